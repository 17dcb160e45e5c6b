/* engram_gguf.h: GGUF table rows decoded to float32, bit-exact against gguf-py's
 * gguf.quants.dequantize (which follows ggml's CPU dequantize_row_* functions).
 *
 *   es_gg_block        values and bytes of one block of a type (0, or -1: a type not served)
 *   es_gg_decode       n values of one type (n a multiple of its block) from src into dst
 *   es_gg_gather       the rows `ids` of a [nrows, row_bytes] table decoded into dst[k * n]
 *   es_records_job_run an engine's chunk of row records of any kind (a table's dtype or a GGUF
 *                      type) to float32, one pointer a record: the demo/Qwen and LongCat gathers
 *
 * Types served: ggml's numbers for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K, and ES_GG_E4M3_ROW: a DeepSeek-V4.1 checkpoint row of 256 e4m3 bytes
 * then 8 e8m0 scales (one per 32 values), kept in a GGUF as an I8 tensor of 264 bytes a row.
 *
 * Numerics: every value is the reference's float32 expression in its order: the fp16 scales
 * widened exactly, then d * q (Q4_0, Q5_0, Q8_0, IQ4_NL), d * q + m (Q4_1, Q5_1), (d * sc) * q
 * (Q3_K, Q6_K), (d * sc) * q - (dmin * m) (Q2_K, Q4_K, Q5_K), each operation rounded to float32.
 * Every product followed by an addition is exact in float32 (an fp16 scale's 11 significant
 * bits times a sub-scale of at most 6 bits, times a quant of at most 5: under 24 bits), so a
 * compiler that fuses d * q + m into one FMA (aarch64, -mfma builds) gets the same values. The
 * loops are plain C that compilers vectorize.
 *
 * Nothing here allocates, reads past the bytes its arguments describe, or fails on any byte
 * values (NaN and infinite scales decode as the reference does); the callers check the sizes.
 */
#ifndef ENGRAM_GGUF_H
#define ENGRAM_GGUF_H

#include <stdint.h>
#include <string.h>

#include "engram_fp8.h" /* es8_e8m0: the scales' exact decoder (es_gg_e4m3_bits holds es8_e4m3's values) */

enum {
    ES_GG_F32 = 0, ES_GG_F16 = 1, ES_GG_Q4_0 = 2, ES_GG_Q4_1 = 3, ES_GG_Q5_0 = 6, ES_GG_Q5_1 = 7,
    ES_GG_Q8_0 = 8, ES_GG_Q2_K = 10, ES_GG_Q3_K = 11, ES_GG_Q4_K = 12, ES_GG_Q5_K = 13,
    ES_GG_Q6_K = 14, ES_GG_IQ4_NL = 20, ES_GG_I8 = 24, ES_GG_BF16 = 30,
    ES_GG_E4M3_ROW = 1000 /* not a ggml number: an I8 tensor of 264-byte rows, read as above */
};

#define ES_GG_QK 32    /* values per block of the 32-value types */
#define ES_GG_QK_K 256 /* values per super-block of the K types */

static inline int es_gg_block(int type, int64_t *values, int64_t *bytes) {
    int64_t v, b;
    switch (type) {
    case ES_GG_F32: v = 1; b = 4; break;
    case ES_GG_F16: case ES_GG_BF16: v = 1; b = 2; break;
    case ES_GG_Q4_0: case ES_GG_IQ4_NL: v = 32; b = 18; break;
    case ES_GG_Q4_1: v = 32; b = 20; break;
    case ES_GG_Q5_0: v = 32; b = 22; break;
    case ES_GG_Q5_1: v = 32; b = 24; break;
    case ES_GG_Q8_0: v = 32; b = 34; break;
    case ES_GG_Q2_K: v = 256; b = 84; break;
    case ES_GG_Q3_K: v = 256; b = 110; break;
    case ES_GG_Q4_K: v = 256; b = 144; break;
    case ES_GG_Q5_K: v = 256; b = 176; break;
    case ES_GG_Q6_K: v = 256; b = 210; break;
    case ES_GG_E4M3_ROW: v = 256; b = 264; break;
    default: return -1;
    }
    *values = v;
    *bytes = b;
    return 0;
}

static inline float es_gg_fbits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t es_gg_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* IEEE half -> float, exact (as numpy's astype: infinities, NaN payloads, subnormals). */
static inline float es_gg_f16(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return es_gg_fbits(s | 0x7f800000u | m << 13);
    if (e != 0) return es_gg_fbits(s | (e + 112) << 23 | m << 13);
    const float v = (float)m * 0x1p-24f; /* subnormal (or zero): m * 2^-24, exact */
    return s ? -v : v;
}

static inline float es_gg_h(const uint8_t *p) { return es_gg_f16(es_gg_u16(p)); }

/* The float32 bits of every e4m3 byte as es8_e4m3 decodes it (NaN codes 0x7f, 0xff included):
 * the 264-byte rows decode by a load a value (es8_e4m3, a value at a time, is several times slower). */
static const uint32_t es_gg_e4m3_bits[256] = {
    0x00000000u, 0x3b000000u, 0x3b800000u, 0x3bc00000u, 0x3c000000u, 0x3c200000u, 0x3c400000u, 0x3c600000u,
    0x3c800000u, 0x3c900000u, 0x3ca00000u, 0x3cb00000u, 0x3cc00000u, 0x3cd00000u, 0x3ce00000u, 0x3cf00000u,
    0x3d000000u, 0x3d100000u, 0x3d200000u, 0x3d300000u, 0x3d400000u, 0x3d500000u, 0x3d600000u, 0x3d700000u,
    0x3d800000u, 0x3d900000u, 0x3da00000u, 0x3db00000u, 0x3dc00000u, 0x3dd00000u, 0x3de00000u, 0x3df00000u,
    0x3e000000u, 0x3e100000u, 0x3e200000u, 0x3e300000u, 0x3e400000u, 0x3e500000u, 0x3e600000u, 0x3e700000u,
    0x3e800000u, 0x3e900000u, 0x3ea00000u, 0x3eb00000u, 0x3ec00000u, 0x3ed00000u, 0x3ee00000u, 0x3ef00000u,
    0x3f000000u, 0x3f100000u, 0x3f200000u, 0x3f300000u, 0x3f400000u, 0x3f500000u, 0x3f600000u, 0x3f700000u,
    0x3f800000u, 0x3f900000u, 0x3fa00000u, 0x3fb00000u, 0x3fc00000u, 0x3fd00000u, 0x3fe00000u, 0x3ff00000u,
    0x40000000u, 0x40100000u, 0x40200000u, 0x40300000u, 0x40400000u, 0x40500000u, 0x40600000u, 0x40700000u,
    0x40800000u, 0x40900000u, 0x40a00000u, 0x40b00000u, 0x40c00000u, 0x40d00000u, 0x40e00000u, 0x40f00000u,
    0x41000000u, 0x41100000u, 0x41200000u, 0x41300000u, 0x41400000u, 0x41500000u, 0x41600000u, 0x41700000u,
    0x41800000u, 0x41900000u, 0x41a00000u, 0x41b00000u, 0x41c00000u, 0x41d00000u, 0x41e00000u, 0x41f00000u,
    0x42000000u, 0x42100000u, 0x42200000u, 0x42300000u, 0x42400000u, 0x42500000u, 0x42600000u, 0x42700000u,
    0x42800000u, 0x42900000u, 0x42a00000u, 0x42b00000u, 0x42c00000u, 0x42d00000u, 0x42e00000u, 0x42f00000u,
    0x43000000u, 0x43100000u, 0x43200000u, 0x43300000u, 0x43400000u, 0x43500000u, 0x43600000u, 0x43700000u,
    0x43800000u, 0x43900000u, 0x43a00000u, 0x43b00000u, 0x43c00000u, 0x43d00000u, 0x43e00000u, 0x7fc00000u,
    0x80000000u, 0xbb000000u, 0xbb800000u, 0xbbc00000u, 0xbc000000u, 0xbc200000u, 0xbc400000u, 0xbc600000u,
    0xbc800000u, 0xbc900000u, 0xbca00000u, 0xbcb00000u, 0xbcc00000u, 0xbcd00000u, 0xbce00000u, 0xbcf00000u,
    0xbd000000u, 0xbd100000u, 0xbd200000u, 0xbd300000u, 0xbd400000u, 0xbd500000u, 0xbd600000u, 0xbd700000u,
    0xbd800000u, 0xbd900000u, 0xbda00000u, 0xbdb00000u, 0xbdc00000u, 0xbdd00000u, 0xbde00000u, 0xbdf00000u,
    0xbe000000u, 0xbe100000u, 0xbe200000u, 0xbe300000u, 0xbe400000u, 0xbe500000u, 0xbe600000u, 0xbe700000u,
    0xbe800000u, 0xbe900000u, 0xbea00000u, 0xbeb00000u, 0xbec00000u, 0xbed00000u, 0xbee00000u, 0xbef00000u,
    0xbf000000u, 0xbf100000u, 0xbf200000u, 0xbf300000u, 0xbf400000u, 0xbf500000u, 0xbf600000u, 0xbf700000u,
    0xbf800000u, 0xbf900000u, 0xbfa00000u, 0xbfb00000u, 0xbfc00000u, 0xbfd00000u, 0xbfe00000u, 0xbff00000u,
    0xc0000000u, 0xc0100000u, 0xc0200000u, 0xc0300000u, 0xc0400000u, 0xc0500000u, 0xc0600000u, 0xc0700000u,
    0xc0800000u, 0xc0900000u, 0xc0a00000u, 0xc0b00000u, 0xc0c00000u, 0xc0d00000u, 0xc0e00000u, 0xc0f00000u,
    0xc1000000u, 0xc1100000u, 0xc1200000u, 0xc1300000u, 0xc1400000u, 0xc1500000u, 0xc1600000u, 0xc1700000u,
    0xc1800000u, 0xc1900000u, 0xc1a00000u, 0xc1b00000u, 0xc1c00000u, 0xc1d00000u, 0xc1e00000u, 0xc1f00000u,
    0xc2000000u, 0xc2100000u, 0xc2200000u, 0xc2300000u, 0xc2400000u, 0xc2500000u, 0xc2600000u, 0xc2700000u,
    0xc2800000u, 0xc2900000u, 0xc2a00000u, 0xc2b00000u, 0xc2c00000u, 0xc2d00000u, 0xc2e00000u, 0xc2f00000u,
    0xc3000000u, 0xc3100000u, 0xc3200000u, 0xc3300000u, 0xc3400000u, 0xc3500000u, 0xc3600000u, 0xc3700000u,
    0xc3800000u, 0xc3900000u, 0xc3a00000u, 0xc3b00000u, 0xc3c00000u, 0xc3d00000u, 0xc3e00000u, 0xffc00000u,
};

/* ggml's kvalues_iq4nl */
static const int8_t es_gg_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void es_gg_scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block of `type` at b into y (the block's values). */
static inline void es_gg_block_decode(int type, const uint8_t *b, float *y) {
    switch (type) {
    case ES_GG_Q4_0: {
        const float d = es_gg_h(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[2 + j] & 0xF) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        break;
    }
    case ES_GG_IQ4_NL: {
        const float d = es_gg_h(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)es_gg_iq4nl[b[2 + j] & 0xF];
            y[j + 16] = d * (float)es_gg_iq4nl[b[2 + j] >> 4];
        }
        break;
    }
    case ES_GG_Q4_1: {
        const float d = es_gg_h(b), m = es_gg_h(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[4 + j] & 0xF) + m;
            y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        break;
    }
    case ES_GG_Q5_0: {
        const float d = es_gg_h(b);
        const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24; /* little endian */
        for (int j = 0; j < 16; j++) {
            const int lo = (b[6 + j] & 0xF) | (int)((qh >> j) & 1) << 4;
            const int hi = (b[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
        break;
    }
    case ES_GG_Q5_1: {
        const float d = es_gg_h(b), m = es_gg_h(b + 2);
        const uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
        for (int j = 0; j < 16; j++) {
            const int lo = (b[8 + j] & 0xF) | (int)((qh >> j) & 1) << 4;
            const int hi = (b[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
        break;
    }
    case ES_GG_Q8_0: {
        const float d = es_gg_h(b);
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case ES_GG_Q2_K: { /* scales[16], qs[64], d, dmin */
        const uint8_t *sc = b, *qs = b + 16;
        const float d = es_gg_h(b + 80), dmin = es_gg_h(b + 82);
        for (int e = 0; e < 256; e++) {
            const int half = e >> 7, shift = (e >> 5) & 3, l = e & 31, s = sc[e >> 4];
            const float dl = d * (float)(s & 0xF), ml = dmin * (float)(s >> 4);
            y[e] = dl * (float)((qs[half * 32 + l] >> (2 * shift)) & 3) - ml;
        }
        break;
    }
    case ES_GG_Q3_K: { /* hmask[32], qs[64], scales[12], d */
        const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
        const float d = es_gg_h(b + 108);
        float dl[16];
        for (int i = 0; i < 16; i++) {
            const int lo = (i < 8 ? s[i] : s[i - 8] >> 4) & 0xF, hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
            dl[i] = d * (float)((lo | hi << 4) - 32);
        }
        for (int e = 0; e < 256; e++) {
            const int half = e >> 7, shift = (e >> 5) & 3, l = e & 31;
            const int q = ((qs[half * 32 + l] >> (2 * shift)) & 3) - (((hm[l] >> (e >> 5)) & 1) ? 0 : 4);
            y[e] = dl[e >> 4] * (float)q;
        }
        break;
    }
    case ES_GG_Q4_K:
    case ES_GG_Q5_K: { /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128] */
        const float d = es_gg_h(b), dmin = es_gg_h(b + 2);
        const int k5 = type == ES_GG_Q5_K;
        const uint8_t *qh = b + 16, *qs = b + (k5 ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            es_gg_scale_min_k4(j, b + 4, &sc, &mn);
            const float d1 = d * (float)sc, m1 = dmin * (float)mn;
            const uint8_t *q = qs + (j >> 1) * 32;
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> (4 * (j & 1))) & 0xF;
                if (k5) v |= ((qh[l] >> j) & 1) << 4;
                y[j * 32 + l] = d1 * (float)v - m1;
            }
        }
        break;
    }
    case ES_GG_Q6_K: { /* ql[128], qh[64], scales[16] (int8), d; two halves of 128 values */
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = es_gg_h(b + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = b + half * 64, *qh = b + 128 + half * 32;
            float *yh = y + half * 128;
            for (int q4 = 0; q4 < 4; q4++) { /* 32 values: ql nibble q4 >> 1 of ql[(q4 & 1) * 32 + l] */
                const uint8_t *lo = ql + (q4 & 1) * 32;
                const int lsh = 4 * (q4 >> 1), hsh = 2 * q4;
                const float d0 = d * (float)sc[half * 8 + q4 * 2], d1 = d * (float)sc[half * 8 + q4 * 2 + 1];
                for (int l = 0; l < 32; l++) {
                    const int q = (((lo[l] >> lsh) & 0xF) | ((qh[l] >> hsh) & 3) << 4) - 32;
                    yh[q4 * 32 + l] = (l < 16 ? d0 : d1) * (float)q;
                }
            }
        }
        break;
    }
    case ES_GG_E4M3_ROW: { /* 256 e4m3 values, then 8 e8m0 scales */
        for (int k = 0; k < 8; k++) {
            const float f = es8_e8m0(b[256 + k]);
            for (int i = 0; i < 32; i++) y[k * 32 + i] = es_gg_fbits(es_gg_e4m3_bits[b[k * 32 + i]]) * f;
        }
        break;
    }
    default: break;
    }
}

/* n values (a multiple of the type's block values) of `type` from src into dst. Returns -1 for
 * a type not served or an n that is not whole blocks, and writes nothing then. */
static inline int es_gg_decode(int type, const uint8_t *src, int64_t n, float *dst) {
    int64_t bv, bb;
    if (es_gg_block(type, &bv, &bb) != 0 || n < 0 || n % bv != 0) return -1;
    switch (type) {
    case ES_GG_F32: memcpy(dst, src, (size_t)n * 4); return 0;
    case ES_GG_F16: for (int64_t i = 0; i < n; i++) dst[i] = es_gg_h(src + 2 * i); return 0;
    case ES_GG_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = es_gg_fbits((uint32_t)es_gg_u16(src + 2 * i) << 16);
        return 0;
    default:
        for (int64_t k = 0; k < n / bv; k++) es_gg_block_decode(type, src + k * bb, dst + k * bv);
        return 0;
    }
}

/* dst[k * n .. k * n + n) = row ids[k] of the table [nrows, row_bytes] at base, for k < nids.
 * Returns -1 (nothing written) for a type not served, row_bytes not n's bytes, or an id
 * outside [0, nrows). */
static inline int es_gg_gather(int type, const uint8_t *base, int64_t nrows, int64_t row_bytes, int64_t n,
                               const int64_t *ids, int64_t nids, float *dst) {
    int64_t bv, bb;
    if (es_gg_block(type, &bv, &bb) != 0 || n <= 0 || n % bv != 0 || n / bv * bb != row_bytes) return -1;
    for (int64_t k = 0; k < nids; k++)
        if (ids[k] < 0 || ids[k] >= nrows) return -1;
    for (int64_t k = 0; k < nids; k++) es_gg_decode(type, base + ids[k] * row_bytes, n, dst + k * n);
    return 0;
}

/* ---- an engine's rows, every kind of record ---------------------------------------- */

/* Rows given as their records, one pointer a record (an engine's row source: mapped rows,
 * a row cache's slots, direct reads' buffers): token i's H records at dp[i*H + j] (int8 and
 * NVFP4 rows: their scales at sp[...]) into e + i*lde. kind: engram_step.h's es_gather_job's, and 4 FP8 with
 * one global scale (lut[byte]), 5 NVFP4 (lut[scale byte * 16 + nibble], the low nibble the
 * even element), 6 GGUF rows of type ggtype (engram_gguf.h). The engines' es_split ctx. */
typedef struct {
    const char *const *dp;
    const char *const *sp;
    float *e;
    int64_t lde;
    const float *lut; /* kinds 4, 5: the value of each code */
    int kind, hd, H;
    int ggtype; /* kind 6 */
} es_records_job;

static inline void es_records_job_run(void *arg, int64_t i0, int64_t i1) {
    const es_records_job *w = (const es_records_job *)arg;
    const int64_t zero = 0;
    for (int64_t i = i0; i < i1; i++)
        for (int j = 0; j < w->H; j++) {
            const char *p = w->dp[i * w->H + j];
            float *e = w->e + i * w->lde + (int64_t)j * w->hd;
            const uint8_t *b = (const uint8_t *)p;
            switch (w->kind) {
            case 0: es_gather_f32((const float *)p, w->hd, &zero, 1, e); break;
            case 1: es_gather_f16((const uint16_t *)p, w->hd, &zero, 1, e); break;
            case 3: es_gather_bf16((const uint16_t *)p, w->hd, &zero, 1, e); break;
            case 4:
                for (int d = 0; d < w->hd; d++) e[d] = w->lut[b[d]];
                break;
            case 5: {
                const uint8_t *s = (const uint8_t *)w->sp[i * w->H + j];
                for (int d = 0; d < w->hd; d++) e[d] = w->lut[(int)s[d >> 4] * 16 + ((b[d >> 1] >> ((d & 1) * 4)) & 0xF)];
                break;
            }
            case 6: es_gg_decode(w->ggtype, b, w->hd, e); break;
            default: es_gather_i8((const int8_t *)p, (const float *)w->sp[i * w->H + j], w->hd, &zero, 1, e);
            }
        }
}

#endif /* ENGRAM_GGUF_H */
