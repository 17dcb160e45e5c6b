/* engram_hash_kern.h: the hash kernels, a template included once per path by engram_hash.h
 * (see engram_isa.h). The path's shared settings (ES_SF, ES_TGT, ES_KI, ES_VW) come from
 * ES_PATH through engram_path.h; before each inclusion engram_hash.h sets ES_PATH and this
 * template's own parameters:
 *   ES_CVT   1 when the ISA converts double <-> int64 lanes in one instruction (AVX-512DQ, NEON)
 *   ES_STREAM(p, v), ES_SFENCE()  a streaming store of one vector to aligned p, and the fence
 *            that orders such stores (plain store and nothing where the ISA has none)
 * No include guard: including it again with other settings is the point; it undefines
 * these parameters at its end.
 */
#include "engram_path.h"
#define ES_VD (ES_VW / 2) /* 64-bit lanes per vector: the path's vector of ES_VW floats */

typedef double ES_SF(es_hvd) __attribute__((vector_size(ES_VD * 8), aligned(8)));
typedef int64_t ES_SF(es_hvl) __attribute__((vector_size(ES_VD * 8), aligned(8)));
typedef uint64_t ES_SF(es_hvu) __attribute__((vector_size(ES_VD * 8), aligned(8)));

/* The division-free mod (ES_FP_PRIME_MAX) of one mix, a vector of heads: x mod p per lane,
 * where x = hi*c + lo is congruent to the mix hi*2^32 + lo (hi signed, lo in [0, 2^32)). */
ES_KI void ES_SF(es_fpmod)(double hi, double lo, const ES_SF(es_hvd) *p, const ES_SF(es_hvd) *inv,
                           const ES_SF(es_hvd) *c, ES_SF(es_hvl) *out) {
    typedef ES_SF(es_hvd) vd;
    typedef ES_SF(es_hvl) vl;
    const vd M = (vd){0} + 0x1.8p52;  /* x + 1.5*2^52 rounds x (|x| < 2^51) to an integer */
    const vd x = hi * *c + lo;        /* exact: |x| < 2^31*p + 2^32 < 2^53 */
    const vd q = (x * *inv + M) - M;  /* nearest integer to x/p, up to 2^-19: |x/p| < 2^33 */
    vd r = x - q * *p;                /* exact (an integer in (-p, p)) */
    r += (vd)((vl)(r < 0) & (vl)*p);  /* floored: [0, p) */
#if ES_CVT
    *out = __builtin_convertvector(r, vl);
#else
    *out = (vl)(r + M) - (vl)M;       /* the integer's bits (0 <= r < 2^51) */
#endif
}

/* One order's n_head rows of one position: out[j] = mix mod primes[j], the mix given as h and,
 * for es_fpmod (fp: {p, 1/p, 2^32 mod p}, stride H), as hi*2^32 + lo. ES_VD heads per vector;
 * the last, partial vector's unused lanes compute x mod 1 and are not stored. Without fp:
 * Lemire's reciprocal when mods (es_modulus of each prime), else a division per head.
 * stream: full vectors go out with streaming stores (the caller checked the alignment). */
ES_KI void ES_SF(es_order_row)(int64_t h, double hi, double lo, int n_head, const int64_t *primes,
                               const double *fp, const es_modulus *mods, int H, int64_t *out, int stream) {
    typedef ES_SF(es_hvd) vd;
    typedef ES_SF(es_hvl) vl;
    if (!fp) {
        if (mods)
            for (int j = 0; j < n_head; j++) out[j] = es_floormod_fast(h, &mods[j]);
        else
            for (int j = 0; j < n_head; j++) out[j] = es_floormod(h, primes[j]);
        return;
    }
    int j = 0;
    for (; j + ES_VD <= n_head; j += ES_VD) {
        vl r;
        ES_SF(es_fpmod)(hi, lo, (const vd *)(fp + j), (const vd *)(fp + H + j), (const vd *)(fp + 2 * H + j), &r);
        if (stream)
            ES_STREAM((vl *)(out + j), r);
        else
            *(vl *)(out + j) = r;
    }
    if (j < n_head) {
        vd p = (vd){0} + 1.0, inv = (vd){0} + 1.0, c = (vd){0};
        vl r;
        for (int l = 0; j + l < n_head; l++) p[l] = fp[j + l], inv[l] = fp[H + j + l], c[l] = fp[2 * H + j + l];
        ES_SF(es_fpmod)(hi, lo, &p, &inv, &c, &r);
        for (int l = 0; j + l < n_head; l++) out[j + l] = r[l];
    }
}

/* All H = (max_ngram-1)*n_head head-local rows of one position (see es_hash_window). */
static ES_TGT void ES_SF(es_hash_window)(const int64_t *win, const int64_t *mult, int max_ngram, int n_head,
                                         const int64_t *primes, const double *fp, int64_t *rows) {
    const int H = (max_ngram - 1) * n_head;
    uint64_t h = (uint64_t)win[0] * (uint64_t)mult[0];
    for (int n = 2; n <= max_ngram; n++) {
        h ^= (uint64_t)win[n - 1] * (uint64_t)mult[n - 1];
        const int off = (n - 2) * n_head;
        const int64_t hs = (int64_t)h;
        ES_SF(es_order_row)(hs, (double)(hs >> 32), (double)(hs & 0xffffffff), n_head, primes + off,
                            fp ? fp + off : 0, 0, H, rows + off, 0);
    }
}

/* Rows of T positions whose windows are given: entry k (k < max_ngram) of position t, the id
 * k positions back as the history rule left it (pads filled in), at win[k*ld + t]; rows[T][H].
 * In blocks of `blk` positions: first the mixes of ES_VD positions at a time (64-bit lanes,
 * every order), split into hi/lo doubles; then row by row each order's mods, heads across the
 * lanes (a row's H results are written together). The lanes past T of the last vector are read
 * (each window row holds T rounded up to 8 readable entries), computed and not stored.
 * mods: es_modulus of each prime, the divisors when fp is NULL (NULL too: a division a head). */
ES_KI void ES_SF(es_hash_windows_core)(const int64_t *win, int64_t ld, int64_t T, const int64_t *mult,
                                       int max_ngram, int n_head, const int64_t *primes, const double *fp,
                                       const es_modulus *mods, int64_t *rows, int stream) {
    typedef ES_SF(es_hvd) vd;
    typedef ES_SF(es_hvl) vl;
    typedef ES_SF(es_hvu) vu;
    const int H = (max_ngram - 1) * n_head, back = max_ngram - 1;
    int blk = ES_HASH_SCRATCH / back / ES_VD * ES_VD; /* >= ES_VD (ES_HASH_SCRATCH's bound) */
    if (blk > ES_HASH_BLOCK) blk = ES_HASH_BLOCK;
    /* order n's mix of the block's position i at [(n-2)*blk + i] */
    int64_t h[ES_HASH_SCRATCH] __attribute__((aligned(64)));
    double hi[ES_HASH_SCRATCH] __attribute__((aligned(64)));
    double lo[ES_HASH_SCRATCH] __attribute__((aligned(64)));
    const vl M = (vl){0} + 0x4338000000000000LL; /* the bits of 1.5*2^52: int <-> double for |v| < 2^51 */
    const vd Md = (vd){0} + 0x1.8p52;
    /* streaming stores need every full vector aligned: rows, and each order's n_head heads */
    stream = stream && fp && (uintptr_t)rows % (ES_VD * 8) == 0 && n_head % ES_VD == 0;
    for (int64_t t0 = 0; t0 < T; t0 += blk) {
        const int nt = T - t0 < blk ? (int)(T - t0) : blk;
        const int nv = (nt + ES_VD - 1) / ES_VD * ES_VD;
        for (int i = 0; i < nv; i += ES_VD) {
            vl m = (vl){0};
            for (int k = 0; k < max_ngram; k++) {
                const vl x = *(const vl *)(win + k * ld + t0 + i);
                m ^= (vl)((vu)x * ((vu){0} + (uint64_t)mult[k])); /* wrapping int64 products */
                if (k) {
                    const int o = (k - 1) * blk + i;
                    *(vl *)(h + o) = m;
                    /* mix = hi*2^32 + lo, hi signed (arithmetic shift), lo in [0, 2^32) */
                    *(vd *)(hi + o) = (vd)((m >> 32) + M) - Md;
                    *(vd *)(lo + o) = (vd)((m & 0xffffffff) + M) - Md;
                }
            }
        }
        for (int i = 0; i < nt; i++) /* row by row: each row's H results written together */
            for (int k = 1; k < max_ngram; k++) {
                const int o = (k - 1) * blk + i, off = (k - 1) * n_head;
                ES_SF(es_order_row)(h[o], hi[o], lo[o], n_head, primes + off, fp ? fp + off : 0,
                                    mods ? mods + off : 0, H, rows + (t0 + i) * H + off, stream);
            }
    }
    if (stream) ES_SFENCE();
}

/* es_hash_windows_core, compiled apart for the geometries of the configs (3-grams and 4-grams of
 * 8 heads): constant loop bounds unroll the windows and heads. */
static ES_TGT void ES_SF(es_hash_windows)(const int64_t *win, int64_t ld, int64_t T, const int64_t *mult,
                                          int max_ngram, int n_head, const int64_t *primes, const double *fp,
                                          const es_modulus *mods, int64_t *rows, int stream) {
    if (max_ngram == 3 && n_head == 8)
        ES_SF(es_hash_windows_core)(win, ld, T, mult, 3, 8, primes, fp, mods, rows, stream);
    else if (max_ngram == 4 && n_head == 8)
        ES_SF(es_hash_windows_core)(win, ld, T, mult, 4, 8, primes, fp, mods, rows, stream);
    else
        ES_SF(es_hash_windows_core)(win, ld, T, mult, max_ngram, n_head, primes, fp, mods, rows, stream);
}

#undef ES_VD
#undef ES_CVT
#undef ES_STREAM
#undef ES_SFENCE
#include "engram_path_end.h"
