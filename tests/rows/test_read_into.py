"""read_into(rows, out) on every row source gives the table's own record bytes: the mapped table,
the checkpoint's files read directly, the packed row file, the RAM row cache in front of each
(small enough to evict within one call), a Mooncake Store; rows repeated, negative rows as zero
records, a [T, k] call into a strided slice of a larger buffer, calls longer than a submit
window. The oracle is record_arrays of the mapped weights (the checkpoint's bytes)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from engram_stream import EngramModel
from engram_stream.rows import _source, packed
from engram_stream.rows.records import record_arrays

from conftest import make_model, make_v41_model

MODELS = {
    "demo-int8": lambda: make_model(G=2, n=3, K=3, D=16, comp=True, seed=6, vocab=60, table_dtype="int8"),
    "v41-flash-rows": lambda: make_v41_model(seed=8, hd=256, D=32),  # the 264-byte record
}
SOURCES = {
    "mapped": {},
    "cache on the mapping": dict(row_cache_mb="small"),
    "direct": dict(tables="direct"),
    "direct+cache": dict(tables="direct", row_cache_mb="small"),
    "packed row file": dict(tables="direct", _packed=True),
    "packed row file+cache": dict(tables="direct", row_cache_mb="small", _packed=True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("read_into")
    out = {}
    for name, make in MODELS.items():
        path = str(d / (name + (".safetensors" if name.startswith("demo") else "")))
        make().save(path)
        out[name] = path
    return out


def load(path, **kw):
    if os.path.isdir(path):
        return EngramModel.from_deepseek_v41(path, **kw)
    return EngramModel.load(path, **kw)


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


def source_model(path, tmp_path, what):
    kw = dict(SOURCES[what])
    if kw.get("row_cache_mb") == "small":  # far fewer slots than the rows one call reads
        kw["row_cache_mb"] = 0.05 if os.path.isdir(path) else 0.004
    if kw.pop("_packed", False):
        copy = str(tmp_path / os.path.basename(path))
        (shutil.copytree if os.path.isdir(path) else shutil.copyfile)(path, copy)
        packed.pack_rows(load(copy), packed.rows_path(copy))
        model = load(copy, **kw)
        assert model.row_tiers.open_tier.rows_path == packed.rows_path(copy)
        return model
    return load(path, **kw)


@pytest.mark.parametrize("what", list(SOURCES))
@pytest.mark.parametrize("name", list(MODELS))
def test_every_source_reads_the_tables_bytes(saved, name, what, tmp_path):
    path = saved[name]
    ref = load(path)
    model = source_model(path, tmp_path, what)
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
    if SOURCES[what].get("row_cache_mb"):
        assert st["hits"] > 0 and st["misses"] > 0 and st["evictions"] > 0
    if SOURCES[what].get("tables"):
        assert st["reads"] > 0


def test_read_into_refuses_bad_arguments(saved):
    model = load(saved["v41-flash-rows"])
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


@pytest.mark.mooncake
def test_mooncake_source_reads_the_tables_bytes(tier, saved):
    path = saved["v41-flash-rows"]
    ref = load(path)
    tier.publish(ref)
    rng = np.random.default_rng(5)
    for mb in (0, 0.05):
        model = load(path, tables=tier, row_cache_mb=mb)
        for L in model.cfg.layer_ids:
            src = model.row_source(L)
            for rows in calls(src.nrows, rng)[:2]:
                out = np.empty(rows.shape + (src.rowbytes + src.scalebytes,), np.uint8)
                src.read_into(rows, out)
                np.testing.assert_array_equal(out, oracle(ref, L, rows))
        assert model.row_cache_stats()["fetches"] > 0
