"""Direct row reads (rows/_direct.pyx, include/engram_io.h) against the mapped bytes.

Every read is compared with numpy's view of the same file; the number of preads with a count
made here from the page arithmetic (each part's pages of the distinct rows, a record that
shares a page with the previous one joining its read)."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from engram_stream.errors import FileChangedError
from engram_stream.rows._direct import DirectReader, FilePart, IOPool, MemPart, RecordFile, wait_percentile

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

PAGE = 4096


def _file(path, nbytes, seed):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    data.tofile(path)
    return data


SPAN_MAX = 256 * 1024  # engram_io.h ES_IO_SPAN_MAX: the longest single read


def expected_reads(parts, rows):
    """Preads a batch needs: per file part, the distinct rows' page ranges in order, a range that
    shares a page with the read so far joining it (unless that read would pass SPAN_MAX)."""
    u = np.unique(rows)
    n = 0
    for p in parts:
        if not isinstance(p, FilePart):
            continue
        start = end = -1
        for r in u.tolist():
            a = p.offset + (r // p.per_group) * p.group_bytes + (r % p.per_group) * p.nbytes
            b = a + p.nbytes
            pa, pb = a // PAGE * PAGE, -(-b // PAGE) * PAGE
            if pa < end and pb - start <= SPAN_MAX:
                end = max(end, pb)
            else:
                n += 1
                start, end = pa, pb
    return n


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A V4.1-like layout in two files: weights [N, 256] at an odd offset of one file, scales
    [N, 8] in another (so weight rows straddle pages), plus the same records packed 15 a page."""
    d = tmp_path_factory.mktemp("direct")
    N = 3000
    wfile, sfile, pfile = d / "w.bin", d / "s.bin", d / "packed.bin"
    woff, soff = 4096 * 3 + 136, 24
    wdata = _file(wfile, woff + N * 256 + 100, 1)
    sdata = _file(sfile, soff + N * 8, 2)
    w = wdata[woff:woff + N * 256].reshape(N, 256)
    s = sdata[soff:soff + N * 8].reshape(N, 8)
    rec = np.concatenate([w, s], axis=1)
    pages = -(-N // 15)
    packed = np.zeros((pages * 15 + 0, 264), np.uint8)
    packed[:N] = rec
    buf = np.zeros((pages, PAGE), np.uint8)
    buf[:, :15 * 264] = packed.reshape(pages, 15 * 264)
    poff = PAGE
    full = np.concatenate([np.full(poff, 7, np.uint8), buf.ravel()])
    full.tofile(pfile)
    return dict(N=N, w=w, s=s, rec=rec, wfile=str(wfile), sfile=str(sfile), pfile=str(pfile),
                woff=woff, soff=soff, poff=poff)


def layouts(sh):
    N = sh["N"]
    return {
        "shards": [FilePart(sh["wfile"], sh["woff"], 256), FilePart(sh["sfile"], sh["soff"], 8)],
        "packed": [FilePart(sh["pfile"], sh["poff"], 264, per_group=15, group_bytes=PAGE)],
        "scales_in_ram": [FilePart(sh["wfile"], sh["woff"], 256), MemPart(np.ascontiguousarray(sh["s"]))],
        "one_file_two_parts": [FilePart(sh["wfile"], sh["woff"], 256), FilePart(sh["wfile"], sh["woff"] + 13, 8)],
    }, N


@pytest.mark.parametrize("layout", ["shards", "packed", "scales_in_ram", "one_file_two_parts"])
@pytest.mark.parametrize("qd", [1, 2, 16])
def test_reads_match_the_mapped_bytes(shard, layout, qd):
    parts_by, N = layouts(shard)
    parts = parts_by[layout]
    f = RecordFile(N, parts, rowbytes=256)
    assert f.recbytes == 264 and f.rowbytes == 256 and f.scalebytes == 8
    want_all = np.concatenate([shard["w"], shard["w"][:, 13:21] if layout == "one_file_two_parts"
                               else shard["s"]], axis=1)
    if layout == "one_file_two_parts":  # the second part: 8 bytes from 13 past each row's start
        flat = np.fromfile(shard["wfile"], np.uint8)
        o = shard["woff"] + 13 + 8 * np.arange(N)
        want_all[:, 256:] = flat[o[:, None] + np.arange(8)]
    io = IOPool(qd)
    r = DirectReader(f, io)
    rng = np.random.default_rng(qd)
    batches = [rng.integers(0, N, 50), rng.integers(0, N, (4, 24)), np.array([5, 5, 5, 6, 4]),
               np.arange(N), np.array([N - 1, 0]), np.zeros(0, np.int64), rng.integers(0, 40, 300)]
    before = r.stats()["reads"]
    total = 0
    for b in batches:
        got = r.read(b)
        np.testing.assert_array_equal(got, want_all[np.asarray(b).ravel()])
        total += expected_reads(parts, np.asarray(b).ravel())
    st = r.stats()
    assert st["reads"] - before == total
    assert st["rows_read"] == sum(len(np.unique(b)) for b in batches)
    if qd > 1:
        assert io.threads == qd - 1


def test_packed_file_reads_one_page_per_row_and_pages_once(shard):
    """15 records a page, none straddling: a batch costs one read per distinct page."""
    parts_by, N = layouts(shard)
    r = DirectReader(RecordFile(N, parts_by["packed"], rowbytes=256), IOPool(4))
    rows = np.array([0, 1, 14, 15, 29, 30, 2999, 2999, 1500])
    r.read(rows)
    assert r.stats()["reads"] == len(np.unique(rows // 15)) == 5
    r.read(np.array([7]))
    assert r.stats()["reads"] == 6 and r.stats()["bytes_read"] == 6 * PAGE


_RAMFS = """
import os, sys, shutil, numpy as np
from engram_stream.rows._direct import DirectReader, FilePart, IOPool, RecordFile
src, woff, soff, N, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
w, s = shutil.copy(src + "/w.bin", d), shutil.copy(src + "/s.bin", d)
t = RecordFile(N, [FilePart(w, woff, 256), FilePart(s, soff, 8)])
rows = np.random.default_rng(0).integers(0, N, 100)
print(int(any(t.direct)), DirectReader(t, IOPool(3)).read(rows).tobytes().hex())
"""


def test_o_direct_where_the_file_system_takes_it_buffered_elsewhere(shard, tmp_path):
    """ext4 (the tests' temp folder here) and tmpfs (Linux >= 6.6) take O_DIRECT; ramfs refuses
    it at open: the same bytes either way."""
    import shutil
    import subprocess
    import sys
    parts_by, N = layouts(shard)
    f = RecordFile(N, parts_by["shards"], rowbytes=256)
    rows = np.random.default_rng(0).integers(0, N, 100)
    want = shard["rec"][rows]
    np.testing.assert_array_equal(DirectReader(f, IOPool(3)).read(rows), want)
    plain = RecordFile(N, parts_by["shards"], rowbytes=256, direct=False)
    assert plain.direct == (False, False)
    np.testing.assert_array_equal(DirectReader(plain, IOPool(3)).read(rows), want)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a ramfs needs root and unshare(1)")
    d = tmp_path / "ramfs"
    d.mkdir()
    script = f"mount -t ramfs none {d} && exec {sys.executable} -c '{_RAMFS}' " + " ".join(
        map(str, [os.path.dirname(shard["wfile"]), shard["woff"], shard["soff"], N, d]))
    # from tmp_path: run from the checkout, `python -c` would put its unbuilt tree first on sys.path
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert r.returncode == 0, r.stderr[-2000:]
    direct, data = r.stdout.split()
    assert direct == "0"  # buffered
    np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(data), np.uint8).reshape(want.shape), want)


def test_refusals(shard, tmp_path):
    parts_by, N = layouts(shard)
    f = RecordFile(N, parts_by["shards"], rowbytes=256)
    r = DirectReader(f, IOPool(2))
    for bad in ([N], [-1], [0, N + 5]):
        with pytest.raises(IndexError, match="out of range"):
            r.read(bad)
    np.testing.assert_array_equal(r.read([3]), shard["rec"][[3]])  # still works
    with pytest.raises(ValueError, match="need"):  # the file is too short for the rows
        RecordFile(N + 1000, parts_by["shards"])
    with pytest.raises(ValueError, match="qd"):
        IOPool(0)
    with pytest.raises(ValueError, match="1 to 2 parts"):
        RecordFile(N, [])
    with pytest.raises(ValueError, match="MemPart"):
        MemPart(np.zeros((3, 4), np.float32))
    with pytest.raises(FileNotFoundError):
        RecordFile(4, [FilePart(tmp_path / "nope.bin", 0, 8)])


def test_truncated_file_is_refused_not_served(shard, tmp_path):
    """A file cut short after it was opened: refused before any read (every batch from then
    on, as a mapped file is), the change named."""
    import shutil
    w = shutil.copy(shard["wfile"], tmp_path / "w.bin")
    N = shard["N"]
    f = RecordFile(N, [FilePart(w, shard["woff"], 256), FilePart(shard["sfile"], shard["soff"], 8)])
    r = DirectReader(f, IOPool(4))
    np.testing.assert_array_equal(r.read([N - 1]), shard["rec"][[N - 1]])
    os.truncate(w, shard["woff"] + 100 * 256)
    with pytest.raises(FileChangedError, match="truncated"):
        r.read([5, N - 1, N - 2])
    with pytest.raises(FileChangedError, match="truncated"):
        r.read([5])


def test_device_errors_are_reported(shard):
    """A real EIO from pread: the record file's descriptor is pointed at /proc/self/mem, whose
    reads at unmapped addresses (the file offsets here) fail with EIO."""
    parts_by, N = layouts(shard)
    f = RecordFile(N, parts_by["shards"], rowbytes=256, direct=False)
    r = DirectReader(f, IOPool(3))
    fd = f.fileno(shard["sfile"])
    mem = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        os.dup2(mem, fd)
        f._restamp()  # the same file to its change check: only its reads fail
        with pytest.raises(OSError) as e:
            r.read([1, 2, 3, 400])
        assert e.value.errno == errno.EIO and shard["sfile"] in str(e.value)
    finally:
        os.close(mem)


def test_wait_histogram_percentiles():
    h = np.zeros(240, np.int64)
    assert wait_percentile(h, 0.5) == 0.0
    h[80] = 99  # 2^10 us: ~1 ms
    h[160] = 1  # ~1 s
    assert 0.95e-3 < wait_percentile(h, 0.5) < 1.1e-3
    assert 0.95e-3 < wait_percentile(h, 0.99) < 1.1e-3
    assert wait_percentile(h, 1.0) > 0.9


def test_fork_child_reads_with_threads_of_its_own(shard):
    """A pool whose threads ran in the parent works in a forked child (its threads start anew)."""
    parts_by, N = layouts(shard)
    r = DirectReader(RecordFile(N, parts_by["shards"], rowbytes=256), IOPool(4))
    rows = np.arange(0, N, 7)
    r.read(rows)
    pid = os.fork()
    if pid == 0:
        ok = np.array_equal(r.read(rows), shard["rec"][rows])
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


_FIRST_READS = """
import sys, threading, numpy as np
from engram_stream.rows._direct import DirectReader, FilePart, IOPool, RecordFile
w, woff, s, soff, N = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
f = RecordFile(N, [FilePart(w, woff, 256), FilePart(s, soff, 8)], rowbytes=256)
want = DirectReader(f, IOPool(1)).read(np.arange(N))
for rnd in range(40):
    io = IOPool(8)
    readers = [DirectReader(f, io) for _ in range(4)]
    go, bad = threading.Barrier(4), []
    def run(i):
        rows = np.random.default_rng(rnd * 4 + i).integers(0, N, 400)
        go.wait()
        try:
            if not np.array_equal(readers[i].read(rows), want[rows]):
                bad.append((rnd, i, "wrong bytes"))
        except Exception as e:
            bad.append((rnd, i, repr(e)))
    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert not bad, bad
    assert io.threads == 7, io.threads
print("ok")
"""


def test_first_reads_on_several_threads_start_one_set_of_threads(shard, tmp_path):
    """Four threads making the first reads of a fresh pool at once: the pool starts its qd - 1
    threads once (one caller starts them, the others wait), every read is right. In a
    subprocess: the race it guards against corrupted the heap or crashed."""
    from helpers.processes import run_python   # from outside the checkout: its unbuilt source must not shadow the package
    r = run_python(["-c", _FIRST_READS, shard["wfile"], str(shard["woff"]), shard["sfile"], str(shard["soff"]),
                    str(shard["N"])], timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr[-2000:]


def test_records_up_to_one_reads_buffer_are_read_larger_ones_refused(tmp_path):
    """A record part is read by one pread into a buffer of SPAN_MAX bytes: the largest part that
    fits at any alignment (SPAN_MAX - PAGE + 1 bytes) reads right at every page offset; one
    byte more is refused when the file is opened, naming the size (it overflowed the buffer)."""
    nb, N = SPAN_MAX - PAGE + 1, 5
    path = tmp_path / "big.bin"
    for off in (0, PAGE - 1, 17):
        data = _file(path, off + N * nb, off)
        want = data[off:].reshape(N, nb)
        r = DirectReader(RecordFile(N, [FilePart(path, off, nb)]), IOPool(3))
        rows = np.array([4, 0, 2, 3, 1, 1])
        np.testing.assert_array_equal(r.read(rows), want[rows])
    _file(path, N * (nb + 1), 1)
    with pytest.raises(ValueError, match=f"{nb + 1} bytes.*tables='mapped'"):
        RecordFile(N, [FilePart(path, 0, nb + 1)])
    from engram_stream.rows._direct import MAX_PART_BYTES
    assert MAX_PART_BYTES == nb


# ---- a model's files (rows/direct.py) -----------------------------------------------------------
V41 = dict(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=512,
           n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
           image_token_id=299)


@pytest.mark.parametrize("how", ["shards", "scales_in_ram", "packed"])
def test_a_models_records_from_its_files(tmp_path, how):
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.rows import packed
    from engram_stream.rows.direct import DirectTier
    from engram_stream.v41 import hf
    d = tmp_path / "ck"
    hf.make_synthetic(d, EngramConfig(**V41), seed=4, n_shards=3)
    model = EngramModel.from_deepseek_v41(d)
    if how == "packed":
        packed.pack_rows(model, packed.rows_path(d))
    files = DirectTier(qd=4, scales_in_ram=how == "scales_in_ram").open(model)
    assert (files.rows_path is not None) == (how == "packed")
    for L in V41["layer_ids"]:
        w = model.layer(L)
        want = np.concatenate([w.embed_weight, w.embed_scale], axis=1)
        f = files.files[L]
        assert (f.nparts, f.rowbytes, f.scalebytes) == ((1 if how == "packed" else 2), 256, 8)
        rows = np.random.default_rng(L).integers(0, want.shape[0], 300)
        r = DirectReader(f, files.io)
        np.testing.assert_array_equal(r.read(rows), want[rows])
        per_row = r.stats()["reads"] / r.stats()["rows_read"]
        assert per_row <= (1.0 if how != "shards" else 2.0)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_demo_records_from_its_file(tmp_path, dtype):
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.rows.direct import DirectTier
    from engram_stream.rows.records import record_arrays
    cfg = EngramConfig(hidden_size=32, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
                       engram_vocab_size=[211, 223], layer_ids=[1, 3], vocab_size=500, kernel_size=3)
    p = str(tmp_path / "m.safetensors")
    EngramModel.init(cfg, seed=3).save(p, table_dtype=dtype)
    model = EngramModel.load(p)
    files = DirectTier(qd=2).open(model)
    for L in cfg.layer_ids:
        rows_, scales = record_arrays(model.layer(L))
        want = rows_ if scales is None else np.concatenate([rows_, scales], axis=1)
        r = DirectReader(files.files[L], files.io)
        idx = np.arange(want.shape[0])[::-1]
        np.testing.assert_array_equal(r.read(idx), want[idx])


def test_direct_needs_mapped_tables(tmp_path):
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.rows.direct import DirectTier
    model = EngramModel.init(EngramConfig(**V41), seed=0)
    with pytest.raises(ValueError, match="mmap=True"):
        DirectTier().open(model)
    with pytest.raises(ValueError, match="qd"):
        DirectTier(qd=0)
    from engram_stream.rows.mapped import MappedTier
    from engram_stream.rows.tiers import parse_tier
    assert isinstance(parse_tier("direct"), DirectTier) and parse_tier("direct").qd == 32
    assert type(parse_tier("mapped")) is MappedTier
    t = DirectTier(qd=8)
    assert parse_tier(t) is t
    assert parse_tier({"direct": {"qd": 4, "scales_in_ram": True}}).qd == 4
    for bad in ("other", None, {"direct": {}, "mapped": {}}, {"direct": 4}):
        with pytest.raises(TypeError, match="tables= takes 'mapped' | 'direct' | 'mooncake', a Tier"):
            parse_tier(bad)
    with pytest.raises(TypeError, match="qq.*the arguments are .*'qd'"):
        parse_tier({"direct": {"qq": 1}})


def test_direct_model_reads_its_own_files_after_chdir(tmp_path, monkeypatch):
    """A model loaded by a relative path keeps its files: after chdir to a folder holding another
    checkpoint of the same name, with_weight_dtype() reads the first model's rows."""
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.rows.records import record_arrays
    cfg = EngramConfig(hidden_size=32, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
                       engram_vocab_size=[211, 223], layer_ids=[1, 3], vocab_size=500, kernel_size=3)
    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        EngramModel.init(cfg, seed=seed).save(str(tmp_path / name / "m.safetensors"))
    monkeypatch.chdir(tmp_path / "a")
    model = EngramModel.load("m.safetensors", tables="direct")
    monkeypatch.chdir(tmp_path / "b")
    bf = model.with_weight_dtype("bfloat16")
    for L in cfg.layer_ids:
        want = record_arrays(model.layer(L))[0]
        f = bf.tier.inner.files[L]
        rows = np.arange(want.shape[0])
        np.testing.assert_array_equal(DirectReader(f, bf.tier.inner.io).read(rows), want[rows])
        assert all(os.path.isabs(p) for p in f.paths if p)
    assert model.source == str(tmp_path / "a" / "m.safetensors")
