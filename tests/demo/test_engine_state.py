"""The engine's state rules and its hardening (DESIGN.md 7, the streaming engines): state in
typed memoryviews, checks before state, refused calls that change nothing."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from engram_stream import EngineSnapshot, EngramConfig
from engram_stream._hash import MAX_KERNEL_SIZE
from helpers.models import make_model
from helpers.numeric import close
from helpers.inputs import random_inputs as inputs

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang


# ---- 1. config values bounded by what the kernels support ----------------------------------------
def test_huge_kernel_size_refused_by_the_config():
    """kernel_size 2,000,000 crashed step() with SIGSEGV (its taps sized a C stack array)."""
    with pytest.raises(ValueError, match="kernel_size"):
        EngramConfig(kernel_size=2_000_000)
    with pytest.raises(ValueError, match="kernel_size"):
        EngramConfig(kernel_size=MAX_KERNEL_SIZE + 1)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        EngramConfig(hidden_size=1 << 30, hc_mult=4)


def test_largest_kernel_size_matches_the_oracle():
    """At the bound the engine still equals the batch path (taps on the heap, not the stack)."""
    model = make_model(G=1, n=2, K=MAX_KERNEL_SIZE, D=8, nh=1, hd=8, layers=(1,), seed=5)
    ids, hid = inputs(model, 1, 6, np.random.default_rng(1))
    want = model.forward(1, ids, hid)[0]
    eng = model.stream(1)
    close(np.stack([eng.step(int(ids[0, t]), hid[0, t]) for t in range(6)]), want)
    close(model.stream(1).prefill(ids[0], hid[0]), want)


# ---- 2. nothing stored before the one-owner guard ---------------------------------------------------
def test_refused_call_on_another_thread_does_not_change_the_token():
    """Thread B's refused step(999, bad_hidden) / feed made thread A hash 999: the scalar id
    was stored in the engine before the guard. A's rows must always be those of its token."""
    model = make_model(G=1, n=2, K=2, D=8, nh=2, hd=4, vocab=1000, layers=(1,), seed=2)
    eng = model.stream(1)
    h = np.zeros((1, 8), np.float32)
    eng.step(5, h)
    eng.feed(5)
    want = eng.rows.copy()       # the window is (5, 5) from here on
    eng.compute(h)
    bad = np.zeros((3, 3), np.float32)
    stop, wrong = threading.Event(), []

    def intruder():
        while not stop.is_set():
            for call in (lambda: eng.step(999, bad), lambda: eng.feed(999), lambda: eng.step(999, h[0])):
                try:
                    call()
                except (ValueError, RuntimeError):
                    pass

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: widen any race
    b = threading.Thread(target=intruder)
    b.start()
    try:
        for _ in range(1000):
            try:
                eng.feed(5)
            except RuntimeError:  # the intruder holds the engine right now
                continue
            if not np.array_equal(eng.rows, want):
                wrong.append(eng.rows.copy())
            eng.compute(h)
    finally:
        stop.set()
        b.join()
        sys.setswitchinterval(old)
    assert not wrong, f"{len(wrong)} steps hashed another thread's refused token"


def test_refused_call_inside_a_call_does_not_change_its_token():
    """The same race made deterministic: a refused step(999, ...) runs while step(5, ...)
    converts its hidden (after it read its id, before the guard): 5 must be hashed."""
    model = make_model(G=1, n=2, K=2, D=8, nh=2, hd=4, vocab=1000, layers=(1,), seed=2)
    eng, ref = model.stream(1), model.stream(1)
    h = np.zeros((1, 8), np.float32)

    class Sneaky:
        def __array__(self, dtype=None, copy=None):
            with pytest.raises(ValueError):
                eng.step(999, np.zeros((3, 3), np.float32))  # refused: wrong shape
            return h

    for tok in (5, 6):
        got = eng.step(tok, Sneaky())
        close(got, ref.step(tok, h))
        np.testing.assert_array_equal(eng.rows, ref.rows)


# ---- 4. restore reads the snapshot once ----------------------------------------------------------
class _Shifty(EngineSnapshot):
    """A snapshot whose pos is good on the first reads (where checks look) and out of the ring
    after them (where a second read would copy from)."""

    def __init__(self, snap, bad_pos):
        super().__init__(snap.fingerprint, hist=snap.hist, ring=snap.ring, pos=snap.pos, seen=snap.seen)
        self._reads, self._good, self._bad = 0, snap.pos, bad_pos

    @property
    def pos(self):
        self._reads += 1
        return self._good if self._reads <= 3 else self._bad

    @pos.setter
    def pos(self, v):
        pass


def test_restore_reads_the_snapshot_once():
    model = make_model(G=2, n=3, K=3, D=13, seed=3)
    ids, hid = inputs(model, 2, 10, np.random.default_rng(0))
    eng = model.stream(4, 2)
    for t in range(4):
        eng.step(ids[:, t], hid[:, t])
    snap = eng.snapshot()
    for t in range(4, 7):
        eng.step(ids[:, t], hid[:, t])
    shifty = _Shifty(snap, np.full(2, 10 ** 9, np.int64))
    eng.restore(shifty)
    np.testing.assert_array_equal(eng.snapshot().pos, snap.pos)  # what was checked is what is in
    want = model.forward(4, ids, hid)
    close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(4, 10)]), want[:, 4:10].transpose(1, 0, 2, 3))


# ---- 6. rows: defined before any token, the last token's after prefill ---------------------------
def test_rows_before_any_token_and_after_prefill():
    model = make_model(G=2, n=3, K=3, D=13, comp=True, seed=3)
    L, H = 4, model.cfg.n_heads
    eng = model.stream(L, 2)
    np.testing.assert_array_equal(eng.rows, np.full((2, H), -1))  # no token yet: -1, not garbage
    ids, hid = inputs(model, 1, 9, np.random.default_rng(4))
    want = model.plan.hash_numpy(ids)[L][0] + model.plan.offsets[L]    # [T, H] absolute rows
    eng.prefill(ids[0], hid[0], stream=1)
    np.testing.assert_array_equal(eng.rows[1], want[-1])               # the LAST token's rows
    np.testing.assert_array_equal(eng.rows[0], np.full(H, -1))
    snap = eng.snapshot()
    eng.reset(1)
    np.testing.assert_array_equal(eng.rows[1], np.full(H, -1))
    eng.restore(snap)
    np.testing.assert_array_equal(eng.rows[1], want[-1])
    long_ids, long_hid = inputs(model, 1, 300, np.random.default_rng(5))  # more than one chunk
    eng.prefill(long_ids[0], long_hid[0], stream=0)
    np.testing.assert_array_equal(eng.rows[0], model.plan.hash_numpy(long_ids)[L][0, -1] + model.plan.offsets[L])


# ---- 7. out= overlapping hidden --------------------------------------------------------------------
def test_out_overlapping_hidden_is_refused_and_changes_nothing():
    model = make_model(G=2, n=3, K=3, D=13, seed=3)
    G, D = 2, 13
    ids, hid = inputs(model, 3, 4, np.random.default_rng(0))
    eng = model.stream(4, 3)
    eng.step(ids[:, 0], hid[:, 0])
    before = eng.snapshot()
    buf = np.zeros(4 * G * D, np.float32)
    h = buf[:3 * G * D].reshape(3, G, D)
    h[...] = hid[:, 1]
    for out in (h, buf[G * D // 2:G * D // 2 + 3 * G * D].reshape(3, G, D)):   # same, shifted
        with pytest.raises(ValueError, match="overlap"):
            eng.step(ids[:, 1], h, out=out)
    T = 3
    pbuf = np.zeros((T + 1) * G * D, np.float32)
    ph = pbuf[:T * G * D].reshape(T, G, D)
    ph[...] = hid[0, 1:4]
    with pytest.raises(ValueError, match="overlap"):
        eng.prefill(ids[0, 1:4], ph, out=pbuf[G * D:].reshape(T, G, D))
    after = eng.snapshot()
    for k in ("hist", "ring", "pos", "seen", "rows"):
        np.testing.assert_array_equal(getattr(after, k), getattr(before, k))
    got = eng.step(ids[:, 1], h, out=np.empty((3, G, D), np.float32))  # a separate out works
    close(got, model.forward(4, ids, hid)[:, 1])


# ---- the borrowed arrays are checked once, at construction ---------------------------------------
def test_engine_refuses_model_arrays_of_the_wrong_dtype_or_shape():
    model = make_model(G=2, n=3, K=3, D=13, seed=3)
    w = model.layer(4)
    good = w.norm1
    for bad in (good.astype(np.float64), good[:, :-1].copy(), np.asfortranarray(good)):
        w.norm1 = bad
        with pytest.raises(ValueError, match="norm1"):
            model.stream(4)
    w.norm1 = good
    model.stream(4)
