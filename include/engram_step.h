/* engram_step.h: the float kernels of one streaming step, shared by every engine.
 *
 *   es_gemm_packed  Y[B,M] = X[B,E] W^T + bias for skinny B (1..~128 rows), with W
 *                   pre-packed in 16-column panels so each panel is one contiguous
 *                   stream and read from memory once per call, whatever B is.
 *   es_tail         gate, value, ShortConv (RMSNorm, causal taps over rows the caller
 *                   picks, SiLU) and output for one token of one stream. Stateless:
 *                   the conv state and its ring rules live in _engine.pyx.
 *   es_gather       copy a token's H table rows (float32 / float16 / int8+scale).
 *
 * Written with GCC vector extensions (GCC, clang). The GEMM and the gathers are compiled
 * once per instruction set from engram_step_kern.h and picked by es_isa (engram_isa.h):
 * one build runs on any CPU, and ENGRAM_STREAM_ISA / the tests can force each path.
 * Nothing here allocates or raises.
 */
#ifndef ENGRAM_STEP_H
#define ENGRAM_STEP_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engram_isa.h"
#include "engram_consts.h" /* ES_EPS_KEY, ES_EPS_CONV, ES_GATE_CLAMP */
#if ES_X86_PATHS
#include <immintrin.h>
#endif

/* es_tail is still cloned by GCC's target_clones (an ifunc: glibc only). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && !defined(ES_NO_CLONES)
#define ES_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ES_CLONES
#endif
#define ES_INLINE static inline __attribute__((always_inline))

#define ES_PANEL 16 /* output columns per packed weight panel (16 floats: one 64-byte line a k) */

typedef float es_v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t es_v8i __attribute__((vector_size(32), aligned(4)));

/* float16 bits -> float32, exactly (subnormals, inf and NaN included). */
static inline float es_half_to_float(uint16_t h) {
#if defined(__FLT16_MAX__) && !defined(ES_NO_FLOAT16)
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
#else /* no _Float16 (GCC < 12 / clang < 15 on x86, 32-bit targets): by the bits */
    const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float32 */
        f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
    } else {
        bits = (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | (man << 13);
    }
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* ---- skinny GEMM over packed panels ------------------------------------------
 * Packed layout: panel p holds columns [16p, 16p+16) of W^T as Wp[p][k][16] (zero padded
 * past M); biasp is padded to a multiple of 16 the same way. Per-ISA copies follow:
 * tiles of ES_MR rows x ES_TP panels (baseline: 3 x 1 panel = 12 xmm accumulators of 16;
 * AVX2: 6 x 1 panel = 12 ymm; AVX-512: 8 x 2 panels = 16 zmm of 32), and one-row GEMVs
 * over ES_GP panels at once. */
#define ES_SFX baseline /* 16-byte vectors: SSE2 / NEON registers (wider ones spill there) */
#define ES_TGT
#define ES_VW 4
#define ES_TP 1
#define ES_MR 3
#define ES_GP 2
#define ES_F16C 0
#include "engram_step_kern.h"
#if ES_X86_PATHS
#define ES_SFX avx2
#define ES_TGT ES_TARGET_AVX2
#define ES_VW 8
#define ES_TP 1
#define ES_MR 6
#define ES_GP 4
#define ES_F16C 1
#include "engram_step_kern.h"
#define ES_SFX avx512
#define ES_TGT ES_TARGET_AVX512
#define ES_VW 16
#define ES_TP 2
#define ES_MR 8
#define ES_GP 8
#define ES_F16C 1
#include "engram_step_kern.h"
#endif

/* Rows per GEMM micro-tile of the running path (the packing of es_pack_rows). */
static inline int es_gemm_mr(void) {
#if ES_X86_PATHS
    if (es_isa_now() == ES_ISA_AVX512) return es_mr_avx512;
    if (es_isa_now() == ES_ISA_AVX2) return es_mr_avx2;
#endif
    return es_mr_baseline;
}

/* Y = X W^T + bias over the panels [p0, p1). X rows are ldx floats apart: keep ldx*4
 * off multiples of 4 KiB (the engine pads rows by 16 floats), else the rows of a tile
 * alias one L1 set (measured 1.3-1.6x slower). Xp: X's full tiles packed by
 * es_pack_rows, or NULL. */
static inline void es_gemm_range(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                                 const float *biasp, int M, float *Y, int p0, int p1, const float *Xp) {
    if (wbf16)
        ES_DISPATCH(es_gemm_range_bf16, (X, ldx, B, E, (const uint16_t *)Wp, biasp, M, Y, p0, p1, Xp));
    else
        ES_DISPATCH(es_gemm_range_f32, (X, ldx, B, E, (const float *)Wp, biasp, M, Y, p0, p1, Xp));
}

/* Xp[t][k][mr] = X[mr*t + r][k] for the B/mr full tiles. */
static inline void es_pack_rows(const float *X, int64_t ldx, int64_t B, int E, float *Xp, int mr) {
    for (int64_t t = 0; t < B / mr; t++)
        for (int k = 0; k < E; k++)
            for (int r = 0; r < mr; r++) Xp[(t * E + k) * mr + r] = X[(t * mr + r) * ldx + k];
}

/* Pack X into xpack (scratch of B*E floats) when it holds two tiles or more; else NULL. */
static inline const float *es_maybe_pack(const float *X, int64_t ldx, int64_t B, int E, float *xpack) {
    const int mr = es_gemm_mr();
    if (!xpack || B < 2 * mr) return 0;
    es_pack_rows(X, ldx, B, E, xpack, mr);
    return xpack;
}

/* Wp: float32 panels, or bfloat16 bits (uint16_t) when wbf16. xpack: scratch of B*E floats
 * for the packed rows, or NULL. */
static inline void es_gemm_packed(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                                  const float *biasp, int M, float *Y, float *xpack) {
    es_gemm_range(X, ldx, B, E, Wp, wbf16, biasp, M, Y, 0, (M + ES_PANEL - 1) / ES_PANEL,
                  es_maybe_pack(X, ldx, B, E, xpack));
}

/* The same split over threads by panel ranges (prefill: many rows, worth the thread
 * start-up of ~50 us). A thread that cannot start runs its range inline. */
typedef struct {
    const float *X;
    const void *Wp;
    const float *biasp, *Xp;
    float *Y;
    int64_t ldx, B;
    int E, M, p0, p1, wbf16;
} es_gemm_job;

static void *es_gemm_job_run(void *arg) {
    const es_gemm_job *j = (const es_gemm_job *)arg;
    es_gemm_range(j->X, j->ldx, j->B, j->E, j->Wp, j->wbf16, j->biasp, j->M, j->Y, j->p0, j->p1, j->Xp);
    return 0;
}

#define ES_MAX_THREADS 16
static inline void es_gemm_packed_mt(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                                     const float *biasp, int M, float *Y, float *xpack, int nthreads) {
    const int np = (M + ES_PANEL - 1) / ES_PANEL;
    if (nthreads > ES_MAX_THREADS) nthreads = ES_MAX_THREADS;
    if (nthreads > np) nthreads = np;
    if (nthreads <= 1) { es_gemm_packed(X, ldx, B, E, Wp, wbf16, biasp, M, Y, xpack); return; }
    const float *Xp = es_maybe_pack(X, ldx, B, E, xpack);
    es_gemm_job jobs[ES_MAX_THREADS];
    pthread_t tid[ES_MAX_THREADS];
    int started[ES_MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        es_gemm_job j = {X, Wp, biasp, Xp, Y, ldx, B, E, M, (int)((int64_t)np * i / nthreads),
                         (int)((int64_t)np * (i + 1) / nthreads), wbf16};
        jobs[i] = j;
    }
    for (int i = 1; i < nthreads; i++) started[i] = pthread_create(&tid[i], 0, es_gemm_job_run, &jobs[i]) == 0;
    es_gemm_job_run(&jobs[0]);
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) pthread_join(tid[i], 0);
        else es_gemm_job_run(&jobs[i]);
    }
}

/* ---- the per-token tail -------------------------------------------------------- */

ES_INLINE es_v8 es_sel(es_v8i m, es_v8 a, es_v8 b) {
    return (es_v8)((m & (es_v8i)a) | (~m & (es_v8i)b));
}

/* exp on 8 lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial),
 * ~2 ulp; NaN stays NaN through the polynomial. */
ES_INLINE es_v8 es_exp8(es_v8 x) {
    const es_v8 hi = {88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f,
                      88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f};
    x = es_sel(x > hi, hi, x);
    x = es_sel(x < -hi, -hi, x);
    es_v8 fx = x * 1.44269504088896341f + 0.5f;
    es_v8i n = __builtin_convertvector(fx, es_v8i);
    es_v8 tf = __builtin_convertvector(n, es_v8);
    es_v8i gt = tf > fx; /* truncation rounded up for negatives: floor */
    n += gt;             /* gt is -1 where true */
    tf = __builtin_convertvector(n, es_v8);
    es_v8 r = x - tf * 0.693359375f + tf * 2.12194440e-4f;
    es_v8 r2 = r * r;
    es_v8 y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r2 + r + 1.0f;
    es_v8i e = (n + 127) << 23;
    return y * (es_v8)e;
}

typedef struct {
    int G, D, K;       /* K: conv taps; the first K-1 read earlier values, the last x(t) */
    float inv_sqrt_d;  /* 1/sqrt(D), the gate's scale */
    const float *n1;   /* [G, D] key RMSNorm weights */
    const float *n2;   /* [G, D] hidden RMSNorm weights */
    const float *n3;   /* [G, D] ShortConv RMSNorm weights */
    const float *cw;   /* [K, G*D] conv taps, tap-major so a tap is contiguous over channels */
} es_tail_params;

ES_INLINE float es_hsum(es_v8 v) {
    float t[8];
    *(es_v8 *)t = v;
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

/* sum k^2 and sum h^2 in one pass. */
ES_INLINE void es_sumsq2(const float *k, const float *h, int D, float *sk, float *sh) {
    es_v8 a = {0}, b = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        es_v8 kv = *(const es_v8 *)(k + d), hv = *(const es_v8 *)(h + d);
        a += kv * kv;
        b += hv * hv;
    }
    float fa = es_hsum(a), fb = es_hsum(b);
    for (; d < D; d++) {
        fa += k[d] * k[d];
        fb += h[d] * h[d];
    }
    *sk = fa; *sh = fb;
}

/* sum (k*rk*w1) * (h*rh*w2): the dot of the normalized vectors, normalized first as the
 * reference does, so huge-but-finite inputs do not overflow where the reference does not. */
ES_INLINE float es_normdot(const float *k, const float *h, const float *w1, const float *w2, float rk,
                           float rh, int D) {
    es_v8 a = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        a += (*(const es_v8 *)(k + d) * rk * *(const es_v8 *)(w1 + d)) *
             (*(const es_v8 *)(h + d) * rh * *(const es_v8 *)(w2 + d));
    float f = es_hsum(a);
    for (; d < D; d++) f += (k[d] * rk * w1[d]) * (h[d] * rh * w2[d]);
    return f;
}

/* sum (g*v)^2 */
ES_INLINE float es_sumsq_scaled(const float *v, float g, int D) {
    es_v8 a = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8) { es_v8 x = g * *(const es_v8 *)(v + d); a += x * x; }
    float s = es_hsum(a);
    for (; d < D; d++) s += (g * v[d]) * (g * v[d]);
    return s;
}

/* One token of one stream.
 *   proj  [(G+1)*D]  key projections of the G streams, then the value projection (bias added)
 *   hid   [G, D]     the hidden state
 *   taps  [K-1]      taps[i] -> the G*D normalized values tap i reads (x(t - (K-1-i)*dil)):
 *                    which rows those are is the caller's rule (the engine's conv ring)
 *   xdst  [G*D]      where x(t), this token's normalized values, is written (NULL: nowhere);
 *                    it may be taps[0] (the oldest row, overwritten by x(t)): every element
 *                    is read as a tap before it is written
 *   out   [G, D]     value + SiLU(conv)
 * Returns nothing and cannot fail; NaN/inf inputs propagate as the reference's do. */
ES_CLONES static void es_tail(const es_tail_params *P, const float *proj, const float *hid,
                              const float *const *taps, float *xdst, float *out) {
    const int G = P->G, D = P->D, K = P->K;
    const int64_t C = (int64_t)G * D;
    const float *v = proj + C;
    const float *wlast = P->cw + (int64_t)(K - 1) * C; /* the tap on x(t) itself */
    for (int g = 0; g < G; g++) {
        const float *k = proj + (int64_t)g * D, *h = hid + (int64_t)g * D;
        float sk, sh;
        es_sumsq2(k, h, D, &sk, &sh);
        const float rk = 1.0f / sqrtf(sk / D + ES_EPS_KEY), rh = 1.0f / sqrtf(sh / D + ES_EPS_KEY);
        float s = es_normdot(k, h, P->n1 + (int64_t)g * D, P->n2 + (int64_t)g * D, rk, rh, D) * P->inv_sqrt_d;
        /* sign(s) * sqrt(max(|s|, clamp)); s == 0 stays 0 and NaN stays NaN */
        s = s > 0 ? sqrtf(fmaxf(s, ES_GATE_CLAMP)) : (s < 0 ? -sqrtf(fmaxf(-s, ES_GATE_CLAMP)) : s);
        const float gate = 1.0f / (1.0f + expf(-s));
        const float r3 = 1.0f / sqrtf(es_sumsq_scaled(v, gate, D) / D + ES_EPS_CONV);
        const float *w3 = P->n3 + (int64_t)g * D;
        float *o = out + (int64_t)g * D;
        const int64_t c0 = (int64_t)g * D;
        int d = 0;
        for (; d + 8 <= D; d += 8) {
            const int64_t c = c0 + d;
            es_v8 vv = gate * *(const es_v8 *)(v + d);
            es_v8 x = vv * r3 * *(const es_v8 *)(w3 + d);
            es_v8 y = *(const es_v8 *)(wlast + c) * x;
            for (int i = 0; i < K - 1; i++)
                y += *(const es_v8 *)(P->cw + i * C + c) * *(const es_v8 *)(taps[i] + c);
            if (xdst) *(es_v8 *)(xdst + c) = x;
            *(es_v8 *)(o + d) = vv + y / (1.0f + es_exp8(-y));
        }
        for (; d < D; d++) {
            const int64_t c = c0 + d;
            float vv = gate * v[d];
            float x = vv * r3 * w3[d];
            float y = wlast[c] * x;
            for (int i = 0; i < K - 1; i++) y += P->cw[i * C + c] * taps[i][c];
            if (xdst) xdst[c] = x;
            o[d] = vv + y / (1.0f + expf(-y));
        }
    }
}

/* ---- gathering a token's rows ---------------------------------------------------- */

/* e[j*hd : (j+1)*hd] = table[rows[j]] for float32 tables. */
static inline void es_gather_f32(const float *table, int hd, const int64_t *rows, int H, float *e) {
    for (int j = 0; j < H; j++) memcpy(e + (int64_t)j * hd, table + rows[j] * hd, sizeof(float) * hd);
}

/* float16 tables (IEEE binary16 bits), widened to float32. */
static inline void es_gather_f16(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) {
    ES_DISPATCH(es_gather_f16, (table, hd, rows, H, e));
}

/* int8 rows with one float32 scale per row: value = q * scale. */
static inline void es_gather_i8(const int8_t *table, const float *scale, int hd, const int64_t *rows, int H,
                                float *e) {
    ES_DISPATCH(es_gather_i8, (table, scale, hd, rows, H, e));
}

/* ---- knowing rows early ------------------------------------------------------------ */

/* Pull rows into the CPU cache ahead of the gather (in-RAM tables). */
static inline void es_prefetch_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const char *r = table + rows[j] * rowbytes;
        for (int64_t b = 0; b < rowbytes; b += 64) __builtin_prefetch(r + b);
    }
}

/* madvise(advice) on the pages holding each row (file-backed tables: WILLNEED starts
 * the reads now, while earlier layers compute). Returns how many calls failed. */
static inline int64_t es_advise_rows(const char *table, int64_t rowbytes, const int64_t *rows, int64_t n,
                                     int advice) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int64_t failed = 0;
    for (int64_t j = 0; j < n; j++) {
        uintptr_t a = (uintptr_t)(table + rows[j] * rowbytes);
        uintptr_t lo = a & ~(page - 1), hi = (a + rowbytes + page - 1) & ~(page - 1);
        failed += madvise((void *)lo, hi - lo, advice) != 0;
    }
    return failed;
}

/* Mark rows in a bitmap (rows-touched accounting for residency reports). */
static inline void es_mark_rows(uint8_t *bitmap, const int64_t *rows, int64_t n) {
    for (int64_t j = 0; j < n; j++) bitmap[rows[j] >> 3] |= (uint8_t)(1u << (rows[j] & 7));
}

#endif /* ENGRAM_STEP_H */
