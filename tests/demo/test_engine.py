"""StreamEngine (engram_stream/demo/_engine.pyx) against the numpy batch path, token by token.

The oracle is EngramModel.forward(L, ids[B, T], hidden[B, T, G, D]). Stream s of an
engine plays row s of a batch: its output at its p-th token must equal forward's
[s, p]. Floats compare with rtol=2e-4, atol=2e-5 (the engine uses FMA and another
summation order); integers (rows, tokens_seen) and replays of the engine by itself
compare exactly.

Every model here has non-trivial RMSNorm weights and biases (perturbed in place
after init and before any engine exists: engines borrow pointers to those arrays).

The engine base's behaviour on every variant (reset, snapshots, feed/compute, argument checks,
threads, the work split, steady-state allocation under `pytest --memray`) is tests/engine/;
here, the demo's own: its kernels' tiles and table types, its snapshot fields, the races and
thread split of large demo models in subprocesses, and test_alloc_native_zero, the stricter "no
native allocation at all" in a subprocess with memray.Tracker.
"""
from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram_stream import EngineSnapshot
from helpers.inputs import Oracle, assert_foreign_snapshots_refused, assert_step_threads_agree, random_inputs
from helpers.models import make_model
from helpers.numeric import ATOL, RTOL, close, hypothesis_settings
from helpers.processes import run_python
from helpers.repo import ROOT
from engram_stream._hash import EPS_CONV, GATE_CLAMP
from engram_stream.demo.reference import EPS_F32

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

HYP = hypothesis_settings(30)
inputs = random_inputs


@pytest.fixture
def small():
    """A 3-stream engine on a small model with compression, its oracle (T=40)."""
    model = make_model(G=2, n=3, K=3, D=13, comp=True, seed=3)
    ids, hid = inputs(model, 3, 40, np.random.default_rng(0))
    return model, model.stream(4, 3), Oracle(model, 4, ids, hid)


# ---- token by token vs the batch path -------------------------------------------------------
@st.composite
def configs(draw):
    n = draw(st.integers(2, 4))
    vocab = draw(st.integers(3, 60))
    return dict(G=draw(st.integers(1, 4)), n=n, K=draw(st.integers(1, 5)),
                D=draw(st.sampled_from([1, 3, 5, 8, 13, 16, 24, 33])),
                nh=draw(st.integers(1, 4)), hd=draw(st.integers(1, 5)), vocab=vocab,
                layers=draw(st.sampled_from([(0,), (2, 5), (7, 1)])),
                evs=[draw(st.integers(2, 300)) for _ in range(n - 1)],
                comp=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                pad=draw(st.integers(0, vocab - 1)))


def forward64(model, L, ids, hid):
    """The demo's output in float64, reference.forward's steps without its float32 roundings:
    the exact result that the float32 oracle and the engine both approximate."""
    cfg, w = model.cfg, model.layer(L)
    rows = model.plan.hash_numpy(ids, layers=[L])[L]
    B, T, _ = rows.shape
    G, D = cfg.hc_mult, cfg.hidden_size

    def rms(x, weight, eps):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight
    e = w.table_f32(rows + w.offsets).reshape(B, T, cfg.engram_dim).astype(np.float64)
    h = hid.astype(np.float64)
    gate = np.empty((B, T, G, 1))
    for g in range(G):
        k = rms(e @ w.key_w[g].T.astype(np.float64) + w.key_b[g], w.norm1[g], EPS_F32)
        s = np.sum(k * rms(h[:, :, g], w.norm2[g], EPS_F32), axis=-1) / np.sqrt(D)
        gate[:, :, g, 0] = 1 / (1 + np.exp(-np.sign(s) * np.sqrt(np.maximum(np.abs(s), GATE_CLAMP))))
    v = gate * (e @ w.value_w.T.astype(np.float64) + w.value_b)[:, :, None, :]
    x = np.stack([rms(v[:, :, g], w.conv_norm[g], EPS_CONV) for g in range(G)], axis=2).reshape(B, T, G * D)
    y = np.zeros_like(x)
    for i in range(cfg.kernel_size):
        shift = (cfg.kernel_size - 1 - i) * cfg.max_ngram_size
        if shift < T:
            y[:, shift:] += w.conv_w[:, i] * x[:, :T - shift]
    return v + (y / (1 + np.exp(-y))).reshape(B, T, G, D)


def close_or_truer(got, want, exact):
    """got within the tolerance of the float32 oracle, or, where it is not, no farther than the
    oracle from the float64 result (plus the tolerance). The oracle itself is off where a key
    projection cancels to ~0 at D = 1 (|k| ~ 1e-6 from terms of size ~1): RMSNorm over one
    element then scales its rounding up ~1000x, in whichever summation order."""
    tol = ATOL + RTOL * np.abs(want)
    bad = (np.abs(got - want) > tol) & (np.abs(got - exact) > np.abs(want - exact) + tol)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} values off at {np.argwhere(bad)[:4].tolist()}: "
                           f"engine {got[bad][:4]}, oracle {want[bad][:4]}, float64 {exact[bad][:4]}")


@HYP
@given(c=configs(), T=st.integers(1, 40), data=st.data())
def test_single_stream_matches_batch(c, T, data):
    model = make_model(**c)
    L = data.draw(st.sampled_from(model.cfg.layer_ids))
    ids, hid = inputs(model, 1, T, np.random.default_rng(c["seed"]))
    want, exact = model.forward(L, ids, hid)[0], forward64(model, L, ids, hid)[0]
    eng = model.stream(L)
    for t in range(T):
        tok = int(ids[0, t]) if t % 2 else ids[0, t]  # Python int and numpy int64 scalars
        got = eng.step(tok, hid[0, t])
        assert got.shape == (model.cfg.hc_mult, model.cfg.hidden_size) and got.dtype == np.float32
        close_or_truer(got, want[t], exact[t])
    assert eng.tokens_seen.tolist() == [T]


@HYP
@given(c=configs(), S=st.integers(1, 7), T=st.integers(1, 40), data=st.data())
def test_multi_stream_matches_batch(c, S, T, data):
    model = make_model(**c)
    L = data.draw(st.sampled_from(model.cfg.layer_ids))
    ids, hid = inputs(model, S, T, np.random.default_rng(c["seed"] + 1))
    want, exact = model.forward(L, ids, hid), forward64(model, L, ids, hid)
    eng = model.stream(L, n_streams=S)
    out = np.full((S, model.cfg.hc_mult, model.cfg.hidden_size), np.nan, np.float32)
    for t in range(T):
        if t % 2:
            got = eng.step(ids[:, t], hid[:, t], out=out)
            assert got is out
        else:
            got = eng.step(list(ids[:, t]), hid[:, t])  # any integer sequence
        close_or_truer(got, want[:, t], exact[:, t])
    assert eng.tokens_seen.tolist() == [T] * S


class _KeyShifted:
    """A layer's weights with the key bias moved by d (float64): forward64 of a key projection
    that summed to d off its exact value."""

    def __init__(self, w, d):
        self._w, self.key_b = w, w.key_b.astype(np.float64) + d

    def __getattr__(self, name):
        return getattr(self._w, name)


class _ModelWith:
    def __init__(self, model, w):
        self.cfg, self.plan, self._w = model.cfg, model.plan, w

    def layer(self, L):
        return self._w


def _float32_key_spread(model, L, ids, b, t, orders=200):
    """How far float32 sums put token (b, t)'s key projection (G = D = 1) from its exact value:
    the lowest and highest over summation orders (sequential, in random orders, with and without
    a fused multiply-add), in numpy float32 scalars, which round alike on every platform."""
    w = model.layer(L)
    rows = model.plan.hash_numpy(ids, layers=[L])[L]
    e = w.table_f32(rows[b, t] + w.offsets).reshape(-1)
    kw, kb = w.key_w[0, 0], w.key_b[0, 0]
    exact = float(np.dot(e.astype(np.float64), kw.astype(np.float64)) + float(kb))
    rng, got = np.random.default_rng(0), []
    for i in range(orders):
        acc = np.float32(0)
        for j in rng.permutation(e.shape[0]):
            acc = np.float32(float(acc) + float(e[j]) * float(kw[j])) if i % 2 else acc + e[j] * kw[j]
        got.append(float(acc + kb) - exact)
    return min(got), max(got)


def test_where_a_key_cancels_the_engine_is_within_float32s_own_error():
    """A draw of the test above: at D = 1, stream 5's key projection at t = 1 sums to -3.7e-6
    from terms of size ~0.1, so every float32 summation order lands the key its own distance
    from the exact one (up to ~7e-8 over the orders tried), and RMSNorm over one element scales
    that up ~1000x: the output of a float32 computation, numpy's oracle included, is up to
    ~2.5e-3 (relative) off the float64 result, by how much depends on the order (numpy's oracle,
    through the platform's BLAS: 8e-4 on one, within the tolerance on another). The engine is
    held to the float64 result, no farther than float32 itself lands (the farther of the oracle
    and the key's spread over orders, carried through forward64) plus the tolerance; how far the
    oracle is is not asserted: that belongs to the platform's BLAS, not to the engine."""
    c = dict(G=1, n=3, K=4, D=1, nh=2, hd=5, vocab=52, layers=(0,), evs=[110, 72], comp=True, seed=3562, pad=20)
    model = make_model(**c)
    ids, hid = inputs(model, 6, 35, np.random.default_rng(c["seed"] + 1))  # (the draw's T = 35)
    want, exact = model.forward(0, ids, hid)[5, 1], forward64(model, 0, ids, hid)[5, 1]
    eng = model.stream(0, n_streams=6)
    eng.step(ids[:, 0], hid[:, 0])
    got = eng.step(ids[:, 1], hid[:, 1])[5]
    spread = np.abs(want - exact)
    for d in _float32_key_spread(model, 0, ids, 5, 1):
        far = forward64(_ModelWith(model, _KeyShifted(model.layer(0), d)), 0, ids, hid)[5, 1]
        spread = np.maximum(spread, np.abs(far - exact))
    bound = spread + ATOL + RTOL * np.abs(exact)
    assert (np.abs(got - exact) <= bound).all(), (got, want, exact, spread)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("S", [1, 3])
def test_quantized_tables_match_batch(dtype, S):
    model = make_model(G=3, n=3, K=4, D=24, nh=3, hd=4, comp=True, table_dtype=dtype, seed=5)
    assert model.layers[4].table.dtype == np.dtype(dtype)
    ids, hid = inputs(model, S, 30, np.random.default_rng(1))
    want = model.forward(4, ids, hid)
    eng = model.stream(4, S)
    for t in range(30):
        got = eng.step(ids[0, t], hid[0, t]) if S == 1 else eng.step(ids[:, t], hid[:, t])
        close(got, want[0, t] if S == 1 else want[:, t])
    # and prefill uses the same gather
    eng2 = model.stream(4, S)
    close(eng2.prefill(ids[S - 1], hid[S - 1], stream=S - 1), want[S - 1])


def test_wide_layer_uses_gemv_and_tiles():
    """M = (G+1)*D >= 64 (the four-panel GEMV for one row) and S >= 6 (full micro-tiles)."""
    model = make_model(G=4, n=2, K=2, D=33, nh=4, hd=5, seed=7)
    for S in (1, 7):
        ids, hid = inputs(model, S, 12, np.random.default_rng(S))
        want = model.forward(1, ids, hid)
        eng = model.stream(1, S)
        for t in range(12):
            close(eng.step(ids[:, t], hid[:, t]), want[:, t])


# ---- prefill -------------------------------------------------------------------------------
@pytest.mark.parametrize("T0", [0, 1, 7, 11, 40, 128, 129, 137, 300])  # every GEMM row-tile remainder
def test_prefill_then_step(T0):
    model = make_model(G=2, n=3, K=4, D=13, comp=True, seed=11)
    ids, hid = inputs(model, 1, T0 + 20, np.random.default_rng(T0))
    want = model.forward(1, ids, hid)[0]
    eng = model.stream(1)
    got = eng.prefill(ids[0, :T0], hid[0, :T0])
    assert got.shape == (T0, 2, 13) and got.dtype == np.float32
    close(got, want[:T0])
    assert eng.tokens_seen.tolist() == [T0]
    for t in range(T0, T0 + 20):
        close(eng.step(int(ids[0, t]), hid[0, t]), want[t])


def test_prefill_out_and_continuation_after_steps():
    model = make_model(G=1, n=4, K=5, D=5, seed=12)
    ids, hid = inputs(model, 1, 200, np.random.default_rng(2))
    want = model.forward(4, ids, hid)[0]
    eng = model.stream(4)
    for t in range(9):
        close(eng.step(ids[0, t], hid[0, t]), want[t])
    out = np.empty((150, 1, 5), np.float32)
    assert eng.prefill(ids[0, 9:159], hid[0, 9:159], out=out) is out
    close(out, want[9:159])
    close(eng.prefill(ids[0, 159:163], hid[0, 159:163]), want[159:163])  # prefill after prefill
    for t in range(163, 200):
        close(eng.step(ids[0, t], hid[0, t]), want[t])


def test_prefill_one_stream_of_many_leaves_the_others():
    model = make_model(G=3, n=3, K=3, D=8, comp=True, seed=13)
    ids, hid = inputs(model, 4, 200, np.random.default_rng(3))
    o = Oracle(model, 1, ids, hid)
    eng = model.stream(1, 4)
    for _ in range(5):
        o.step(eng)
    before = eng.snapshot()
    o.prefill(eng, 2, 140)            # chunked (> 128), a continuation of stream 2
    after = eng.snapshot()
    for name in ("hist", "ring", "pos", "seen"):  # other streams' state untouched
        a, b = getattr(before, name), getattr(after, name)
        np.testing.assert_array_equal(np.delete(a, 2, axis=0), np.delete(b, 2, axis=0))
    assert eng.tokens_seen.tolist() == [5, 5, 145, 5]
    o.prefill(eng, 0, 3)
    for _ in range(20):
        o.step(eng)
    assert eng.tokens_seen.tolist() == [28, 25, 165, 25]


# ---- snapshot / restore ----------------------------------------------------------------------
def _damaged(snap):
    S = snap.hist.shape[0]
    cl = snap.ring.shape[1]
    fp = snap.fingerprint
    good = dict(hist=snap.hist, ring=snap.ring, pos=snap.pos, seen=snap.seen)
    for name, bad in [("hist", snap.hist[:, :-1].copy()), ("hist", snap.hist.astype(np.int32)),
                      ("ring", snap.ring[:, :, :-1].copy()), ("ring", snap.ring.astype(np.float64)),
                      ("ring", np.asfortranarray(np.repeat(snap.ring, 2, axis=2))[:, :, ::2]),
                      ("pos", snap.pos + cl), ("pos", snap.pos - cl - 1), ("pos", snap.pos[:-1].copy()),
                      ("seen", snap.seen.astype(np.float64)), ("ring", None)]:
        yield EngineSnapshot(fp, **{**good, name: bad})
    yield EngineSnapshot(fp[:2] + (S + 1,) + fp[3:], **good)


def test_snapshot_refused_and_state_unchanged(small):
    model, eng, o = small
    for _ in range(6):
        o.step(eng)
    good = eng.snapshot()
    foreign = [
        model.stream(1, 3).snapshot(),                           # another layer
        model.stream(4, 2).snapshot(),                           # another stream count
        make_model(G=2, n=3, K=3, D=14, comp=True, seed=3).stream(4, 3).snapshot(),   # another config
        make_model(G=2, n=3, K=3, D=13, comp=False, seed=3).stream(4, 3).snapshot(),  # no compression
        make_model(G=2, n=3, K=3, D=13, comp=True, seed=4).stream(4, 3).snapshot(),   # other seed
    ]
    assert [f.fingerprint != good.fingerprint for f in foreign] == [True] * 5
    assert_foreign_snapshots_refused(eng, o, good, foreign + list(_damaged(good)))


# ---- threads ----------------------------------------------------------------------------------
_RACE = textwrap.dedent("""
    import json, sys, threading, time
    import numpy as np
    from engram_stream import EngramConfig, EngramModel
    cfg = EngramConfig(engram_vocab_size=[1009, 1013], max_ngram_size=3, n_embed_per_ngram=1024,
                       n_head_per_ngram=4, layer_ids=[0], pad_id=1, seed=0, kernel_size=3,
                       hidden_size=512, hc_mult=3, vocab_size=500)
    m = EngramModel.init(cfg, seed=1)
    S, N = 2, 8
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, (N, S)); hid = rng.standard_normal((N, S, 3, 512)).astype(np.float32)
    ref = m.stream(0, S); want = np.stack([ref.step(ids[t], hid[t]) for t in range(N)])
    pids = np.zeros(128, np.int64); phid = np.zeros((128, 3, 512), np.float32)
    t_start = time.time(); rounds = refused = bad = 0
    # at least argv[1] seconds, and on until one overlap was refused (a loaded machine may need
    # several rounds for the threads to meet), 60 s at most
    while (time.time() - t_start < float(sys.argv[1]) or not refused) and time.time() - t_start < 60 \
            and not bad:
        rounds += 1
        e = m.stream(0, S); got = np.zeros_like(want); go = threading.Event(); done = threading.Event()
        def A():
            go.set()
            for t in range(N):
                while True:
                    try:
                        got[t] = e.step(ids[t], hid[t]); break
                    except RuntimeError:
                        pass
            done.set()
        def B():
            global refused
            go.wait()
            for T in range(S + 1, 129):       # each prefill that overlaps A must be refused
                if done.is_set():
                    break
                try:
                    e.prefill(pids[:T], phid[:T], stream=0)
                except RuntimeError:
                    refused += 1
        ta, tb = threading.Thread(target=A), threading.Thread(target=B)
        ta.start(); tb.start(); ta.join(); tb.join()
        bad += not np.allclose(got[:, 1], want[:, 1], rtol=2e-4, atol=2e-5)   # stream 1: A's only
    print(json.dumps(dict(rounds=rounds, refused=refused, corrupted=bad)))
""")


def test_refused_concurrent_prefill_does_not_corrupt_step():
    """Thread A steps a 2-stream engine; thread B calls prefill(stream=0) with growing T on the
    same engine. B's calls that overlap A must be refused (RuntimeError) without touching A's
    work: A's stream-1 outputs must be right. (Regression: prefill grew the shared scratch,
    realloc of rbuf/ebuf/ybuf, BEFORE the busy guard, so a refused prefill had already moved
    the buffers under a running step: the GEMM wrote the freed ybuf, the tail read the new one.)
    Run in a subprocess: a use-after-free may also crash."""
    r = run_python(["-c", _RACE, "2.0"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["refused"] > 0, res        # the race did happen
    assert res["corrupted"] == 0, res


# ---- work split over threads (step_threads, prefill_threads) ---------------------------------
def _state(eng):
    s = eng.snapshot()
    return s.hist, s.ring, s.pos, s.seen, s.rows


@pytest.fixture(scope="module")
def wide():
    """M = (G+1)*D = 3*45 = 135 columns: 9 panels (8 full, one partial), so 2 and 3 threads
    each get panels; D = 45 leaves a remainder after every vector width (16, 8, 4); K = 4 and
    n = 3: a conv ring of 9 rows. float32 and bf16 projection weights."""
    f32 = make_model(G=2, n=3, K=4, D=45, nh=2, hd=4, comp=True, seed=31)
    return {"float32": f32, "bfloat16": f32.with_weight_dtype("bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("S", range(2, 18))  # every micro-tile remainder of every path (3, 6, 8 rows)
def test_step_threads_bitwise_equal_and_match_batch(wide, dtype, S):
    ids, hid = inputs(wide[dtype], S, 5, np.random.default_rng(S))
    assert_step_threads_agree(wide[dtype], 1, ids, hid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_threads_pieces_match_steps(wide, dtype, threads):
    """Prefill in pieces shorter and longer than the conv ring (9) and across the 128-token
    chunks, threads or not, then steps: the batch path's outputs, and the state token-by-token
    steps leave (floats within tolerance: the GEMM tiles and the GEMV sum in other orders)."""
    model = wide[dtype]
    T = 330
    ids, hid = inputs(model, 1, T + 4, np.random.default_rng(threads))
    want = model.forward(1, ids, hid)[0]
    eng, ref = model.stream(1), model.stream(1)
    eng.prefill_threads = threads
    t = 0
    for n in (8, 1, 5, 9, 10, 3, 129, 7, 128, 30):  # 8, 9, 10: tails split over threads around the ring's 9
        close(eng.prefill(ids[0, t:t + n], hid[0, t:t + n]), want[t:t + n])
        for i in range(t, t + n):
            ref.step(int(ids[0, i]), hid[0, i])
        a, b = _state(eng), _state(ref)
        assert all(np.array_equal(x, y) for i, (x, y) in enumerate(zip(a, b)) if i != 1)  # ints exactly
        close(a[1], b[1])  # the conv ring, slot by slot
        t += n
    assert t == T
    for i in range(T, T + 4):
        close(eng.step(int(ids[0, i]), hid[0, i]), want[i])


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_prefill_threads_bitwise_equal(dtype):
    """The gathers (every table type), GEMM and tails of a prefill split over threads give the
    bits of one thread."""
    model = make_model(G=3, n=3, K=4, D=24, nh=3, hd=4, comp=True, table_dtype=dtype, seed=9)
    ids, hid = inputs(model, 1, 300, np.random.default_rng(4))
    outs, states = [], []
    for th in (1, 2, 5):
        eng = model.stream(4, 2)
        eng.prefill_threads = th
        outs.append(eng.prefill(ids[0], hid[0], stream=1))
        states.append(_state(eng))
    close(outs[0], model.forward(4, ids, hid)[0])
    for o, st in zip(outs[1:], states[1:]):
        assert np.array_equal(o, outs[0])
        assert all(np.array_equal(a, b) for a, b in zip(st, states[0]))


_ONE_CPU = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from helpers.models import make_model
    from engram_stream.engine import _base
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # every thread of the split on one CPU
    def threads():  # the engine's workers (the BLAS library's come and go with fork)
        n = 0
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    n += f.read().strip() == "engram-worker"
            except OSError:  # a thread that just left
                pass
        return n
    def settle(n):  # exiting workers take a moment
        for _ in range(200):
            if threads() == n:
                break
            time.sleep(0.01)
        return threads() - n
    before = threads()
    model = make_model(G=2, n=3, K=4, D=200, nh=2, hd=8, comp=True, seed=5)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.cfg.vocab_size, (40, 16))
    hid = rng.standard_normal((16, 2, 200)).astype(np.float32)
    one, two = model.stream(1, 16), model.stream(1, 16)
    two.step_threads = 2
    p1, p2 = model.stream(1), model.stream(1)
    p1.prefill_threads, p2.prefill_threads = 1, 2
    pid = rng.integers(0, model.cfg.vocab_size, 300)
    phid = rng.standard_normal((300, 2, 200)).astype(np.float32)
    st, ln = np.arange(16), np.ones(16, np.int64)
    def calls(n):
        for t in range(n):
            assert np.array_equal(two.step(ids[t % 40], hid), one.step(ids[t % 40], hid))
        for _ in range(10):
            assert np.array_equal(p2.prefill(pid, phid), p1.prefill(pid, phid))
        for t in range(80):  # more calls than there are team slots (64)
            assert np.array_equal(two.step_packed(ids[t % 40], hid, st, ln), one.step_packed(ids[t % 40], hid, st, ln))
    calls(40)  # the main thread's calls: it keeps one team, one worker, parked between calls
    kept = (_base._teams_held(), settle(before + 1))
    failed = []
    def other():
        try:
            calls(20)
        except BaseException as e:
            failed.append(e)
    for _ in range(3):  # threads that call and exit: each closes its team on the way out
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert not failed, failed
    settle(before + 1)  # the exited threads' workers gone first: a fork while one exits (inside
    # free(), holding the allocator's lock) can leave the child blocked on that lock
    child = os.fork()  # the child has none of its parent's workers: it starts its own
    if child == 0:
        try:
            calls(5)
            code = 0 if _base._teams_held() >= 1 else 3
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(child, 0)
    print(kept[0], kept[1], os.waitstatus_to_exitcode(status), _base._teams_held(), settle(before + 1))
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.exists("/proc/self/status"),
                    reason="needs Linux CPU affinity and /proc")
def test_thread_split_on_one_cpu_bitwise_equal_and_leaves_no_threads():
    """Two threads on one CPU: a worker often starts only after the caller took every piece,
    and the caller returns without it (es_team_run). The 16-stream steps, packed steps and
    prefills keep the bits of one thread; a calling thread keeps one team (one slot, one
    parked worker) across its calls, a thread that exits closes its own, and a forked child
    starts its own workers."""
    from engram_stream.engine import isa
    r = run_python(["-c", _ONE_CPU, os.path.join(ROOT, "tests")], timeout=120,
                   env=dict(os.environ, ENGRAM_STREAM_ISA=isa.kernel_isa()))  # the path of this run
    assert r.returncode == 0, r.stderr[-2000:]
    # the main thread's one team and worker; the child fine; still that one after three threads came and went
    assert r.stdout.split()[-5:] == ["1", "0", "0", "1", "0"], r.stdout


# ---- steady-state allocation ---------------------------------------------------------------------
_ALLOC = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from helpers.models import make_model
    from helpers.processes import native_allocations
    D = 130   # an output of G*D*4 >= 1024 bytes is past numpy's small-buffer cache: malloc sees it
    model = make_model(G=2, n=3, K=4, D=D, comp=True, seed=28)
    rng = np.random.default_rng(0)
    res = {}
    for S in (1, 4):
        eng = model.stream(1, S)
        toks = ([int(x) for x in rng.integers(0, 40, 2000)] if S == 1
                else list(rng.integers(0, 40, (2000, S))))
        h = rng.standard_normal((S, 2, D) if S > 1 else (2, D)).astype(np.float32)
        out = np.empty_like(h)
        for t in toks[:10]:
            eng.step(t, h, out=out)

        def with_out():
            for t in toks:
                eng.step(t, h, out=out)

        def without_out():
            for t in toks:
                eng.step(t, h)
        res[f"{S}_out"], res[f"{S}_no_out"] = native_allocations(with_out), native_allocations(without_out)
    print(json.dumps(res))
""")


def test_alloc_native_zero():
    """Stricter than limit_memory (a high-water mark): no native allocation at all in 2000 steps
    with out= (memray.Tracker in a subprocess, so it does not clash with pytest --memray). The
    same loop without out= must show one allocation per step: the measurement can fail."""
    r = run_python(["-c", _ALLOC, os.path.join(ROOT, "tests")], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for S in (1, 4):
        n, nbytes = res[f"{S}_out"]
        assert n <= 2 and nbytes < 4096, res          # (allow a one-off cache fill)
        assert res[f"{S}_no_out"][0] >= 2000, res    # sensitivity: fresh outputs are seen
