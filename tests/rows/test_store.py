"""The mmap tier: advice, residency (mincore), eviction, row prefetch, and decoding over a mapped table."""
from __future__ import annotations

import gc
import mmap
import time

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.demo import checkpoint
from engram_stream.errors import FileChangedError
from engram_stream.io.files import mapping_of
from engram_stream.io import memory

PAGE = memory.PAGE
# One layer, head_dim 64 (256-byte float32 rows), a ~17 MB table.
CFG = EngramConfig(engram_vocab_size=[4099, 4099], max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8,
                   layer_ids=[3], pad_id=2, kernel_size=4, hidden_size=32, hc_mult=2, vocab_size=1000)
L = 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    m = EngramModel.init(CFG, seed=0)
    f32, i8 = str(d / "f32.safetensors"), str(d / "i8.safetensors")
    m.save(f32)
    m.save(i8, table_dtype="int8")
    return m, f32, i8


def _cold(path):
    """Load with the file's pages evicted from the page cache (skip where the kernel keeps them)."""
    gc.collect()  # models of earlier tests may still map the file: their pages cannot be evicted
    memory.evict_file(path)
    m = EngramModel.load(path, mmap=True)
    w = m.layers[L]
    if memory.resident_bytes(w.table) > 0.01 * w.table.nbytes:
        pytest.skip("posix_fadvise(DONTNEED) does not evict this file system's pages (tmpfs?)")
    return m


def _wait_resident(a, at_least, timeout=5.0):
    t0 = time.monotonic()
    while memory.resident_bytes(a) < at_least and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    return memory.resident_bytes(a)


def _vma_flags(addr):
    """VmFlags of the mapping holding addr, from /proc/self/smaps."""
    current = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= addr < hi
        elif current and head == "VmFlags:":
            return line.split()[1:]
    return None


# ---- mappings and advice ---------------------------------------------------------------------------
def test_mapping_of(files, tmp_path):
    m, f32, _ = files
    t = EngramModel.load(f32).layers[L].table
    assert isinstance(mapping_of(t), mmap.mmap)
    assert memory.is_file_backed(t[10:20]) and memory.is_file_backed(t.reshape(-1)[5:])
    assert not memory.is_file_backed(m.layers[L].table) and not memory.is_file_backed(np.ones(3))
    mm = np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="w+", shape=(1024,))
    assert memory.is_file_backed(mm) and memory.is_file_backed(mm[3:])


def test_load_advises_random(files):
    """A cold gather must read the row's page only: mmap loads mark table mappings MADV_RANDOM."""
    _, f32, i8 = files
    for path in (f32, i8):
        w = EngramModel.load(path).layers[L]
        for a in (w.table, w.table_scale):
            if a is not None:
                mid = a.__array_interface__["data"][0] + a.nbytes // 2
                assert "rr" in _vma_flags(mid), path


def test_advise(files):
    m, f32, _ = files
    t = EngramModel.load(f32).layers[L].table
    for advice in ("normal", "sequential", "willneed", "random", "dontneed", mmap.MADV_RANDOM):
        memory.advise(t, advice)
    assert np.array_equal(t, m.layers[L].table)  # dontneed on a file mapping loses nothing
    with pytest.raises(ValueError, match="unknown advice"):
        memory.advise(t, "sometimes")
    ram = np.ones((1000, 64), np.float32)
    with pytest.raises(ValueError, match="destroy"):
        memory.advise(ram, "dontneed")
    memory.advise(ram, "willneed")
    assert (ram == 1).all()


@pytest.mark.parametrize("advice", [24, mmap.MADV_FREE, mmap.MADV_REMOVE, mmap.MADV_DONTFORK, -1, True, 3.0])
def test_advise_refuses_advice_outside_the_whitelist(advice):
    """24 is MADV_DONTNEED_LOCKED: on ordinary memory it zeroes the pages (glibc then aborts);
    MADV_FREE/REMOVE destroy data too, DONTFORK changes fork semantics. Only read hints pass."""
    ram = np.ones((1000, 64), np.float32)
    with pytest.raises((ValueError, TypeError), match="advice"):
        memory.advise(ram, advice)
    assert (ram == 1).all()


# ---- residency ---------------------------------------------------------------------------------------
def test_resident_bytes_of_ordinary_memory():
    buf = mmap.mmap(-1, 32 << 20)  # fresh anonymous memory: no page is there until written
    a = np.frombuffer(buf, np.uint8)
    assert memory.resident_bytes(a) < 1 << 20
    a[: 8 << 20] = 1
    r = memory.resident_bytes(a)
    assert 8 << 20 <= r <= 12 << 20  # slack: transparent huge pages fault in 2 MB at a time
    assert memory.resident_bytes(a[100:5000]) == 4900  # partial pages count their overlap only
    assert memory.resident_bytes(np.ones(0)) == 0


def test_cold_touch_grows_resident(files):
    m, f32, _ = files
    cold = _cold(f32)
    t, ref = cold.layers[L].table, m.layers[L].table
    rng = np.random.default_rng(0)
    few, many = rng.choice(len(t), 10, replace=False), rng.choice(len(t), 1000, replace=False)
    assert np.array_equal(t[few], ref[few])
    r_few = memory.resident_bytes(t)
    assert 10 * 256 <= r_few <= 10 * 2 * PAGE + 2 * PAGE  # no read-ahead around the rows
    assert r_few < 0.01 * t.nbytes
    assert np.array_equal(t[many], ref[many])
    r_many = memory.resident_bytes(t)
    assert r_many > 20 * r_few and r_many <= 1010 * 2 * PAGE
    rep = memory.residency(cold)[L]
    assert rep == {"table_bytes": t.nbytes, "resident_bytes": r_many, "file_backed": True}


def test_read_rows_reads_by_pread_and_leaves_the_page_cache_as_it_was(files):
    """read_rows: a few rows of a mapped table, equal to indexing it, without faulting the
    mapping and with the pages it read dropped again; an already cached page stays cached."""
    _, _, i8 = files
    in_ram = EngramModel.load(i8, mmap=False).layers[L]
    cold = _cold(i8)
    t, s = cold.layers[L].table, cold.layers[L].table_scale
    rows = np.array([0, 5, 5, t.shape[0] // 2, t.shape[0] - 1])
    for a, want in ((t, in_ram.table), (s, in_ram.table_scale)):
        before = memory.resident_bytes(a)                     # an edge page load read beside it, at most
        assert before <= 2 * memory.PAGE
        got = memory.read_rows(a, rows)
        assert got.flags.c_contiguous and got.dtype == a.dtype
        np.testing.assert_array_equal(got, want[rows])
        assert memory.resident_bytes(a) == before
    memory.touch(t[:1])                                       # a page cached before: left cached
    memory.read_rows(t, [0])
    assert memory.resident_bytes(t[:1]) == t[:1].nbytes
    ram = np.arange(12.0).reshape(4, 3)                      # ordinary memory: indexed
    np.testing.assert_array_equal(memory.read_rows(ram, [3, 1]), ram[[3, 1]])
    with pytest.raises(IndexError):
        memory.read_rows(t, [t.shape[0]])


def test_byte_chunks_read_a_whole_table_and_leave_the_page_cache_as_it_was(files):
    """byte_chunks (a table's digest): every byte of a mapped table, in order, by pread; the pages
    it brought in are dropped again, the next chunk's too (read-ahead would bring them in before
    their chunk looked: they were kept), and pages cached before stay cached."""
    m, f32, _ = files
    want = np.ascontiguousarray(m.layers[L].table).reshape(-1).view(np.uint8)
    cold = _cold(f32)
    t = cold.layers[L].table
    assert t.nbytes > 8 << 20
    inner = t[8:-8]                                           # the edge pages: shared with the weights beside
    memory.touch(t[1000:1100])                                # cached before: left cached
    before = memory.resident_bytes(inner)
    got = np.concatenate([np.frombuffer(c, np.uint8).copy() for c in memory.byte_chunks(t, 1 << 20)])
    np.testing.assert_array_equal(got, want)
    assert memory.resident_bytes(inner) == before and memory.resident_bytes(t[1000:1100]) == t[1000:1100].nbytes
    ram = np.arange(10.0)                                      # ordinary memory
    assert b"".join(bytes(c) for c in memory.byte_chunks(ram, 24)) == ram.tobytes()


def test_release_and_evict(files):
    m, f32, _ = files
    cold = _cold(f32)
    t = cold.layers[L].table
    memory.touch(t)
    assert memory.resident_bytes(t) == t.nbytes
    memory.release(cold)  # unmapped from this process, still cached
    memory.evict_file(f32)
    assert memory.resident_bytes(t) < 0.01 * t.nbytes
    assert np.array_equal(t[::97], m.layers[L].table[::97])  # and read back on demand


def test_residency_in_ram(files):
    m, _, _ = files
    rep = memory.residency(m)
    assert rep[L]["file_backed"] is False and rep[L]["table_bytes"] == m.layers[L].table.nbytes
    assert rep[L]["resident_bytes"] == rep[L]["table_bytes"]  # init wrote every page


# ---- prefetch ------------------------------------------------------------------------------------------
def _pages_of(a, rows):
    base, rb = a.__array_interface__["data"][0], a.strides[0]
    return {p for r in rows for p in range((base + r * rb) // PAGE, (base + r * rb + rb - 1) // PAGE + 1)}


def _fed_rows(eng, seed):
    """Feed a one-stream engine one token (hashed only: feed() reads no page of the table): its rows."""
    eng.feed(int(np.random.default_rng(seed).integers(0, CFG.vocab_size)))
    return np.asarray(eng.rows).ravel()


def test_engine_prefetch_reads_rows_in(files):
    """engine.prefetch() after feed(): the fed rows' pages come into the page cache (MADV_WILLNEED),
    not a read-ahead window around them."""
    m, f32, _ = files
    cold = _cold(f32)
    t = cold.layers[L].table
    eng = cold.stream(L)
    rows = _fed_rows(eng, 1)
    n = len(_pages_of(t, rows))
    assert eng.prefetch() == 0  # no advice call failed
    got = _wait_resident(t, 0.9 * n * PAGE)
    assert 0.9 * n * PAGE <= got <= 2 * n * PAGE + 64 * PAGE
    assert np.array_equal(t[rows], m.layers[L].table[rows])


def test_engine_prefetch_int8_rows_and_scales(files):
    """An int8 table's prefetch advises its rows' pages and their scales' pages (apart)."""
    m, _, i8 = files
    cold = _cold(i8)
    w = cold.layers[L]
    eng = cold.stream(L)
    rows = _fed_rows(eng, 2)
    n_scale = len(_pages_of(w.table_scale, rows))
    assert eng.prefetch() == 0
    assert _wait_resident(w.table_scale, 0.9 * n_scale * PAGE) >= 0.9 * n_scale * PAGE
    ref = checkpoint.compact(m, "int8").layers[L]
    assert np.array_equal(w.table_f32(rows), ref.table_f32(rows))


def test_decode_over_mapped_table_with_prefetch(files):
    """feed() -> prefetch() -> compute() over a cold mapped table == the in-RAM engine."""
    m, f32, _ = files
    cold = _cold(f32)
    w = cold.layers[L]
    e_ram, e_map = m.stream(L), cold.stream(L)
    rng = np.random.default_rng(3)
    for _ in range(64):
        tok = int(rng.integers(0, CFG.vocab_size))
        hid = rng.standard_normal((CFG.hc_mult, CFG.hidden_size)).astype(np.float32)
        e_map.feed(tok)
        assert e_map.prefetch() == 0
        assert np.array_equal(e_map.compute(hid), e_ram.step(tok, hid))
    assert memory.resident_bytes(w.table) <= 64 * CFG.n_heads * 2 * PAGE


def test_residency_rows_touched(files):
    """rows_touched from the engine's row bitmap: the distinct rows the decode read."""
    _, f32, _ = files
    cold = _cold(f32)
    eng = cold.stream(L)
    bitmap = memory.track_rows(eng)
    rng = np.random.default_rng(4)
    rows = set()
    for _ in range(40):
        eng.feed(int(rng.integers(0, CFG.vocab_size)))
        rows.update(eng.rows.ravel().tolist())
        eng.compute(rng.standard_normal((CFG.hc_mult, CFG.hidden_size)).astype(np.float32))
    rep = memory.residency(cold, touched={L: bitmap})[L]
    assert rep["rows_touched"] == len(rows)
    assert rep["resident_bytes"] <= len(rows) * 2 * PAGE
    assert "rows_touched" not in memory.residency(cold)[L]


# ---- a mapped file changed under a loaded model --------------------------------------
CHANGED = r"""
import os, sys
import numpy as np
from engram_stream import EngramConfig, EngramModel
from engram_stream.errors import FileChangedError
cfg = EngramConfig(engram_vocab_size=[4099, 4099], max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8,
                   layer_ids=[3], pad_id=2, kernel_size=4, hidden_size=32, hc_mult=2, vocab_size=1000)
d, mode = sys.argv[1], sys.argv[2]
p, q = os.path.join(d, "m.st"), os.path.join(d, "other.st")
a, b = EngramModel.init(cfg, seed=0), EngramModel.init(cfg, seed=1)
a.save(p)
b.save(q)
os.utime(p, ns=(10 ** 18, 10 ** 18))     # an old mtime: any later write to the file changes it
m = EngramModel.load(p)
ids = np.random.default_rng(0).integers(0, 1000, (4, 64))
hid = np.ones((4, 64, 2, 32), np.float32)
want = a.forward(3, ids, hid)
assert np.allclose(m.forward(3, ids, hid), want, atol=2e-5, rtol=2e-4)
h1 = hid[0, 0]
eng, half = m.stream(3), m.stream(3)
eng.step(5, h1)
half.feed(7)                              # fed before the change, computed after it
if mode == "rename":                      # the safe way: a new file renamed over the old
    b.save(p)
    assert np.allclose(m.forward(3, ids, hid), want, atol=2e-5, rtol=2e-4)   # the mapping keeps the old file
    assert np.allclose(eng.step(9, h1), m.stream(3).prefill([5, 9], hid[0, :2])[1], atol=2e-5, rtol=2e-4)
    sys.exit(0)
if mode == "truncate":
    os.truncate(p, os.path.getsize(p) // 3)
else:                                     # the other model's bytes written over this file, in place
    with open(q, "rb") as src, open(p, "r+b") as dst:
        dst.write(src.read())
for call in (lambda: m.forward(3, ids, hid), lambda: m.save(os.path.join(d, "copy.st")),
             lambda: eng.step(5, h1), lambda: eng.prefill(ids[0], hid[0]), lambda: half.compute(h1)):
    try:
        call()
    except FileChangedError as e:
        assert ("truncated" if mode == "truncate" else "rewritten") in str(e) and p in str(e), e
    else:
        sys.exit(f"{mode}: not refused")
assert eng.tokens_seen.tolist() == [1] and half.pending_compute   # refused calls changed nothing
"""


@pytest.mark.parametrize("mode", ["truncate", "rewrite", "rename"])
def test_mapped_file_changed_under_a_model(tmp_path, mode):
    """Truncated (reads would SIGBUS) or rewritten in place (new tables with old weights): refused
    with FileChangedError. Replaced by rename (what save() does): the model keeps the old file."""
    from helpers.processes import run_python
    r = run_python(["-c", CHANGED, str(tmp_path), mode], timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
