/* engram_step.h: the float kernels of one streaming step, shared by every engine.
 *
 *   es_gemm_packed  Y[B,M] = X[B,E] W^T + bias for skinny B (1..~128 rows), with W
 *                   pre-packed in 16-column panels so each panel is one contiguous
 *                   stream and read from memory once per call, whatever B is.
 *   es_tail_x/_y    gate, value, ShortConv (RMSNorm, causal taps over rows the caller
 *                   picks, SiLU) and output for one token of one stream. Stateless:
 *                   the conv state and its ring rules live in _engine.pyx.
 *   es_parallel     a range of independent items over threads (GEMM panels, tails, gathers):
 *                   the thread teams live in engram_team.h.
 *   es_gather       copy a token's H table rows (float32 / float16 / int8+scale).
 *
 * Written with GCC vector extensions (GCC, clang). The GEMM, the tail and the gathers are compiled
 * once per instruction set from engram_step_kern.h and picked by es_isa_now() (engram_isa.h):
 * one build runs on any CPU, and ENGRAM_STREAM_ISA / the tests can force each path.
 * Nothing here allocates or raises.
 */
#ifndef ENGRAM_STEP_H
#define ENGRAM_STEP_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engram_isa.h"
#include "engram_consts.h" /* ES_EPS_KEY, ES_EPS_CONV, ES_GATE_CLAMP */
#include "engram_team.h"   /* es_parallel, es_split, ES_MAX_THREADS: the splits over threads */
#if ES_X86_PATHS
#include <immintrin.h>
#endif


#define ES_PANEL 16 /* output columns per packed weight panel (16 floats: one 64-byte line a k) */
#define ES_TAIL_PF 512 /* floats a tail fetches ahead of each row it streams (es_tail_prefetch_head) */

/* The tail's fixed parameters (es_tail_x / es_tail_y below). */
typedef struct {
    int G, D, K;       /* K: conv taps; the first K-1 read earlier values, the last x(t) */
    float inv_sqrt_d;  /* 1/sqrt(D), the gate's scale */
    float eps_qk;      /* RMSNorm eps of the keys and the hidden (the demo: ES_EPS_KEY; Qwen: rms_norm_eps) */
    float eps_conv;    /* RMSNorm eps of the ShortConv input (the demo: ES_EPS_CONV) */
    const float *n1;   /* [G, D] key RMSNorm weights */
    const float *n2;   /* [G, D] hidden RMSNorm weights */
    const float *n3;   /* [G, D] ShortConv RMSNorm weights */
    const float *cw;   /* [K, G*D] conv taps, tap-major so a tap is contiguous over channels */
} es_tail_params;

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

/* bfloat16 at the engine's edges (a bf16 model's hidden in, its delta out): a bf16 is a float32's
 * top 16 bits, so widening is exact; narrowing rounds to nearest even, a NaN to the quiet NaN of
 * its sign (0x7fc0 | sign), as ml_dtypes (and so a bf16 array's astype) rounds. */
static inline float es_bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t es_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline void es_floats_to_bf16(const float *x, int64_t n, uint16_t *o) {
    for (int64_t i = 0; i < n; i++) o[i] = es_float_to_bf16(x[i]);
}
/* o = bf16(g * x): the float32 product, then rounded */
static inline void es_floats_to_bf16_scaled(const float *x, float g, int64_t n, uint16_t *o) {
    for (int64_t i = 0; i < n; i++) o[i] = es_float_to_bf16(g * x[i]);
}

/* ---- skinny GEMM over packed panels ------------------------------------------
 * Packed layout: panel p holds columns [16p, 16p+16) of W^T as Wp[p][k][16] (zero padded
 * past M); biasp is padded to a multiple of 16 the same way. Per-ISA copies follow:
 * tiles of ES_MR rows x ES_TP panels (baseline: 3 x 1 panel = 12 xmm accumulators of 16;
 * AVX2: 6 x 1 panel = 12 ymm; AVX-512: 8 x 2 panels = 16 zmm of 32; NEON: 6 x 1 panel = 24
 * of its 32 registers), and one-row GEMVs
 * over ES_GP panels at once. */
#define ES_PATH ES_ISA_BASELINE /* 16-byte vectors: SSE2 / NEON registers (wider ones spill there) */
#define ES_TP 1
#define ES_MR 3
#define ES_GP 2
#define ES_GP_BF16 2
#include "engram_step_kern.h"
#if ES_X86_PATHS
#define ES_PATH ES_ISA_AVX2
#define ES_TP 1
#define ES_MR 6
#define ES_GP 4
#define ES_GP_BF16 4
#include "engram_step_kern.h"
#define ES_PATH ES_ISA_AVX512
#define ES_TP 2
#define ES_MR 8
#define ES_GP 8
#define ES_GP_BF16 8
#include "engram_step_kern.h"
#endif
#if ES_NEON_PATHS
#define ES_PATH ES_ISA_NEON /* 32 vector registers: 6 x 1 panel = 24 accumulators, 4 weight vectors; the
                             * bf16 GEMV over 2 panels (4 spill: bench/inner_loops.py) */
#define ES_TP 1
#define ES_MR 6
#define ES_GP 4
#define ES_GP_BF16 2
#define ES_CHAINS 16
#include "engram_step_kern.h"
#endif

/* es_gemm_packed's wbf16 for bf16 weights whose rows are bf16 values too (the engines: a bf16 table). */
#define ES_GEMM_BF16_ROWS 2
#if ES_X86_PATHS || ES_NEON_PATHS
/* ---- the bf16 path's GEMM on vdpbf16ps (wbf16 == ES_GEMM_BF16_ROWS) ---------------------
 * When the weights are bf16 and the rows are too (a bf16 table: the gather widens them exactly,
 * so truncating them back is exact), the products of a dot product are exact in float32 and
 * vdpbf16ps does 32 of them an instruction, twice vfmadd's 16. Columns in the lanes, as the
 * float kernels: the 64 bytes of panel rows k and k+1 (16 columns each) are one vpermw from
 * 16 lanes of (w[k][c], w[k+1][c]) pairs, so the panels serve every path and no second copy of
 * the weights is packed; each row's pair (x[k], x[k+1]) is broadcast from es_pack_pairs' tiles.
 * In a lane: the odd k of a pair added first, each addition rounded, DAZ/FTZ (es8_dpbf16_lane):
 * only the order of the sums and subnormals differ from the float32 oracle. */
#define ES_DP_MR 8 /* rows per tile: 8 x ES_DP_TP panels = 16 of the 32 zmm accumulate (measured */
#define ES_DP_TP 2  /* against 16 x 1 and 12 x 2 on Zen 4: 2x and 1.9x faster at 16 rows) */

/* Xq: the rows as bf16 pairs (x[k] low half, x[k+1] high; an odd E's last pair padded with 0):
 * the B/ES_DP_MR full tiles as [t][k/2][ES_DP_MR], then the rest as [k/2][B % ES_DP_MR]:
 * B*ceil(E/2) words, within es_gemm_packed's B*E floats of scratch. */
static inline void es_pack_pairs_tiles(const float *X, int64_t ldx, int64_t B, int E, uint32_t *Xq, int64_t t0,
                                       int64_t t1) { /* the tiles [t0, t1): rows [t0, t1) * ES_DP_MR */
    const int kp = (E + 1) / 2;
    for (int64_t b0 = t0 * ES_DP_MR; b0 < B && b0 < t1 * ES_DP_MR; b0 += ES_DP_MR) {
        const int mr = B - b0 < ES_DP_MR ? (int)(B - b0) : ES_DP_MR;
        uint32_t *q = Xq + b0 * kp;
        for (int r = 0; r < mr; r++) {
            const float *x = X + (b0 + r) * ldx;
            for (int j = 0; j < kp; j++) {
                uint32_t lo, hi = 0;
                memcpy(&lo, x + 2 * j, sizeof lo);
                if (2 * j + 1 < E) memcpy(&hi, x + 2 * j + 1, sizeof hi);
                q[j * mr + r] = (lo >> 16) | (hi & 0xffff0000u);
            }
        }
    }
}
static inline void es_pack_pairs(const float *X, int64_t ldx, int64_t B, int E, uint32_t *Xq) {
    es_pack_pairs_tiles(X, ldx, B, E, Xq, 0, (B + ES_DP_MR - 1) / ES_DP_MR);
}
/* The same pairs straight from bf16 row records (a bf16 table: row b's H records at dp[b*H + h],
 * hd bf16 each, row b = the records side by side): a record's 32-bit word i is the pair of its
 * values 2i and 2i + 1 (little-endian: the first in the low half), so with hd even a pair is a
 * word copied, with no float32 rows written and read back between (the gather and es_pack_pairs
 * took ~7% of the LongCat prefill's time on one core); hd odd: value by value. Bits: those of
 * es_pack_pairs on the widened rows (the widening is exact and the pack truncates it back). */
static inline uint16_t es_record_bf16(const char *const *rec, int hd, int k) {
    uint16_t v;
    memcpy(&v, rec[k / hd] + 2 * (int64_t)(k % hd), sizeof v);
    return v;
}
#ifndef ES_PAIRS_PFD
#define ES_PAIRS_PFD 2 /* rows ahead whose records es_pack_pairs_records_tiles prefetches */
#endif
static inline void es_pack_pairs_records_tiles(const char *const *dp, int H, int hd, int64_t B, uint32_t *Xq,
                                               int64_t t0, int64_t t1) {
    const int E = H * hd, kp = (E + 1) / 2, hw = hd / 2;
    for (int64_t b0 = t0 * ES_DP_MR; b0 < B && b0 < t1 * ES_DP_MR; b0 += ES_DP_MR) {
        const int mr = B - b0 < ES_DP_MR ? (int)(B - b0) : ES_DP_MR;
        uint32_t *q = Xq + b0 * kp;
        for (int r = 0; r < mr; r++) {
            const char *const *rec = dp + (b0 + r) * H;
            if (b0 + r + ES_PAIRS_PFD < B) /* random rows: their lines requested ahead, many in flight */
                for (int h = 0; h < H; h++)
                    for (int64_t o = 0; o < 2 * (int64_t)hd; o += 64) __builtin_prefetch(rec[ES_PAIRS_PFD * H + h] + o, 0, 1);
            if (!(hd & 1)) {
                for (int h = 0; h < H; h++) {
                    const char *p = rec[h];
                    uint32_t *qh = q + (int64_t)h * hw * mr + r;
                    for (int i = 0; i < hw; i++) memcpy(qh + (int64_t)i * mr, p + 4 * (int64_t)i, sizeof(uint32_t));
                }
            } else {
                for (int j = 0; j < kp; j++) {
                    const uint32_t hi = 2 * j + 1 < E ? es_record_bf16(rec, hd, 2 * j + 1) : 0;
                    q[(int64_t)j * mr + r] = es_record_bf16(rec, hd, 2 * j) | hi << 16;
                }
            }
        }
    }
}
#endif
#include "engram_bfdot.h" /* neon_bf16: the same pairs on BFDOT */
#if ES_X86_PATHS

/* One tile: mr rows (pairs at xq, row r's pair j at xq[j*mr + r]) x tp panels over all E. */
static inline __attribute__((always_inline)) ES_TARGET_BF16 void es_dp_tile(
    const uint32_t *xq, const uint16_t *w, int64_t ps, int E, const float *bias, float *Y, int64_t ldy, int ncols,
    const int mr, const int tp, const uint16_t *pf, int pk, const int pfs) {
    typedef short vidx __attribute__((vector_size(64)));
    const __m512i idx = (__m512i)(vidx){0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512 acc[ES_DP_MR][ES_DP_TP];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
        for (int c = 0; c < tp; c++) acc[r][c] = _mm512_loadu_ps(bias + c * ES_PANEL);
    const int kp = E / 2;
    for (int j = 0; j <= kp; j++) {
        if (j == kp && !(E & 1)) break;
        __m512bh wv[ES_DP_TP];
#pragma GCC unroll 2
        for (int c = 0; c < tp; c++) {
            const uint16_t *p = w + c * ps + ES_PANEL * (int64_t)(2 * j);
            const __m512i v = j < kp ? _mm512_loadu_si512(p) /* an odd E's last row alone: no read past it */
                                     : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
            wv[c] = (__m512bh)_mm512_maskz_permutexvar_epi16(j < kp ? ~0u : 0x55555555u, idx, v);
        }
        if (pf && j == pk) { /* pk: a pair of panel rows, one 64-byte line */
#pragma GCC unroll 2
            for (int q = 0; q < tp; q++) __builtin_prefetch(pf + q * ps + ES_PANEL * (int64_t)(2 * pk), 0, 2);
            pk += pfs;
        }
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xq[j * mr + r]);
#pragma GCC unroll 2
            for (int c = 0; c < tp; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
        }
    }
    const __mmask16 m0 = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1);
    const __mmask16 m1 = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(Y + r * ldy, m0, acc[r][0]);
        if (tp > 1) _mm512_mask_storeu_ps(Y + r * ldy + ES_PANEL, m1, acc[r][1]);
    }
}

/* Every row through tp panels at w: the full tiles, then the rest as one smaller tile (its row
 * count a constant per case: the accumulators stay in registers). The tiles share the next
 * panels' prefetch as in es_tile_rows. */
static inline __attribute__((always_inline)) ES_TARGET_BF16 void es_dp_rows(
    const uint32_t *Xq, int64_t B, int E, const uint16_t *w, int64_t ps, const float *bias, float *Y, int M,
    int ncols, const uint16_t *pf, const int tp) {
    const int kp = (E + 1) / 2, nt = (int)((B + ES_DP_MR - 1) / ES_DP_MR);
    int64_t b = 0;
    for (; b + ES_DP_MR <= B; b += ES_DP_MR)
        es_dp_tile(Xq + b * kp, w, ps, E, bias, Y + b * M, M, ncols, ES_DP_MR, tp, pf, (int)(b / ES_DP_MR), nt);
    const uint32_t *xq = Xq + b * kp;
    float *Yb = Y + b * M;
    switch (B - b) {
#define ES_DP_REM(n) case n: es_dp_tile(xq, w, ps, E, bias, Yb, M, ncols, n, tp, pf, nt - 1, nt); break;
        ES_DP_REM(1) ES_DP_REM(2) ES_DP_REM(3) ES_DP_REM(4) ES_DP_REM(5) ES_DP_REM(6) ES_DP_REM(7)
#undef ES_DP_REM
        default: break;
    }
}

/* One row through ES_DP_GP full panels at w: each lane the tile's sums in the tile's order (bias,
 * then a vdpbf16ps a pair of k), so a row's bits do not depend on which kernel ran it or on the
 * split. The widening GEMV spends two ALU ops and two FMAs a 64-byte line, this a vpermw and one
 * vdpbf16ps: the one-stream step at LongCat's dims (18 MiB of panels, from L3) took 11-20% less
 * time on Zen 4; ES_DP_GP concurrent streams, each fetched ES_DP_PFD lines ahead (bench/NOTES.md). */
#define ES_DP_GP 8
#define ES_DP_PFD 16
static inline __attribute__((always_inline)) ES_TARGET_BF16 void es_dp_gemv(
    const uint32_t *xq, int E, const uint16_t *w, int64_t ps, const float *bias, float *y) {
    typedef short vidx __attribute__((vector_size(64)));
    const __m512i idx = (__m512i)(vidx){0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512 acc[ES_DP_GP];
    const char *wq[ES_DP_GP]; /* each panel's base and one byte offset: no address arithmetic to spill */
#pragma GCC unroll 8
    for (int q = 0; q < ES_DP_GP; q++) {
        acc[q] = _mm512_loadu_ps(bias + q * ES_PANEL);
        wq[q] = (const char *)(w + q * ps);
    }
    const int kp = E / 2;
    const int64_t end = (int64_t)kp * 64;
    for (int64_t off = 0; off < end; off += 64) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)*xq++);
#pragma GCC unroll 8
        for (int q = 0; q < ES_DP_GP; q++) {
            __builtin_prefetch(wq[q] + off + 64 * ES_DP_PFD, 0, 3);
            acc[q] = _mm512_dpbf16_ps(acc[q], xb,
                                      (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(wq[q] + off)));
        }
    }
    if (E & 1) { /* the last k alone, its pair's odd half zero (es_dp_tile) */
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)*xq);
#pragma GCC unroll 8
        for (int q = 0; q < ES_DP_GP; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + q * ps + ES_PANEL * (int64_t)(2 * kp)));
            acc[q] = _mm512_dpbf16_ps(acc[q], xb, (__m512bh)_mm512_maskz_permutexvar_epi16(
                                                      0x55555555u, idx, _mm512_castsi256_si512(v)));
        }
    }
#pragma GCC unroll 8
    for (int q = 0; q < ES_DP_GP; q++) _mm512_storeu_ps(y + q * ES_PANEL, acc[q]);
}

/* Y = X W^T + bias over the panels [p0, p1), X as es_pack_pairs left it in Xq. One row: the full
 * panels ES_DP_GP at a time, the rest (and a partial last panel) through the tiles. */
static ES_TARGET_BF16 void es_gemm_range_dp(const uint32_t *Xq, int64_t B, int E, const uint16_t *Wp,
                                            const float *biasp, int M, float *Y, int p0, int p1) {
    const int64_t ps = (int64_t)E * ES_PANEL;
    int p = p0;
    if (B == 1) {
        const int full = M / ES_PANEL < p1 ? M / ES_PANEL : p1;
        for (; p + ES_DP_GP <= full; p += ES_DP_GP)
            es_dp_gemv(Xq, E, Wp + p * ps, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL);
    }
    while (p < p1) {
        const int tp = p + ES_DP_TP <= p1 ? ES_DP_TP : 1;
        const uint16_t *w = Wp + p * ps;
        int ncols = M - p * ES_PANEL;
        if (ncols > tp * ES_PANEL) ncols = tp * ES_PANEL;
        const uint16_t *pf = p + tp < p1 ? w + tp * ps : 0;
        if (tp == ES_DP_TP) es_dp_rows(Xq, B, E, w, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL, M, ncols, pf, ES_DP_TP);
        else es_dp_rows(Xq, B, E, w, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL, M, ncols, pf, 1);
        p += tp;
    }
}
#endif

/* Rows per GEMM micro-tile of the running path (the packing of es_pack_rows). */
static inline int es_gemm_mr(void) {
    int mr;
    ES_ON_PATH(es_isa_now(), mr = es_mr_baseline, mr = es_mr_avx2, mr = es_mr_avx512, mr = es_mr_avx512,
               mr = es_mr_neon);  /* bf16: the avx512 copies */
    return mr;
}

/* Y = X W^T + bias over the panels [p0, p1). X rows are ldx floats apart: keep ldx*4
 * off multiples of 4 KiB (the engine pads rows by 16 floats), else the rows of a tile
 * alias one L1 set (measured 1.3-1.6x slower). Xp: X's full tiles packed by
 * es_pack_rows, or NULL; with wbf16 == ES_GEMM_DP the rows' pairs of es_pack_pairs. */
#define ES_GEMM_DP 3 /* es_gemm_mode's answer: the vdpbf16ps (or BFDOT) GEMM on pairs at Xp */
static inline void es_gemm_range(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                                 const float *biasp, int M, float *Y, int p0, int p1, const float *Xp) {
#if ES_X86_PATHS
    if (wbf16 == ES_GEMM_DP) {
        es_gemm_range_dp((const uint32_t *)Xp, B, E, (const uint16_t *)Wp, biasp, M, Y, p0, p1);
        return;
    }
#endif
#if ES_NEON_PATHS
    if (wbf16 == ES_GEMM_DP) {
        es_gemm_range_bfdot((const uint32_t *)Xp, B, E, (const uint16_t *)Wp, biasp, M, Y, p0, p1);
        return;
    }
#endif
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

/* The GEMM a call runs: wbf16 as the engine gives it (0 float32 weights, 1 bf16, ES_GEMM_BF16_ROWS
 * bf16 weights and bf16 rows), ES_GEMM_DP where the vdpbf16ps one runs: the bf16 path and scratch
 * to pack the rows in (one row too: es_dp_gemv reads the panels unwidened, and a row's bits are
 * the same in a call of any size); BFDOT's on neon_bf16 for two rows or more (one row: the GEMV). */
static inline int es_gemm_mode(int wbf16, int64_t B, const float *xpack) {
#if ES_X86_PATHS
    if (wbf16 == ES_GEMM_BF16_ROWS && B >= 1 && xpack && es_isa_now() == ES_ISA_BF16) return ES_GEMM_DP;
#endif
#if ES_NEON_PATHS
    if (wbf16 == ES_GEMM_BF16_ROWS && B >= 2 && xpack && es_isa_now() == ES_ISA_NEON_BF16) return ES_GEMM_DP;
#endif
    (void)B, (void)xpack;
    return wbf16 != 0;
}

/* Pack X into xpack (scratch of B*E floats) when it holds two tiles or more, or as pairs for
 * the vdpbf16ps GEMM (mode ES_GEMM_DP); else NULL. */
static inline const float *es_maybe_pack(const float *X, int64_t ldx, int64_t B, int E, float *xpack, int mode) {
#if ES_X86_PATHS || ES_NEON_PATHS
    if (mode == ES_GEMM_DP) {
        es_pack_pairs(X, ldx, B, E, (uint32_t *)xpack);
        return xpack;
    }
#endif
    (void)mode;
    const int mr = es_gemm_mr();
    if (!xpack || B < 2 * mr) return 0;
    es_pack_rows(X, ldx, B, E, xpack, mr);
    return xpack;
}

/* Wp: float32 panels (wbf16 0), or bfloat16 bits (uint16_t; wbf16 1, or ES_GEMM_BF16_ROWS when
 * every row is a bf16 value). xpack: scratch of B*E floats for the packed rows, or NULL. */
static inline void es_gemm_packed(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                                  const float *biasp, int M, float *Y, float *xpack) {
    const int mode = es_gemm_mode(wbf16, B, xpack);
    es_gemm_range(X, ldx, B, E, Wp, mode, biasp, M, Y, 0, (M + ES_PANEL - 1) / ES_PANEL,
                  es_maybe_pack(X, ldx, B, E, xpack, mode));
}

#if ES_X86_PATHS
/* The bf16 path's multiply-add: 12 chains of vdpbf16ps zmm (32 bf16 products each), n rounds;
 * returns the multiply-adds done, their sum in *sink. */
static ES_TARGET_BF16 int64_t es_dpbf16_chains(int64_t n, float *sink) {
    __m512 a[12];
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380); /* 1, 2^-24 */
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t k = 0; k < n; k++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y);
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    *(volatile float *)sink = _mm512_reduce_add_ps(s); /* a store the compiler must do: the loop stays */
    return n * 12 * 32;
}
#endif

/* The running path's register-only FMA rate (es_fma_chains in engram_step_kern.h; bf16: the
 * avx512 one, the demo's kernels being those): n rounds; returns the float multiply-adds done,
 * their sum in *sink. */
static inline int64_t es_fma_chains(int64_t n, float *sink) {
    int64_t done = 0;
    ES_DISPATCH(done = es_fma_chains, (n, sink));
    return done;
}

/* es_gemm_packed split over threads by panel ranges: bitwise equal to one thread (a column's
 * sums do not depend on which tile computes it; one row, B = 1, takes the GEMV in runs of ES_GP
 * panels from the range's start: its pieces are whole runs of ES_GEMV_RUN panels, a multiple of
 * every path's ES_GP, so the runs are one thread's). The vdpbf16ps GEMM's rows are packed
 * in pieces of row tiles on the same threads. */
#define ES_GEMV_RUN 8
typedef struct {
    const float *X;
    const void *Wp;
    const float *biasp, *Xp;
    float *Y;
    int64_t ldx, B;
    int E, M, wbf16;
} es_gemm_job;

static void es_gemm_job_run(void *arg, int64_t p0, int64_t p1) {
    const es_gemm_job *j = (const es_gemm_job *)arg;
    es_gemm_range(j->X, j->ldx, j->B, j->E, j->Wp, j->wbf16, j->biasp, j->M, j->Y, (int)p0, (int)p1, j->Xp);
}

#if ES_X86_PATHS || ES_NEON_PATHS
static void es_pack_pairs_job_run(void *arg, int64_t t0, int64_t t1) {
    const es_gemm_job *j = (const es_gemm_job *)arg;
    es_pack_pairs_tiles(j->X, j->ldx, j->B, j->E, (uint32_t *)j->Xp, t0, t1);
}
#endif

/* The GEMM of j (its rows packed as its mode reads them) over the threads in pieces of panels:
 * of whole ES_TP-panel tiles (a tile of fewer panels is slower); one row's, of whole GEMV runs;
 * the pairs GEMM's, of whole ES_DP_TP-panel tiles, ~32 a thread: a split ends when its last
 * piece does, and with ~8 pieces a thread (0.7 ms each at LongCat's 128-row chunk on Zen 4) the
 * other thread idled half a piece a chunk on average. */
static inline void es_gemm_split(es_gemm_job *j, int nthreads, es_team *team) {
    const int64_t np = (j->M + ES_PANEL - 1) / ES_PANEL;
    int64_t grain;
    if (j->B == 1) {
        grain = (np + 8 * (int64_t)nthreads - 1) / (8 * (int64_t)nthreads);
        grain = (grain + ES_GEMV_RUN - 1) / ES_GEMV_RUN * ES_GEMV_RUN;
    } else if (j->wbf16 == ES_GEMM_DP) {
        grain = (np + 32 * (int64_t)nthreads - 1) / (32 * (int64_t)nthreads);
        grain = (grain + 1) & ~(int64_t)1;
    } else {
        grain = (np + 8 * (int64_t)nthreads - 1) / (8 * (int64_t)nthreads);
        grain = (grain + 3) & ~(int64_t)3;
    }
    es_split(team, nthreads, np, grain, es_gemm_job_run, j);
}

static inline void es_gemm_packed_mt(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                                     const float *biasp, int M, float *Y, float *xpack, int nthreads,
                                     es_team *team) {
    if (nthreads <= 1) { es_gemm_packed(X, ldx, B, E, Wp, wbf16, biasp, M, Y, xpack); return; }
    const int mode = es_gemm_mode(wbf16, B, xpack);
    es_gemm_job j = {X, Wp, biasp, 0, Y, ldx, B, E, M, mode};
#if ES_X86_PATHS || ES_NEON_PATHS
    if (mode == ES_GEMM_DP && B > ES_DP_MR) { /* the tiles' pairs packed on the threads too */
        j.Xp = xpack;
        es_split(team, nthreads, (B + ES_DP_MR - 1) / ES_DP_MR, 1, es_pack_pairs_job_run, &j);
    } else
#endif
        j.Xp = es_maybe_pack(X, ldx, B, E, xpack, mode);
    es_gemm_split(&j, nthreads, team);
}

#if ES_X86_PATHS || ES_NEON_PATHS
typedef struct {
    const char *const *dp;
    uint32_t *Xq;
    int64_t B;
    int H, hd;
} es_pairs_records_job;

static void es_pairs_records_job_run(void *arg, int64_t t0, int64_t t1) {
    const es_pairs_records_job *j = (const es_pairs_records_job *)arg;
    es_pack_pairs_records_tiles(j->dp, j->H, j->hd, j->B, j->Xq, t0, t1);
}
#endif

/* es_gemm_packed_mt on the rows of bf16 row records (dp as es_pack_pairs_records_tiles reads
 * them, E = H*hd) where it runs the pairs GEMM (mode ES_GEMM_DP: wbf16 ES_GEMM_BF16_ROWS on the
 * bf16 or neon_bf16 path): the pairs packed from the records on the threads, then the GEMM; the
 * same bits as gathering the rows to float32 and calling es_gemm_packed_mt. Returns 0, having
 * done nothing, where another mode runs: the caller gathers the rows and calls that. */
static inline int es_gemm_records_mt(const char *const *dp, int H, int hd, int64_t B, const void *Wp, int wbf16,
                                     const float *biasp, int M, float *Y, float *xpack, int nthreads,
                                     es_team *team) {
#if ES_X86_PATHS || ES_NEON_PATHS
    if (es_gemm_mode(wbf16, B, xpack) != ES_GEMM_DP) return 0;
    const int E = H * hd;
    es_pairs_records_job pj = {dp, (uint32_t *)xpack, B, H, hd};
    const int64_t nt = (B + ES_DP_MR - 1) / ES_DP_MR;
    es_split(team, nthreads > 1 && B > ES_DP_MR ? nthreads : 1, nt, 1, es_pairs_records_job_run, &pj);
    es_gemm_job j = {0, Wp, biasp, xpack, Y, 0, B, E, M, ES_GEMM_DP};
    es_gemm_split(&j, nthreads, team);
    return 1;
#else
    (void)dp, (void)H, (void)hd, (void)B, (void)Wp, (void)wbf16, (void)biasp, (void)M, (void)Y, (void)xpack;
    (void)nthreads, (void)team;
    return 0;
#endif
}

/* ---- the per-token tail ----------------------------------------------------------
 * Two halves per token (per-ISA copies in engram_step_kern.h):
 *   es_tail_x  gate[G] and x(t) = rms3(gate * v) [G*D] from the projections and hidden
 *   es_tail_y  out = gate * v + SiLU(conv): the taps on x(t) and K-1 earlier rows
 * x(t) depends only on the token (not on the conv state), so a prefill computes every
 * token's x first and then every token's conv, each half split over threads; a step runs
 * both halves per stream. The hidden and out are float32, or bfloat16 bits where hbf / obf
 * (a bf16 model's): the hidden widened as it is loaded, the out rounded as it is stored (the
 * same sums as float32; the choice is made once per stream row, outside the loops). */
static inline void es_tail_x(const es_tail_params *P, const float *proj, const void *hid, int hbf, float *x,
                             float *gate) {
    ES_DISPATCH(es_tail_x, (P, proj, hid, hbf, x, gate));
}

/* taps[K-1]: the rows tap i reads (x(t - (K-1-i)*dil), the caller's rule); x: x(t); xdst:
 * where x(t) is copied (NULL: nowhere), which may be taps[0] (read before written). */
static inline void es_tail_y(const es_tail_params *P, const float *proj, const float *gate,
                             const float *const *taps, const float *x, float *xdst, void *out, int obf) {
    ES_DISPATCH(es_tail_y, (P, proj, gate, taps, x, xdst, out, obf));
}

/* A block of n tails, token (or stream) i reading proj Y + i*ldy, hid + i*C elements, and
 * writing out + i*C elements, x(t) at X + i*C, its gates at gates + i*G; its taps at
 * taps[i*(K-1) ..]; xdst[i] (xdst NULL: nowhere). hbf / obf: hid / out hold bfloat16. */
typedef struct {
    const es_tail_params *P;
    const float *Y;
    int64_t ldy;
    const char *hid;
    char *out;
    float *X, *gates;
    const float *const *taps;
    float *const *xdst;
    int hbf, obf;
} es_tails_job;

static void es_tails_x_run(void *arg, int64_t i0, int64_t i1) {
    const es_tails_job *j = (const es_tails_job *)arg;
    const int64_t C = (int64_t)j->P->G * j->P->D, hb = j->hbf ? 2 : 4;
    for (int64_t i = i0; i < i1; i++)
        es_tail_x(j->P, j->Y + i * j->ldy, j->hid + i * C * hb, j->hbf, j->X + i * C, j->gates + i * j->P->G);
}

static void es_tails_y_run(void *arg, int64_t i0, int64_t i1) {
    const es_tails_job *j = (const es_tails_job *)arg;
    const int64_t C = (int64_t)j->P->G * j->P->D, ob = j->obf ? 2 : 4;
    for (int64_t i = i0; i < i1; i++)
        es_tail_y(j->P, j->Y + i * j->ldy, j->gates + i * j->P->G, j->taps + i * (j->P->K - 1), j->X + i * C,
                  j->xdst ? j->xdst[i] : 0, j->out + i * C * ob, j->obf);
}

/* A tail's rows come cold (the GEMM's weight stream has passed through the caches), and each
 * group's 4 KiB of a row starts a new page, where the hardware's stream prefetch starts over:
 * the tail kernels fetch ES_TAIL_PF floats ahead of each row they stream, and this fetches the
 * first ES_TAIL_PF floats of token i's rows before its tail starts (the 16 tails of a step,
 * Zen 5, one thread: 98 -> 72 us; bench/NOTES.md). */
static inline void es_tail_prefetch_head(const es_tails_job *j, int64_t i) {
    const int64_t C = (int64_t)j->P->G * j->P->D;
    const int k1 = j->P->K - 1;
    const int64_t hb = j->hbf ? 2 : 4, ob = j->obf ? 2 : 4;
    for (int64_t b = 0; b < ES_TAIL_PF && b < C; b += 16) {
        __builtin_prefetch(j->Y + i * j->ldy + b, 0, 3);
        __builtin_prefetch(j->hid + (i * C + b) * hb, 0, 3);
        for (int t = 0; t < k1; t++) __builtin_prefetch(j->taps[i * k1 + t] + b, 0, 3);
        __builtin_prefetch(j->out + (i * C + b) * ob, 1, 3);
    }
}

static void es_tails_xy_run(void *arg, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        es_tail_prefetch_head((const es_tails_job *)arg, i);
        es_tails_x_run(arg, i, i + 1);
        es_tails_y_run(arg, i, i + 1);
    }
}

/* chained = 0: the n tails are independent (one token per stream: x then conv per item);
 * chained = 1: tail i may read the x of an earlier one (a prefill): over threads all x first,
 * then the convs; on one thread x then conv token by token, in order (the same bits). */
static inline void es_tails_mt(const es_tail_params *P, int64_t n, const float *Y, int64_t ldy, const void *hid,
                               int hbf, void *out, int obf, float *X, float *gates, const float *const *taps,
                               float *const *xdst, int chained, int nthreads, es_team *team) {
    es_tails_job j = {P, Y, ldy, (const char *)hid, (char *)out, X, gates, taps, xdst, hbf, obf};
    if (chained && nthreads > 1) { /* (one thread: token by token below, its rows still in cache) */
        es_split(team, nthreads, n, 0, es_tails_x_run, &j);
        es_split(team, nthreads, n, 0, es_tails_y_run, &j);
    } else {
        es_split(team, nthreads, n, 0, es_tails_xy_run, &j);
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

/* bfloat16 tables (the top 16 bits of a float32), widened to float32: exact. */
static inline void es_gather_bf16(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) {
    for (int j = 0; j < H; j++) {
        const uint16_t *src = table + rows[j] * hd;
        float *dst = e + (int64_t)j * hd;
        for (int d = 0; d < hd; d++) {
            const uint32_t bits = (uint32_t)src[d] << 16;
            memcpy(dst + d, &bits, sizeof bits);
        }
    }
}

/* int8 rows with one float32 scale per row: value = q * scale. */
static inline void es_gather_i8(const int8_t *table, const float *scale, int hd, const int64_t *rows, int H,
                                float *e) {
    ES_DISPATCH(es_gather_i8, (table, scale, hd, rows, H, e));
}

/* n tokens' rows (rows[i*H ..]) into e + i*lde, split over threads. kind: 0 float32,
 * 1 float16, 2 int8 + per-row scale, 3 bfloat16. */
typedef struct {
    const void *table;
    const float *scale;
    const int64_t *rows;
    float *e;
    int64_t lde;
    int kind, hd, H;
} es_gather_job;

static void es_gather_job_run(void *arg, int64_t i0, int64_t i1) {
    const es_gather_job *j = (const es_gather_job *)arg;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t *r = j->rows + i * j->H;
        float *e = j->e + i * j->lde;
        if (j->kind == 0) es_gather_f32((const float *)j->table, j->hd, r, j->H, e);
        else if (j->kind == 1) es_gather_f16((const uint16_t *)j->table, j->hd, r, j->H, e);
        else if (j->kind == 3) es_gather_bf16((const uint16_t *)j->table, j->hd, r, j->H, e);
        else es_gather_i8((const int8_t *)j->table, j->scale, j->hd, r, j->H, e);
    }
}

static inline void es_gather_mt(int kind, const void *table, const float *scale, int hd, const int64_t *rows, int H,
                                int64_t n, float *e, int64_t lde, int nthreads) {
    es_gather_job j = {table, scale, rows, e, lde, kind, hd, H};
    es_parallel_pieces(nthreads, n, 0, es_gather_job_run, &j);
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
