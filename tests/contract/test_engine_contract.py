"""The contract every streaming engine keeps, run on every variant (engine/_base.pyx holds it
once): the one-owner guard and a scalar id that lives in its call, out= never overlapping
hidden, the file check before every read (truncated or rewritten shards: FileChangedError, not
SIGBUS), rows after prefill/feed and before any token, snapshots (damage, fingerprints, a save
and load in between), a refused call leaving the state unchanged, reset.

Outputs are held to each variant's numpy oracle (EngramModel.forward); integers exactly."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engram_stream import EngineSnapshot, EngramModel
from engram_stream.errors import FileChangedError
from helpers.inputs import out_shape, stepped, variant_hidden, variant_ids, variant_inputs
from helpers.models import checkpoint_path, contract_model, contract_variants
from helpers.numeric import close

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

VARIANTS = contract_variants()   # every registered variant


def _model(variant, **kw):
    return contract_model(variant, **kw)


@pytest.fixture(params=VARIANTS, scope="module")
def model(request):
    return _model(request.param)


def _state(eng):
    s = eng.snapshot()
    return {k: getattr(s, k).copy() for k in s.names}


def _same_state(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- the one-owner guard, and the scalar id of a call ----------------------------------------------
def test_a_refused_call_inside_a_call_does_not_change_its_token(model):
    """step(tok, h) reads its id, then converts h; a refused step(other, bad) run meanwhile (from
    h.__array__) must not make it hash `other`: the scalar id lives in the call."""
    L = model.cfg.layer_ids[0]
    eng, ref = model.stream(L), model.stream(L)
    if model.variant.input_layer:
        # no hidden to convert, so no call runs inside one: a call refused for its hidden (an input
        # layer takes none) changes nothing, and the calls after it hash their own tokens
        for tok in (5, 6, 5):
            with pytest.raises(ValueError, match="takes no hidden"):
                eng.step(7, np.zeros((3, 3), np.float32))
            close(eng.step(tok), ref.step(tok))
            np.testing.assert_array_equal(eng.rows, ref.rows)
        return
    h = variant_hidden(model, np.random.default_rng(0), ())

    class Sneaky:
        def __array__(self, dtype=None, copy=None):
            with pytest.raises(ValueError):
                eng.step(7, np.zeros((3, 3), np.float32))  # refused: wrong shape
            return h

    for tok in (5, 6, 5):
        close(eng.step(tok, Sneaky()), ref.step(tok, h))
        np.testing.assert_array_equal(eng.rows, ref.rows)


def test_one_engine_two_threads_is_refused_not_corrupted(model):
    L = model.cfg.layer_ids[0]
    eng = model.stream(L, 2)
    ids, hid = variant_inputs(model, 1, (2, 40))
    want = model.forward(L, ids, hid[...])
    refused, done, errors = [0], threading.Event(), []

    def intruder():
        while not done.is_set():
            try:
                eng.step(np.array([1, 2]), np.zeros((2, 3), np.float32))  # always refused
            except RuntimeError:
                refused[0] += 1
            except ValueError:
                pass

    t = threading.Thread(target=intruder)
    t.start()
    try:
        for p in range(40):
            while True:
                try:
                    got = eng.step(ids[:, p], hid[:, p])
                    break
                except RuntimeError:
                    continue
            close(got, want[:, p])
    finally:
        done.set()
        t.join()


# ---- out= and hidden ------------------------------------------------------------------------------
def test_out_overlapping_hidden_is_refused_and_changes_nothing(model):
    L = model.cfg.layer_ids[0]
    G, D = model.cfg.hc_mult, model.cfg.hidden_size
    ids, hid = variant_inputs(model, 2, (3, 4))
    eng = stepped(model, L, ids, hid, 1)
    before = _state(eng)
    if model.variant.input_layer:   # no hidden to overlap: out= alone, written in place
        out = np.empty(out_shape(model, 3), np.float32)
        assert eng.step(ids[:, 1], out=out) is out
        close(out, model.forward(L, ids)[:, 1])
        return
    buf = np.zeros(4 * G * D, np.float32)
    h = buf[:3 * G * D].reshape(3, G, D)
    h[...] = hid[:, 1]
    for out in (h, buf[G * D // 2:G * D // 2 + 3 * G * D].reshape(3, G, D)):
        with pytest.raises(ValueError, match="overlap"):
            eng.step(ids[:, 1], h, out=out)
    pbuf = np.zeros(4 * G * D, np.float32)
    ph = pbuf[:3 * G * D].reshape(3, G, D)
    with pytest.raises(ValueError, match="overlap"):
        eng.prefill(ids[0, 1:4], ph, out=pbuf[G * D:].reshape(3, G, D))
    with pytest.raises(ValueError, match="overlap"):
        eng.step_packed(ids[:, 1], h, [0, 1, 2], [1, 1, 1], out=h)
    assert _same_state(_state(eng), before)
    close(eng.step(ids[:, 1], h, out=np.empty((3, G, D), np.float32)), model.forward(L, ids, hid)[:, 1])


# ---- files changed under a mapped model -------------------------------------------------------------
def _saved(variant, tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    m = _model(variant)
    path = checkpoint_path(m, tmp_path)
    m.save(path)
    return EngramModel.load(path, mmap=True), path


def _files(path):
    return [path] if os.path.isfile(path) else sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


CALLS = {
    "step": lambda m, e, L, ids, h: e.step(int(ids[0]), None if h is None else h[0]),
    "prefill": lambda m, e, L, ids, h: e.prefill(ids, h),
    "packed": lambda m, e, L, ids, h: e.step_packed(ids, h, [0], [len(ids)]),
    "feed": lambda m, e, L, ids, h: e.feed(int(ids[0])),
    "forward": lambda m, e, L, ids, h: m.forward(L, ids[None], None if h is None else h[None]),
    "decoder": lambda m, e, L, ids, h: m.decoder().begin(int(ids[0])),
    "save": lambda m, e, L, ids, h: m.save(OUT[0]),
}
OUT = [None]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("how", ["truncated", "rewritten"])
def test_a_changed_file_is_refused_by_every_call(variant, how, tmp_path):
    """Every call that reads a mapped table (or, V4.1, any shard it maps) refuses a file
    truncated (SIGBUS otherwise) or rewritten in place (mixed tables otherwise), for every
    file of the checkpoint, and works again on a fresh load."""
    rng = np.random.default_rng(4)
    for victim in range(len(_files(_saved(variant, tmp_path / "probe")[1]))):
        d = tmp_path / f"v{victim}"
        m, path = _saved(variant, d)
        f = _files(path)[victim]
        from engram_stream.io.files import mapping_of  # the layer whose engine reads that file
        L = next(L for L in m.cfg.layer_ids
                 if any(getattr(mapping_of(a), "path", None) == str(f) for a in m.layer(L).file_arrays()))
        ids, h = variant_ids(m, rng, (6,)), variant_hidden(m, rng, (6,))
        engines = {name: m.stream(L) for name in CALLS}
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            if how == "truncated":
                fh.truncate(size // 2)
            else:
                fh.seek(size - 1)
                fh.write(b"\x7f")
        for name, call in CALLS.items():
            e = engines[name]
            OUT[0] = checkpoint_path(m, d, "copy")
            with pytest.raises(FileChangedError, match=str(f.name)):
                call(m, e, L, ids, h[...])
            if name != "forward" and name != "save":
                assert not e.pending_compute


# ---- rows ---------------------------------------------------------------------------------------------
def test_rows_before_any_token_after_prefill_and_after_feed(model):
    L, H = model.cfg.layer_ids[-1], model.cfg.n_heads
    eng = model.stream(L, 2)
    np.testing.assert_array_equal(eng.rows, np.full((2, H), -1))  # no token yet: -1, not garbage
    ids, hid = variant_inputs(model, 5, (1, 300))  # more than one chunk
    want = model.plan.hash_numpy(ids)[L][0] + model.plan.offsets[L]
    eng.prefill(ids[0, :9], hid[0, :9], stream=1)
    np.testing.assert_array_equal(eng.rows[1], want[8])               # the LAST token's rows
    np.testing.assert_array_equal(eng.rows[0], np.full(H, -1))        # stream 0 untouched
    eng.prefill(ids[0], hid[0], stream=0)
    np.testing.assert_array_equal(eng.rows[0], want[-1])
    np.testing.assert_array_equal(eng.rows[1], want[8])               # stream 1 untouched
    eng.reset(1)
    np.testing.assert_array_equal(eng.rows[1], np.full(H, -1))
    one = model.stream(L)
    one.feed(int(ids[0, 0]))
    np.testing.assert_array_equal(one.rows[0], want[0])               # known at feed, before compute
    one.compute(hid[0, 0])


# ---- snapshots ------------------------------------------------------------------------------------------
def test_snapshot_damage_and_foreign_snapshots_are_refused_state_unchanged(model):
    L = model.cfg.layer_ids[0]
    ids, hid = variant_inputs(model, 6, (3, 8))
    eng = stepped(model, L, ids, hid, 3)
    good = eng.snapshot()
    arrays = {k: getattr(good, k) for k in good.names}
    bad = [model.stream(L, 2).snapshot(), "nope"]
    if len(model.cfg.layer_ids) > 1:   # another layer's (longcat-flash-lite has one layer)
        bad.append(model.stream(model.cfg.layer_ids[-1], 3).snapshot())
    for k, a in arrays.items():
        bad.append(EngineSnapshot(good.fingerprint, **{**arrays, k: a.astype(np.float64)}))
        bad.append(EngineSnapshot(good.fingerprint, **{**arrays, k: a[:-1].copy()}))
    bad.append(EngineSnapshot(good.fingerprint, **{**arrays, "seen": -np.ones(3, np.int64)}))
    bad.append(EngineSnapshot(good.fingerprint, **{**arrays, "rows": np.full_like(arrays["rows"], 1 << 40)}))
    for p in range(3, 5):
        eng.step(ids[:, p], hid[:, p])
    before = _state(eng)
    for b in bad:
        with pytest.raises((ValueError, TypeError)):
            eng.restore(b)
        assert _same_state(_state(eng), before)
    eng.restore(good)
    close(np.stack([eng.step(ids[:, p], hid[:, p]) for p in range(3, 8)], 1), model.forward(L, ids, hid[...])[:, 3:8])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_snapshot_restores_into_the_same_model_saved_and_loaded(variant, tmp_path):
    """The fingerprint is the model's semantics: a V4.1 save adds the declared sizes to its
    config.json, and the reloaded model must still take the snapshot."""
    m = _model(variant)
    L = m.cfg.layer_ids[0]
    ids, hid = variant_inputs(m, 7, (1, 10))
    eng = m.stream(L)
    for p in range(4):
        eng.step(int(ids[0, p]), hid[0, p])
    snap = eng.snapshot()
    path = checkpoint_path(m, tmp_path)
    m.save(path)
    back = EngramModel.load(path).stream(L)
    back.restore(snap)
    close(np.stack([back.step(int(ids[0, p]), hid[0, p]) for p in range(4, 10)]), m.forward(L, ids, hid[...])[0, 4:])


# ---- refused calls, reset --------------------------------------------------------------------------------
def test_refused_calls_change_nothing(model):
    L = model.cfg.layer_ids[0]
    V = model.cfg.vocab_size
    G, D = model.cfg.hc_mult, model.cfg.hidden_size
    ids, hid = variant_inputs(model, 8, (2, 6))
    eng = stepped(model, L, ids, hid, 1)
    before = _state(eng)
    inp = model.variant.input_layer
    h2 = None if inp else np.zeros((2, G, D), np.float32)
    h1, h3 = (None, None) if inp else (np.zeros((1, G, D), np.float32), np.zeros((3, G, D), np.float32))
    for call in [lambda: eng.step(np.array([1, V]), h2),                       # id past the vocab
                 lambda: eng.step(np.array([1, 2]), np.zeros((2, G, D + 1))),  # hidden shape (an input layer: any)
                 lambda: eng.step(np.array([1, 2]), np.zeros((2, G, D), np.int64)),  # hidden dtype
                 lambda: eng.step(np.array([1, 2]), None if not inp else np.zeros((2, D), np.float32)),
                 lambda: eng.prefill(np.array([1, V, 2]), h3),
                 lambda: eng.prefill(np.array([1]), h1, stream=2),
                 lambda: eng.step_packed(np.array([1, 2]), h2, [0, 0], [1, 1]),   # a slot twice
                 lambda: eng.step_packed(np.array([1, 2]), h2, [0, 2], [1, 1]),   # no such slot
                 lambda: eng.step_packed(np.array([1, 2]), h2, [0, 1], [2, 1]),   # lengths != N
                 lambda: eng.step_packed(np.array([1, 2]), h2, [0, 1], [2, 0]),   # an empty segment
                 lambda: eng.step_packed(np.array([1, V]), h2, [0, 1], [1, 1]),
                 lambda: eng.commit([1, 1]),                                       # no draft
                 lambda: eng.compute(h2)]:                                         # nothing fed
        with pytest.raises((ValueError, IndexError, TypeError, RuntimeError)):
            call()
        assert _same_state(_state(eng), before) and not eng.pending_compute
    close(eng.step(ids[:, 1], hid[:, 1]), model.forward(L, ids, hid[...])[:, 1])


def test_reset_one_stream_and_all(model):
    L = model.cfg.layer_ids[0]
    ids, hid = variant_inputs(model, 9, (2, 10))
    eng = stepped(model, L, ids, hid, 5)
    eng.reset(0)
    assert eng.tokens_seen.tolist() == [0, 5]
    got = np.stack([eng.step(ids[:, p], hid[:, p]) for p in range(5, 10)], 1)
    close(got[0], model.forward(L, ids[:1, 5:], hid[:1, 5:])[0])
    close(got[1], model.forward(L, ids[1:], hid[1:])[0, 5:])
    eng.feed(ids[:, 0])
    eng.reset()  # every stream, and the fed token
    assert not eng.pending_compute and eng.tokens_seen.tolist() == [0, 0]
    close(eng.step(ids[:, 0], hid[:, 0]), model.forward(L, ids[:, :1], hid[:, :1])[:, 0])


def test_repr_names_the_kernel_path(model):
    from engram_stream.engine.isa import ISA_NAMES
    r = repr(model.stream(model.cfg.layer_ids[0]))
    assert any(f"'{name}'" in r for name in ISA_NAMES), r


def test_engines_of_both_variants_share_one_base():
    from engram_stream.engine._base import EngineBase
    for variant in VARIANTS:
        m = _model(variant)
        assert isinstance(m.stream(m.cfg.layer_ids[0]), EngineBase)


def test_every_engine_keeps_its_plans_history_rule():
    """A variant's engine hashes through the window of its plan's history rule (the engine's
    _window_class); an engine given a model whose plan has another rule refuses it, naming both,
    instead of hashing with the wrong rule (or, before it, the variant's own check of the model)."""
    engines = {}
    for variant in VARIANTS:
        m = _model(variant)
        eng = m.stream(m.cfg.layer_ids[0])
        assert type(eng)._window_class().history == m.plan.history, variant
        engines[m.plan.history] = (type(eng), m)
    for rule, (cls, _) in engines.items():
        for other, (_, m) in engines.items():
            if other != rule and cls._window_class().history != m.plan.history:
                with pytest.raises(ValueError, match=f"keeps the '{rule}' history rule but the model's plan has "
                                                     f"'{other}'|needs a "):
                    cls(m, m.cfg.layer_ids[0])
    assert {"plain", "dead", "separator"} <= set(engines), sorted(engines)

