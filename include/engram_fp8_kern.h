/* engram_fp8_kern.h: the float8 kernels of the V4.1 step, a template included once per path
 * by engram_fp8.h (as engram_step_kern.h is by engram_step.h). The path's shared settings come
 * from ES_PATH through engram_path.h: ES_SF, ES_TGT, ES_KI, ES_VW (4: 16 bytes, SSE2 / NEON;
 * 8: AVX2), and how e4m3 is widened:
 *   ES_F16C   1: through fp16 bits and F16C (the value times 2^-8; the caller folds 2^8 into the
 *             block scale, ES8_WIDEN_FOLD), the one-token GEMV through float32 bits by integer
 *             ops (es8_widen16i); 0: through float32 bits, portable C
 *   ES_NEON   1 (aarch64 ASIMD): through fp16 bits as F16C, by SSHLL #7 and FCVTL, in order
 * Before each inclusion engram_fp8.h sets ES_PATH and this template's own parameters:
 *   ES8_GR    weight rows the one-token GEMV streams at once
 *   ES8_MG    tokens up to which the many-token projection widens in registers (es8_mgemv, at most 8)
 *   ES8_XR    weight rows of a many-token tile (ES8_XR x ES8_XV vector accumulators)
 *   ES8_XV    token vectors of that tile (ES_VW tokens each, in the lanes; at most 2)
 *   ES8_XR1   weight rows of a tile of one token vector (at most 12)
 *   ES8_KB    k per block of the many-token projection (its widened rows stay in L1)
 *   ES8_KB_FEW  the same for at most ES8_FEW tokens
 *   ES8_XCOLS from this many tile columns of token vectors on, a row tile goes through all of
 *             them (else a tile column through all row tiles)
 * No include guard: including it again with other settings is the point; it undefines these
 * parameters at its end.
 *
 * Widening e4m3 exactly. A byte b = s eeee mmm. Sign-extended to 16 bits and shifted left
 * by 7, its bits are s s eeee mmm 0000000: masked with 0xbf80 this is the fp16 s 0eeee mmm0000000,
 * whose value is the e4m3 value times 2^-8 for every code (e4m3 subnormals land on fp16
 * subnormals, and F16C widens those exactly). Portable: the float32 s 000eeee mmm..., the
 * value times 2^-120 (subnormal in float32 for e = 0: exact, and the multiply by 2^120 that
 * follows is exact).
 * NEON: SSHLL #7 sign-extends and shifts 8 bytes in one instruction, then the same mask, FCVTL.
 * The NaN codes (s 1111 111) read as +-480 that way: the portable widening and the gathers set
 * their exponent to all ones (NaN, as the reference); the F16C projection does not (as the
 * avx512 path: checkpoints hold none, and on a CPU whose conversions bound the GEMV the fix
 * would cost a third of its time).
 */
#include "engram_path.h"
#define ES8_NV (16 / ES_VW) /* vectors per 16 widened bytes */

typedef float ES_SF(es8_vf) __attribute__((vector_size(ES_VW * 4), aligned(4)));
typedef double ES_SF(es8_vd) __attribute__((vector_size(ES_VW * 8), aligned(8)));
enum { ES_SF(es8_xlanes) = ES_VW, /* tokens per packed vector (es8_pack_tokens) */
       ES_SF(es8_mg) = ES8_MG };   /* tokens up to which es8_mgemv runs */

#if !ES_F16C && ES_VW != 4
#error "the portable and NEON widenings work on 4-lane vectors"
#endif

#if ES_NEON
/* 16 e4m3 bytes -> v[0..4) in order, the values times 2^-8 (fp16 bits: SSHLL #7 gives
 * s s eeee mmm 0000000, the mask 0xbf80 clears the second sign bit, FCVTL widens exactly);
 * nan: the NaN codes read NaN (magnitude 0x3f80 + 0x80 carries into bit 14: exponent all ones). */
ES_KI void ES_SF(es8_widen16n)(const uint8_t *p, ES_SF(es8_vf) *v, const int nan) {
    const int8x16_t x = vreinterpretq_s8_u8(vld1q_u8(p));
    const int16x8_t m = vdupq_n_s16((int16_t)0xbf80);
    int16x8_t h[2] = {vandq_s16(vshll_n_s8(vget_low_s8(x), 7), m), vandq_s16(vshll_high_n_s8(x, 7), m)};
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {
        if (nan) {
            const int16x8_t t = vaddq_s16(vandq_s16(h[i], vdupq_n_s16(0x3f80)), vdupq_n_s16(0x80));
            h[i] = vorrq_s16(h[i], vandq_s16(t, vdupq_n_s16(0x4000)));
        }
        const float16x8_t f = vreinterpretq_f16_s16(h[i]);
        v[2 * i] = (ES_SF(es8_vf))vcvt_f32_f16(vget_low_f16(f));
        v[2 * i + 1] = (ES_SF(es8_vf))vcvt_high_f32_f16(f);
    }
}
#endif

/* 16 e4m3 bytes at p -> v[0 .. ES8_NV) in the order the GEMVs read them (es8_gemv_layout):
 * F16C: the bytes as 8 words, v[0] their even bytes (shifted left by 8, arithmetic shift
 * right by 1, mask 0xbf80: the fp16 of value x 2^-8, as above), v[1] the odd ones (shifted
 * right by 1): three integer ops a 16 bytes, the rest of the GEMV stays off the conversion
 * unit (vcvtph2ps ~3 cycles per 8 values on the Zen of the benchmarks); NaN codes read
 * +-480. Portable: the bytes as 4 dwords, v[j] the bytes j, j + 4, j + 8, j + 12, each the
 * float32 bits sign << 31 | (b & 0x7f) << 20 by two shifts, two masks and an or (SSE2 has no
 * byte sign extension: the compilers lowered one to scalar code), NaN codes read NaN. */
ES_KI void ES_SF(es8_widen16g)(const uint8_t *p, ES_SF(es8_vf) *v) {
#if ES_NEON
    ES_SF(es8_widen16n)(p, v, 0);
#elif ES_F16C
    const __m128i m = _mm_set1_epi16((short)0xbf80), x = _mm_loadu_si128((const __m128i *)p);
    v[0] = (ES_SF(es8_vf))_mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1), m));
    v[1] = (ES_SF(es8_vf))_mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(x, 1), m));
#else
    typedef uint32_t vu __attribute__((vector_size(16)));
    typedef uint32_t vuu __attribute__((vector_size(16), aligned(1)));
    typedef int32_t vs __attribute__((vector_size(16)));
    const vu x = *(const vuu *)p;
    vu f[4];
    f[0] = ((x << 24) & 0x80000000u) | ((x << 20) & 0x07f00000u);
    f[1] = ((x << 16) & 0x80000000u) | ((x << 12) & 0x07f00000u);
    f[2] = ((x << 8) & 0x80000000u) | ((x << 4) & 0x07f00000u);
    f[3] = (x & 0x80000000u) | ((x >> 4) & 0x07f00000u);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        f[j] |= (vu)((vs)(f[j] & 0x07f00000u) == (vs){0x07f00000, 0x07f00000, 0x07f00000, 0x07f00000}) & 0x7f800000u;
        v[j] = (ES_SF(es8_vf))f[j] * 0x1p120f; /* value x 2^-120 (subnormal for e = 0) -> the value */
    }
#endif
}

#if ES_F16C
/* 16 e4m3 bytes at p -> v[0], v[1] in es8_widen16g's order (even bytes, odd bytes), the
 * values times 2^-120, by integer operations alone: the bytes as 8 words sign-extended to
 * dwords (vpmovsxwd); the odd byte (bits 15..8, its sign filling 31..15) shifted left by 12,
 * the even one left by 24 then arithmetically right by 4, each masked with 0x87f00000: the
 * float32 s 0000eeee mmm0..., whose value is the e4m3 value x 2^-120 for every code (e = 0
 * lands on float32 subnormals, exact; a CPU flushing denormal inputs (DAZ) would read those
 * as 0, as the portable widening). Six single-uop integer ops a 16 bytes, no conversion unit:
 * on Zen 4 the one-token GEMV through vcvtph2ps (es8_widen16g) was bound by the conversions,
 * not by memory. NaN codes read +-480 x 2^-120, as es8_widen16g's +-480 x 2^-8. */
ES_KI void ES_SF(es8_widen16i)(const uint8_t *p, ES_SF(es8_vf) *v) {
    const __m256i x = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m256i m = _mm256_set1_epi32((int)0x87f00000u);
    v[0] = (ES_SF(es8_vf))_mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(x, 24), 4), m));
    v[1] = (ES_SF(es8_vf))_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 12), m));
}
#define ES8_WIDEN_FOLD_I 0x1p112f /* es8_widen16i's 2^-120 over es8_widen16g's 2^-8 */
#endif

/* 16 e4m3 bytes at p -> v[0 .. ES8_NV) in order: the values times 2^-8 (F16C) or exactly
 * (portable); nan: the NaN codes read NaN (always, portable). */
ES_KI void ES_SF(es8_widen16)(const uint8_t *p, ES_SF(es8_vf) *v, const int nan) {
#if ES_F16C
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
    if (nan) { /* magnitude bits 0x3f80: + 0x80 carries into bit 14 (exponent all ones) */
        const __m256i t = _mm256_add_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x80));
        h = _mm256_or_si256(h, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    }
    v[0] = (ES_SF(es8_vf))_mm256_cvtph_ps(_mm256_castsi256_si128(h));
    v[1] = (ES_SF(es8_vf))_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#elif ES_NEON
    ES_SF(es8_widen16n)(p, v, nan);
#else
    typedef ES_SF(es8_vf) vf;
    vf g[4];
    (void)nan;
    ES_SF(es8_widen16g)(p, g); /* g[j][i] is byte 4i + j: transposed back */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) v[i] = (vf){g[0][i], g[1][i], g[2][i], g[3][i]};
#endif
}

#if ES_F16C || ES_NEON
#define ES8_WIDEN_FOLD 256.0f /* the widened values are value * 2^-8 */
#else
#define ES8_WIDEN_FOLD 1.0f
#endif

ES_KI float ES_SF(es8_hsum)(ES_SF(es8_vf) v) {
    float t[ES_VW];
    *(ES_SF(es8_vf) *)t = v;
    return es_hsum_lanes(t, ES_VW);
}

/* ---- table rows and the activation quantizer ------------------------------------------ */

/* e[j*hd + i] = e4m3(w[rows[j]][i]) * e8m0(sc[rows[j]][i/32]): exact, as es8_gather_plain. */
static ES_TGT void ES_SF(es8_gather)(const uint8_t *w, const uint8_t *sc, int hd, const int64_t *rows, int H,
                                      float *e) {
    typedef ES_SF(es8_vf) vf;
    const int nb = hd / ES8_BLOCK;
    for (int j = 0; j < H; j++) {
        const uint8_t *src = w + rows[j] * hd, *s = sc + rows[j] * nb;
        float *dst = e + (int64_t)j * hd;
        for (int b = 0; b < nb; b++) {
            const float f = es8_e8m0(s[b]);
            for (int h = 0; h < ES8_BLOCK; h += 16) {
                vf v[ES8_NV];
                ES_SF(es8_widen16)(src + b * ES8_BLOCK + h, v, 1);
#pragma GCC unroll 4
                for (int i = 0; i < ES8_NV; i++) { /* v * 2^8 is exact: the product rounds as e4m3 * f */
                    *(vf *)(dst + b * ES8_BLOCK + h + i * ES_VW) = (v[i] * ES8_WIDEN_FOLD) * f;
                }
            }
        }
    }
}

/* es8_act_quant_plain compiled for this path (the loops vectorize), times 1/s for / s: s is
 * a normal power of two, so both are the same correctly rounded value (the same bits), and
 * a vector division costs ~10x a multiply. */
static ES_TGT void ES_SF(es8_act_quant)(const float *x, int n, float *qx, float *s) {
    for (int b = 0; b < n / ES8_BLOCK; b++) {
        const float *xb = x + b * ES8_BLOCK;
        uint32_t amax = 0;
        for (int i = 0; i < ES8_BLOCK; i++) {
            const uint32_t a = es8_bits(xb[i]) & 0x7fffffffu;
            amax = a > amax ? a : amax;
        }
        const float sb = es8_act_scale(es8_from_bits(amax)), rb = 1.0f / sb;
        s[b] = sb;
        for (int i = 0; i < ES8_BLOCK; i++) qx[b * ES8_BLOCK + i] = es8_round_e4m3(xb[i] * rb) * sb;
    }
}

/* ---- the wkv projection ------------------------------------------------------------------ */

/* The activation in the order es8_widen16g gives the weights: per 16 values, F16C: the even
 * k, then the odd; portable: k = j, j + 4, j + 8, j + 12 for j = 0..3; NEON: in order. */
static ES_TGT void ES_SF(es8_gemv_layout)(const float *qx, int E, float *q) {
    for (int k = 0; k < E; k += 16)
#if ES_NEON
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) q[k + i] = qx[k + i];
#elif ES_F16C
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            q[k + i] = qx[k + 2 * i];
            q[k + 8 + i] = qx[k + 2 * i + 1];
        }
#else
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) q[k + i] = qx[k + (i & 3) * 4 + (i >> 2)];
#endif
}

#if ES_F16C /* wi: es8_widen16i (qs x ES8_WIDEN_FOLD_I more), else es8_widen16g */
#define ES8_WIDEN_GEMV(p, v, wi) ((wi) ? ES_SF(es8_widen16i)(p, v) : ES_SF(es8_widen16g)(p, v))
#else
#define ES8_WIDEN_GEMV(p, v, wi) ((void)(wi), ES_SF(es8_widen16g)(p, v))
#endif

/* One token, R rows (a constant at each call site) over all k: R weight streams in flight
 * (memory-bound), each row prefetched ES8_PREFETCH bytes ahead, widened in registers. qs:
 * the activation in es8_gemv_layout's order, the block scales folded in (x ES8_WIDEN_FOLD).
 * y[r] = the sums. */
ES_KI void ES_SF(es8_gemv)(const uint8_t *w, const int R, const float *qs, int E, float *y, const int wi) {
    typedef ES_SF(es8_vf) vf;
    vf acc[ES8_GR][ES8_NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int i = 0; i < ES8_NV; i++) acc[r][i] = (vf){0};
#define ES8_GEMV16(k)                                                                              \
    do {                                                                                           \
        vf q[ES8_NV];                                                                              \
        _Pragma("GCC unroll 4") for (int i = 0; i < ES8_NV; i++) q[i] = *(const vf *)(qs + (k) + i * ES_VW); \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                     \
            vf v[ES8_NV];                                                                          \
            ES8_WIDEN_GEMV(w + (int64_t)r * E + (k), v, wi);                                     \
            _Pragma("GCC unroll 4") for (int i = 0; i < ES8_NV; i++) acc[r][i] += v[i] * q[i];    \
        }                                                                                          \
    } while (0)
    int k = 0;
    for (; k + 64 <= E; k += 64) { /* a prefetch a row per line */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(w + (int64_t)r * E + k + ES8_PREFETCH, 0, 3);
#if ES_F16C /* and the same line of the next R rows, towards L2 (an address: past the last row it is a
             * hint that loads nothing): measured on Zen 4, one thread from DRAM, 13.6 -> 21 GB/s,
             * the plain read's rate; the hardware prefetcher alone kept 4 rows' streams short */
            __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)((int64_t)(r + R) * E + k)), 0, 1);
#endif
        }
#pragma GCC unroll 4
        for (int u = 0; u < 64; u += 16) ES8_GEMV16(k + u);
    }
    for (; k < E; k += 16) ES8_GEMV16(k);
#undef ES8_GEMV16
#undef ES8_WIDEN_GEMV
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
        for (int i = 1; i < ES8_NV; i++) acc[r][0] += acc[r][i];
        y[r] = ES_SF(es8_hsum)(acc[r][0]);
    }
}

/* A few tokens (2..ES8_MG), one row at a time: each 16 bytes of the row widened once in
 * registers (es8_widen16g, as the one-token GEMV), scaled by the block scale and
 * multiplied with every token's 16 values: no widened copy (its stores cost ~20 cycles a 16
 * bytes on the Zen of the benchmarks, a token's FMAs 2), so few tokens stay memory-bound.
 * q: the S tokens in es8_gemv_layout's order, rows E + 16 floats apart (not a multiple of 4
 * KiB: the tokens' lines would share L1 sets); y[t*ldy + r]. */
ES_KI void ES_SF(es8_mgemv)(const uint8_t *w, int R, const float *q, const int S, int E, const float *wsf,
                              float *y, int64_t ldy) {
    typedef ES_SF(es8_vf) vf;
    for (int r = 0; r < R; r++) {
        const uint8_t *wr = w + (int64_t)r * E;
        vf acc[ES8_MG];
#pragma GCC unroll 8
        for (int t = 0; t < S; t++) acc[t] = (vf){0};
        for (int k0 = 0; k0 < E; k0 += 32) { /* a block of 32 summed apart, then added (the reference's blocks) */
            if (!(k0 & 63)) __builtin_prefetch(wr + k0 + ES8_PREFETCH, 0, 3);
            vf v[2][ES8_NV], blk[ES8_MG];
            const float f = wsf[k0 >> 5];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                ES_SF(es8_widen16g)(wr + k0 + 16 * h, v[h]);
#pragma GCC unroll 4
                for (int i = 0; i < ES8_NV; i++) v[h][i] *= f;
            }
#pragma GCC unroll 8
            for (int t = 0; t < S; t++) {
                const float *qt = q + (int64_t)t * (E + 16) + k0;
                blk[t] = v[0][0] * *(const vf *)qt;
#pragma GCC unroll 8
                for (int j = 1; j < 2 * ES8_NV; j++) blk[t] += v[j / ES8_NV][j % ES8_NV] * *(const vf *)(qt + j * ES_VW);
                acc[t] += blk[t];
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < S; t++) y[t * ldy + r] = ES_SF(es8_hsum)(acc[t]);
    }
}

/* Rows [0, R) of a group, k in [k0, k0 + kw), widened with their block scales folded in
 * (wsf, x ES8_WIDEN_FOLD): row r at wf + r*ws. kw % 16 == 0. */
ES_KI void ES_SF(es8_widen_block)(const uint8_t *w, int R, int E, int k0, int kw, const float *wsf, float *wf,
                                    int64_t ws) {
    typedef ES_SF(es8_vf) vf;
    for (int64_t r = 0; r < R; r++)
        for (int k = 0; k < kw; k += 16) {
            vf v[ES8_NV];
            ES_SF(es8_widen16)(w + r * E + k0 + k, v, 0);
            const float f = wsf[(k0 + k) >> 5];
#pragma GCC unroll 4
            for (int i = 0; i < ES8_NV; i++) *(vf *)(wf + r * ws + k + i * ES_VW) = v[i] * f;
        }
}

/* The bytes [k0, k0 + kw) of R rows of a group, requested into L2 ahead of their widening: 32
 * rows are too many streams for the hardware prefetcher (measured: the widening waited on
 * memory a third of its time without). */
ES_KI void ES_SF(es8_wprefetch)(const uint8_t *w, int R, int E, int k0, int kw) {
    for (int r = 0; r < R; r++)
        for (int b = 0; b < kw; b += 64) __builtin_prefetch(w + (int64_t)r * E + k0 + b, 0, 2);
}

/* The micro-kernel of the many-token projection: R widened rows (w, row stride ws) x V
 * vectors of ES_VW tokens (xt, packed [k][ES_VW] per vector, vectors ldv apart) over n values
 * of k: each weight is broadcast into an FMA with the tokens' values at its k. part: R x V
 * vectors of sums (row stride ldp): this block's sums are stored there (first) or added (a
 * sum per k block, then the blocks': the error of a sum of a block's terms, not of E terms).
 * R and V are constants at each call site, so the tile stays in registers. */
ES_KI void ES_SF(es8_xtile)(const float *w, int64_t ws, const int R, const float *xt, int64_t ldv, const int V,
                              int n, float *part, int64_t ldp, int first) {
    typedef ES_SF(es8_vf) vf;
    vf acc[ES8_XR1][ES8_XV];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[r][v] = (vf){0};
    for (int k = 0; k < n; k++) {
        vf xv[ES8_XV];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) xv[v] = *(const vf *)(xt + v * ldv + k * ES_VW);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            const float wb = w[r * ws + k];
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[r][v] += wb * xv[v];
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) {
            vf *p = (vf *)(part + r * ldp + v * ES_VW);
            *p = first ? acc[r][v] : *p + acc[r][v];
        }
}

/* One tile of `rows` (1..ES8_XR; with one token vector, up to ES8_XR1; a constant per case)
 * x V token vectors. */
ES_KI void ES_SF(es8_xcase)(int rows, const float *wr, int64_t ws, const float *x, int64_t ldv, const int V,
                              int kw, float *pr, int64_t ldp, int first) {
#define ES8_X(n) case n: ES_SF(es8_xtile)(wr, ws, n, x, ldv, V, kw, pr, ldp, first); break;
    switch (rows) {
        ES8_X(1) ES8_X(2) ES8_X(3) ES8_X(4) ES8_X(5) ES8_X(6)
        ES8_X(7) ES8_X(8) ES8_X(9) ES8_X(10) ES8_X(11) ES8_X(12)
        default: break;
    }
#undef ES8_X
}

/* Rows of a tile starting at row r of R: ES8_XR, and a remainder of fewer rows than a tile
 * split with the tile before it into two near-equal ones (few accumulators leave the FMAs
 * idle: 32 rows go 6, 6, 6, 6, 4, 4). */
static inline int ES_SF(es8_tile_rows)(int R, int r, int xr) {
    return R - r <= xr ? R - r : (R - r < 2 * xr ? (R - r + 1) / 2 : xr);
}

/* One group of R <= 32 rows for S tokens (qx rows at stride ldq; xt: the same packed by
 * es8_pack_tokens with ES_VW lanes, S > ES8_MG, or each in es8_gemv_layout's order, E + 16
 * floats apart, 2..ES8_MG tokens). One token (qx in es8_gemv_layout's order): a GEMV straight from
 * the float8 bytes, the block scales folded into the activation once. A few: es8_mgemv.
 * Several: over k blocks (ES8_KB, or ES8_KB_FEW for up to ES8_FEW tokens: measured faster
 * there), the block's rows widened into scratch (L1/L2, rows a line apart more than a block:
 * at 4 KiB strides they would share L1 sets), the next block's bytes prefetched, then tiles of
 * rows x token vectors (a tile column of token vectors through all row tiles, or for many
 * tokens, a row tile through all token columns: its widened rows stay in L1 while the tokens
 * stream from L2); the block sums add up in scratch ([R][S rounded up to ES_VW]) and go to
 * y[t*ldy + r] after the last block. next: the next group's rows (rnext of them) or NULL: its
 * first block is prefetched during this group's last. */
static ES_TGT void ES_SF(es8_group)(const uint8_t *w, int R, const float *qx, const float *xt, int64_t S, int E,
                                     const float *wsf, float *y, int64_t ldy, float *scratch, const uint8_t *next,
                                     int rnext) {
    typedef ES_SF(es8_vf) vf;
    if (S == 1) {
        float qs[E] __attribute__((aligned(64)));
        int wi = 0;
#if ES_F16C
        /* es8_widen16i where qs x 2^112 stays finite (|qx x wsf| < 2^16): the
         * products are the same reals as through es8_widen16g, so the sums are the same bits */
        typedef uint32_t vu __attribute__((vector_size(ES_VW * 4)));
        typedef int32_t vs __attribute__((vector_size(ES_VW * 4)));
        vs big = {0}; /* lanes with |t| >= 2^16 (or NaN): the bits of |t| compared as integers */
        for (int k = 0; k < E; k += ES_VW) {
            const vf t = *(const vf *)(qx + k) * wsf[k >> 5];
            big |= (vs)((vu)t & 0x7fffffffu) >= 0x47800000;
            *(vf *)(qs + k) = t * ES8_WIDEN_FOLD_I;
        }
        wi = 1;
        for (int i = 0; i < ES_VW; i++) wi &= !big[i];
        for (int k = 0; k < E && !wi; k += ES_VW) *(vf *)(qs + k) = *(const vf *)(qx + k) * wsf[k >> 5];
#else
        for (int k = 0; k < E; k += ES_VW) *(vf *)(qs + k) = *(const vf *)(qx + k) * wsf[k >> 5];
#endif
        int r = 0; /* wi a constant in each copy of the GEMV (a test in its loop cost registers) */
#define ES8_GEMV_ROWS(wi)                                                                                  \
        do {                                                                                               \
            for (; r + ES8_GR <= R; r += ES8_GR) ES_SF(es8_gemv)(w + (int64_t)r * E, ES8_GR, qs, E, y + r, wi); \
            for (; r < R; r++) ES_SF(es8_gemv)(w + (int64_t)r * E, 1, qs, E, y + r, wi);                  \
        } while (0)
        if (wi) ES8_GEMV_ROWS(1);
        else ES8_GEMV_ROWS(0);
#undef ES8_GEMV_ROWS
        return;
    }
    if (S <= ES8_MG) { /* xt: the tokens in es8_gemv_layout's order */
#define ES8_M(n) case n: ES_SF(es8_mgemv)(w, R, xt, n, E, wsf, y, ldy); break;
        switch (S) { ES8_M(2) ES8_M(3) ES8_M(4) ES8_M(5) ES8_M(6) ES8_M(7) ES8_M(8) default: break; }
#undef ES8_M
        return;
    }
    const int kb = S <= ES8_FEW ? ES8_KB_FEW : ES8_KB;
    const int64_t nv = (S + ES_VW - 1) / ES_VW, ldp = nv * ES_VW, ldv = (int64_t)E * ES_VW, ws = kb + 16;
    const int rows_outer = nv > ES8_XCOLS * ES8_XV;
    float *wf = scratch, *part = scratch + (int64_t)ES8_BLOCK * ws;
    for (int k0 = 0; k0 < E; k0 += kb) {
        const int kw = E - k0 < kb ? E - k0 : kb, first = k0 == 0;
        ES_SF(es8_widen_block)(w, R, E, k0, kw, wsf, wf, ws);
        if (k0 + kb < E) ES_SF(es8_wprefetch)(w, R, E, k0 + kb, E - k0 - kb < kb ? E - k0 - kb : kb);
        else if (next) ES_SF(es8_wprefetch)(next, rnext, E, 0, E < kb ? E : kb);
        const float *xb = xt + (int64_t)k0 * ES_VW;
        if (rows_outer) {
            for (int r = 0, rows; r < R; r += rows) {
                rows = ES_SF(es8_tile_rows)(R, r, ES8_XR);
                for (int64_t j0 = 0; j0 < nv; j0 += ES8_XV) {
                    const int V = nv - j0 < ES8_XV ? (int)(nv - j0) : ES8_XV;
                    if (V == ES8_XV) ES_SF(es8_xcase)(rows, wf + (int64_t)r * ws, ws, xb + j0 * ldv, ldv, ES8_XV, kw, part + r * ldp + j0 * ES_VW, ldp, first);
                    else ES_SF(es8_xcase)(rows, wf + (int64_t)r * ws, ws, xb + j0 * ldv, ldv, 1, kw, part + r * ldp + j0 * ES_VW, ldp, first);
                }
            }
        } else {
            for (int64_t j0 = 0; j0 < nv; j0 += ES8_XV) {
                const int V = nv - j0 < ES8_XV ? (int)(nv - j0) : ES8_XV;
                for (int r = 0, rows; r < R; r += rows) {
                    rows = ES_SF(es8_tile_rows)(R, r, V == 1 ? ES8_XR1 : ES8_XR);
                    if (V == ES8_XV) ES_SF(es8_xcase)(rows, wf + (int64_t)r * ws, ws, xb + j0 * ldv, ldv, ES8_XV, kw, part + r * ldp + j0 * ES_VW, ldp, first);
                    else ES_SF(es8_xcase)(rows, wf + (int64_t)r * ws, ws, xb + j0 * ldv, ldv, 1, kw, part + r * ldp + j0 * ES_VW, ldp, first);
                }
            }
        }
    }
    for (int64_t t = 0; t < S; t++)
        for (int r = 0; r < R; r++) y[t * ldy + r] = part[r * ldp + t];
}

/* ---- the gate tail -------------------------------------------------------------------- */

/* es8_gate_tail_plain on vectors: the three sums in double over ES_VW lanes (only their order
 * differs), the rest per stream by the one formula (es8_gate_out). hid: float32, or bfloat16
 * bits (hbf) widened as they are loaded, chosen once per stream. */
typedef uint16_t ES_SF(es8_vh) __attribute__((vector_size(ES_VW * 2), aligned(2)));
typedef uint32_t ES_SF(es8_vu) __attribute__((vector_size(ES_VW * 4), aligned(4)));
ES_KI void ES_SF(es8_gate_sums)(const float *key, const void *hv, const int hbf, const float *a, const float *b,
                                int D, double *s3) {
    typedef ES_SF(es8_vf) vf;
    typedef ES_SF(es8_vd) vd;
    vd vh = {0}, vk = {0}, vt = {0};
    int d = 0;
    for (; d + ES_VW <= D; d += ES_VW) {
        const vf hf = hbf ? (vf)(__builtin_convertvector(*(const ES_SF(es8_vh) *)((const uint16_t *)hv + d),
                                                         ES_SF(es8_vu)) << 16)
                          : *(const vf *)((const float *)hv + d);
        const vd hd = __builtin_convertvector(hf, vd);
        const vd kd = __builtin_convertvector(*(const vf *)(key + d), vd);
        const vf af = *(const vf *)(a + d), bf = *(const vf *)(b + d);
        vh += hd * hd;
        vk += kd * kd;
        vt += ((hd * __builtin_convertvector(af, vd)) * __builtin_convertvector(bf, vd)) * kd;
    }
    double sh = 0, sk = 0, dot = 0;
    for (int i = 0; i < ES_VW; i++) {
        sh += vh[i];
        sk += vk[i];
        dot += vt[i];
    }
    for (; d < D; d++) {
        const float h = hbf ? es_bf16_to_float(((const uint16_t *)hv)[d]) : ((const float *)hv)[d];
        sh += (double)h * h;
        sk += (double)key[d] * key[d];
        dot += (double)h * a[d] * b[d] * key[d];
    }
    s3[0] = sh, s3[1] = sk, s3[2] = dot;
}

static ES_TGT void ES_SF(es8_gate_tail)(const float *kv, const void *hid, int hbf, const float *qw, const float *kw,
                                         int G, int D, float eps, int dead, void *out, int obf) {
    const float *value = kv + (int64_t)G * D;
    for (int c = 0; c < G; c++) {
        const float *key = kv + (int64_t)c * D;
        const float *a = qw + (int64_t)c * D, *b = kw + (int64_t)c * D;
        double s3[3];
        if (hbf) ES_SF(es8_gate_sums)(key, (const uint16_t *)hid + (int64_t)c * D, 1, a, b, D, s3);
        else ES_SF(es8_gate_sums)(key, (const float *)hid + (int64_t)c * D, 0, a, b, D, s3);
        es8_gate_out(s3[0], s3[1], s3[2], value, D, eps, dead, (char *)out + (int64_t)c * D * (obf ? 2 : 4), obf);
    }
}

#undef ES8_NV
#undef ES8_WIDEN_FOLD
#undef ES8_WIDEN_FOLD_I
/* this copy's parameters: the next inclusion defines its own */
#undef ES8_GR
#undef ES8_MG
#undef ES8_XR
#undef ES8_XV
#undef ES8_XR1
#undef ES8_KB
#undef ES8_KB_FEW
#undef ES8_FEW
#undef ES8_XCOLS
#include "engram_path_end.h"
