/* engram_fp8.h: the float8 kernels of the DeepSeek-V4.1 Engram step (DESIGN.md section 4).
 *
 *   es8_e4m3 / es8_e8m0   one float8 byte -> float, exact (e4m3fn 0x7f/0xff and e8m0 0xff: NaN)
 *   es8_gather            a token's H table rows: e4m3 bytes x one e8m0 scale per 32 values
 *   es8_act_quant         the reference's activation quantization, per 32 values:
 *                         s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448))) from the exponent bits,
 *                         q = e4m3(clamp(x / s, +-448)) rounded to nearest even; returns q * s
 *   es8_wkv_mt            Y[S, M] = the fp8 wkv projection of S quantized tokens, 32x32 block
 *                         scales, over threads split by row groups. One token: the weight bytes
 *                         stay float8 and are widened in registers (memory-bound GEMV). Several:
 *                         the rows of a 32-row group are widened to float32 into scratch, k
 *                         block by k block, and every token reads them, the tokens in the
 *                         vector lanes (up to 8 tokens: widened in registers, no copy)
 *   es8_gate_tail         the gate (rstd, eps 1e-20, signed sqrt, sigmoid; 0 at DEAD) times the
 *                         shared value, for the G streams of one token
 *
 * Block-scale numerics: the reference sums each 32-wide block of q*w in fp32 (every product
 * is exact: 4-bit x 4-bit significands) and adds block * s_x * s_w over the blocks. Here the
 * power-of-two scales are folded into the factors first (q * s_x and w * s_w, both exact), so
 * every product is the reference's scaled by a power of two: the same values, only the order
 * of the fp32 additions differs (FMA or multiply then add: the same, the products being exact).
 *
 * Paths: the kernels follow es_isa_now() (engram_isa.h) like the demo's, so ENGRAM_STREAM_ISA and
 * engram_stream.engine.isa.use_isa choose them for both variants. baseline, avx2 and neon are one template
 * (engram_fp8_kern.h): e4m3 widened exactly in registers (avx2: through fp16 bits and F16C,
 * the value times 2^-8 with the 2^8 folded into the block scale; neon: the same fp16 bits by
 * SSHLL and FCVTL; baseline: through float32 bits, portable C that GCC and clang vectorize for
 * SSE2 / NEON). The avx512 path is its own code below (the fp16 widening on 512-bit registers,
 * 16-lane FMAs; 2..8 tokens: the avx2 es8_mgemv); its gathers and quantizer are the avx2 copies
 * (exact: the same bits), its gate tail the plain one. The bf16 path (AVX512_BF16) is the avx512
 * one with the projection on vdpbf16ps (e4m3 widened through byte tables; see its section). The
 * many-token tiles of both, once the rows are widened, are one template (engram_fp8_tiles.h). NaN
 * codes: the fp16 projections (avx2, avx512, neon) read those of wkv (0x7f/0xff) as +-480
 * (checkpoints hold none); the baseline, bf16 and every path's gathers read NaN, as the reference.
 * The *_plain functions are the portable
 * scalar C (the reference of the benchmarks). Nothing here allocates (the caller passes the
 * scratch; thread starts that fail run inline) and nothing fails.
 */
#ifndef ENGRAM_FP8_H
#define ENGRAM_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "engram_consts.h" /* ES_GATE_CLAMP */

#include "engram_isa.h"
#include "engram_step.h" /* es_split, ES_MAX_THREADS */

#if ES_X86_PATHS
#include <immintrin.h>
#define ES8_READ_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define ES8_READ_CLONES
#endif

#define ES8_BLOCK 32          /* values per activation scale, weight block edge, table row scale */
#define ES8_E4M3_MAX 448.0f
#define ES8_AMAX_MIN 1e-4f
#define ES8_XT_MIN 9          /* avx512, bf16: tokens from which they go in the 16 lanes (es8_xtile_avx512); below,
                               * from 2: the avx2 es8_mgemv, es8_mgemv_bf16 (measured faster than widened
                               * rows: 2.6x at 2 tokens, and lanes beat tiles along k from 9 on Zen 5) */
#define ES8_XT_ROWS 12        /* avx512: weight rows per tile of two 16-token vectors (24 accumulators) */
#define ES8_KBLOCK 256        /* avx512: k per block of the many-token projection (its widened rows: L1) */
#define ES8_MAX_THREADS ES_MAX_THREADS
#define ES8_GRAB 4            /* row groups a projection thread takes at a time */
#define ES8_PREFILL_CHUNK 256 /* prompt tokens per projection in prefill (wkv widened once per chunk) */
#define ES8_PREFETCH 512      /* bytes of a weight row requested ahead by the one-token tile */
#define ES8_MAX_E 16384       /* values per token at most: the one-token path keeps a scaled copy on the
                               * stack (64 KiB; threads may have small stacks), the callers check it */
#define ES8_INLINE static inline __attribute__((always_inline))

/* ---- scalars ---------------------------------------------------------------------- */

ES8_INLINE float es8_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
ES8_INLINE uint32_t es8_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities; S.1111.111 is NaN. */
static inline float es8_e4m3(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if ((b & 0x7f) == 0x7f) v = NAN;
    else if (e == 0) v = (float)m * 0x1p-9f;                            /* subnormal m/8 * 2^-6 */
    else v = es8_from_bits((uint32_t)(e + 120) << 23 | (uint32_t)m << 20); /* 2^(e-7) * (1+m/8) */
    return (b & 0x80) ? -v : v;
}

/* float8_e8m0fnu: 2^(b - 127); 0xff is NaN; b = 0 is the float32 subnormal 2^-127. */
static inline float es8_e8m0(uint8_t b) {
    if (b == 0xff) return NAN;
    if (b == 0) return 0x1p-127f;
    return es8_from_bits((uint32_t)b << 23);
}

/* y rounded to the e4m3 grid (nearest, ties to even), saturating at +-448; NaN stays NaN.
 * On the bits, with masks instead of branches or selects (this runs on every activation
 * value, and with masks GCC vectorizes the quantizer's loop): at or above 2^-6 the mantissa
 * is rounded to 3 bits; below, the grid is the multiples of 2^-9, which adding and removing
 * 2^14 rounds to (the float32 ulp of 2^14 is 2^-9; ties to even by the FPU; not folded: no
 * -ffast-math in setup.py). */
static inline float es8_round_e4m3(float y) {
    const uint32_t uy = es8_bits(y), sign = uy & 0x80000000u;
    uint32_t ua = uy & 0x7fffffffu;
    const uint32_t nan = -(uint32_t)(ua > 0x7f800000u), big = -(uint32_t)(ua > 0x43e00000u) & ~nan;
    ua = (ua & ~big) | (0x43e00000u & big);                                 /* 448 */
    const uint32_t sub = es8_bits((es8_from_bits(ua) + 0x1p14f) - 0x1p14f);
    const uint32_t nrm = (ua + 0x7ffffu + ((ua >> 20) & 1u)) & 0xfff00000u;
    const uint32_t n = -(uint32_t)(ua >= 0x3c800000u) & ~nan;               /* 2^-6 */
    return es8_from_bits((nrm & n) | (sub & ~n & ~nan) | (ua & nan) | sign);
}

/* The activation scale of a block with max |x| = amax, as the reference's fast_round_scale:
 * x = max(amax, 1e-4) * float32(1/448), then 2^(exponent + (mantissa != 0)). */
static inline float es8_act_scale(float amax) {
    const float x = (amax > ES8_AMAX_MIN ? amax : ES8_AMAX_MIN) * (float)(1.0 / 448.0);
    const uint32_t u = es8_bits(x);
    const int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + ((u & 0x7fffff) != 0);
    return es8_from_bits((uint32_t)(e + 127) << 23);
}

/* ---- plain scalar C: the reference of the vector paths (and the avx512 gate tail) ------------ */

/* e[j*hd + i] = e4m3(w[rows[j]][i]) * e8m0(sc[rows[j]][i/32]) (exact in float32). hd % 32 == 0. */
static inline void es8_gather_plain(const uint8_t *w, const uint8_t *sc, int hd, const int64_t *rows, int H,
                                    float *e) {
    const int nb = hd / ES8_BLOCK;
    for (int j = 0; j < H; j++) {
        const uint8_t *src = w + rows[j] * hd, *s = sc + rows[j] * nb;
        float *dst = e + (int64_t)j * hd;
        for (int b = 0; b < nb; b++) {
            const float f = es8_e8m0(s[b]);
            for (int i = 0; i < ES8_BLOCK; i++) dst[b * ES8_BLOCK + i] = es8_e4m3(src[b * ES8_BLOCK + i]) * f;
        }
    }
}

/* x quantized per 32 values: qx[n] = e4m3(x / s) * s (exact), s[n/32] the scales. */
static inline void es8_act_quant_plain(const float *x, int n, float *qx, float *s) {
    for (int b = 0; b < n / ES8_BLOCK; b++) {
        const float *xb = x + b * ES8_BLOCK;
        uint32_t amax = 0;   /* the bits of max |x|: as integers a NaN wins, as in torch's amax */
        for (int i = 0; i < ES8_BLOCK; i++) {
            const uint32_t a = es8_bits(xb[i]) & 0x7fffffffu;
            amax = a > amax ? a : amax;
        }
        const float sb = es8_act_scale(es8_from_bits(amax));
        s[b] = sb;
        for (int i = 0; i < ES8_BLOCK; i++) qx[b * ES8_BLOCK + i] = es8_round_e4m3(xb[i] / sb) * sb;
    }
}

/* Y[t*M + r] = sum_k e4m3(W[r*E + k]) * e8m0(WS[r/32][k/32]) * qx[t*ldq + k] for all rows and
 * S tokens, one scalar multiply-add at a time through a table of the 256 codes: what plain C
 * does (bench_v41.py holds the vector paths to it). */
static inline void es8_wkv_plain(const float *qx, int64_t ldq, int64_t S, int E, const uint8_t *W,
                                 const uint8_t *WS, int M, float *Y) {
    float lut[256];
    for (int c = 0; c < 256; c++) lut[c] = es8_e4m3((uint8_t)c);
    const int nb = E / ES8_BLOCK;
    for (int64_t t = 0; t < S; t++)
        for (int64_t r = 0; r < M; r++) {
            const uint8_t *wr = W + r * E, *ws = WS + (r / ES8_BLOCK) * nb;
            const float *q = qx + t * ldq;
            float sum = 0.0f;
            for (int b = 0; b < nb; b++) {
                const float f = es8_e8m0(ws[b]);
                for (int i = b * ES8_BLOCK; i < (b + 1) * ES8_BLOCK; i++) sum += lut[wr[i]] * f * q[i];
            }
            Y[t * M + r] = sum;
        }
}

/* ---- the gate tail ------------------------------------------------------------------- */

/* One token. kv [(G+1)*D]: the key of stream c at c*D, the shared value at G*D.
 * Stream c: rstd = rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps),
 * dot = sum(h * qw[c] * kw[c] * key) * rstd / sqrt(D),
 * gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), 0 when dead; out = gate * value.
 * Sums in double (D up to a few thousand: the float32 rounding of the oracle is below 1e-6). */
/* Stream c's output from its three sums (sh = sum h^2, sk = sum key^2, dot): the formula above,
 * every path's (they differ only in how they sum). */
static inline void es8_gate_out(double sh, double sk, double dot, const float *value, int D, float eps, int dead,
                                void *o, int obf) {
    const float rstd = (1.0f / sqrtf((float)(sh / D) + eps)) * (1.0f / sqrtf((float)(sk / D) + eps));
    const float s = (float)dot * rstd / sqrtf((float)D);
    const float mag = fabsf(s) < ES_GATE_CLAMP ? ES_GATE_CLAMP : fabsf(s);  /* NaN stays NaN */
    const float z = copysignf(sqrtf(mag), s);
    const float gate = dead ? 0.0f : 1.0f / (1.0f + expf(-z));
    if (obf) es_floats_to_bf16_scaled(value, gate, D, (uint16_t *)o); /* the float32 product, rounded */
    else for (int d = 0; d < D; d++) ((float *)o)[d] = gate * value[d];
}

/* hid / out: float32, or bfloat16 bits where hbf / obf (engram_step.h), chosen once per stream. */
static inline __attribute__((always_inline)) void es8_gate_sums_plain(const float *key, const void *hv, int hbf,
                                                                      const float *a, const float *b, int D,
                                                                      double *s3) {
    double sh = 0, sk = 0, dot = 0;
    for (int d = 0; d < D; d++) {
        const float hd = hbf ? es_bf16_to_float(((const uint16_t *)hv)[d]) : ((const float *)hv)[d];
        sh += (double)hd * hd;
        sk += (double)key[d] * key[d];
        dot += (double)hd * a[d] * b[d] * key[d];
    }
    s3[0] = sh, s3[1] = sk, s3[2] = dot;
}

static inline void es8_gate_tail_plain(const float *kv, const void *hid, int hbf, const float *qw, const float *kw,
                                       int G, int D, float eps, int dead, void *out, int obf) {
    const float *value = kv + (int64_t)G * D;
    for (int c = 0; c < G; c++) {
        const float *key = kv + (int64_t)c * D;
        const float *a = qw + (int64_t)c * D, *b = kw + (int64_t)c * D;
        double s3[3];
        if (hbf) es8_gate_sums_plain(key, (const uint16_t *)hid + (int64_t)c * D, 1, a, b, D, s3);
        else es8_gate_sums_plain(key, (const float *)hid + (int64_t)c * D, 0, a, b, D, s3);
        es8_gate_out(s3[0], s3[1], s3[2], value, D, eps, dead, (char *)out + (int64_t)c * D * (obf ? 2 : 4), obf);
    }
}

/* ---- vdpbf16ps, emulated: the reference of the bf16 path -------------------------------------- */

/* One fp32 lane of vdpbf16ps as Intel documents it (SDM: VDPBF16PS) and as measured on AMD Zen
 * 5: acc += a1*b1, rounded to nearest even, then += a0*b0, rounded again (the odd pair first;
 * each step fused: the product exact), inputs (the bf16 factors and acc) that are denormal
 * read as zero of their sign, a denormal result of either step flushed to zero of its sign;
 * MXCSR neither read nor written. NaN: a NaN (x86 keeps the first NaN operand's payload; only
 * NaN-ness is part of this reference). */
static inline float es8_flush(float x) {
    const uint32_t u = es8_bits(x);
    return (u & 0x7f800000u) ? x : es8_from_bits(u & 0x80000000u);
}
static inline float es8_dpbf16_lane(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
#define ES8_BF(h) es8_flush(es8_from_bits((uint32_t)(h) << 16))
    float t = es8_flush(acc);
    t = es8_flush(fmaf(ES8_BF(a1), ES8_BF(b1), t));
    t = es8_flush(fmaf(ES8_BF(a0), ES8_BF(b0), t));
#undef ES8_BF
    return t;
}

/* ---- the vector paths: one template per instruction set (engram_fp8_kern.h) --------------- */

/* xt[(t/lanes)*E*lanes + k*lanes + t%lanes] = qx[t*ldq + k]: the tokens packed `lanes` per
 * vector, k-major, the lanes past S zero. */
static inline void es8_pack_tokens(const float *qx, int64_t ldq, int64_t S, int E, float *xt, int lanes) {
    const int64_t nv = (S + lanes - 1) / lanes;
    memset(xt + (nv - 1) * E * lanes, 0, sizeof(float) * E * lanes);
    for (int64_t t = 0; t < S; t++) {
        float *dst = xt + (t / lanes) * E * lanes + t % lanes;
        for (int k = 0; k < E; k++) dst[k * lanes] = qx[t * ldq + k];
    }
}

#define ES8_KB_MAX 512 /* the largest ES8_KB, ES8_KB_FEW below (the scratch holds one of its blocks) */
#define ES_PATH ES_ISA_BASELINE /* 16-byte vectors: SSE2 / NEON; 6 rows x 2 vectors = 12 accumulators */
#define ES8_GR 2
#define ES8_MG 8
#define ES8_XR 6
#define ES8_XV 2
#define ES8_XR1 12
#define ES8_KB 256
#define ES8_KB_FEW 512
#define ES8_FEW 32
#define ES8_XCOLS 2
#include "engram_fp8_kern.h"
#if ES_X86_PATHS
#define ES_PATH ES_ISA_AVX2 /* 6 rows x 2 vectors of 8 tokens = 12 ymm accumulators */
#define ES8_GR 4
#define ES8_MG 8
#define ES8_XR 6
#define ES8_XV 2
#define ES8_XR1 12
#define ES8_KB 256
#define ES8_KB_FEW 512
#define ES8_FEW 32
#define ES8_XCOLS 2
#include "engram_fp8_kern.h"
#endif
#if ES_NEON_PATHS
#define ES_PATH ES_ISA_NEON /* 32 registers: the GEMV 2 rows at once (4 spill: bench/inner_loops.py); tiles
                             * of 8 rows x 2 token vectors */
#define ES8_GR 2
#define ES8_MG 8
#define ES8_XR 8
#define ES8_XV 2
#define ES8_XR1 12
#define ES8_KB 256
#define ES8_KB_FEW 512
#define ES8_FEW 32
#define ES8_XCOLS 2
#include "engram_fp8_kern.h"
#endif

/* ---- the avx512 path ----------------------------------------------------------------------- */

#if ES_X86_PATHS
_Static_assert(ES8_XT_MIN - 1 <= es8_mg_avx2, "avx512 runs the avx2 es8_mgemv below ES8_XT_MIN tokens");
#endif

#if ES_X86_PATHS
/* 16 e4m3 bytes -> 16 floats equal to value * 2^-8 (see the top of this file). */
ES8_INLINE ES_TARGET_AVX512 __m512 es8_widen16(const uint8_t *p) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_cvtph_ps(h);
}

/* One token, R rows (a constant at each call site) over all k: R weight streams in flight
 * (memory-bound), each row prefetched ES8_PREFETCH bytes ahead, 32 bytes widened at a time
 * (one 512-bit sign-extend/shift/mask for two fp16->float32 conversions: measured 5-8% less
 * time per step than 16 at a time). qs carries the block scales (times 2^8). y[r] = the sums. */
ES8_INLINE ES_TARGET_AVX512 void es8_gemv512(const uint8_t *w, const int R, const float *qs, int E, float *y) {
    __m512 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < E; k += 32) {  /* 32 bytes of a row: es8_widen16 on 512-bit registers */
        const __m512 q0 = _mm512_loadu_ps(qs + k), q1 = _mm512_loadu_ps(qs + k + 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (int64_t)r * E + k;
            if (!(k & 63)) _mm_prefetch((const char *)(p + ES8_PREFETCH), _MM_HINT_T0);
            __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
            h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xbf80));
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), q0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), q1, acc[r][1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* R rows of wkv widened to float32 once, block scales folded in (wsf carries the 2^8 of the
 * widening), laid out k block by k block: the block at k0 at wf + 32*k0, its row r at
 * + r*ES8_KBLOCK (the last block padded). So the rows of a block are contiguous (no two at a
 * 4 KiB stride: they would share L1 sets) and a tile addresses them with one register. */
static ES_TARGET_AVX512 void es8_widen_rows(const uint8_t *w, int R, int E, const float *wsf, float *wf) {
    for (int k0 = 0; k0 < E; k0 += ES8_KBLOCK) {
        const int kw = E - k0 < ES8_KBLOCK ? E - k0 : ES8_KBLOCK;
        for (int64_t r = 0; r < R; r++) {
            float *dst = wf + (int64_t)ES8_BLOCK * k0 + r * ES8_KBLOCK;
            for (int k = 0; k < kw; k += 32) {
                const __m512 f = _mm512_set1_ps(wsf[(k0 + k) >> 5]);
                const uint8_t *src = w + r * E + k0 + k;
                _mm512_storeu_ps(dst + k, _mm512_mul_ps(es8_widen16(src), f));
                _mm512_storeu_ps(dst + k + 16, _mm512_mul_ps(es8_widen16(src + 16), f));
            }
        }
    }
}

/* The tiles with tokens in the lanes (ES8_XT_MIN tokens or more): es8_xtile_avx512, es8_tiles_avx512. */
#define ES_PATH ES_ISA_AVX512
#define ES8_KPU 1
#define ES8_KPAD 1
#define ES8_TW float
#define ES8_TX float
#define ES8_XLOAD(p) _mm512_loadu_ps(p)
#define ES8_WB(p) _mm512_set1_ps(*(p))
#define ES8_MAC(acc, x, wb) _mm512_fmadd_ps(wb, x, acc)
#include "engram_fp8_tiles.h"

/* One group of R <= 32 rows for S tokens (S = 1 or S >= ES8_XT_MIN; qx rows at stride ldq;
 * xt: the same packed by es8_pack_tokens). One token: a GEMV straight from the float8 bytes,
 * the block scales folded into the activation once. Several: the rows widened once into
 * scratch, then over k blocks of ES8_KBLOCK (a block of widened rows, 32 KiB, and a token
 * tile stay in L1) tiles of tokens in the lanes. */
static ES_TARGET_AVX512 void es8_group_avx512(const uint8_t *w, int R, const float *qx, int64_t ldq, const float *xt,
                                      int64_t S, int E, const float *wsf, float *y, int64_t ldy, float *scratch,
                                      const uint8_t *next, int64_t nnext) {
    if (S == 1) {
        float qs[E] __attribute__((aligned(64)));
        for (int k = 0; k < E; k += 16)
            _mm512_store_ps(qs + k, _mm512_mul_ps(_mm512_loadu_ps(qx + k), _mm512_set1_ps(wsf[k >> 5])));
        int r = 0;
        for (; r + 4 <= R; r += 4) es8_gemv512(w + (int64_t)r * E, 4, qs, E, y + r);
        for (; r < R; r++) es8_gemv512(w + (int64_t)r * E, 1, qs, E, y + r);
        return;
    }
    float *wf = scratch, *part = scratch + (int64_t)ES8_BLOCK * (E + ES8_KBLOCK);
    es8_widen_rows(w, R, E, wsf, wf);
    /* the next group's bytes are requested while these rows compute, so its widening reads L2
     * (measured: 5% at 16 tokens) */
    es8_tiles_avx512(wf, R, xt, S, E, 0, E, part, y, ldy, next, nnext);
}
#endif


/* ---- the bf16 path (AVX512_BF16 + VBMI) -------------------------------------------------------
 * Every e4m3 value is a normal bf16 (the subnormals m * 2^-9 too), and so is every quantized
 * activation (an e4m3 value times a power of two >= 2^-22): widened exactly, their products in
 * vdpbf16ps are exact and only the fp32 additions differ from the avx512 path: in pairs, the odd
 * k of a pair first, each rounded (es8_dpbf16_lane). Widening: two 128-byte tables (the bf16
 * bits of the 128 magnitudes, low and high bytes) through vpermt2b, the sign or-ed in; the
 * NaN codes read NaN, as the oracle. The block scales are folded in as on the avx512 path
 * (one token: into the activation, s_x * s_w; several: s_x into the activation, s_w into the
 * widened rows, on float32 and back, exact): so the one difference in value from the
 * reference is DAZ/FTZ: a folded factor or a sum below 2^-126 reads as zero (the reference
 * keeps float32 subnormals; with real scales nothing comes near). The widening leaves the 64
 * values of a chunk in the order of the unpacks (es8_bf16_pos); the activations are laid out
 * the same, and a pair of the dot product is two neighbouring positions. */

/* Where value k lands: the unpacks interleave within 128-bit lanes, so a 64-value chunk holds
 * k = 0-7, 16-23, 32-39, 48-55, then 8-15, 24-31, 40-47, 56-63. */
static inline int es8_bf16_pos(int k) {
    const int j = k & 15, lane = (k >> 4) & 3;
    return (k & ~63) + (j < 8 ? 8 * lane + j : 32 + 8 * lane + j - 8);
}

/* fp8_linear(cols=): 1 or 0 forces the bf16 columns tile (below) on or off, -1 the rule; every
 * build declares it (the v41 extension sets it), only the x86 bf16 path reads it. */
static int es8_cols_mode __attribute__((unused)) = -1;

#if ES_X86_PATHS
#define ES8_GR_BF16 8 /* rows the one-token GEMV streams at once (measured: 0.84x the time of 4 on Zen 5) */

/* The bf16 bits of e4m3 magnitudes 0..127: low bytes, then high bytes (0x7f: NaN 0x7fc0). */
static const uint8_t es8_bf16_tab[256] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10,
    0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10, 0x20, 0x30,
    0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50,
    0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70,
    0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90,
    0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0,
    0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0,
    0xe0, 0xc0,
    0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3d, 0x3d,
    0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3e, 0x3e, 0x3e, 0x3e,
    0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f,
    0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x42, 0x42, 0x42, 0x42, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43,
    0x43, 0x7f
};

ES8_INLINE ES_TARGET_BF16 void es8_bf16_tables(__m512i t[4]) {
    for (int i = 0; i < 4; i++) t[i] = _mm512_load_si512((const void *)(es8_bf16_tab + 64 * i));
}

/* 64 e4m3 bytes -> 64 bf16 in two vectors (the order of es8_bf16_pos), exact. */
ES8_INLINE ES_TARGET_BF16 void es8_widen64_bf16(__m512i x, const __m512i t[4], __m512i *a, __m512i *b) {
    const __m512i lo = _mm512_permutex2var_epi8(t[0], x, t[1]);  /* 7 index bits: the magnitude */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t[2], x, t[3]), x,
                                                 _mm512_set1_epi8((char)0x80), 0xf8);  /* | x & 0x80 */
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}

/* The bytes of a row chunk at p: 64, or the last 32 of a row (the rest read as code 0). */
ES8_INLINE ES_TARGET_BF16 __m512i es8_load64(const uint8_t *p, int full) {
    return full ? _mm512_loadu_si512((const void *)p) : _mm512_maskz_loadu_epi8(0xffffffffull, p);
}

/* dst[es8_bf16_pos(k)] = bf16(x[k] * f[k / 32]) (f NULL: 1) for k < E, zero up to E rounded up
 * to 64. The values are e4m3 values times powers of two: exact (denormal ones read 0: DAZ). */
static ES_TARGET_BF16 void es8_bf16_act(const float *x, int E, const float *f, uint16_t *dst) {
    const __m512i ia = _mm512_setr_epi32(0x10000, 0x30002, 0x50004, 0x70006, 0x110010, 0x130012, 0x150014,
                                         0x170016, 0x210020, 0x230022, 0x250024, 0x270026, 0x310030, 0x330032,
                                         0x350034, 0x370036);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(8));
    for (int k = 0; k < E; k += 64) {
        const int full = E - k >= 64;
        __m512 v[4];
        for (int i = 0; i < 4; i++) v[i] = full || i < 2 ? _mm512_loadu_ps(x + k + 16 * i) : _mm512_setzero_ps();
        if (f) {
            const __m512 f0 = _mm512_set1_ps(f[k >> 5]), f1 = full ? _mm512_set1_ps(f[(k >> 5) + 1]) : f0;
            v[0] = _mm512_mul_ps(v[0], f0), v[1] = _mm512_mul_ps(v[1], f0);
            v[2] = _mm512_mul_ps(v[2], f1), v[3] = _mm512_mul_ps(v[3], f1);
        }
        const __m512i w01 = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]), w23 = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
        _mm512_storeu_si512((void *)(dst + k), _mm512_permutex2var_epi16(w01, ia, w23));
        _mm512_storeu_si512((void *)(dst + k + 32), _mm512_permutex2var_epi16(w01, ib, w23));
    }
}

/* One token, R rows (a constant at each call site, up to ES8_GR_BF16): the GEMV of es8_gemv512
 * on bf16, the weights widened by the tables, qs the activation with both scales (es8_bf16_act). */
ES8_INLINE ES_TARGET_BF16 void es8_gemv_bf16(const uint8_t *w, const int R, const uint16_t *qs, int E, float *y,
                                        const __m512i t[4]) {
    __m512 acc[ES8_GR_BF16][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < E; k += 64) {
        const int full = E - k >= 64;
        const __m512bh qa = (__m512bh)_mm512_loadu_si512((const void *)(qs + k));
        const __m512bh qb = (__m512bh)_mm512_loadu_si512((const void *)(qs + k + 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (int64_t)r * E + k;
            _mm_prefetch((const char *)(p + ES8_PREFETCH), _MM_HINT_T0);
            __m512i a, b;
            es8_widen64_bf16(es8_load64(p, full), t, &a, &b);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)a, qa);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)b, qb);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* The 128 e4m3 magnitudes as float32 (the plain tables' bf16 bits). */
ES8_INLINE ES_TARGET_BF16 void es8_bf16_mag(__m512 mag[8]) {
    for (int i = 0; i < 8; i++) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(es8_bf16_tab + 16 * i)));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(es8_bf16_tab + 128 + 16 * i)));
        mag[i] = _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(hi, 24), _mm512_slli_epi32(lo, 16)));
    }
}

/* The tables of es8_widen64_bf16 for the e4m3 magnitudes times the block scale s: the high
 * half of the float32 product (exact for e4m3 values times powers of two; a denormal one keeps
 * its high bits, read as zero by vdpbf16ps), the sign or-ed in after as for the plain tables.
 * mag: the 128 magnitudes as float32 (es8_bf16_mag). */
ES8_INLINE ES_TARGET_BF16 void es8_bf16_tables_scaled(const __m512 mag[8], float s, __m512i t[4]) {
    const __m512 sv = _mm512_set1_ps(s);
    __m128i lo[8], hi[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(mag[i], sv)), 16);
        lo[i] = _mm512_cvtepi32_epi8(u), hi[i] = _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8));
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512i a = _mm512_castsi128_si512(lo[4 * h]), b = _mm512_castsi128_si512(hi[4 * h]);
        a = _mm512_inserti32x4(a, lo[4 * h + 1], 1), b = _mm512_inserti32x4(b, hi[4 * h + 1], 1);
        a = _mm512_inserti32x4(a, lo[4 * h + 2], 2), b = _mm512_inserti32x4(b, hi[4 * h + 2], 2);
        t[h] = _mm512_inserti32x4(a, lo[4 * h + 3], 3), t[2 + h] = _mm512_inserti32x4(b, hi[4 * h + 3], 3);
    }
}

/* es8_widen_rows on bf16: R rows (ldw bytes apart) widened, times their block scales (wsf), k
 * block by k block: the block at k0 at wb + 32*k0, its row r at + r*ES8_KBLOCK (bf16 in
 * es8_bf16_pos order, a last block's tail zero to a multiple of 64). The scales are folded
 * into the tables (those of a 64-value chunk's two blocks, built once for all R rows; the
 * halves blended), not multiplied per value: 0.74x the time per value in L1 on Zen 4. */
static ES_TARGET_BF16 void es8_widen_rows_bf16(const uint8_t *w, int64_t ldw, int R, int E, const float *wsf,
                                               uint16_t *wb) {
    __m512 mag[8];
    es8_bf16_mag(mag);
    const __mmask64 upper = 0xffffffff00000000ull;
    for (int k0 = 0; k0 < E; k0 += ES8_KBLOCK) {
        const int kw = E - k0 < ES8_KBLOCK ? E - k0 : ES8_KBLOCK;
        uint16_t *dst = wb + (int64_t)ES8_BLOCK * k0;
        for (int k = 0; k < kw; k += 64) {
            const int full = kw - k >= 64, b0 = (k0 + k) >> 5;
            __m512i ta[4], tb[4];
            es8_bf16_tables_scaled(mag, wsf[b0], ta);
            if (full) es8_bf16_tables_scaled(mag, wsf[b0 + 1], tb);
            else memcpy(tb, ta, sizeof ta);  /* the last 32 values: their code 0 reads 0 */
            for (int64_t r = 0; r < R; r++) {
                const __m512i x = es8_load64(w + r * ldw + k0 + k, full);
                const __m512i lo = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(ta[0], x, ta[1]),
                                                          _mm512_permutex2var_epi8(tb[0], x, tb[1]));
                const __m512i h = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(ta[2], x, ta[3]),
                                                         _mm512_permutex2var_epi8(tb[2], x, tb[3]));
                const __m512i hi = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi8((char)0x80), 0xf8);
                _mm512_storeu_si512((void *)(dst + r * ES8_KBLOCK + k), _mm512_unpacklo_epi8(lo, hi));
                _mm512_storeu_si512((void *)(dst + r * ES8_KBLOCK + k + 32), _mm512_unpackhi_epi8(lo, hi));
            }
        }
    }
}

/* 2..8 tokens (T, a constant at each call site), R = 1 or 2 rows: each 64 bytes of a row
 * widened once in registers (the tables) and multiplied with every token's 64 values (qs: T
 * rows of es8_bf16_act with both scales, ldq apart): no widened copy, so few tokens stay as
 * memory-bound as the one-token GEMV (as the avx2 es8_mgemv). y[t*ldy + r]. */
ES8_INLINE ES_TARGET_BF16 void es8_mgemv_bf16(const uint8_t *w, const int R, const uint16_t *qs, int64_t ldq,
                                         const int T, int E, float *y, int64_t ldy, const __m512i t[4]) {
    __m512 acc[2][8];
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < T; j++) acc[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < E; k += 64) {
        const int full = E - k >= 64;
        __m512i a[2], b[2];
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + (int64_t)r * E + k;
            _mm_prefetch((const char *)(p + ES8_PREFETCH), _MM_HINT_T0);
            es8_widen64_bf16(es8_load64(p, full), t, &a[r], &b[r]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < T; j++) {
            const __m512bh qa = (__m512bh)_mm512_loadu_si512((const void *)(qs + j * ldq + k));
            const __m512bh qb = (__m512bh)_mm512_loadu_si512((const void *)(qs + j * ldq + k + 32));
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
                acc[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][j], (__m512bh)a[r], qa), (__m512bh)b[r], qb);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < T; j++) y[j * ldy + r] = _mm512_reduce_add_ps(acc[r][j]);
}

/* A pair of bf16 weights (positions 2p, 2p + 1 of a widened row) broadcast to 16 lanes. */
ES8_INLINE ES_TARGET_BF16 __m512bh es8_pair16(const uint32_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);  /* (the rows are uint16_t: no uint32_t access) */
    return (__m512bh)_mm512_set1_epi32((int)u);
}

/* The tiles on bf16 (es8_xtile_bf16, es8_tiles_bf16): a unit is a pair of positions, each row's
 * pair broadcast into a vdpbf16ps with the 16 tokens' pairs (32 multiply-adds an instruction);
 * the tokens packed by es8_bf16_tokens. */
#define ES_PATH ES_ISA_BF16
#define ES8_KPU 2
#define ES8_KPAD 64
#define ES8_TW uint32_t
#define ES8_TX uint32_t
#define ES8_XLOAD(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
#define ES8_WB(p) es8_pair16(p)
#define ES8_MAC(acc, x, wb) _mm512_dpbf16_ps(acc, x, wb)
#include "engram_fp8_tiles.h"

/* Rows of es8_bf16_act (2..8 tokens, per group) are this many bf16 apart: E rounded up to 64
 * and a line (E * 2 bytes is often a multiple of 4 KiB: the rows would share L1 sets). */
static inline int64_t es8_bf16_ldb(int E) { return (int64_t)((E + 63) & ~63) + 32; }

/* The tokens of a call (S >= ES8_XT_MIN) in bf16 packed for the lanes: [S/16][E64/2 pairs][16]
 * dwords of two bf16 (positions of es8_bf16_pos), the lanes past S zero. */
static ES_TARGET_BF16 void es8_bf16_tokens(const float *qx, int64_t ldq, int64_t S, int E, uint16_t *xb) {
    const int64_t np = (E + 63) / 64 * 32, nv = (S + 15) / 16;
    uint32_t *xt = (uint32_t *)xb;
    uint16_t row[es8_bf16_ldb(E)] __attribute__((aligned(64)));
    memset(xt + (nv - 1) * np * 16, 0, sizeof(uint32_t) * np * 16);
    for (int64_t t = 0; t < S; t++) {
        es8_bf16_act(qx + t * ldq, E, 0, row);
        uint32_t *dst = xt + (t / 16) * np * 16 + t % 16;
        for (int64_t p = 0; p < np; p++) memcpy(dst + p * 16, row + 2 * p, 4);
    }
}

/* ---- the bf16 columns tile: weight rows in the lanes --------------------------------------
 * The tokens-in-lanes tile above broadcasts a weight pair into the vdpbf16ps of one or two
 * vectors of 16 tokens: 9 to 15 tokens leave 7 to 1 lanes of 16 idle. Here, as the bf16 GEMM
 * of engram_step.h (es_gemm_range_dp), the 32 rows of a group are the lanes of two vectors
 * and a token's pair is broadcast into both: 8 tokens x 2 vectors, 16 vdpbf16ps for 8
 * broadcasts and two loads, no lane idle at any token count. The rows are widened k block by
 * k block (the factors of es8_widen_rows_bf16) and turned into columns in registers (16 x 16
 * dwords of float8 bytes per 64 values of 16 rows); every lane sums its pairs in the order of
 * a token lane of the lanes tile (the pairs of es8_bf16_pos, one after another, from zero),
 * so both give the same bits and the choice between them is speed only (es8_cols_for). The
 * transpose makes its widening dearer. Measured on Zen 4 (bf16 path, 2048 x 6144, one thread,
 * the best of 8 CPU-time runs, a shared machine): faster where a vector of 16 tokens would be
 * part-filled (9: 2.50 against 2.90 ms; 12: 2.50/2.94; 17: 3.43/5.02; 24: 4.20/5.32), not
 * where all are full (16: 3.11/2.95; 32: 5.12/5.07). */
#define ES8_CT_MR 8  /* tokens per columns tile: 8 x 2 vectors = 16 accumulators */

/* Whether S tokens run on the columns tile: S >= 2 where forced on, else from ES8_XT_MIN
 * tokens where a vector of 16 would be part-filled. */
static inline int es8_cols_for(int64_t S) {
    if (S < 2 || !es8_cols_mode) return 0;
    return es8_cols_mode > 0 || (S >= ES8_XT_MIN && S % 16 != 0);
}

/* Pairs of bf16 per token row of es8_bf16_act: E rounded up to 64, halved. */
static inline int64_t es8_bf16_np(int E) { return (int64_t)(E + 63) / 64 * 32; }

/* r[i] lane j -> r[j] lane i for 16 vectors of 16 dwords. */
ES8_INLINE ES_TARGET_BF16 void es8_transpose16(__m512i r[16]) {
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 16; i += 8)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* A group's R <= 32 rows (ldw bytes apart; E values: a k block) widened into columns: the pair
 * p (es8_bf16_pos pairs; np per row) of rows 16c .. 16c + 15 at wc + (c*np + p)*16, a dword a
 * row; rows past R zero. The same bf16 factors as es8_widen_rows_bf16. Per 64 values of 16
 * rows: the float8 dwords transposed (16 x 16, a dword = 4 values of a row), each column
 * widened by the tables of its block scale, then its two pairs split out. */
static ES_TARGET_BF16 void es8_widen_cols_bf16(const uint8_t *w, int64_t ldw, int R, int E, const float *wsf,
                                               uint32_t *wc) {
    const int64_t np = es8_bf16_np(E);
    __m512 mag[8];
    es8_bf16_mag(mag);
    /* a widened column: rows 4L, 4L+1 in lane L of a, 4L+2, 4L+3 of b, each row's two pairs
     * neighbours: these pick pair 0 (1: idx + 1) of rows 0..15 */
    const __m512i idx = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30);
    const __m512i one = _mm512_set1_epi32(1);
    int slot[32];  /* where the natural pair q of a 64-value chunk goes (es8_bf16_pos) */
    for (int q = 0; q < 32; q++) slot[q] = es8_bf16_pos(2 * q) / 2;
    for (int k = 0; k < E; k += 64) {
        const int full = E - k >= 64, b0 = k >> 5;
        __m512i tb[2][4];
        es8_bf16_tables_scaled(mag, wsf[b0], tb[0]);
        if (full) es8_bf16_tables_scaled(mag, wsf[b0 + 1], tb[1]);
        else memcpy(tb[1], tb[0], sizeof tb[0]);  /* the last 32 values: their code 0 reads 0 */
        for (int c = 0; c < 2; c++) {
            __m512i v[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                v[i] = 16 * c + i < R ? es8_load64(w + (int64_t)(16 * c + i) * ldw + k, full) : _mm512_setzero_si512();
            es8_transpose16(v);
            uint32_t *dst = wc + (c * np + k / 2) * 16;
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {  /* column j: values k + 4j .. k + 4j + 3 of the 16 rows */
                __m512i a, b;
                es8_widen64_bf16(v[j], tb[j >> 3], &a, &b);
                _mm512_storeu_si512((void *)(dst + slot[2 * j] * 16), _mm512_permutex2var_epi32(a, idx, b));
                _mm512_storeu_si512((void *)(dst + slot[2 * j + 1] * 16),
                                    _mm512_permutex2var_epi32(a, _mm512_add_epi32(idx, one), b));
            }
        }
    }
}

/* The tokens of a call (es8_cols_for(S)) as pairs for the columns tile: the S/8 full tiles
 * [tile][np][8] dwords, then the rest [np][S % 8] (es8_bf16_pos pairs, s_x only). */
static ES_TARGET_BF16 void es8_bf16_cols_tokens(const float *qx, int64_t ldq, int64_t S, int E, uint32_t *xq) {
    const int64_t np = es8_bf16_np(E);
    uint16_t row[es8_bf16_ldb(E)] __attribute__((aligned(64)));
    for (int64_t t = 0; t < S; t++) {
        es8_bf16_act(qx + t * ldq, E, 0, row);
        const int64_t b0 = t / ES8_CT_MR * ES8_CT_MR, mr = S - b0 < ES8_CT_MR ? S - b0 : ES8_CT_MR;
        uint32_t *q = xq + b0 * np + (t - b0);
        for (int64_t p = 0; p < np; p++) memcpy(q + p * mr, row + 2 * p, 4);
    }
}

/* mr tokens (pairs at xq, token r's pair p at xq[p*mr + r]) x the group's two column vectors
 * over the np pairs of a k block (wc: es8_widen_cols_bf16's); the sums carried in part[r*32 +
 * c] from block to block (first: from zero), after the last (y non-NULL) y[r*ldy + c] for the
 * R valid rows c. pf: npf bytes of the next group, a line a pair requested (its widening then
 * reads L2), or NULL. */
ES8_INLINE ES_TARGET_BF16 void es8_ctile_bf16(const uint32_t *xq, const uint32_t *wc, int64_t np, const int mr,
                                             float *part, int first, float *y, int64_t ldy, int R, const uint8_t *pf,
                                             int64_t npf) {
    __m512 acc[ES8_CT_MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * 32);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * 32 + 16);
    }
    const int64_t npl = pf ? (npf + 63) / 64 : 0;
    for (int64_t p = 0; p < np; p++) {
        if (p < npl) _mm_prefetch((const char *)pf + p * 64, _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wc + p * 16));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wc + (np + p) * 16));
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xq[p * mr + r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    if (!y) {
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            _mm512_storeu_ps(part + r * 32, acc[r][0]);
            _mm512_storeu_ps(part + r * 32 + 16, acc[r][1]);
        }
        return;
    }
    const __mmask16 m0 = R >= 16 ? 0xffff : (__mmask16)((1u << R) - 1);
    const __mmask16 m1 = R >= 32 ? 0xffff : R <= 16 ? 0 : (__mmask16)((1u << (R - 16)) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
    }
}

/* One group on the columns tile, k block by k block (ES8_KBLOCK): the block's rows widened into
 * columns in scratch (16 KiB: it stays in L1), then the tokens (xq: es8_bf16_cols_tokens) 8 at
 * a time, the rest as one smaller tile, their sums carried in scratch after the block. */
static ES_TARGET_BF16 void es8_cols_bf16(const uint8_t *w, int R, const uint32_t *xq, int64_t S, int E,
                                         const float *wsf, float *y, int64_t ldy, float *scratch, const uint8_t *next,
                                         int64_t nnext) {
    const int64_t np = es8_bf16_np(E);
    uint32_t *wc = (uint32_t *)scratch;
    float *part = scratch + (int64_t)ES8_BLOCK * (E + ES8_KBLOCK);  /* [S][32] */
    const int nkb = (E + ES8_KBLOCK - 1) / ES8_KBLOCK;
    const int64_t pfb = (nnext + nkb - 1) / nkb;  /* the next group's bytes requested over each block */
    for (int kb = 0; kb < nkb; kb++) {
        const int k0 = kb * ES8_KBLOCK, kw = E - k0 < ES8_KBLOCK ? E - k0 : ES8_KBLOCK, first = kb == 0;
        const int64_t pf0 = kb * pfb < nnext ? kb * pfb : nnext, pfn = nnext - pf0 < pfb ? nnext - pf0 : pfb;
        const int64_t nb = es8_bf16_np(kw);
        es8_widen_cols_bf16(w + k0, E, R, kw, wsf + k0 / ES8_BLOCK, wc);
        float *yk = kb == nkb - 1 ? y : 0;
        int64_t b = 0;
        for (; b + ES8_CT_MR <= S; b += ES8_CT_MR)
            es8_ctile_bf16(xq + b * np + k0 / 2 * ES8_CT_MR, wc, nb, ES8_CT_MR, part + b * 32, first,
                           yk ? yk + b * ldy : 0, ldy, R, b || !pfn ? 0 : next + pf0, pfn);
        const uint32_t *x = xq + b * np + k0 / 2 * (S - b);
        float *yb = yk ? yk + b * ldy : 0, *pb = part + b * 32;
        const uint8_t *pf = b || !pfn ? 0 : next + pf0;
        switch (S - b) {
#define ES8_CT_REM(n) case n: es8_ctile_bf16(x, wc, nb, n, pb, first, yb, ldy, R, pf, pfn); break;
            ES8_CT_REM(1) ES8_CT_REM(2) ES8_CT_REM(3) ES8_CT_REM(4) ES8_CT_REM(5) ES8_CT_REM(6) ES8_CT_REM(7)
#undef ES8_CT_REM
            default: break;
        }
    }
}

/* es8_group_avx512 on the bf16 path: qx the tokens (rows ldq apart), xb the same packed by
 * es8_bf16_tokens (S >= ES8_XT_MIN). One token: the GEMV, both scales in the activation; 2..8:
 * es8_mgemv_bf16 on the tokens scaled for this group (in scratch); more: the rows widened into
 * scratch with s_w, tiles of rows x tokens in the lanes. */
static ES_TARGET_BF16 void es8_group_bf16(const uint8_t *w, int R, const float *qx, int64_t ldq, const uint16_t *xb,
                                     int64_t S, int E, const float *wsf, float *y, int64_t ldy, float *scratch,
                                     const uint8_t *next, int64_t nnext) {
    __m512i t[4];
    es8_bf16_tables(t);
    if (es8_cols_for(S)) {
        es8_cols_bf16(w, R, (const uint32_t *)xb, S, E, wsf, y, ldy, scratch, next, nnext);
        return;
    }
    if (S == 1) {
        uint16_t qs[(E + 63) & ~63] __attribute__((aligned(64)));
        es8_bf16_act(qx, E, wsf, qs);
        int r = 0;
        for (; r + ES8_GR_BF16 <= R; r += ES8_GR_BF16) es8_gemv_bf16(w + (int64_t)r * E, ES8_GR_BF16, qs, E, y + r, t);
        for (; r < R; r++) es8_gemv_bf16(w + (int64_t)r * E, 1, qs, E, y + r, t);
        return;
    }
    if (S < ES8_XT_MIN) {
        uint16_t *qs = (uint16_t *)scratch;
        const int64_t ldb = es8_bf16_ldb(E);
        for (int64_t j = 0; j < S; j++) es8_bf16_act(qx + j * ldq, E, wsf, qs + j * ldb);
#define ES8_M(n) case n: for (r = 0; r + 2 <= R; r += 2) es8_mgemv_bf16(w + (int64_t)r * E, 2, qs, ldb, n, E, y + r, ldy, t); \
                         if (r < R) es8_mgemv_bf16(w + (int64_t)r * E, 1, qs, ldb, n, E, y + r, ldy, t); break;
        int r;
        switch (S) { ES8_M(2) ES8_M(3) ES8_M(4) ES8_M(5) ES8_M(6) ES8_M(7) ES8_M(8) default: break; }
#undef ES8_M
        return;
    }
    /* a k block widened, then its tiles: the widened rows stay in L1 (all of a group's at once,
     * 32 x E x 2 bytes, go to L2: widening 2048 x 6144 values took 0.80 ms so, 0.56 in L1) */
    uint16_t *wf = (uint16_t *)scratch;
    float *part = scratch + (int64_t)ES8_BLOCK * (E + ES8_KBLOCK);
    const int nkb = (E + ES8_KBLOCK - 1) / ES8_KBLOCK;
    const int64_t pfb = (nnext + nkb - 1) / nkb;  /* the next group's bytes requested over each block */
    for (int kb = 0; kb < nkb; kb++) {
        const int k0 = kb * ES8_KBLOCK, kw = E - k0 < ES8_KBLOCK ? E - k0 : ES8_KBLOCK;
        const int64_t pf0 = kb * pfb < nnext ? kb * pfb : nnext, pfn = nnext - pf0 < pfb ? nnext - pf0 : pfb;
        es8_widen_rows_bf16(w + k0, E, R, kw, wsf + k0 / ES8_BLOCK, wf);
        es8_tiles_bf16((const uint32_t *)wf, R, (const uint32_t *)xb, S, E, k0, k0 + kw, part, y, ldy,
                       pfn ? next + pf0 : 0, pfn);
    }
}

/* acc[i] = vdpbf16ps lane i of (acc, a, b) for n lanes (a, b: 2n bf16): the real instruction
 * (the CPU must have it), or es8_dpbf16_lane (emulate). The tests hold one to the other. */
static ES_TARGET_BF16 void es8_dpbf16_real(float *acc, const uint16_t *a, const uint16_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512i va = _mm512_maskz_loadu_epi32(m, a + 2 * i), vb = _mm512_maskz_loadu_epi32(m, b + 2 * i);
        _mm512_mask_storeu_ps(acc + i, m, _mm512_dpbf16_ps(_mm512_maskz_loadu_ps(m, acc + i), (__m512bh)va, (__m512bh)vb));
    }
}
#endif

static inline int es8_dpbf16(float *acc, const uint16_t *a, const uint16_t *b, int64_t n, int emulate) {
    if (emulate) {
        for (int64_t i = 0; i < n; i++) acc[i] = es8_dpbf16_lane(acc[i], a[2 * i], a[2 * i + 1], b[2 * i], b[2 * i + 1]);
        return 0;
    }
#if ES_X86_PATHS
    if (es_isa_cpu_best() >= ES_ISA_BF16) { es8_dpbf16_real(acc, a, b, n); return 0; }
#endif
    return -1;
}

/* ---- dispatch -------------------------------------------------------------------------------- */

/* avx512 and bf16 gather and quantize with the avx2 copies (exact: the same bits). */
static inline void es8_gather(const uint8_t *w, const uint8_t *sc, int hd, const int64_t *rows, int H, float *e) {
    ES_DISPATCH_COPIES(es_isa_now(), es8_gather, (w, sc, hd, rows, H, e), baseline, avx2, avx2, avx2, neon);
}

static inline void es8_act_quant(const float *x, int n, float *qx, float *s) {
    ES_DISPATCH_COPIES(es_isa_now(), es8_act_quant, (x, n, qx, s), baseline, avx2, avx2, avx2, neon);
}

/* One token. kv [(G+1)*D]: the key of stream c at c*D, the shared value at G*D (see
 * es8_gate_tail_plain; avx512 and bf16 run that one). */
static inline void es8_gate_tail(const float *kv, const void *hid, int hbf, const float *qw, const float *kw, int G,
                                 int D, float eps, int dead, void *out, int obf) {
    ES_DISPATCH_COPIES(es_isa_now(), es8_gate_tail, (kv, hid, hbf, qw, kw, G, D, eps, dead, out, obf), baseline,
                       avx2, plain, plain, neon);
}

/* Scratch of the many-token projection (S > 1), in floats: the tokens packed for the lanes (or
 * the columns tile), shared, then per thread the path's own (avx512: a group's widened rows
 * [32, E + ES8_KBLOCK], bf16: a k block of them; and partial sums [32, S rounded up to 16];
 * bf16 2..8 tokens: their scaled rows there; the template paths: a k block of widened rows
 * [32, ES8_KB] and the sums [32, S rounded up]). Sized for every path, so a path switched
 * between sizing and use still fits. */
static inline int64_t es8_xt_floats(int64_t S, int E) { return S > 1 ? (S + 15) / 16 * 16 * (E + 16) : 0; }
static inline int64_t es8_thread_floats(int64_t S, int E) {
    const int64_t s16 = (S + 15) / 16 * 16;
    const int64_t avx512 = (int64_t)ES8_BLOCK * (E + ES8_KBLOCK) + ES8_BLOCK * 16 * (s16 > 16 ? s16 : 16);
    const int64_t templ = (int64_t)ES8_BLOCK * (ES8_KB_MAX + 16) + ES8_BLOCK * s16;  /* a k block, the sums */
    return avx512 > templ ? avx512 : templ;
}
static inline int64_t es8_scratch_floats(int64_t S, int E, int nthreads) {
    return es8_xt_floats(S, E) + nthreads * es8_thread_floats(S, E);
}

/* The row stride of quantized activations for E values: E plus a cache line, so that the
 * rows of a token tile do not share L1 sets (E * 4 bytes is often a multiple of 4 KiB). */
static inline int64_t es8_ldq(int E) { return (int64_t)E + 16; }

/* Y[t*M + o] for the 32-row weight groups [g0, g1) and all S tokens on path `isa`.
 *   qx  [S, ldq]  quantized activations times their scales (es8_act_quant), ldq >= E
 *   xt  the same packed for the lanes (es8_pack_tokens), or NULL (one token; avx512 below 16)
 *   W   [M, E]  e4m3 bytes, WS [ceil(M/32), E/32] e8m0 bytes
 *   scratch     this thread's es8_thread_floats(S, E) floats (unused for one token)
 *   gn          the group this thread computes after g1 - 1 (its rows requested while g1 - 1
 *               computes), or -1
 * Each group's weights are read from memory once per call. The sums of an output depend only
 * on its own group, so any split of the groups gives the same bits. */
static inline void es8_wkv_range(int isa, const float *qx, int64_t ldq, const float *xt, int64_t S, int E,
                                 const uint8_t *W, const uint8_t *WS, int M, float *Y, int64_t g0, int64_t g1,
                                 float *scratch, int64_t gn) {
    const int nb = E / ES8_BLOCK;
    /* the fp16 widenings (avx2, avx512, neon and neon_bf16) read value * 2^-8: 2^8 folded into the block scale
     * (baseline, bf16: exact) */
    const float f = isa == ES_ISA_AVX2 || isa == ES_ISA_AVX512 || isa >= ES_ISA_NEON ? 256.0f : 1.0f;
    float wsf[nb];
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = g * ES8_BLOCK;
        const int R = M - r0 < ES8_BLOCK ? (int)(M - r0) : ES8_BLOCK;
        for (int b = 0; b < nb; b++) wsf[b] = es8_e8m0(WS[g * nb + b]) * f;
        /* the group this thread computes next (its rows prefetched while these compute) */
        const int64_t gx = g + 1 < g1 ? g + 1 : gn, rx = gx * ES8_BLOCK;
        const int rn = gx >= 0 ? (M - rx < ES8_BLOCK ? (int)(M - rx) : ES8_BLOCK) : 0;
        const uint8_t *next = rn ? W + rx * E : 0;
        ES_ON_PATH(isa, es8_group_baseline(W + r0 * E, R, qx, xt, S, E, wsf, Y + r0, M, scratch, next, rn),
                   es8_group_avx2(W + r0 * E, R, qx, xt, S, E, wsf, Y + r0, M, scratch, next, rn),
                   /* avx512, 2..8 tokens: the avx2 es8_mgemv (the same fp16 widening and scales) */
                   S > 1 && S < ES8_XT_MIN
                       ? es8_group_avx2(W + r0 * E, R, qx, xt, S, E, wsf, Y + r0, M, scratch, next, rn)
                       : es8_group_avx512(W + r0 * E, R, qx, ldq, xt, S, E, wsf, Y + r0, M, scratch,
                                          next, (int64_t)rn * E),
                   es8_group_bf16(W + r0 * E, R, qx, ldq, (const uint16_t *)xt, S, E, wsf, Y + r0, M, scratch,
                                  next, (int64_t)rn * E),
                   es8_group_neon(W + r0 * E, R, qx, xt, S, E, wsf, Y + r0, M, scratch, next, rn));
    }
}

typedef struct {
    int isa, E, M;
    const float *qx;
    int64_t ldq, S;
    const uint8_t *W, *WS;
    float *Y, *xt, *scratch;
    int64_t ng, next;  /* row groups; the first one no thread has taken yet */
} es8_wkv_args;

/* Thread `slot` (its scratch) takes ES8_GRAB row groups at a time until none is left: a
 * thread that shares its core with other work takes fewer (a static split would wait for
 * it). It claims its next groups as the last of the current ones starts, so that group's rows
 * are requested while it computes (else every ES8_GRAB-th group widens from DRAM: on Zen 4, bf16,
 * 16 tokens, the widening took 33% of the projection's samples, over half of them on those
 * loads; 21% after, 13% of them on the loads), and a thread holds at most one group it has not
 * started. Which thread computes a group does not change its bits. */
static void es8_wkv_part(void *ctx, int64_t slot, int64_t slot_end) {
    es8_wkv_args *a = (es8_wkv_args *)ctx;
    float *scratch = a->scratch ? a->scratch + slot * es8_thread_floats(a->S, a->E) : 0;
    (void)slot_end;
    int64_t g0 = __atomic_fetch_add(&a->next, ES8_GRAB, __ATOMIC_RELAXED);
    while (g0 < a->ng) {
        const int64_t g1 = g0 + ES8_GRAB < a->ng ? g0 + ES8_GRAB : a->ng;
        if (g1 - g0 > 1)
            es8_wkv_range(a->isa, a->qx, a->ldq, a->xt, a->S, a->E, a->W, a->WS, a->M, a->Y, g0, g1 - 1, scratch,
                          g1 - 1);
        const int64_t gn = __atomic_fetch_add(&a->next, ES8_GRAB, __ATOMIC_RELAXED);
        es8_wkv_range(a->isa, a->qx, a->ldq, a->xt, a->S, a->E, a->W, a->WS, a->M, a->Y, g1 - 1, g1, scratch,
                      gn < a->ng ? gn : -1);
        g0 = gn;
    }
}

/* es8_wkv_range over all groups on the running path (es_isa_now(), read once per call), split by
 * groups over nthreads threads (each reads its own groups of wkv; scratch:
 * es8_scratch_floats(S, E, nthreads) floats, or NULL for one token): on the call's team (the
 * engine's kept workers, engram_team.h), or NULL: threads started for this split. Bitwise
 * equal to one thread. */
static inline void es8_wkv_mt(const float *qx, int64_t ldq, int64_t S, int E, const uint8_t *W, const uint8_t *WS,
                              int M, float *Y, int nthreads, float *scratch, es_team *team) {
    const int isa = es_isa_now();
    float *xt = 0;
    const int64_t ng = (M + ES8_BLOCK - 1) / ES8_BLOCK;
    if (nthreads > ES8_MAX_THREADS) nthreads = ES8_MAX_THREADS;  /* the scratch holds nthreads slots */
    if (nthreads > ng) nthreads = (int)ng;
#if ES_X86_PATHS
    if (isa == ES_ISA_BF16) {  /* many tokens in bf16 for the lanes; 2..8 read qx (es8_group_bf16) */
        if (scratch && es8_cols_for(S)) es8_bf16_cols_tokens(qx, ldq, S, E, (uint32_t *)(xt = scratch));
        else if (scratch && S >= ES8_XT_MIN) es8_bf16_tokens(qx, ldq, S, E, (uint16_t *)(xt = scratch));
    } else
#endif
    if (scratch && S > 1) {  /* the tokens in the lanes: 16 a vector on avx512 (from ES8_XT_MIN tokens) */
        int lanes, mg;  /* (bf16 packed its own above) */
        ES_ON_PATH(isa, (lanes = es8_xlanes_baseline, mg = es8_mg_baseline),
                   (lanes = es8_xlanes_avx2, mg = es8_mg_avx2), (lanes = 16, mg = ES8_XT_MIN - 1),
                   (lanes = 16, mg = ES8_XT_MIN - 1), (lanes = es8_xlanes_neon, mg = es8_mg_neon));
        xt = scratch;
        if (S <= mg) {  /* a few tokens on the template paths (avx512: the avx2 es8_mgemv): each in its GEMV's order */
            for (int64_t t = 0; t < S; t++)
                ES_DISPATCH_COPIES(isa, es8_gemv_layout, (qx + t * ldq, E, xt + t * (E + 16)), baseline, avx2, avx2,
                                   avx2, neon);
        } else {
            es8_pack_tokens(qx, ldq, S, E, xt, lanes);
        }
    }
    float q1[S == 1 ? E : 1];  /* one token on the template paths: in their GEMV's order, once per call */
    if (S == 1)
        ES_ON_PATH(isa, qx = (es8_gemv_layout_baseline(qx, E, q1), q1), qx = (es8_gemv_layout_avx2(qx, E, q1), q1),
                   (void)0, (void)0, qx = (es8_gemv_layout_neon(qx, E, q1), q1));
    es8_wkv_args a = {isa, E, M, qx, ldq, S, W, WS, Y, xt, scratch ? scratch + es8_xt_floats(S, E) : 0, ng, 0};
    es_split(team, nthreads, nthreads, 1, es8_wkv_part, &a);  /* one piece a scratch slot */
}

/* The register-only peak of the projection's own multiply-add on the running path: vdpbf16ps
 * chains on bf16 (32 products an instruction), else the path's FMA chains (es_fma_chains).
 * n rounds; returns the multiply-adds done. */
static inline int64_t es8_mac_chains(int64_t n, float *sink) {
#if ES_X86_PATHS
    if (es_isa_now() == ES_ISA_BF16) return es_dpbf16_chains(n, sink);
#endif
    return es_fma_chains(n, sink);
}

/* ---- the bandwidth floor ------------------------------------------------------------ */

/* XOR of n bytes read once, 256 bytes per iteration into four independent vector lanes: the
 * time to read a weight once (bench/bench_v41.py compares a step with it). A tail of n % 256
 * bytes is ignored. */
typedef uint64_t es8_u64x8 __attribute__((vector_size(64)));

ES8_READ_CLONES static uint64_t es8_read_bytes(const uint8_t *p, int64_t n) {
    es8_u64x8 a = {0}, b = {0}, c = {0}, d = {0}, v;
    for (int64_t i = 0; i + 256 <= n; i += 256) {
        memcpy(&v, p + i, 64); a ^= v;
        memcpy(&v, p + i + 64, 64); b ^= v;
        memcpy(&v, p + i + 128, 64); c ^= v;
        memcpy(&v, p + i + 192, 64); d ^= v;
    }
    a ^= b ^ c ^ d;
    uint64_t r = 0;
    for (int j = 0; j < 8; j++) r ^= a[j];
    return r;
}

#endif /* ENGRAM_FP8_H */
