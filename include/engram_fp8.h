/* engram_fp8.h: the float8 kernels of the DeepSeek-V4.1 Engram step (DESIGN.md section 4).
 *
 *   es8_e4m3 / es8_e8m0   one float8 byte -> float, exact (e4m3fn 0x7f/0xff and e8m0 0xff: NaN)
 *   es8_gather            a token's H table rows: e4m3 bytes x one e8m0 scale per 32 values
 *   es8_act_quant         the reference's activation quantization, per 32 values:
 *                         s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448))) from the exponent bits,
 *                         q = e4m3(clamp(x / s, +-448)) rounded to nearest even; returns q * s
 *   es8_wkv               Y[S, M] = the fp8 wkv projection of S quantized tokens, 32x32 block
 *                         scales; the weight bytes stay float8 and are widened in registers
 *   es8_gate_tail         the gate (rstd, eps 1e-20, signed sqrt, sigmoid; 0 at DEAD) times the
 *                         shared value, for the G streams of one token
 *
 * Block-scale numerics: the reference sums each 32-wide block of q*w in fp32 (every product
 * is exact: 4-bit x 4-bit significands) and adds block * s_x * s_w over the blocks. Here the
 * power-of-two scales are folded into the factors first (q * s_x and w * s_w, both exact), so
 * every product is the reference's scaled by a power of two: the same values, only the order
 * of the fp32 additions differs.
 *
 * Two paths, chosen by the caller (`isa`, stateless): ES8_AVX512 widens 16 e4m3 bytes at a time
 * through fp16 (sign-extend, shift by 7, mask: the fp16 with those bits is value * 2^-8, exact
 * for every finite code, subnormals included; the 2^8 is folded into the block scale) and runs 16-lane
 * FMAs; ES8_BASELINE is portable C. es8_isa_supported() says what this CPU runs. On the AVX-512
 * path the NaN codes of wkv (0x7f/0xff) read as +-480 (checkpoints hold none); the table
 * gather and the baseline decode them as NaN. Nothing here allocates (except thread starts
 * in es8_wkv_mt, which fall back to running inline) and nothing fails.
 */
#ifndef ENGRAM_FP8_H
#define ENGRAM_FP8_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include "engram_consts.h" /* ES_GATE_CLAMP */

#include "engram_isa.h"

#if ES_X86_PATHS
#include <immintrin.h>
#define ES8_HAVE_AVX512 1
#define ES8_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define ES8_READ_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define ES8_READ_CLONES
#define ES8_HAVE_AVX512 0
#endif

#define ES8_BLOCK 32          /* values per activation scale, weight block edge, table row scale */
#define ES8_E4M3_MAX 448.0f
#define ES8_AMAX_MIN 1e-4f
#define ES8_TILE_TOKENS 8     /* tokens per register tile of the multi-token projection */
#define ES8_MAX_THREADS 16
#define ES8_PREFETCH 512      /* bytes of a weight row requested ahead by the one-token tile */
#define ES8_INLINE static inline __attribute__((always_inline))

enum { ES8_BASELINE = 0, ES8_AVX512 = 1 };

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

/* y rounded to the e4m3 grid (nearest, ties to even), saturating at +-448; NaN stays NaN. */
static inline float es8_round_e4m3(float y) {
    float a = fabsf(y);
    if (a > ES8_E4M3_MAX) a = ES8_E4M3_MAX;
    if (!(a >= 0x1p-6f)) {
        a = rintf(a * 512.0f) * 0x1p-9f;      /* subnormal range: steps of 2^-9 */
    } else {
        int ex;
        frexpf(a, &ex);                        /* a in [2^(ex-1), 2^ex): 3 mantissa bits */
        a = ldexpf(rintf(ldexpf(a, 4 - ex)), ex - 4);
    }
    return copysignf(a, y);
}

/* The activation scale of a block with max |x| = amax, as the reference's fast_round_scale:
 * x = max(amax, 1e-4) * float32(1/448), then 2^(exponent + (mantissa != 0)). */
static inline float es8_act_scale(float amax) {
    const float x = (amax > ES8_AMAX_MIN ? amax : ES8_AMAX_MIN) * (float)(1.0 / 448.0);
    const uint32_t u = es8_bits(x);
    const int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + ((u & 0x7fffff) != 0);
    return es8_from_bits((uint32_t)(e + 127) << 23);
}

/* ---- table rows ------------------------------------------------------------------- */

/* e[j*hd + i] = e4m3(w[rows[j]][i]) * e8m0(sc[rows[j]][i/32]) (exact in float32). hd % 32 == 0. */
static inline void es8_gather(const uint8_t *w, const uint8_t *sc, int hd, const int64_t *rows, int H,
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
static inline void es8_act_quant(const float *x, int n, float *qx, float *s) {
    for (int b = 0; b < n / ES8_BLOCK; b++) {
        const float *xb = x + b * ES8_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < ES8_BLOCK; i++) {
            const float a = fabsf(xb[i]);
            amax = (a > amax || a != a) ? a : amax;   /* NaN wins, as torch's amax */
        }
        const float sb = es8_act_scale(amax);
        s[b] = sb;
        for (int i = 0; i < ES8_BLOCK; i++) qx[b * ES8_BLOCK + i] = es8_round_e4m3(xb[i] / sb) * sb;
    }
}

/* ---- the wkv projection -------------------------------------------------------------- */

/* Portable tile: y[t*ldy + r] = sum_k e4m3(w[r*E + k]) * wsf[k/32] * qx[t*E + k]. */
static inline void es8_tile_base(const uint8_t *w, int R, const float *qx, int T, int E, const float *wsf,
                                 float *y, int64_t ldy) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            const uint8_t *wr = w + (int64_t)r * E;
            const float *qt = qx + (int64_t)t * E;
            float acc[ES8_BLOCK] = {0};
            for (int k = 0; k < E; k += ES8_BLOCK) {
                const float f = wsf[k / ES8_BLOCK];
                for (int i = 0; i < ES8_BLOCK; i++) acc[i] += (es8_e4m3(wr[k + i]) * f) * qt[k + i];
            }
            float sum = 0.0f;
            for (int i = 0; i < ES8_BLOCK; i++) sum += acc[i];
            y[t * ldy + r] = sum;
        }
}

#if ES8_HAVE_AVX512
/* 16 e4m3 bytes -> 16 floats equal to value * 2^-8 (see the top of this file). */
ES8_INLINE ES8_T512 __m512 es8_widen16(const uint8_t *p) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_cvtph_ps(h);
}

/* R weight rows x T tokens over k in [k0, k1), every accumulator a 16-lane register; R and T
 * are compile-time constants at each call site below, so the loops unroll and the tile stays
 * in registers. A widened weight is scaled by its block's wsf (2^8 folded in) before the FMAs.
 * The weights and activations are indexed by absolute k (row stride E). part: NULL (the whole
 * k range at once), or R*T*16 floats of vector partial sums carried across k blocks (read
 * unless first, written unless y). y: the reduced sums y[t*ldy + r], or NULL. */
ES8_INLINE ES8_T512 void es8_tile512(const uint8_t *w, const int R, const float *qx, const int T, int E, int k0,
                                     int k1, const float *wsf, float *part, int first, float *y, int64_t ldy) {
    /* wsf NULL: qx carries the block scales already (one token); then the weights are also
     * prefetched ES8_PREFETCH bytes ahead, a line per row every 64 bytes */
    __m512 acc[4][ES8_TILE_TOKENS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++)
            acc[r][t] = (part && !first) ? _mm512_loadu_ps(part + (r * T + t) * 16) : _mm512_setzero_ps();
    for (int k = k0; k < k1; k += 16) {
        __m512 wv[4];
        if (wsf) {
            const __m512 f = _mm512_set1_ps(wsf[k >> 5]);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) wv[r] = _mm512_mul_ps(es8_widen16(w + (int64_t)r * E + k), f);
        } else {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                if (!(k & 63)) _mm_prefetch((const char *)(w + (int64_t)r * E + k + ES8_PREFETCH), _MM_HINT_T0);
                wv[r] = es8_widen16(w + (int64_t)r * E + k);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            const __m512 qv = _mm512_loadu_ps(qx + (int64_t)t * E + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], qv, acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            if (y) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
            else _mm512_storeu_ps(part + (r * T + t) * 16, acc[r][t]);
        }
}

#define ES8_KBLOCK 256 /* k per block when tokens share a tile: their activations stay in L1 */

/* R rows (<= 32) x T tokens (1..8) with the tile shape fixed at compile time. One token: four
 * rows at once over all k (four weight streams in flight, memory-bound). Several: pairs of
 * rows, k in blocks of ES8_KBLOCK with the partial sums in `part` (32 * 8 * 16 floats). */
static ES8_T512 void es8_tile_avx512(const uint8_t *w, int R, const float *qx, int T, int E, const float *wsf,
                                     float *y, int64_t ldy, float *part) {
    if (T == 1) {  /* the block scales go into the activation once, not into every row */
        float qs[E] __attribute__((aligned(64)));
        for (int k = 0; k < E; k += 16)
            _mm512_store_ps(qs + k, _mm512_mul_ps(_mm512_loadu_ps(qx + k), _mm512_set1_ps(wsf[k >> 5])));
        int r = 0;
        for (; r + 4 <= R; r += 4) es8_tile512(w + (int64_t)r * E, 4, qs, 1, E, 0, E, 0, 0, 1, y + r, ldy);
        for (; r < R; r++) es8_tile512(w + (int64_t)r * E, 1, qs, 1, E, 0, E, 0, 0, 1, y + r, ldy);
        return;
    }
#define ES8_T(rows, t) case t: es8_tile512(wr, rows, qx, t, E, k0, k1, wsf, pr, first, yr, ldy); break;
    for (int k0 = 0; k0 < E; k0 += ES8_KBLOCK) {
        const int k1 = k0 + ES8_KBLOCK < E ? k0 + ES8_KBLOCK : E, first = k0 == 0;
        for (int r = 0; r < R; r += 2) {
            const uint8_t *wr = w + (int64_t)r * E;
            float *pr = part + (int64_t)r * ES8_TILE_TOKENS * 16, *yr = k1 == E ? y + r : 0;
            if (r + 2 <= R) {
                switch (T) { ES8_T(2, 2) ES8_T(2, 3) ES8_T(2, 4) ES8_T(2, 5) ES8_T(2, 6) ES8_T(2, 7) ES8_T(2, 8) default: break; }
            } else {
                switch (T) { ES8_T(1, 2) ES8_T(1, 3) ES8_T(1, 4) ES8_T(1, 5) ES8_T(1, 6) ES8_T(1, 7) ES8_T(1, 8) default: break; }
            }
        }
    }
#undef ES8_T
}
#endif

/* What this CPU can run: ES8_AVX512 (the kernels' AVX-512 level, engram_isa.h)
 * or ES8_BASELINE. */
static inline int es8_isa_supported(void) {
#if ES8_HAVE_AVX512
    if (es_isa_cpu_best() == ES_ISA_AVX512) return ES8_AVX512;  /* F16C: every AVX-512 CPU */
#endif
    return ES8_BASELINE;
}

/* Y[t*M + o] for the 32-row weight groups [g0, g1) and all S tokens.
 *   qx  [S, E]  quantized activations times their scales (es8_act_quant)
 *   W   [M, E]  e4m3 bytes, WS [ceil(M/32), E/32] e8m0 bytes
 * Each group's weights are read from memory once per call; tokens go 8 at a time. */
static inline void es8_wkv_range(int isa, const float *qx, int64_t S, int E, const uint8_t *W, const uint8_t *WS,
                                 int M, float *Y, int64_t g0, int64_t g1) {
    const int nb = E / ES8_BLOCK;
    const float f = isa == ES8_AVX512 ? 256.0f : 1.0f;  /* the AVX-512 widening reads value * 2^-8 */
    float wsf[nb];
#if ES8_HAVE_AVX512
    float part[ES8_BLOCK * ES8_TILE_TOKENS * 16] __attribute__((aligned(64)));
#endif
    for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = g * ES8_BLOCK;
        const int R = M - r0 < ES8_BLOCK ? (int)(M - r0) : ES8_BLOCK;
        for (int b = 0; b < nb; b++) wsf[b] = es8_e8m0(WS[g * nb + b]) * f;
        for (int64_t t0 = 0; t0 < S; t0 += ES8_TILE_TOKENS) {
            const int T = S - t0 < ES8_TILE_TOKENS ? (int)(S - t0) : ES8_TILE_TOKENS;
#if ES8_HAVE_AVX512
            if (isa == ES8_AVX512) {
                es8_tile_avx512(W + r0 * E, R, qx + t0 * E, T, E, wsf, Y + t0 * M + r0, M, part);
                continue;
            }
#endif
            es8_tile_base(W + r0 * E, R, qx + t0 * E, T, E, wsf, Y + t0 * M + r0, M);
        }
    }
}

static inline void es8_wkv(int isa, const float *qx, int64_t S, int E, const uint8_t *W, const uint8_t *WS, int M,
                           float *Y) {
    es8_wkv_range(isa, qx, S, E, W, WS, M, Y, 0, (M + ES8_BLOCK - 1) / ES8_BLOCK);
}

/* The same over threads, split by weight groups (prefill: each thread reads its own part of wkv). */
typedef struct {
    int isa, E, M;
    const float *qx;
    int64_t S, g0, g1;
    const uint8_t *W, *WS;
    float *Y;
} es8_wkv_job;

static void *es8_wkv_job_run(void *arg) {
    const es8_wkv_job *j = (const es8_wkv_job *)arg;
    es8_wkv_range(j->isa, j->qx, j->S, j->E, j->W, j->WS, j->M, j->Y, j->g0, j->g1);
    return 0;
}

static inline void es8_wkv_mt(int isa, const float *qx, int64_t S, int E, const uint8_t *W, const uint8_t *WS,
                              int M, float *Y, int nthreads) {
    const int64_t ng = (M + ES8_BLOCK - 1) / ES8_BLOCK;
    if (nthreads > ES8_MAX_THREADS) nthreads = ES8_MAX_THREADS;
    if (nthreads > ng) nthreads = (int)ng;
    if (nthreads <= 1) { es8_wkv(isa, qx, S, E, W, WS, M, Y); return; }
    es8_wkv_job jobs[ES8_MAX_THREADS];
    pthread_t tid[ES8_MAX_THREADS];
    int started[ES8_MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        es8_wkv_job j = {isa, E, M, qx, S, ng * i / nthreads, ng * (i + 1) / nthreads, W, WS, Y};
        jobs[i] = j;
    }
    for (int i = 1; i < nthreads; i++) started[i] = pthread_create(&tid[i], 0, es8_wkv_job_run, &jobs[i]) == 0;
    es8_wkv_job_run(&jobs[0]);
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) pthread_join(tid[i], 0);
        else es8_wkv_job_run(&jobs[i]);
    }
}

/* ---- the gate tail ------------------------------------------------------------------- */

/* One token. kv [(G+1)*D]: the key of stream c at c*D, the shared value at G*D.
 * Stream c: rstd = rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps),
 * dot = sum(h * qw[c] * kw[c] * key) * rstd / sqrt(D),
 * gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), 0 when dead; out = gate * value.
 * Sums in double (D up to a few thousand: the float32 rounding of the oracle is below 1e-6). */
static inline void es8_gate_tail(const float *kv, const float *hid, const float *qw, const float *kw, int G,
                                 int D, float eps, int dead, float *out) {
    const float *value = kv + (int64_t)G * D;
    for (int c = 0; c < G; c++) {
        const float *key = kv + (int64_t)c * D, *h = hid + (int64_t)c * D;
        const float *a = qw + (int64_t)c * D, *b = kw + (int64_t)c * D;
        double sh = 0, sk = 0, dot = 0;
        for (int d = 0; d < D; d++) {
            sh += (double)h[d] * h[d];
            sk += (double)key[d] * key[d];
            dot += (double)h[d] * a[d] * b[d] * key[d];
        }
        const float rstd = (1.0f / sqrtf((float)(sh / D) + eps)) * (1.0f / sqrtf((float)(sk / D) + eps));
        const float s = (float)dot * rstd / sqrtf((float)D);
        const float mag = fabsf(s) < ES_GATE_CLAMP ? ES_GATE_CLAMP : fabsf(s);  /* NaN stays NaN */
        const float z = copysignf(sqrtf(mag), s);
        const float gate = dead ? 0.0f : 1.0f / (1.0f + expf(-z));
        float *o = out + (int64_t)c * D;
        for (int d = 0; d < D; d++) o[d] = gate * value[d];
    }
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
