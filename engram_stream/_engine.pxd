# The streaming engine's C state. Kernels: include/engram_hash.h (integers) and
# include/engram_step.h (floats); this class owns the buffers and the rules.
from libc.stdint cimport int64_t, int8_t, uint8_t, uint16_t

cdef extern from "engram_step.h" nogil:
    ctypedef struct es_tail_params:
        int G, D, K, dil, conv_len
        float inv_sqrt_d
        const float *n1
        const float *n2
        const float *n3
        const float *cw
    void es_gemm_packed(const float *X, int64_t ldx, int64_t B, int E, const float *Wp, const float *biasp,
                        int M, float *Y, float *xpack) noexcept
    void es_gemm_packed_mt(const float *X, int64_t ldx, int64_t B, int E, const float *Wp,
                           const float *biasp, int M, float *Y, float *xpack, int nthreads) noexcept
    void es_tail(const es_tail_params *P, const float *proj, const float *hid, float *ring,
                 int64_t pos, float *out) noexcept
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
    cdef object _keep              # the arrays the borrowed pointers below point into
    cdef object _fingerprint       # what a snapshot must match to be restored here

    # geometry
    cdef int G, D, E, M, H, hd, n, nh, K, conv_len
    cdef int64_t ldx              # ebuf row stride: E + 16 (see es_gemm_packed)
    cdef int64_t vocab, pad, C
    cdef int table_kind            # 0 float32, 1 float16, 2 int8 + per-row scale

    # borrowed, read-only model data
    cdef const int64_t *lookup     # NULL: identity compression
    cdef const int64_t *mult
    cdef const int64_t *primes
    cdef const double *fp          # division-free mod constants (NULL: divide)
    cdef const int64_t *offsets
    cdef const char *table
    cdef const float *table_scale
    cdef int64_t rowbytes          # bytes of one table row
    cdef uint8_t *touched          # optional rows-touched bitmap (track_rows), borrowed
    cdef object _touched_ref
    cdef const float *wp           # packed projection panels
    cdef const float *bp           # padded bias
    cdef es_tail_params tp

    # owned state, per stream
    cdef int64_t *hist             # [S, n-1] last compressed ids, most recent first
    cdef float *ring               # [S, conv_len, C] normalized values (the conv state)
    cdef int64_t *pos              # [S] ring slot of the oldest value
    cdef int64_t *seen             # [S] tokens processed since reset

    # owned scratch
    cdef int64_t cap               # rows the scratch holds (n_streams, grown for prefill)
    cdef int64_t *rbuf             # [cap, H] absolute table rows
    cdef float *ebuf               # [cap, ldx] gathered rows
    cdef float *ybuf               # [cap, M] projections
    cdef float *pbuf               # [cap, E] gathered rows packed in 6-row tiles for the GEMM
    cdef bint pending              # feed() done, compute() not yet
    cdef int64_t tok1              # a scalar token id of a single-stream call
    cdef bint busy                 # a call is running (one owner at a time)
    cdef public int prefill_threads  # threads for prefill's GEMMs (default: the machine's cores)

    cdef int _grow(self, int64_t cap) except -1
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil
    cdef void _hash_one(self, int64_t s, int64_t token, int64_t *rows) noexcept nogil
    cdef void _gather(self, const int64_t *rows, float *e) noexcept nogil
    cdef void _tail(self, int64_t s, const float *proj, const float *hid, float *out) noexcept nogil
    cdef void _feed_nogil(self, const int64_t *ids) noexcept nogil
    cdef void _compute_nogil(self, const float *hid, float *out) noexcept nogil
    cdef void _reset_stream(self, int64_t s) noexcept nogil
    cdef void _reset_all(self) noexcept nogil
    cdef _enter(self)
    cdef const int64_t *_id_ptr(self, ids, bint single)
