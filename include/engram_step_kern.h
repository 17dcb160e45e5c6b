/* engram_step_kern.h: the float kernels, a template included once per instruction set by
 * engram_step.h (see engram_isa.h). Before each inclusion:
 *   ES_SFX   the suffix of this copy's names (baseline, avx2, avx512)
 *   ES_TGT   its target attribute (empty for the baseline)
 *   ES_VW    floats per vector: 8 (32 bytes) or 16 (64 bytes, AVX-512)
 *   ES_TP    packed panels per GEMM micro-tile (a panel is ES_PANEL = 16 columns)
 *   ES_MR    rows per micro-tile: ES_MR x ES_TP*16/ES_VW accumulators stay in registers
 *   ES_GP    panels the one-row GEMV streams at once (concurrent memory streams)
 *   ES_F16C  1 where F16C converts half floats (x86 copies), 0 for the portable conversion
 * No include guard: including it again with other settings is the point; it undefines
 * these parameters at its end.
 */
#define ES_SK_CAT2(a, b) a##_##b
#define ES_SK_CAT(a, b) ES_SK_CAT2(a, b)
#define ES_SF(name) ES_SK_CAT(name, ES_SFX)
#define ES_KI static inline __attribute__((always_inline)) ES_TGT
#define ES_NV (ES_PANEL / ES_VW) /* vectors per panel */
/* offset of a tile's vector c in the packed weights: panel c / ES_NV, lanes (c % ES_NV) * ES_VW */
#define ES_WOFF(c, ps) ((int64_t)((c) / ES_NV) * (ps) + ((c) % ES_NV) * ES_VW)

typedef float ES_SF(es_vf) __attribute__((vector_size(ES_VW * 4), aligned(4)));
enum { ES_SF(es_mr) = ES_MR }; /* the row packing this copy's tiles read (es_gemm_mr) */

/* Store a tile row's tc vectors at Y, or only its first ncols floats (the right edge). */
ES_KI void ES_SF(es_store_row)(float *Y, const ES_SF(es_vf) *v, const int tc, int ncols) {
    typedef ES_SF(es_vf) vf;
    if (ncols == tc * ES_VW) {
#pragma GCC unroll 4
        for (int c = 0; c < tc; c++) *(vf *)(Y + c * ES_VW) = v[c];
    } else {
        float tmp[ES_TP * ES_PANEL];
#pragma GCC unroll 4
        for (int c = 0; c < tc; c++) *(vf *)(tmp + c * ES_VW) = v[c];
        memcpy(Y, tmp, sizeof(float) * ncols);
    }
}

/* The GEMM, twice: float32 weights, and bfloat16 weights widened in registers. */
#define ES_WT float
#define ES_WNAME f32
#define ES_W_BF16 0
#include "engram_gemm_kern.h"
#define ES_WT uint16_t
#define ES_WNAME bf16
#define ES_W_BF16 1
#include "engram_gemm_kern.h"

/* ---- gathers ---------------------------------------------------------------------- */

/* float16 tables (IEEE binary16 bits), widened to float32. */
static ES_TGT void ES_SF(es_gather_f16)(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) {
    for (int j = 0; j < H; j++) {
        const uint16_t *src = table + rows[j] * hd;
        float *dst = e + (int64_t)j * hd;
        int d = 0;
#if ES_F16C
        for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
        for (; d < hd; d++) dst[d] = es_half_to_float(src[d]);
    }
}

/* int8 rows with one float32 scale per row: value = q * scale. */
static ES_TGT void ES_SF(es_gather_i8)(const int8_t *table, const float *scale, int hd, const int64_t *rows,
                                       int H, float *e) {
    for (int j = 0; j < H; j++) {
        const int8_t *src = table + rows[j] * hd;
        const float s = scale[rows[j]];
        float *dst = e + (int64_t)j * hd;
        for (int d = 0; d < hd; d++) dst[d] = (float)src[d] * s;
    }
}

#undef ES_SF
#undef ES_SK_CAT
#undef ES_SK_CAT2
#undef ES_KI
#undef ES_NV
#undef ES_WOFF
/* this copy's parameters: the next inclusion defines its own */
#undef ES_SFX
#undef ES_TGT
#undef ES_VW
#undef ES_TP
#undef ES_MR
#undef ES_GP
#undef ES_F16C
