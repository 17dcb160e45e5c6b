/* engram_step.h: the float kernels of one streaming step, shared by every engine.
 *
 *   es_gemm_packed  Y[B,M] = X[B,E] W^T + bias for skinny B (1..~128 rows), with W
 *                   pre-packed in 16-column panels so each panel is one contiguous
 *                   stream and read from memory once per call, whatever B is.
 *   es_tail         gate, value, ShortConv (RMSNorm, dilated causal taps from the
 *                   conv ring, SiLU) and output for one token of one stream.
 *   es_gather       copy a token's H table rows (float32 / float16 / int8+scale).
 *
 * Written with GCC vector extensions and compiled twice through target_clones
 * (x86-64-v3 = AVX2+FMA+F16C, and the baseline), picked at load time: no -march
 * flag, so one build runs on any x86-64. Nothing here allocates or raises.
 */
#ifndef ENGRAM_STEP_H
#define ENGRAM_STEP_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(ES_NO_CLONES)
#define ES_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ES_CLONES
#endif
#define ES_INLINE static inline __attribute__((always_inline))

#define ES_PANEL 16 /* output columns per packed weight panel (two 8-lane vectors) */
#define ES_MR 6     /* rows per micro-tile: 6 x 2 accumulators + 3 temporaries = 15 registers */
#define ES_PACK_MIN_ROWS 12 /* from here on, rows are packed in 6-row tiles before the GEMM */
#define ES_EPS_KEY 1.1920928955078125e-07f /* float32 eps: torch RMSNorm default (eps=None) */
#define ES_EPS_CONV 1e-5f

typedef float es_v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t es_v8i __attribute__((vector_size(32), aligned(4)));

/* ---- skinny GEMM over packed panels ------------------------------------------ */

/* Packed layout: panel p holds columns [16p, 16p+16) of W^T as Wp[p][k][16]
 * (zero padded past M); biasp is padded to a multiple of 16 the same way. */

/* One micro-tile: mr rows x 16 columns over all E, row r's k-th value at X[r*xr + k*xk]
 * (rows as they are: xr = ldx, xk = 1; packed 6-row tiles: xr = 1, xk = 6, where the six
 * values of one k share a cache line: measured 1.3x at 126 rows).
 * pf: the next panel, prefetched line by line while this one computes (NULL: none):
 * a second memory stream in flight, as the GEMV gets from its four panels. */
ES_INLINE void es_tile(const float *X, int64_t xr, int64_t xk, const float *w, int E, const float *bias,
                       float *Y, int64_t ldy, int ncols, const int mr, const float *pf) {
    es_v8 acc[ES_MR][2];
    es_v8 b0 = *(const es_v8 *)bias, b1 = *(const es_v8 *)(bias + 8);
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) { acc[r][0] = b0; acc[r][1] = b1; }
    for (int k = 0; k < E; k++) {
        es_v8 w0 = *(const es_v8 *)(w + 16 * (int64_t)k), w1 = *(const es_v8 *)(w + 16 * (int64_t)k + 8);
        if (pf) __builtin_prefetch(pf + 16 * (int64_t)k);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            float x = X[r * xr + k * xk];
            acc[r][0] += x * w0;
            acc[r][1] += x * w1;
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        if (ncols == ES_PANEL) {
            *(es_v8 *)(Y + r * ldy) = acc[r][0];
            *(es_v8 *)(Y + r * ldy + 8) = acc[r][1];
        } else {
            float tmp[ES_PANEL];
            *(es_v8 *)tmp = acc[r][0];
            *(es_v8 *)(tmp + 8) = acc[r][1];
            memcpy(Y + r * ldy, tmp, sizeof(float) * ncols);
        }
    }
}

/* Xp[t][k][6] = X[6t + r][k] for the B/6 full tiles. */
static inline void es_pack_rows(const float *X, int64_t ldx, int64_t B, int E, float *Xp) {
    for (int64_t t = 0; t < B / ES_MR; t++)
        for (int k = 0; k < E; k++)
            for (int r = 0; r < ES_MR; r++) Xp[(t * E + k) * ES_MR + r] = X[(t * ES_MR + r) * ldx + k];
}

/* One row (a GEMV): four independent accumulator pairs hide the FMA latency. */
ES_INLINE void es_tile1(const float *x, const float *w, int E, const float *bias, float *y, int ncols) {
    es_v8 a0 = *(const es_v8 *)bias, a1 = *(const es_v8 *)(bias + 8);
    es_v8 c0 = {0}, c1 = {0}, d0 = {0}, d1 = {0}, f0 = {0}, f1 = {0};
    int k = 0;
    for (; k + 4 <= E; k += 4) {
        const float *wk = w + 16 * (int64_t)k;
        a0 += x[k] * *(const es_v8 *)(wk);
        a1 += x[k] * *(const es_v8 *)(wk + 8);
        c0 += x[k + 1] * *(const es_v8 *)(wk + 16);
        c1 += x[k + 1] * *(const es_v8 *)(wk + 24);
        d0 += x[k + 2] * *(const es_v8 *)(wk + 32);
        d1 += x[k + 2] * *(const es_v8 *)(wk + 40);
        f0 += x[k + 3] * *(const es_v8 *)(wk + 48);
        f1 += x[k + 3] * *(const es_v8 *)(wk + 56);
    }
    for (; k < E; k++) {
        a0 += x[k] * *(const es_v8 *)(w + 16 * (int64_t)k);
        a1 += x[k] * *(const es_v8 *)(w + 16 * (int64_t)k + 8);
    }
    a0 += c0 + d0 + f0;
    a1 += c1 + d1 + f1;
    float tmp[ES_PANEL];
    *(es_v8 *)tmp = a0;
    *(es_v8 *)(tmp + 8) = a1;
    memcpy(y, tmp, sizeof(float) * ncols);
}

/* A GEMV over four panels at once: four concurrent sequential streams keep more
 * memory requests in flight than one (measured: ~1.8x the bandwidth of one). */
ES_INLINE void es_gemv4(const float *x, int E, const float *w, const float *bias, float *y) {
    const int64_t PS = (int64_t)E * ES_PANEL; /* floats per panel */
    es_v8 a0 = *(const es_v8 *)(bias), a1 = *(const es_v8 *)(bias + 8);
    es_v8 b0 = *(const es_v8 *)(bias + 16), b1 = *(const es_v8 *)(bias + 24);
    es_v8 c0 = *(const es_v8 *)(bias + 32), c1 = *(const es_v8 *)(bias + 40);
    es_v8 d0 = *(const es_v8 *)(bias + 48), d1 = *(const es_v8 *)(bias + 56);
    for (int k = 0; k < E; k++) {
        const float xk = x[k];
        const float *wk = w + 16 * (int64_t)k;
        a0 += xk * *(const es_v8 *)(wk);
        a1 += xk * *(const es_v8 *)(wk + 8);
        b0 += xk * *(const es_v8 *)(wk + PS);
        b1 += xk * *(const es_v8 *)(wk + PS + 8);
        c0 += xk * *(const es_v8 *)(wk + 2 * PS);
        c1 += xk * *(const es_v8 *)(wk + 2 * PS + 8);
        d0 += xk * *(const es_v8 *)(wk + 3 * PS);
        d1 += xk * *(const es_v8 *)(wk + 3 * PS + 8);
    }
    *(es_v8 *)(y) = a0; *(es_v8 *)(y + 8) = a1;
    *(es_v8 *)(y + 16) = b0; *(es_v8 *)(y + 24) = b1;
    *(es_v8 *)(y + 32) = c0; *(es_v8 *)(y + 40) = c1;
    *(es_v8 *)(y + 48) = d0; *(es_v8 *)(y + 56) = d1;
}

/* Y = X W^T + bias over the panels [p0, p1). X rows are ldx floats apart: keep ldx*4
 * off multiples of 4 KiB (the engine pads rows by 16 floats), else the rows of a tile
 * alias one L1 set (measured 1.3-1.6x slower). Xp: X's full tiles packed by
 * es_pack_rows, or NULL. */
ES_CLONES static void es_gemm_range(const float *X, int64_t ldx, int64_t B, int E, const float *Wp,
                                    const float *biasp, int M, float *Y, int p0, int p1, const float *Xp) {
    int p = p0;
    if (B == 1) { /* one row: stream the weights four panels at a time */
        const int full = M / ES_PANEL < p1 ? M / ES_PANEL : p1;
        for (; p + 4 <= full; p += 4)
            es_gemv4(X, E, Wp + (int64_t)p * E * ES_PANEL, biasp + p * ES_PANEL, Y + p * ES_PANEL);
    }
    for (; p < p1; p++) { /* each panel is read from memory once; its row tiles reuse it from cache */
        const float *w = Wp + (int64_t)p * E * ES_PANEL;
        const float *bias = biasp + p * ES_PANEL;
        int ncols = M - p * ES_PANEL < ES_PANEL ? M - p * ES_PANEL : ES_PANEL;
        float *Yp = Y + p * ES_PANEL;
        const float *pf = p + 1 < p1 ? w + (int64_t)E * ES_PANEL : 0;
        int64_t b = 0;
        if (Xp)
            for (; b + ES_MR <= B; b += ES_MR, pf = 0)
                es_tile(Xp + b * E, 1, ES_MR, w, E, bias, Yp + b * M, M, ncols, ES_MR, pf);
        for (; b + ES_MR <= B; b += ES_MR, pf = 0)
            es_tile(X + b * ldx, ldx, 1, w, E, bias, Yp + b * M, M, ncols, ES_MR, pf);
        switch (B - b) {
            case 5: es_tile(X + b * ldx, ldx, 1, w, E, bias, Yp + b * M, M, ncols, 5, pf); break;
            case 4: es_tile(X + b * ldx, ldx, 1, w, E, bias, Yp + b * M, M, ncols, 4, pf); break;
            case 3: es_tile(X + b * ldx, ldx, 1, w, E, bias, Yp + b * M, M, ncols, 3, pf); break;
            case 2: es_tile(X + b * ldx, ldx, 1, w, E, bias, Yp + b * M, M, ncols, 2, pf); break;
            case 1: es_tile1(X + b * ldx, w, E, bias, Yp + b * M, ncols); break;
            default: break;
        }
    }
}

/* xpack: scratch of B*E floats for the packed rows (used from ES_PACK_MIN_ROWS rows), or NULL. */
static inline void es_gemm_packed(const float *X, int64_t ldx, int64_t B, int E, const float *Wp,
                                  const float *biasp, int M, float *Y, float *xpack) {
    if (xpack && B >= ES_PACK_MIN_ROWS) es_pack_rows(X, ldx, B, E, xpack);
    else xpack = 0;
    es_gemm_range(X, ldx, B, E, Wp, biasp, M, Y, 0, (M + ES_PANEL - 1) / ES_PANEL, xpack);
}

/* The same split over threads by panel ranges (prefill: many rows, worth the thread
 * start-up of ~50 us). A thread that cannot start runs its range inline. */
typedef struct {
    const float *X, *Wp, *biasp, *Xp;
    float *Y;
    int64_t ldx, B;
    int E, M, p0, p1;
} es_gemm_job;

static void *es_gemm_job_run(void *arg) {
    const es_gemm_job *j = (const es_gemm_job *)arg;
    es_gemm_range(j->X, j->ldx, j->B, j->E, j->Wp, j->biasp, j->M, j->Y, j->p0, j->p1, j->Xp);
    return 0;
}

#define ES_MAX_THREADS 16
static inline void es_gemm_packed_mt(const float *X, int64_t ldx, int64_t B, int E, const float *Wp,
                                     const float *biasp, int M, float *Y, float *xpack, int nthreads) {
    const int np = (M + ES_PANEL - 1) / ES_PANEL;
    if (nthreads > ES_MAX_THREADS) nthreads = ES_MAX_THREADS;
    if (nthreads > np) nthreads = np;
    if (nthreads <= 1) { es_gemm_packed(X, ldx, B, E, Wp, biasp, M, Y, xpack); return; }
    if (xpack && B >= ES_PACK_MIN_ROWS) es_pack_rows(X, ldx, B, E, xpack);
    else xpack = 0;
    es_gemm_job jobs[ES_MAX_THREADS];
    pthread_t tid[ES_MAX_THREADS];
    int started[ES_MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        es_gemm_job j = {X, Wp, biasp, xpack, Y, ldx, B, E, M, (int)((int64_t)np * i / nthreads),
                         (int)((int64_t)np * (i + 1) / nthreads)};
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
    int G, D, K, dil, conv_len;
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
 *   ring  [conv_len, G*D] this stream's normalized values; slot (pos - j) mod conv_len holds
 *                    x(t-j) for j = 1..conv_len, slot pos the oldest, overwritten with x(t)
 *   out   [G, D]     value + SiLU(conv)
 * Returns nothing and cannot fail; NaN/inf inputs propagate as the reference's do. */
ES_CLONES static void es_tail(const es_tail_params *P, const float *proj, const float *hid,
                              float *ring, int64_t pos, float *out) {
    const int G = P->G, D = P->D, K = P->K, L = P->conv_len;
    const int64_t C = (int64_t)G * D;
    const float *v = proj + C;
    int64_t slot[K > 1 ? K - 1 : 1]; /* ring slot read by tap i < K-1 */
    for (int i = 0; i < K - 1; i++) slot[i] = (pos + L - (int64_t)(K - 1 - i) * P->dil) % L;
    const float *wlast = P->cw + (int64_t)(K - 1) * C; /* the tap on x(t) itself */
    for (int g = 0; g < G; g++) {
        const float *k = proj + (int64_t)g * D, *h = hid + (int64_t)g * D;
        float sk, sh;
        es_sumsq2(k, h, D, &sk, &sh);
        const float rk = 1.0f / sqrtf(sk / D + ES_EPS_KEY), rh = 1.0f / sqrtf(sh / D + ES_EPS_KEY);
        float s = es_normdot(k, h, P->n1 + (int64_t)g * D, P->n2 + (int64_t)g * D, rk, rh, D) * P->inv_sqrt_d;
        /* sign(s) * sqrt(max(|s|, 1e-6)); s == 0 stays 0 and NaN stays NaN */
        s = s > 0 ? sqrtf(fmaxf(s, 1e-6f)) : (s < 0 ? -sqrtf(fmaxf(-s, 1e-6f)) : s);
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
                y += *(const es_v8 *)(P->cw + i * C + c) * *(const es_v8 *)(ring + slot[i] * C + c);
            if (L) *(es_v8 *)(ring + pos * C + c) = x;
            *(es_v8 *)(o + d) = vv + y / (1.0f + es_exp8(-y));
        }
        for (; d < D; d++) {
            const int64_t c = c0 + d;
            float vv = gate * v[d];
            float x = vv * r3 * w3[d];
            float y = wlast[c] * x;
            for (int i = 0; i < K - 1; i++) y += P->cw[i * C + c] * ring[slot[i] * C + c];
            if (L) ring[pos * C + c] = x;
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
ES_CLONES static void es_gather_f16(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) {
    for (int j = 0; j < H; j++) {
        const _Float16 *src = (const _Float16 *)(table + rows[j] * hd);
        float *dst = e + (int64_t)j * hd;
        for (int d = 0; d < hd; d++) dst[d] = (float)src[d];
    }
}

/* int8 rows with one float32 scale per row: value = q * scale. */
ES_CLONES static void es_gather_i8(const int8_t *table, const float *scale, int hd, const int64_t *rows,
                                   int H, float *e) {
    for (int j = 0; j < H; j++) {
        const int8_t *src = table + rows[j] * hd;
        const float s = scale[rows[j]];
        float *dst = e + (int64_t)j * hd;
        for (int d = 0; d < hd; d++) dst[d] = (float)src[d] * s;
    }
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
