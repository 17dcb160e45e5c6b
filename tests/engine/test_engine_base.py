"""The engine base's behaviour (engram_stream/engine/_base.pyx) on every registered variant, token
by token against its numpy oracle (EngramModel.forward): reset of a stream or all, snapshots and
restores, feed/compute, engines on threads (two engines at once, one engine refused to a second
caller, a snapshot beside a running step), the work split over threads, steady-state allocation
(its argument checks: test_engine_args.py).

A stream s of an engine plays row s of the oracle's batch. Floats compare within the project's
tolerance; integers (rows, tokens_seen) and an engine's replays of itself compare exactly. An
input layer (longcat-flash-lite) takes no hidden and gives [.., D]: its hidden is None wherever a
residual layer's is an array (helpers.inputs.variant_hidden), its outputs out_shape(model, ..).

Memory: `pytest --memray tests/engine -k alloc` enforces the limit_memory markers."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engram_stream import EngineSnapshot
from helpers.inputs import (Oracle, assert_foreign_snapshots_refused, assert_step_threads_agree, engine_state, out_shape,
                            variant_hidden, variant_ids, variant_inputs)
from helpers.models import contract_model, contract_variants
from helpers.numeric import close

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

VARIANTS = contract_variants()   # every registered variant


@pytest.fixture(params=VARIANTS, scope="module")
def model(request):
    return contract_model(request.param)


def _layer(model):
    return model.cfg.layer_ids[-1]


def _small(model, seed=0, S=3, T=40):
    """An S-stream engine of the model's last layer and its oracle over T tokens."""
    L = _layer(model)
    ids, hid = variant_inputs(model, seed, (S, T))
    return model.stream(L, S), Oracle(model, L, ids, hid)


def _three_streams_after(model, seed, T, steps):
    """The last layer, 3 streams' inputs over T tokens and their oracle, and an engine that has
    stepped the first `steps` of them."""
    L = _layer(model)
    ids, hid = variant_inputs(model, seed, (3, T))
    want = model.forward(L, ids, hid[...])
    eng = model.stream(L, 3)
    for t in range(steps):
        eng.step(ids[:, t], hid[:, t])
    return L, ids, hid, want, eng


def _bad_hidden(model, S):
    """A hidden every call refuses: the wrong stream count (an input layer: any array at all)."""
    if model.variant.input_layer:
        return np.zeros((S, model.cfg.hidden_size), np.float32)
    return np.zeros((S + 1, model.cfg.hc_mult, model.cfg.hidden_size), np.float32)


# ---- reset ---------------------------------------------------------------------------------
def test_reset_one_stream_among_many(model):
    eng, o = _small(model, seed=4, S=5, T=60)
    for _ in range(10):
        o.step(eng)
    new_ids, new_hid = variant_inputs(model, 40, (1, 60))
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


def test_reset_all_and_single_stream(model):
    L = _layer(model)
    ids, hid = variant_inputs(model, 5, (3, 20))
    eng = model.stream(L, 3)
    want = model.forward(L, ids, hid[...])
    for t in range(20):
        eng.step(ids[:, t], hid[:, t])
    eng.reset()
    assert eng.tokens_seen.tolist() == [0, 0, 0]
    for t in range(20):  # the same sequences again, from the start
        close(eng.step(ids[:, t], hid[:, t]), want[:, t])
    one = model.stream(L)
    for t in range(7):
        one.step(int(ids[0, t]), hid[0, t])
    one.reset(0)
    for t in range(20):
        close(one.step(int(ids[0, t]), hid[0, t]), want[0, t])


def test_reset_one_stream_while_feed_pending(model):
    """After feed(ids), reset(0) must either be refused (RuntimeError, compute then finishes the
    token) or leave streams 1.. consistent: clearing `pending` for all streams after feed pushed the
    token into streams 1..'s hash windows would leave their next outputs matching neither the
    sequence with that token nor the one without it."""
    L, ids, hid, want, eng = _three_streams_after(model, seed=6, T=20, steps=5)
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
            ids = ids[:, skip]
            hid = hid if model.variant.input_layer else hid[:, skip]
            want = model.forward(L, ids, hid[...])
            t0 = 5
    for t in range(t0, t0 + 6):
        got = eng.step(ids[:, t], hid[:, t])
        close(got[1:], want[1:, t])


# ---- snapshot / restore ----------------------------------------------------------------------
def test_snapshot_restore_replays_exactly(model):
    L, ids, hid, want, eng = _three_streams_after(model, seed=7, T=40, steps=7)
    snap = eng.snapshot()
    assert isinstance(snap, EngineSnapshot) and snap.nbytes == eng.state_nbytes
    frozen = {k: getattr(snap, k).copy() for k in snap.names}
    first = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(7, 16)], 1)
    close(first, want[:, 7:16])
    for k, v in frozen.items():  # the snapshot is a copy, not a view of the engine's state
        np.testing.assert_array_equal(getattr(snap, k), v)
        assert not getattr(snap, k).flags.writeable
    eng.restore(snap)
    assert eng.tokens_seen.tolist() == [7, 7, 7]
    again = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(7, 16)], 1)
    np.testing.assert_array_equal(again, first)
    # into a second engine of the same model, layer and stream count
    other = model.stream(L, 3)
    other.restore(snap)
    np.testing.assert_array_equal(np.stack([other.step(ids[:, t], hid[:, t]) for t in range(7, 16)], 1), first)
    for t in range(16, 40):
        close(other.step(ids[:, t], hid[:, t]), want[:, t])
    # a snapshot can be restored repeatedly, also after a prefill changed the scratch
    eng.prefill(ids[1, 16:40], hid[1, 16:40], stream=1)
    eng.restore(snap)
    np.testing.assert_array_equal(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(7, 16)], 1), first)


def test_snapshot_of_another_layer_or_stream_count_refused_state_unchanged(model):
    eng, o = _small(model, seed=3)
    for _ in range(6):
        o.step(eng)
    good = eng.snapshot()
    foreign = [model.stream(o.L, 2).snapshot()]                                    # another stream count
    foreign += [model.stream(L, 3).snapshot() for L in model.cfg.layer_ids if L != o.L]   # another layer
    assert all(f.fingerprint != good.fingerprint for f in foreign)
    assert_foreign_snapshots_refused(eng, o, good, foreign)


def test_snapshot_between_feed_and_compute_refused(model):
    eng, o = _small(model, seed=10)
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


def test_restore_clears_pending(model):
    eng, o = _small(model, seed=11)
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
def test_feed_compute_equals_step_and_rows(model, S):
    L = _layer(model)
    ids, hid = variant_inputs(model, 8, (S, 25))
    want = model.forward(L, ids, hid[...])
    rows = model.plan.hash(ids)[L] + model.plan.offsets[L]           # [S, T, H] absolute rows
    np.testing.assert_array_equal(rows - model.plan.offsets[L], model.plan.hash_numpy(ids)[L])
    a, b = model.stream(L, S), model.stream(L, S)
    for t in range(25):
        single = S == 1 and t % 2
        tok = int(ids[0, t]) if single else ids[:, t]
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


def test_feed_compute_misuse(model):
    eng, o = _small(model, seed=12)
    ids, hid = o.now()
    with pytest.raises(RuntimeError):
        eng.compute(hid)                         # compute without feed
    eng.feed(ids)
    with pytest.raises(RuntimeError):
        eng.feed(ids)                            # feed twice
    with pytest.raises(RuntimeError):
        eng.step(ids, hid)                       # step while pending
    with pytest.raises(RuntimeError):
        eng.prefill(ids[:1], None if hid is None else hid[:1], stream=0)  # prefill while pending
    with pytest.raises(ValueError):
        eng.compute(_bad_hidden(model, 3))       # a bad hidden keeps the token pending
    assert eng.pending_compute
    out = np.empty(out_shape(model, 3), np.float32)
    assert eng.compute(hid, out=out) is out
    o.check(out)
    assert not eng.pending_compute
    for _ in range(3):
        o.step(eng)
    eng.feed(o.now()[0])
    eng.reset()                                  # reset() of everything drops the pending token
    assert not eng.pending_compute
    assert eng.tokens_seen.tolist() == [0, 0, 0]


# ---- threads ----------------------------------------------------------------------------------
def test_two_engines_in_two_threads(model):
    """Engines of one model (other layers and stream counts) stepping at once in their own
    threads give the bits each gives alone."""
    layers = model.cfg.layer_ids
    work = [(layers[0], 3) + variant_inputs(model, 20, (3, 300)),
            (layers[-1], 2) + variant_inputs(model, 21, (2, 300)),
            (layers[0], 1) + variant_inputs(model, 22, (1, 300))]
    solo = []
    for L, S, ids, hid in work:
        e = model.stream(L, S)
        solo.append(np.stack([e.step(ids[:, t], hid[:, t]) for t in range(300)], 1))
    for (L, S, ids, hid), s in zip(work, solo):   # the first 40 tokens against the oracle too
        close(s[:, :40], model.forward(L, ids[:, :40], None if model.variant.input_layer else hid[:, :40]))
    engines = [model.stream(L, S) for L, S, _, _ in work]  # created before the threads start
    results, errors = [None] * len(work), []
    barrier = threading.Barrier(len(work))

    def run(i):
        try:
            L, S, ids, hid = work[i]
            barrier.wait()
            out = np.empty(out_shape(model, S), np.float32)
            res = []
            for t in range(300):
                engines[i].step(ids[:, t], hid[:, t], out=out)
                res.append(out.copy())
            results[i] = np.stack(res, 1)
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


def test_one_engine_two_threads_busy_guard(model):
    """One engine, two threads. Thread A decodes a sequence (retrying its step when refused);
    thread B keeps calling step() with an out-of-vocab id, which either overlaps A's call
    (RuntimeError from the busy guard) or is rejected as a bad id (ValueError). Neither changes
    the state, so A's outputs must equal the single-thread run exactly, whatever the
    interleaving. A decodes the sequence again (after a reset) until the guard has fired: a
    small model's steps are short, and B's calls meet few of them."""
    T = 1000
    L = _layer(model)
    ids, hid = variant_inputs(model, 13, (2, T))
    solo = model.stream(L, 2)
    solo_out = np.stack([solo.step(ids[:, t], hid[:, t]) for t in range(T)], axis=1)
    close(solo_out[:, :50], model.forward(L, ids[:, :50], None if model.variant.input_layer else hid[:, :50]))
    eng = model.stream(L, 2)
    bad_ids = np.array([model.cfg.vocab_size, 0])
    bad_h = variant_hidden(model, np.random.default_rng(0), (2,))[...]
    b_running, done = threading.Event(), threading.Event()
    seen = {"A_refused": 0, "B_busy": 0, "B_bad": 0, "other": [], "rounds": 0, "differ": []}

    def A():
        try:
            b_running.wait(10)
            end = time.monotonic() + 60
            while not (seen["A_refused"] + seen["B_busy"]) and time.monotonic() < end:
                eng.reset()
                got = np.full_like(solo_out, np.nan)
                for t in range(T):
                    while True:
                        try:
                            got[:, t] = eng.step(ids[:, t], hid[:, t])
                            break
                        except RuntimeError:
                            seen["A_refused"] += 1
                            time.sleep(0)            # let B finish its call
                seen["rounds"] += 1
                if not np.array_equal(got, solo_out) or eng.tokens_seen.tolist() != [T, T]:
                    seen["differ"].append(seen["rounds"])
        finally:
            done.set()

    def B():
        while not done.is_set():
            try:
                eng.step(bad_ids, bad_h)
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
    assert not seen["other"] and not seen["differ"], seen
    assert seen["B_busy"] + seen["A_refused"] > 0, seen  # the guard fired at least once


def test_snapshot_during_concurrent_step_is_refused_or_consistent(model):
    """snapshot() while another thread's step() runs: refused (RuntimeError) or consistent: a
    snapshot after k tokens, restored into a fresh engine, steps on to the bits of the run that
    was never interrupted. (A snapshot outside the busy guard returned torn states: the hash
    window advanced, the conv ring and tokens_seen not.)"""
    L, T = _layer(model), 1000
    ids, hid = variant_inputs(model, 14, (2, T))
    solo = model.stream(L, 2)
    want = np.stack([solo.step(ids[:, t], hid[:, t]) for t in range(T)], 1)
    eng = model.stream(L, 2)
    b_running, done, snaps = threading.Event(), threading.Event(), []

    def A():
        b_running.wait(10)
        for t in range(T):
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
            b_running.set()
            done.wait(0.0001)

    threads = [threading.Thread(target=A), threading.Thread(target=B)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s in snaps:
        k = int(s.seen[0])
        assert s.seen.tolist() == [k, k], s.seen
        back = model.stream(L, 2)
        back.restore(s)
        for t in range(k, min(k + 3, T)):
            np.testing.assert_array_equal(back.step(ids[:, t], hid[:, t]), want[:, t])


# ---- work split over threads (step_threads, prefill_threads) ---------------------------------
@pytest.mark.parametrize("S", [2, 3, 5, 8, 17])
def test_step_threads_bitwise_equal_and_match_batch(model, S):
    ids, hid = variant_inputs(model, S, (S, 5))
    assert_step_threads_agree(model, _layer(model), ids, hid)


def test_step_threads_attribute(model):
    L = _layer(model)
    eng = model.stream(L, 4)
    assert eng.step_threads == 1  # the default
    for set_to, got in ((2, 2), (0, 1), (-7, 1), (16, 16), (17, 16), (10**9, 16), (3, 3)):
        eng.step_threads = set_to
        assert eng.step_threads == got
    assert model.stream(L, 4).step_threads == 1  # per engine
    assert 1 <= eng.prefill_threads <= 8  # default: the cores, at most 8
    for set_to, got in ((0, 1), (-7, 1), (10**20, 16), (3, 3)):
        eng.prefill_threads = set_to
        assert eng.prefill_threads == got
    one = model.stream(L)
    one.step_threads = 2  # accepted; one stream has nothing to split
    ids, hid = variant_inputs(model, 0, (1, 4))
    want = model.forward(L, ids, hid[...])[0]
    for t in range(4):
        close(one.step(int(ids[0, t]), hid[0, t]), want[t])


def test_prefill_threads_bitwise_equal(model):
    """The gathers, GEMM and tails of a prefill split over threads give the bits of one thread."""
    L = _layer(model)
    ids, hid = variant_inputs(model, 4, (1, 300))
    outs, states = [], []
    for th in (1, 2, 5):
        eng = model.stream(L, 2)
        eng.prefill_threads = th
        outs.append(eng.prefill(ids[0], hid[0], stream=1))
        states.append(engine_state(eng))
    close(outs[0], model.forward(L, ids, hid[...])[0])
    for o, st in zip(outs[1:], states[1:]):
        assert np.array_equal(o, outs[0])
        assert all(np.array_equal(a, b) for a, b in zip(st, states[0]))


# ---- steady-state allocation ---------------------------------------------------------------------
N_ALLOC = 2000


@pytest.fixture(scope="module")
def alloc_setup(model):
    """Everything allocated before the measured tests run (limit_memory counts the test body)."""
    L = _layer(model)
    rng = np.random.default_rng(15)
    one, multi = model.stream(L), model.stream(L, 4)
    one_toks = [int(x) for x in variant_ids(model, rng, (N_ALLOC,))]
    multi_ids = variant_ids(model, rng, (N_ALLOC, 4))
    one_h, multi_h = variant_hidden(model, rng, ())[...], variant_hidden(model, rng, (4,))[...]
    one_out, multi_out = np.empty(out_shape(model), np.float32), np.empty(out_shape(model, 4), np.float32)
    for t in range(10):  # warm up
        one.step(one_toks[t], one_h, out=one_out)
        multi.step(multi_ids[t], multi_h, out=multi_out)
    return dict(L=L, one=one, one_toks=one_toks, one_h=one_h, one_out=one_out,
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


def test_alloc_steady_state_results(model, alloc_setup):
    """The measured loops compute the right thing (checked on fresh engines)."""
    L, h = alloc_setup["L"], alloc_setup["one_h"]
    toks = np.array(alloc_setup["one_toks"][:30])
    hid = None if h is None else np.broadcast_to(h, (1, 30) + h.shape)
    want = model.forward(L, toks[None], hid)[0]
    eng, out = model.stream(L), np.empty(out_shape(model), np.float32)
    for t in range(30):
        close(eng.step(int(toks[t]), h, out=out), want[t])
