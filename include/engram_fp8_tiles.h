/* engram_fp8_tiles.h: the many-token projection of the 512-bit paths (avx512, bf16) once their
 * rows are widened: the micro-kernel with tokens in the lanes and the blocking of a row group
 * over k blocks, token vectors and row tiles. A template included once per path by
 * engram_fp8.h. The two paths differ only in the multiply-add on a 4-byte unit of k: avx512 a
 * float32 weight broadcast into vfmadd with 16 tokens' values, bf16 a pair of bf16 weights
 * broadcast into vdpbf16ps with 16 tokens' pairs. The names' suffix and the target attribute
 * come from ES_PATH (ES_ISA_AVX512, ES_ISA_BF16) through engram_path.h: es8_xtile_avx512,
 * es8_tiles_bf16. Before inclusion engram_fp8.h sets ES_PATH and:
 *   ES8_KPU     k per 4-byte unit: 1 (float32) or 2 (a bf16 pair)
 *   ES8_KPAD    a k block's units cover its k rounded up to this (1; bf16: 64, the widening's chunk)
 *   ES8_TW      the type of a unit of the widened rows (float, uint32_t) and ES8_TX of the tokens
 *   ES8_XLOAD(p)         16 tokens' units at p, a vector
 *   ES8_WB(p)            the unit at p broadcast to 16 lanes
 *   ES8_MAC(acc, x, wb)  acc plus the products of x and wb (the path's multiply-add)
 * No include guard: including it again with other settings is the point; it undefines these
 * parameters at its end.
 */
#include "engram_path.h"
#define ES8_KU (ES8_KBLOCK / ES8_KPU) /* units per widened row of a k block */

/* R widened rows (w, ES8_KU units apart) x V vectors of 16 tokens (xt: packed [unit][16] per
 * vector, vectors ldv units apart) over n units of k: each weight unit is broadcast into a
 * multiply-add with the 16 tokens' units at its k, so a loaded byte feeds 4x more lanes than
 * along k. part: R x 16V partial sums (row stride ldp) carried across k blocks; y: after the
 * last block, the nt valid tokens' sums, y[t*ldy + r] (t < nt), else NULL. pf: the next
 * group's bytes, 4 KiB requested over a block of 256 k (its widening then reads L2), or NULL. */
ES_KI void ES_SF(es8_xtile)(const ES8_TW *w, const int R, const ES8_TX *xt, int64_t ldv, const int V, int n,
                            float *part, int64_t ldp, int first, float *y, int64_t ldy, int64_t nt,
                            const uint8_t *pf) {
    __m512 acc[16][2];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * ldp + v * 16);
    for (int i = 0; i < n; i++) {
        if (pf && !(i & (4 / ES8_KPU - 1))) _mm_prefetch((const char *)pf + i * 16 * ES8_KPU, _MM_HINT_T1);
        __typeof__(ES8_XLOAD(xt)) xv[2];
#pragma GCC unroll 2
        for (int v = 0; v < V; v++) xv[v] = ES8_XLOAD(xt + v * ldv + i * 16);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __typeof__(ES8_WB(w)) wb = ES8_WB(w + r * ES8_KU + i);
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) acc[r][v] = ES8_MAC(acc[r][v], xv[v], wb);
        }
    }
    if (!y) {
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 2
            for (int v = 0; v < V; v++) _mm512_storeu_ps(part + r * ldp + v * 16, acc[r][v]);
        return;
    }
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)ldy));
#pragma GCC unroll 2
    for (int v = 0; v < V; v++) {
        const int64_t left = nt - v * 16;
        const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) _mm512_mask_i32scatter_ps(y + v * 16 * ldy + r, m, idx, acc[r][v], 4);
    }
}

/* One group's R <= 32 widened rows, the k blocks from kb0 (a multiple of ES8_KBLOCK) to kb1
 * (wf: the block at k0 at wf + 32*(k0 - kb0)/ES8_KPU, its row r at + r*ES8_KU) times S >=
 * ES8_XT_MIN tokens (xt: 16 a vector, E's units apart): over k blocks of ES8_KBLOCK (a block
 * of widened rows and a token tile stay in L1), pairs of token vectors (an odd last one
 * alone), row tiles of ES8_XT_ROWS x two vectors or 16 x one. part: this thread's [32, S
 * rounded up to 16] partial sums, carried from call to call over the blocks of one group;
 * y[t*ldy + r] after the last; the nnext bytes at next are prefetched while these rows compute. */
static ES_TGT void ES_SF(es8_tiles)(const ES8_TW *wf, int R, const ES8_TX *xt, int64_t S, int E, int kb0, int kb1,
                                    float *part, float *y, int64_t ldy, const uint8_t *next, int64_t nnext) {
    const uint8_t *pf = next, *pf_end = next + nnext;
#define ES8_PF (pf < pf_end ? (pf += 4096) - 4096 : 0)
#define ES8_UNITS(k) ((int64_t)((k) + ES8_KPAD - 1) / ES8_KPAD * ES8_KPAD / ES8_KPU)
    const int64_t nv = (S + 15) / 16, ldp = nv * 16, ldv = ES8_UNITS(E) * 16;
    const int VV = nv > 1 ? 2 : 1, RB = VV == 2 ? ES8_XT_ROWS : 16;
#define ES8_X(rows, v) case rows: ES_SF(es8_xtile)(wr, rows, x, ldv, v, n, pr, ldp, first, yr, ldy, nt, ES8_PF); break;
    for (int k0 = kb0; k0 < kb1; k0 += ES8_KBLOCK) {
        const int kw = E - k0 < ES8_KBLOCK ? E - k0 : ES8_KBLOCK, first = k0 == 0, n = (int)ES8_UNITS(kw);
        const ES8_TW *wb = wf + (int64_t)ES8_BLOCK * (k0 - kb0) / ES8_KPU;
        for (int64_t j0 = 0, V; j0 < nv; j0 += V) {
            V = nv - j0 < VV ? 1 : VV;  /* an odd last vector alone */
            const ES8_TX *x = xt + j0 * ldv + (int64_t)k0 / ES8_KPU * 16;
            const int64_t nt = S - j0 * 16;
            for (int r = 0; r < R; r += RB) {
                const int rows = R - r < RB ? R - r : RB;
                const ES8_TW *wr = wb + (int64_t)r * ES8_KU;
                float *pr = part + r * ldp + j0 * 16, *yr = k0 + kw == E ? y + j0 * 16 * ldy + r : 0;
                if (V == 2) {
                    switch (rows) { ES8_X(1, 2) ES8_X(2, 2) ES8_X(3, 2) ES8_X(4, 2) ES8_X(5, 2) ES8_X(6, 2)
                                    ES8_X(7, 2) ES8_X(8, 2) ES8_X(9, 2) ES8_X(10, 2) ES8_X(11, 2)
                                    ES8_X(12, 2) default: break; }
                } else {
                    switch (rows) { ES8_X(1, 1) ES8_X(2, 1) ES8_X(3, 1) ES8_X(4, 1) ES8_X(5, 1) ES8_X(6, 1)
                                    ES8_X(7, 1) ES8_X(8, 1) ES8_X(9, 1) ES8_X(10, 1) ES8_X(11, 1)
                                    ES8_X(12, 1) ES8_X(13, 1) ES8_X(14, 1) ES8_X(15, 1) ES8_X(16, 1)
                                    default: break; }
                }
            }
        }
    }
#undef ES8_X
#undef ES8_UNITS
#undef ES8_PF
}

#undef ES8_KU
#undef ES8_KPU
#undef ES8_KPAD
#undef ES8_TW
#undef ES8_TX
#undef ES8_XLOAD
#undef ES8_WB
#undef ES8_MAC
#include "engram_path_end.h"
