# cython: language_level=3
"""Direct row reads: a table's row records read with pread from the checkpoint's own files.

    io = IOPool(qd=16)                                 # reads in flight per batch (qd - 1 threads + the caller)
    f = RecordFile(nrows, [FilePart(shard, off_w, 256), FilePart(shard2, off_s, 8)])   # V4.1 shards
    f = RecordFile(nrows, [FilePart(rows_file, off, 264, per_group=15, group_bytes=4096)], rowbytes=256)
    r = DirectReader(f, io)
    recs = r.read(rows)                                # uint8 [len(rows), 264], rows in the given order

The rules (page planning, pread loop, the pool) are in include/engram_io.h. A batch's rows are
de-duplicated, each file part's pages de-duplicated (a page is read once per batch, a record
that straddles two pages is one read of both), files opened with O_DIRECT where the file
system takes it (else buffered: tmpfs refuses O_DIRECT at open). Engines use the cdef
submit()/wait()/record() (no Python object per row); read() is the same for Python callers.
A failed read raises OSError (a short one: EIO naming the file, offset and byte counts; a file
changed since it was opened: FileChangedError) and nothing read by that batch is served.

A file changed since it was opened is one whose (device, inode, size, mtime, ctime) fstat
differs: ctime too, since anyone can put an mtime back (utime) but nobody can set a ctime.
Checksummed parts (the packed row file's: FilePart(sums=...)) are checked record by record as
they are read, in C (engram_io.h's es_io_sum): a record whose bytes are not the ones packed
(changed before the file was opened, or between the stat check and the read) raises
RowChecksumError naming the layer and row, and nothing of its batch is served.
"""
import errno as _errno
import mmap
import os
import stat

import numpy as np
cimport numpy as cnp
from libc.math cimport log2
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport close

from engram_stream.errors import FileChangedError, RowChecksumError
from engram_stream.io.files import _stamp, stamp_changed

cnp.import_array()

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

PAGE = ES_IO_PAGE
MAX_QD = ES_IO_MAX_QD
# The largest record part read from a file: one record's pages (its bytes and up to a page of
# alignment before them) must fit one read's buffer of ES_IO_SPAN_MAX bytes.
MAX_PART_BYTES = ES_IO_SPAN_MAX - ES_IO_PAGE + 1
WAIT_BUCKETS = 240          # read-wait histogram: 8 buckets per octave from 1 us


class FilePart:
    """One part of a record read from a file: row r's bytes at
    offset + (r // per_group) * group_bytes + (r % per_group) * nbytes. sums: the offset in a
    group of its records' 8-byte checksums (record k's at sums + 8 k: es_io_sum of its bytes,
    seeded seed + r), checked at every read; None: no checksums."""

    def __init__(self, path, offset, nbytes, per_group=1, group_bytes=None, sums=None, seed=0):
        self.path, self.offset, self.nbytes = os.fspath(path), int(offset), int(nbytes)
        self.per_group = int(per_group)
        self.group_bytes = int(nbytes if group_bytes is None else group_bytes)
        self.sums, self.seed = (None if sums is None else int(sums)), int(seed)
        if self.offset < 0 or self.nbytes <= 0 or self.per_group <= 0 \
                or self.group_bytes < self.per_group * self.nbytes:
            raise ValueError(f"FilePart({self.path!r}): offset {self.offset} >= 0, nbytes {self.nbytes} > 0 and "
                             f"group_bytes {self.group_bytes} >= per_group {self.per_group} x nbytes needed")
        if self.sums is not None and not (self.per_group * self.nbytes <= self.sums
                                          and self.sums + 8 * self.per_group <= self.group_bytes):
            raise ValueError(f"FilePart({self.path!r}): checksums at {self.sums} must follow the group's "
                             f"{self.per_group} x {self.nbytes} record bytes and end within its {self.group_bytes}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"FilePart({self.path!r}): seed {self.seed} is not a 64-bit unsigned value")

    def extent(self):
        """The most bytes one row's read must span (its record, and its checksum after it)."""
        if self.sums is None:
            return self.nbytes
        return self.sums + 8 + max(0, (self.per_group - 1) * (8 - self.nbytes))

    def end(self, nrows):
        """The file size the part's last row needs (its checksum's end too)."""
        if nrows == 0:
            return 0
        r = nrows - 1
        g = self.offset + (r // self.per_group) * self.group_bytes
        end = g + (r % self.per_group) * self.nbytes + self.nbytes
        return end if self.sums is None else max(end, g + self.sums + 8 * (r % self.per_group) + 8)

    def __repr__(self):
        return (f"FilePart({self.path!r}, offset={self.offset}, nbytes={self.nbytes}, per_group={self.per_group}, "
                f"group_bytes={self.group_bytes}" + ("" if self.sums is None else f", sums={self.sums}") + ")")


class MemPart:
    """One part of a record copied from memory: row r = array[r] (uint8 [nrows, nbytes], C order),
    e.g. the scales held in RAM."""

    def __init__(self, array):
        a = np.asarray(array)
        if not (a.dtype == np.uint8 and a.ndim == 2 and a.flags.c_contiguous):
            raise ValueError(f"MemPart needs a C-contiguous uint8 [rows, bytes] array, got {a.dtype} {a.shape}")
        self.array, self.nbytes = a, a.shape[1]

    def __repr__(self):
        return f"MemPart({self.array.shape[0]} x {self.nbytes} bytes)"




def record_sums(const uint8_t[:, ::1] records, uint64_t seed, int64_t first):
    """uint64[n]: the checksum of each record of records [n, bytes] (row first + i) as the
    direct reader checks them (es_io_sum: XXH64 of the bytes, seeded seed + row). The packed
    row file's writer stores them."""
    cdef int64_t n = records.shape[0], nb = records.shape[1]
    out = np.empty(n, np.uint64)
    cdef uint64_t[::1] o = out
    if n and nb:
        with nogil:
            es_io_sums(<const char *> &records[0, 0], n, nb, nb, seed, first, &o[0])
    elif n:
        for i in range(n):
            o[i] = es_io_sum(NULL, 0, seed + <uint64_t> (first + i))
    return out


def _open(path, direct):
    """(fd, direct in effect): O_DIRECT when the file system takes it, probed with one aligned
    read (some refuse at open, e.g. tmpfs, others at the first read); buffered otherwise."""
    flags = os.O_RDONLY | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != _errno.EINVAL:
                raise
        else:
            probe = mmap.mmap(-1, ES_IO_PAGE)  # anonymous maps are page aligned
            try:
                os.preadv(fd, [probe], 0)
                return fd, True
            except OSError as e:
                os.close(fd)
                if e.errno != _errno.EINVAL:
                    raise
            finally:
                probe.close()
    return os.open(path, flags), False


cdef class IOPool:
    """The threads that read rows: a batch keeps up to `qd` reads in flight (qd - 1 threads and
    the caller). One pool may serve every reader of a model; its threads start at the first
    read (and again in a forked child)."""

    def __cinit__(self, int qd=16):
        if not 1 <= qd <= ES_IO_MAX_QD:
            raise ValueError(f"qd (reads in flight) must be in [1, {ES_IO_MAX_QD}], got {qd}")
        if es_io_pool_init(&self.pool, qd) != 0:
            raise MemoryError("IOPool: no memory for its buffers")
        self.qd = qd
        self.ready = True

    def __dealloc__(self):
        if self.ready:  # readers hold the pool, and wait for their reads before they go
            with nogil:
                es_io_pool_free(&self.pool)

    @property
    def threads(self):
        """Threads running now (qd - 1 once a read has started them)."""
        return self.pool.started

    def __repr__(self):
        return f"IOPool(qd={self.qd})"


cdef class RecordFile:
    """A table's row records in files: nrows records of the parts' bytes in order (FilePart,
    MemPart). rowbytes: the bytes of a record that are the row (the rest is its scale; default
    the first part's bytes). direct: try O_DIRECT. layer: the layer the records are of (errors
    name it). The files stay open while this lives; check() refuses files changed since
    (FileChangedError)."""

    def __cinit__(self, int64_t nrows, parts, rowbytes=None, bint direct=True, layer=None):
        parts = list(parts)
        if not 1 <= len(parts) <= ES_IO_MAX_PARTS:
            raise ValueError(f"a record has 1 to {ES_IO_MAX_PARTS} parts, got {len(parts)}")
        if nrows < 0:
            raise ValueError(f"nrows must be >= 0, got {nrows}")
        self.nrows, self.nparts, self.layer = nrows, len(parts), layer
        self._fds, self._stamps, self._keep, paths, direct_in = {}, {}, [], [], []
        cdef int64_t off = 0
        cdef int i
        try:
            for i, p in enumerate(parts):
                if isinstance(p, MemPart):
                    if p.array.shape[0] != nrows:
                        raise ValueError(f"MemPart of {p.array.shape[0]} rows for a table of {nrows}")
                    self._keep.append(p.array)
                    self.parts[i].fd = -1
                    self.parts[i].mem = <const char *> cnp.PyArray_DATA(p.array)
                    self.parts[i].base = 0
                    self.parts[i].bytes = self.parts[i].group_bytes = p.nbytes
                    self.parts[i].per_group = 1
                    self.parts[i].sums, self.parts[i].seed = -1, 0
                    paths.append(None)
                    direct_in.append(False)
                elif isinstance(p, FilePart):
                    if p.extent() > MAX_PART_BYTES:
                        raise ValueError(f"{p.path}: a record part of {p.extent()} bytes is more than one direct read "
                                         f"holds ({MAX_PART_BYTES} bytes: the I/O buffers' {ES_IO_SPAN_MAX} less a "
                                         f"page of alignment); read this table mapped (tables='mapped') instead")
                    if p.path not in self._fds:
                        fd, d = _open(p.path, direct)
                        self._fds[p.path] = (fd, d)
                        st = os.fstat(fd)
                        if not stat.S_ISREG(st.st_mode):
                            raise ValueError(f"{p.path}: not a regular file")
                        self._stamps[p.path] = _stamp(st)
                    fd, d = self._fds[p.path]
                    size = self._stamps[p.path][2]
                    if p.end(nrows) > size:
                        raise ValueError(f"{p.path}: {nrows} rows of {p.nbytes} bytes from offset {p.offset} need "
                                         f"{p.end(nrows)} bytes, the file has {size}")
                    self.parts[i].fd = fd
                    self.parts[i].mem = NULL
                    self.parts[i].base, self.parts[i].bytes = p.offset, p.nbytes
                    self.parts[i].per_group, self.parts[i].group_bytes = p.per_group, p.group_bytes
                    self.parts[i].sums = -1 if p.sums is None else p.sums
                    self.parts[i].seed = p.seed
                    paths.append(p.path)
                    direct_in.append(d)
                else:
                    raise TypeError(f"record parts are FilePart or MemPart, got {type(p).__name__}")
                self.parts[i].dst_off = off
                off += self.parts[i].bytes
        except BaseException:
            self._close()
            raise
        self.recbytes = off
        self.rowbytes = self.parts[0].bytes if rowbytes is None else rowbytes
        if not 0 < self.rowbytes <= self.recbytes:
            self._close()
            raise ValueError(f"rowbytes {self.rowbytes} must be in (0, {self.recbytes}]")
        self.scalebytes = self.recbytes - self.rowbytes
        self.paths, self.direct = tuple(paths), tuple(direct_in)
        self._restamp(False)

    def _restamp(self, bint now=True):
        """Take the open files' stamps (now=True: as they are now; tests use it after pointing
        a descriptor at a failing device, which check() would otherwise call another file)."""
        cdef int i
        self.nfds = 0
        for path, (fd, _) in self._fds.items():
            if now:
                self._stamps[path] = _stamp(os.fstat(fd))
            self.fdv[self.nfds] = fd
            for i in range(6):
                self.stampv[self.nfds][i] = self._stamps[path][i]
            self.nfds += 1

    cdef int check_fast(self) except -1:
        """check() at the cost of one fstat a file (before every batch of reads)."""
        cdef struct_stat st
        cdef int i
        for i in range(self.nfds):
            if fstat(self.fdv[i], &st) != 0 or es_stamp_changed(self.stampv[i], &st):
                self.check()  # raises, with the message
        return 0

    def _close(self):
        # close(2) itself, not os.close: __dealloc__ may run at interpreter exit, after the
        # os module's globals are cleared
        for fd, _ in (self._fds or {}).values():
            close(fd)
        self._fds = {}

    def __dealloc__(self):
        if self._fds:
            self._close()

    def check(self):
        """Raise FileChangedError when a file was truncated or replaced in place since it was opened."""
        for path, (fd, _) in self._fds.items():
            now = _stamp(os.fstat(fd))
            was = self._stamps[path]
            if stamp_changed(was, now):
                what = ("truncated" if now[2] < was[2] else "rewritten in place" if now[2:4] != was[2:4] else
                        "changed in place (its ctime moved: written with its mtime put back, or its inode's "
                        "metadata changed)")
                raise FileChangedError(f"{path}: {what} after it was opened for row reads (size {was[2]} -> "
                                       f"{now[2]} bytes): its rows can no longer be read safely. Do not modify a "
                                       f"checkpoint in place: write a new one and load it again")

    def fileno(self, path):
        """The descriptor this reads `path` with."""
        return self._fds[os.fspath(path)][0]

    def describe(self):
        return [dict(path=p, direct=d, offset=self.parts[i].base, nbytes=self.parts[i].bytes,
                     per_group=self.parts[i].per_group, group_bytes=self.parts[i].group_bytes)
                for i, (p, d) in enumerate(zip(self.paths, self.direct))]

    def __repr__(self):
        return f"RecordFile({self.nrows} rows x {self.recbytes} bytes, {self.describe()})"


cdef class DirectReader:
    """One caller's reads of a RecordFile through an IOPool (per engine: not for two threads at
    once; several readers share a file and a pool). cdef: submit(rows) starts a batch (returns
    at once), wait() finishes it (raises on a failed read), record(row) points at a read record
    until the next submit. read(rows) does all three for Python callers."""

    def __cinit__(self, RecordFile file, IOPool io, stride=None, totals=None):
        self.file, self.io = file, io
        if totals is not None and not (isinstance(totals, np.ndarray) and totals.dtype == np.int64
                                       and totals.shape == (TOTALS,)):
            raise ValueError(f"totals must be an int64[{TOTALS}] array (new_totals())")
        self.totals = totals
        self.stride = file.recbytes if stride is None else int(stride)
        if self.stride < file.recbytes:
            raise ValueError(f"stride {self.stride} < record bytes {file.recbytes}")
        cdef void *p = NULL
        if posix_memalign(&p, ES_IO_PAGE, ES_IO_SPAN_MAX) != 0:
            raise MemoryError()
        self.buf = <char *> p
        self.hist = np.zeros(WAIT_BUCKETS, np.int64)

    def __dealloc__(self):
        if self.pending:
            with nogil:
                es_io_wait(&self.io.pool, &self.job, self.buf)
        free(self.u)
        free(self.spans)
        free(self.stage)
        free(self.buf)

    cdef int _grow(self, int64_t n) except -1:
        if n <= self.cap:
            return 0
        cdef int64_t cap = max(n, 2 * self.cap, 64)
        cdef int64_t *u = <int64_t *> malloc(cap * sizeof(int64_t))
        cdef es_io_span *spans = <es_io_span *> malloc(cap * self.file.nparts * sizeof(es_io_span))
        cdef char *stage = <char *> malloc(cap * self.stride)
        if u == NULL or spans == NULL or stage == NULL:
            free(u)
            free(spans)
            free(stage)
            raise MemoryError(f"DirectReader: no memory for {cap} rows")
        free(self.u)
        free(self.spans)
        free(self.stage)
        self.u, self.spans, self.stage, self.cap = u, spans, stage, cap
        return 0

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        """Start reading rows[n] (absolute; any order, repeats allowed): the distinct ones are
        planned and queued, the pool's threads start on them, this returns. Refused (nothing
        started) when a row is out of range or a batch is still pending."""
        if self.pending:
            raise RuntimeError("DirectReader.submit: the previous batch was not waited for")
        cdef int64_t i, bad = -1, N = self.file.nrows, ns
        with nogil:
            for i in range(n):
                if rows[i] < 0 or rows[i] >= N:
                    bad = i
                    break
        if bad >= 0:
            raise IndexError(f"row {rows[bad]} out of range for a table of {N} rows")
        self.file.check_fast()  # a file rewritten in place since it was opened: FileChangedError
        self._grow(n)
        with nogil:
            self.m = es_io_unique(rows, n, self.u)
            ns = es_io_plan(self.file.parts, self.file.nparts, self.u, self.m, self.spans)
            es_io_copy_mem(self.file.parts, self.file.nparts, self.u, self.m, self.stage, self.stride)
            es_io_submit(&self.io.pool, &self.job, self.file.parts, self.u, self.spans, ns, self.stage,
                         self.stride, self.io.qd)
        self.pending = True
        return 0

    cdef int wait(self) except -1:
        """Finish the submitted batch: raises OSError / FileChangedError when a read failed (its
        records are then not served)."""
        if not self.pending:
            return 0
        cdef int e
        cdef double t0, dt
        with nogil:
            t0 = es_io_now()
            e = es_io_wait(&self.io.pool, &self.job, self.buf)
            dt = es_io_now() - t0
        self.pending = False
        self.calls += 1
        self.reads += self.job.nspans
        self.bytes_read += self.job.bytes
        self.wait_seconds += dt
        cdef int b = _bucket(dt)
        self.hist[b] += 1
        if self.totals is not None:
            t = self.totals
            t[0] += self.job.nspans
            t[1] += self.job.bytes
            t[2] += self.m if e == 0 else 0
            t[3 + b] += 1
        if e == 0:
            self.rows_read += self.m
            return 0
        cdef es_io_span s = self.spans[self.job.err_span]
        self.m = 0  # nothing of this batch is served
        path = self.file.paths[s.part]
        if e == ES_IO_BADSUM:
            raise checksum_error(path, self.file.layer, self.job.err_row)
        if e == ES_IO_SHORT:
            self.file.check()  # a file truncated under us explains a short read best
            raise OSError(_errno.EIO, f"{path}: short read at offset {s.off}: {self.job.err_got} of {s.need} bytes "
                                      f"(the file ends before the rows it should hold)")
        raise OSError(e, f"{path}: reading {s.len} bytes at offset {s.off}: {os.strerror(e)}")

    cdef const char *record(self, int64_t row) noexcept nogil:
        cdef int64_t k = es_io_find(self.u, self.m, row)
        return NULL if k < 0 else self.stage + k * self.stride

    def read(self, rows):
        """The records of `rows` (any shape, absolute rows), uint8 [rows.size, recbytes], read now."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        cdef int64_t n = r.shape[0], i, rb = self.file.recbytes
        cdef const int64_t *pr = <const int64_t *> cnp.PyArray_DATA(r)
        self.submit(pr, n)
        self.wait()
        out = np.empty((n, rb), dtype=np.uint8)
        cdef char *po = <char *> cnp.PyArray_DATA(out)
        with nogil:
            for i in range(n):
                memcpy(po + i * rb, self.record(pr[i]), rb)
        return out

    def stats(self):
        """reads (preads), bytes_read, rows_read (distinct rows), calls, wait_seconds, wait_hist."""
        return {"reads": self.reads, "bytes_read": self.bytes_read, "rows_read": self.rows_read,
                "calls": self.calls, "wait_seconds": self.wait_seconds, "wait_hist": self.hist.copy()}


def checksum_error(path, layer, row):
    """The RowChecksumError of a record whose bytes fail their checksum."""
    return RowChecksumError(f"{path}: layer {layer} row {row}: the record read does not match its checksum (the "
                            f"file's bytes are not the ones packed: changed on disk, or damaged); nothing of this "
                            f"read was served. Write the row file again: `engram-stream pack-rows --force` on the "
                            f"checkpoint (or delete {os.path.basename(path)} to read the checkpoint's own files)")


TOTALS = 3 + WAIT_BUCKETS   # a totals array: reads, bytes_read, rows_read, then the wait histogram


cdef inline int _bucket(double dt) noexcept:
    """The wait histogram's bucket of dt seconds: 8 an octave from 1 us."""
    cdef int b = 0 if dt <= 1e-6 else <int> (8 * log2(dt * 1e6))
    return min(b, WAIT_BUCKETS - 1)


def add_read(totals, int64_t reads, int64_t nbytes, int64_t rows, double wait_seconds):
    """Count one finished batch of a reader that is not a DirectReader (a remote store's) in a
    totals array: its reads, bytes, distinct rows and the time its caller waited."""
    totals[0] += reads
    totals[1] += nbytes
    totals[2] += rows
    totals[3 + _bucket(wait_seconds)] += 1


def new_totals():
    """Counters several DirectReaders add to (a model's readers of one layer): int64[TOTALS]."""
    return np.zeros(TOTALS, np.int64)


def totals_summary(totals):
    """{reads, bytes_read, rows_read, read_wait_p50, read_wait_p99} of a totals array."""
    t = np.asarray(totals)
    return {"reads": int(t[0]), "bytes_read": int(t[1]), "rows_read": int(t[2]),
            "read_wait_p50": wait_percentile(t[3:], 0.5), "read_wait_p99": wait_percentile(t[3:], 0.99)}


def wait_percentile(hist, q):
    """The q-quantile (0..1) of the waits a histogram of DirectReader.stats() counts, in seconds
    (the bucket's geometric middle: within 5%); 0.0 when it counts none."""
    h = np.asarray(hist, np.int64)
    total = int(h.sum())
    if total == 0:
        return 0.0
    k = int(np.searchsorted(np.cumsum(h), max(1, int(np.ceil(q * total)))))
    return 1e-6 * 2.0 ** ((k + 0.5) / 8)
