# cython: language_level=3
"""Row sources (the seam between engines and the places rows live; _source.pxd has the contract).

    MappedRows    the table in memory or mapped from the checkpoint: pointers into it, nothing to fail
    DirectRows    rows read from the checkpoint's files (rows/_direct.pyx): pread, O_DIRECT, an I/O pool
    RecordSource  records fetched in one batch a call by Python code: subclass it with start(rows)
                  and finish() (rows.mooncake.tier.RemoteRows; a toy source in a test file)
    CachedRows    the model's RAM row cache of a layer (shared by its engines) in front of any of them

An engine hashes a call's tokens, hands the rows to submit() (a remote or disk source starts
reading there: Decoder.begin starts every layer's reads before any layer runs), then per chunk
asks resolve() for each row's data and scale pointers, gathers without the GIL, and release()s
them. Which places a model reads is its Tables' choice (rows/tier.py; tables=), not the engines'.
"""
import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t
from libc.errno cimport EIO, ENOMEM, ENOSYS
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memcpy, memset
from posix.stat cimport fstat, struct_stat

from engram_stream.rows._cache cimport RowCache, es_rc_hit, es_rc_insert, es_rc_lock, es_rc_peek, es_rc_unlock, es_rowcache
from engram_stream.rows._direct cimport (ES_IO_BADSUM, ES_IO_PAGE, ES_IO_SHORT, ES_IO_SPAN_MAX, DirectReader,
                                         RecordFile, es_io_copy_mem, es_io_find, es_io_plan, es_io_span, es_io_submit,
                                         es_io_unique, es_io_wait, es_stamp_changed)
from engram_stream.rows._direct import checksum_error
from engram_stream.errors import FileChangedError
from engram_stream.io.files import mapping_of
from engram_stream._hash cimport es_runtime_bind, es_runtime_of_process

cnp.import_array()

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

READ_WINDOW = 1 << 16  # rows read_into hands one submit() (as the engines' SUBMIT_ROWS)

cdef extern from "engram_step.h" nogil:
    void es_prefetch_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n) noexcept
    int64_t es_advise_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n,
                           int advice) noexcept
    int MADV_WILLNEED


cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)


cdef int _regrow_nogil(void **p, size_t nbytes) noexcept nogil:
    """realloc of *p to nbytes without the GIL: 0, or -1 (*p as it was)."""
    cdef void *a = realloc(p[0], nbytes if nbytes else 1)
    if a == NULL:
        return -1
    p[0] = a
    return 0


cdef int _grow_scratch(int64_t n, int64_t *cap, void **a, size_t abytes, void **b, size_t bbytes, void **c,
                       size_t cbytes) noexcept nogil:
    """read_nogil()'s three scratch arrays (a, b, c: abytes, bbytes, cbytes a row) grown to hold
    n rows (cap: the rows they hold): 0, or -1 (no memory)."""
    cdef int64_t want = max(n, 2 * cap[0], 64)
    if n <= cap[0]:
        return 0
    if _regrow_nogil(a, want * abytes) or _regrow_nogil(b, want * bbytes) or _regrow_nogil(c, want * cbytes):
        return -1
    cap[0] = want
    return 0


cdef inline int _fail(es_read_error *e, int code, int64_t row, int err) noexcept nogil:
    e.code, e.row, e.err = code, row, err
    return -1


cdef void *_regrow(void *p, size_t nbytes) except NULL:
    cdef void *a = realloc(p, nbytes if nbytes else 1)
    if a == NULL:
        raise MemoryError(f"row source scratch of {nbytes} bytes")
    return a


cdef class RowSource:
    """Where an engine's rows come from (see _source.pxd). Subclasses implement the four calls."""

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        raise NotImplementedError(f"{type(self).__name__}.resolve")

    cdef void release(self) noexcept:
        pass

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        return 0

    cdef int read_nogil(self, const int64_t *rows, int64_t n, char *out, es_read_error *e) noexcept nogil:
        return _fail(e, ES_READ_NO_C, rows[0] if n else 0, ENOSYS)

    cdef int reserve(self, int64_t n) except -1:
        if self._grow_nogil(n) != 0:
            raise MemoryError(f"{type(self).__name__}: read scratch for {n} rows")
        return 0

    cdef int _grow_nogil(self, int64_t n) noexcept nogil:
        return 0

    def read_error(self, code, row, err, more=""):
        """The exception of a read_nogil() failure (code ES_READ_*, the row, errno; `more`:
        what the caller adds to the message)."""
        if code == ES_READ_FILE_CHANGED:
            return FileChangedError(f"{type(self).__name__}: a table file was truncated or rewritten in place "
                                    f"after it was opened{more}")
        if code == ES_READ_NO_C:
            return TypeError(f"{type(self).__name__} has no C reader: its reads need the GIL{more}")
        return OSError(err, f"{type(self).__name__}: reading rows (first row {row}): {os.strerror(err)}{more}")

    def mapped_arrays(self):
        """The arrays this source points engines into (a view of a mapped file among them is
        stamped by the engine: engine/_base.pyx's FileStamps); () for a source that reads files
        itself (DirectRows checks its own stamps) or a store."""
        return ()

    def __repr__(self):
        return (f"{type(self).__name__}(rows={self.nrows}, record={self.rowbytes}+{self.scalebytes} bytes, "
                f"fallible={bool(self.fallible)})")

    @property
    def reading(self):
        """True between a submit() whose rows are still being read and the resolve() that waits
        for them (Decoder.begin leaves every layer's source reading)."""
        return False

    def read(self, rows):
        """uint8[len(rows), rowbytes + scalebytes]: the records of `rows` as an engine reads them
        (tests, tools)."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        if r.size and (r.min() < 0 or r.max() >= self.nrows):
            raise IndexError(f"rows out of range for a table of {self.nrows} rows")
        out = np.empty((r.shape[0], self.rowbytes + self.scalebytes), dtype=np.uint8)
        self.read_into(r, out)
        return out

    def read_into(self, rows, out):
        """Fill `out` with the records of `rows` (a serving caller's bulk read: vLLM's lookup).

        rows: integers, [n] or [T, k]; a negative row gives a record of zeros (the caller's "no
        row": vLLM's -1 and ids outside its shard). out: writeable uint8 of shape rows.shape +
        (rowbytes + scalebytes,) whose last axis is contiguous; its other axes may have any
        strides (a slice of a larger staging buffer). The rows go through submit/resolve in
        windows of READ_WINDOW (a source's scratch stays bounded); nothing is made per row."""
        cdef int64_t rec = self.rowbytes + self.scalebytes
        a = np.asarray(rows)
        if a.dtype.kind not in "iu" or a.ndim not in (1, 2):
            raise TypeError(f"read_into: rows must be integers of 1 or 2 dimensions, got {a.dtype} {a.shape}")
        if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or not out.flags.writeable
                or out.shape != a.shape + (rec,) or (rec > 1 and out.size and out.strides[a.ndim] != 1)):
            raise ValueError(f"read_into: out must be a writeable uint8 array of shape {a.shape + (rec,)} with "
                             f"its last axis contiguous, got {getattr(out, 'dtype', type(out))} "
                             f"{getattr(out, 'shape', '')}")
        r = np.ascontiguousarray(a, dtype=np.int64)
        if r.size and r.max() >= self.nrows:
            raise IndexError(f"read_into: row {int(r.max())} is out of range for a table of {self.nrows} rows "
                             f"(ids are rows of this layer's table; a negative id reads zeros)")
        cdef int64_t n = r.size, k = a.shape[1] if a.ndim == 2 else 1, i, m = 0, w0, nb
        cdef int64_t s0 = out.strides[0], s1 = out.strides[1] if a.ndim == 2 else 0
        if n == 0:
            return
        vr = np.empty(n, dtype=np.int64)
        dd = np.empty(n, dtype=np.uintp)
        cdef int64_t W = min(n, READ_WINDOW)
        dp = np.empty(W, dtype=np.uintp)
        sp = np.empty(W, dtype=np.uintp)
        cdef const int64_t *pr = <const int64_t *> cnp.PyArray_DATA(r)
        cdef int64_t *pv = <int64_t *> cnp.PyArray_DATA(vr)
        cdef char **pd = <char **> cnp.PyArray_DATA(dd)
        cdef char *base = <char *> cnp.PyArray_DATA(out)
        cdef char *d
        with nogil:
            for i in range(n):
                d = base + (i // k) * s0 + (i % k) * s1
                if pr[i] < 0:
                    memset(d, 0, rec)
                else:
                    pv[m] = pr[i]
                    pd[m] = d
                    m += 1
        w0 = 0
        while w0 < m:
            nb = min(W, m - w0)
            self._copy_rows(pv + w0, nb, pd + w0, <const char **> cnp.PyArray_DATA(dp),
                            <const char **> cnp.PyArray_DATA(sp))
            w0 += nb

    cdef int _copy_rows(self, const int64_t *rows, int64_t n, char **dst, const char **dp,
                        const char **sp) except -1:
        cdef int64_t i, rb = self.rowbytes, sb = self.scalebytes
        self.submit(rows, n)
        self.resolve(rows, n, dp, sp)
        try:
            with nogil:
                for i in range(n):
                    memcpy(dst[i], dp[i], rb)
                    if sb:
                        memcpy(dst[i] + rb, sp[i], sb)
        finally:
            self.release()
        return 0



cdef class MappedRows(RowSource):
    """`data`: the table as any C-contiguous array of `nrows` rows; `scale`: its per-row scales
    (None: none). Both are borrowed read-only (a RAM array or a view of a mapped file: then, and
    only then, prefetch() asks the kernel to page rows in). record_format: what a record's bytes
    are (rows.records.record_format of the layer); None: the arrays' dtypes ("uint8+uint8")."""

    def __cinit__(self, data, scale=None, record_format=None):
        if not (isinstance(data, np.ndarray) and data.flags.c_contiguous and data.ndim >= 1):
            raise ValueError("MappedRows: the table must be a C-contiguous array")
        self.nrows = data.shape[0]
        self.rowbytes = data.nbytes // max(self.nrows, 1)
        self.data = <const char *> cnp.PyArray_DATA(data)
        self.scale = NULL
        self.scalebytes = 0
        if scale is not None:
            if not (isinstance(scale, np.ndarray) and scale.flags.c_contiguous and scale.shape[0] == self.nrows):
                raise ValueError(f"MappedRows: scales must be a C-contiguous array of {self.nrows} rows")
            self.scalebytes = scale.nbytes // max(self.nrows, 1)
            self.scale = <const char *> cnp.PyArray_DATA(scale)
        self.fallible = False
        self.record_format = (record_format if record_format is not None else
                              data.dtype.name + ("" if scale is None else "+" + scale.dtype.name))
        self.paged = mapping_of(data) is not None
        self._keep = (data, scale)
        self.nogil_reads = True

    def mapped_arrays(self):
        return tuple(a for a in self._keep if a is not None)

    cdef int read_nogil(self, const int64_t *rows, int64_t n, char *out, es_read_error *e) noexcept nogil:
        cdef int64_t i, rb = self.rowbytes, sb = self.scalebytes, rec = self.rowbytes + self.scalebytes
        cdef char *d
        for i in range(n):
            d = out + i * rec
            if rows[i] < 0:
                memset(d, 0, rec)
                continue
            memcpy(d, self.data + rows[i] * rb, rb)
            if sb:
                memcpy(d + rb, self.scale + rows[i] * sb, sb)
        return 0

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        with nogil:  # in-RAM or cached pages: toward the CPU cache before the gather
            es_prefetch_rows(self.data, self.rowbytes, rows, n)
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i
        with nogil:
            for i in range(n):
                dp[i] = self.data + rows[i] * self.rowbytes
                sp[i] = self.scale + rows[i] * self.scalebytes if self.scale != NULL else NULL
        return 0

    cdef int _copy_rows(self, const int64_t *rows, int64_t n, char **dst, const char **dp,
                        const char **sp) except -1:
        cdef int64_t i, rb = self.rowbytes, sb = self.scalebytes
        with nogil:  # straight from the table: no pointers to resolve
            es_prefetch_rows(self.data, rb, rows, n)
            for i in range(n):
                memcpy(dst[i], self.data + rows[i] * rb, rb)
                if sb:
                    memcpy(dst[i] + rb, self.scale + rows[i] * sb, sb)
        return 0

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        cdef int64_t failed
        if not self.paged:
            return 0  # RAM: nothing to page in
        with nogil:
            failed = es_advise_rows(self.data, self.rowbytes, rows, n, MADV_WILLNEED)
            if self.scale != NULL:  # scales live on other pages
                failed += es_advise_rows(self.scale, self.scalebytes, rows, n, MADV_WILLNEED)
        return failed


cdef class PartedRows(RowSource):
    """A table kept as consecutive parts (a GGUF's per-head or per-embedder tensors, each at its
    own offset): part k, a C-contiguous array of rows of `rowbytes` bytes each, holds the rows
    from the sum of the earlier parts' rows on. Pointers straight into the parts (RAM or views
    of a mapped file: then prefetch() asks the kernel for the rows' pages); no scales. nrows: the
    table's rows when the parts hold fewer (a padded table): the rows past them read as zero
    bytes (a converter drops the padding no hash addresses)."""

    def __cinit__(self, parts, record_format=None, nrows=None):
        parts = list(parts)
        if not parts or not all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.ndim >= 1
                                and a.shape[0] > 0 for a in parts):
            raise ValueError("PartedRows: parts must be C-contiguous arrays of at least one row each")
        rb = {a.nbytes // a.shape[0] for a in parts}
        if len(rb) != 1:
            raise ValueError(f"PartedRows: the parts' rows must be one size, got {sorted(rb)} bytes")
        self.nparts = len(parts)
        self.bases = <const char **> realloc(NULL, self.nparts * sizeof(char *))
        self.starts = <int64_t *> realloc(NULL, (self.nparts + 1) * sizeof(int64_t))
        if self.bases == NULL or self.starts == NULL:
            raise MemoryError("PartedRows: no memory for its part table")
        cdef int64_t k, at = 0
        for k in range(self.nparts):
            self.bases[k] = <const char *> cnp.PyArray_DATA(parts[k])
            self.starts[k] = at
            at += parts[k].shape[0]
        self.starts[self.nparts] = at
        if nrows is not None and nrows < at:
            raise ValueError(f"PartedRows: nrows {nrows} < the parts' {at} rows")
        self.nrows, self.rowbytes, self.scalebytes = (at if nrows is None else nrows), rb.pop(), 0
        self.zero = <const char *> calloc(1, self.rowbytes)
        if self.zero == NULL:
            raise MemoryError("PartedRows: no memory for its zero row")
        self.fallible = False
        self.nogil_reads = True
        self.record_format = record_format if record_format is not None else parts[0].dtype.name
        self.paged = mapping_of(parts[0]) is not None
        self._keep = parts

    def mapped_arrays(self):
        return tuple(self._keep)

    def __dealloc__(self):
        free(self.bases)
        free(self.starts)
        free(<void *> self.zero)

    cdef int read_nogil(self, const int64_t *rows, int64_t n, char *out, es_read_error *e) noexcept nogil:
        cdef int64_t i
        for i in range(n):
            if rows[i] < 0:
                memset(out + i * self.rowbytes, 0, self.rowbytes)
            else:
                memcpy(out + i * self.rowbytes, self._row(rows[i]), self.rowbytes)
        return 0

    cdef const char *_row(self, int64_t r) noexcept nogil:
        cdef int64_t lo = 0, hi = self.nparts - 1, mid
        if r >= self.starts[self.nparts]:
            return self.zero
        while lo < hi:   # the last part whose first row is <= r
            mid = (lo + hi + 1) >> 1
            if self.starts[mid] <= r:
                lo = mid
            else:
                hi = mid - 1
        return self.bases[lo] + (r - self.starts[lo]) * self.rowbytes

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i
        with nogil:
            for i in range(n):
                dp[i] = self._row(rows[i])
                sp[i] = NULL
        return 0

    cdef int _copy_rows(self, const int64_t *rows, int64_t n, char **dst, const char **dp,
                        const char **sp) except -1:
        cdef int64_t i
        with nogil:
            for i in range(n):
                memcpy(dst[i], self._row(rows[i]), self.rowbytes)
        return 0

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        cdef int64_t failed = 0, i, zero = 0
        if not self.paged:
            return 0
        with nogil:
            for i in range(n):
                if rows[i] < self.starts[self.nparts]:
                    failed += es_advise_rows(self._row(rows[i]), self.rowbytes, &zero, 1, MADV_WILLNEED)
        return failed


cdef class DirectRows(RowSource):
    """A table's rows read from its files (tables="direct"): submit() starts reading the call's
    distinct rows (de-duplicated by page, O_DIRECT, the I/O pool), resolve() waits for them and
    points into the reader's records (valid until the next submit). record_format: what a
    record's bytes are (rows.records.record_format of the layer; None: unknown)."""

    def __cinit__(self, DirectReader reader, record_format=None):
        cdef RecordFile f = reader.file
        self.reader, self.record_format = reader, record_format
        self.nrows, self.rowbytes = f.nrows, f.rowbytes
        self.scalebytes = f.scalebytes
        self.fallible = True
        self.parts, self.nparts, self.pool, self.qd = f.parts, f.nparts, &reader.io.pool, reader.io.qd
        self.nfds, self.fdv, self.stampv = f.nfds, f.fdv, &f.stampv[0][0]
        self.nogil_reads = True

    @property
    def reading(self):
        return bool(self.pending)

    def __dealloc__(self):
        if self.pending:
            try:
                self.reader.wait()
            except BaseException:
                pass
        free(self.gu)
        free(self.gspans)
        free(self.gstage)
        free(self.gbuf)

    cdef int _grow_nogil(self, int64_t n) noexcept nogil:
        cdef void *p = NULL
        if self.gbuf == NULL:
            if posix_memalign(&p, ES_IO_PAGE, ES_IO_SPAN_MAX) != 0:
                return -1
            self.gbuf = <char *> p
        return _grow_scratch(n, &self.gcap, <void **> &self.gu, sizeof(int64_t), <void **> &self.gspans,
                             self.nparts * sizeof(es_io_span), <void **> &self.gstage, self.rowbytes + self.scalebytes)

    cdef int read_nogil(self, const int64_t *rows, int64_t n, char *out, es_read_error *e) noexcept nogil:
        cdef int64_t i, k, m = 0, nu = 0, ns, rec = self.rowbytes + self.scalebytes, first = -1
        cdef int rc
        cdef struct_stat st
        if self._grow_nogil(n) != 0:
            return _fail(e, ES_READ_IO, rows[0] if n else 0, ENOMEM)
        for i in range(n):
            if rows[i] >= 0:
                self.gu[m] = rows[i]
                m += 1
        if m:
            first = self.gu[0]
            for i in range(self.nfds):   # RecordFile.check_fast, without the GIL
                if fstat(self.fdv[i], &st) != 0 or es_stamp_changed(self.stampv + 6 * i, &st):
                    return _fail(e, ES_READ_FILE_CHANGED, first, 0)
            nu = es_io_unique(self.gu, m, self.gu)
            ns = es_io_plan(self.parts, self.nparts, self.gu, nu, self.gspans)
            es_io_copy_mem(self.parts, self.nparts, self.gu, nu, self.gstage, rec)
            es_io_submit(self.pool, &self.gjob, self.parts, self.gu, self.gspans, ns, self.gstage, rec, self.qd)
            rc = es_io_wait(self.pool, &self.gjob, self.gbuf)
            if rc == ES_IO_BADSUM:
                return _fail(e, ES_READ_BAD_SUM, self.gjob.err_row, 0)
            if rc != 0:
                return _fail(e, ES_READ_IO, first, EIO if rc == ES_IO_SHORT else rc)
        for i in range(n):
            if rows[i] < 0:
                memset(out + i * rec, 0, rec)
            else:
                k = es_io_find(self.gu, nu, rows[i])
                memcpy(out + i * rec, self.gstage + k * rec, rec)
        return 0

    def read_error(self, code, row, err, more=""):
        """As RowSource's; a failed checksum names the packed row file, the layer and the row."""
        if code == ES_READ_BAD_SUM:
            return checksum_error(self.reader.file.paths[0], self.reader.file.layer, row)
        return RowSource.read_error(self, code, row, err, more)

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        if self.pending:  # an aborted call's reads: wait, keep nothing
            self.pending = False
            try:
                self.reader.wait()
            except BaseException:
                pass
        self.sub_rows, self.sub_n = NULL, 0
        self.reader.submit(rows, n)
        self.pending = True
        self.sub_rows, self.sub_n = rows, n
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i, off = rows - self.sub_rows, rb = self.rowbytes, sb = self.scalebytes
        cdef const char *p
        if self.sub_rows == NULL or off < 0 or off + n > self.sub_n:
            raise RuntimeError("DirectRows.resolve: these rows were not submitted")
        if self.pending:
            self.pending = False
            try:
                self.reader.wait()
            except BaseException:
                self.sub_rows, self.sub_n = NULL, 0
                raise
        with nogil:
            for i in range(n):
                p = self.reader.record(rows[i])
                dp[i] = p
                sp[i] = p + rb if sb else NULL
        return 0


cdef class RecordSource(RowSource):
    """Rows whose records come in one batch a call from Python code. Subclass it and define

        start(rows)   rows: int64[n], sorted, distinct, all in range: begin fetching their
                      records and return (the engine goes on meanwhile); raise to refuse
        finish()      wait for them: uint8 [>= n, >= rowbytes + scalebytes] (rows may be
                      strided), record k of rows[k] at [k]; raise (TierError, OSError) on
                      anything short: nothing is used

    and call RecordSource.__init__(self, nrows, rowbytes, scalebytes, record_format) first. One fetch is in
    flight per source (a start() whose finish() was never asked - an aborted call - is finished
    and dropped before the next). The array finish() returns is read until the next start()."""

    def __init__(self, nrows, rowbytes, scalebytes=0, record_format=None):
        if not (nrows >= 0 and rowbytes > 0 and scalebytes >= 0):
            raise ValueError(f"RecordSource: nrows {nrows!r}, rowbytes {rowbytes!r}, scalebytes {scalebytes!r}: "
                             f"need nrows >= 0, rowbytes > 0, scalebytes >= 0")
        self.nrows, self.rowbytes, self.scalebytes = nrows, rowbytes, scalebytes
        self.record_format = record_format
        self.fallible = True

    def __dealloc__(self):
        free(self.uniq)

    @property
    def reading(self):
        return bool(self.pending)

    def start(self, rows):
        raise NotImplementedError(f"{type(self).__name__}.start(rows)")

    def finish(self):
        raise NotImplementedError(f"{type(self).__name__}.finish()")

    cdef void _drop(self) noexcept:
        if self.pending:
            self.pending = False
            try:
                self.finish()
            except BaseException:
                pass
        self.ready = False
        self._stage = None

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        cdef void *a
        self._drop()
        self.nu = 0
        if n > self.cap:
            a = realloc(self.uniq, n * sizeof(int64_t))
            if a == NULL:
                raise MemoryError(f"{type(self).__name__}: scratch of {n} rows")
            self.uniq, self.cap = <int64_t *> a, n
        with nogil:
            memcpy(self.uniq, rows, n * sizeof(int64_t))
            self.nu = es_io_unique(self.uniq, n, self.uniq)
        if self.nu:
            self.start(np.asarray(<int64_t[:self.nu]> self.uniq).copy())
            self.pending = True
        else:
            self.ready = True
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i, k, rb = self.rowbytes, sb = self.scalebytes, rec = self.rowbytes + self.scalebytes
        cdef const char *p
        cdef bint bad = False
        if self.pending:
            self.pending = False
            st = self.finish()
            if (not isinstance(st, np.ndarray) or st.dtype != np.uint8 or st.ndim != 2
                    or st.shape[0] < self.nu or st.shape[1] < rec or st.strides[1] != 1):
                raise ValueError(f"{type(self).__name__}.finish() must return uint8 [>= {self.nu}, >= {rec}] "
                                 f"with contiguous records, got {getattr(st, 'dtype', type(st))} "
                                 f"{getattr(st, 'shape', '')}")
            self._stage = st
            self.stage, self.sstride = <const char *> cnp.PyArray_DATA(st), st.strides[0]
            self.ready = True
        if not self.ready:
            raise RuntimeError(f"{type(self).__name__}.resolve: no rows were submitted")
        with nogil:
            for i in range(n):
                k = es_io_find(self.uniq, self.nu, rows[i])
                if k < 0 or k >= self.nu or self.uniq[k] != rows[i]:
                    bad = True
                    break
                p = self.stage + k * self.sstride
                dp[i] = p
                sp[i] = p + rb if sb else NULL
        if bad:
            raise RuntimeError(f"{type(self).__name__}.resolve: these rows were not submitted")
        return 0


cdef class CachedRows(RowSource):
    """A layer's RowCache in front of `source`, any other RowSource. The cache is the model's,
    shared by every engine of the layer (and so by every stream); this object is one engine's
    reader of it (one owner). submit() plans the call's rows against the cache and hands the
    distinct misses to the source's own submit() (a disk or remote source starts reading them:
    Decoder.begin starts every layer's reads); the first resolve() resolves them from the source
    and copies them into the cache.

    Sharing: every change to the cache happens under its lock; a slot some reader still reads is
    pinned by count (refs, one pin per submitted position), so no engine's fills evict another's
    rows. release() drops the pins of the positions resolved since the last release() (an engine
    releases chunk by chunk: the rest of its window stays pinned); a release() with nothing
    resolved, and the next submit(), drop every pin left. When every slot is pinned a row is read
    where the source put it."""

    def __cinit__(self, RowCache cache, RowSource source):
        if source is None or isinstance(source, CachedRows):
            raise TypeError(f"CachedRows: source must be a RowSource that is not itself cached, got {source!r}")
        if source.rowbytes + source.scalebytes != cache.recbytes:
            raise ValueError(f"CachedRows: the cache holds {cache.recbytes}-byte records, rows are "
                             f"{source.rowbytes}+{source.scalebytes} bytes")
        self.cache, self.source = cache, source
        self.nrows, self.rowbytes, self.scalebytes = source.nrows, source.rowbytes, source.scalebytes
        self.record_format = source.record_format
        self.fallible = source.fallible
        self.nogil_reads = source.nogil_reads

    def mapped_arrays(self):
        return self.source.mapped_arrays()

    def __dealloc__(self):
        self._unpin()
        free(self.srcd)
        free(self.srcs)
        free(self.udp)
        free(self.usp)
        free(self.pin_of)
        free(self.mpos)
        free(self.uniq)
        free(self.slot_of)
        free(self.gmiss)
        free(self.gu)
        free(self.gstage)

    cdef int _grow_nogil(self, int64_t n) noexcept nogil:
        return _grow_scratch(n, &self.gcap, <void **> &self.gmiss, sizeof(int64_t), <void **> &self.gu,
                             sizeof(int64_t), <void **> &self.gstage, self.rowbytes + self.scalebytes)

    cdef int reserve(self, int64_t n) except -1:
        RowSource.reserve(self, n)
        self.source.reserve(n)
        return 0

    cdef int read_nogil(self, const int64_t *rows, int64_t n, char *out, es_read_error *e) noexcept nogil:
        """As the engines' path: hits copied under the cache's lock; the distinct misses read by
        the source's read_nogil(), then admitted (a miss is a row read, its repeats in the call
        hits). A failed read admits nothing."""
        cdef int64_t i, j, k, s, m = 0, nu, rec = self.rowbytes + self.scalebytes
        cdef es_rowcache *rc = &self.cache.c
        cdef char *d
        if self._grow_nogil(n) != 0:
            return _fail(e, ES_READ_IO, rows[0] if n else 0, ENOMEM)
        es_rc_lock(rc)
        for i in range(n):
            d = out + i * rec
            if rows[i] < 0:
                memset(d, 0, rec)
                continue
            s = es_rc_peek(rc, rows[i])
            if s >= 0:
                memcpy(d, es_rc_hit(rc, s), rec)
            else:
                self.gmiss[m] = i
                m += 1
        es_rc_unlock(rc)
        if not m:
            return 0
        for j in range(m):
            self.gu[j] = rows[self.gmiss[j]]
        nu = es_io_unique(self.gu, m, self.gu)
        es_rc_lock(rc)
        rc.misses += nu
        rc.hits += m - nu
        es_rc_unlock(rc)
        if self.source.read_nogil(self.gu, nu, self.gstage, e) != 0:
            return -1
        for j in range(m):
            k = es_io_find(self.gu, nu, rows[self.gmiss[j]])
            memcpy(out + self.gmiss[j] * rec, self.gstage + k * rec, rec)
        es_rc_lock(rc)
        for k in range(nu):
            rc.bytes_fetched += rc.recbytes
            if es_rc_peek(rc, self.gu[k]) < 0:
                s = es_rc_insert(rc, self.gu[k])
                if s >= 0:
                    memcpy(rc.data + s * rc.stride, self.gstage + k * rec, rec)
        es_rc_unlock(rc)
        return 0

    def read_error(self, code, row, err, more=""):
        """Its source's (the reads behind the cache are the source's)."""
        return self.source.read_error(code, row, err, more)

    @property
    def reading(self):
        return bool(self.pending)

    cdef int _grow(self, int64_t n) except -1:
        if n <= self.cap:
            return 0
        cdef int64_t cap = max(n, 2 * self.cap, 64)
        self.srcd = <const char **> _regrow(self.srcd, cap * sizeof(char *))
        self.srcs = <const char **> _regrow(self.srcs, cap * sizeof(char *))
        self.udp = <const char **> _regrow(self.udp, cap * sizeof(char *))
        self.usp = <const char **> _regrow(self.usp, cap * sizeof(char *))
        self.pin_of = <int64_t *> _regrow(self.pin_of, cap * sizeof(int64_t))
        self.mpos = <int64_t *> _regrow(self.mpos, cap * sizeof(int64_t))
        self.uniq = <int64_t *> _regrow(self.uniq, cap * sizeof(int64_t))
        self.slot_of = <int64_t *> _regrow(self.slot_of, cap * sizeof(int64_t))
        self.cap = cap
        return 0

    cdef void _unpin(self) noexcept:
        """Drop every pin this reader holds."""
        self._unpin_range(0, self.npos)

    cdef void _unpin_range(self, int64_t lo, int64_t hi) noexcept:
        """Drop the pins of submitted positions [lo, hi)."""
        cdef int64_t i, s, dropped = 0
        cdef int32_t *refs = self.cache.c.refs
        hi = min(hi, self.npos)
        if self.npins == 0 or lo >= hi:
            return
        with nogil:
            es_rc_lock(&self.cache.c)
            for i in range(lo, hi):
                s = self.pin_of[i]
                if s >= 0:
                    refs[s] -= 1
                    self.pin_of[i] = -1
                    dropped += 1
            es_rc_unlock(&self.cache.c)
        self.npins -= dropped

    cdef void release(self) noexcept:
        if self.res_hi > self.res_lo:
            self._unpin_range(self.res_lo, self.res_hi)
        else:  # nothing resolved since the last release: the call was abandoned
            self._unpin()
        self.res_lo = self.res_hi = 0

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        cdef int64_t i, s, nu, m = 0, npins = 0
        cdef es_rowcache *c = &self.cache.c
        self.pending = False  # an aborted call's misses: the source drops them at its next submit
        self._unpin()  # the previous call's rows
        self.res_lo = self.res_hi = 0
        self.sub_rows, self.sub_n = NULL, 0
        self._grow(n)
        self.npos = n
        with nogil:
            es_rc_lock(&self.cache.c)
            for i in range(n):
                s = es_rc_peek(c, rows[i])
                if s >= 0:
                    self.srcd[i] = es_rc_hit(c, s)
                    self.srcs[i] = self.srcd[i] + self.rowbytes
                    c.refs[s] += 1
                    self.pin_of[i] = s
                    npins += 1
                else:
                    self.pin_of[i] = -1
                    self.srcd[i] = NULL
                    self.mpos[m] = i
                    m += 1
            es_rc_unlock(&self.cache.c)
            for i in range(m):
                self.uniq[i] = rows[self.mpos[i]]
            nu = es_io_unique(self.uniq, m, self.uniq)
            if m:  # a miss is a row read; its repeats in this call are served by that read: hits
                es_rc_lock(&self.cache.c)
                c.misses += nu
                c.hits += m - nu
                es_rc_unlock(&self.cache.c)
        self.npins, self.m, self.nu = npins, m, nu
        if nu:
            try:
                self.source.submit(self.uniq, nu)
            except BaseException:
                self._unpin()
                raise
            self.pending = True
        self.sub_rows, self.sub_n = rows, n
        return 0

    cdef int _admit(self) except -1:
        """Resolve the distinct misses from the source, each into the cache (a pin per missed
        position), every missed position pointed at its record. A failed read unpins the call
        and raises."""
        cdef int64_t i, j, k, s, npins = self.npins
        cdef int64_t rb = self.rowbytes, sb = self.scalebytes
        cdef es_rowcache *c = &self.cache.c
        cdef char *slot
        self.pending = False
        try:
            self.source.resolve(self.uniq, self.nu, self.udp, self.usp)
        except BaseException:
            self._unpin()
            self.sub_rows, self.sub_n = NULL, 0
            raise
        cdef bint full = False
        with nogil:
            es_rc_lock(&self.cache.c)
            for k in range(self.nu):
                s = es_rc_peek(c, self.uniq[k])  # another engine may have brought it meanwhile
                c.bytes_fetched += c.recbytes  # brought from the source, cached or not
                if s < 0 and not full:
                    # every slot pinned: none frees up while this loop only adds pins, so stop
                    # asking (each failed ask scans the whole clock)
                    s = es_rc_insert(c, self.uniq[k])
                    full = s < 0
                    if s >= 0:
                        slot = c.data + s * c.stride
                        memcpy(slot, self.udp[k], rb)
                        if sb:
                            memcpy(slot + rb, self.usp[k], sb)
                if s >= 0:  # held while the rest are admitted (an insert may evict any unpinned slot)
                    c.refs[s] += 1
                self.slot_of[k] = s
            for j in range(self.m):
                i = self.mpos[j]
                k = es_io_find(self.uniq, self.nu, self.sub_rows[i])
                s = self.slot_of[k]
                if s >= 0:
                    c.refs[s] += 1
                    self.pin_of[i] = s
                    npins += 1
                    self.srcd[i] = c.data + s * c.stride
                    self.srcs[i] = self.srcd[i] + rb
                else:  # not cached: where the source put it (valid until its next submit)
                    self.srcd[i] = self.udp[k]
                    self.srcs[i] = self.usp[k]
            for k in range(self.nu):
                if self.slot_of[k] >= 0:
                    c.refs[self.slot_of[k]] -= 1
            es_rc_unlock(&self.cache.c)
        self.npins = npins
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i, off = rows - self.sub_rows
        cdef int64_t rb = self.rowbytes, sb = self.scalebytes
        # the records planned by submit(): `rows` is a piece of the rows it was given
        if self.sub_rows == NULL or off < 0 or off + n > self.sub_n:
            raise RuntimeError("CachedRows.resolve: these rows were not submitted")
        if self.pending:
            self._admit()
        with nogil:
            for i in range(n):
                dp[i] = self.srcd[off + i]
                sp[i] = self.srcs[off + i] if sb else NULL
        if self.res_hi > self.res_lo:
            self.res_lo, self.res_hi = min(self.res_lo, off), max(self.res_hi, off + n)
        else:
            self.res_lo, self.res_hi = off, off + n
        return 0

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        cdef int64_t failed = 0, i
        if self.pending:  # the call's distinct misses, as handed to the source at submit()
            return self.source.prefetch(self.uniq, self.nu)
        for i in range(n):  # only the rows the cache lacks (a racy peek: advice only)
            if es_rc_peek(&self.cache.c, rows[i]) < 0:
                failed += self.source.prefetch(rows + i, 1)
        return failed
