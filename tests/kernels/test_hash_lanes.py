"""The batch hash (the window class's windows, then the position-vectorized kernel
es_hash_windows) and the division-free mod, at their edges.

The windows are made in blocks of 64 positions (HashWindow.fill_windows); the kernel hashes blocks
of positions in vector lanes (2, 4 or 8 per vector by path) and splits every mix as hi*2^32 + lo
for the double-precision mod: these tests hit lengths that are not a multiple of a vector or a
block, partial head vectors, windows that cross block boundaries, the dead-token rule, and mixes
at the ends of int64. Expectations: the numpy oracle (hash_numpy) and
Python ints (pyref.py_rows, Python's floored %), never the code under test.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engram_stream import EngramConfig, HashPlan
from engram_stream import plan as plan_mod
from pyref import py_rows

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
FP_MAX = 1 << 21  # primes below it take the division-free mod (ES_FP_PRIME_MAX)


def demo_cfg(evs, n_head, layers=(0, 5), vocab=300, pad=3):
    return EngramConfig(engram_vocab_size=list(evs), max_ngram_size=len(evs) + 1, n_embed_per_ngram=n_head,
                        n_head_per_ngram=n_head, layer_ids=list(layers), pad_id=pad, vocab_size=vocab,
                        hidden_size=2, hc_mult=1, kernel_size=2)


def v41_cfg(evs, n_head, vocab=300, image=299):
    return EngramConfig(variant="deepseek-v4.1", engram_vocab_size=list(evs), max_ngram_size=len(evs) + 1,
                        n_embed_per_ngram=64 * n_head, n_head_per_ngram=n_head, layer_ids=[1, 4], pad_id=2,
                        hidden_size=64, hc_mult=2, vocab_size=vocab, image_token_id=image)


def check(plan, ids, python=True):
    got, want = plan.hash(ids), plan.hash_numpy(ids)
    for L in plan.cfg.layer_ids:
        np.testing.assert_array_equal(got[L], want[L])
        if python:
            assert got[L].tolist() == py_rows(ids, plan.lookup, plan.pad_id, plan.multipliers[L], plan.primes[L],
                                              dead_id=plan.dead_id)


# --- lengths, batch sizes, geometries ------------------------------------------------------------

GEOMETRIES = [([97, 2003], 8),          # the demo's shape (3-grams, 8 heads): its own compiled copy
              ([211, 211, 211], 8),     # deepseek-v4.1's shape (4-grams, 8 heads): its own copy
              ([11], 1), ([50021], 3), ([97, 2003], 5), ([13, 17, 19], 7), ([101] * 4, 9),
              ([(1 << 21) - 300, 7], 6)]  # primes just below 2^21 (still the double-precision mod)


@pytest.mark.parametrize("evs, n_head", GEOMETRIES)
def test_every_length_1_to_17_and_batch_1_to_9(evs, n_head):
    plan = HashPlan(demo_cfg(evs, n_head))
    assert plan.head_fp[0] is not None
    rng = np.random.default_rng(len(evs) * 100 + n_head)
    for T in range(1, 18):
        B = 1 + T % 9
        ids = rng.integers(-5, 300, (B, T))  # negative ids pass through compression (demo)
        check(plan, ids, python=T < 6)


@pytest.mark.parametrize("T", [63, 64, 65, 127, 128, 129, 1000])
def test_windows_across_blocks(T):
    """The kernel works in blocks of up to 64 positions: windows reach back into the previous block."""
    for evs, n_head in GEOMETRIES[:3] + [([5] * 40, 1)]:
        plan = HashPlan(demo_cfg(evs, n_head, layers=[2]))
        ids = np.random.default_rng(T).integers(0, 300, (2, T))
        check(plan, ids, python=False)


@pytest.mark.parametrize("evs, n_head", [([211, 211, 211], 8), ([211, 211, 211], 3), ([97], 5), ([13] * 6, 2)])
def test_dead_tokens_block_at_every_distance(evs, n_head):
    """deepseek-v4.1: image tokens and unknown ids block every older window entry, also across blocks."""
    plan = HashPlan(v41_cfg(evs, n_head))
    rng = np.random.default_rng(n_head)
    for T in list(range(1, 18)) + [64, 65, 200]:
        B = 1 + T % 9
        ids = rng.integers(0, 300, (B, T))
        dead = rng.random((B, T)) < 0.15
        ids[dead] = rng.choice([299, -1, -7], size=int(dead.sum()))
        if T == 200:
            ids[0, 60:70] = 299          # a run of dead tokens across the block boundary
        check(plan, ids, python=T < 6)


def test_division_path_and_mixed_orders():
    """Primes past 2^21 divide in hardware; results are the same either way."""
    plan = HashPlan(demo_cfg([(1 << 21) + 5, 3], 4))
    assert plan.head_fp[0] is None
    ids = np.random.default_rng(2).integers(-(1 << 40), 300, (3, 77))
    check(plan, ids, python=False)


# --- the mod itself: mixes chosen directly -------------------------------------------------------

def mix_plan(evs, n_head, sign):
    """2-grams with multipliers (sign, 0): the mix of position t is sign*id[t] (wrapping)."""
    cfg = demo_cfg(evs, n_head, layers=[0], vocab=10)
    return HashPlan(cfg, multipliers={0: np.array([sign, 0], np.int64)})


def mod_rows(mixes, evs, n_head):
    """Rows of the given int64 mixes through plan.hash: negatives as ids, the others negated."""
    x = np.asarray(mixes, dtype=np.int64)
    out = np.empty((x.size, n_head), np.int64)
    for sign, sel in ((1, x < 0), (-1, x >= 0)):
        with np.errstate(over="ignore"):
            ids = (x[sel] * np.int64(sign)).reshape(1, -1)  # -x for x >= 0: always <= 0 (valid id or negative)
        plan = mix_plan(evs, n_head, sign)
        if ids.size:
            out[sel] = plan.hash(ids)[0][0]
    return out, [p for order in plan.primes[0] for p in order]


EDGE_MIXES = [I64_MIN, I64_MIN + 1, I64_MAX, I64_MAX - 1, -1, 0, 1, 2, -2, (1 << 32) - 1, 1 << 32,
              -(1 << 32), -(1 << 32) - 1, (1 << 31) - 1, 1 << 31, -(1 << 31), (1 << 53) + 1, -(1 << 53) - 1,
              (1 << 62) + 12345, -(1 << 62) - 12345]


@pytest.mark.parametrize("evs, n_head", [([2], 8), ([3], 5), ([646400], 8), ([(1 << 21) - 400], 9),
                                         ([65521], 3), ([1 << 16], 16)])
def test_mod_of_extreme_mixes(evs, n_head):
    rows, primes = mod_rows(EDGE_MIXES, evs, n_head)
    assert max(primes) < FP_MAX
    for x, r in zip(EDGE_MIXES, rows.tolist()):
        assert r == [x % p for p in primes], x


@pytest.mark.parametrize("evs, n_head", [([(1 << 21) + 5], 8), ([16000000], 3), ([(1 << 40) + 15], 2),
                                         ([(1 << 62) - 5000], 2), ([(1 << 21) + 5], 70)])
def test_mod_of_extreme_mixes_large_primes(evs, n_head):
    """Primes past 2^21: Lemire's reciprocal (up to 64 heads a layer), or a division (more)."""
    rows, primes = mod_rows(EDGE_MIXES, evs, n_head)
    assert min(primes) >= FP_MAX
    for x, r in zip(EDGE_MIXES, rows.tolist()):
        assert r == [x % p for p in primes], x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(I64_MIN, I64_MAX), min_size=1, max_size=40),
       st.integers(2, FP_MAX - 2000), st.integers(1, 10))
def test_mod_of_random_mixes_any_small_prime(mixes, ev, n_head):
    rows, primes = mod_rows(mixes, [ev], n_head)
    assert max(primes) < FP_MAX
    for x, r in zip(mixes, rows.tolist()):
        assert r == [x % p for p in primes], x


def test_mod_near_multiples_of_the_prime():
    """Mixes within a few units of k*p (the rounding of x/p is closest to a tie there)."""
    rows, primes = mod_rows([0], [646400], 8)
    rng = np.random.default_rng(5)
    mixes = []
    for p in primes:
        for k in rng.integers(-(1 << 62) // p, (1 << 62) // p, 20).tolist() + [I64_MAX // p, I64_MIN // p]:
            mixes += [k * p + d for d in (-2, -1, 0, 1, 2) if I64_MIN <= k * p + d <= I64_MAX]
    rows, primes = mod_rows(mixes, [646400], 8)
    for x, r in zip(mixes, rows.tolist()):
        assert r == [x % p for p in primes], x


# --- outputs past ES_HASH_STREAM_BYTES: streaming stores where aligned -------------------------------

def offset_buffer(shape, skip):
    """An int64 array of `shape` starting `skip` elements past a 64-byte boundary."""
    n = int(np.prod(shape))
    raw = np.empty(n + 16, np.int64)
    s = (-raw.ctypes.data % 64) // 8 + skip
    return raw[s:s + n].reshape(shape)


@pytest.mark.parametrize("evs, n_head", [([97, 2003], 8), ([211, 211, 211], 8), ([97], 4), ([97, 2003], 6)])
def test_large_outputs_aligned_or_not(evs, n_head):
    """2+ MB outputs: streaming stores when rows are vector-aligned (plan.hash's own arrays are),
    ordinary ones otherwise; the same rows either way, in fresh arrays and in out= buffers."""
    plan = HashPlan(demo_cfg(evs, n_head, layers=[0, 1]))
    H = plan.cfg.n_heads
    T = (2 << 20) // (8 * H) + 37  # one layer's rows just past 2 MB
    ids = np.random.default_rng(4).integers(-3, 300, (1, T))
    want = plan.hash_numpy(ids)
    got = plan.hash(ids)
    assert all(got[L].ctypes.data % 64 == 0 for L in got)
    for skip in (0, 1, 2, 4):
        out = {L: offset_buffer((1, T, H), skip) for L in plan.cfg.layer_ids}
        plan.hash(ids, out=out)
        for L in plan.cfg.layer_ids:
            np.testing.assert_array_equal(got[L], want[L])
            np.testing.assert_array_equal(out[L], want[L])


# --- plan.hash over threads ------------------------------------------------------------------------

def test_threaded_hash_equals_one_thread(monkeypatch):
    plan = HashPlan(demo_cfg([97, 2003], 8, layers=[0, 1, 2]))
    ids = np.random.default_rng(9).integers(0, 300, (7, 333))
    one = plan.hash(ids)
    monkeypatch.setattr(plan_mod, "PARALLEL_MIN_POSITIONS", 0)
    monkeypatch.setattr(plan_mod, "_hash_workers", lambda: 3)
    many = plan.hash(ids)
    for L in one:
        np.testing.assert_array_equal(many[L], one[L])


def test_run_shared_runs_each_job_once_and_raises():
    done = []
    plan_mod._run_shared(list(range(50)), done.append, 3)
    assert sorted(done) == list(range(50))

    def boom(j):
        if j == 7:
            raise RuntimeError("job 7")

    with pytest.raises(RuntimeError, match="job 7"):
        plan_mod._run_shared(list(range(20)), boom, 2)
