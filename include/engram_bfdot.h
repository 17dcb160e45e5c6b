/* engram_bfdot.h: the neon_bf16 path's GEMM of bf16 weights on bf16 rows, on BFDOT (ARMv8.6
 * FEAT_BF16; included by engram_step.h in aarch64 builds).
 *
 * The aarch64 twin of es_gemm_range_dp (engram_step.h): columns in the lanes, rows packed once
 * per GEMM as bf16 pairs by es_pack_pairs (the same [t][k/2][ES_DP_MR] layout), weights read from
 * the float kernels' panels (rows k and k+1 of 8 columns zipped into 8 bf16 pairs in registers:
 * no second copy of the weights). A tile is ES_DP_MR = 8 rows x 8 columns: 16 accumulators, two
 * vectors of the 8 rows' pairs (BFDOT's lane form broadcasts each row's pair), 16 BFDOTs per
 * pair of k against 6 loads and zips.
 * BFDOT without FEAT_EBF16 (the Arm ARM's BFDotAdd; qemu's bfdotadd) adds a pair's two exact
 * products, then that sum to the lane, each addition rounded to odd, denormal inputs and
 * results flushed to zero: other bits than vdpbf16ps's, within the same tolerance of the oracle
 * (DESIGN.md section 9; tests/kernels/test_bfdot_path.py emulates it bit for bit).
 * Compiled with the +bf16 target per function: the rest of the build runs on any ARMv8-A, and
 * es_isa_cpu_best offers the path only where getauxval(AT_HWCAP2) has HWCAP2_BF16. */
#ifndef ENGRAM_BFDOT_H
#define ENGRAM_BFDOT_H
#if ES_NEON_PATHS

/* One tile: mr rows (pairs at xq, row r's pair j at xq[j*mr + r]) x 8 columns of the panel at w
 * (ncols of them stored) over all E. */
static inline __attribute__((always_inline)) ES_TARGET_NEON_BF16 void es_bfdot_tile(
    const uint32_t *xq, const uint16_t *w, int E, const float *bias, float *Y, int64_t ldy, int ncols, const int mr) {
    float32x4_t acc[ES_DP_MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r][0] = vld1q_f32(bias), acc[r][1] = vld1q_f32(bias + 4);
    const int kp = E / 2;
    for (int j = 0; j <= kp; j++) {
        if (j == kp && !(E & 1)) break;
        const uint16x8_t w0 = vld1q_u16(w + ES_PANEL * (int64_t)(2 * j));
        const uint16x8_t w1 = j < kp ? vld1q_u16(w + ES_PANEL * (int64_t)(2 * j + 1)) : vdupq_n_u16(0); /* odd E */
        const bfloat16x8_t lo = vreinterpretq_bf16_u16(vzip1q_u16(w0, w1));  /* columns 0..3: (w[k], w[k+1]) */
        const bfloat16x8_t hi = vreinterpretq_bf16_u16(vzip2q_u16(w0, w1));  /* columns 4..7 */
        bfloat16x8_t x[2];
        if (mr > 4) x[1] = vreinterpretq_bf16_u32(mr == 8 ? vld1q_u32(xq + j * mr + 4) : vdupq_n_u32(0));
        if (mr == 8 || mr == 4) x[0] = vreinterpretq_bf16_u32(vld1q_u32(xq + j * mr));
        else { /* a partial tile: its rows' pairs through a zeroed buffer (no read past the pack) */
            uint32_t t[8] = {0};
            for (int r = 0; r < mr; r++) t[r] = xq[j * mr + r];
            x[0] = vreinterpretq_bf16_u32(vld1q_u32(t));
            if (mr > 4) x[1] = vreinterpretq_bf16_u32(vld1q_u32(t + 4));
        }
#define ES_BFDOT_ROW(r)                                                       \
    if ((r) < mr) {                                                           \
        acc[r][0] = vbfdotq_laneq_f32(acc[r][0], lo, x[(r) / 4], (r) % 4);    \
        acc[r][1] = vbfdotq_laneq_f32(acc[r][1], hi, x[(r) / 4], (r) % 4);    \
    }
        ES_BFDOT_ROW(0) ES_BFDOT_ROW(1) ES_BFDOT_ROW(2) ES_BFDOT_ROW(3)
        ES_BFDOT_ROW(4) ES_BFDOT_ROW(5) ES_BFDOT_ROW(6) ES_BFDOT_ROW(7)
#undef ES_BFDOT_ROW
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        if (ncols >= 8) {
            vst1q_f32(Y + r * ldy, acc[r][0]);
            vst1q_f32(Y + r * ldy + 4, acc[r][1]);
        } else {
            float t[8];
            vst1q_f32(t, acc[r][0]);
            vst1q_f32(t + 4, acc[r][1]);
            for (int c = 0; c < ncols; c++) Y[r * ldy + c] = t[c];
        }
    }
}

/* Y = X W^T + bias over the panels [p0, p1), X as es_pack_pairs left it in Xq; each panel's 16
 * columns as two 8-column halves, every row through one half before the next. */
static ES_TARGET_NEON_BF16 void es_gemm_range_bfdot(const uint32_t *Xq, int64_t B, int E, const uint16_t *Wp,
                                                    const float *biasp, int M, float *Y, int p0, int p1) {
    const int64_t ps = (int64_t)E * ES_PANEL;
    const int kp = (E + 1) / 2;
    for (int p = p0; p < p1; p++)
        for (int h = 0; h < ES_PANEL; h += 8) {
            const int c0 = p * ES_PANEL + h, ncols = M - c0 < 8 ? M - c0 : 8;
            if (ncols <= 0) break;
            const uint16_t *w = Wp + p * ps + h;
            const float *bias = biasp + c0;
            int64_t b = 0;
            for (; b + ES_DP_MR <= B; b += ES_DP_MR)
                es_bfdot_tile(Xq + b * kp, w, E, bias, Y + b * M + c0, M, ncols, ES_DP_MR);
            const uint32_t *xq = Xq + b * kp;
            float *Yb = Y + b * M + c0;
            switch (B - b) {
#define ES_BFDOT_REM(n) case n: es_bfdot_tile(xq, w, E, bias, Yb, M, ncols, n); break;
                ES_BFDOT_REM(1) ES_BFDOT_REM(2) ES_BFDOT_REM(3) ES_BFDOT_REM(4) ES_BFDOT_REM(5) ES_BFDOT_REM(6)
                ES_BFDOT_REM(7)
#undef ES_BFDOT_REM
                default: break;
            }
        }
}

/* The instruction itself, for the tests (demo _bfdot): acc[i] = BFDOT(acc[i], (a[2i], a[2i+1]),
 * (b[2i], b[2i+1])) over n lanes, 4 at a time. */
static ES_TARGET_NEON_BF16 void es_bfdot_lanes(float *acc, const uint16_t *a, const uint16_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i += 4) {
        float t[4] = {0};
        uint16_t ta[8] = {0}, tb[8] = {0};
        const int m = n - i < 4 ? (int)(n - i) : 4;
        memcpy(t, acc + i, m * sizeof(float));
        memcpy(ta, a + 2 * i, 2 * m * sizeof(uint16_t));
        memcpy(tb, b + 2 * i, 2 * m * sizeof(uint16_t));
        const float32x4_t r = vbfdotq_f32(vld1q_f32(t), vreinterpretq_bf16_u16(vld1q_u16(ta)),
                                          vreinterpretq_bf16_u16(vld1q_u16(tb)));
        vst1q_f32(t, r);
        memcpy(acc + i, t, m * sizeof(float));
    }
}
#endif

/* BFDOT over n lanes where this CPU has it (0), else -1 (demo _bfdot: the tests' window). */
static inline int es_bfdot(float *acc, const uint16_t *a, const uint16_t *b, int64_t n) {
#if ES_NEON_PATHS
    if (es_isa_cpu_best() == ES_ISA_NEON_BF16) {
        es_bfdot_lanes(acc, a, b, n);
        return 0;
    }
#endif
    (void)acc, (void)a, (void)b, (void)n;
    return -1;
}
#endif /* ENGRAM_BFDOT_H */
