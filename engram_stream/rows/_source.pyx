# cython: language_level=3
"""Row sources (the seam between engines and the places rows live; _source.pxd has the contract).

    MappedRows   the table in memory or mapped from the checkpoint: pointers into it, nothing to fail
    DirectRows   rows read from the checkpoint's files (rows/_direct.pyx): pread, O_DIRECT, an I/O pool
    CachedRows   the model's RAM row cache of a layer (shared by its engines) in front of a
                 MappedRows, a DirectReader or a remote reader (rows.mooncake)

An engine hashes a call's tokens, hands the rows to submit() (a remote source reads its misses
there: Decoder.begin starts every layer's reads before any layer runs), then per chunk asks
resolve() for each row's data and scale pointers, gathers without the GIL, and release()s them.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, memset

from engram_stream.rows._cache cimport RowCache, es_rc_hit, es_rc_insert, es_rc_lock, es_rc_peek, es_rc_unlock, es_rowcache
from engram_stream.rows._direct cimport DirectReader, es_io_find, es_io_unique

cnp.import_array()

READ_WINDOW = 1 << 16  # rows read_into hands one submit() (as the engines' SUBMIT_ROWS)

cdef extern from "engram_step.h" nogil:
    void es_prefetch_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n) noexcept
    int64_t es_advise_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n,
                           int advice) noexcept
    int MADV_WILLNEED


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
    (None: none). Both are borrowed read-only (a RAM array or a view of a mapped file)."""

    def __cinit__(self, data, scale=None):
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
        self._keep = (data, scale)

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
        with nogil:
            failed = es_advise_rows(self.data, self.rowbytes, rows, n, MADV_WILLNEED)
            if self.scale != NULL:  # scales live on other pages
                failed += es_advise_rows(self.scale, self.scalebytes, rows, n, MADV_WILLNEED)
        return failed


cdef class CachedRows(RowSource):
    """A layer's RowCache in front of where its misses come from; the cache is the model's, shared
    by every engine of the layer (and so by every stream), and this object is one engine's reader
    of it (one owner). Exactly one source of misses:

      local=MappedRows    a miss is copied from the mapping at resolve()
      reader=DirectReader submit() plans the rows against the cache and starts reading the
                          distinct misses from disk (the I/O pool runs while the engine goes on:
                          Decoder.begin starts every layer's reads); resolve() waits for them
      remote=RemoteRows   the same with one batched remote read (rows.mooncake: start/finish)

    Sharing: every change to the cache happens under its lock; a slot some reader still reads is
    pinned by count (refs), so no engine's fills evict another's rows. A call's pins last until
    this reader's next submit() (reader, remote) or release() (local). When every slot is pinned
    a row is read from the mapping or the staged records instead."""

    def __cinit__(self, RowCache cache, MappedRows local=None, DirectReader reader=None, remote=None,
                  rowbytes=None, scalebytes=0, nrows=None):
        if (local is not None) + (reader is not None) + (remote is not None) != 1:
            raise ValueError("CachedRows needs exactly one of local (a MappedRows), reader (a DirectReader) "
                             "and remote (a reader with start/finish)")
        self.cache, self.local, self.reader, self.remote = cache, local, reader, remote
        if local is not None:
            self.nrows, self.rowbytes, self.scalebytes = local.nrows, local.rowbytes, local.scalebytes
        elif reader is not None:
            self.nrows, self.rowbytes = reader.file.nrows, reader.file.rowbytes
            self.scalebytes = reader.file.scalebytes
        else:
            self.nrows, self.rowbytes, self.scalebytes = nrows, rowbytes, scalebytes
        if self.rowbytes + self.scalebytes != cache.recbytes:
            raise ValueError(f"CachedRows: the cache holds {cache.recbytes}-byte records, rows are "
                             f"{self.rowbytes}+{self.scalebytes} bytes")
        self.fallible = local is None

    def __dealloc__(self):
        self._drop()
        self._unpin()
        free(self.src)
        free(self.pins)
        free(self.mpos)
        free(self.uniq)
        free(self.slot_of)

    @property
    def reading(self):
        return bool(self.pending)

    cdef int _grow(self, int64_t n) except -1:
        if n <= self.cap:
            return 0
        cdef int64_t cap = max(n, 2 * self.cap, 64)
        cdef void *a = realloc(self.src, cap * sizeof(char *))
        if a == NULL:
            raise MemoryError("CachedRows: scratch")
        self.src = <const char **> a
        a = realloc(self.pins, 2 * cap * sizeof(int64_t))
        if a == NULL:
            raise MemoryError("CachedRows: scratch")
        self.pins = <int64_t *> a
        a = realloc(self.mpos, cap * sizeof(int64_t))
        if a == NULL:
            raise MemoryError("CachedRows: scratch")
        self.mpos = <int64_t *> a
        a = realloc(self.uniq, cap * sizeof(int64_t))
        if a == NULL:
            raise MemoryError("CachedRows: scratch")
        self.uniq = <int64_t *> a
        a = realloc(self.slot_of, cap * sizeof(int64_t))
        if a == NULL:
            raise MemoryError("CachedRows: scratch")
        self.slot_of = <int64_t *> a
        self.cap = cap
        return 0

    cdef void _unpin(self) noexcept:
        """Drop every pin this reader holds."""
        cdef int64_t i, n = self.npins
        cdef int32_t *refs = self.cache.c.refs
        if n == 0:
            return
        with nogil:
            es_rc_lock(&self.cache.c)
            for i in range(n):
                refs[self.pins[i]] -= 1
            es_rc_unlock(&self.cache.c)
        self.npins = 0

    cdef void _drop(self) noexcept:
        """Reads started and never admitted (an aborted call): wait for them, keep nothing."""
        if not self.pending:
            return
        self.pending = False
        try:
            if self.reader is not None:
                self.reader.wait()
            else:
                self.remote.finish()
        except BaseException:
            pass
        self._stage = None

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        cdef int64_t i, s, k, nu, m = 0, npins = 0
        cdef es_rowcache *c = &self.cache.c
        if self.local is not None:
            return 0  # misses are copied at resolve()
        self._drop()
        self._unpin()  # the previous call's rows
        self.sub_rows, self.sub_n = NULL, 0
        self._grow(n)
        with nogil:
            es_rc_lock(&self.cache.c)
            for i in range(n):
                s = es_rc_peek(c, rows[i])
                if s >= 0:
                    self.src[i] = es_rc_hit(c, s)
                    c.refs[s] += 1
                    self.pins[npins] = s
                    npins += 1
                else:
                    self.src[i] = NULL
                    self.mpos[m] = i
                    m += 1
            es_rc_unlock(&self.cache.c)
            for i in range(m):
                self.uniq[i] = rows[self.mpos[i]]
            nu = es_io_unique(self.uniq, m, self.uniq)
            if m:  # a miss is a row read; its repeats in this call are served by that read: hits,
                es_rc_lock(&self.cache.c)  # as the mapped source counts them
                c.misses += nu
                c.hits += m - nu
                es_rc_unlock(&self.cache.c)
        self.npins, self.m, self.nu = npins, m, nu
        self.sub_rows, self.sub_n = rows, n
        if nu:
            try:
                if self.reader is not None:
                    self.reader.submit(self.uniq, nu)
                else:
                    self.remote.start(np.asarray(<int64_t[:nu]> self.uniq).copy())
            except BaseException:
                self._unpin()
                self.sub_rows, self.sub_n = NULL, 0
                raise
            self.pending = True
        return 0

    cdef int _admit(self) except -1:
        """The started reads are done: each distinct missed row into the cache (pinned), every
        missed position pointed at its record. A failed read unpins the call and raises."""
        cdef int64_t i, j, k, s, npins = self.npins
        cdef int64_t rb = self.cache.c.recbytes
        cdef es_rowcache *c = &self.cache.c
        self.pending = False
        try:
            if self.reader is not None:
                self.reader.wait()
                self.stage, self.sstride = self.reader.stage, self.reader.stride
            else:
                st = self.remote.finish()
                self._stage = st
                self.stage, self.sstride = <const char *> cnp.PyArray_DATA(st), st.strides[0]
        except BaseException:
            self._unpin()
            self.sub_rows, self.sub_n = NULL, 0
            raise
        cdef bint full = False
        with nogil:
            es_rc_lock(&self.cache.c)
            for k in range(self.nu):
                s = es_rc_peek(c, self.uniq[k])  # another engine may have brought it meanwhile
                c.bytes_fetched += rb  # brought from the source, cached or not
                if s < 0 and not full:
                    # every slot pinned: none frees up while this loop only adds pins, so stop
                    # asking (each failed ask scans the whole clock)
                    s = es_rc_insert(c, self.uniq[k])
                    full = s < 0
                    if s >= 0:
                        memcpy(c.data + s * c.stride, self.stage + k * self.sstride, rb)
                if s >= 0:
                    c.refs[s] += 1
                    self.pins[npins] = s
                    npins += 1
                self.slot_of[k] = s
            es_rc_unlock(&self.cache.c)
            for j in range(self.m):
                i = self.mpos[j]
                k = es_io_find(self.uniq, self.nu, self.sub_rows[i])
                s = self.slot_of[k]
                self.src[i] = (c.data + s * c.stride) if s >= 0 else (self.stage + k * self.sstride)
        self.npins = npins
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i, s, off, npins
        cdef const char *p
        cdef int64_t rb = self.rowbytes, sb = self.scalebytes
        cdef es_rowcache *c = &self.cache.c
        cdef MappedRows m = self.local
        cdef bint full = False
        if m is None:
            # the records planned by submit(): `rows` is a piece of the rows it was given
            off = rows - self.sub_rows
            if self.sub_rows == NULL or off < 0 or off + n > self.sub_n:
                raise RuntimeError("CachedRows.resolve: these rows were not submitted")
            if self.pending:
                self._admit()
            with nogil:
                for i in range(n):
                    dp[i] = self.src[off + i]
                    sp[i] = self.src[off + i] + rb if sb else NULL
            return 0
        self._unpin()
        self._grow(n)
        npins = 0
        with nogil:
            es_rc_lock(&self.cache.c)
            for i in range(n):
                s = es_rc_peek(c, rows[i])
                if s >= 0:
                    p = es_rc_hit(c, s)
                else:
                    c.misses += 1
                    s = es_rc_insert(c, rows[i]) if not full else -1
                    full = s < 0  # every slot pinned: stays so for this call (see _admit)
                    if s >= 0:
                        p = c.data + s * c.stride
                        memcpy(<char *> p, m.data + rows[i] * rb, rb)
                        if sb:
                            memcpy(<char *> p + rb, m.scale + rows[i] * sb, sb)
                        c.bytes_fetched += c.recbytes
                if s >= 0:
                    c.refs[s] += 1
                    self.pins[npins] = s
                    npins += 1
                    dp[i] = p
                    sp[i] = p + rb if sb else NULL
                else:  # every slot pinned: read the table itself
                    dp[i] = m.data + rows[i] * rb
                    sp[i] = m.scale + rows[i] * sb if sb else NULL
            es_rc_unlock(&self.cache.c)
        self.npins = npins
        return 0

    cdef void release(self) noexcept:
        if self.local is not None:
            self._unpin()

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        cdef int64_t failed = 0, i
        if self.local is None:
            return 0  # those rows are being read since submit()
        for i in range(n):  # only the pages of rows the cache lacks (a racy peek: advice only)
            if es_rc_peek(&self.cache.c, rows[i]) < 0:
                failed += self.local.prefetch(rows + i, 1)
        return failed


cdef class DirectRows(RowSource):
    """A table's rows read from its files without a cache (tables="direct", row_cache_mb=0):
    submit() starts reading the call's distinct rows (de-duplicated by page, O_DIRECT, the I/O
    pool), resolve() waits for them and points into the reader's records (valid until the next
    submit)."""

    def __cinit__(self, DirectReader reader):
        self.reader = reader
        self.nrows, self.rowbytes = reader.file.nrows, reader.file.rowbytes
        self.scalebytes = reader.file.scalebytes
        self.fallible = True

    @property
    def reading(self):
        return bool(self.pending)

    def __dealloc__(self):
        if self.pending:
            try:
                self.reader.wait()
            except BaseException:
                pass

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
