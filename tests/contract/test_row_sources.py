"""The row-source contract: every place a model's rows can come from (helpers.row_sources.ROW_SOURCES: the
mapped table, the checkpoint's files read directly, the packed row file, the RAM row cache in front
of each - small enough to evict within one call -, the host's shared row cache, a Mooncake Store,
and any source a test file adds:
tests/contract/test_toy_source.py), for both record layouts of each variant (ROW_MODELS):

- read_into(rows, out) gives the table's own record bytes: rows repeated, negative rows as zero
  records, a [T, k] call into a strided slice of a larger buffer, calls longer than a submit window
  (the oracle: record_arrays of the mapped weights, the checkpoint's bytes);
- engines handed the source (model.stream(L, S, rows=...)) and the Decoder decode bit-identically
  to the mapped tables, a prompt across prefill chunks then steps of 1 and 3 streams;
- a source feeds one engine (it keeps one call's rows), a mapped table any number;
- prefetch() is advice: a count of failed calls, outputs unchanged;
- a cached source pins a call's cached rows while the call reads them and release() unpins them;
- the stats keep one meaning: a cache's misses are the rows its source read."""
from __future__ import annotations

import numpy as np
import pytest

from engram_stream.rows import CachedRows, RowSource, _source
from engram_stream.rows._cache import RowCache
from engram_stream.rows.records import record_arrays

from helpers.inputs import assert_decoded_identically, decode_inputs, decode_run
from helpers.row_sources import ROW_MODELS, ROW_SOURCES, load_checkpoint, row_source_model

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang
SOURCES = [pytest.param(w, marks=pytest.mark.mooncake) if "mooncake" in w else w for w in ROW_SOURCES]
LAYOUTS = ["demo-int8", "v41-flash-rows"]   # a float32 scale apart; V4.1's 264-byte record


def oracle(model, L, rows):
    """The records of `rows` from the mapped weights (zeros for negative rows)."""
    r, s = record_arrays(model.layer(L))
    rec = r if s is None else np.concatenate([r, s], axis=1)
    out = rec[np.maximum(rows, 0)].copy()
    out[rows < 0] = 0
    return out


def calls(nrows, rng):
    """Row arrays of the calls: repeats, negatives, one longer than a submit window."""
    a = rng.integers(0, nrows, 300)
    a[::7] = a[0]
    b = rng.integers(-1, nrows, (40, 6))
    b[3] = -1
    long = rng.integers(0, nrows, _source.READ_WINDOW + 1000)
    return [a, b, long, np.array([nrows - 1, 0, nrows - 1], np.int32), np.zeros(0, np.int64)]


@pytest.mark.parametrize("what", SOURCES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_source_reads_the_tables_bytes(row_checkpoints, name, what, tmp_path, request):
    path = row_checkpoints[name]
    ref = load_checkpoint(path)
    model = row_source_model(path, what, tmp_path, request)
    rng = np.random.default_rng(3)
    for L in model.cfg.layer_ids:
        src = model.row_source(L)
        rec = src.rowbytes + src.scalebytes
        for rows in calls(src.nrows, rng):
            out = np.full(rows.shape + (rec,), 0xAB, np.uint8)
            src.read_into(rows, out)
            np.testing.assert_array_equal(out, oracle(ref, L, rows), err_msg=f"{what} layer {L}")
        # into a strided slice of a staging buffer [T, layers, k, rec] (vLLM's packed rows)
        rows = rng.integers(-1, src.nrows, (33, 5))
        stage = np.full((33, 2, 5, rec), 0xCD, np.uint8)
        src.read_into(rows, stage[:, 1])
        np.testing.assert_array_equal(stage[:, 1], oracle(ref, L, rows))
        assert (stage[:, 0] == 0xCD).all()
    st = model.row_cache_stats()
    if ROW_SOURCES[what].get("row_cache_mb"):
        assert st["hits"] > 0 and st["misses"] > 0 and st["evictions"] > 0
    if ROW_SOURCES[what].get("tables") is not None:
        assert st["reads"] > 0


def test_read_into_refuses_bad_arguments(row_checkpoints):
    model = load_checkpoint(row_checkpoints["v41-flash-rows"])
    L = model.cfg.layer_ids[0]
    src = model.row_source(L)
    rec = src.rowbytes + src.scalebytes
    with pytest.raises(IndexError, match=f"row {src.nrows} is out of range"):
        src.read_into(np.array([0, src.nrows]), np.zeros((2, rec), np.uint8))
    with pytest.raises(ValueError, match="shape"):
        src.read_into(np.array([0, 1]), np.zeros((2, rec - 1), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        src.read_into(np.array([0, 1]), np.zeros((2, rec), np.int8))
    with pytest.raises(ValueError, match="contiguous"):
        src.read_into(np.array([0]), np.zeros((1, rec, 2), np.uint8)[:, :, 0])
    with pytest.raises(TypeError, match="integers"):
        src.read_into(np.array([0.0]), np.zeros((1, rec), np.uint8))
    ro = np.zeros((1, rec), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        src.read_into(np.array([0]), ro)
    with pytest.raises(KeyError, match="not an Engram layer"):
        model.row_source(999)


@pytest.mark.parametrize("what", SOURCES)
@pytest.mark.parametrize("name", list(ROW_MODELS))
def test_engines_through_every_source_decode_bit_identically(row_checkpoints, name, what, tmp_path, request):
    path = row_checkpoints[name]
    for S in (1, 3):
        want = decode_run(load_checkpoint(path), S)
        model = row_source_model(path, what, tmp_path, request)
        assert_decoded_identically(decode_run(model, S), want)
    # an engine handed its source: the same outputs as the decoder's own engines
    ids, hid, p_ids, p_hid = decode_inputs(model, 3, 6, 40, seed=1)
    ref = load_checkpoint(path)
    for L in model.cfg.layer_ids:
        src = model.row_source(L)
        eng, plain = model.stream(L, 3, rows=src), ref.stream(L, 3)
        assert eng.row_source is src
        np.testing.assert_array_equal(eng.prefill(p_ids, p_hid, stream=2), plain.prefill(p_ids, p_hid, stream=2))
        for t in range(ids.shape[0]):
            np.testing.assert_array_equal(eng.step(ids[t], hid[t]), plain.step(ids[t], hid[t]))
    st = model.row_cache_stats()
    if st["capacity_rows"] and st["reads"]:
        assert st["misses"] == st["rows_read"]  # a miss is a row its source read, once


@pytest.mark.parametrize("what", SOURCES)
def test_a_source_feeds_one_engine(row_checkpoints, what, tmp_path, request):
    model = row_source_model(row_checkpoints["v41"], what, tmp_path, request)
    L = model.cfg.layer_ids[0]
    src = model.row_source(L)
    assert isinstance(src, RowSource) and src.nrows == model.plan.table_rows[L]
    model.stream(L, rows=src)
    if type(src).__name__ == "MappedRows":   # pointers into the table, nothing kept: any number
        model.stream(L, rows=src)
    else:
        with pytest.raises(ValueError, match="already feeds an engine"):
            model.stream(L, rows=src)
    with pytest.raises(TypeError, match="RowSource"):
        model.stream(L, rows=object())
    with pytest.raises(ValueError, match="rows"):
        model.stream(L, rows=model.row_source(model.cfg.layer_ids[1]))  # another layer's table


@pytest.mark.parametrize("what", SOURCES)
def test_prefetch_is_advice(row_checkpoints, what, tmp_path, request):
    path = row_checkpoints["demo-int8"]
    model = row_source_model(path, what, tmp_path, request)
    ids, hid, _, _ = decode_inputs(model, 2, 8, 1, seed=2)
    ref = load_checkpoint(path)
    for L in model.cfg.layer_ids:
        eng, plain = model.stream(L, 2), ref.stream(L, 2)
        for t in range(ids.shape[0]):
            eng.feed(ids[t])
            assert eng.prefetch() >= 0
            np.testing.assert_array_equal(eng.compute(hid[t]), plain.step(ids[t], hid[t]))


@pytest.mark.parametrize("what", SOURCES)
def test_release_unpins_what_the_call_pinned(row_checkpoints, what, tmp_path, request):
    """A call's cached rows are pinned from submit to release: while an engine's call is fed and
    not computed, after it no pin is left (a fetch, a compute, a read_into, an abandoned call).
    A source the model reads uncached is put behind a cache of its own here (CachedRows over any
    source)."""
    model = row_source_model(row_checkpoints["demo-int8"], what, tmp_path, request)
    L = model.cfg.layer_ids[0]
    src = model.row_source(L)
    if isinstance(src, CachedRows):
        cache = model.tier.cache(L)
    else:
        cache = RowCache(64, src.rowbytes + src.scalebytes, L)
        src = CachedRows(cache, src)
    ids, hid, _, _ = decode_inputs(model, 1, 1, 1, seed=4)
    eng = model.stream(L, rows=src)
    eng.feed(ids[0])
    eng.fetch()                       # the token's rows read into the cache, released
    assert cache.pinned() == 0
    eng.reset()
    eng.feed(ids[0])                  # the same rows, cached: the submit pins each position's slot
    assert cache.pinned() > 0
    eng.compute(hid[0])
    assert cache.pinned() == 0
    eng.reset()
    eng.feed(ids[0])
    assert cache.pinned() > 0
    eng.reset()                       # the fed call abandoned: its pins go with it
    assert cache.pinned() == 0
    reader = model.row_source(L)
    reader.read(np.arange(50))
    reader.read(np.arange(50))
    assert model.tier.caches.get(L) is None or model.tier.caches[L].pinned() == 0
