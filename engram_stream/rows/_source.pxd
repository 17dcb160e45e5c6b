# The row-source seam: where an engine's table rows come from. Engines see only RowSource;
# a new place for rows is one subclass. A row travels as a record: `rowbytes` of data in the
# table's dtype, then `scalebytes` of its scale (int8 tables: a float32; V4.1: 8 e8m0 bytes),
# and an engine gets, per row, a pointer to each half (the halves need not be adjacent).
from libc.stdint cimport int64_t

from engram_stream.rows._cache cimport RowCache
from engram_stream.rows._direct cimport DirectReader


cdef class RowSource:
    cdef readonly int64_t nrows        # rows of the table (valid rows: 0 .. nrows-1)
    cdef readonly int64_t rowbytes     # bytes of a row's data
    cdef readonly int64_t scalebytes   # bytes of its scale (0: none)
    cdef readonly object record_format # what a record's bytes are (rows.records.record_format), or None: unknown
    cdef readonly bint fallible        # resolve()/submit() may raise: engines keep what a rollback needs
    cdef public bint bound             # an engine reads through it (one engine a source, but a MappedRows)

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
    cdef const int64_t *sub_rows       # the rows of the last submit() (resolve() takes pieces of them)
    cdef int64_t sub_n
    cdef bint pending                  # misses asked of the source, not admitted yet
    cdef int _grow(self, int64_t n) except -1
    cdef void _unpin(self) noexcept
    cdef void _unpin_range(self, int64_t lo, int64_t hi) noexcept
    cdef int _admit(self) except -1
