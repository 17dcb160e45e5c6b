# cython: language_level=3
"""The vLLM plugin's capturable lookup: a host function a CUDA graph can hold (issue 39).

In vLLM's FULL CUDA graphs nothing of Python runs at replay, so a lookup captured there must
be stream-ordered work: the ids' copy to pinned memory, then a host node (cuLaunchHostFunc)
that reads the rows into pinned staging, then the staging's copy to the device. This module is
that host node: hf_run(ctx) is a plain C function (nogil, no Python, no CUDA call, as a host
function must be) over an hf_ctx that holds everything it touches, built from one of the
plugin's row sources by HostLookup:

    ids      [T, k] int32 or int64 (this rank's columns of vLLM's hash ids), pinned
    staging  [T, k, 264] uint8 records or [T, k, head_dim] bf16 bits, pinned
    source   a C view of the row source: a mapped table (data + scale pointers), a direct
             RecordFile (its parts, open files, I/O pool: engram_io.h), each optionally behind
             the RAM / host row cache (engram_rowcache.h, under its lock)

An id outside [lo, hi) (this rank's rows) or negative gives a record of zeros, as vLLM's
kernel. A failure is never raised from the host node: it is recorded in the context's error
slot (the first one: code, row, errno; and a count), the rows it concerns read as zeros, and
HostLookup.check() raises it at the next eager check. Sources whose reads need the GIL (a
RecordSource: Mooncake) have no C view: HostLookup refuses them (graph_capable says why).
"""
import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc
from libc.errno cimport EIO
from libc.string cimport memcpy, memset
from posix.stat cimport fstat, struct_stat

from engram_stream.errors import FileChangedError
from engram_stream.rows.records import E4M3_E8M0_RECORD
from engram_stream.integrations._records cimport records_bf16
from engram_stream.rows._cache cimport RowCache, es_rc_hit, es_rc_insert, es_rc_lock, es_rc_peek, es_rc_unlock, es_rowcache
from engram_stream.rows._direct import checksum_error
from engram_stream.rows._direct cimport (DirectReader, ES_IO_BADSUM, ES_IO_PAGE, ES_IO_SHORT, ES_IO_SPAN_MAX, RecordFile, es_io_copy_mem,
                                         es_io_find, es_io_job, es_io_part, es_io_plan, es_io_pool, es_io_span, es_io_submit,
                                         es_io_unique, es_io_wait, es_stamp_changed)
from engram_stream.rows._source cimport CachedRows, DirectRows, MappedRows, RecordSource, RowSource

cnp.import_array()

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

# error codes of the slot
HF_OK = 0
HF_BAD_ROW = 1        # an id in this rank's range but past the table's rows
HF_IO = 2             # a read failed (errno) or came short (ES_IO_SHORT)
HF_FILE_CHANGED = 3   # a table file was truncated or replaced since it was opened
HF_BAD_SUM = 4        # a packed record failed its checksum (the row in the slot)

cdef enum:
    K_MAPPED = 1
    K_DIRECT = 2

ctypedef struct hf_ctx:
    # inputs
    const void *ids
    int id64
    int64_t T, k, lo, hi
    # the source
    int kind
    int64_t nrows, rowbytes, scalebytes, rec
    const char *mdata
    const char *mscale
    const es_io_part *parts
    int nparts
    es_io_pool *pool
    int qd
    int nfds
    const int *fdv
    const int64_t *stampv            # [nfds][6]
    es_rowcache *cache               # NULL: none
    # output
    char *staging
    int bf16
    int64_t D
    float zero_scale
    # scratch (owned, sized for T * k)
    int64_t *rows
    int64_t *miss
    int64_t *u
    es_io_span *spans
    char *stage                      # distinct missed records
    char *recs                       # bf16: the records before conversion (uint8 out: staging)
    char *iobuf                      # ES_IO_SPAN_MAX page-aligned bytes for es_io_wait
    es_io_job job
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


cdef int _files_changed(hf_ctx *c) noexcept nogil:
    """RecordFile.check_fast without the GIL: 1 if a file changed since it was opened (es_stamp_changed)."""
    cdef struct_stat st
    cdef int i
    cdef const int64_t *s
    for i in range(c.nfds):
        s = c.stampv + 6 * i
        if fstat(c.fdv[i], &st) != 0 or es_stamp_changed(s, &st):
            return 1
    return 0


cdef int _read_distinct(hf_ctx *c, int64_t nu) noexcept nogil:
    """Records of the sorted distinct rows u[nu] into stage (k-th at stage + k * rec). 0, or -1
    with the error recorded."""
    cdef int64_t j, ns, rec = c.rec, rb = c.rowbytes, sb = c.scalebytes
    cdef int e
    if c.kind == K_MAPPED:
        for j in range(nu):
            memcpy(c.stage + j * rec, c.mdata + c.u[j] * rb, rb)
            if sb:
                memcpy(c.stage + j * rec + rb, c.mscale + c.u[j] * sb, sb)
        return 0
    if _files_changed(c):
        _fail(c, 3, c.u[0], 0)
        return -1
    ns = es_io_plan(c.parts, c.nparts, c.u, nu, c.spans)
    es_io_copy_mem(c.parts, c.nparts, c.u, nu, c.stage, rec)
    es_io_submit(c.pool, &c.job, c.parts, c.u, c.spans, ns, c.stage, rec, c.qd)
    e = es_io_wait(c.pool, &c.job, c.iobuf)
    if e == ES_IO_BADSUM:
        _fail(c, 4, c.job.err_row, 0)
        return -1
    if e != 0:
        _fail(c, 2, c.u[0], EIO if e == ES_IO_SHORT else e)
        return -1
    return 0


cdef void hf_run(void *arg) noexcept nogil:
    """The host function (cuLaunchHostFunc's CUhostFn): this lookup's records (or bf16 rows)
    of ids into staging. No Python, no CUDA call; never fails loudly (see the module doc)."""
    cdef hf_ctx *c = <hf_ctx *> arg
    cdef int64_t n = c.T * c.k, i, j, m = 0, nu, kk, s, rec = c.rec, id_
    cdef es_rowcache *rc = c.cache
    cdef char *recs = c.recs if c.bf16 else c.staging
    cdef char *d
    cdef const int32_t *i32 = <const int32_t *> c.ids
    cdef const int64_t *i64 = <const int64_t *> c.ids
    c.calls += 1
    for i in range(n):
        id_ = i64[i] if c.id64 else i32[i]
        if id_ < c.lo or id_ >= c.hi or id_ < 0:
            c.rows[i] = -1
        elif id_ >= c.nrows:
            _fail(c, 1, id_, 0)
            c.rows[i] = -1
        else:
            c.rows[i] = id_
    if rc != NULL:
        es_rc_lock(rc)
    for i in range(n):
        d = recs + i * rec
        if c.rows[i] < 0:
            memset(d, 0, rec)
            continue
        if rc != NULL:
            s = es_rc_peek(rc, c.rows[i])
            if s >= 0:
                memcpy(d, es_rc_hit(rc, s), rec)
                continue
        c.miss[m] = i
        m += 1
    if rc != NULL:
        es_rc_unlock(rc)
    if m:
        for j in range(m):
            c.u[j] = c.rows[c.miss[j]]
        nu = es_io_unique(c.u, m, c.u)
        if rc != NULL:  # a miss is a row read; its repeats in this call are hits (as CachedRows)
            es_rc_lock(rc)
            rc.misses += nu
            rc.hits += m - nu
            es_rc_unlock(rc)
        if _read_distinct(c, nu) != 0:
            for j in range(m):
                memset(recs + c.miss[j] * rec, 0, rec)
        else:
            for j in range(m):
                kk = es_io_find(c.u, nu, c.rows[c.miss[j]])
                memcpy(recs + c.miss[j] * rec, c.stage + kk * rec, rec)
            if rc != NULL:
                es_rc_lock(rc)
                for kk in range(nu):
                    rc.bytes_fetched += rc.recbytes
                    if es_rc_peek(rc, c.u[kk]) < 0:
                        s = es_rc_insert(rc, c.u[kk])
                        if s >= 0:
                            memcpy(rc.data + s * rc.stride, c.stage + kk * rec, rec)
                es_rc_unlock(rc)
    if c.bf16:
        records_bf16(<const uint8_t *> recs, <uint16_t *> c.staging, n, c.D, c.zero_scale)


def host_fn_address():
    """The address of hf_run (a CUhostFn / cudaHostFn_t: void (*)(void *))."""
    return <size_t> &hf_run


def graph_capable(source):
    """(True, "") when a host function can read `source` without the GIL, else (False, why)."""
    inner = source.source if isinstance(source, CachedRows) else source
    if isinstance(inner, (MappedRows, DirectRows)):
        return True, ""
    if isinstance(inner, RecordSource):
        return False, (f"{type(inner).__name__} rows come from Python code (a store's client): they need the GIL, "
                       f"which a CUDA graph's host node must not take")
    return False, f"{type(inner).__name__} has no C read path"


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
    pool) alive. Not for two streams at once (one scratch)."""
    cdef hf_ctx c
    cdef object _keep
    cdef object _path, _layer                # a direct source's file and layer (a checksum error names them)

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
        cdef int64_t D = source.rowbytes, n = T * k
        if isinstance(staging, np.ndarray) and staging.dtype == np.uint16 and source.record_format != E4M3_E8M0_RECORD:
            # bf16 rows are made by widening V4.1 records: the source's records must be those, whatever
            # their size (a demo int8 row of 128 and its float32 scale are 132 bytes, as a V4.1 record)
            raise ValueError(f"HostLookup: bf16 staging converts V4.1 records ({E4M3_E8M0_RECORD}); this source's records "
                             f"are {source.record_format or 'of an unknown format'} ({source.rowbytes}+"
                             f"{source.scalebytes} bytes): stage uint8 records [T, k, {rec}] instead")
        if not (isinstance(staging, np.ndarray) and staging.flags.c_contiguous and staging.flags.writeable
                and ((staging.dtype == np.uint8 and staging.shape == (T, k, rec))
                     or (staging.dtype == np.uint16 and staging.shape == (T, k, D)
                         and source.scalebytes * 32 == D))):
            raise ValueError(f"HostLookup: staging must be C-contiguous uint8 {(T, k, rec)} records or uint16 "
                             f"{(T, k, D)} bf16 rows (V4.1 records), got {getattr(staging, 'dtype', type(staging))} "
                             f"{getattr(staging, 'shape', '')}")
        cdef CachedRows cr
        cdef MappedRows mr
        cdef DirectRows dr
        cdef RecordFile f
        cdef void *p = NULL
        inner = source
        keep = [source, ids, staging]
        if isinstance(source, CachedRows):
            cr = source
            self.c.cache = &cr.cache.c
            inner = cr.source
            keep.append(cr.cache)
        if isinstance(inner, MappedRows):
            mr = inner
            self.c.kind = K_MAPPED
            self.c.mdata, self.c.mscale = mr.data, mr.scale
        else:
            dr = inner
            f = dr.reader.file
            self.c.kind = K_DIRECT
            self.c.parts, self.c.nparts = f.parts, f.nparts
            self.c.pool, self.c.qd = &dr.reader.io.pool, dr.reader.io.qd
            self.c.nfds, self.c.fdv, self.c.stampv = f.nfds, f.fdv, &f.stampv[0][0]
            self._path, self._layer = f.paths[0], f.layer
            keep += [dr.reader, f, dr.reader.io]
            if posix_memalign(&p, ES_IO_PAGE, ES_IO_SPAN_MAX) != 0:
                raise MemoryError()
            self.c.iobuf = <char *> p
            self.c.spans = <es_io_span *> _alloc(n * f.nparts * sizeof(es_io_span))
        self._keep = keep
        self.c.ids, self.c.id64 = <const void *> cnp.PyArray_DATA(ids), ids.dtype == np.int64
        self.c.T, self.c.k, self.c.lo, self.c.hi = T, k, lo, hi
        self.c.nrows, self.c.rowbytes, self.c.scalebytes, self.c.rec = source.nrows, source.rowbytes, \
            source.scalebytes, rec
        self.c.staging = <char *> cnp.PyArray_DATA(staging)
        self.c.bf16, self.c.D, self.c.zero_scale = staging.dtype == np.uint16, D, zero_scale
        self.c.rows = <int64_t *> _alloc(n * sizeof(int64_t))
        self.c.miss = <int64_t *> _alloc(n * sizeof(int64_t))
        self.c.u = <int64_t *> _alloc(n * sizeof(int64_t))
        self.c.stage = <char *> _alloc(n * rec)
        if self.c.bf16:
            self.c.recs = <char *> _alloc(n * rec)

    def __dealloc__(self):
        free(self.c.rows)
        free(self.c.miss)
        free(self.c.u)
        free(self.c.spans)
        free(self.c.stage)
        free(self.c.recs)
        free(self.c.iobuf)

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
        more = f" ({count} failures since the last check; their rows were served as zeros)"
        if code == 1:
            raise IndexError(f"engram_stream graph lookup: id {row} is past the table's {self.c.nrows} rows{more}")
        if code == 4:
            raise checksum_error(self._path, self._layer, row)
        if code == 3:
            raise FileChangedError(f"engram_stream graph lookup: a table file was truncated or rewritten in place "
                                   f"after it was opened{more}")
        raise OSError(e, f"engram_stream graph lookup: reading rows (first row {row}): {os.strerror(e)}{more}")
