# cython: language_level=3
"""Row sources (the seam between engines and the places rows live; _source.pxd has the contract).

    MappedRows   the table in memory or mapped from the checkpoint: pointers into it, nothing to fail
    CachedRows   the RAM row cache in front of a MappedRows, or of a remote reader (rows.mooncake)

An engine hashes a call's tokens, hands the rows to submit() (a remote source reads its misses
there: Decoder.begin starts every layer's reads before any layer runs), then per chunk asks
resolve() for each row's data and scale pointers, gathers without the GIL, and release()s them.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

from engram_stream.rows._cache cimport (RowCache, es_rc_hit, es_rc_insert, es_rc_peek, es_rc_plan,
                                        es_rc_admit)

cnp.import_array()

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

    def read(self, rows):
        """uint8[len(rows), rowbytes + scalebytes]: the records of `rows` as an engine reads them
        (tests, tools; one resolve)."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        if r.size and (r.min() < 0 or r.max() >= self.nrows):
            raise IndexError(f"rows out of range for a table of {self.nrows} rows")
        cdef int64_t n = r.shape[0], i, rb = self.rowbytes, sb = self.scalebytes
        dp = np.zeros(max(n, 1), dtype=np.uintp)
        sp = np.zeros(max(n, 1), dtype=np.uintp)
        out = np.empty((n, rb + sb), dtype=np.uint8)
        cdef const char **pd = <const char **> cnp.PyArray_DATA(dp)
        cdef const char **ps = <const char **> cnp.PyArray_DATA(sp)
        cdef char *po = <char *> cnp.PyArray_DATA(out)
        self.submit(<const int64_t *> cnp.PyArray_DATA(r), n)
        self.resolve(<const int64_t *> cnp.PyArray_DATA(r), n, pd, ps)
        try:
            for i in range(n):
                memcpy(po + i * (rb + sb), pd[i], rb)
                if sb:
                    memcpy(po + i * (rb + sb) + rb, ps[i], sb)
        finally:
            self.release()
        return out


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

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        cdef int64_t failed
        with nogil:
            failed = es_advise_rows(self.data, self.rowbytes, rows, n, MADV_WILLNEED)
            if self.scale != NULL:  # scales live on other pages
                failed += es_advise_rows(self.scale, self.scalebytes, rows, n, MADV_WILLNEED)
        return failed


cdef class CachedRows(RowSource):
    """A RowCache (one engine's: an engine has one owner, so the cache needs no lock) in front of
    `local` (a MappedRows: a miss is copied from it) or of `fetch` (remote: fetch(uniq) reads the
    distinct missed rows, sorted, into a staging array uint8[>= len(uniq), cache stride] and may
    raise; it is called once per submit, with the GIL).

    Every row a resolve() hands out is pinned until the next one, so the rows of one chunk never
    evict each other; when every slot is pinned a row is read from the mapping (or the staging
    buffer) instead."""

    def __cinit__(self, RowCache cache, MappedRows local=None, fetch=None, rowbytes=None, scalebytes=0,
                  nrows=None):
        if (local is None) == (fetch is None):
            raise ValueError("CachedRows needs exactly one of local (a MappedRows) and fetch (a remote reader)")
        self.cache, self.local, self.fetch = cache, local, fetch
        if local is not None:
            self.nrows, self.rowbytes, self.scalebytes = local.nrows, local.rowbytes, local.scalebytes
        else:
            self.nrows, self.rowbytes, self.scalebytes = nrows, rowbytes, scalebytes
        if self.rowbytes + self.scalebytes != cache.recbytes:
            raise ValueError(f"CachedRows: the cache holds {cache.recbytes}-byte records, rows are "
                             f"{self.rowbytes}+{self.scalebytes} bytes")
        self.fallible = fetch is not None

    def __dealloc__(self):
        free(self.src)
        free(self.mpos)

    cdef int _grow(self, int64_t n) except -1:
        cdef void *a
        cdef void *b
        if n > self.cap:
            a = realloc(self.src, max(n, 1) * sizeof(char *))
            if a == NULL:
                raise MemoryError("CachedRows: scratch")
            self.src = <const char **> a
            b = realloc(self.mpos, max(n, 1) * sizeof(int64_t))
            if b == NULL:
                raise MemoryError("CachedRows: scratch")
            self.mpos = <int64_t *> b
            self.cap = n
        return 0

    cdef int submit(self, const int64_t *rows, int64_t n) except -1:
        if self.fetch is None:
            return 0
        # remote: plan against the cache (hits pinned), read the distinct misses in one batch,
        # admit them (pinned); resolve() then only points at the records
        self.sub_rows, self.sub_n = NULL, 0
        self._grow(n)
        self._stage = self.cache.plan_fetch(rows, n, self.src, self.mpos, self.fetch)  # read until the next submit
        self.sub_rows, self.sub_n = rows, n
        return 0

    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1:
        cdef int64_t i, s
        cdef const char *p
        cdef int64_t rb = self.rowbytes, sb = self.scalebytes
        cdef MappedRows m = self.local
        cdef int64_t off
        if self.fetch is not None:
            # the records planned by submit(): `rows` is a piece of the rows it was given
            off = rows - self.sub_rows
            if self.sub_rows == NULL or off < 0 or off + n > self.sub_n:
                raise RuntimeError("CachedRows.resolve: these rows were not submitted")
            with nogil:
                for i in range(n):
                    dp[i] = self.src[off + i]
                    sp[i] = self.src[off + i] + rb if sb else NULL
            return 0
        with nogil:
            self.cache.c.epoch += 1  # pins of this resolve
            for i in range(n):
                s = es_rc_peek(&self.cache.c, rows[i])
                if s >= 0:
                    p = es_rc_hit(&self.cache.c, s)
                else:
                    self.cache.c.misses += 1
                    s = es_rc_insert(&self.cache.c, rows[i])
                    if s >= 0:
                        p = self.cache.c.data + s * self.cache.c.stride
                        memcpy(<char *> p, m.data + rows[i] * rb, rb)
                        if sb:
                            memcpy(<char *> p + rb, m.scale + rows[i] * sb, sb)
                        self.cache.c.bytes_fetched += self.cache.c.recbytes
                if s >= 0:
                    self.cache.c.pin[s] = self.cache.c.epoch
                    dp[i] = p
                    sp[i] = p + rb if sb else NULL
                else:  # every slot pinned by this resolve: read the table itself
                    dp[i] = m.data + rows[i] * rb
                    sp[i] = m.scale + rows[i] * sb if sb else NULL
        return 0

    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept:
        cdef int64_t failed = 0, i
        if self.local is None:
            return 0  # remote rows were read by submit()
        for i in range(n):  # only the pages of rows the cache lacks
            if es_rc_peek(&self.cache.c, rows[i]) < 0:
                failed += self.local.prefetch(rows + i, 1)
        return failed
