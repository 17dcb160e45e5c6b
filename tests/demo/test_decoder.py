"""Decoder (engram_stream/engine/decoder.py) and the engine hooks it drives (feed/compute,
prefetch, track_rows), against per-layer engines and the numpy batch path.

The oracle is EngramModel.forward; a decoder's layer output must also equal,
bit for bit, a standalone StreamEngine of that layer stepped with the same inputs
(the decoder only splits step() into feed() and compute()).
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers.numeric import close
from helpers.models import make_model as shared_make_model

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

LAYERS = (1, 4, 9)


def make_model(layers=LAYERS, comp=True, **kw):
    """helpers.models.make_model with three layers and a dense compression map by default."""
    return shared_make_model(layers=layers, comp=comp, **kw)


def inputs(model, S, T, seed):
    """ids int64[S, T] (a few negative) and {layer: hidden float32[S, T, G, D]}; the expected
    outputs {layer: float32[S, T, G, D]}."""
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    ids = rng.integers(-2, cfg.vocab_size, (S, T)).astype(np.int64)
    hid = {L: rng.standard_normal((S, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
           for L in cfg.layer_ids}
    want = {L: model.forward(L, ids, hid[L]) for L in cfg.layer_ids}
    return ids, hid, want


def decoding(S, T, seed, steps=0, **kw):
    """make_model(seed=seed, **kw), its inputs(S, T, seed) and a decoder of S streams that has
    decoded tokens [0, steps) through run_tokens: (model, dec, ids, hid, want)."""
    model = make_model(seed=seed, **kw)
    ids, hid, want = inputs(model, S, T, seed=seed)
    dec = model.decoder(S)
    run_tokens(dec, ids, hid, want, range(steps), S)
    return model, dec, ids, hid, want


def tok(ids, t, S):
    """The token argument of step t: a scalar for one stream, ids[S] otherwise."""
    return ids[0, t] if S == 1 else ids[:, t]


def hsel(h, t, S):
    return h[0, t] if S == 1 else h[:, t]


def run_tokens(dec, ids, hid, want, ts, S):
    """Decode tokens ts through begin/layer and check every layer against the batch path."""
    for t in ts:
        dec.begin(tok(ids, t, S))
        for L in dec.layers:
            close(dec.layer(L, hsel(hid[L], t, S)), hsel(want[L], t, S))
        assert dec.pending() == []


# ---- begin / layer ------------------------------------------------------------------------------
@pytest.mark.parametrize("S", [1, 3])
def test_begin_layer_equals_engines_and_batch(S):
    model, dec, ids, hid, want = decoding(S, 30, seed=1)
    assert dec.layers == LAYERS and dec.n_streams == S
    engines = {L: model.stream(L, S) for L in LAYERS}
    for t in range(30):
        dec.begin(tok(ids, t, S))
        assert dec.pending() == list(LAYERS)
        order = LAYERS if t % 2 else LAYERS[::-1]      # layers may run in any order
        for i, L in enumerate(order):
            h = hsel(hid[L], t, S)
            if t % 3 == 0:
                out = np.empty(h.shape, np.float32)
                assert dec.layer(L, h, out=out) is out
            else:
                out = dec.layer(L, h)
            np.testing.assert_array_equal(out, engines[L].step(tok(ids, t, S), h))
            close(out, hsel(want[L], t, S))
            assert dec.pending() == [x for x in LAYERS if x not in order[:i + 1]]
    for L in LAYERS:
        assert dec.engines[L].tokens_seen.tolist() == [30] * S


def test_step_dict_equals_batch():
    model, dec, ids, hid, want = decoding(2, 20, seed=2, G=3, D=8, n=4, K=2)
    for t in range(20):
        outs = dec.step(ids[:, t], {L: hid[L][:, t] for L in LAYERS})
        assert sorted(outs) == sorted(LAYERS)
        for L in LAYERS:
            close(outs[L], want[L][:, t])
    with pytest.raises(ValueError):
        dec.step(ids[:, 0], {1: hid[1][:, 0]})            # missing layers: nothing begun
    assert dec.pending() == []
    with pytest.raises(ValueError):
        dec.step(ids[:, 0], {**{L: hid[L][:, 0] for L in LAYERS}, 2: hid[1][:, 0]})
    assert dec.pending() == []


def test_begin_twice_names_the_layers_and_misuse():
    model, dec, ids, hid, want = decoding(1, 12, seed=3, steps=4)
    dec.begin(ids[0, 4])
    close(dec.layer(4, hid[4][0, 4]), want[4][0, 4])
    with pytest.raises(RuntimeError) as exc:
        dec.begin(ids[0, 5])
    assert "[1, 9]" in str(exc.value), str(exc.value)
    with pytest.raises(RuntimeError):
        dec.layer(4, hid[4][0, 4])                          # layer 4 already ran for this token
    with pytest.raises(KeyError):
        dec.layer(2, hid[4][0, 4])                          # not an Engram layer
    with pytest.raises(RuntimeError):
        dec.prefill(ids[0, :2], {L: hid[L][0, :2] for L in LAYERS})
    with pytest.raises(RuntimeError):
        dec.snapshot()
    assert dec.pending() == [1, 9]
    for L in (9, 1):
        close(dec.layer(L, hid[L][0, 4]), want[L][0, 4])
    run_tokens(dec, ids, hid, want, range(5, 12), 1)


def test_begin_bad_id_changes_nothing():
    model, dec, ids, hid, want = decoding(3, 10, seed=4, steps=3)
    for bad in (np.array([0, model.cfg.vocab_size, 1]), np.array([1, 2]), 5, np.array([1.0, 2.0, 3.0])):
        with pytest.raises((ValueError, TypeError)):
            dec.begin(bad)
        assert dec.pending() == []
    for L in LAYERS:
        assert dec.engines[L].tokens_seen.tolist() == [3, 3, 3]
    run_tokens(dec, ids, hid, want, range(3, 10), 3)


class _Flaky:
    """An array-like whose value changes between reads: a valid id first, then one past the vocab."""

    def __init__(self, good, bad):
        self.values = [good, bad]

    def __array__(self, dtype=None, copy=None):
        v = self.values[0] if len(self.values) == 1 else self.values.pop(0)
        return np.array([v], dtype=dtype or np.int64)


def test_begin_is_all_or_nothing():
    """The ids are read once and checked for every layer before any layer is fed: a value
    that changes between reads cannot leave some layers fed and the others not."""
    model, dec, ids, hid, want = decoding(1, 6, seed=4, steps=3)
    try:
        dec.begin(_Flaky(int(ids[0, 3]), model.cfg.vocab_size + 5))
    except ValueError:
        assert dec.pending() == []                          # refused: no layer fed
        dec.begin(ids[0, 3])
    assert dec.pending() == list(LAYERS)                    # accepted: every layer fed, the same id
    for L in LAYERS:
        close(dec.layer(L, hid[L][0, 3]), want[L][0, 3])
    run_tokens(dec, ids, hid, want, range(4, 6), 1)


def test_decoder_errors_name_its_own_calls():
    """Errors speak of begin()/layer() (the decoder's calls), not of the engines' feed()/compute();
    a list where the per-layer dict belongs is a TypeError that says so."""
    model, dec, ids, hid, want = decoding(1, 3, seed=5)
    h = hid[1][0, 0]

    def refused(exc_type, call, *words):
        with pytest.raises(exc_type) as e:
            call()
        msg = str(e.value)
        assert all(w in msg for w in words) and "feed()" not in msg and "compute(" not in msg, msg

    refused(RuntimeError, lambda: dec.layer(1, h), "begin(")
    dec.begin(ids[0, 0])
    refused(RuntimeError, lambda: dec.snapshot(), "layer(")
    refused(RuntimeError, lambda: dec.reset(0), "layer(")
    for L in LAYERS:
        close(dec.layer(L, hid[L][0, 0]), want[L][0, 0])
    refused(RuntimeError, lambda: dec.layer(1, h), "begin(")    # layer 1 already ran for this token
    refused(TypeError, lambda: dec.step(5, [h, h]), "dict")
    refused(TypeError, lambda: dec.prefill([5], [h[None]]), "dict")
    refused(TypeError, lambda: dec.restore([1, 2]), "snapshot")
    assert dec.pending() == []
    run_tokens(dec, ids, hid, want, range(1, 3), 1)


def test_decoder_construction():
    model = make_model(seed=5)
    with pytest.raises(ValueError):
        model.decoder(prefetch="sometimes")
    with pytest.raises(ValueError):
        model.decoder(n_streams=0)
    assert model.decoder(prefetch=False).prefetch is False
    dec = model.decoder()
    assert dec.prefetch is True   # asks every begin; in-RAM tables: the source has nothing to page in
    assert all(not dec.engines[L].row_source.paged for L in LAYERS)


# ---- prefill ---------------------------------------------------------------------------------
@pytest.mark.parametrize("T0", [1, 150])
def test_prefill_then_step(T0):
    model, dec, ids, hid, want = decoding(2, T0 + 15, seed=6, K=4)
    for s in (1, 0):  # each stream's prompt, one at a time
        outs = dec.prefill(ids[s, :T0], {L: hid[L][s, :T0] for L in LAYERS}, stream=s)
        for L in LAYERS:
            close(outs[L], want[L][s, :T0])
    run_tokens(dec, ids, hid, want, range(T0, T0 + 15), 2)
    for L in LAYERS:
        assert dec.engines[L].tokens_seen.tolist() == [T0 + 15] * 2
    with pytest.raises(ValueError):
        dec.prefill(ids[0, :2], {1: hid[1][0, :2]})


def test_prefill_single_stream_after_steps():
    model, dec, ids, hid, want = decoding(1, 60, seed=7, steps=5, n=2, K=5)
    outs = dec.prefill(ids[0, 5:40], {L: hid[L][0, 5:40] for L in LAYERS})
    for L in LAYERS:
        close(outs[L], want[L][0, 5:40])
    run_tokens(dec, ids, hid, want, range(40, 60), 1)


# ---- reset / snapshot / restore ----------------------------------------------------------------------
def test_reset_one_stream_and_all():
    model, dec, ids, hid, want = decoding(3, 24, seed=8, steps=8)
    dec.reset(1)
    for L in LAYERS:
        assert dec.engines[L].tokens_seen.tolist() == [8, 0, 8]
    # stream 1 replays its sequence from the start while 0 and 2 go on
    for t in range(8, 24):
        r = np.array([t, t - 8, t])
        dec.begin(ids[[0, 1, 2], r])
        for L in LAYERS:
            close(dec.layer(L, hid[L][[0, 1, 2], r]), want[L][[0, 1, 2], r])
    dec.reset()
    run_tokens(dec, ids, hid, want, range(10), 3)


def test_snapshot_restore_replay_exact():
    model, dec, ids, hid, want = decoding(2, 30, seed=9, steps=6, G=1, D=24)
    snap = dec.snapshot()
    assert sorted(snap) == sorted(LAYERS)

    def play(d, ts):
        return [d.step(ids[:, t], {L: hid[L][:, t] for L in LAYERS}) for t in ts]

    first = play(dec, range(6, 18))
    dec.restore(snap)
    again = play(dec, range(6, 18))
    other = model.decoder(2)
    other.restore(snap)
    third = play(other, range(6, 18))
    for a, b, c in zip(first, again, third):
        for L in LAYERS:
            np.testing.assert_array_equal(a[L], b[L])
            np.testing.assert_array_equal(a[L], c[L])
    run_tokens(other, ids, hid, want, range(18, 30), 2)


def test_a_decoder_snapshot_is_a_type_of_its_own_as_an_engines_is():
    """engine.snapshot() gave an EngineSnapshot, decoder.snapshot() a bare dict: the decoder's is
    a DecoderSnapshot, a read-only mapping of layer -> EngineSnapshot, and restore() takes it."""
    from engram_stream import DecoderSnapshot, EngineSnapshot
    model, dec, ids, hid, want = decoding(2, 12, seed=12, steps=4)
    snap = dec.snapshot()
    assert type(snap) is DecoderSnapshot and not isinstance(snap, dict)
    assert sorted(snap) == sorted(LAYERS) and len(snap) == len(LAYERS) and snap.layers == list(dec.engines)
    assert all(isinstance(snap[L], EngineSnapshot) for L in LAYERS)
    assert snap.nbytes == sum(snap[L].nbytes for L in LAYERS) > 0
    assert repr(snap) == f"DecoderSnapshot(layers={list(dec.engines)}, n_streams=2, {snap.nbytes} bytes)"
    with pytest.raises(TypeError):
        snap[LAYERS[0]] = None                             # read-only
    with pytest.raises(TypeError, match="EngineSnapshot"):
        DecoderSnapshot({1: "not a snapshot"})
    run_tokens(dec, ids, hid, want, range(4, 8), 2)
    dec.restore(snap)                                      # back to 4 tokens, then the same outputs again
    for L in LAYERS:
        assert dec.engines[L].tokens_seen.tolist() == [4, 4]
    run_tokens(dec, ids, hid, want, range(4, 12), 2)
    dec.restore(dict(snap))                                # a plain {layer: EngineSnapshot} is taken too
    run_tokens(dec, ids, hid, want, range(4, 6), 2)
    with pytest.raises(TypeError, match="DecoderSnapshot"):
        dec.restore(snap[LAYERS[0]])                       # one layer's snapshot is not a decoder's


def test_restore_checks_every_layer_before_changing_any():
    model, dec, ids, hid, want = decoding(2, 20, seed=10, steps=3)
    old = dec.snapshot()                                   # valid, but 3 tokens old
    run_tokens(dec, ids, hid, want, range(3, 8), 2)
    foreign = make_model(seed=10, D=14).decoder(2).snapshot()
    mixed = {1: old[1], 4: old[4], 9: foreign[9]}
    for bad in (mixed, {1: old[1], 4: old[4]}, {**old, 2: old[1]}, [old[L] for L in LAYERS], None,
                {1: old[1], 4: old[4], 9: None}, model.decoder(3).snapshot()):
        with pytest.raises((ValueError, TypeError)):
            dec.restore(bad)
    for L in LAYERS:  # layers 1 and 4 were not rolled back to `old`
        assert dec.engines[L].tokens_seen.tolist() == [8, 8]
    run_tokens(dec, ids, hid, want, range(8, 20), 2)


# ---- engine hooks: track_rows, prefetch --------------------------------------------------------------
def _bits(bitmap):
    return set(np.flatnonzero(np.unpackbits(bitmap, bitorder="little")).tolist())


def test_track_rows_marks_exactly_the_hashed_rows():
    model = make_model(seed=11, n=4, nh=3)
    plan = model.plan
    ids, hid, want = inputs(model, 2, 40, seed=11)
    dec = model.decoder(2)
    maps = {L: np.zeros((plan.table_rows[L] + 7) // 8, np.uint8) for L in LAYERS}
    for L in LAYERS:
        dec.engines[L].track_rows(maps[L])
    run_tokens(dec, ids, hid, want, range(25), 2)
    # stream 0 then prefills the rest of its sequence: prefill rows are recorded too
    dec.prefill(ids[0, 25:40], {L: hid[L][0, 25:40] for L in LAYERS}, stream=0)
    expect = {}
    for L in LAYERS:
        rows = plan.hash(ids)[L] + plan.offsets[L]          # [S, T, H]
        expect[L] = set(rows[0].ravel().tolist()) | set(rows[1, :25].ravel().tolist())
        assert _bits(maps[L]) == expect[L]
        assert max(expect[L]) < plan.table_rows[L]
        assert len(expect[L]) > model.cfg.n_heads           # not trivially one token's rows
    # feed (begin) already marks the new tokens' rows, the ones `rows` reports
    dec.begin(np.array([7, ids[1, 25]]))
    ext = np.concatenate([ids[0], [7]])[None]
    for L in LAYERS:
        rows = plan.hash(ids)[L] + plan.offsets[L]
        r0 = (plan.hash(ext)[L] + plan.offsets[L])[0, 40]
        np.testing.assert_array_equal(dec.engines[L].rows, np.stack([r0, rows[1, 25]]))
        assert _bits(maps[L]) == expect[L] | set(r0.tolist()) | set(rows[1, 25].tolist())
        dec.layer(L, hid[L][:, 25])
        dec.engines[L].track_rows(None)                     # None stops recording
    frozen = {L: m.copy() for L, m in maps.items()}
    dec.reset()
    for t in range(10):
        dec.step((ids[:, t] + 5) % model.cfg.vocab_size, {L: hid[L][:, t] for L in LAYERS})
    for L in LAYERS:
        np.testing.assert_array_equal(maps[L], frozen[L])


def test_track_rows_bad_bitmaps():
    model = make_model(seed=12)
    eng = model.stream(4)
    need = (model.plan.table_rows[4] + 7) // 8
    ro = np.zeros(need, np.uint8)
    ro.flags.writeable = False
    for bad in (np.zeros(need - 1, np.uint8), np.zeros(need, np.int8), np.zeros(need, np.uint16),
                np.zeros(2 * need, np.uint8)[::2], ro, np.zeros((need, 1), np.uint8), [0] * need):
        with pytest.raises(ValueError):
            eng.track_rows(bad)
    eng.step(3, np.zeros((2, 13), np.float32))   # no bitmap: runs without recording


def test_engine_prefetch_in_ram():
    model = make_model(seed=13)
    ids, hid, want = inputs(model, 3, 10, seed=13)
    eng = model.stream(9, 3)
    with pytest.raises(RuntimeError):
        eng.prefetch()                               # before feed
    for t in range(10):
        eng.feed(ids[:, t])
        assert eng.prefetch() == 0
        assert eng.prefetch() == 0                   # idempotent
        close(eng.compute(hid[9][:, t]), want[9][:, t])
        with pytest.raises(RuntimeError):
            eng.prefetch()                           # after compute: nothing pending
    dec = model.decoder(3, prefetch=True)            # prefetch on every begin(), in-RAM tables
    assert dec.prefetch is True
    run_tokens(dec, ids, hid, want, range(10), 3)


def test_file_backed_tables_prefetch(tmp_path):
    """Tables on np.memmap: the mapped source pages rows in, madvise succeeds, outputs unchanged."""
    def to_file(L, table):
        m = np.memmap(tmp_path / f"table{L}.bin", dtype=table.dtype, mode="w+", shape=table.shape)
        m[:] = table
        m.flush()
        return np.memmap(tmp_path / f"table{L}.bin", dtype=table.dtype, mode="r", shape=table.shape)

    model = make_model(seed=14, table=to_file)
    ref = make_model(seed=14)
    for L in LAYERS:
        assert isinstance(model.layers[L].table, np.memmap)
        np.testing.assert_array_equal(model.layers[L].table, ref.layers[L].table)
    ids, hid, want = inputs(ref, 2, 15, seed=14)
    dec = model.decoder(2)
    assert all(dec.engines[L].row_source.paged for L in LAYERS)
    run_tokens(dec, ids, hid, want, range(10), 2)
    dec.begin(ids[:, 10])
    for L in LAYERS:
        assert dec.engines[L].prefetch() == 0
        close(dec.layer(L, hid[L][:, 10]), want[L][:, 10])
    run_tokens(dec, ids, hid, want, range(11, 15), 2)
