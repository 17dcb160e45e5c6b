/* engram_hash_kern.h: the hash kernels, a template included once per instruction set by
 * engram_hash.h (see engram_isa.h). Before each inclusion:
 *   ES_SFX   the suffix of this copy's names (baseline, avx2, avx512)
 *   ES_TGT   its target attribute (empty for the baseline)
 *   ES_VD    doubles per vector in the division-free mod (4, or 8 with 64-byte vectors)
 * No include guard: including it again with other settings is the point; it undefines
 * these parameters at its end.
 */
#define ES_HK_CAT2(a, b) a##_##b
#define ES_HK_CAT(a, b) ES_HK_CAT2(a, b)
#define ES_HF(name) ES_HK_CAT(name, ES_SFX)

/* LANES floored mods at once, exactly, in double precision (see ES_FP_PRIME_MAX). */
#define ES_FPMOD_DEF(name, LANES)                                                                        \
    static inline __attribute__((always_inline)) ES_TGT void name(                                         \
        double hi, double lo, int neg, const double *p, const double *inv, const double *c, int64_t *out) { \
        typedef double vd __attribute__((vector_size(LANES * 8), aligned(8)));                             \
        typedef int64_t vl __attribute__((vector_size(LANES * 8), aligned(8)));                            \
        const vd M = (vd){0} + 0x1p52; /* x + 2^52 - 2^52: round to integer */                            \
        const vd pv = *(const vd *)p;                                                                      \
        const vd x = hi * *(const vd *)c + lo;                                                             \
        const vd q = (x * *(const vd *)inv + M) - M;                                                       \
        vd r = x - q * pv;                                                                                 \
        r += (vd)((vl)(r < 0) & (vl)pv);                                                                   \
        r -= (vd)((vl)(r >= pv) & (vl)pv);                                                                 \
        const vl nm = (vl){0} - (int64_t)neg; /* all ones when the mix is negative: select, */            \
        const vd flipped = (pv - 1.0) - r;     /* no branch (signs are random) */                          \
        r = (vd)(((vl)flipped & nm) | ((vl)r & ~nm));                                                      \
        *(vl *)out = (vl)(r + M) - (vl)M; /* exact integer r < 2^52 -> int64 bits */                      \
    }
ES_FPMOD_DEF(ES_HF(es_fpmod4), 4)
#if ES_VD > 4
ES_FPMOD_DEF(ES_HF(es_fpmod), ES_VD)
#endif
#undef ES_FPMOD_DEF

/* All H = (max_ngram-1)*n_head head-local rows of one position (see es_hash_window). */
static inline __attribute__((always_inline)) ES_TGT void ES_HF(es_hash_window_core)(
    const int64_t *win, const int64_t *mult, int max_ngram, int n_head, const int64_t *primes,
    const double *fp, int64_t *rows) {
    const int H = (max_ngram - 1) * n_head;
    uint64_t h = (uint64_t)win[0] * (uint64_t)mult[0];
    for (int n = 2; n <= max_ngram; n++) {
        h ^= (uint64_t)win[n - 1] * (uint64_t)mult[n - 1];
        const int off = (n - 2) * n_head;
        int64_t *r = rows + off;
        int j = 0;
        if (fp) {
            const uint64_t s = (uint64_t)((int64_t)h >> 63), y = h ^ s;
            const double hi = (double)(y >> 32), lo = (double)(y & 0xffffffffu);
#if ES_VD > 4
            for (; j + ES_VD <= n_head; j += ES_VD)
                ES_HF(es_fpmod)(hi, lo, s != 0, fp + off + j, fp + H + off + j, fp + 2 * H + off + j, r + j);
#endif
            for (; j + 4 <= n_head; j += 4)
                ES_HF(es_fpmod4)(hi, lo, s != 0, fp + off + j, fp + H + off + j, fp + 2 * H + off + j, r + j);
        }
        for (; j < n_head; j++) r[j] = es_floormod((int64_t)h, primes[off + j]);
    }
}

static ES_TGT void ES_HF(es_hash_window)(const int64_t *win, const int64_t *mult, int max_ngram, int n_head,
                                         const int64_t *primes, const double *fp, int64_t *rows) {
    ES_HF(es_hash_window_core)(win, mult, max_ngram, n_head, primes, fp, rows);
}

static ES_TGT void ES_HF(es_hash_sequence)(const int64_t *c, int64_t T, int64_t pad, const int64_t *mult,
                                           int max_ngram, int n_head, const int64_t *primes,
                                           const double *fp, int64_t *rows) {
    const int H = (max_ngram - 1) * n_head;
    int64_t win[ES_MAX_NGRAM];
    for (int64_t t = 0; t < T; t++) {
        for (int k = 0; k < max_ngram; k++) win[k] = t - k >= 0 ? c[t - k] : pad;
        ES_HF(es_hash_window_core)(win, mult, max_ngram, n_head, primes, fp, rows + t * H);
    }
}

#undef ES_HF
#undef ES_HK_CAT
#undef ES_HK_CAT2
#undef ES_SFX
#undef ES_TGT
#undef ES_VD
