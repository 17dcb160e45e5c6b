# The row-source seam: where an engine's table rows come from. Engines see only RowSource;
# a new place for rows is one subclass. A row travels as a record: `rowbytes` of data in the
# table's dtype, then `scalebytes` of its scale (int8 tables: a float32; V4.1: 8 e8m0 bytes),
# and an engine gets, per row, a pointer to each half (the halves need not be adjacent).
from libc.stdint cimport int64_t

from engram_stream.rows._cache cimport RowCache


cdef class RowSource:
    cdef readonly int64_t nrows        # rows of the table (valid rows: 0 .. nrows-1)
    cdef readonly int64_t rowbytes     # bytes of a row's data
    cdef readonly int64_t scalebytes   # bytes of its scale (0: none)
    cdef readonly bint fallible        # resolve()/submit() may raise: engines keep what a rollback needs

    # The rows a call will need (every chunk of it): start reading the missing ones now (a
    # mapped table: pull them toward the CPU). Called with the GIL; may raise (nothing is used).
    cdef int submit(self, const int64_t *rows, int64_t n) except -1
    # dp[i] / sp[i]: rows[i]'s data and scale (NULL without scales), valid until release().
    # Reads what is still missing; raises TierError / OSError with nothing used. `rows` is the
    # array given to the last submit() or a piece of it (a chunk of the call's tokens).
    cdef int resolve(self, const int64_t *rows, int64_t n, const char **dp, const char **sp) except -1
    # The pointers of the last resolve() are no longer read.
    cdef void release(self) noexcept
    # A hint for rows that will be resolved soon (mapped files: madvise WILLNEED the pages the
    # row cache lacks). Returns the calls that failed (advice only: never raises).
    cdef int64_t prefetch(self, const int64_t *rows, int64_t n) noexcept


cdef class MappedRows(RowSource):
    """A table in memory (RAM or a mapped file): pointers straight into it."""
    cdef const char *data              # row r at data + r * rowbytes
    cdef const char *scale             # its scale at scale + r * scalebytes, or NULL
    cdef object _keep                  # the arrays the pointers point into


cdef class CachedRows(RowSource):
    """The RAM row cache (rows/_cache.pyx) in front of a MappedRows (misses copied from the
    mapping) or of a remote reader (misses fetched in one batch by a Python callable)."""
    cdef RowCache cache
    cdef MappedRows local              # the table the misses are copied from, or None
    cdef object fetch                  # remote: fetch(uniq rows) -> uint8[>= len, stride] staging, or None
    cdef object _stage                 # the staging array of the last submit (src points into it)
    cdef const char **src              # [cap] each row's record (a slot, the staging buffer)
    cdef int64_t *mpos                 # [cap] positions that missed
    cdef int64_t cap
    cdef const int64_t *sub_rows       # remote: the rows of the last submit() (resolve() takes pieces of them)
    cdef int64_t sub_n
    cdef int _grow(self, int64_t n) except -1
