"""Memory and page advice: madvise, residency, page-cache eviction, process memory.

A table loaded with `EngramModel.load(path, mmap=True)` is a read-only view of the
checkpoint file. Its pages live in the kernel's page cache, are read on first touch,
are shared by every process that maps the file, and can be dropped by the kernel
under memory pressure (they are clean). Everything the engine does with such a table
is a plain memory read; this module only talks to the kernel about its pages and
reports what the process holds:

  advise(a, "random")       no read-ahead: a cold gather reads the rows' pages, not a window around them
  resident_bytes(a)         how much of `a` is in RAM (mincore: the page cache for file pages)
  read_rows(a, rows)        a few rows by pread, the mapping untouched and the page cache left as it was
  byte_chunks(a)            all of a's bytes in chunks, by pread like read_rows (a table's digest)
  evict_file(path)          drop the file's unmapped pages from the page cache (cold start)
  evict(model)              release() and evict_file() every file the model maps (a cold start)
  release(model)            unmap this process's table pages (they stay cached until evicted)
  residency(model)          {layer: {"table_bytes", "resident_bytes", "file_backed"[, "rows_touched"]}}
  track_rows(engine)        a bitmap the engine marks with every row it reads (for rows_touched)
  touch(a)                  fault every page of `a` in (warm-up, tests)
  mapping_bytes(prefix)     Rss and Pss of this process's mappings of some files (/proc/self/smaps)
  proc_status()             the memory lines of /proc/self/status in bytes

Row prefetch (MADV_WILLNEED of the rows a call reads) is the engine's: engine.prefetch() after
feed(), and every engine's submit() of a mapped table (rows._source.MappedRows).

The rule for mapped files (never rewrite one in place) and MappedFile, the mapping that
notices when it is broken: engram_stream.io.files.

Linux/POSIX only (madvise and mincore through ctypes on libc).
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ..errors import FileChangedError
from .files import MappedFile, mapping_of

PAGE = mmap.PAGESIZE
ADVICE = {"normal": mmap.MADV_NORMAL, "random": mmap.MADV_RANDOM, "sequential": mmap.MADV_SEQUENTIAL,
          "willneed": mmap.MADV_WILLNEED, "dontneed": mmap.MADV_DONTNEED}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int


def _madvise(addr: int, length: int, advice: int):
    if _libc.madvise(addr, length, advice) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"madvise({addr:#x}, {length}, {advice}): {os.strerror(e)}")


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _pages(a: np.ndarray):
    """(first page address, length in bytes) of the whole pages covering a's buffer."""
    start = _addr(a)
    first = start - start % PAGE
    end = start + a.nbytes
    return first, -(-(end - first) // PAGE) * PAGE


def is_file_backed(a) -> bool:
    return mapping_of(a) is not None


def advise(a: np.ndarray, advice):
    """madvise the pages under array `a`: "random", "willneed", "dontneed", "sequential", "normal"
    (or the mmap.MADV_* int of one of these: other advice, e.g. MADV_FREE, MADV_REMOVE or 24,
    MADV_DONTNEED_LOCKED, can destroy data or change fork semantics, so it is refused).
    "dontneed" is refused on ordinary memory: on anonymous pages it would zero the data; on
    shared file pages (our loads) it only unmaps them from this process (on a private
    copy-on-write mapping it would drop your writes to it)."""
    if isinstance(advice, str):
        if advice not in ADVICE:
            raise ValueError(f"unknown advice {advice!r}: one of {sorted(ADVICE)}")
        code = ADVICE[advice]
    elif isinstance(advice, (int, np.integer)) and not isinstance(advice, bool) and advice in ADVICE.values():
        code = int(advice)
    else:
        raise ValueError(f"advice {advice!r} is not allowed: one of {sorted(ADVICE)} or their mmap.MADV_* values")
    if code == mmap.MADV_DONTNEED and not is_file_backed(a):
        raise ValueError("advise(..., 'dontneed') on an array that is not a view of a file mapping "
                         "would destroy its data")
    if a.nbytes:
        _madvise(*_pages(a), code)


def resident_bytes(a: np.ndarray) -> int:
    """Bytes of `a` in RAM right now (mincore; partial edge pages count their overlap only)."""
    if a.nbytes == 0:
        return 0
    first, length = _pages(a)
    n = length // PAGE
    vec = np.zeros(n, dtype=np.uint8)
    if _libc.mincore(first, length, vec.ctypes.data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mincore: {os.strerror(e)}")
    per_page = np.full(n, PAGE, dtype=np.int64)
    start, end = _addr(a), _addr(a) + a.nbytes
    per_page[0] = min(end, first + PAGE) - start
    if n > 1:
        per_page[-1] = end - (first + (n - 1) * PAGE)
    return int(per_page[(vec & 1).astype(bool)].sum())


def _resident_pages(first: int, n: int) -> np.ndarray:
    """mincore of n pages from page address `first`: bool[n], True where the page is in RAM."""
    vec = np.zeros(n, dtype=np.uint8)
    if _libc.mincore(first, n * PAGE, vec.ctypes.data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mincore: {os.strerror(e)}")
    return (vec & 1).astype(bool)


def _own_descriptor(mm: MappedFile) -> int:
    """A new open file description of the mapped file (the inode mapped, not whatever its path
    names now): advice given to it changes nothing of the mapping's or anyone else's reads."""
    try:
        return os.open(f"/proc/self/fd/{mm.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no /proc: the path, when it still names the file mapped
        mm.check()
        fd = os.open(mm.path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != mm.stamp[:2]:
            os.close(fd)
            raise FileChangedError(f"{mm.path}: replaced after it was mapped: load it again")
        return fd


def _file_offset(mm: MappedFile, a: np.ndarray):
    """(the mapping's address, a's first byte in the file): the mapping starts at offset 0."""
    base = np.frombuffer(mm, np.uint8, 1).ctypes.data
    return base, _addr(a) - base


def file_extent(a):
    """(MappedFile, offset) when `a` is a C-contiguous view of a mapped file: its bytes are that
    file's bytes [offset, offset + a.nbytes); else None."""
    mm = mapping_of(a)
    if not isinstance(mm, MappedFile) or not a.flags.c_contiguous:
        return None
    return mm, _file_offset(mm, a)[1]


def byte_chunks(a: np.ndarray, chunk: int = 16 << 20):
    """Every byte of `a` in order, `chunk` bytes at a time (memoryviews, each valid until the next
    is asked for). A C-contiguous view of a mapped file is read like read_rows: pread on a
    descriptor of its own, never through the mapping, and the pages a chunk brought into the page
    cache are dropped again (POSIX_FADV_DONTNEED), so reading a whole table, to digest it, leaves
    the file's pages as it found them. The descriptor is advised POSIX_FADV_RANDOM: read-ahead
    would bring the next chunk's pages in, and they would count as cached before it (kept)."""
    ext = file_extent(a)
    if ext is None:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for at in range(0, flat.size, chunk):
            yield memoryview(flat[at:at + chunk])
        return
    mm, off0 = ext
    mm.check()
    base = _file_offset(mm, a)[0]
    buf = memoryview(bytearray(chunk))
    fd = _own_descriptor(mm)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for at in range(0, a.nbytes, chunk):
            n, off = min(chunk, a.nbytes - at), off0 + at
            p0, p1 = off // PAGE, (off + n - 1) // PAGE
            cold = ~_resident_pages(base + p0 * PAGE, p1 - p0 + 1)
            if os.preadv(fd, [buf[:n]], off) != n:
                mm.check()
                raise FileChangedError(f"{mm.path}: ends before byte {off + n} of a table it maps")
            yield buf[:n]
            edges = np.flatnonzero(np.diff(np.concatenate(([0], cold.view(np.int8), [0]))))  # runs of cold pages
            for s, e in zip(edges[0::2].tolist(), edges[1::2].tolist()):
                os.posix_fadvise(fd, (p0 + s) * PAGE, (e - s) * PAGE, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_rows(a: np.ndarray, rows) -> np.ndarray:
    """a[rows] (rows: ints indexing a's first axis) as a new C-contiguous array, without touching
    the mapping when `a` is a C-contiguous view of a mapped file: each row is read with pread on a
    descriptor of its own advised POSIX_FADV_RANDOM (only the rows' pages are read, no read-ahead
    around them), and the pages that were not in the page cache before are dropped from it again
    (POSIX_FADV_DONTNEED), so looking a few rows up leaves the file's pages as it found them.
    Any other array is indexed in memory."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    mm = mapping_of(a)
    if not isinstance(mm, MappedFile) or not a.flags.c_contiguous or a.ndim < 1 or not rows.size:
        return np.ascontiguousarray(a[rows])
    n = a.shape[0]
    if not (rows.min() >= 0 and rows.max() < n):
        raise IndexError(f"read_rows: rows outside [0, {n})")
    rb = a.itemsize * int(np.prod(a.shape[1:]))          # a row's bytes (strides[0] of one row may be anything)
    out = np.empty((rows.size,) + a.shape[1:], dtype=a.dtype)
    if not rb:
        return out
    mm.check()   # a file truncated since it was mapped: refused, as every read of the mapping is
    base, off0 = _file_offset(mm, a)                    # a's first byte in the file
    first = (off0 + rows * rb) // PAGE                  # each row's page span in the file
    last = (off0 + rows * rb + rb - 1) // PAGE
    pages = np.unique(np.concatenate([np.arange(f, e + 1) for f, e in zip(first.tolist(), last.tolist())]))
    cold = [p for p in pages.tolist() if not _resident_pages(base + p * PAGE, 1)[0]]   # the mapping starts at offset 0
    dst = out.reshape(rows.size, -1).view(np.uint8)
    fd = _own_descriptor(mm)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for k, r in enumerate(rows.tolist()):
            got = os.pread(fd, rb, off0 + r * rb)
            if len(got) != rb:
                mm.check()
                raise FileChangedError(f"{mm.path}: ends before row {r} of a table it maps")
            dst[k] = np.frombuffer(got, np.uint8)
        for p in cold:
            os.posix_fadvise(fd, p * PAGE, PAGE, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return out


def mapping_bytes(prefix, pid="self") -> dict:
    """{"rss", "pss"}: bytes of process PID's mappings of files whose path starts with prefix
    (/proc/PID/smaps: Rss counts every page it maps, Pss shares each page among its mappers)."""
    rss = pss = 0
    mine = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's line
                mine = len(head) >= 6 and head[5].startswith(prefix)
            elif mine and head[0] == "Rss:":
                rss += int(head[1]) * 1024
            elif mine and head[0] == "Pss:":
                pss += int(head[1]) * 1024
    return {"rss": rss, "pss": pss}


def proc_status(pid="self") -> dict:
    """Memory lines of /proc/PID/status in bytes: RssAnon, RssFile, VmRSS, VmHWM, ..."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def evict_file(path):
    """Ask the kernel to drop the file's pages from the page cache (POSIX_FADV_DONTNEED).
    Pages some process still has mapped are kept: release() this process's mappings first."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapped_files(model) -> list:
    """Paths of every file the model's layers map (a demo file, a V4.1 folder's shards), in order."""
    paths = []
    for w in model.layers.values():
        for a in w.file_arrays():
            mm = mapping_of(a)
            if isinstance(mm, MappedFile) and mm.path not in paths:
                paths.append(mm.path)
    return paths


def evict(model) -> list:
    """A cold start for a loaded model: unmap this process's pages of every file the model maps
    (MADV_DONTNEED on the whole mappings: clean file pages, nothing is lost) and drop those files
    and the packed row file beside the checkpoint (when there is one) from the page cache.
    Returns the paths evicted. Pages another process maps stay (the kernel keeps them)."""
    from ..rows import packed   # the row file's name beside a checkpoint
    paths = mapped_files(model)
    for w in model.layers.values():
        for a in w.file_arrays():
            if isinstance(mapping_of(a), MappedFile):
                advise(a, "dontneed")
    source = getattr(model, "source", None)
    rows = packed.rows_path(source) if source is not None else None
    if rows is not None and os.path.isfile(rows):
        paths.append(rows)
    for path in paths:
        evict_file(path)
    return paths


def _tables(model):
    for L, w in model.layers.items():
        yield L, [a for a in (w.table, w.table_scale) if a is not None]


def release(model):
    """Unmap this process's pages of every file-backed table (MADV_DONTNEED): RSS drops, the
    pages stay in the page cache until evict_file() or memory pressure. In-RAM tables are left."""
    for _, arrays in _tables(model):
        for a in arrays:
            if is_file_backed(a):
                advise(a, "dontneed")


def track_rows(engine) -> np.ndarray:
    """Make `engine` (a StreamEngine) record every table row it reads; returns the bitmap
    (uint8, bit r = row r) to pass to residency(model, touched={layer: bitmap}). Keep it alive."""
    bitmap = np.zeros((engine.model.plan.table_rows[engine.layer] + 7) // 8, dtype=np.uint8)
    engine.track_rows(bitmap)
    return bitmap


def residency(model, touched=None) -> dict:
    """{layer: {"table_bytes", "resident_bytes", "file_backed"}}; int8 scales count with their
    table. For file-backed tables resident means "in the page cache", whoever touched it.
    touched: {layer: bitmap from track_rows()} adds "rows_touched" (distinct rows read)."""
    out = {}
    for L, arrays in _tables(model):
        out[L] = {"table_bytes": sum(a.nbytes for a in arrays),
                  "resident_bytes": sum(resident_bytes(a) for a in arrays),
                  "file_backed": is_file_backed(arrays[0])}
        if touched is not None and L in touched:
            out[L]["rows_touched"] = int(np.unpackbits(touched[L]).sum())
    return out


def touch(a: np.ndarray) -> int:
    """Read one byte per page of `a` (faults it all in); returns a checksum so it is not elided."""
    if a.nbytes == 0:
        return 0
    b = a.reshape(-1).view(np.uint8)
    return int(b[::PAGE].sum(dtype=np.int64))
