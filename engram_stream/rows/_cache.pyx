# cython: language_level=3
"""RowCache: a fixed RAM budget of whole table rows in front of a table source.

The rules (open-addressing index keyed by absolute row, GCLOCK eviction, pins by
count) are in include/engram_rowcache.h; this class owns the memory and the lock its
readers (rows/_source.pyx CachedRows: every engine of the layer) take to change it.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy
from cpython.pythread cimport PyThread_allocate_lock, PyThread_free_lock

cnp.import_array()

SLOT_ALIGN = 64  # the slots start on a cache line


def slot_bytes(int64_t recbytes):
    """Bytes one cached row costs in slots: its record rounded up to a cache line (64) when that
    costs at most an eighth more, else to 8 bytes. A line-aligned record touches no extra line,
    but V4.1's 264-byte record would take 320 bytes: 21% fewer rows in the same RAM."""
    cdef int64_t line = (recbytes + 63) // 64 * 64
    return line if 8 * (line - recbytes) <= recbytes else (recbytes + 7) // 8 * 8


def _index_entries(int64_t nslots):
    cdef int64_t size = 1
    while size < 2 * nslots:
        size *= 2
    return size


cdef extern from "sys/mman.h" nogil:
    int madvise(void *addr, size_t length, int advice)
    int MADV_HUGEPAGE

DEF HUGE = 2 << 20


def _filled(int64_t n, dtype, fill):
    """n elements of dtype, all `fill`. A large array asks for transparent huge pages before its
    pages are touched: a big cache is read at random, and with 4 KiB pages nearly every lookup
    would also miss the TLB (advice only: refused, it changes nothing)."""
    a = np.empty(n, dtype)
    cdef size_t start = a.ctypes.data, end = start + a.nbytes
    cdef size_t lo = (start + HUGE - 1) & ~(<size_t> HUGE - 1), hi = end & ~(<size_t> HUGE - 1)
    if hi > lo:
        madvise(<void *> lo, hi - lo, MADV_HUGEPAGE)
    a.fill(fill)
    return a


def cache_nbytes(int64_t nslots, int64_t recbytes):
    """RAM a RowCache of nslots rows holds: slots, index (a power of two >= 2 per row),
    keys, use counters and pin counts."""
    n = max(nslots, 1)
    return n * slot_bytes(recbytes) + SLOT_ALIGN + _index_entries(nslots) * 8 + n * (8 + 4 + 1)


def slots_for(int64_t budget_bytes, int64_t recbytes):
    """The most rows a cache can hold within budget_bytes (everything counted)."""
    if cache_nbytes(0, recbytes) > budget_bytes:
        return 0
    lo, hi = 0, max(0, budget_bytes // (slot_bytes(recbytes) + 2 * 8 + 8 + 4 + 1))
    while lo < hi:  # cache_nbytes grows with n: the last n that fits
        mid = (lo + hi + 1) // 2
        if cache_nbytes(mid, recbytes) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


cdef class RowCache:
    """A cache of `nslots` row records of `recbytes` bytes each (layer: a label for stats;
    totals: an int64[4] that hits, misses, bytes_fetched, evictions are added to at the end)."""

    COUNTERS = ("hits", "misses", "bytes_fetched", "evictions")

    def __cinit__(self, int64_t nslots, int64_t recbytes, layer=None, totals=None):
        if nslots < 0 or recbytes < 0:
            raise ValueError(f"RowCache needs nslots >= 0 and recbytes >= 0, got {nslots}, {recbytes}")
        cdef int64_t size = _index_entries(nslots)
        cdef int bits = 0
        while (<int64_t> 1 << bits) < size:
            bits += 1
        cdef int64_t stride = slot_bytes(recbytes)
        index = _filled(size, np.int64, 0)
        keys = _filled(max(nslots, 1), np.int64, -1)
        uses = _filled(max(nslots, 1), np.uint8, 0)
        refs = _filled(max(nslots, 1), np.int32, 0)
        data = _filled(max(nslots, 1) * stride + SLOT_ALIGN, np.uint8, 0)
        cdef int64_t off = (-data.ctypes.data) % SLOT_ALIGN
        self._arrays = (index, keys, uses, data, refs)
        self.layer = layer
        if totals is not None and not (isinstance(totals, np.ndarray) and totals.dtype == np.int64
                                       and totals.shape == (4,)):
            raise ValueError("totals must be an int64[4] array")
        self._totals = totals
        self.c.nslots, self.c.recbytes, self.c.stride = nslots, recbytes, stride
        self.c.mask, self.c.shift = size - 1, 64 - bits
        self.c.index = <int64_t *> cnp.PyArray_DATA(index)
        self.c.keys = <int64_t *> cnp.PyArray_DATA(keys)
        self.c.uses = <uint8_t *> cnp.PyArray_DATA(uses)
        self.c.refs = <int32_t *> cnp.PyArray_DATA(refs)
        self.c.data = <char *> cnp.PyArray_DATA(data) + off
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError("RowCache: no lock")
        self.c.hand = self.c.used = 0
        self.c.hits = self.c.misses = self.c.evictions = self.c.bytes_fetched = 0

    def __dealloc__(self):
        if self.lock != NULL:
            PyThread_free_lock(self.lock)
        if self._totals is not None:
            self._totals += (self.c.hits, self.c.misses, self.c.bytes_fetched, self.c.evictions)

    @property
    def nslots(self):
        return self.c.nslots

    @property
    def recbytes(self):
        return self.c.recbytes

    @property
    def nbytes(self):
        """RAM the cache holds (slots, index, keys, counters, pins)."""
        return sum(a.nbytes for a in self._arrays)

    def stats(self):
        return {"hits": self.c.hits, "misses": self.c.misses, "bytes_fetched": self.c.bytes_fetched,
                "evictions": self.c.evictions, "rows_cached": self.c.used,
                "capacity_rows": self.c.nslots, "cache_bytes": self.nbytes}

    def __contains__(self, row):
        return es_rc_peek(&self.c, row) >= 0

    def __len__(self):
        return self.c.used

    def rows(self):
        """int64: the rows cached now (sorted)."""
        keys = self._arrays[1][:self.c.used]
        return np.sort(keys[keys >= 0])

    def touch(self, rows):
        """Look every row of `rows` up in order, as an engine's reads would (a miss takes a slot,
        CLOCK evicting), without any bytes: the hit-rate model of a cache this size (recbytes 0
        holds keys only). Returns the hits among them; the counters count them too."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        cdef const int64_t *pr = <const int64_t *> cnp.PyArray_DATA(r)
        cdef int64_t i, s, n = r.shape[0], hits = 0
        with nogil:
            for i in range(n):
                s = es_rc_peek(&self.c, pr[i])
                if s >= 0:
                    es_rc_hit(&self.c, s)
                    hits += 1
                else:
                    self.c.misses += 1
                    es_rc_insert(&self.c, pr[i])
        return hits

    def read(self, rows, cnp.ndarray records):
        """Read `rows` through the cache from `records` (uint8[N, recbytes], standing in for a
        table): what an engine's gather does per row. Returns uint8[len(rows), recbytes]."""
        r = np.ascontiguousarray(rows, dtype=np.int64).ravel()
        if records.dtype != np.uint8 or records.ndim != 2 or records.shape[1] != self.c.recbytes \
                or not records.flags.c_contiguous:
            raise ValueError(f"records must be a C-contiguous uint8 [N, {self.c.recbytes}] array")
        if r.size and (r.min() < 0 or r.max() >= records.shape[0]):
            raise IndexError("rows out of range")
        out = np.empty((r.shape[0], self.c.recbytes), dtype=np.uint8)
        cdef const int64_t *pr = <const int64_t *> cnp.PyArray_DATA(r)
        cdef const char *tab = <const char *> cnp.PyArray_DATA(records)
        cdef char *po = <char *> cnp.PyArray_DATA(out)
        cdef int64_t i, n = r.shape[0], rb = self.c.recbytes
        cdef const char *p
        with nogil:
            for i in range(n):
                p = es_rc_row(&self.c, pr[i], tab, rb, NULL, 0)
                if p == NULL:
                    p = tab + pr[i] * rb
                memcpy(po + i * rb, p, rb)
        return out
