# The streaming engine's state. Kernels: include/engram_hash.h (integers) and
# include/engram_step.h (floats), both stateless; this class owns the state (typed
# memoryviews) and the rules that move it (_engine.pyx: the one home of the ring rules).
cimport numpy as cnp
from libc.stdint cimport int64_t, int8_t, uint8_t, uint16_t

from engram_stream.rows._cache cimport RowCache, es_rowcache

cdef extern from "engram_step.h" nogil:
    ctypedef struct es_tail_params:
        int G, D, K
        float inv_sqrt_d
        const float *n1
        const float *n2
        const float *n3
        const float *cw
    void es_gemm_packed(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16, const float *biasp,
                        int M, float *Y, float *xpack) noexcept
    void es_gemm_packed_mt(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                           const float *biasp, int M, float *Y, float *xpack, int nthreads) noexcept
    void es_tails_mt(const es_tail_params *P, int64_t n, const float *Y, int64_t ldy, const float *hid,
                     float *out, float *X, float *gates, const float **taps, float **xdst,
                     int chained, int nthreads) noexcept
    void es_gather_mt(int kind, const void *table, const float *scale, int hd, const int64_t *rows, int H,
                      int64_t n, float *e, int64_t lde, int nthreads) noexcept
    int ES_MAX_THREADS
    int64_t es_fma_chains(int64_t n, float *sink) noexcept
    void es_gather_f32(const float *table, int hd, const int64_t *rows, int H, float *e) noexcept
    void es_gather_f16(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) noexcept
    void es_prefetch_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n) noexcept
    int64_t es_advise_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n,
                           int advice) noexcept
    void es_mark_rows(uint8_t *bitmap, const int64_t *rows, int64_t n) noexcept
    int MADV_WILLNEED
    int MADV_RANDOM
    int MADV_NORMAL
    void es_gather_i8(const int8_t *table, const float *scale, int hd, const int64_t *rows, int H,
                      float *e) noexcept


cdef class StreamEngine:
    cdef readonly object model
    cdef readonly object layer
    cdef readonly int n_streams
    cdef object _fingerprint       # what a snapshot must match to be restored here
    cdef object _file              # the io.files.MappedFile under a loaded table, or None
    cdef int file_fd               # its descriptor (-1: none) and its stamp (dev, ino, size,
    cdef int64_t file_stamp[4]     # mtime_ns) at load: checked before every table read

    # geometry
    cdef int G, D, E, M, H, hd, n, nh, K, conv_len
    cdef int64_t ldx              # ebuf row stride: E + 16 (see es_gemm_packed)
    cdef int64_t vocab, pad, C
    cdef int table_kind            # 0 float32, 1 float16, 2 int8 + per-row scale

    # borrowed, read-only model data: typed memoryviews taken once in __cinit__, shapes and
    # dtypes checked there (the ENGRAM_STREAM_DEBUG build bounds-checks every index below)
    cdef bint has_lookup           # False: identity compression (lookup is then empty)
    cdef const int64_t[::1] lookup     # [vocab]
    cdef const int64_t[::1] mult       # [n]
    cdef const int64_t[::1] primes     # [H]
    cdef const double[::1] fp          # [3H] division-free mod constants (empty: divide)
    cdef const int64_t[::1] offsets    # [H]
    cdef const uint8_t[:, ::1] table   # [rows, hd * itemsize]: the rows' bytes, any table dtype
    cdef const float[::1] table_scale  # [rows] int8 tables (empty otherwise)
    cdef int64_t rowbytes          # bytes of one table row
    cdef const uint8_t[:, :, ::1] wp   # [ceil(M/16), E, 16 * 4 or 2] packed projection panels' bytes:
    cdef bint wbf16                    # float32, or bfloat16 when wbf16 (model.with_weight_dtype)
    cdef const float[::1] bp           # [16*ceil(M/16)] padded bias
    cdef const float[:, ::1] cw        # [K, C] conv taps, tap-major
    cdef const float[:, ::1] n1, n2, n3  # [G, D] key, hidden and ShortConv RMSNorm weights
    cdef uint8_t[::1] touched      # optional rows-touched bitmap (track_rows), borrowed
    cdef bint tracking
    cdef es_tail_params tp

    # owned state, per stream (the ring rules that move it: _engine.pyx)
    cdef int64_t[:, ::1] hist          # [S, n-1] last compressed ids, most recent first
    cdef float[:, :, ::1] conv_state   # [S, conv_len, C] normalized values x; pos[s] = the oldest
    cdef int64_t[::1] pos              # [S] conv_state slot of the oldest value (where x(t) goes)
    cdef int64_t[::1] seen             # [S] tokens processed since reset
    cdef int64_t[:, ::1] last_rows     # [S, H] absolute table rows of the last fed token (-1: none)

    # owned scratch (malloc'd: it holds nothing between calls, is grown with realloc for
    # prefill under the one-owner guard, and is only handed to the C kernels as pointers)
    cdef int64_t cap               # rows the scratch holds (n_streams, grown for prefill)
    cdef int64_t *rbuf             # [cap, H] absolute table rows (prefill chunks)
    cdef float *ebuf               # [cap, ldx] gathered rows
    cdef float *ybuf               # [cap, M] projections
    cdef float *pbuf               # [cap, E] gathered rows packed in 6-row tiles for the GEMM
    cdef float *xbuf               # [cap, C] x(t) of each token of a block (step: per stream)
    cdef float *gbuf               # [cap, G] their gates
    cdef const float **taps        # [cap, K-1] the rows the taps of each token read
    cdef float **xdst              # [cap] where each x(t) goes in the conv ring (step)
    cdef bint pending              # feed() done, compute() not yet
    cdef bint busy                 # a call is running (one owner at a time)
    cdef int _prefill_threads      # threads for prefill (prefill_threads: 1..ES_MAX_THREADS)
    cdef int _step_threads         # threads for a multi-stream step (step_threads: 1..ES_MAX_THREADS)

    # row tiers (engram_stream.tiers; DESIGN "Row tiers"): a RAM row cache, a remote row source
    cdef RowCache rcache           # None: rows straight from the table
    cdef es_rowcache *rc           # &rcache.c, or NULL
    cdef object remote             # tiers.RemoteRows (rows fetched with the GIL at feed), or None
    cdef const char **src          # [cap * H] remote: each row's record (a cache slot or the staging buffer)
    cdef int64_t *mpos             # [cap * H] remote: positions that missed the cache

    cdef int _grow(self, int64_t cap) except -1
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil
    cdef void _hash_one(self, int64_t s, int64_t token, int64_t *rows) noexcept nogil
    cdef void _gather(self, const int64_t *rows, int64_t k, float *e) noexcept nogil
    cdef void _record(self, const char *p, float *e) noexcept nogil
    cdef int _fetch(self, const int64_t *rows, int64_t n) except -1
    cdef int _feed_remote(self, const int64_t *ids) except -1
    cdef void _project_tail(self, int64_t s, int64_t nb, const float *ph, float *po) noexcept nogil
    cdef int _prefill_remote(self, int64_t s, const int64_t *pid, int64_t T, int64_t chunk,
                             const float *ph, float *po) except -1
    cdef void _tails_step(self, const float *hid, float *out) noexcept nogil
    cdef void _tails_prefill(self, int64_t s, int64_t nb, const float *hid, float *out) noexcept nogil
    cdef void _feed_nogil(self, const int64_t *ids) noexcept nogil
    cdef void _compute_nogil(self, const float *hid, float *out) noexcept nogil
    cdef void _reset_stream(self, int64_t s) noexcept nogil
    cdef void _reset_all(self) noexcept nogil
    cdef _enter(self)
    cdef _refuse_overlap(self, cnp.ndarray o, cnp.ndarray h)
    cdef int _check_file(self) except -1
