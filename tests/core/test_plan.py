"""HashPlan: multipliers, the prime chain, offsets, pad compression, and the n-gram hash.

Expectations are derived independently of the package:
  * multipliers: numpy's default_rng called here with the reference's formula;
  * primes: a slow chain in this file with trial division;
  * is_prime: trial division and literature values (with their factorizations checked here);
  * rows: a pure-Python-int implementation of DESIGN.md 1.1-1.4 (wrapping int64 products,
    xor, Python's floored %), plus the fast path pinned bit-equal to the numpy oracle.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engram_stream import EngramConfig, HashPlan
from engram_stream import _hash
from engram_stream.config import min_chain_rows
from engram_stream.engine._window import HashWindow
from engram_stream.errors import LayerError
from engram_stream.variants import is_prime
from engram_stream import variants
from helpers.processes import run_python
from pyref import py_rows, to_signed

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cfg_of(evs=(11, 13), n_head=2, layers=(0, 3), vocab=50, pad=2, seed=0, **kw):
    n = len(evs) + 1
    return EngramConfig(engram_vocab_size=list(evs), max_ngram_size=n, n_embed_per_ngram=2 * n_head,
                        n_head_per_ngram=n_head, layer_ids=list(layers), pad_id=pad, seed=seed,
                        kernel_size=kw.get("kernel_size", 2), hidden_size=kw.get("hidden_size", 4),
                        hc_mult=kw.get("hc_mult", 1), vocab_size=vocab)


# --- independent helpers ------------------------------------------------------------------------

def trial_division_is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def slow_prime_chain(evs, n_head, layers):
    """DESIGN.md 1.3, written out: {layer: [[p]*n_head per order]}, one global seen set."""
    seen, out = set(), {}
    for L in layers:
        orders = []
        for v in evs:
            start, heads = v - 1, []
            for _ in range(n_head):
                c = start + 1
                while not (trial_division_is_prime(c) and c not in seen):
                    c += 1
                seen.add(c)
                heads.append(c)
                start = c
            orders.append(heads)
        out[L] = orders
    return out


def expected_multipliers(seed, layer, n_max, compressed_vocab):
    half = max(1, (I64_MAX // compressed_vocab) // 2)
    r = np.random.default_rng(seed + 10007 * layer).integers(0, half, size=n_max, dtype=np.int64)
    return r * 2 + 1


def surjective_lookup(vocab, m, seed):
    """A dense compression table over `vocab` ids using exactly the values 0..m-1."""
    rng = np.random.default_rng(seed)
    vals = np.concatenate([np.arange(m), rng.integers(0, m, vocab - m)])
    return rng.permutation(vals).astype(np.int64)


# --- multipliers --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_multipliers_identity(seed):
    cfg = cfg_of(evs=(11, 13, 17), layers=(1, 15, 0), vocab=129280, seed=seed)
    plan = HashPlan(cfg)
    assert plan.compressed_vocab == 129280
    for L in (1, 15, 0):
        m = plan.multipliers[L]
        assert m.dtype == np.int64 and m.shape == (4,)
        np.testing.assert_array_equal(m, expected_multipliers(seed, L, 4, 129280))
        assert np.all(m % 2 == 1)
        half = (I64_MAX // 129280) // 2
        assert np.all(m >= 1) and np.all(m <= 2 * (half - 1) + 1)


def test_multipliers_demo_defaults():
    plan = HashPlan(EngramConfig())
    for L in (1, 15):
        np.testing.assert_array_equal(plan.multipliers[L], expected_multipliers(0, L, 3, 129280))


@pytest.mark.parametrize("m", [1, 7, 33])
def test_multipliers_with_compression_use_compressed_vocab(m):
    cfg = cfg_of(vocab=50, layers=(2, 5))
    lookup = surjective_lookup(50, m, seed=m)
    plan = HashPlan(cfg, compression=lookup)
    assert plan.compressed_vocab == m                     # max(lookup) + 1
    for L in (2, 5):
        np.testing.assert_array_equal(plan.multipliers[L], expected_multipliers(0, L, 3, m))
    if m != 50:  # and they differ from the identity draw (different half)
        ident = HashPlan(cfg)
        assert not np.array_equal(ident.multipliers[2], plan.multipliers[2])


def test_multipliers_half_floor_is_one_when_vocab_huge():
    # compressed_vocab > INT64_MAX // 2 makes (INT64_MAX // V) // 2 == 0 -> half = 1 -> all ones
    # (the formula's corner; a config's vocab_size is bounded far below it)
    cfg = cfg_of(vocab=50, pad=0)
    mult = variants.get(variants.DEFAULT).draw_multipliers(cfg, (1 << 62) + 1)
    for L in cfg.layer_ids:
        np.testing.assert_array_equal(mult[L], np.ones(3, np.int64))


def test_injected_multipliers_kept_bit_exact():
    cfg = cfg_of()
    inj = {0: np.array([I64_MAX, I64_MIN, -1], np.int64), 3: np.array([2, 0, 4], np.int64)}
    plan = HashPlan(cfg, multipliers=inj)
    for L in (0, 3):
        assert plan.multipliers[L].dtype == np.int64
        np.testing.assert_array_equal(plan.multipliers[L], inj[L])


def test_injected_uint64_multipliers_are_reinterpreted():
    cfg = cfg_of()
    u = {0: np.array([(1 << 64) - 1, 1 << 63, 3], np.uint64), 3: np.array([5, 7, (1 << 63) + 5], np.uint64)}
    plan = HashPlan(cfg, multipliers=u)
    np.testing.assert_array_equal(plan.multipliers[0], np.array([-1, I64_MIN, 3], np.int64))
    np.testing.assert_array_equal(plan.multipliers[3], np.array([5, 7, I64_MIN + 5], np.int64))


@pytest.mark.parametrize("bad,exc", [
    ({0: np.array([1, 3, 5])}, ValueError),                                      # missing layer
    ({0: np.array([1, 3, 5]), 3: np.array([1, 3, 5]), 4: np.array([1, 3, 5])}, ValueError),  # extra
    ({0: np.array([1, 3]), 3: np.array([1, 3, 5])}, ValueError),                 # too short
    ({0: np.array([1, 3, 5, 7]), 3: np.array([1, 3, 5])}, ValueError),           # too long
    ({0: np.array([[1, 3, 5]]), 3: np.array([1, 3, 5])}, ValueError),            # 2-d
    ({0: np.array([1.0, 3.0, 5.0]), 3: np.array([1, 3, 5])}, TypeError),         # float dtype
    ({0: np.array([True, True, True]), 3: np.array([1, 3, 5])}, TypeError),      # bool dtype
    ([np.array([1, 3, 5]), np.array([1, 3, 5])], TypeError),                     # not a dict
])
def test_injected_multipliers_rejected(bad, exc):
    with pytest.raises(exc):
        HashPlan(cfg_of(), multipliers=bad)


# --- primes -----------------------------------------------------------------------------------

PRIME_CFGS = [
    dict(evs=(11, 13), n_head=2, layers=(0, 3)),
    dict(evs=(10, 10), n_head=3, layers=(0, 1, 2)),             # duplicate vocab sizes across orders
    dict(evs=(50, 20, 20, 50), n_head=4, layers=(7, 2)),        # decreasing then equal again
    dict(evs=(2, 2), n_head=5, layers=(4, 9, 1)),               # smallest possible start
    dict(evs=(1000, 1000, 999), n_head=8, layers=(1, 15)),
    dict(evs=(646400, 646400), n_head=8, layers=(1, 15)),       # the demo
]


@pytest.mark.parametrize("kw", PRIME_CFGS)
def test_primes_match_slow_chain(kw):
    cfg = cfg_of(**kw)
    plan = HashPlan(cfg)
    want = slow_prime_chain(kw["evs"], kw["n_head"], kw["layers"])
    assert set(plan.primes) == set(kw["layers"])
    for L in kw["layers"]:
        got = [[int(p) for p in heads] for heads in plan.primes[L]]
        assert got == want[L], L
    flat = [p for L in kw["layers"] for heads in want[L] for p in heads]
    assert len(set(flat)) == len(flat)                            # globally distinct


def test_primes_hand_values():
    # evs (10, 10), 3 heads, layers [0, 1]: primes above 9 in order, never reused
    plan = HashPlan(cfg_of(evs=(10, 10), n_head=3, layers=(0, 1)))
    assert plan.primes[0] == [[11, 13, 17], [19, 23, 29]]
    assert plan.primes[1] == [[31, 37, 41], [43, 47, 53]]
    # order with a larger start after a smaller one: (20, 10) -> order 3 starts at 9 again
    plan = HashPlan(cfg_of(evs=(20, 10), n_head=2, layers=(5,)))
    assert plan.primes[5] == [[23, 29], [11, 13]]


@pytest.mark.parametrize("kw", PRIME_CFGS[:4])
def test_offsets_are_exclusive_cumsum(kw):
    plan = HashPlan(cfg_of(**kw))
    for L in kw["layers"]:
        flat = [p for heads in slow_prime_chain(kw["evs"], kw["n_head"], kw["layers"])[L] for p in heads]
        want, acc = [], 0
        for p in flat:
            want.append(acc)
            acc += p
        assert plan.offsets[L].dtype == np.int64
        assert plan.offsets[L].tolist() == want
        assert plan.table_rows[L] == acc


def test_is_prime_vs_trial_division():
    for n in range(-50, 20000):
        assert is_prime(n) == trial_division_is_prime(n), n


KNOWN_PRIMES = [2, 3, 41, 43, 65537, 1_000_000_007, 998_244_353, 2**31 - 1, 2**61 - 1,
                2**63 - 25, 2**64 - 59, 1_000_000_000_000_000_003]


@pytest.mark.parametrize("p", KNOWN_PRIMES)
def test_is_prime_known_primes(p):
    assert is_prime(p)


# composites as explicit factorizations (the product is computed here, so each is composite)
COMPOSITES = [
    (3, 11, 17), (5, 13, 17), (7, 13, 19), (5, 17, 29), (7, 31, 73),          # Carmichael 561..
    (7, 13, 31, 61), (7, 23, 41, 53, 5),                   # Carmichael 172081; a 5-factor composite
    (41, 101, 7, 13, 11), (6763, 10627, 29947),                                 # Carmichael 2152302898747
    (149491, 747451, 34233211),            # 3825123056546413051: strong pseudoprime to bases 2..23
    (1373653 // 829, 829), (2047 // 23, 23), (3215031751 // 151, 151),          # spsp(2), spsp(2,3,5,7)
    (2**31 - 1, 2**31 - 1), (1_000_003, 1_000_003), (65537, 65537), (41, 41), (43, 43),   # prime squares
    (2**31 - 1, 2**61 - 1), (2**61 - 1, 3), (1_000_000_007, 998_244_353),
    (399165290221, 798330580441),          # 318665857834031151167461: spsp to bases 2..37
]


@pytest.mark.parametrize("factors", COMPOSITES, ids=[str(math.prod(f)) for f in COMPOSITES])
def test_is_prime_known_composites(factors):
    n = math.prod(factors)
    assert all(f > 1 for f in factors) and len(factors) >= 2
    assert not is_prime(n)


def test_is_prime_carmichael_numbers_by_trial_division():
    # the first Carmichael numbers (each composite with a^(n-1) = 1 mod n for gcd(a, n) = 1)
    for n in (561, 1105, 1729, 2465, 2821, 6601, 8911, 10585, 15841, 29341, 41041, 46657,
              52633, 62745, 63973, 75361, 101101, 115921, 126217, 162401, 172081, 188461):
        assert not trial_division_is_prime(n)
        assert pow(2, n - 1, n) == 1 or math.gcd(2, n) != 1
        assert not is_prime(n), n


# --- pad id -----------------------------------------------------------------------------------

def test_pad_identity_and_compressed():
    cfg = cfg_of(vocab=50, pad=7)
    assert HashPlan(cfg).pad_id == 7
    lookup = surjective_lookup(50, 9, seed=1)
    assert HashPlan(cfg, compression=lookup).pad_id == int(lookup[7])


def test_pad_is_used_for_positions_before_start():
    # multipliers (0, 1, 0): order-2 mix = w0*0 ^ w1*1 = w1, which is the compressed pad at t=0
    cfg = cfg_of(evs=(1000, 1000), n_head=1, layers=(0,), vocab=50, pad=7)
    lookup = np.arange(50, dtype=np.int64)[::-1].copy()      # a permutation: 7 -> 42
    plan = HashPlan(cfg, compression=lookup, multipliers={0: np.array([0, 1, 0], np.int64)})
    ids = np.array([[3, 4, 5]])
    for rows in (plan.hash(ids)[0], plan.hash_numpy(ids)[0]):
        # head 0 (order 2): mix = w1 -> [pad, c(3), c(4)] = [42, 46, 45]
        assert rows[0, :, 0].tolist() == [42, 46, 45]


# --- the hash: hand case with Python ints -----------------------------------------------------

def test_hash_tiny_hand_case():
    cfg = cfg_of(evs=(5, 7), n_head=2, layers=(0,), vocab=6, pad=1)
    # primes: order 2 -> 5, 7 ; order 3 -> 11, 13 (7 taken)
    mult = np.array([3, 5, 7], np.int64)
    plan = HashPlan(cfg, multipliers={0: mult})
    assert plan.primes[0] == [[5, 7], [11, 13]]
    ids = np.array([[2, 4, -3]])
    # t=0: w=(2,1,1): m2 = 6^5 = 3 ; m3 = 3^7 = 4
    # t=1: w=(4,2,1): m2 = 12^10 = 6 ; m3 = 6^7 = 1
    # t=2: w=(-3,4,2): m2 = -9^20 = -29 ; m3 = -29^14 = -19  (two's complement xor)
    assert (-9 ^ 20) == -29 and (-29 ^ 14) == -19
    want = [[[3 % 5, 3 % 7, 4 % 11, 4 % 13],
             [6 % 5, 6 % 7, 1 % 11, 1 % 13],
             [-29 % 5, -29 % 7, -19 % 11, -19 % 13]]]
    assert want == [[[3, 3, 4, 4], [1, 6, 1, 1], [1, 6, 3, 7]]]
    assert plan.hash(ids)[0].tolist() == want
    assert plan.hash_numpy(ids)[0].tolist() == want
    assert py_rows(ids, None, 1, mult, plan.primes[0]) == want


def test_hash_wrapping_hand_case():
    cfg = cfg_of(evs=(11, 13), n_head=1, layers=(0,), vocab=10, pad=0)
    mult = np.array([I64_MAX, I64_MIN, -1], np.int64)
    plan = HashPlan(cfg, multipliers={0: mult})
    p2, p3 = plan.primes[0][0][0], plan.primes[0][1][0]
    assert (p2, p3) == (11, 13)
    ids = np.array([[3, 5]])
    # t=0: w=(3,0,0): 3*(2^63-1) mod 2^64 = 2^63-3 (as signed: 9223372036854775805)
    a0 = 3 * I64_MAX - (1 << 64)
    assert a0 == (1 << 63) - 3
    # t=1: w=(5,3,0): 5*(2^63-1) = 2^63 - 5 + 2*2^64 -> signed -(5) + 2^63 -> 2^63-5 ; 3*(-2^63) -> -2^63
    a1, b1 = to_signed(5 * I64_MAX), to_signed(3 * I64_MIN)
    assert a1 == (1 << 63) - 5 and b1 == I64_MIN
    m1 = to_signed(a1 ^ b1)                                 # flips the sign bit: -5
    assert m1 == -5
    want = [[[a0 % 11, a0 % 13], [m1 % 11, m1 % 13]]]
    assert plan.hash(ids)[0].tolist() == want
    assert plan.hash_numpy(ids)[0].tolist() == want


# --- the hash: fast == numpy oracle == Python ints (hypothesis) --------------------------------

EXTREME_MULTS = [I64_MAX, I64_MIN, I64_MIN + 1, I64_MAX - 1, -1, 0, 1, 2, 1 << 62, -(1 << 62), 3]


@st.composite
def hash_case(draw):
    n_max = draw(st.integers(2, 5))
    n_head = draw(st.integers(1, 3))
    evs = [draw(st.integers(2, 2000)) for _ in range(n_max - 1)]
    n_layers = draw(st.integers(1, 3))
    layers = draw(st.lists(st.integers(0, 60), min_size=n_layers, max_size=n_layers, unique=True))
    vocab = draw(st.integers(1, 300))
    pad = draw(st.integers(0, vocab - 1))
    seed = draw(st.integers(0, 1000))
    cfg = EngramConfig(engram_vocab_size=evs, max_ngram_size=n_max, n_embed_per_ngram=n_head,
                       n_head_per_ngram=n_head, layer_ids=layers, pad_id=pad, seed=seed,
                       kernel_size=2, hidden_size=2, hc_mult=1, vocab_size=vocab)
    lookup = None
    if draw(st.booleans()):
        m = draw(st.integers(1, vocab))
        lookup = surjective_lookup(vocab, m, draw(st.integers(0, 2**32)))
    mults = None
    kind = draw(st.sampled_from(["drawn", "int64", "uint64"]))
    if kind == "int64":
        el = st.one_of(st.sampled_from(EXTREME_MULTS), st.integers(I64_MIN, I64_MAX))
        mults = {L: np.array(draw(st.lists(el, min_size=n_max, max_size=n_max)), np.int64) for L in layers}
    elif kind == "uint64":
        el = st.one_of(st.sampled_from([(1 << 64) - 1, 1 << 63, (1 << 63) + 1, 2, 0]),
                       st.integers(0, (1 << 64) - 1))
        mults = {L: np.array(draw(st.lists(el, min_size=n_max, max_size=n_max)), np.uint64) for L in layers}
    B = draw(st.integers(0, 3))
    T = draw(st.integers(0, 8))
    id_el = st.one_of(st.integers(0, vocab - 1), st.sampled_from([vocab - 1, 0, -1, I64_MIN, -vocab]),
                      st.integers(I64_MIN, -1))
    ids = np.array(draw(st.lists(id_el, min_size=B * T, max_size=B * T)), dtype=np.int64).reshape(B, T)
    return cfg, lookup, mults, ids


@SETTINGS
@given(hash_case())
def test_hash_fast_equals_numpy_and_python(case):
    cfg, lookup, mults, ids = case
    plan = HashPlan(cfg, compression=lookup, multipliers=mults)
    ids_before = ids.copy()
    fast, slow = plan.hash(ids), plan.hash_numpy(ids)
    np.testing.assert_array_equal(ids, ids_before)                  # input not modified
    B, T = ids.shape
    assert set(fast) == set(slow) == set(cfg.layer_ids)
    pad = cfg.pad_id if lookup is None else int(lookup[cfg.pad_id])
    for L in cfg.layer_ids:
        assert fast[L].dtype == np.int64 and fast[L].shape == (B, T, cfg.n_heads)
        assert slow[L].dtype == np.int64 and slow[L].shape == (B, T, cfg.n_heads)
        np.testing.assert_array_equal(fast[L], slow[L])
        mult = mults[L] if mults is not None else expected_multipliers(
            cfg.seed, L, cfg.max_ngram_size, cfg.vocab_size if lookup is None else int(lookup.max()) + 1)
        want = py_rows(ids, lookup, pad, mult, slow_prime_chain(cfg.engram_vocab_size, cfg.n_head_per_ngram,
                                                                 cfg.layer_ids)[L])
        assert fast[L].tolist() == want
        # rows are in [0, prime) for every head
        primes = np.array([p for h in plan.primes[L] for p in h], np.int64)
        assert np.all(fast[L] >= 0) and np.all(fast[L] < primes)


@SETTINGS
@given(hash_case(), st.data())
def test_hash_layer_subset_and_out_buffers(case, data):
    cfg, lookup, mults, ids = case
    plan = HashPlan(cfg, compression=lookup, multipliers=mults)
    full = plan.hash_numpy(ids)
    sub = data.draw(st.lists(st.sampled_from(cfg.layer_ids), min_size=1, unique=True))
    got = plan.hash(ids, layers=sub)
    assert list(got) == sub
    out = {L: np.full(ids.shape + (cfg.n_heads,), -7, np.int64) for L in sub}
    got2 = plan.hash(ids, layers=sub, out=out)
    for L in sub:
        np.testing.assert_array_equal(got[L], full[L])
        assert got2[L] is out[L]
        np.testing.assert_array_equal(out[L], full[L])
    np.testing.assert_array_equal(plan.hash_numpy(ids, layers=sub)[sub[0]], full[sub[0]])


def test_hash_shapes_edge_cases():
    cfg = cfg_of(evs=(11, 13, 17, 19), n_head=2, layers=(0,), vocab=30)
    plan = HashPlan(cfg)
    for shape in [(0, 0), (0, 5), (3, 0), (1, 1), (2, 3), (1, 4)]:
        ids = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 30
        f, s = plan.hash(ids)[0], plan.hash_numpy(ids)[0]
        assert f.shape == s.shape == shape + (8,)
        np.testing.assert_array_equal(f, s)
        if ids.size:
            assert f.tolist() == py_rows(ids, None, 2, plan.multipliers[0], plan.primes[0])


def test_hash_accepts_lists_and_other_int_dtypes():
    plan = HashPlan(cfg_of(vocab=300))
    ref = plan.hash_numpy(np.array([[1, 2, 255, 0]], np.int64))
    for ids in ([[1, 2, 255, 0]], np.array([[1, 2, 255, 0]], np.uint8), np.array([[1, 2, 255, 0]], np.int32),
                np.array([[1, 2, 255, 0]], np.uint64), np.asfortranarray(np.array([[1, 2, 255, 0]]))):
        for fn in (plan.hash, plan.hash_numpy):
            got = fn(ids)
            for L in ref:
                np.testing.assert_array_equal(got[L], ref[L])


# --- floored mod kernels -------------------------------------------------------------------------

MOD_X = [I64_MIN, I64_MIN + 1, I64_MAX, I64_MAX - 1, -1, 0, 1, -2, 2, (1 << 62), -(1 << 62),
         (1 << 32) - 1, -(1 << 32)]
DIVISORS = [1, 2, 3, 5, 7, 11, 13, 646403, 2**31 - 1, 2**32 + 15, 2**61 - 1, 2**62 + 135, 2**63 - 25]


@pytest.mark.parametrize("reciprocal", [False, True])
def test_floormod_extremes_and_random(reciprocal):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(MOD_X, np.int64),
                        rng.integers(I64_MIN, I64_MAX, 2000, dtype=np.int64, endpoint=True),
                        rng.integers(-1000, 1000, 200, dtype=np.int64)])
    primes = np.array(DIVISORS + [int(v) for v in rng.integers(1, I64_MAX, 20, dtype=np.int64)], np.int64)
    got = _hash.floormod(x, primes, reciprocal=reciprocal)
    assert got.shape == (x.size, primes.size) and got.dtype == np.int64
    want = [[int(a) % int(p) for p in primes] for a in x]            # Python ints: floored
    assert got.tolist() == want
    np.testing.assert_array_equal(got, x[:, None] % primes[None, :])  # numpy's % agrees too


@pytest.mark.parametrize("reciprocal", [False, True])
def test_floormod_divisor_int64_max(reciprocal):
    x = np.array(MOD_X, np.int64)
    got = _hash.floormod(x, np.array([I64_MAX], np.int64), reciprocal=reciprocal)
    assert got[:, 0].tolist() == [int(a) % I64_MAX for a in x]


@pytest.mark.parametrize("bad", [[0], [5, -3], [I64_MIN], list(range(1, 258))])
def test_floormod_rejects_bad_divisors(bad):
    with pytest.raises(ValueError):
        _hash.floormod(np.zeros(3, np.int64), np.array(bad, np.int64))


def test_floormod_empty():
    assert _hash.floormod(np.zeros(0, np.int64), np.array([3], np.int64)).shape == (0, 1)
    assert _hash.floormod(np.zeros(4, np.int64), np.zeros(0, np.int64)).shape == (4, 0)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_comp", [False, True])
@pytest.mark.parametrize("bad", [50, 51, I64_MAX])
def test_ids_out_of_vocab_raise_and_corrupt_nothing(with_comp, bad):
    cfg = cfg_of(vocab=50, layers=(0, 3))
    lookup = surjective_lookup(50, 20, seed=2) if with_comp else None
    plan = HashPlan(cfg, compression=None if lookup is None else lookup.copy())
    good = np.array([[1, 2, 3, 49]], np.int64)
    before = plan.hash_numpy(good)
    mult_before = {L: m.copy() for L, m in plan.multipliers.items()}
    ids = np.array([[1, 2, bad, 4], [5, 6, 7, 8]], np.int64)
    ids_before = ids.copy()
    out = {L: np.full((2, 4, cfg.n_heads), -7, np.int64) for L in cfg.layer_ids}
    with pytest.raises(ValueError, match="vocab"):
        plan.hash(ids, out=out)
    with pytest.raises(ValueError, match="vocab"):
        plan.hash(ids)
    with pytest.raises(ValueError, match="vocab"):
        plan.hash_numpy(ids)
    with pytest.raises(ValueError, match="vocab"):
        plan.compress(ids)
    np.testing.assert_array_equal(ids, ids_before)
    for L in cfg.layer_ids:
        assert np.all(out[L] == -7)                      # no partial writes into out buffers
        np.testing.assert_array_equal(plan.multipliers[L], mult_before[L])
    if lookup is not None:
        np.testing.assert_array_equal(plan.lookup, lookup)
    after, after_fast = plan.hash_numpy(good), plan.hash(good)
    for L in cfg.layer_ids:
        np.testing.assert_array_equal(after[L], before[L])
        np.testing.assert_array_equal(after_fast[L], before[L])


def test_uint64_ids_past_int64_rejected():
    plan = HashPlan(cfg_of())
    ids = np.array([[1, (1 << 63) + 3]], np.uint64)
    for fn in (plan.hash, plan.hash_numpy):
        with pytest.raises(ValueError):
            fn(ids)


@pytest.mark.parametrize("ids", [np.array([[1.0, 2.0]]), np.array([[1, 2]], np.float32),
                                 np.array([[True, False]]), np.array([["a", "b"]]),
                                 np.array([[1, None]], dtype=object)])
def test_non_integer_ids_type_error(ids):
    plan = HashPlan(cfg_of())
    for fn in (plan.hash, plan.hash_numpy):
        with pytest.raises(TypeError):
            fn(ids)


@pytest.mark.parametrize("ids", [np.array([1, 2, 3]), np.array(3), np.zeros((1, 2, 3), np.int64)])
def test_wrong_ndim(ids):
    plan = HashPlan(cfg_of())
    for fn in (plan.hash, plan.hash_numpy):
        with pytest.raises(ValueError):
            fn(ids)


def test_unknown_layer_key_error():
    plan = HashPlan(cfg_of(layers=(0, 3)))
    ids = np.array([[1, 2]])
    for fn in (plan.hash, plan.hash_numpy):
        with pytest.raises(KeyError):
            fn(ids, layers=[99])
        with pytest.raises(KeyError):
            fn(ids, layers=[0, 1])


@pytest.mark.parametrize("buf", [
    np.zeros((1, 2, 4), np.int32),                 # dtype
    np.zeros((1, 2, 5), np.int64),                 # shape
    np.zeros((2, 1, 4), np.int64),                 # shape
    np.zeros((1, 2, 8), np.int64)[:, :, ::2],      # not contiguous
    "readonly",
    [[[0] * 4] * 2],                               # not an ndarray
])
def test_out_buffer_rejected(buf):
    plan = HashPlan(cfg_of(layers=(0, 3)))
    if isinstance(buf, str):
        buf = np.zeros((1, 2, 4), np.int64)
        buf.flags.writeable = False
    with pytest.raises(ValueError):
        plan.hash(np.array([[1, 2]]), out={0: buf})


def test_out_buffer_partial_dict_allocates_the_rest():
    plan = HashPlan(cfg_of(layers=(0, 3)))
    ids = np.array([[1, 2, 7]])
    buf = np.zeros((1, 3, 4), np.int64)
    got = plan.hash(ids, out={3: buf})
    assert got[3] is buf
    ref = plan.hash_numpy(ids)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(buf, ref[3])


def test_out_not_a_dict_rejected_cleanly():
    plan = HashPlan(cfg_of(layers=(0,)))
    with pytest.raises((TypeError, ValueError)):
        plan.hash(np.array([[1, 2]]), out=np.zeros((1, 2, 4), np.int64))


# --- compression tables ---------------------------------------------------------------------

@pytest.mark.parametrize("table,exc", [
    (np.arange(49), ValueError),                                   # too short
    (np.arange(51) % 50, ValueError),                              # too long
    (np.arange(50).reshape(5, 10), ValueError),                    # 2-d
    (np.r_[-1, np.arange(49)], ValueError),                        # negative
    (np.r_[0, 2, np.zeros(48, int)], ValueError),                  # gap: 1 never used
    (np.r_[np.arange(49), 60], ValueError),                        # max >= vocab (gap)
    (np.arange(50) * 2 % 50, ValueError),                          # only evens: gaps
    (np.arange(50, dtype=np.float64), TypeError),                  # float dtype
    (np.ones(50, dtype=bool), TypeError),                          # bool dtype
    (np.array([str(i) for i in range(50)]), TypeError),            # strings
])
def test_compression_tables_rejected(table, exc):
    with pytest.raises(exc):
        HashPlan(cfg_of(vocab=50), compression=table)


def test_compression_table_accepted_forms():
    cfg = cfg_of(vocab=50)
    t = surjective_lookup(50, 13, seed=5)
    ref = HashPlan(cfg, compression=t)
    for form in (t.astype(np.int32), t.astype(np.uint16), list(t.tolist())):
        p = HashPlan(cfg, compression=form)
        assert p.compressed_vocab == 13 and p.pad_id == int(t[2])
        assert p.lookup.dtype == np.int64
        ids = np.array([[0, 5, 49, -4, 2]])
        for L in cfg.layer_ids:
            np.testing.assert_array_equal(p.hash(ids)[L], ref.hash_numpy(ids)[L])


def test_compress_negative_pass_through():
    cfg = cfg_of(vocab=50)
    t = surjective_lookup(50, 13, seed=6)
    plan = HashPlan(cfg, compression=t)
    ids = np.array([[-1, 0, 49, I64_MIN, 7]])
    assert plan.compress(ids).tolist() == [[-1, int(t[0]), int(t[49]), I64_MIN, int(t[7])]]


def test_max_ngram_above_fast_path_limit_is_consistent():
    try:
        cfg = EngramConfig(engram_vocab_size=[11] * 64, max_ngram_size=65, n_embed_per_ngram=1,
                           n_head_per_ngram=1, layer_ids=[0], pad_id=0, vocab_size=20, hidden_size=2,
                           hc_mult=1, kernel_size=2)
    except ValueError:
        return                                             # rejected up front: consistent
    plan = HashPlan(cfg)
    ids = np.array([[1, 2, 3]])
    np.testing.assert_array_equal(plan.hash(ids)[0], plan.hash_numpy(ids)[0])


def test_hashplan_requires_config():
    with pytest.raises(TypeError):
        HashPlan({"vocab_size": 10})


# --- the two mod paths of the C hash: double-precision (p < 2^21) and division --------------

@pytest.mark.parametrize("vocab, n_head, fp", [
    ([97, 2003], 6, True),                   # 4 lanes + 2 scalar tail heads
    ([(1 << 21) - 20, 50021], 5, False),     # the prime chain crosses 2^21: division path
    ([(1 << 40) + 15, 3], 4, False),         # huge primes
])
def test_fp_and_division_mod_paths(vocab, n_head, fp):
    cfg = EngramConfig(engram_vocab_size=vocab, max_ngram_size=3, n_embed_per_ngram=n_head, n_head_per_ngram=n_head,
                       layer_ids=[0, 1], pad_id=3, vocab_size=1 << 20, hidden_size=2, hc_mult=1, kernel_size=2)
    mult = {0: np.array([I64_MAX, -3, I64_MIN + 7], np.int64), 1: np.array([-1, 2**62 + 1, 5], np.int64)}
    for m in (None, mult):
        plan = HashPlan(cfg, multipliers=m)
        assert (plan.head_fp[0] is not None) == fp
        ids = np.random.default_rng(1).integers(-(1 << 40), 1 << 20, (2, 300))
        got, ref = plan.hash(ids), plan.hash_numpy(ids)
        for L in cfg.layer_ids:
            np.testing.assert_array_equal(got[L], ref[L])
            assert got[L][:, :5].tolist() == py_rows(ids[:, :5], None, 3, plan.multipliers[L], plan.primes[L])


# --- the batch hash runs the variant's window class -----------------------------------------------
def test_hash_batch_validates_its_arguments():
    plan = HashPlan(EngramConfig())
    w = HashWindow.of_plan(plan, plan.cfg.layer_ids[0])
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    for shape in ((1, 6, 16), (2, 2, 16), (2, 6, 15)):  # too few rows, positions, heads
        with pytest.raises(ValueError, match="out must have shape"):
            w.hash_batch(ids, np.zeros(shape, np.int64))
    bad = ids.copy()
    bad[1, 3] = plan.cfg.vocab_size
    with pytest.raises(ValueError, match=f"token id {plan.cfg.vocab_size} out of range"):
        w.hash_batch(bad, np.zeros((2, 6, 16), np.int64))
    with pytest.raises(LayerError):
        HashWindow.of_plan(plan, 99)
    n = plan.cfg.max_ngram_size
    for wins, b0 in ((np.zeros((n, 12 + 7), np.int64), 0),   # no room for the last vector's lanes
                     (np.zeros((n + 1, 20), np.int64), 0),   # not n window rows
                     (np.zeros((n, 20), np.int64), 1)):      # rows past its end
        with pytest.raises(ValueError, match="wins must be"):
            w.windows_batch(ids, wins, b0)
        with pytest.raises(ValueError, match="wins"):
            w.hash_windows(wins, np.zeros((2, 6, 16), np.int64), b0)
    wins = w.windows_batch(ids, np.zeros((n, 20), np.int64))   # the pieces equal hash_batch
    np.testing.assert_array_equal(w.hash_windows(wins, np.zeros((2, 6, 16), np.int64)),
                                  plan.hash_numpy(ids)[plan.cfg.layer_ids[0]])


def test_a_plan_pickles_after_hashing():
    import pickle
    plan = HashPlan(EngramConfig())
    ids = np.arange(40, dtype=np.int64).reshape(2, 20)
    want = plan.hash(ids)
    again = pickle.loads(pickle.dumps(plan))
    assert again._windows == {} and plan._windows
    for L, rows in again.hash(ids).items():
        np.testing.assert_array_equal(rows, want[L])


def test_hash_runs_the_window_class_the_variant_names():
    """A variant that names another window class (here Qwen's separator rule on the demo's hash)
    gets that rule in plan.hash, with no shared file changed: its numpy oracle agrees, the demo's
    plain rule does not."""
    from engram_stream.qwen._engine import SeparatorWindow
    from engram_stream.qwen.variant import QwenVariant

    class SepDemo(type(variants.get(variants.DEFAULT))):
        name = "sep-demo-test"
        window_class = SeparatorWindow
        windows = QwenVariant.windows

    variants.register(SepDemo())
    try:
        cfg = EngramConfig(variant="sep-demo-test", pad_id=5)
        plan, plain = HashPlan(cfg), HashPlan(EngramConfig(pad_id=5))
        assert plan.history == "separator"
        ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, 150))
        ids[:, ::7] = 5
        got, want, other = plan.hash(ids), plan.hash_numpy(ids), plain.hash(ids)
        for L in cfg.layer_ids:
            assert type(plan._windows[L]) is SeparatorWindow
            np.testing.assert_array_equal(got[L], want[L])
            assert (got[L] != other[L]).any()
    finally:
        variants.unregister("sep-demo-test")


def test_compress_validates_the_lookup_length():
    ids = np.array([[0, 9, 99]], np.int64)
    with pytest.raises(ValueError, match="lookup"):
        _hash.compress(ids, np.zeros(10, np.int64), 100)    # ids up to 99 would read past 10 entries
    assert _hash.compress(ids, np.arange(100, dtype=np.int64), 100).tolist() == [[0, 9, 99]]


def test_hash_in_a_forked_child_after_the_pool_started():
    """plan.hash's thread pool does not survive fork (its threads stay in the parent): the
    child must get a fresh pool, not wait forever on workers that do not exist."""
    script = r"""
import os, sys, time
import numpy as np
from engram_stream import EngramConfig, HashPlan
from engram_stream import plan as plan_mod
cfg = EngramConfig(engram_vocab_size=[1009, 1013], layer_ids=[1, 2], vocab_size=5000, hidden_size=8, hc_mult=1,
                   n_embed_per_ngram=8, n_head_per_ngram=2)
p = HashPlan(cfg)
plan_mod._hash_workers = lambda: 2      # a pool even on a 1-core runner
ids = np.random.default_rng(0).integers(0, 5000, (4, plan_mod.PARALLEL_MIN_POSITIONS))
want = p.hash(ids)                      # starts the pool
assert plan_mod._POOL is not None
pid = os.fork()
if pid == 0:
    got = p.hash(ids)
    os._exit(0 if all(np.array_equal(got[L], want[L]) for L in want) else 3)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
os.waitpid(pid, 0)
sys.exit("the child hung in plan.hash")
"""
    r = run_python(["-c", script], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("evs, n_head, layers", [([2, 2], 5, [0, 3, 7]), ([97, 2003, 97], 6, [1, 2]),
                                                 ([646400, 646400], 8, [1, 15]), ([1 << 40, 3], 4, [5])])
def test_min_chain_rows_is_a_lower_bound(evs, n_head, layers):
    """load() refuses tables smaller than this bound before the prime search: it must never
    exceed the real chain's rows (per layer, and over all layers)."""
    cfg = EngramConfig(engram_vocab_size=evs, max_ngram_size=len(evs) + 1, n_embed_per_ngram=n_head,
                       n_head_per_ngram=n_head, layer_ids=layers, vocab_size=50, hidden_size=2, hc_mult=1)
    rows = HashPlan(cfg).table_rows
    assert min_chain_rows(cfg) <= min(rows.values())
    assert min_chain_rows(cfg, len(layers)) <= sum(rows.values())
    assert min_chain_rows(cfg) >= n_head * sum(evs)               # and not a trivial bound


# --- configs whose prime sums would wrap int64 ----------------------------------------------------

WRAPPING = {
    "demo [2**60]*2": dict(engram_vocab_size=[2 ** 60, 2 ** 60]),          # 8 heads x 2 orders x 2**60 per layer
    "v41 2**64//6": dict(variant="deepseek-v4.1", engram_vocab_size=[2 ** 64 // 6] * 3, max_ngram_size=4,
                         n_embed_per_ngram=64, n_head_per_ngram=2, hidden_size=64, pad_id=2, vocab_size=300,
                         image_token_id=299),
}


@pytest.mark.parametrize("case", list(WRAPPING))
def test_configs_whose_prime_sum_passes_int64_are_refused(case):
    """A layer's primes sum to its table rows; past int64 the sum wrapped (to 708 rows in one
    case) and a step read row ~3e18 (SIGSEGV). Refused by the config itself, naming the bound,
    never with a wrapped (negative) number."""
    import re
    with pytest.raises(ValueError, match="int64") as e:
        EngramConfig(**WRAPPING[case])
    assert not re.search(r"-\d", str(e.value)), e.value


def test_a_chain_past_the_bound_found_by_the_search_is_refused_by_the_plan():
    """The config's check is a lower bound (cheap, before the search); the plan checks the real
    sums (Python ints) once the search has found them."""
    # 2 heads of order 2 from 2**62 - 2: the least chain (2**63 - 3) fits int64, the real one
    # does not (2**62 - 2 and 2**62 - 1 are not prime; checked here)
    limit = I64_MAX
    start = (1 << 62) - 2
    cfg = cfg_of(evs=(start,), n_head=2, layers=(0,))
    primes, c = [], start
    while len(primes) < 2:
        if is_prime(c):
            primes.append(c)
        c += 1
    assert sum(primes) > limit      # the real chain passes the bound...
    assert min_chain_rows(cfg) <= limit    # ...the config's least bound does not
    with pytest.raises(ValueError, match="int64"):
        HashPlan(cfg)


def test_hash_out_buffers_must_not_overlap():
    """plan.hash(out={1: buf, 15: buf}) gave layer 1 layer 15's rows: refused."""
    plan = HashPlan(cfg_of())
    ids = np.arange(12).reshape(2, 6) % 50
    buf = np.empty((2, 6, plan.cfg.n_heads), np.int64)
    with pytest.raises(ValueError, match="overlap"):
        plan.hash(ids, out={0: buf, 3: buf})
    big = np.empty((2, 2, 6, plan.cfg.n_heads), np.int64)
    with pytest.raises(ValueError, match="overlap"):
        plan.hash(ids, out={0: big[0], 3: big.reshape(-1)[5:5 + big[0].size].reshape(big[0].shape)})
    got = plan.hash(ids, out={0: big[0], 3: big[1]})   # disjoint slices of one block: fine
    want = plan.hash_numpy(ids)
    assert all(np.array_equal(got[L], want[L]) for L in (0, 3))


# ---- the plan's Variant hooks: head sizes (any modulus), extras, the numpy rows ----------------------------
def test_head_sizes_plan_extras_and_rows_numpy_are_the_variants():
    """A variant's own head sizes (composite and even: the division-free mods serve any modulus),
    its extra per-layer data (held read-only on the plan) and its oracle rows; the default sizes
    are the prime chain."""
    demo = type(variants.get(variants.DEFAULT))
    name = "sizes-toy"
    sizes = np.array([12, 15, 16, 21], np.int64)   # H = 2 orders x 2 heads, none prime

    class SizesToy(demo):
        example_config = dict(demo.example_config, variant=name)

        def head_sizes(self, cfg):
            return {L: sizes for L in cfg.layer_ids}

        def plan_extras(self, cfg, plan):
            return {"toy_extra": {L: np.arange(3) + L for L in cfg.layer_ids}}

    SizesToy.name = name
    variants.register(SizesToy())
    try:
        cfg = EngramConfig(**dict(cfg_of(evs=(11, 13)).to_dict(), variant=name))
        plan = HashPlan(cfg)
        for L in cfg.layer_ids:
            assert plan.head_primes[L].tolist() == sizes.tolist()
            assert plan.offsets[L].tolist() == [0, 12, 27, 43] and plan.table_rows[L] == 64
            assert plan.primes[L] == [[12, 15], [16, 21]]
            assert plan.head_fp[L] is not None   # the double-precision mod's constants, composites too
            assert plan.toy_extra[L].tolist() == [L, L + 1, L + 2] and not plan.toy_extra[L].flags.writeable
        ids = np.random.default_rng(0).integers(-3, cfg.vocab_size, size=(3, 40))
        want = plan.hash_numpy(ids)
        for L in cfg.layer_ids:
            assert (want[L] < sizes).all() and (want[L] >= 0).all()
            np.testing.assert_array_equal(plan.hash(ids)[L], want[L])
        x = np.arange(-1000, 1000, dtype=np.int64) * 7919
        np.testing.assert_array_equal(_hash.floormod(x, sizes, reciprocal=True), x[:, None] % sizes)
    finally:
        variants.unregister(name)
    plain = cfg_of(evs=(11, 13))
    assert HashPlan(plain).head_primes[0].tolist() == [11, 13, 17, 19]   # the default: the prime chain


def test_a_bad_head_sizes_or_a_clashing_extra_is_refused():
    demo = type(variants.get(variants.DEFAULT))
    name = "bad-sizes-toy"
    for hook, match in (("head_sizes", r"Variant.head_sizes gave layer 0"), ("plan_extras", "HashPlan has already")):
        class Bad(demo):
            example_config = dict(demo.example_config, variant=name)
        if hook == "head_sizes":
            Bad.head_sizes = lambda self, cfg: {L: np.array([5, 0, 7, 9]) for L in cfg.layer_ids}
        else:
            Bad.plan_extras = lambda self, cfg, plan: {"offsets": {}}
        Bad.name = name
        variants.register(Bad())
        try:
            cfg = EngramConfig(**dict(cfg_of(evs=(11, 13)).to_dict(), variant=name))
            with pytest.raises(ValueError, match=match):
                HashPlan(cfg)
        finally:
            variants.unregister(name)
