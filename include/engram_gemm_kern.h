/* engram_gemm_kern.h: the skinny GEMM over packed panels, a template included by
 * engram_step_kern.h once per weight type inside each per-ISA copy. Before inclusion:
 *   ES_WT      the weight element: float, or uint16_t holding bfloat16 bits
 *   ES_WNAME   its name in the functions' names (f32, bf16): es_gemm_range_bf16_avx512, ...
 *   ES_W_BF16  1 for bfloat16: a weight vector is widened in registers (zero-extend, shift
 *              left 16: exact), so the math is float32 on the bf16 values and half the bytes
 * No include guard: including it again with other settings is the point; it undefines
 * these parameters at its end.
 */
#define ES_GF(name) ES_SF(ES_PATH_CAT(name, ES_WNAME))
#if ES_W_BF16
#define ES_GPN ES_GP_BF16 /* half the bytes per panel: more panels in flight */
#else
#define ES_GPN ES_GP
#endif
#if ES_W_BF16 && ES_VW == 16 && ES_X86_PATHS
/* 16 bf16 -> 16 floats in one AVX-512BW op: word 2i+1 of the result takes bf16 i, the even
 * words are zeroed by the mask (zero-extend and shift were two ops, one on the FMA port). */
typedef short ES_GF(es_vidx) __attribute__((vector_size(64)));
#define ES_LOADW(p)                                                                                              \
    ((ES_SF(es_vf))_mm512_maskz_permutexvar_epi16(                                                              \
        0xAAAAAAAAu,                                                                                            \
        (__m512i)(ES_GF(es_vidx)){0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7,                               \
                                  0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15},                        \
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p)))))
#elif ES_W_BF16 && ES_VW == 8 && ES_X86_PATHS
/* 8 bf16 -> 8 floats in one AVX2 op: the 16 bytes broadcast to both 128-bit lanes (a load,
 * no ALU op), then a byte shuffle puts bf16 i into the high half of float i, zeros below. */
typedef char ES_GF(es_vidx) __attribute__((vector_size(32)));
#define ES_LOADW(p)                                                                                              \
    ((ES_SF(es_vf))_mm256_shuffle_epi8(                                                                         \
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p))),                                     \
        (__m256i)(ES_GF(es_vidx)){-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7,      \
                                  -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15}))
#elif ES_W_BF16
typedef uint16_t ES_GF(es_vh) __attribute__((vector_size(ES_VW * 2), aligned(2)));
typedef uint32_t ES_GF(es_vu) __attribute__((vector_size(ES_VW * 4), aligned(4)));
#define ES_LOADW(p) ((ES_SF(es_vf))(__builtin_convertvector(*(const ES_GF(es_vh) *)(p), ES_GF(es_vu)) << 16))
#else
#define ES_LOADW(p) (*(const ES_SF(es_vf) *)(p))
#endif

/* One micro-tile: mr rows x tp panels over all E, row r's k-th value at X[r*xr + k*xk]
 * (rows as they are: xr = ldx, xk = 1; packed tiles: xr = 1, xk = ES_MR, where the values
 * of one k share a cache line: measured 1.3x at 126 rows). ps: floats per panel.
 * pf: the next tile's panels, prefetched into L2 line by line while this one computes (NULL:
 * none): a second memory stream in flight, as the GEMV gets from its panels; this tile
 * takes rows k = pk, pk + pfs, ... (the row tiles of a column share the rows between them;
 * into L2, not L1: measured ~4% less time on the 16-row step). */
ES_KI void ES_GF(es_tile)(const float *X, int64_t xr, int64_t xk, const ES_WT *w, int64_t ps, int E,
                          const float *bias, float *Y, int64_t ldy, int ncols, const int mr, const int tp,
                          const ES_WT *pf, int pk, const int pfs) {
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
        for (int c = 0; c < tc; c++) wv[c] = ES_LOADW(w + ES_WOFF(c, ps) + ES_PANEL * (int64_t)k);
        if (pf && k == pk) {
#pragma GCC unroll 4
            for (int q = 0; q < tp; q++) __builtin_prefetch(pf + q * ps + ES_PANEL * (int64_t)k, 0, 2);
            pk += pfs;
        }
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
ES_KI void ES_GF(es_tile1)(const float *x, const ES_WT *w, int64_t ps, int E, const float *bias, float *y,
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
            for (int c = 0; c < tc; c++) a[u][c] += x[k + u] * ES_LOADW(w + ES_WOFF(c, ps) + ES_PANEL * (int64_t)(k + u));
    for (; k < E; k++)
#pragma GCC unroll 4
        for (int c = 0; c < tc; c++) a[0][c] += x[k] * ES_LOADW(w + ES_WOFF(c, ps) + ES_PANEL * (int64_t)k);
#pragma GCC unroll 4
    for (int c = 0; c < tc; c++) a[0][c] += (a[1][c] + a[2][c]) + a[3][c];
    ES_SF(es_store_row)(y, a[0], tc, ncols);
}

/* A GEMV over ES_GPN full panels at once: concurrent sequential streams keep more memory
 * requests in flight than one (measured with four: ~1.8x the bandwidth of one). */
#if !ES_W_BF16
ES_KI void ES_GF(es_gemv)(const float *x, int E, const ES_WT *w, int64_t ps, const float *bias, float *y) {
    typedef ES_SF(es_vf) vf;
    vf a[ES_GPN * ES_NV];
#pragma GCC unroll 16
    for (int q = 0; q < ES_GPN * ES_NV; q++) a[q] = *(const vf *)(bias + q * ES_VW);
    for (int k = 0; k < E; k++) {
        const float xk = x[k];
#pragma GCC unroll 16
        for (int q = 0; q < ES_GPN * ES_NV; q++) a[q] += xk * ES_LOADW(w + ES_WOFF(q, ps) + ES_PANEL * (int64_t)k);
    }
#pragma GCC unroll 16
    for (int q = 0; q < ES_GPN * ES_NV; q++) *(vf *)(y + q * ES_VW) = a[q];
}

#else
/* The bf16 GEMV: a 32-bit word of a panel row holds two neighbouring columns' bf16 bits;
 * (word << 16) is the even column's float and (word & 0xffff0000) the odd one's, so two
 * ALU ops widen two columns a lane (zero-extend and shift took two per column: the GEMV
 * was bound by those, not by memory). Even and odd columns sum apart and are interleaved
 * at the end. With 16 lanes one 64-byte load holds rows k and k+1 of a panel: lanes 0-7
 * sum the even k, lanes 8-15 the odd k, added at the end (an odd last k: by scalars). */
typedef uint32_t ES_GF(es_vw) __attribute__((vector_size(ES_VW * 4), aligned(4)));
typedef int32_t ES_GF(es_vxi) __attribute__((vector_size(ES_VW * 4), aligned(4)));
#if ES_VW == 16
#define ES_BK 2                       /* k per load */
#define ES_BA 1                       /* word vectors per panel per load */
#else
#define ES_BK 1
#define ES_BA (ES_PANEL / 2 / ES_VW)  /* 8 words a panel row */
#endif
ES_KI void ES_GF(es_gemv)(const float *x, int E, const ES_WT *w, int64_t ps, const float *bias, float *y) {
    typedef ES_SF(es_vf) vf;
    typedef ES_GF(es_vw) vw;
    typedef ES_GF(es_vxi) vi;
    vf ev[ES_GPN * ES_BA], od[ES_GPN * ES_BA];
#pragma GCC unroll 16
    for (int q = 0; q < ES_GPN * ES_BA; q++) ev[q] = od[q] = (vf){0};
    vi hi = {0}; /* the lanes of row k + 1 (16 lanes) */
    for (int i = ES_VW / 2; i < ES_VW && ES_BK == 2; i++) hi[i] = -1;
    int k = 0;
    for (; k + ES_BK <= E; k += ES_BK) {
        vf xv = (vf){0} + x[k];
        if (ES_BK == 2) xv = (vf)(((vi)((vf){0} + x[k + ES_BK - 1]) & hi) | ((vi)xv & ~hi));
#pragma GCC unroll 16
        for (int q = 0; q < ES_GPN; q++)
#pragma GCC unroll 2
            for (int a = 0; a < ES_BA; a++) {
                const vw wv = *(const vw *)(w + q * ps + ES_PANEL * (int64_t)k + a * 2 * ES_VW);
                ev[q * ES_BA + a] += xv * (vf)(wv << 16);
                od[q * ES_BA + a] += xv * (vf)(wv & 0xffff0000u);
            }
    }
    for (int q = 0; q < ES_GPN; q++) {
        float e[ES_BA * ES_VW], o[ES_BA * ES_VW], *yq = y + q * ES_PANEL;
        for (int a = 0; a < ES_BA; a++) {
            *(vf *)(e + a * ES_VW) = ev[q * ES_BA + a];
            *(vf *)(o + a * ES_VW) = od[q * ES_BA + a];
        }
        for (int i = 0; i < ES_PANEL / 2; i++) { /* word i: columns 2i and 2i + 1 */
            float se = e[i], so = o[i];
            if (ES_BK == 2) { se += e[i + ES_PANEL / 2]; so += o[i + ES_PANEL / 2]; }
            yq[2 * i] = bias[q * ES_PANEL + 2 * i] + se;
            yq[2 * i + 1] = bias[q * ES_PANEL + 2 * i + 1] + so;
        }
        for (int kk = k; kk < E; kk++) /* the last k when E is odd (16 lanes) */
            for (int c = 0; c < ES_PANEL; c++) {
                uint32_t bits = (uint32_t)w[q * ps + ES_PANEL * (int64_t)kk + c] << 16;
                float f;
                memcpy(&f, &bits, sizeof f);
                yq[c] += x[kk] * f;
            }
    }
}
#undef ES_BK
#undef ES_BA
#endif

/* Every row of X through one tile column (tp panels at w): full ES_MR-row tiles (packed
 * ones from Xp when given), then the remainder as one smaller tile. */
ES_KI void ES_GF(es_tile_rows)(const float *X, int64_t ldx, int64_t B, int E, const float *Xp, const ES_WT *w,
                               int64_t ps, const float *bias, float *Yp, int M, int ncols, const ES_WT *pf,
                               const int tp) {
    /* the nt row tiles share the next panels' prefetch: tile t takes rows k = t mod nt, so the
     * reads ahead spread over the whole tile column instead of crowding its first tile */
    const int nt = (int)((B + ES_MR - 1) / ES_MR);
    int64_t b = 0;
    if (Xp)
        for (; b + ES_MR <= B; b += ES_MR)
            ES_GF(es_tile)(Xp + b * E, 1, ES_MR, w, ps, E, bias, Yp + b * M, M, ncols, ES_MR, tp, pf,
                           (int)(b / ES_MR), nt);
    for (; b + ES_MR <= B; b += ES_MR)
        ES_GF(es_tile)(X + b * ldx, ldx, 1, w, ps, E, bias, Yp + b * M, M, ncols, ES_MR, tp, pf, (int)(b / ES_MR),
                       nt);
    const float *Xb = X + b * ldx;
    float *Yb = Yp + b * M;
    switch (B - b) { /* a constant row count per case: the accumulators stay in registers */
#define ES_REM(n) \
    case n: if (n < ES_MR) ES_GF(es_tile)(Xb, ldx, 1, w, ps, E, bias, Yb, M, ncols, n < ES_MR ? n : 1, tp, pf, nt - 1, nt); break;
        ES_REM(2) ES_REM(3) ES_REM(4) ES_REM(5) ES_REM(6) ES_REM(7) ES_REM(8)
        ES_REM(9) ES_REM(10) ES_REM(11) ES_REM(12) ES_REM(13) ES_REM(14) ES_REM(15)
#undef ES_REM
        case 1: ES_GF(es_tile1)(Xb, w, ps, E, bias, Yb, ncols, tp); break;
        default: break;
    }
}

/* Y = X W^T + bias over the panels [p0, p1) (see es_gemm_range in engram_step.h). */
static ES_TGT void ES_GF(es_gemm_range)(const float *X, int64_t ldx, int64_t B, int E, const ES_WT *Wp,
                                        const float *biasp, int M, float *Y, int p0, int p1, const float *Xp) {
    const int64_t ps = (int64_t)E * ES_PANEL; /* floats per panel */
    int p = p0;
    if (B == 1) { /* one row: stream the weights ES_GPN panels at a time */
        const int full = M / ES_PANEL < p1 ? M / ES_PANEL : p1;
        for (; p + ES_GPN <= full; p += ES_GPN)
            ES_GF(es_gemv)(X, E, Wp + p * ps, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL);
    }
    while (p < p1) { /* each panel is read from memory once; its row tiles reuse it from cache */
        const int tp = p + ES_TP <= p1 ? ES_TP : 1;
        const ES_WT *w = Wp + p * ps;
        int ncols = M - p * ES_PANEL;
        if (ncols > tp * ES_PANEL) ncols = tp * ES_PANEL;
        const ES_WT *pf = p + tp < p1 ? w + tp * ps : 0;
        if (ES_TP > 1 && tp == ES_TP)
            ES_GF(es_tile_rows)(X, ldx, B, E, Xp, w, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL, M, ncols, pf, ES_TP);
        else
            ES_GF(es_tile_rows)(X, ldx, B, E, Xp, w, ps, biasp + p * ES_PANEL, Y + p * ES_PANEL, M, ncols, pf, 1);
        p += tp;
    }
}

#undef ES_LOADW
#undef ES_GPN
#undef ES_GF
#undef ES_WT
#undef ES_WNAME
#undef ES_W_BF16
