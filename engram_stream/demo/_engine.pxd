# The demo variant's streaming engine: the shared skeleton (engine/_base.pxd) plus the fused
# projection and the ShortConv ring. Kernels: include/engram_step.h (stateless float math);
# the ring's rules (which slot a tap reads, where x(t) goes) live in _engine.pyx.
cimport numpy as cnp
from libc.stdint cimport int64_t, int8_t, uint8_t, uint16_t

from engram_stream.engine._base cimport EngineBase, es_team

cdef extern from "engram_step.h" nogil:
    ctypedef struct es_tail_params:
        int G, D, K
        float inv_sqrt_d
        float eps_qk
        float eps_conv
        const float *n1
        const float *n2
        const float *n3
        const float *cw
    void es_tails_mt(const es_tail_params *P, int64_t n, const float *Y, int64_t ldy, const void *hid, int hbf,
                     void *out, int obf, float *X, float *gates, const float **taps, float **xdst,
                     int chained, int nthreads, es_team *team) noexcept
    int ES_MAX_THREADS
    void es_gemm_packed(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                        const float *biasp, int M, float *Y, float *xpack) noexcept
    int64_t es_fma_chains(int64_t n, float *sink) noexcept
    int es_bfdot(float *acc, const uint16_t *a, const uint16_t *b, int64_t n) noexcept
    void es_gather_f32(const float *table, int hd, const int64_t *rows, int H, float *e) noexcept
    void es_gather_f16(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) noexcept
    void es_gather_bf16(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) noexcept
    void es_gather_i8(const int8_t *table, const float *scale, int hd, const int64_t *rows, int H,
                      float *e) noexcept


cdef class StreamEngine(EngineBase):
    cdef int K, conv_len
    cdef int64_t ldx                   # ebuf row stride: E + 16 (see es_gemm_packed)
    cdef int table_kind                # 0 float32, 1 float16, 2 int8 + per-row scale, 3 bfloat16, 4 FP8 bytes
                                       # through a value table, 5 NVFP4 nibbles + E4M3 block scales through one,
                                       # 6 GGUF rows (a GGUFTier's records) through include/engram_gguf.h
    cdef int ggtype                    # kind 6: the rows' GGUF type (rows.gguf.gather_type)
    cdef const float[::1] lut          # kinds 4, 5: the value of each code (weights' table_lut; else empty)

    # borrowed, read-only model data (typed memoryviews, shapes checked in _init_variant)
    cdef const uint8_t[:, :, ::1] wp   # [ceil(M/16), E, 16 * 4 or 2] packed projection panels' bytes:
    cdef int wbf16                     # 0 float32, 1 bfloat16 (model.with_weight_dtype), ES_GEMM_BF16_ROWS
                                       # bfloat16 with a bfloat16 table (es_gemm_packed)
    cdef const float[::1] bp           # [16*ceil(M/16)] padded bias
    cdef const float[:, ::1] cw        # [K, C] conv taps, tap-major
    cdef const float[:, ::1] n1, n2, n3  # [G, D] key, hidden and ShortConv RMSNorm weights
    cdef es_tail_params tp

    # owned state, per stream
    cdef float[:, :, ::1] conv_state   # [S, conv_len, C] normalized values x; pos[s] = the oldest
    cdef int64_t[::1] pos              # [S] conv_state slot of the oldest value (where x(t) goes)

    # what a rollback / commit needs of the ring (made when a call is a draft or its reads can fail)
    cdef bint ring_kept
    cdef float[:, :, ::1] undo_ring     # [S, conv_len, C] the slots a segment will overwrite, before it
    cdef int64_t[::1] undo_pos          # [S]
    cdef float[:, ::1] xsave           # [tokens, C] x of draft tokens a later token of the call overwrote
    cdef bint xsaving

    # owned scratch (malloc'd, per chunk; only handed to C as pointers)
    cdef int64_t ccap                  # tokens the chunk scratch holds
    cdef float *ebuf                   # [ccap, ldx] gathered rows
    cdef float *ybuf                   # [ccap, M] projections
    cdef float *pbuf                   # [ccap, E] gathered rows packed in tiles for the GEMM
    cdef float *xbuf                   # [ccap, C] x(t) of each token
    cdef float *gbuf                   # [ccap, G] their gates
    cdef const float **taps            # [ccap, K-1] the rows the taps of each token read
    cdef float **xdst                  # [ccap] where each x(t) goes in the ring (a chunk of steps)

    cdef void _save_x(self, int64_t t0, int64_t c0, int64_t plen) noexcept nogil
