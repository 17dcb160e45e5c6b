# The deepseek-v4.1 streaming engine's C state. Kernels: include/engram_fp8.h (float8 rows,
# activation quantization, the wkv projection, the gate; on the path es_isa selects, as the
# demo's) and include/engram_hash.h (the hash).
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t

from engram_stream.engine._base cimport EngineBase, es_range_fn, es_split, es_team
from engram_stream.engine._window cimport HashWindow

cdef extern from "engram_fp8.h" nogil:
    int ES8_BLOCK
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
                    int M, float *Y, int nthreads, float *scratch, es_team *team) noexcept
    void es8_wkv_plain(const float *qx, int64_t ldq, int64_t S, int E, const uint8_t *W, const uint8_t *WS,
                       int M, float *Y) noexcept
    void es8_gate_tail(const float *kv, const void *hid, int hbf, const float *qw, const float *kw, int G, int D,
                       float eps, int dead, void *out, int obf) noexcept
    uint64_t es8_read_bytes(const uint8_t *p, int64_t n) noexcept
    int64_t es8_mac_chains(int64_t n, float *sink) noexcept
    int es8_cols_mode
    int es8_dpbf16(float *acc, const uint16_t *a, const uint16_t *b, int64_t n, int emulate) noexcept

cdef extern from "engram_step.h" nogil:
    void es_prefetch_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n) noexcept
    int64_t es_advise_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n,
                           int advice) noexcept
    void es_mark_rows(uint8_t *bitmap, const int64_t *rows, int64_t n) noexcept
    int MADV_WILLNEED


cdef class DeadWindow(HashWindow):
    cdef int64_t dead_id               # the raw id that is DEAD (the image token)


cdef class V41StreamEngine(EngineBase):
    cdef float eps
    cdef int ggtype                    # >= 0: a GGUFTier's rows, decoded by include/engram_gguf.h (-1: e4m3 records)
    cdef int64_t dead_id               # the raw id whose gate is 0 (the image token)

    # borrowed, read-only model data (typed memoryviews, shapes checked in _init_variant)
    cdef const uint8_t[:, ::1] ww      # wkv, e4m3 [M, E]
    cdef const uint8_t[:, ::1] ws      # wkv block scales, e8m0 [M/32, E/32]
    cdef const float[:, ::1] qw, kw    # [G, D]

    # owned scratch, per chunk
    cdef int64_t qcap                  # tokens the three below hold
    cdef float[:, ::1] qbuf            # [chunk, es8_ldq(E)] rows dequantized, then quantized in place
    cdef float[:, ::1] sbuf            # [chunk, E/32] their scales
    cdef float[:, ::1] ybuf            # [chunk, M] projections: G keys, then the value
    cdef float[::1] wscr               # projection scratch of many-token chunks (es8_scratch_floats)
    cdef int64_t wscr_n                # its floats (0: none yet)

    cdef void _tokens(self, es_range_fn fn, int64_t t0, const void *hid, void *out, int64_t n,
                      int threads) noexcept nogil
