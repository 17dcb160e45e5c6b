# The RAM row cache: include/engram_rowcache.h holds the lookup and CLOCK rules, the region's
# layout and its lock; RowCache owns the region (the process's own memory, or a host's file
# under /dev/shm); the row sources (rows/_source.pyx) read and fill it between es_rc_lock and
# es_rc_unlock.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cdef extern from "engram_rowcache.h" nogil:
    ctypedef struct es_rc_head:
        uint64_t magic
        int64_t version, head_bytes, total_bytes
        int64_t nslots, recbytes, stride, entries
        char identity[96]
        int64_t hand, used
        int64_t hits, misses, evictions, bytes_fetched
        int64_t recoveries
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
        es_rc_head *head
    uint64_t ES_RC_MAGIC
    int64_t ES_RC_VERSION
    int ES_RC_IDENTITY
    int64_t es_rc_layout(int64_t nslots, int64_t stride, int64_t entries, int64_t *o_index, int64_t *o_keys,
                         int64_t *o_refs, int64_t *o_uses, int64_t *o_data) noexcept
    int es_rc_init_head(es_rowcache *c, int64_t head_bytes, int64_t total, const char *identity) noexcept
    int es_rc_sound(es_rowcache *c, uint8_t *seen) noexcept
    int es_rc_init_lock(es_rc_head *h) noexcept
    void es_rc_lock(es_rowcache *c) noexcept
    void es_rc_unlock(es_rowcache *c) noexcept
    int64_t es_rc_peek(const es_rowcache *c, int64_t row) noexcept
    const char *es_rc_hit(es_rowcache *c, int64_t s) noexcept
    int64_t es_rc_insert(es_rowcache *c, int64_t row) noexcept
    const char *es_rc_row(es_rowcache *c, int64_t row, const char *table, int64_t rowbytes,
                          const char *scale, int64_t scalebytes) noexcept


cdef class RowCache:
    cdef es_rowcache c             # this process's view: es_rc_lock(&c) / es_rc_unlock(&c) around every change
    cdef readonly object layer
    cdef readonly object host      # the host's file under /dev/shm (bytes), or None: the process's own memory
    cdef char *base                # the region: head, index, keys, refs, uses, slots
    cdef size_t mapped
    cdef int fd                    # the host file, flock'ed shared while this process uses it (-1: none)
    cdef int pid                   # the process that attached it (a forked child does not detach it)
    cdef object __weakref__        # CachedTier tracks live caches for row_cache_stats()
    cdef object _totals            # int64[4] the counters are added to when the cache goes away
    cdef int _map(self, int fd, int64_t total) except -1
    cdef int _create(self, bytes path, int64_t total, bytes identity) except -1
    cdef int _join(self, int fd, bytes path, int64_t total, bytes identity) except -1
    cdef int64_t _cached(self) noexcept
