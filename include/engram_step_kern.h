/* engram_step_kern.h: the float kernels, a template included once per instruction set by
 * engram_step.h (see engram_isa.h). Before each inclusion:
 *   ES_SFX   the suffix of this copy's names (baseline, avx2, avx512)
 *   ES_TGT   its target attribute (empty for the baseline)
 *   ES_VW    floats per vector: 8 (32 bytes) or 16 (64 bytes, AVX-512)
 *   ES_TP    packed panels per GEMM micro-tile (a panel is ES_PANEL = 16 columns)
 *   ES_MR    rows per micro-tile: ES_MR x ES_TP*16/ES_VW accumulators stay in registers
 *   ES_GP    panels the one-row GEMV streams at once (concurrent memory streams)
 *   ES_F16C  1 where F16C converts half floats (x86 copies), 0 for the portable conversion
 * No include guard: including it again with other settings is the point.
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

/* One micro-tile: mr rows x tp panels over all E, row r's k-th value at X[r*xr + k*xk]
 * (rows as they are: xr = ldx, xk = 1; packed tiles: xr = 1, xk = ES_MR, where the values
 * of one k share a cache line: measured 1.3x at 126 rows). ps: floats per panel.
 * pf: the next tile's panels, prefetched line by line while this one computes (NULL:
 * none): a second memory stream in flight, as the GEMV gets from its panels. */
ES_KI void ES_SF(es_tile)(const float *X, int64_t xr, int64_t xk, const float *w, int64_t ps, int E,
                          const float *bias, float *Y, int64_t ldy, int ncols, const int mr, const int tp,
                          const float *pf) {
    typedef ES_SF(es_vf) vf;
    const int tc = tp * ES_NV;
    vf acc[ES_MR][ES_TP * ES_NV];
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int c = 0; c < tc; c++) acc[r][c] = *(const vf *)(bias + c * ES_VW);
    for (int k = 0; k < E; k++) {
        vf wv[ES_TP * ES_NV];
#pragma GCC unroll 4
        for (int c = 0; c < tc; c++) wv[c] = *(const vf *)(w + ES_WOFF(c, ps) + ES_PANEL * (int64_t)k);
        if (pf)
#pragma GCC unroll 4
            for (int q = 0; q < tp; q++) __builtin_prefetch(pf + q * ps + ES_PANEL * (int64_t)k);
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            const float x = X[r * xr + k * xk];
#pragma GCC unroll 4
            for (int c = 0; c < tc; c++) acc[r][c] += x * wv[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++) ES_SF(es_store_row)(Y + r * ldy, acc[r], tc, ncols);
}

/* One row over tp panels: four accumulator sets over k hide the FMA latency. */
ES_KI void ES_SF(es_tile1)(const float *x, const float *w, int64_t ps, int E, const float *bias, float *y,
                           int ncols, const int tp) {
    typedef ES_SF(es_vf) vf;
    const int tc = tp * ES_NV;
    vf a[4][ES_TP * ES_NV];
#pragma GCC unroll 4
    for (int c = 0; c < tc; c++) {
        a[0][c] = *(const vf *)(bias + c * ES_VW);
        a[1][c] = a[2][c] = a[3][c] = (vf){0};
    }
    int k = 0;
    for (; k + 4 <= E; k += 4)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
#pragma GCC unroll 4
            for (int c = 0; c < tc; c++) a[u][c] += x[k + u] * *(const vf *)(w + ES_WOFF(c, ps) + ES_PANEL * (int64_t)(k + u));
    for (; k < E; k++)
#pragma GCC unroll 4
        for (int c = 0; c < tc; c++) a[0][c] += x[k] * *(const vf *)(w + ES_WOFF(c, ps) + ES_PANEL * (int64_t)k);
#pragma GCC unroll 4
    for (int c = 0; c < tc; c++) a[0][c] += (a[1][c] + a[2][c]) + a[3][c];
    ES_SF(es_store_row)(y, a[0], tc, ncols);
}

/* A GEMV over ES_GP full panels at once: concurrent sequential streams keep more memory
 * requests in flight than one (measured with four: ~1.8x the bandwidth of one). */
ES_KI void ES_SF(es_gemv)(const float *x, int E, const float *w, int64_t ps, const float *bias, float *y) {
    typedef ES_SF(es_vf) vf;
    vf a[ES_GP * ES_NV];
#pragma GCC unroll 16
    for (int q = 0; q < ES_GP * ES_NV; q++) a[q] = *(const vf *)(bias + q * ES_VW);
    for (int k = 0; k < E; k++) {
        const float xk = x[k];
#pragma GCC unroll 16
        for (int q = 0; q < ES_GP * ES_NV; q++) a[q] += xk * *(const vf *)(w + ES_WOFF(q, ps) + ES_PANEL * (int64_t)k);
    }
#pragma GCC unroll 16
    for (int q = 0; q < ES_GP * ES_NV; q++) *(vf *)(y + q * ES_VW) = a[q];
}

/* Every row of X through one tile column (tp panels at w): full ES_MR-row tiles (packed
 * ones from Xp when given), then the remainder as one smaller tile. */
ES_KI void ES_SF(es_tile_rows)(const float *X, int64_t ldx, int64_t B, int E, const float *Xp, const float *w,
                               int64_t ps, const float *bias, float *Yp, int M, int ncols, const float *pf,
                               const int tp) {
    int64_t b = 0;
    if (Xp)
        for (; b + ES_MR <= B; b += ES_MR, pf = 0)
            ES_SF(es_tile)(Xp + b * E, 1, ES_MR, w, ps, E, bias, Yp + b * M, M, ncols, ES_MR, tp, pf);
    for (; b + ES_MR <= B; b += ES_MR, pf = 0)
        ES_SF(es_tile)(X + b * ldx, ldx, 1, w, ps, E, bias, Yp + b * M, M, ncols, ES_MR, tp, pf);
    const float *Xb = X + b * ldx;
    float *Yb = Yp + b * M;
    switch (B - b) { /* a constant row count per case: the accumulators stay in registers */
#define ES_REM(n) \
    case n: if (n < ES_MR) ES_SF(es_tile)(Xb, ldx, 1, w, ps, E, bias, Yb, M, ncols, n < ES_MR ? n : 1, tp, pf); break;
        ES_REM(2) ES_REM(3) ES_REM(4) ES_REM(5) ES_REM(6) ES_REM(7) ES_REM(8)
        ES_REM(9) ES_REM(10) ES_REM(11) ES_REM(12) ES_REM(13) ES_REM(14) ES_REM(15)
#undef ES_REM
        case 1: ES_SF(es_tile1)(Xb, w, ps, E, bias, Yb, ncols, tp); break;
        default: break;
    }
}

/* Y = X W^T + bias over the panels [p0, p1) (see es_gemm_range in engram_step.h). */
static ES_TGT void ES_SF(es_gemm_range)(const float *X, int64_t ldx, int64_t B, int E, const float *Wp,
                                        const float *biasp, int M, float *Y, int p0, int p1, const float *Xp) {
    const int64_t ps = (int64_t)E * ES_PANEL; /* floats per panel */
    int p = p0;
    if (B == 1) { /* one row: stream the weights ES_GP panels at a time */
        const int full = M / ES_PANEL < p1 ? M / ES_PANEL : p1;
        for (; p + ES_GP <= full; p += ES_GP)
            ES_SF(es_gemv)(X, E, Wp + p * ps, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL);
    }
    while (p < p1) { /* each panel is read from memory once; its row tiles reuse it from cache */
        const int tp = p + ES_TP <= p1 ? ES_TP : 1;
        const float *w = Wp + p * ps;
        int ncols = M - p * ES_PANEL;
        if (ncols > tp * ES_PANEL) ncols = tp * ES_PANEL;
        const float *pf = p + tp < p1 ? w + tp * ps : 0;
        if (ES_TP > 1 && tp == ES_TP)
            ES_SF(es_tile_rows)(X, ldx, B, E, Xp, w, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL, M, ncols, pf, ES_TP);
        else
            ES_SF(es_tile_rows)(X, ldx, B, E, Xp, w, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL, M, ncols, pf, 1);
        p += tp;
    }
}

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
