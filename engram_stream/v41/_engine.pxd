# The deepseek-v4.1 streaming engine's C state. Kernels: include/engram_fp8.h (float8 rows,
# activation quantization, the wkv projection, the gate; on the path es_isa selects, as the
# demo's) and include/engram_hash.h (the hash).
from libc.stdint cimport int64_t, uint8_t, uint64_t

cdef extern from "engram_fp8.h" nogil:
    int ES8_BLOCK
    int ES8_TILE_TOKENS
    int ES8_MAX_THREADS
    int ES8_PREFILL_CHUNK
    int ES8_MAX_E
    float es8_e4m3(uint8_t b) noexcept
    float es8_e8m0(uint8_t b) noexcept
    void es8_gather(const uint8_t *w, const uint8_t *sc, int hd, const int64_t *rows, int H, float *e) noexcept
    void es8_act_quant(const float *x, int n, float *qx, float *s) noexcept
    int64_t es8_scratch_floats(int64_t S, int E, int nthreads) noexcept
    int64_t es8_ldq(int E) noexcept
    void es8_wkv_mt(const float *qx, int64_t ldq, int64_t S, int E, const uint8_t *W, const uint8_t *WS,
                    int M, float *Y, int nthreads, float *scratch) noexcept
    void es8_wkv_plain(const float *qx, int64_t ldq, int64_t S, int E, const uint8_t *W, const uint8_t *WS,
                       int M, float *Y) noexcept
    void es8_gate_tail(const float *kv, const float *hid, const float *qw, const float *kw, int G, int D,
                       float eps, int dead, float *out) noexcept
    uint64_t es8_read_bytes(const uint8_t *p, int64_t n) noexcept

cdef extern from "engram_step.h" nogil:
    ctypedef void (*es_range_fn)(void *ctx, int64_t i0, int64_t i1) noexcept nogil
    void es_parallel(int nthreads, int64_t n, es_range_fn fn, void *ctx) noexcept
    void es_prefetch_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n) noexcept
    int64_t es_advise_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n,
                           int advice) noexcept
    void es_mark_rows(uint8_t *bitmap, const int64_t *rows, int64_t n) noexcept
    int MADV_WILLNEED


cdef class V41StreamEngine:
    cdef readonly object model
    cdef readonly object layer
    cdef readonly int n_streams
    cdef object _keep              # the model arrays the borrowed pointers below point into
    cdef object _fingerprint       # what a snapshot must match to be restored here

    # geometry
    cdef int G, D, E, M, H, hd, n, nh
    cdef int64_t C                 # G*D: hidden / output floats of one token
    cdef int64_t vocab, pad, dead_id
    cdef float eps

    # borrowed, read-only model data
    cdef const int64_t *lookup     # NULL: identity compression
    cdef const int64_t *mult
    cdef const int64_t *primes
    cdef const double *fp          # division-free mod constants (NULL: divide)
    cdef const int64_t *offsets
    cdef const uint8_t *tw         # table rows, e4m3 [N, hd]
    cdef const uint8_t *ts         # table scales, e8m0 [N, hd/32]
    cdef const uint8_t *ww         # wkv, e4m3 [M, E]
    cdef const uint8_t *ws         # wkv block scales, e8m0 [M/32, E/32]
    cdef const float *qw
    cdef const float *kw
    cdef uint8_t *touched          # optional rows-touched bitmap (track_rows), borrowed
    cdef object _touched_ref

    # owned state, per stream
    cdef int64_t[:, ::1] hist      # [S, n-1] window, newest first: compressed ids, -1 = DEAD
    cdef int64_t[::1] seen         # [S] tokens processed since reset

    # owned scratch
    cdef int64_t cap               # tokens the scratch holds (n_streams, grown for prefill)
    cdef int64_t[:, ::1] rbuf      # [cap, H] absolute table rows
    cdef uint8_t[::1] gdead        # [cap] the token is the DEAD (image) id: gate 0
    cdef float[:, ::1] qbuf        # [cap, es8_ldq(E)] rows dequantized, then quantized in place (e4m3 x scales)
    cdef float[:, ::1] sbuf        # [cap, E/32] their scales
    cdef float[:, ::1] ybuf        # [cap, M] projections: G keys, then the value
    cdef float[::1] wscr           # projection scratch of many-token calls (es8_scratch_floats)
    cdef int64_t wscr_n            # its floats (0: none yet)
    cdef bint pending              # feed() done, compute() not yet
    cdef int64_t tok1              # a scalar token id of a single-stream call
    cdef bint busy                 # a call is running (one owner at a time)
    cdef int _prefill_threads      # threads for prefill (prefill_threads, 1..ES8_MAX_THREADS)
    cdef int _step_threads         # threads of a multi-stream step (step_threads, 1..ES8_MAX_THREADS)

    cdef int _grow(self, int64_t cap) except -1
    cdef int _grow_scratch(self, int64_t S, int threads) except -1
    cdef void _tokens(self, es_range_fn fn, const float *hid, float *out, int64_t n, int threads) noexcept nogil
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil
    cdef void _hash_one(self, int64_t s, int64_t token, int64_t i) noexcept nogil
    cdef void _feed_nogil(self, const int64_t *ids) noexcept nogil
    cdef void _compute_nogil(self, const float *hid, float *out, int64_t n, int threads) noexcept nogil
    cdef int _step_scratch(self) except -1
    cdef void _count_step(self) noexcept nogil
    cdef void _reset_stream(self, int64_t s) noexcept nogil
    cdef _enter(self)
    cdef const int64_t *_id_ptr(self, ids, bint single)
