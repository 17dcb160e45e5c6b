# The row-source seam: where an engine's table rows come from. Engines see only RowSource;
# a new place for rows is one subclass. A row travels as a record: `rowbytes` of data in the
# table's dtype, then `scalebytes` of its scale (int8 tables: a float32; V4.1: 8 e8m0 bytes),
# and an engine gets, per row, a pointer to each half (the halves need not be adjacent).
from libc.stdint cimport int64_t

from engram_stream.rows._cache cimport RowCache
from engram_stream.rows._direct cimport DirectReader, es_io_job, es_io_part, es_io_pool, es_io_span

# A read_nogil() failure: what went wrong (ES_READ_*), the row it concerns and an errno.
cdef enum:
    ES_READ_IO = 2             # a read failed (errno) or came short (EIO)
    ES_READ_FILE_CHANGED = 3   # a table file was truncated or replaced since it was opened
    ES_READ_BAD_SUM = 4        # a packed record failed its checksum
    ES_READ_NO_C = 5           # the source has no C reader (nogil_reads is False)

ctypedef struct es_read_error:
    int code
    int64_t row
    int err


cdef class RowSource:
    cdef readonly int64_t nrows        # rows of the table (valid rows: 0 .. nrows-1)
    cdef readonly int64_t rowbytes     # bytes of a row's data
    cdef readonly int64_t scalebytes   # bytes of its scale (0: none)
    cdef readonly object record_format # what a record's bytes are (rows.records.record_format), or None: unknown
    cdef readonly bint fallible        # resolve()/submit() may raise: engines keep what a rollback needs
    cdef public bint bound             # an engine reads through it (one engine a source, but a MappedRows)
    cdef readonly bint nogil_reads     # read_nogil() reads with no GIL and no Python (a CUDA graph's host node)

    # The rows a call will need (every chunk of it): start reading the missing ones now (a
    # mapped table: pull them toward the CPU). Called with the GIL; may raise (nothing is used).
    cdef int submit(self, const int64_t *rows, int64_t n) except -1
    # dp[i] / sp[i]: rows[i]'s data and scale (NULL without scales), valid until release(). Reads
    # what is still missing; raises TierError / OSError with nothing used. `rows` is the array
    # given to the last submit() or a piece of it (a chunk of the call's tokens).
    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1
    # The pointers of the resolve()s since the last release() are no longer read: a reader that
    # holds something for them lets it go (CachedRows unpins their cache slots); the rest of the
    # submitted rows stay resolvable. With no resolve() since the last release() (an abandoned
    # call), everything the last submit() holds is let go.
    cdef void release(self) noexcept
    # A hint for rows that will be resolved soon; the source decides what helps (a mapped file:
    # madvise WILLNEED of their pages; a cache: only of the rows it lacks; others: nothing).
    # Returns the calls that failed (advice only: never raises).
    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept
    # read_into's copy of n rows (all in range) to dst[i] (rowbytes + scalebytes each), with dp/sp
    # [n] scratch: submit, resolve, copy, release (a MappedRows copies from the table itself).
    cdef int _copy_rows(self, const int64_t *rows, int64_t n, char **dst, const char **dp,
                        const char **sp) except -1
    # The records of rows[n] (in range, repeats and any order; a negative row: zeros) to
    # out + i * (rowbytes + scalebytes), with no GIL and no Python: 0, or -1 with *e set (out is
    # then unspecified). Defined where nogil_reads is set (else ES_READ_NO_C). Its scratch is
    # its own (submit/resolve's state is untouched), grown here or by reserve(): one caller at a time.
    cdef int read_nogil(self, const int64_t *rows, int64_t n, char *out, es_read_error *e) noexcept nogil
    # read_nogil()'s scratch for n rows, with the GIL (MemoryError), so that it allocates nothing later:
    # _grow_nogil(n), which read_nogil() calls too (0, or -1: no memory).
    cdef int reserve(self, int64_t n) except -1
    cdef int _grow_nogil(self, int64_t n) noexcept nogil


cdef class MappedRows(RowSource):
    """A table in memory (RAM or a mapped file): pointers straight into it."""
    cdef const char *data              # row r at data + r * rowbytes
    cdef const char *scale             # its scale at scale + r * scalebytes, or NULL
    cdef readonly bint paged           # a view of a mapped file: prefetch() asks the kernel for pages
    cdef object _keep                  # the arrays the pointers point into


cdef class PartedRows(RowSource):
    """A table kept as consecutive parts (a GGUF's per-head tensors): pointers into each part."""
    cdef const char **bases            # [nparts] part k's first row
    cdef int64_t *starts               # [nparts + 1] the table row each part starts at, then nrows
    cdef int64_t nparts
    cdef const char *zero              # [rowbytes] zeros: the rows past the parts (a padded table)
    cdef readonly bint paged           # views of a mapped file: prefetch() asks the kernel for pages
    cdef object _keep                  # the parts
    cdef const char *_row(self, int64_t r) noexcept nogil


cdef class DirectRows(RowSource):
    """Rows read from files (a DirectReader) with no cache: submit() starts the reads, resolve()
    waits and points into the reader's records."""
    cdef DirectReader reader
    cdef const int64_t *sub_rows
    cdef int64_t sub_n
    cdef bint pending
    # read_nogil(): the reader's file and pool as C pointers, and scratch of its own
    cdef const es_io_part *parts
    cdef int nparts, qd, nfds
    cdef es_io_pool *pool
    cdef const int *fdv
    cdef const int64_t *stampv         # [nfds][6]
    cdef es_io_job gjob
    cdef int64_t *gu                   # [gcap] distinct rows, sorted
    cdef es_io_span *gspans            # [gcap * nparts]
    cdef char *gstage                  # [gcap] records
    cdef char *gbuf                    # ES_IO_SPAN_MAX page-aligned bytes for es_io_wait
    cdef int64_t gcap


cdef class RecordSource(RowSource):
    """A source whose records arrive in one batch per call from Python code (a store, a service,
    a test's toy): subclasses define start(rows) and finish() (see _source.pyx)."""
    cdef int64_t *uniq                 # [cap] the distinct rows of the last submit(), sorted
    cdef int64_t nu, cap
    cdef object _stage                 # what finish() returned: record k of uniq[k] at stage[k]
    cdef const char *stage
    cdef int64_t sstride
    cdef bint pending                  # started, finish() not called yet
    cdef bint ready                    # finish() returned: resolve() may point into the stage
    cdef void _drop(self) noexcept


cdef class CachedRows(RowSource):
    """A layer's RAM row cache (shared by every engine of the model: locked, pins by count) in
    front of any other RowSource: the distinct misses of a call are that source's own
    submit/resolve, copied into the cache as they arrive."""
    cdef RowCache cache
    cdef readonly RowSource source     # where misses come from
    cdef const char **srcd             # [cap] each submitted position's data
    cdef const char **srcs             # [cap] and its scale
    cdef const char **udp              # [cap] the source's pointers of uniq[k]'s data
    cdef const char **usp              # [cap] and of its scale
    cdef int64_t *pin_of               # [cap] the slot each submitted position pinned (-1: none)
    cdef int64_t npos                  # positions of pin_of in use (the last submit's n)
    cdef int64_t npins                 # pins held (entries of pin_of >= 0)
    cdef int64_t res_lo, res_hi        # positions resolved since the last release(): [res_lo, res_hi)
    cdef int64_t *mpos                 # [cap] submitted positions that missed
    cdef int64_t *uniq                 # [cap] the distinct missed rows, sorted
    cdef int64_t *slot_of              # [cap] the slot uniq[k] was admitted to (-1: none)
    cdef int64_t m, nu, cap
    cdef int64_t *gmiss                # read_nogil(): [gcap] positions that missed
    cdef int64_t *gu                   # [gcap] their distinct rows, sorted
    cdef char *gstage                  # [gcap] their records, from the source's read_nogil()
    cdef int64_t gcap
    cdef const int64_t *sub_rows       # the rows of the last submit() (resolve() takes pieces of them)
    cdef int64_t sub_n
    cdef bint pending                  # misses asked of the source, not admitted yet
    cdef int _grow(self, int64_t n) except -1
    cdef void _unpin(self) noexcept
    cdef void _unpin_range(self, int64_t lo, int64_t hi) noexcept
    cdef int _admit(self) except -1
