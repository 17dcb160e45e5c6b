# cython: language_level=3
"""The vLLM plugin's capturable lookup: a host function a CUDA graph can hold (issue 39).

In vLLM's FULL CUDA graphs nothing of Python runs at replay, so a lookup captured there must
be stream-ordered work: the ids' copy to pinned memory, then a host node (cuLaunchHostFunc)
that reads the rows into pinned staging, then the staging's copy to the device. This module is
that host node: hf_run(ctx) is a plain C function (nogil, no Python, no CUDA call, as a host
function must be) over an hf_ctx that holds everything it touches, built by HostLookup:

    ids      [T, k] int32 or int64 (this rank's columns of vLLM's hash ids), pinned
    staging  [T, k, 264] uint8 records or [T, k, head_dim] bf16 bits, pinned (the records of the
             checkpoint or of a GGUF's raw V4.1 rows, "gguf:E4M3_ROW": the same bytes)
    source   the row source, read through its C reader (RowSource.read_nogil, rows/_source.pxd):
             any source whose nogil_reads is set (MappedRows, DirectRows, a CachedRows over either)

An id outside [lo, hi) (this rank's rows) or negative gives a record of zeros, as vLLM's
kernel. A failure is never raised from the host node: it is recorded in the context's error
slot (the first one: code, row, errno; and a count), the call's rows read as zeros, and
HostLookup.check() raises it at the next eager check (the source names the error:
RowSource.read_error). A source whose reads need the GIL (a RecordSource: Mooncake) has no C
reader: HostLookup refuses it (graph_capable says why).
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from engram_stream.rows.records import E4M3_E8M0_RECORD
from engram_stream.integrations.serving import GGUF_V41
from engram_stream.integrations._records cimport records_bf16
from engram_stream.rows._source cimport (ES_READ_BAD_SUM, ES_READ_FILE_CHANGED, ES_READ_IO, CachedRows, RowSource,
                                         es_read_error)

cnp.import_array()

V41_RECORDS = (E4M3_E8M0_RECORD, GGUF_V41)   # the bytes vLLM's V4.1 kernel widens to bf16

# error codes of the slot: an id past the table, then the source's read_nogil() failures
cdef enum:
    BAD_ROW = 1       # an id in this rank's range but past the table's rows (the source's codes are 2 and up)

HF_OK = 0
HF_BAD_ROW = BAD_ROW
HF_IO = ES_READ_IO                        # a read failed (errno) or came short
HF_FILE_CHANGED = ES_READ_FILE_CHANGED    # a table file was truncated or replaced since it was opened
HF_BAD_SUM = ES_READ_BAD_SUM              # a packed record failed its checksum (the row in the slot)

ctypedef struct hf_ctx:
    # inputs
    const void *ids
    int id64
    int64_t T, k, lo, hi
    # the source (borrowed: HostLookup keeps it alive)
    void *src
    int64_t nrows, rec
    # output
    char *staging
    int bf16
    int64_t D
    float zero_scale
    # scratch (owned, sized for T * k)
    int64_t *rows
    char *recs                       # bf16: the records before conversion (uint8 out: staging)
    # the error slot (the first error since the last check) and counters
    int err
    int err_errno
    int64_t err_row
    int64_t nerr
    int64_t calls


cdef inline void _fail(hf_ctx *c, int code, int64_t row, int e) noexcept nogil:
    if c.err == 0:
        c.err, c.err_row, c.err_errno = code, row, e
    c.nerr += 1


cdef void hf_run(void *arg) noexcept nogil:
    """The host function (cuLaunchHostFunc's CUhostFn): this lookup's records (or bf16 rows)
    of ids into staging. No Python, no CUDA call; never fails loudly (see the module doc)."""
    cdef hf_ctx *c = <hf_ctx *> arg
    cdef int64_t n = c.T * c.k, i, id_
    cdef char *recs = c.recs if c.bf16 else c.staging
    cdef const int32_t *i32 = <const int32_t *> c.ids
    cdef const int64_t *i64 = <const int64_t *> c.ids
    cdef es_read_error e
    c.calls += 1
    for i in range(n):
        id_ = i64[i] if c.id64 else i32[i]
        if id_ < c.lo or id_ >= c.hi or id_ < 0:
            c.rows[i] = -1
        elif id_ >= c.nrows:
            _fail(c, BAD_ROW, id_, 0)
            c.rows[i] = -1
        else:
            c.rows[i] = id_
    if (<RowSource> c.src).read_nogil(c.rows, n, recs, &e) != 0:
        _fail(c, e.code, e.row, e.err)
        memset(recs, 0, n * c.rec)
    if c.bf16:
        records_bf16(<const uint8_t *> recs, <uint16_t *> c.staging, n, c.D, c.zero_scale)


def host_fn_address():
    """The address of hf_run (a CUhostFn / cudaHostFn_t: void (*)(void *))."""
    return <size_t> &hf_run


def graph_capable(source):
    """(True, "") when a host function can read `source` without the GIL (its C reader,
    RowSource.read_nogil: nogil_reads is set), else (False, why)."""
    if isinstance(source, RowSource) and source.nogil_reads:
        return True, ""
    inner = source.source if isinstance(source, CachedRows) else source
    return False, (f"{type(inner).__name__} has no C reader (nogil_reads is False): its reads need the GIL (rows "
                   f"from Python code, such as a store's client), which a CUDA graph's host node must not take. "
                   f"The sources that qualify: MappedRows, DirectRows, a CachedRows over either")


cdef void *_alloc(size_t n) except NULL:
    cdef void *p = malloc(n if n else 1)
    if p == NULL:
        raise MemoryError(f"HostLookup: {n} bytes of scratch")
    return p


cdef class HostLookup:
    """One capturable lookup's context: ids [T, k] (int32/int64, C order) -> staging (uint8
    [T, k, rec] records, or uint16 [T, k, D] bf16 bits), both pinned host arrays the caller
    keeps at fixed addresses (a captured graph's copies name them). lo, hi: this rank's rows.
    Lives as long as any graph that holds its address; holds the source (and its files, cache,
    pool) alive. The contexts of one source share its C reader's scratch: run them on one
    stream (a stream's host nodes run one at a time)."""
    cdef hf_ctx c
    cdef object _keep
    cdef RowSource _source                   # names a failure of its reads (read_error)

    def __cinit__(self, RowSource source, ids, staging, int64_t lo, int64_t hi, float zero_scale=0.0):
        memset(&self.c, 0, sizeof(hf_ctx))
        ok, why = graph_capable(source)
        if not ok:
            raise TypeError(f"HostLookup: {why}")
        if not (isinstance(ids, np.ndarray) and ids.ndim == 2 and ids.dtype in (np.int32, np.int64)
                and ids.flags.c_contiguous):
            raise ValueError(f"HostLookup: ids must be a C-contiguous int32/int64 [T, k] array, got "
                             f"{getattr(ids, 'dtype', type(ids))} {getattr(ids, 'shape', '')}")
        cdef int64_t T = ids.shape[0], k = ids.shape[1], rec = source.rowbytes + source.scalebytes
        cdef int64_t D = rec // 33 * 32, n = T * k     # a V4.1 record: D e4m3 bytes, then D / 32 e8m0 bytes
        if isinstance(staging, np.ndarray) and staging.dtype == np.uint16 and source.record_format not in V41_RECORDS:
            # bf16 rows are made by widening V4.1 records: the source's records must be those (the
            # checkpoint's, or a GGUF's raw rows: the same bytes), whatever their size (a demo int8
            # row of 128 and its float32 scale are 132 bytes, as a V4.1 record)
            raise ValueError(f"HostLookup: bf16 staging converts V4.1 records ({' or '.join(V41_RECORDS)}); this source's records "
                             f"are {source.record_format or 'of an unknown format'} ({source.rowbytes}+"
                             f"{source.scalebytes} bytes): stage uint8 records [T, k, {rec}] instead")
        if not (isinstance(staging, np.ndarray) and staging.flags.c_contiguous and staging.flags.writeable
                and ((staging.dtype == np.uint8 and staging.shape == (T, k, rec))
                     or (staging.dtype == np.uint16 and staging.shape == (T, k, D) and rec % 33 == 0))):
            raise ValueError(f"HostLookup: staging must be C-contiguous uint8 {(T, k, rec)} records or uint16 "
                             f"{(T, k, D)} bf16 rows (V4.1 records), got {getattr(staging, 'dtype', type(staging))} "
                             f"{getattr(staging, 'shape', '')}")
        source.reserve(n)   # the C reader's scratch: the host node allocates nothing
        self._keep = [source, ids, staging]
        self._source = source
        self.c.src = <void *> source
        self.c.ids, self.c.id64 = <const void *> cnp.PyArray_DATA(ids), ids.dtype == np.int64
        self.c.T, self.c.k, self.c.lo, self.c.hi = T, k, lo, hi
        self.c.nrows, self.c.rec = source.nrows, rec
        self.c.staging = <char *> cnp.PyArray_DATA(staging)
        self.c.bf16, self.c.D, self.c.zero_scale = staging.dtype == np.uint16, D, zero_scale
        self.c.rows = <int64_t *> _alloc(n * sizeof(int64_t))
        if self.c.bf16:
            self.c.recs = <char *> _alloc(n * rec)

    def __dealloc__(self):
        free(self.c.rows)
        free(self.c.recs)

    @property
    def address(self):
        """The context's address: the host function's userData."""
        return <size_t> &self.c

    @property
    def calls(self):
        """Times the host function ran on this context."""
        return self.c.calls

    @property
    def errors(self):
        """Failures recorded since the last check()."""
        return self.c.nerr

    def run(self):
        """Run the host function here, now (what the stream runs at the host node)."""
        with nogil:
            hf_run(&self.c)

    def error(self):
        """The first error recorded since the last check(): None or (code, row, errno)."""
        if self.c.err == 0:
            return None
        return (self.c.err, self.c.err_row, self.c.err_errno)

    def check(self):
        """Raise the first error recorded since the last check (and clear the slot): IndexError
        (an id past the table), OSError (a failed read), FileChangedError, RowChecksumError (a
        packed record whose bytes fail their checksum: the file, layer and row)."""
        cdef int code = self.c.err, e = self.c.err_errno
        cdef int64_t row = self.c.err_row, count = self.c.nerr
        if code == 0:
            return
        self.c.err, self.c.err_errno, self.c.err_row, self.c.nerr = 0, 0, 0, 0
        more = f" (graph lookup: {count} failures since the last check; their rows were served as zeros)"
        if code == HF_BAD_ROW:
            raise IndexError(f"engram_stream graph lookup: id {row} is past the table's {self.c.nrows} rows{more}")
        raise self._source.read_error(code, row, e, more)
