"""The vLLM plugin's capturable lookup's host function (integrations/_vllm_graph.pyx: hf_run), on
CPU, called directly (HostLookup.run) and through its C function pointer (ctypes, as the CUDA
driver calls a host node), against the eager row path (RowSource.read_into, records_to_bf16):
uint8 records and bf16 rows, cold and warm, through every local source (mapped, direct, the
packed row file, each behind the RAM row cache), ids outside the rank's rows and -1 as zeros,
and its error slot (an id past the table, a table file changed under it). No vLLM, no torch,
no CUDA: the suite's own run and its ASan stage run these."""
from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from engram_stream import EngramModel
from engram_stream.errors import FileChangedError
from engram_stream.integrations._vllm_graph import HF_BAD_ROW, HF_FILE_CHANGED, HostLookup, graph_capable, host_fn_address
from engram_stream.integrations._records import records_to_bf16
from engram_stream.rows import RecordSource

from helpers.row_sources import PLUGIN_SOURCES

pytestmark = pytest.mark.native  # drives C code over raw pointers: CI runs it again under ASan


def model_of(path, settings):
    tables = settings["tables"]
    return EngramModel.from_deepseek_v41(path, tables=tables, row_cache_mb=settings.get("row_cache_mb") or None)


def ids_of(src, T, k, lo, hi, rng, dtype=np.int32):
    """[T, k] ids as vLLM's (int32): rows in [lo, hi), some -1, some outside [lo, hi), repeats."""
    ids = rng.integers(lo, hi, (T, k)).astype(dtype)
    ids[rng.random(ids.shape) < 0.1] = -1
    if lo > 0:
        ids[rng.random(ids.shape) < 0.1] = lo - 1
    if hi < src.nrows:
        ids[rng.random(ids.shape) < 0.1] = hi
    ids[T // 2:T // 2 + 2] = ids[0]
    return ids


def eager(src, ids, lo, hi, bf16):
    """The eager path's bytes: read_into of the owned rows (-1 elsewhere), then records_to_bf16."""
    rows = np.where((ids >= lo) & (ids < hi), ids, -1).astype(np.int64)
    rec = np.empty(rows.shape + (src.rowbytes + src.scalebytes,), np.uint8)
    src.read_into(rows, rec)
    if not bf16:
        return rec
    out = np.empty(rows.shape + (src.rowbytes,), np.uint16)
    records_to_bf16(rec, out)
    return out


def staging_of(src, T, k, bf16):
    if bf16:
        return np.full((T, k, src.rowbytes), 7, np.uint16)
    return np.full((T, k, src.rowbytes + src.scalebytes), 7, np.uint8)


@pytest.mark.parametrize("source", list(PLUGIN_SOURCES))
def test_host_function_gives_the_eager_lookups_bytes(plugin_checkpoints, source):
    path = plugin_checkpoints["rows" if "packed" in source else "plain"]
    model = model_of(path, PLUGIN_SOURCES[source])
    check = model_of(path, PLUGIN_SOURCES[source])   # the eager path's own model (its own cache)
    rng = np.random.default_rng(5)
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(host_fn_address())
    for L in model.cfg.layer_ids:
        src = model.row_source(L)
        assert graph_capable(src) == (True, "")
        n = src.nrows
        for lo, hi in ((0, n), (n // 3, 2 * n // 3)):        # the whole table; one rank's rows
            for T, k in ((1, 9), (16, 5), (300, 9)):
                for bf16 in (False, True):
                    ids = ids_of(src, T, k, lo, hi, rng, np.int64 if T == 16 else np.int32)
                    want = eager(check.row_source(L), ids, lo, hi, bf16)
                    st = staging_of(src, T, k, bf16)
                    ctx = HostLookup(src, ids, st, lo, hi)
                    ctx.run()                                    # cold (the cache's misses)
                    assert np.array_equal(st, want), (source, L, lo, T, bf16)
                    st[:] = 7
                    call(ctx.address)                            # warm, as the driver calls it
                    assert np.array_equal(st, want), (source, L, lo, T, bf16)
                    new = ids_of(src, T, k, lo, hi, rng, ids.dtype)   # a replay: new ids, same buffers
                    ids[:] = new
                    call(ctx.address)
                    assert np.array_equal(st, eager(check.row_source(L), new, lo, hi, bf16))
                    assert ctx.calls == 3 and ctx.error() is None
                    ctx.check()
    st = model.row_cache_stats()
    if PLUGIN_SOURCES[source].get("row_cache_mb"):
        assert st["hits"] > 0 and st["misses"] > 0


def test_an_id_past_the_table_is_recorded_not_fatal(plugin_checkpoints):
    model = model_of(plugin_checkpoints["plain"], {"tables": "mapped", "row_cache_mb": 0.2})
    src = model.row_source(model.cfg.layer_ids[0])
    n = src.nrows
    ids = np.array([[0, n + 5, 3], [n - 1, -1, n + 7]], np.int32)
    st = staging_of(src, 2, 3, True)
    ctx = HostLookup(src, ids, st, 0, n + 100)   # a range past the table: ids in it are errors
    ctx.run()
    assert ctx.error() == (HF_BAD_ROW, n + 5, 0) and ctx.errors == 2
    assert not st[0, 1].any() and not st[1, 2].any() and not st[1, 1].any()     # zeros
    ok = np.where(ids < n, ids, -1)
    assert np.array_equal(st, eager(model.row_source(model.cfg.layer_ids[0]), ok, 0, n, True))
    with pytest.raises(IndexError, match=f"id {n + 5} is past the table's {n} rows.*2 failures"):
        ctx.check()
    assert ctx.error() is None
    ctx.check()   # cleared


@pytest.mark.parametrize("cache", [None, 0.2])
def test_a_table_file_changed_under_the_host_function_is_recorded(plugin_checkpoints, tmp_path, cache):
    path = str(tmp_path / "v41")
    shutil.copytree(plugin_checkpoints["plain"], path)
    model = model_of(path, {"tables": "direct", "row_cache_mb": cache})
    L = model.cfg.layer_ids[0]
    src = model.row_source(L)
    ids = np.arange(12, dtype=np.int32).reshape(4, 3)
    st = staging_of(src, 4, 3, False)
    ctx = HostLookup(src, ids, st, 0, src.nrows)
    ctx.run()
    assert ctx.error() is None and st.any()
    for f in os.listdir(path):                      # every shard touched: a new mtime
        if f.endswith(".safetensors"):
            os.utime(os.path.join(path, f), ns=(1, 1))
    ids[:] += 100                                    # rows the cache does not hold
    ctx.run()
    assert ctx.error()[0] == HF_FILE_CHANGED
    assert not st.any()                              # nothing read is served
    with pytest.raises(FileChangedError, match="rewritten in place"):
        ctx.check()


def test_a_packed_record_that_fails_its_checksum_is_recorded_not_served(plugin_checkpoints, tmp_path):
    """A record of the packed row file changed after packing (outside the rows open_rows
    samples): the host function serves zeros for the call's rows, records HF_BAD_SUM with the
    row, and check() raises RowChecksumError naming the layer and row."""
    from engram_stream.errors import RowChecksumError
    from engram_stream.integrations._vllm_graph import HF_BAD_SUM
    from engram_stream.rows import packed
    path = str(tmp_path / "v41")
    shutil.copytree(plugin_checkpoints["rows"], path)
    rows = packed.rows_path(path)
    L = 1
    lay = packed.read_header(rows)["layers"][str(L)]
    r = next(r for r in range(lay["rows"] // 2, lay["rows"]) if r not in packed._sample_rows(lay["rows"], L))
    with open(rows, "r+b") as f:
        f.seek(lay["offset"] + r // lay["per_group"] * lay["group_bytes"] + r % lay["per_group"] * 264 + 5)
        f.write(b"\x7e")
    model = model_of(path, {"tables": "direct"})
    assert model.tables.inner.rows_path == rows
    src = model.row_source(L)
    ids = np.array([[0, r, 2]], np.int32)
    st = staging_of(src, 1, 3, False)
    ctx = HostLookup(src, ids, st, 0, src.nrows)
    ctx.run()
    assert ctx.error() == (HF_BAD_SUM, r, 0) and not st.any()
    with pytest.raises(RowChecksumError, match=f"engram_rows.bin: layer {L} row {r}: "):
        ctx.check()
    ids[0, 1] = 1
    ctx.run()
    assert ctx.error() is None
    np.testing.assert_array_equal(st, eager(src, ids, 0, src.nrows, False))


class Toy(RecordSource):
    def start(self, rows):
        self.n = len(rows)

    def finish(self):
        return np.zeros((self.n, self.rowbytes + self.scalebytes), np.uint8)


def test_sources_that_need_the_gil_are_refused():
    """A source without a C reader (nogil_reads False), bare or behind the row cache: graph_capable
    says so and names the sources that qualify; HostLookup refuses it."""
    from engram_stream.rows import CachedRows
    from engram_stream.rows._cache import RowCache
    for src in (Toy(10, 256, 8), CachedRows(RowCache(16, 264, 0), Toy(10, 256, 8))):
        assert not src.nogil_reads
        ok, why = graph_capable(src)
        assert not ok and "Toy has no C reader" in why and "GIL" in why and "MappedRows, DirectRows" in why
        with pytest.raises(TypeError, match="GIL"):
            HostLookup(src, np.zeros((1, 1), np.int32), np.zeros((1, 1, 264), np.uint8), 0, 10)


@pytest.mark.parametrize("checkpoint", ["plain", "rows"])
def test_a_cached_file_source_reads_under_the_graph_reader_as_its_python_read(plugin_checkpoints, checkpoint):
    """The row cache over the checkpoint's files (or its packed row file): the host function reads
    through the source's one C reader (RowSource.read_nogil) the bytes its Python-level read gives,
    cold and warm, and counts the cache as the engines' path does (a miss a distinct row read, its
    repeats in the call hits)."""
    from engram_stream.rows import CachedRows, DirectRows
    model = model_of(plugin_checkpoints[checkpoint], {"tables": "direct", "row_cache_mb": 0.2})
    L = model.cfg.layer_ids[-1]
    src = model.row_source(L)
    assert isinstance(src, CachedRows) and isinstance(src.source, DirectRows)
    assert src.nogil_reads and src.source.nogil_reads
    rng = np.random.default_rng(11)
    ids = rng.integers(0, src.nrows, (40, 6)).astype(np.int64)
    ids[5] = ids[0]                                               # repeats within the call
    ids[7, 2] = -1                                                # "no row": zeros
    st = staging_of(src, 40, 6, False)
    ctx = HostLookup(src, ids, st, 0, src.nrows)
    before = model.row_cache_stats()["layers"][L]
    ctx.run()                                                     # cold: every distinct row a miss
    after = model.row_cache_stats()["layers"][L]
    valid = ids[ids >= 0]
    assert after["misses"] - before["misses"] == len(np.unique(valid))
    assert after["hits"] - before["hits"] == valid.size - len(np.unique(valid))
    want = np.empty_like(st)
    check = model_of(plugin_checkpoints[checkpoint], {"tables": "direct", "row_cache_mb": 0.2})   # its own cache
    check.row_source(L).read_into(ids, want)                      # the Python-level read (submit/resolve)
    assert np.array_equal(st, want) and not st[7, 2].any()
    st[:] = 7
    ctx.run()                                                     # warm: the cache's own copies
    assert np.array_equal(st, want) and ctx.error() is None
    assert model.row_cache_stats()["layers"][L]["hits"] > after["hits"]


def test_buffers_of_the_wrong_shape_are_refused(plugin_checkpoints):
    model = model_of(plugin_checkpoints["plain"], {"tables": "mapped"})
    src = model.row_source(model.cfg.layer_ids[0])
    with pytest.raises(ValueError, match="staging"):
        HostLookup(src, np.zeros((2, 3), np.int32), np.zeros((2, 3, 263), np.uint8), 0, 10)
    with pytest.raises(ValueError, match="ids"):
        HostLookup(src, np.zeros((2, 3), np.float32), np.zeros((2, 3, 264), np.uint8), 0, 10)
    with pytest.raises(ValueError, match="ids"):
        HostLookup(src, np.zeros((3, 2), np.int32).T, np.zeros((2, 3, 264), np.uint8), 0, 10)


@pytest.mark.parametrize("load", [None, {"tables": "mapped", "row_cache_mb": 1}, {"tables": "direct"},
                                  {"tables": "direct", "row_cache_mb": 1}])
def test_bf16_staging_of_records_that_are_not_v41_is_refused(tmp_path, load):
    """A demo int8 table of head width 128 has records of 128 + 4 bytes (its float32 scale), as
    long as a V4.1 record of 128 e4m3 + 4 e8m0 bytes: bf16 staging (the V4.1 widening) is refused
    by the records' format, whatever their size; uint8 staging takes its records as they are."""
    from helpers.models import make_model, make_v41_model
    from engram_stream.rows.records import E4M3_E8M0_RECORD
    model = make_model(nh=2, hd=128, table_dtype="int8", seed=4)
    if load is not None:
        model.save(tmp_path / "int8.st")
        model = EngramModel.load(tmp_path / "int8.st", **load)
    src = model.row_source(model.cfg.layer_ids[0])
    assert (src.rowbytes, src.scalebytes) == (128, 4) and src.record_format == "int8+float32"
    ids = np.array([[0, 1, -1]], np.int32)
    with pytest.raises(ValueError, match=r"bf16 staging converts e4m3 records .* int8\+float32 \(128\+4 bytes\)"):
        HostLookup(src, ids, np.zeros((1, 3, 128), np.uint16), 0, src.nrows)
    st = np.full((1, 3, 132), 7, np.uint8)
    HostLookup(src, ids, st, 0, src.nrows).run()
    w = model.layer(model.cfg.layer_ids[0])
    want = np.concatenate([w.table[:2].view(np.uint8), w.table_scale[:2].reshape(2, 1).view(np.uint8)], axis=1)
    np.testing.assert_array_equal(st[0, :2], want)
    assert not st[0, 2].any()   # -1: a record of zeros
    v41 = make_v41_model(seed=7)   # V4.1's records state their format
    assert v41.row_source(v41.cfg.layer_ids[0]).record_format == E4M3_E8M0_RECORD
