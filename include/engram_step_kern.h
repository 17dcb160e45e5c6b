/* engram_step_kern.h: the float kernels, a template included once per path by engram_step.h
 * (see engram_isa.h): GEMM, gathers, the per-token tail. The path's shared settings (ES_SF,
 * ES_TGT, ES_VW, ES_F16C, ES_NEON, ES_KI) come from ES_PATH through engram_path.h; before each
 * inclusion engram_step.h sets ES_PATH and this template's own parameters:
 *   ES_TP    packed panels per GEMM micro-tile (a panel is ES_PANEL = 16 columns)
 *   ES_MR    rows per micro-tile: ES_MR x ES_TP*16/ES_VW accumulators stay in registers
 *   ES_GP    panels the one-row GEMV streams at once (concurrent memory streams)
 *   ES_GP_BF16  the same for bfloat16 weights (half the bytes a panel: more panels)
 *   ES_CHAINS  es_fma_chains's independent chains (12 when not defined)
 * No include guard: including it again with other settings is the point; it undefines
 * these parameters at its end.
 */
#include "engram_path.h"
#ifndef ES_CHAINS
#define ES_CHAINS 12
#endif
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

/* The GEMM, twice: float32 weights, and bfloat16 weights widened in registers. */
#define ES_WT float
#define ES_WNAME f32
#define ES_W_BF16 0
#include "engram_gemm_kern.h"
#define ES_WT uint16_t
#define ES_WNAME bf16
#define ES_W_BF16 1
#include "engram_gemm_kern.h"

/* ---- gathers ---------------------------------------------------------------------- */

/* float16 tables (IEEE binary16 bits), widened to float32. */
static ES_TGT void ES_SF(es_gather_f16)(const uint16_t *table, int hd, const int64_t *rows, int H, float *e) {
    for (int j = 0; j < H; j++) {
        const uint16_t *src = table + rows[j] * hd;
        float *dst = e + (int64_t)j * hd;
        int d = 0;
#if ES_F16C
        for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#elif ES_NEON
        for (; d + 8 <= hd; d += 8) {
            const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(src + d));
            vst1q_f32(dst + d, vcvt_f32_f16(vget_low_f16(h)));
            vst1q_f32(dst + d + 4, vcvt_high_f32_f16(h));
        }
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

/* ---- the per-token tail (es_tail_x, es_tail_y in engram_step.h) ---------------------- */
/* Tail vectors: at least 8 lanes (the 16-byte baseline runs two registers per op: the
 * independent halves overlap, as in the 8-lane code the baseline ran before). */
#if ES_VW < 8
#define ES_TVW 8
#else
#define ES_TVW ES_VW
#endif
typedef float ES_SF(es_vt) __attribute__((vector_size(ES_TVW * 4), aligned(4)));
typedef int32_t ES_SF(es_vi) __attribute__((vector_size(ES_TVW * 4), aligned(4)));

ES_KI ES_SF(es_vt) ES_SF(es_sel)(ES_SF(es_vi) m, ES_SF(es_vt) a, ES_SF(es_vt) b) {
    typedef ES_SF(es_vt) vf;
    typedef ES_SF(es_vi) vi;
    return (vf)((m & (vi)a) | (~m & (vi)b));
}

/* exp on ES_TVW lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial), ~2 ulp;
 * NaN stays NaN through the polynomial. */
ES_KI ES_SF(es_vt) ES_SF(es_exp)(ES_SF(es_vt) x) {
    typedef ES_SF(es_vt) vf;
    typedef ES_SF(es_vi) vi;
    const vf hi = (vf){0} + 88.3762626647949f;
    x = ES_SF(es_sel)(x > hi, hi, x);
    x = ES_SF(es_sel)(x < -hi, -hi, x);
    vf fx = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(fx, vi);
    vf tf = __builtin_convertvector(n, vf);
    n += (vi)(tf > fx); /* truncation rounded up for negatives: floor (true is -1) */
    tf = __builtin_convertvector(n, vf);
    vf r = x - tf * 0.693359375f + tf * 2.12194440e-4f;
    vf r2 = r * r;
    vf y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r2 + r + 1.0f;
    return y * (vf)((n + 127) << 23);
}

ES_KI float ES_SF(es_hsum)(ES_SF(es_vt) v) {
    float t[ES_TVW];
    *(ES_SF(es_vt) *)t = v;
    return es_hsum_lanes(t, ES_TVW);
}

/* bfloat16 lanes at the edges (hbf / obf in engram_step.h): ES_TVW bf16 widened to floats
 * (exact), and floats rounded to bf16 (es_float_to_bf16, lane by lane). */
typedef uint16_t ES_SF(es_vh) __attribute__((vector_size(ES_TVW * 2), aligned(2)));
typedef uint32_t ES_SF(es_vu) __attribute__((vector_size(ES_TVW * 4), aligned(4)));

/* ES_TVW hidden values at h + d: floats, or bf16 bits widened (hbf, a constant where inlined) */
ES_KI ES_SF(es_vt) ES_SF(es_ldh)(const void *h, int d, const int hbf) {
    typedef ES_SF(es_vt) vf;
    typedef ES_SF(es_vu) vu;
    if (!hbf) return *(const vf *)((const float *)h + d);
    return (vf)(__builtin_convertvector(*(const ES_SF(es_vh) *)((const uint16_t *)h + d), vu) << 16);
}
ES_KI float ES_SF(es_ld1)(const void *h, int d, const int hbf) {
    return hbf ? es_bf16_to_float(((const uint16_t *)h)[d]) : ((const float *)h)[d];
}
ES_KI void ES_SF(es_sto)(void *o, int d, ES_SF(es_vt) v, const int obf) {
    typedef ES_SF(es_vu) vu;
    if (!obf) { *(ES_SF(es_vt) *)((float *)o + d) = v; return; }
    const vu u = (vu)v;
    const vu rn = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, qn = ((u >> 16) & 0x8000u) | 0x7fc0u;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    *(ES_SF(es_vh) *)((uint16_t *)o + d) = __builtin_convertvector((nan & qn) | (~nan & rn), ES_SF(es_vh));
}
ES_KI void ES_SF(es_st1)(void *o, int d, float v, const int obf) {
    if (obf) ((uint16_t *)o)[d] = es_float_to_bf16(v);
    else ((float *)o)[d] = v;
}

/* gate[g] and x = rms3(gate * v) of stream g of one token (es_tail_x below), h its hidden row. */
ES_KI void ES_SF(es_tail_x1)(const es_tail_params *P, const float *proj, int g, const void *h, const int hbf,
                             float *x, float *gate) {
    typedef ES_SF(es_vt) vf;
    const int G = P->G, D = P->D;
    const float *v = proj + (int64_t)G * D;
    const float *k = proj + (int64_t)g * D;
    const float *w1 = P->n1 + (int64_t)g * D, *w2 = P->n2 + (int64_t)g * D, *w3 = P->n3 + (int64_t)g * D;
    vf a = {0}, b = {0};
    int d = 0;
    for (; d + ES_TVW <= D; d += ES_TVW) {
        if (!(d & 15)) { /* a line ahead (engram_step.h, es_tail_prefetch_head) */
            __builtin_prefetch(k + d + ES_TAIL_PF, 0, 3);
            __builtin_prefetch((const char *)h + (int64_t)(d + ES_TAIL_PF) * (hbf ? 2 : 4), 0, 3);
        }
        vf kv = *(const vf *)(k + d), hv = ES_SF(es_ldh)(h, d, hbf);
        a += kv * kv;
        b += hv * hv;
    }
    float sk = ES_SF(es_hsum)(a), sh = ES_SF(es_hsum)(b);
    for (; d < D; d++) {
        const float hd = ES_SF(es_ld1)(h, d, hbf);
        sk += k[d] * k[d];
        sh += hd * hd;
    }
    const float rk = 1.0f / sqrtf(sk / D + P->eps_qk), rh = 1.0f / sqrtf(sh / D + P->eps_qk);
    a = (vf){0};
    for (d = 0; d + ES_TVW <= D; d += ES_TVW)
        a += (*(const vf *)(k + d) * rk * *(const vf *)(w1 + d)) *
             (ES_SF(es_ldh)(h, d, hbf) * rh * *(const vf *)(w2 + d));
    float s = ES_SF(es_hsum)(a);
    for (; d < D; d++) s += (k[d] * rk * w1[d]) * (ES_SF(es_ld1)(h, d, hbf) * rh * w2[d]);
    s *= P->inv_sqrt_d;
    /* sign(s) * sqrt(max(|s|, clamp)); s == 0 stays 0 and NaN stays NaN */
    s = s > 0 ? sqrtf(fmaxf(s, ES_GATE_CLAMP)) : (s < 0 ? -sqrtf(fmaxf(-s, ES_GATE_CLAMP)) : s);
    const float gt = 1.0f / (1.0f + expf(-s));
    a = (vf){0};
    for (d = 0; d + ES_TVW <= D; d += ES_TVW) {
        vf gv = gt * *(const vf *)(v + d);
        a += gv * gv;
    }
    float ss = ES_SF(es_hsum)(a);
    for (; d < D; d++) ss += (gt * v[d]) * (gt * v[d]);
    const float r3 = 1.0f / sqrtf(ss / D + P->eps_conv);
    float *xg = x + (int64_t)g * D;
    for (d = 0; d + ES_TVW <= D; d += ES_TVW) *(vf *)(xg + d) = gt * *(const vf *)(v + d) * r3 * *(const vf *)(w3 + d);
    for (; d < D; d++) xg[d] = gt * v[d] * r3 * w3[d];
    gate[g] = gt;
}

/* gate[g] and x = rms3(gate * v) for the G streams of one token (see engram_step.h). The
 * dot of the normalized key and hidden is taken on the normalized vectors, as the reference
 * does, so huge-but-finite inputs do not overflow where the reference does not. hid: float32,
 * or bfloat16 bits (hbf), chosen once per stream row. */
static ES_TGT void ES_SF(es_tail_x)(const es_tail_params *P, const float *proj, const void *hid, int hbf, float *x,
                                    float *gate) {
    const int64_t D = P->D;
    for (int g = 0; g < P->G; g++) {
        if (hbf) ES_SF(es_tail_x1)(P, proj, g, (const uint16_t *)hid + g * D, 1, x, gate);
        else ES_SF(es_tail_x1)(P, proj, g, (const float *)hid + g * D, 0, x, gate);
    }
}

/* out = gate * v + SiLU(sum of the K taps) of stream g of one token (es_tail_y below), o its out row. */
ES_KI void ES_SF(es_tail_y1)(const es_tail_params *P, const float *proj, int g, float gt, const float *const *taps,
                             const float *x, float *xdst, void *o, const int obf) {
    typedef ES_SF(es_vt) vf;
    const int D = P->D, K = P->K;
    const int64_t C = (int64_t)P->G * D;
    const float *v = proj + C;
    const float *wlast = P->cw + (int64_t)(K - 1) * C; /* the tap on x(t) itself */
    const int64_t c0 = (int64_t)g * D;
    int d = 0;
    for (; d + ES_TVW <= D; d += ES_TVW) {
        const int64_t c = c0 + d;
        if (!(d & 15)) {
            for (int i = 0; i < K - 1; i++) __builtin_prefetch(taps[i] + c + ES_TAIL_PF, 0, 3);
            __builtin_prefetch((char *)o + (int64_t)(d + ES_TAIL_PF) * (obf ? 2 : 4), 1, 3);
        }
        const vf xv = *(const vf *)(x + c);
        vf y = *(const vf *)(wlast + c) * xv;
        for (int i = 0; i < K - 1; i++) y += *(const vf *)(P->cw + i * C + c) * *(const vf *)(taps[i] + c);
        if (xdst) *(vf *)(xdst + c) = xv;
        ES_SF(es_sto)(o, d, gt * *(const vf *)(v + d) + y / (1.0f + ES_SF(es_exp)(-y)), obf);
    }
    for (; d < D; d++) {
        const int64_t c = c0 + d;
        float y = wlast[c] * x[c];
        for (int i = 0; i < K - 1; i++) y += P->cw[i * C + c] * taps[i][c];
        if (xdst) xdst[c] = x[c];
        ES_SF(es_st1)(o, d, gt * v[d] + y / (1.0f + expf(-y)), obf);
    }
}

/* out = gate * v + SiLU(sum of the K taps) for one token (see engram_step.h); out float32, or
 * bfloat16 bits (obf), chosen once per stream row. */
static ES_TGT void ES_SF(es_tail_y)(const es_tail_params *P, const float *proj, const float *gate,
                                    const float *const *taps, const float *x, float *xdst, void *out, int obf) {
    const int64_t D = P->D;
    for (int g = 0; g < P->G; g++) {
        if (obf) ES_SF(es_tail_y1)(P, proj, g, gate[g], taps, x, xdst, (uint16_t *)out + g * D, 1);
        else ES_SF(es_tail_y1)(P, proj, g, gate[g], taps, x, xdst, (float *)out + g * D, 0);
    }
}

/* ---- the register-only FMA rate (bench/bench_step.py's floor) ---------------------
 * n rounds of ES_CHAINS independent vector multiply-add chains, nothing loaded or stored: what
 * this path's FMA units do per second with no memory in the way (12 chains cover the latency of
 * two FMA ports; 16 the four 128-bit FMA pipes of latency 4 of Neoverse V2 / Cortex-X925). The
 * chains start from different values (equal ones get merged by the compiler into one chain,
 * which times the FMA latency instead) and their sum goes to *sink so the loop stays. Returns the float multiply-adds done. */
static ES_TGT int64_t ES_SF(es_fma_chains)(int64_t n, float *sink) {
    typedef ES_SF(es_vf) vf;
    vf a[ES_CHAINS];
    const vf x = (vf){0} + 0.999f, y = (vf){0} + 1e-7f;
    for (int i = 0; i < ES_CHAINS; i++) a[i] = (vf){0} + (float)i;
    for (int64_t k = 0; k < n; k++)
#pragma GCC unroll 16
        for (int i = 0; i < ES_CHAINS; i++) a[i] = a[i] * x + y;
    vf s = (vf){0};
    for (int i = 0; i < ES_CHAINS; i++) s += a[i];
    float r = 0;
    for (int i = 0; i < ES_VW; i++) r += s[i];
    *(volatile float *)sink = r; /* a store the compiler must do: the loop stays */
    return n * ES_CHAINS * ES_VW;
}

#undef ES_TVW
#undef ES_NV
#undef ES_WOFF
/* this copy's parameters: the next inclusion defines its own */
#undef ES_TP
#undef ES_MR
#undef ES_GP
#undef ES_GP_BF16
#undef ES_CHAINS
#include "engram_path_end.h"
