# Direct row reads: include/engram_io.h holds the page planning, the pread loop and the I/O pool;
# IOPool owns a pool, RecordFile one table's record layout and open files, DirectReader one
# caller's batch (distinct rows, spans, the records read).
from libc.stdint cimport int64_t, int32_t, uint64_t
from posix.stat cimport struct_stat
from posix.types cimport pid_t

cdef extern from "engram_io.h" nogil:
    enum: ES_IO_PAGE
    enum: ES_IO_MAX_PARTS
    enum: ES_IO_MAX_QD
    enum: ES_IO_SPAN_MAX
    enum: ES_IO_SHORT
    enum: ES_IO_BADSUM
    ctypedef struct es_io_part:
        int fd
        const char *mem
        int64_t base, bytes, per_group, group_bytes, dst_off, sums
        uint64_t seed
    ctypedef struct es_io_span:
        int32_t part
        int64_t k0, k1, off, len, need
    ctypedef struct es_io_job:
        int64_t nspans, bytes
        int err
        int64_t err_span, err_got, err_row
    ctypedef struct es_io_pool:
        int nthreads, started
    int64_t es_io_off(const es_io_part *p, int64_t row) noexcept
    int64_t es_io_plan(const es_io_part *parts, int nparts, const int64_t *u, int64_t m,
                       es_io_span *spans) noexcept
    void es_io_copy_mem(const es_io_part *parts, int nparts, const int64_t *u, int64_t m,
                        char *dst, int64_t stride) noexcept
    int es_io_pool_init(es_io_pool *pl, int qd) noexcept
    void es_io_pool_free(es_io_pool *pl) noexcept
    void es_io_submit(es_io_pool *pl, es_io_job *j, const es_io_part *parts, const int64_t *u,
                      const es_io_span *spans, int64_t nspans, char *dst, int64_t stride, int qd) noexcept
    int es_io_wait(es_io_pool *pl, es_io_job *j, char *buf) noexcept
    int64_t es_io_unique(const int64_t *rows, int64_t n, int64_t *u) noexcept
    int64_t es_io_find(const int64_t *u, int64_t m, int64_t r) noexcept
    double es_io_now() noexcept
    int es_stamp_changed(const int64_t *s, const struct_stat *st) noexcept
    uint64_t es_io_sum(const void *data, int64_t len, uint64_t seed) noexcept
    void es_io_sums(const char *recs, int64_t n, int64_t stride, int64_t len, uint64_t seed, int64_t first,
                    uint64_t *out) noexcept


cdef class IOPool:
    cdef es_io_pool pool
    cdef readonly int qd
    cdef bint ready


cdef class RecordFile:
    cdef es_io_part parts[ES_IO_MAX_PARTS]
    cdef readonly int nparts
    cdef readonly int64_t nrows, recbytes, rowbytes, scalebytes
    cdef readonly object paths          # the files' paths (messages, FileChangedError)
    cdef readonly object direct         # per file part: O_DIRECT in effect
    cdef readonly object layer          # the layer whose records these are (errors name it), or None
    cdef object _fds, _stamps, _keep
    cdef int nfds
    cdef int fdv[ES_IO_MAX_PARTS]           # the open files, and their stamps at open (io.files._stamp)
    cdef int64_t stampv[ES_IO_MAX_PARTS][6]
    cdef int check_fast(self) except -1
    cdef object __weakref__


cdef class DirectReader:
    cdef readonly RecordFile file
    cdef readonly IOPool io
    cdef es_io_job job
    cdef bint pending                   # a submitted job not waited for yet
    cdef int64_t m                      # distinct rows of the last submit
    cdef int64_t *u                     # [cap] distinct rows, sorted
    cdef es_io_span *spans              # [cap * nparts]
    cdef char *stage                    # [cap * stride] records (page aligned)
    cdef char *buf                      # ES_IO_SPAN_MAX page-aligned bytes for the caller's reads
    cdef int64_t cap, stride
    cdef readonly int64_t reads, bytes_read, rows_read, calls
    cdef readonly double wait_seconds
    cdef object hist                    # int64[WAIT_BUCKETS]: wait() times, 8 buckets an octave from 1 us
    cdef object totals                  # int64[TOTALS] shared with other readers (or None)
    cdef int _grow(self, int64_t n) except -1
    cdef int submit(self, const int64_t *rows, int64_t n) except -1
    cdef int wait(self) except -1
    cdef const char *record(self, int64_t row) noexcept nogil
