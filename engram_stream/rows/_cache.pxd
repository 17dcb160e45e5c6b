# The RAM row cache: include/engram_rowcache.h holds the lookup and CLOCK rules; RowCache
# owns the slots, index and lock; the row sources (rows/_source.pyx) read and fill it.
from cpython.pythread cimport PyThread_type_lock
from libc.stdint cimport int32_t, int64_t, uint8_t

cdef extern from "engram_rowcache.h" nogil:
    ctypedef struct es_rowcache:
        int64_t nslots, recbytes, stride, mask
        int shift
        int64_t *index
        int64_t *keys
        uint8_t *uses
        int32_t *refs
        char *data
        int64_t hand, used
        int64_t hits, misses, evictions, bytes_fetched
    int64_t es_rc_peek(const es_rowcache *c, int64_t row) noexcept
    const char *es_rc_hit(es_rowcache *c, int64_t s) noexcept
    int64_t es_rc_insert(es_rowcache *c, int64_t row) noexcept
    const char *es_rc_row(es_rowcache *c, int64_t row, const char *table, int64_t rowbytes,
                          const char *scale, int64_t scalebytes) noexcept


cdef class RowCache:
    cdef es_rowcache c
    cdef PyThread_type_lock lock   # taken by readers that share the cache (rows/_source.pyx CachedRows)
    cdef readonly object layer
    cdef object _arrays            # the numpy buffers the struct's pointers point into
    cdef object __weakref__        # RowTiers tracks live caches for row_cache_stats()
    cdef object _totals            # int64[4] the counters are added to when the cache goes away
