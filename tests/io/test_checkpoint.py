"""Checkpoints: round trips, the safetensors layout, compact tables, hostile files, atomic saves,
and that mmap tables really are views of the file (not copies)."""
from __future__ import annotations

import json
import os
import stat
import struct
import sys

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from engram_stream.demo import checkpoint
from engram_stream.io import memory
from engram_stream.io import files
from engram_stream.errors import CheckpointError

safetensors_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402
from helpers.processes import run_python

CFG = EngramConfig(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=32, n_head_per_ngram=4,
                   layer_ids=[1, 4], pad_id=2, kernel_size=4, hidden_size=24, hc_mult=4, vocab_size=500)
# Measured output error of compact tables vs float32 (random init, see bench/MEMORY.md): bounds with margin.
TOL = {"float16": dict(max_abs=2e-2, rel_rms=1e-3), "int8": dict(max_abs=0.15, rel_rms=1.5e-2)}


def _compression(vocab, seed=3):
    raw = np.random.default_rng(seed).integers(0, vocab // 3, vocab)
    return np.unique(raw, return_inverse=True)[1].astype(np.int64)  # dense 0..k-1


MULT = {1: np.array([-1, (1 << 62) + 1, -(1 << 63)], np.int64), 4: np.array([3, 5, 7], np.int64)}
VARIANTS = {"plain": {}, "compression": {"compression": _compression(500)}, "multipliers": {"multipliers": MULT},
            "both": {"compression": _compression(500), "multipliers": MULT}}


def _model(variant="plain", seed=1, cfg=CFG):
    return EngramModel.init(cfg, seed=seed, **VARIANTS[variant])


def _inputs(cfg=CFG, B=2, T=9, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (B, T))
    ids[0, 3] = cfg.pad_id
    return ids, rng.standard_normal((B, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)


def _streamed(model, L, ids, hidden):
    eng = model.stream(L)
    return np.stack([eng.step(int(t), h) for t, h in zip(ids, hidden)])


def _split(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(path, hdr, data):
    js = json.dumps(hdr).encode()
    js += b" " * (-len(js) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js + data)


@pytest.fixture
def saved(tmp_path):
    m = _model()
    p = tmp_path / "m.safetensors"
    m.save(p)
    return m, str(p)


# ---- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "ram"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_bit_identical(tmp_path, variant, mmap):
    m = _model(variant)
    p = tmp_path / "m.safetensors"
    m.save(p)
    m2 = EngramModel.load(p, mmap=mmap)
    assert m2.cfg == m.cfg
    assert (m2.plan.lookup is None) == (m.plan.lookup is None)
    if m.plan.lookup is not None:
        assert np.array_equal(m2.plan.lookup, m.plan.lookup)
    for L in CFG.layer_ids:
        assert np.array_equal(m2.plan.multipliers[L], m.plan.multipliers[L])
        a, b = m.state_dict(L), m2.state_dict(L)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    ids, hid = _inputs()
    for L in CFG.layer_ids:
        assert np.array_equal(m.forward(L, ids, hid), m2.forward(L, ids, hid))
        assert np.array_equal(_streamed(m, L, ids[0], hid[0]), _streamed(m2, L, ids[0], hid[0]))
        e1, e2 = m.stream(L), m2.stream(L)
        assert np.array_equal(e1.prefill(ids[1], hid[1]), e2.prefill(ids[1], hid[1]))


def test_safetensors_package_reads_every_tensor(saved):
    m, p = saved
    st = safetensors_numpy.load_file(p)
    for L in CFG.layer_ids:
        for k, v in m.state_dict(L).items():
            got = st[f"layers.{L}.{k}"]
            assert got.dtype == v.dtype and np.array_equal(got, v), k
        assert np.array_equal(st[f"plan.{L}.multipliers"], m.plan.multipliers[L])
        assert np.array_equal(st[f"plan.{L}.primes"], m.plan.head_primes[L])
    assert len(st) == sum(len(m.state_dict(L)) + 2 for L in CFG.layer_ids)
    with safe_open(p, "np") as f:
        meta = f.metadata()
    assert meta["format"] == "engram_stream" and meta["format_version"] == "1"
    assert EngramConfig.from_dict(json.loads(meta["config"])) == CFG


def test_compression_is_stored(tmp_path):
    m = _model("compression")
    m.save(tmp_path / "c.st")
    st = safetensors_numpy.load_file(str(tmp_path / "c.st"))
    assert np.array_equal(st["plan.compression"], m.plan.lookup)


def test_layout_alignment(saved):
    """Every tensor aligned to its element size; the first table on a 4096-byte file boundary."""
    _, p = saved
    hdr, _ = _split(p)
    n = struct.unpack("<Q", open(p, "rb").read(8))[0]
    assert n % 8 == 0
    size = {"I64": 8, "F32": 4, "F16": 2, "I8": 1}
    for name, t in hdr.items():
        if name != "__metadata__":
            assert (8 + n + t["data_offsets"][0]) % size[t["dtype"]] == 0, name
    first = min(t["data_offsets"][0] for k, t in hdr.items() if k.endswith("embedding.weight"))
    assert (8 + n + first) % 4096 == 0


def test_files_from_other_writers_load(tmp_path, saved):
    """Any safetensors writer's file with our names and metadata loads (e.g. tensor order differs)."""
    m, p = saved
    with safe_open(p, "np") as f:
        meta = f.metadata()
    q = str(tmp_path / "other.safetensors")
    safetensors_numpy.save_file(safetensors_numpy.load_file(p), q, metadata=meta)
    m2 = EngramModel.load(q)
    ids, hid = _inputs()
    assert np.array_equal(m.forward(4, ids, hid), m2.forward(4, ids, hid))


def test_misaligned_file_still_loads(tmp_path, saved):
    """A writer that leaves tables misaligned (header not padded to 8): copied, with a warning."""
    m, p = saved
    hdr, data = _split(p)
    js = json.dumps(hdr).encode()
    js += b" " * ((-len(js) % 8) + 1)
    q = tmp_path / "odd.st"
    q.write_bytes(struct.pack("<Q", len(js)) + js + data)
    with pytest.warns(UserWarning, match="misaligned"):
        m2 = EngramModel.load(q)
    ids, hid = _inputs()
    assert np.array_equal(m.forward(1, ids, hid), m2.forward(1, ids, hid))


# ---- compact tables --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_compact_within_tolerance(tmp_path, dtype):
    m = _model("compression")
    p = tmp_path / f"{dtype}.st"
    m.save(p, table_dtype=dtype)
    c = EngramModel.load(p)
    c_mem = checkpoint.compact(m, dtype)
    ids, hid = _inputs(B=3, T=40)
    for L in CFG.layer_ids:
        w = c.layers[L]
        assert w.table.dtype == np.dtype(dtype) and (w.table_scale is not None) == (dtype == "int8")
        assert np.array_equal(w.table, c_mem.layers[L].table)  # compact() == what save writes
        ref, out = m.forward(L, ids, hid), c.forward(L, ids, hid)
        err = np.abs(out - ref)
        assert err.max() <= TOL[dtype]["max_abs"], err.max()
        assert np.sqrt(np.mean(err ** 2) / np.mean(ref ** 2)) <= TOL[dtype]["rel_rms"]
        # the engine on the compact table == the batch path on the same compact model
        np.testing.assert_allclose(_streamed(c, L, ids[0], hid[0]), out[0], atol=2e-5, rtol=2e-4)
    assert os.path.getsize(p) < os.path.getsize(m.save(tmp_path / "f32.st"))


def _with_table(m, L, change):
    """m with layer L's table a changed copy (a model's arrays are read-only)."""
    table = np.array(m.layers[L].table)
    change(table)
    return EngramModel(m.cfg, m.plan, {**m.layers, L: m.layers[L].replace(m.cfg, table=table)})


def test_int8_scales():
    m = _with_table(_model(), 1, lambda t: t.__setitem__(5, 0))  # an all-zero row: scale 1, stays exactly zero
    w = m.layers[1]
    c = checkpoint.compact(m, "int8").layers[1]
    want = np.abs(w.table).max(axis=1) / np.float32(127)
    want[5] = 1
    assert c.table_scale.dtype == np.float32 and np.array_equal(c.table_scale, want.astype(np.float32))
    assert np.abs(c.table).max() == 127 and not c.table[5].any()
    assert np.abs(c.table_f32(slice(None)) - w.table).max() <= (want[:, None] / 2 + 1e-6).max()


def test_compact_round_trips_between_dtypes(tmp_path):
    q = checkpoint.compact(_model(), "int8")
    p = tmp_path / "q.st"
    q.save(p)  # int8 kept as is, with its scale
    assert np.array_equal(EngramModel.load(p).layers[4].table_scale, q.layers[4].table_scale)
    q.save(p, table_dtype="float32")  # dequantized
    back = EngramModel.load(p, mmap=False).layers[4]
    assert back.table.dtype == np.float32 and np.array_equal(back.table, q.layers[4].table_f32(slice(None)))


def test_float16_overflow_is_refused(tmp_path):
    m = _with_table(_model(), 1, lambda t: t.__setitem__((3, 2), 1e6))
    with pytest.raises(ValueError, match="float16 range"):
        m.save(tmp_path / "x.st", table_dtype="float16")
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="table_dtype"):
        m.save(tmp_path / "x.st", table_dtype="int16")
    with pytest.raises(ValueError, match="table_dtype"):
        m.save(tmp_path / "x.st", table_dtype="no such dtype")


def test_save_streams_large_tables_in_chunks(tmp_path, monkeypatch):
    """Conversions run on CHUNK_BYTES pieces: never a full second copy of the table."""
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 4096)
    m = _model()
    seen = []
    real = checkpoint._to
    monkeypatch.setattr(checkpoint, "_to", lambda c, *a: seen.append(c.nbytes) or real(c, *a))
    m.save(tmp_path / "c.st", table_dtype="float16")
    assert max(seen) <= 4096 and sum(seen) == sum(w.table.nbytes for w in m.layers.values())
    c = EngramModel.load(tmp_path / "c.st")
    assert np.array_equal(c.layers[1].table, m.layers[1].table.astype(np.float16))


# ---- atomic save, progress -------------------------------------------------------------------------------
def test_failed_save_leaves_old_file(tmp_path, monkeypatch):
    p = tmp_path / "m.st"
    _model(seed=1).save(p)
    before = p.read_bytes()
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 4096)
    calls = []

    def boom(done, total):  # dies mid-write, after some of the table is on disk
        calls.append(done)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="simulated"):
        _model(seed=2).save(p, table_dtype="int8", progress=boom)
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["m.st"]
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("fsync failed")))
    with pytest.raises(OSError, match="fsync failed"):
        _model(seed=2).save(p)
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["m.st"]


def test_concurrent_saves_to_one_path(tmp_path, monkeypatch):
    """Two threads saving different models to one path: each round the file is one model or
    the other, whole (each save has its own temp file), never a mix, and no temp file stays."""
    import threading
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 4096)   # many small writes: they interleave
    models = [_model(seed=1), _model(seed=2)]
    whole = []
    for i, m in enumerate(models):
        m.save(tmp_path / f"ref{i}.st")
        whole.append((tmp_path / f"ref{i}.st").read_bytes())
    p, errors = tmp_path / "m.st", []

    def save(m):
        try:
            m.save(p)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    for _ in range(8):
        threads = [threading.Thread(target=save, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert p.read_bytes() in whole
    assert sorted(os.listdir(tmp_path)) == ["m.st", "ref0.st", "ref1.st"]


def test_save_never_follows_a_symlink_at_a_temp_name(tmp_path, monkeypatch):
    """A symlink planted where a predictable temp name would be must not redirect the write."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    p = tmp_path / "m.st"
    for name in (f"m.st.tmp-{os.getpid()}", "m.st.tmp"):
        os.symlink(victim, tmp_path / name)
    _model().save(p)
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(p) and EngramModel.load(p).cfg == CFG
    assert os.path.islink(tmp_path / f"m.st.tmp-{os.getpid()}")   # not ours: left alone
    # Even at the very name save() picks, the link is not followed (O_EXCL | O_NOFOLLOW) nor removed.
    planted = str(tmp_path / "m.st.tmp-planted")
    os.symlink(victim, planted)
    monkeypatch.setattr(files, "_temp_name", lambda path: planted)
    with pytest.raises(FileExistsError):
        _model(seed=2).save(p)
    assert victim.read_bytes() == b"precious" and os.path.islink(planted)
    assert EngramModel.load(p).cfg == CFG


def test_save_refuses_a_destination_that_is_not_a_regular_file(tmp_path):
    fifo, folder = tmp_path / "fifo", tmp_path / "folder"
    os.mkfifo(fifo)
    folder.mkdir()
    for dest in (fifo, folder):
        with pytest.raises(ValueError, match="not a regular file"):
            _model().save(dest)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.isdir(folder) and not os.listdir(folder)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder"]           # no temp file left


def test_saved_file_mode_follows_the_umask(tmp_path):
    """The temp file is created private (mkstemp: 0600); the saved file gets the mode open()
    would have given it: 0666 & ~umask."""
    old = os.umask(0o027)
    try:
        _model().save(tmp_path / "m.st")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m.st").st_mode) == 0o640


def test_progress_callback(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 8192)
    seen = []
    p = tmp_path / "m.st"
    _model().save(p, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 4 and all(t == os.path.getsize(p) for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == os.path.getsize(p)


def test_overwrite_while_mapped(tmp_path):
    """os.replace swaps the inode: a model mapping the old file keeps working."""
    p = tmp_path / "m.st"
    m1 = _model(seed=1)
    m1.save(p)
    old = EngramModel.load(p)
    _model(seed=2).save(p)
    ids, hid = _inputs()
    assert np.array_equal(old.forward(1, ids, hid), m1.forward(1, ids, hid))
    assert not np.array_equal(EngramModel.load(p).forward(1, ids, hid), m1.forward(1, ids, hid))


# ---- mmap: views, not copies ----------------------------------------------------------------------------
def test_mmap_tables_are_views_of_the_file(saved):
    m, p = saved
    mm, ram = EngramModel.load(p, mmap=True), EngramModel.load(p, mmap=False)
    t = mm.layers[1].table
    assert not t.flags.owndata and not t.flags.writeable and memory.is_file_backed(t)
    assert not memory.is_file_backed(ram.layers[1].table) and not ram.layers[1].table.flags.writeable
    assert not memory.is_file_backed(mm.layers[1].proj_w)  # weights are small copies
    # A write to the file shows through the mapping (it would not through a copy).
    hdr, _ = _split(p)
    n = struct.unpack("<Q", open(p, "rb").read(8))[0]
    off = 8 + n + hdr["layers.1.multi_head_embedding.embedding.weight"]["data_offsets"][0]
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, np.float32(1234.5).tobytes(), off)
    finally:
        os.close(fd)
    assert t[0, 0] == np.float32(1234.5)
    assert ram.layers[1].table[0, 0] == m.layers[1].table[0, 0]


# A model whose table is ~67 MB (one layer, head_dim 64): for the memory checks.
BIG = EngramConfig(engram_vocab_size=[16411, 16411], max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8,
                   layer_ids=[2], pad_id=2, kernel_size=4, hidden_size=32, hc_mult=2, vocab_size=1000)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("big") / "big.safetensors"
    m = EngramModel.init(BIG, seed=0)
    m.save(p)
    return str(p), m.layers[2].table.nbytes


PROBE = r"""
import json, sys
import memray
import numpy as np
from engram_stream import EngramModel
from engram_stream.io import memory

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out

path, use_mmap, trace = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
before = status()
with memray.Tracker(trace):
    m = EngramModel.load(path, mmap=use_mmap)
    w = m.layers[2]
    memory.touch(w.table)  # every page of the table resident
    eng = m.stream(2)
    for t in range(20):
        eng.step(t, np.ones((m.cfg.hc_mult, m.cfg.hidden_size), np.float32))
after = status()
recs = list(memray.FileReader(trace).get_high_watermark_allocation_records(merge_threads=True))
mmapped = sum(r.size for r in recs if r.allocator == memray.AllocatorType.MMAP)
print(json.dumps({"anon": after["RssAnon"] - before["RssAnon"], "file": after["RssFile"] - before["RssFile"],
                  "heap": sum(r.size for r in recs) - mmapped, "mapped": mmapped}))
"""


def _probe(path, use_mmap, tmp_path):
    trace = tmp_path / f"trace-{int(use_mmap)}.bin"
    r = run_python(["-c", PROBE, path, str(int(use_mmap)), str(trace)], timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_mmap_load_does_not_copy_the_table(big_file, tmp_path):
    """In a fresh process: an mmap load, with the whole table touched, adds file pages, not
    anonymous memory, and its heap (memray, not counting the file mapping) stays small; the
    same probe on an in-RAM load shows the table in both (so the check can fail)."""
    pytest.importorskip("memray")
    path, table_bytes = big_file
    mm, ram = _probe(path, True, tmp_path), _probe(path, False, tmp_path)
    assert mm["anon"] < 16 << 20, mm
    assert mm["file"] > 0.9 * table_bytes, mm
    assert mm["heap"] < 8 << 20, mm
    assert mm["mapped"] >= table_bytes, mm  # memray counts the file mapping as an mmap "allocation"
    assert ram["anon"] > 0.9 * table_bytes and ram["heap"] > table_bytes, ram


# pytest-memray's limit counts every allocation live at the high-water mark, the file mapping
# included (memray intercepts mmap()). So the limit is the file size + 8 MiB: the heap of an mmap
# load (plus a few engine steps) must stay under 8 MiB; a load that copied the table out of the
# mapping would need twice the file. Enforced under `pytest --memray`; a plain test otherwise.
BIG_TABLE_MIB = HashPlan(BIG).table_rows[2] * BIG.head_dim * 4 / 2 ** 20


@pytest.mark.limit_memory(f"{BIG_TABLE_MIB + 8:.0f} MB")
def test_mmap_load_memory_limit(big_file):
    path, _ = big_file
    m = EngramModel.load(path, mmap=True)
    eng = m.stream(2)
    hid = np.ones((BIG.hc_mult, BIG.hidden_size), np.float32)
    for t in range(50):
        eng.step(t, hid)
    assert memory.is_file_backed(m.layers[2].table)


# ---- hostile files ------------------------------------------------------------------------------------
def _entry(hdr, suffix):
    return next(t for k, t in hdr.items() if k.endswith(suffix))


def _set(key, field, value):
    def f(hdr, data):
        hdr[key][field] = value
        return hdr, data
    return f


def _meta(field, value):
    def f(hdr, data):
        if value is None:
            hdr["__metadata__"].pop(field)
        else:
            hdr["__metadata__"][field] = value
        return hdr, data
    return f


def _overwrite(key, values):
    def f(hdr, data):
        b, e = hdr[key]["data_offsets"]
        data = bytearray(data)
        data[b:e] = np.asarray(values(np.frombuffer(data[b:e], np.int64)), np.int64).tobytes()
        return hdr, bytes(data)
    return f


def _replace(key, dtype=None, shape=None):
    """Change a tensor's dtype and/or shape, keeping its byte size (so only the config checks see it)."""
    def f(hdr, data):
        t = hdr[key]
        if dtype is not None:
            t["dtype"] = dtype
        if shape is not None:
            t["shape"] = shape(t["shape"]) if callable(shape) else shape
        return hdr, data
    return f


def _overlap(hdr, data):
    hdr["layers.1.norm2.0.weight"]["data_offsets"] = list(hdr["layers.1.norm1.0.weight"]["data_offsets"])
    return hdr, data


def _drop(key):
    def f(hdr, data):
        del hdr[key]
        return hdr, data
    return f


def _rename(hdr, data):
    hdr["layers.1.norm1.9.weight"] = hdr.pop("layers.1.norm1.0.weight")
    return hdr, data


def _cfg_change(**kw):
    def f(hdr, data):
        c = json.loads(hdr["__metadata__"]["config"])
        c.update(kw)
        hdr["__metadata__"]["config"] = json.dumps(c)
        return hdr, data
    return f


TABLE1 = "layers.1.multi_head_embedding.embedding.weight"
HOSTILE = {
    "offsets past end": (_set("layers.4.value_proj.bias", "data_offsets", [10 ** 9, 10 ** 9 + 96]), "past the end"),
    "overlap": (_overlap, "overlap"),
    "span vs shape": (_set("layers.1.value_proj.bias", "shape", [25]), "needs"),
    "unknown dtype": (_set("layers.1.value_proj.bias", "dtype", "X99"), "dtype X99, expected F32"),
    "dtype not read": (_replace("layers.1.value_proj.bias", dtype="U16", shape=[48]), "dtype U16, expected F32"),
    "span vs other dtype": (_set("layers.1.value_proj.bias", "dtype", "U16"), "U16 \\[24\\] needs 48"),
    "negative shape": (_set("layers.1.value_proj.bias", "shape", [-24]), "non-negative"),
    "bad offsets": (_set("layers.1.value_proj.bias", "data_offsets", [5]), "data_offsets"),
    "dtype vs config": (_replace("layers.1.value_proj.bias", dtype="F16", shape=[48]), "dtype F16, expected F32"),
    "table dtype": (_replace(TABLE1, dtype="I64", shape=lambda s: [s[0], 4]), "expected F32 or F16 or I8"),
    "shape vs config": (_replace(TABLE1, shape=lambda s: [s[0] * 2, 4]), "disagrees with the config"),
    "missing tensor": (_drop("layers.4.key_projs.3.bias"), "missing"),
    "unexpected tensor": (_rename, "unexpected"),
    "no metadata": (_drop("__metadata__"), "not an engram_stream checkpoint"),
    "other format": (_meta("format", "gguf"), "not an engram_stream checkpoint"),
    "future version": (_meta("format_version", "99"), "format_version"),
    "no config": (_meta("config", None), "no config"),
    "config not json": (_meta("config", "{oops"), "config is invalid"),
    "config invalid": (_cfg_change(hidden_size=-3), "config is invalid"),
    "config hc_mult huge": (_cfg_change(hc_mult=10 ** 8), "needs at least|2\\*\\*31"),
    "other vocab (rows)": (_cfg_change(engram_vocab_size=[103, 211]), "primes|rows"),
    "primes": (_overwrite("plan.1.primes", lambda p: p + 2), "primes disagree"),
    "offsets": (_overwrite("layers.4.multi_head_embedding.offsets", lambda o: o[::-1]), "offsets disagree"),
    "compression gaps": (_overwrite("plan.compression", lambda c: c * 2), "hash plan"),
    "config nested 1e5 deep": (_meta("config", "[" * 100000 + "]" * 100000), "config is invalid"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_header(tmp_path, case):
    mutate, match = HOSTILE[case]
    p = str(tmp_path / "m.st")
    _model("compression").save(p)
    _join(p, *mutate(*_split(p)))
    with pytest.raises(CheckpointError, match=match) as e:
        EngramModel.load(p)
    assert isinstance(e.value, ValueError) and p in str(e.value)


def test_truncated_files(saved, tmp_path):
    _, p = saved
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    q = tmp_path / "t.st"
    cuts = {0: "too short", 5: "too short", 8: "runs past", 8 + n // 2: "runs past", 8 + n: "past the end",
            8 + n + 100: "past the end", (len(raw) + 8 + n) // 2: "past the end", len(raw) - 1: "past the end"}
    for cut, match in cuts.items():
        q.write_bytes(raw[:cut])
        for mmap in (True, False):
            with pytest.raises(CheckpointError, match=match):
                EngramModel.load(q, mmap=mmap)


@pytest.mark.parametrize("case", ["garbage", "huge length", "bad json", "not utf8", "json list", "duplicate key",
                                  "nested 1e5 deep"])
def test_corrupt_files(tmp_path, case):
    q = tmp_path / "x.st"
    rng = np.random.default_rng(0)
    body = {
        "garbage": rng.integers(0, 256, 5000, dtype=np.uint8).tobytes(),
        "huge length": struct.pack("<Q", 1 << 40) + b"{}" * 100,
        "bad json": struct.pack("<Q", 16) + b'{"a": [1, 2,,]} ' + b"\0" * 64,
        "not utf8": struct.pack("<Q", 8) + b"\xff\xfe{}    ",
        "json list": struct.pack("<Q", 8) + b"[1, 2]  ",
        "duplicate key": struct.pack("<Q", 16) + b'{"a":{},"a":{}} ',
        "nested 1e5 deep": struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000,
    }[case]
    q.write_bytes(body)
    with pytest.raises(CheckpointError):
        EngramModel.load(q)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        EngramModel.load(tmp_path / "nope.safetensors")


NOT_REGULAR = r"""
import os, sys
from engram_stream.demo import checkpoint
from engram_stream.errors import CheckpointError
d = sys.argv[1]
os.mkfifo(os.path.join(d, "fifo"))
for path in (os.path.join(d, "fifo"), "/dev/zero", d):
    try:
        checkpoint.load(path)
    except CheckpointError as e:
        assert "not a regular file" in str(e), e
    else:
        sys.exit(f"{path} loaded")
"""


def test_non_regular_files_are_refused(tmp_path):
    """A FIFO would block open() forever and a device could be read without end: refused before
    any read (in a subprocess: a hang or a crash fails the test instead of stopping the run)."""
    r = run_python(["-c", NOT_REGULAR, str(tmp_path)], timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


SLOW_CHAIN = r"""
import json, sys, time
import numpy as np
from safetensors.numpy import save_file
from engram_stream.demo import checkpoint
from engram_stream.errors import CheckpointError
H, E = 2 * 20000, 2 * 20000      # 20000 heads per order near 2**61: minutes of prime search
cfg = dict(engram_vocab_size=[2 ** 61, 2 ** 61], max_ngram_size=3, n_embed_per_ngram=20000,
           n_head_per_ngram=20000, layer_ids=[0], pad_id=0, seed=0, kernel_size=2, hidden_size=1,
           hc_mult=1, vocab_size=10)
z = lambda *shape, dt=np.float32: np.zeros(shape, dt)
t = {"plan.0.multipliers": z(3, dt=np.int64), "plan.0.primes": z(H, dt=np.int64),
     "layers.0.multi_head_embedding.offsets": z(H, dt=np.int64),
     "layers.0.multi_head_embedding.embedding.weight": z(1, 1),
     "layers.0.value_proj.weight": z(1, E), "layers.0.value_proj.bias": z(1),
     "layers.0.key_projs.0.weight": z(1, E), "layers.0.key_projs.0.bias": z(1),
     "layers.0.norm1.0.weight": z(1), "layers.0.norm2.0.weight": z(1),
     "layers.0.short_conv.norms.0.weight": z(1), "layers.0.short_conv.conv.weight": z(1, 1, 2)}
save_file(t, sys.argv[1], metadata={"format": "engram_stream", "format_version": "1", "config": json.dumps(cfg)})
t0 = time.monotonic()
try:
    checkpoint.load(sys.argv[1])
except CheckpointError as e:
    assert "rows" in str(e), e
else:
    sys.exit("loaded")
assert time.monotonic() - t0 < 5, time.monotonic() - t0
"""


def test_header_needing_a_long_prime_search_is_refused_quickly(tmp_path):
    """Cheap invariants first: a table of 1 row cannot hold 40000 primes near 2**61, so the
    prime search (minutes here) never starts."""
    r = run_python(["-c", SLOW_CHAIN, str(tmp_path / "slow.st")], timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


KILLED_SAVE = r"""
import os, signal, sys
from engram_stream import EngramModel
model, path = EngramModel.load(sys.argv[1]), sys.argv[2]


def progress(done, total):  # SIGKILL mid-write: no cleanup of any kind runs
    if done > total // 2:
        os.kill(os.getpid(), signal.SIGKILL)


model.save(path, progress=progress)
"""


def test_every_save_sweeps_the_temps_of_killed_writers(saved, tmp_path):
    """Saves SIGKILLed mid-write leave partial temps beside the file (they piled up: 3 kills, 3
    temps); every save (not only `engram-stream init`) removes those of dead writers first, and
    keeps the temps of live ones."""
    m, p = saved
    for _ in range(3):
        r = run_python(["-c", KILLED_SAVE, p, p], timeout=120)
        assert r.returncode == -9, r.stderr[-2000:]
    temps = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert len(temps) == 1   # each killed save swept the one before it
    live = tmp_path / f"{os.path.basename(p)}.tmp-1.0123"   # pid 1 runs: its temp stays
    live.write_bytes(b"x")
    m.save(p)
    assert sorted(n for n in os.listdir(tmp_path) if ".tmp-" in n) == [live.name]
    back = EngramModel.load(p)
    assert all(np.array_equal(v, back.state_dict(L)[k]) for L in CFG.layer_ids for k, v in m.state_dict(L).items())
