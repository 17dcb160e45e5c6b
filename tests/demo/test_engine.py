"""StreamEngine (engram_stream/demo/_engine.pyx) against the numpy batch path, token by token.

The oracle is EngramModel.forward(L, ids[B, T], hidden[B, T, G, D]). Stream s of an
engine plays row s of a batch: its output at its p-th token must equal forward's
[s, p]. Floats compare with rtol=2e-4, atol=2e-5 (the engine uses FMA and another
summation order); integers (rows, tokens_seen) and replays of the engine by itself
compare exactly.

Every model here has non-trivial RMSNorm weights and biases (perturbed in place
after init and before any engine exists: engines borrow pointers to those arrays).

Memory: `pytest --memray tests/demo/test_engine.py -k alloc` enforces the limit_memory
markers (without --memray they are ignored); test_alloc_native_zero checks the
stricter "no native allocation at all" in a subprocess with memray.Tracker.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram_stream import EngineSnapshot
from helpers.inputs import random_inputs
from helpers.models import make_model
from helpers.numeric import ATOL, RTOL, close, hypothesis_settings
from helpers.processes import run_python
from helpers.repo import ROOT
from engram_stream._hash import EPS_CONV, GATE_CLAMP
from engram_stream.demo.reference import EPS_F32

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

HYP = hypothesis_settings(30)
inputs = random_inputs


class Oracle:
    """Expected outputs per stream. Stream s plays row s of ids/hid; pos[s] is its next token."""

    def __init__(self, model, L, ids, hid):
        self.model, self.L = model, L
        self.ids, self.hid = ids.copy(), hid.copy()
        self.want = model.forward(L, self.ids, self.hid)
        self.pos = np.zeros(len(ids), np.int64)

    def now(self):
        r = np.arange(len(self.pos))
        return self.ids[r, self.pos], self.hid[r, self.pos]

    def step(self, eng, out=None):
        ids, hid = self.now()
        got = eng.step(ids, hid, out=out)
        self.check(got)
        return got

    def check(self, got):
        r = np.arange(len(self.pos))
        close(got, self.want[r, self.pos])
        self.pos += 1

    def prefill(self, eng, s, T):
        p = self.pos[s]
        got = eng.prefill(self.ids[s, p:p + T], self.hid[s, p:p + T], stream=s)
        close(got, self.want[s, p:p + T])
        self.pos[s] += T
        return got

    def restart(self, s, ids_row, hid_row):
        """Stream s starts a new sequence (after reset)."""
        self.ids[s], self.hid[s] = ids_row, hid_row
        self.want[s] = self.model.forward(self.L, ids_row[None], hid_row[None])[0]
        self.pos[s] = 0


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


# ---- reset ---------------------------------------------------------------------------------
def test_reset_one_stream_among_many():
    model = make_model(G=2, n=3, K=3, D=13, comp=True, seed=14)
    rng = np.random.default_rng(4)
    ids, hid = inputs(model, 5, 60, rng)
    o = Oracle(model, 4, ids, hid)
    eng = model.stream(4, 5)
    for _ in range(10):
        o.step(eng)
    new_ids, new_hid = inputs(model, 1, 60, rng)
    eng.reset(2)
    o.restart(2, new_ids[0], new_hid[0])
    assert eng.tokens_seen.tolist() == [10, 10, 0, 10, 10]
    for _ in range(15):
        o.step(eng)
    eng.reset(np.int64(4))
    o.restart(4, new_ids[0], new_hid[0])
    for _ in range(10):
        o.step(eng)
    assert eng.tokens_seen.tolist() == [35, 35, 25, 35, 10]


def test_reset_all_and_single_stream():
    model = make_model(G=1, n=2, K=2, D=5, seed=15)
    rng = np.random.default_rng(5)
    ids, hid = inputs(model, 3, 20, rng)
    eng = model.stream(1, 3)
    want = model.forward(1, ids, hid)
    for t in range(20):
        eng.step(ids[:, t], hid[:, t])
    eng.reset()
    assert eng.tokens_seen.tolist() == [0, 0, 0]
    for t in range(20):  # the same sequences again, from the start
        close(eng.step(ids[:, t], hid[:, t]), want[:, t])
    one = model.stream(1)
    for t in range(7):
        one.step(ids[0, t], hid[0, t, None][0])
    one.reset(0)
    for t in range(20):
        close(one.step(ids[0, t], hid[0, t]), want[0, t])


def test_reset_one_stream_while_feed_pending():
    """After feed(ids), reset(0) must either be refused (RuntimeError, compute then finishes the
    token) or leave streams 1.. consistent: clearing `pending` for all streams after feed pushed the
    token into streams 1..'s hash windows would leave their next outputs matching neither the
    sequence with that token nor the one without it."""
    model = make_model(G=2, n=3, K=3, D=8, seed=16)
    ids, hid = inputs(model, 3, 20, np.random.default_rng(6))
    want = model.forward(1, ids, hid)
    eng = model.stream(1, 3)
    for t in range(5):
        eng.step(ids[:, t], hid[:, t])
    eng.feed(ids[:, 5])
    try:
        eng.reset(0)
    except RuntimeError:
        close(eng.compute(hid[:, 5]), want[:, 5])  # refused: the pending token finishes
        t0 = 6
    else:
        if eng.pending_compute:                  # kept pending for the other streams
            close(eng.compute(hid[:, 5])[1:], want[1:, 5])
            t0 = 6
        else:                                    # token 5 dropped for everyone: streams 1.. skip it
            skip = np.delete(np.arange(20), 5)
            want = model.forward(1, ids[:, skip], hid[:, skip])
            ids, hid = ids[:, skip], hid[:, skip]
            t0 = 5
    for t in range(t0, t0 + 6):
        got = eng.step(ids[:, t], hid[:, t])
        close(got[1:], want[1:, t])


# ---- snapshot / restore ----------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 4])
def test_snapshot_restore_replays_exactly(K):
    model = make_model(G=2, n=3, K=K, D=13, comp=True, seed=17)
    ids, hid = inputs(model, 3, 40, np.random.default_rng(7))
    want = model.forward(4, ids, hid)
    eng = model.stream(4, 3)
    for t in range(7):
        eng.step(ids[:, t], hid[:, t])
    snap = eng.snapshot()
    assert isinstance(snap, EngineSnapshot) and snap.nbytes == eng.state_nbytes
    frozen = {k: getattr(snap, k).copy() for k in ("hist", "ring", "pos", "seen")}
    first = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(7, 16)])
    close(first, want[:, 7:16].transpose(1, 0, 2, 3))
    for k, v in frozen.items():  # the snapshot is a copy, not a view of the engine's state
        np.testing.assert_array_equal(getattr(snap, k), v)
        assert not getattr(snap, k).flags.writeable
    eng.restore(snap)
    assert eng.tokens_seen.tolist() == [7, 7, 7]
    again = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(7, 16)])
    np.testing.assert_array_equal(again, first)
    # into a second engine of the same model, layer and stream count
    other = model.stream(4, 3)
    other.restore(snap)
    np.testing.assert_array_equal(np.stack([other.step(ids[:, t], hid[:, t]) for t in range(7, 16)]), first)
    for t in range(16, 40):
        close(other.step(ids[:, t], hid[:, t]), want[:, t])
    # a snapshot can be restored repeatedly, also after a prefill changed the scratch
    eng.prefill(ids[1, 16:40], hid[1, 16:40], stream=1)
    eng.restore(snap)
    np.testing.assert_array_equal(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(7, 16)]), first)


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
    for _ in range(3):
        o.step(eng)
    for bad in foreign + list(_damaged(good)):
        with pytest.raises(ValueError):
            eng.restore(bad)
    for bad in (None, {"hist": good.hist}, good.__dict__):
        with pytest.raises(TypeError):
            eng.restore(bad)
    assert eng.tokens_seen.tolist() == [9, 9, 9]
    for _ in range(10):  # nothing was restored: the sequences continue
        o.step(eng)


def test_snapshot_between_feed_and_compute_refused(small):
    model, eng, o = small
    for _ in range(4):
        o.step(eng)
    ids, hid = o.now()
    eng.feed(ids)
    with pytest.raises(RuntimeError):
        eng.snapshot()
    assert eng.pending_compute
    o.check(eng.compute(hid))
    for _ in range(5):
        o.step(eng)


def test_restore_clears_pending(small):
    model, eng, o = small
    for _ in range(4):
        o.step(eng)
    snap = eng.snapshot()
    eng.feed(o.now()[0])
    eng.restore(snap)
    assert not eng.pending_compute
    for _ in range(5):
        o.step(eng)


# ---- feed / compute ---------------------------------------------------------------------------
@pytest.mark.parametrize("S", [1, 4])
def test_feed_compute_equals_step_and_rows(S):
    model = make_model(G=3, n=4, K=3, D=13, nh=3, comp=True, seed=18)
    ids, hid = inputs(model, S, 25, np.random.default_rng(8))
    L = 4
    want = model.forward(L, ids, hid)
    rows = model.plan.hash(ids)[L] + model.plan.offsets[L]           # [S, T, H] absolute rows
    np.testing.assert_array_equal(rows - model.plan.offsets[L], model.plan.hash_numpy(ids)[L])
    a, b = model.stream(L, S), model.stream(L, S)
    for t in range(25):
        single = S == 1 and t % 2
        tok = ids[0, t] if single else ids[:, t]
        h = hid[0, t] if single else hid[:, t]
        assert not b.pending_compute
        b.feed(tok)
        assert b.pending_compute
        np.testing.assert_array_equal(b.rows, rows[:, t])
        assert b.rows.dtype == np.int64 and b.rows.shape == (S, model.cfg.n_heads)
        got_b = b.compute(h)
        got_a = a.step(tok, h)
        np.testing.assert_array_equal(got_b, got_a)
        close(got_b, want[0, t] if single else want[:, t])
    assert b.tokens_seen.tolist() == [25] * S


def test_feed_compute_misuse(small):
    model, eng, o = small
    ids, hid = o.now()
    with pytest.raises(RuntimeError):
        eng.compute(hid)                         # compute without feed
    eng.feed(ids)
    with pytest.raises(RuntimeError):
        eng.feed(ids)                            # feed twice
    with pytest.raises(RuntimeError):
        eng.step(ids, hid)                       # step while pending
    with pytest.raises(RuntimeError):
        eng.prefill(ids[:1], hid[:1], stream=0)  # prefill while pending
    with pytest.raises(ValueError):
        eng.compute(hid[:2])                     # a bad hidden keeps the token pending
    assert eng.pending_compute
    out = np.empty_like(hid)
    assert eng.compute(hid, out=out) is out
    o.check(out)
    assert not eng.pending_compute
    for _ in range(3):
        o.step(eng)
    eng.feed(o.now()[0])
    eng.reset()                                  # reset() of everything drops the pending token
    assert not eng.pending_compute
    assert eng.tokens_seen.tolist() == [0, 0, 0]


def test_compute_hidden_shapes_single_stream():
    model = make_model(seed=19)
    ids, hid = inputs(model, 1, 6, np.random.default_rng(9))
    want = model.forward(1, ids, hid)[0]
    eng = model.stream(1)
    for t in range(6):
        eng.feed(int(ids[0, t]) if t % 2 else ids[0, t:t + 1])
        got = eng.compute(hid[0, t] if t % 3 else hid[0, t:t + 1])
        close(got.reshape(want[t].shape), want[t])


# ---- bad input ---------------------------------------------------------------------------------
def test_out_of_vocab_id_refused_state_unchanged(small):
    model, eng, o = small
    V = model.cfg.vocab_size
    for _ in range(4):
        o.step(eng)
    ids, hid = o.now()
    for bad in (V, V + 1000, np.iinfo(np.int64).max):
        bad_ids = ids.copy()
        bad_ids[1] = bad
        with pytest.raises(ValueError, match="vocab"):
            eng.step(bad_ids, hid)
        with pytest.raises(ValueError, match="vocab"):
            eng.feed(bad_ids)
        assert not eng.pending_compute
        with pytest.raises(ValueError, match="vocab"):
            eng.prefill(np.array([1, 2, bad, 3]), np.zeros((4, 2, 13), np.float32), stream=2)
    assert eng.tokens_seen.tolist() == [4, 4, 4]
    for _ in range(10):
        o.step(eng)
    one = model.stream(4)
    with pytest.raises(ValueError):
        one.step(V, hid[0])
    assert one.tokens_seen.tolist() == [0]


def test_huge_scalar_id_is_a_value_error():
    """Regression: a scalar id past int64 raised OverflowError instead of ValueError."""
    model = make_model(seed=20)
    eng = model.stream(1)
    h = np.zeros((2, 13), np.float32)
    with pytest.raises(ValueError):
        model.forward(1, np.array([[2**63]], dtype=np.uint64), h[None, None])
    with pytest.raises(ValueError):
        eng.step(2**63, h)
    with pytest.raises(ValueError):
        eng.step(np.uint64(2**63), h)


def test_bad_arguments_refused_state_unchanged(small):
    model, eng, o = small
    for _ in range(3):
        o.step(eng)
    ids, hid = o.now()
    G, D = 2, 13
    bad_calls = [
        (ValueError, lambda: eng.step(ids, hid[:, :, :-1])),            # wrong D
        (ValueError, lambda: eng.step(ids, hid[0])),                    # wrong ndim
        (ValueError, lambda: eng.step(ids, hid[None])),
        (TypeError, lambda: eng.step(ids, hid.astype(np.int32))),       # int hidden
        (TypeError, lambda: eng.step(ids, hid.astype(bool))),
        (ValueError, lambda: eng.step(ids[:2], hid)),                   # wrong number of ids
        (ValueError, lambda: eng.step(np.append(ids, 1), hid)),
        (ValueError, lambda: eng.step(ids[None], hid)),                 # 2-d ids
        (ValueError, lambda: eng.step(5, hid)),                         # scalar id, 3 streams
        (ValueError, lambda: eng.step(5, hid[0])),
        (TypeError, lambda: eng.step(ids.astype(np.float64), hid)),     # float ids
        (TypeError, lambda: eng.step(ids.astype(bool), hid)),           # bool ids
        (TypeError, lambda: eng.step(["a", "b", "c"], hid)),
        (ValueError, lambda: eng.prefill(ids, hid[:2], stream=0)),      # lengths disagree
        (ValueError, lambda: eng.prefill(ids, hid[:, 0], stream=0)),    # hidden ndim
        (ValueError, lambda: eng.prefill(ids[None], hid, stream=0)),    # 2-d ids
        (IndexError, lambda: eng.prefill(ids, hid, stream=3)),          # missing stream
        (IndexError, lambda: eng.prefill(ids, hid, stream=-1)),
        (IndexError, lambda: eng.reset(3)),                             # missing stream
        (IndexError, lambda: eng.reset(-1)),
        (TypeError, lambda: eng.reset("0")),
        (TypeError, lambda: eng.reset(True)),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty((3, G, D), np.float64))),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty((3, G, D + 1), np.float32))),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty((3, G * D), np.float32))),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty((3, G, 2 * D), np.float32)[:, :, ::2])),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty((D, G, 3), np.float32).T)),
        (ValueError, lambda: eng.step(ids, hid, out=_readonly((3, G, D)))),
        (ValueError, lambda: eng.step(ids, hid, out=[[0.0] * D] * G)),
        (ValueError, lambda: eng.prefill(ids, hid, stream=0, out=np.empty((3, G, D), np.float64))),
        (ValueError, lambda: eng.prefill(ids, hid, stream=0, out=_readonly((3, G, D)))),
        (ValueError, lambda: eng.feed(ids[:1])),
        (TypeError, lambda: eng.feed(True)),
    ]
    for i, (exc, call) in enumerate(bad_calls):
        with pytest.raises(exc):
            call()
        assert not eng.pending_compute, i
        assert eng.tokens_seen.tolist() == [3, 3, 3], i
    eng.feed(ids)
    for exc, call in [(ValueError, lambda: eng.compute(hid, out=_readonly((3, G, D)))),
                      (ValueError, lambda: eng.compute(hid, out=np.empty((3, G, D), np.float16))),
                      (TypeError, lambda: eng.compute(hid.astype(np.int64)))]:
        with pytest.raises(exc):
            call()
    o.check(eng.compute(hid))
    for _ in range(6):
        o.step(eng)


def _readonly(shape):
    a = np.zeros(shape, np.float32)
    a.flags.writeable = False
    return a


def test_engine_construction_errors():
    model = make_model(seed=21)
    with pytest.raises(KeyError):
        model.stream(2)
    with pytest.raises(KeyError):
        model.stream("1")
    for S in (0, -1):
        with pytest.raises(ValueError):
            model.stream(1, S)
    eng = model.stream(1, 2)
    assert eng.n_streams == 2 and eng.layer == 1 and eng.model is model
    assert "StreamEngine" in repr(eng)
    from engram_stream import kernel_isa
    assert repr(eng).endswith(f"isa={kernel_isa()!r})")  # the kernel path it runs


def test_bool_tokens_refused():
    model = make_model(seed=22)
    one = model.stream(1)
    h = np.zeros((2, 13), np.float32)
    for tok in (True, False, np.bool_(True), np.array([True])):
        with pytest.raises(TypeError):
            one.step(tok, h if np.ndim(tok) == 0 else h[None])
    assert one.tokens_seen.tolist() == [0]


def test_prefill_bool_stream_refused():
    """Regression: prefill's stream was an int64_t argument, so True became stream 1."""
    model = make_model(seed=22)
    eng = model.stream(1, 2)
    with pytest.raises(TypeError):
        eng.reset(True)
    with pytest.raises(TypeError):
        eng.prefill([1, 2], np.zeros((2, 2, 13), np.float32), stream=True)


def test_hidden_conversions_same_result():
    model = make_model(G=2, n=3, K=3, D=13, seed=23)
    ids, hid = inputs(model, 3, 12, np.random.default_rng(10))
    want = model.forward(1, ids, hid)
    engines = [model.stream(1, 3) for _ in range(5)]
    wide = np.zeros((3, 12, 2, 26), np.float32)
    wide[..., ::2] = hid
    for t in range(12):
        h = hid[:, t]
        variants = [h, h.astype(np.float64), wide[:, t, :, ::2], np.asfortranarray(h), h.tolist()]
        assert not variants[2].flags.c_contiguous and not variants[3].flags.c_contiguous
        outs = [e.step(ids[:, t], v) for e, v in zip(engines, variants)]
        close(outs[0], want[:, t])
        for x in outs[1:]:
            np.testing.assert_array_equal(x, outs[0])
    # the batch path converts float64 the same way
    close(model.forward(1, ids, hid.astype(np.float64)), want)
    # float64 / strided input to prefill
    p = model.stream(1, 3)
    np.testing.assert_array_equal(p.prefill(ids[2], wide[2, :, :, ::2].astype(np.float64), stream=2),
                                  model.stream(1, 3).prefill(ids[2], hid[2], stream=2))


# ---- non-finite input -------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the oracle's overflow/invalid warnings
def test_nan_inf_hidden_propagate_like_batch():
    model = make_model(G=3, n=3, K=4, D=13, comp=True, seed=24)
    ids, hid = inputs(model, 4, 45, np.random.default_rng(11))
    hid[1, 5, 0, 3] = np.nan
    hid[2, 8, 2, :] = np.inf
    hid[3, 10, 1, 0] = -np.inf
    hid[3, 11, 1, 1] = 1e30                       # large but finite
    want = model.forward(1, ids, hid)
    assert np.isnan(want[1, 5]).any() and np.isnan(want[2, 8]).any()
    eng = model.stream(1, 4)
    got = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(45)], axis=1)
    close(got, want, equal_nan=True)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isfinite(got[0]).all()                                  # other streams unaffected
    assert np.isfinite(got[1, :5]).all() and np.isfinite(got[1, -3:]).all()  # the conv ring recovers
    # prefill the same poisoned sequence on one stream
    close(model.stream(1, 4).prefill(ids[2], hid[2], stream=3), want[2], equal_nan=True)


# ---- threads ----------------------------------------------------------------------------------
def test_two_engines_in_two_threads():
    model = make_model(G=2, n=3, K=3, D=64, nh=4, hd=16, comp=True, seed=25)
    rng = np.random.default_rng(12)
    work = [(1, 3) + inputs(model, 3, 300, rng), (4, 2) + inputs(model, 2, 300, rng),
            (1, 1) + inputs(model, 1, 300, rng)]
    solo = []
    for L, S, ids, hid in work:
        e = model.stream(L, S)
        solo.append(np.stack([e.step(ids[:, t], hid[:, t]) for t in range(300)]))
    # first 40 tokens against the oracle too
    for (L, S, ids, hid), s in zip(work, solo):
        close(s[:40].transpose(1, 0, 2, 3), model.forward(L, ids[:, :40], hid[:, :40]))
    engines = [model.stream(L, S) for L, S, _, _ in work]  # created before the threads start
    results, errors = [None] * len(work), []
    barrier = threading.Barrier(len(work))

    def run(i):
        try:
            L, S, ids, hid = work[i]
            barrier.wait()
            out = np.empty((S, 2, 64), np.float32)
            res = []
            for t in range(300):
                engines[i].step(ids[:, t], hid[:, t], out=out)
                res.append(out.copy())
            results[i] = np.stack(res)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for r, s in zip(results, solo):
        np.testing.assert_array_equal(r, s)


def test_one_engine_two_threads_busy_guard():
    """One engine, two threads. Thread A decodes a sequence (retrying its step when refused);
    thread B keeps calling step() with an out-of-vocab id, which either overlaps A's call
    (RuntimeError from the busy guard) or is rejected as a bad id (ValueError). Neither changes
    the state, so A's outputs must equal the single-thread run exactly, whatever the
    interleaving. A runs at least 200 tokens and goes on (up to T) until the guard has fired."""
    T = 3000
    model = make_model(G=2, n=3, K=3, D=64, nh=4, hd=32, comp=True, seed=26)
    ids, hid = inputs(model, 2, T, np.random.default_rng(13))
    want = model.forward(4, ids[:, :50], hid[:, :50])
    solo = model.stream(4, 2)
    solo_out = np.stack([solo.step(ids[:, t], hid[:, t]) for t in range(T)], axis=1)
    close(solo_out[:, :50], want)
    eng = model.stream(4, 2)
    bad_ids = np.array([model.cfg.vocab_size, 0])
    got = np.full_like(solo_out, np.nan)
    b_running, done = threading.Event(), threading.Event()
    seen = {"A_refused": 0, "B_busy": 0, "B_bad": 0, "other": [], "tokens": 0}

    def A():
        try:
            b_running.wait(10)
            for t in range(T):
                while True:
                    try:
                        got[:, t] = eng.step(ids[:, t], hid[:, t])
                        break
                    except RuntimeError:
                        seen["A_refused"] += 1
                        time.sleep(0)            # let B finish its call
                seen["tokens"] = t + 1
                if t >= 200 and seen["A_refused"] + seen["B_busy"]:
                    break
        finally:
            done.set()

    def B():
        h = np.zeros((2, 2, 64), np.float32)
        while not done.is_set():
            try:
                eng.step(bad_ids, h)
            except RuntimeError:
                seen["B_busy"] += 1
            except ValueError:
                seen["B_bad"] += 1
            except BaseException as e:  # pragma: no cover
                seen["other"].append(e)
            b_running.set()
            time.sleep(0.0001)                   # pace B: A must make progress

    threads = [threading.Thread(target=A), threading.Thread(target=B)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    n = seen["tokens"]
    assert not seen["other"], seen
    assert n >= 200, seen
    np.testing.assert_array_equal(got[:, :n], solo_out[:, :n])
    assert eng.tokens_seen.tolist() == [n, n]
    assert seen["B_busy"] + seen["A_refused"] > 0, seen  # the guard fired at least once


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


def test_snapshot_during_concurrent_step_is_refused_or_consistent():
    """snapshot() while another thread's step() runs: refused (RuntimeError) or consistent.
    (Regression: snapshot() was outside the busy guard and returned torn states: hash window
    advanced, conv ring and tokens_seen not.)"""
    model = make_model(G=3, n=3, K=3, D=512, nh=4, hd=256, seed=27)   # ~ms per step
    pad = model.plan.pad_id
    ids, hid = inputs(model, 2, 30, np.random.default_rng(14), neg=False)
    eng = model.stream(1, 2)
    done, snaps = threading.Event(), []

    def A():
        for t in range(30):
            while True:
                try:
                    eng.step(ids[:, t], hid[:, t])
                    break
                except RuntimeError:
                    pass
        done.set()

    def B():
        while not done.is_set():
            try:
                snaps.append(eng.snapshot())
            except RuntimeError:
                pass
            done.wait(0.0003)

    threads = [threading.Thread(target=A), threading.Thread(target=B)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s in snaps:   # a consistent snapshot after k tokens holds tokens k-1, k-2 in its window
        k = int(s.seen[0])
        expect = [ids[0, k - 1 - j] if k - 1 - j >= 0 else pad for j in range(2)]
        assert s.hist[0].tolist() == expect, (k, s.hist[0].tolist(), expect)



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
    model = wide[dtype]
    ids, hid = inputs(model, S, 5, np.random.default_rng(S))
    want = model.forward(1, ids, hid)
    engs = [model.stream(1, S) for _ in range(3)]
    for e, th in zip(engs, (1, 2, 3)):
        e.step_threads = th
    for t in range(5):
        got = [e.step(ids[:, t], hid[:, t]) for e in engs]
        close(got[0], want[:, t])
        for g in got[1:]:
            assert np.array_equal(g, got[0])  # split by columns and streams, never by k
    for e in engs[1:]:
        for a, b in zip(_state(e), _state(engs[0])):
            assert np.array_equal(a, b)


def test_step_threads_attribute():
    model = make_model(D=16, seed=2)
    eng = model.stream(1, 4)
    assert eng.step_threads == 1  # the default
    for set_to, got in ((2, 2), (0, 1), (-7, 1), (16, 16), (17, 16), (10**9, 16), (3, 3)):
        eng.step_threads = set_to
        assert eng.step_threads == got
    assert model.stream(1, 4).step_threads == 1  # per engine
    assert 1 <= eng.prefill_threads <= 8  # default: the cores, at most 8
    for set_to, got in ((0, 1), (-7, 1), (10**20, 16), (3, 3)):
        eng.prefill_threads = set_to
        assert eng.prefill_threads == got
    one = model.stream(1)
    one.step_threads = 2  # accepted; one stream has nothing to split
    ids, hid = inputs(model, 1, 4, np.random.default_rng(0))
    want = model.forward(1, ids, hid)[0]
    for t in range(4):
        close(one.step(int(ids[0, t]), hid[0, t]), want[t])


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
N_ALLOC = 2000


@pytest.fixture(scope="module")
def alloc_setup():
    """Everything allocated before the measured tests run (limit_memory counts the test body)."""
    model = make_model(G=2, n=3, K=4, D=40, comp=True, seed=28)
    rng = np.random.default_rng(15)
    one = model.stream(1)
    one_toks = [int(x) for x in rng.integers(0, model.cfg.vocab_size, N_ALLOC)]
    one_h = rng.standard_normal((2, 40)).astype(np.float32)
    one_out = np.empty((2, 40), np.float32)
    multi = model.stream(1, 4)
    multi_ids = rng.integers(0, model.cfg.vocab_size, (N_ALLOC, 4))
    multi_h = rng.standard_normal((4, 2, 40)).astype(np.float32)
    multi_out = np.empty((4, 2, 40), np.float32)
    for t in range(10):  # warm up
        one.step(one_toks[t], one_h, out=one_out)
        multi.step(multi_ids[t], multi_h, out=multi_out)
    return dict(model=model, one=one, one_toks=one_toks, one_h=one_h, one_out=one_out,
                multi=multi, multi_ids=multi_ids, multi_h=multi_h, multi_out=multi_out)


@pytest.mark.limit_memory("64 KB")
def test_alloc_steady_state_single_stream(alloc_setup):
    eng, toks, h, out = (alloc_setup[k] for k in ("one", "one_toks", "one_h", "one_out"))
    for tok in toks:
        eng.step(tok, h, out=out)


@pytest.mark.limit_memory("64 KB")
def test_alloc_steady_state_multi_stream(alloc_setup):
    eng, ids, h, out = (alloc_setup[k] for k in ("multi", "multi_ids", "multi_h", "multi_out"))
    for t in range(N_ALLOC):
        eng.step(ids[t], h, out=out)


def test_alloc_steady_state_results(alloc_setup):
    """The measured loops compute the right thing (checked on fresh engines)."""
    model = alloc_setup["model"]
    toks = np.array(alloc_setup["one_toks"][:30])
    h = alloc_setup["one_h"]
    want = model.forward(1, toks[None], np.broadcast_to(h, (1, 30, 2, 40)))[0]
    eng, out = model.stream(1), np.empty((2, 40), np.float32)
    for t in range(30):
        close(eng.step(int(toks[t]), h, out=out), want[t])


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
