/* engram_hash.h: the integer kernels of Engram's n-gram hash, shared by the
 * batch hasher (_hash.pyx) and the streaming engine (_engine.pyx).
 *
 * Semantics (DESIGN.md 1.4): mix_n = XOR_{k<n} w[k]*mult[k] in wrapping int64,
 * row = mix mod prime with FLOORED mod (numpy's %), so rows are in [0, prime).
 * Multiplication is done in uint64_t: signed overflow is UB in C, unsigned
 * wrap-around is defined and gives the same bits as numpy's int64 wrap.
 */
#ifndef ENGRAM_HASH_H
#define ENGRAM_HASH_H

#include <stdint.h>

/* Floored x mod p (p > 0, result in [0, p)), as numpy's %: a hardware
 * division and one correction. This is the hot-path mod: on the CPUs measured
 * here (bench/bench_hash.py) a 64-bit DIV beat every reciprocal trick. */
static inline int64_t es_floormod(int64_t x, int64_t p) {
    int64_t r = x % p;
    return r < 0 ? r + p : r;
}

/* The reciprocal alternative, kept for CPUs with slow dividers and measured
 * beside the division in the bench: Lemire's "fastmod" with a 128-bit magic
 * M = floor((2^128-1)/p) + 1, exact for every 64-bit numerator and divisor
 * (Lemire, Kaser, Kurz 2019): four multiplies, no division. */
typedef struct {
    uint64_t m_lo;
    uint64_t m_hi;
    uint64_t p;
} es_modulus;

static inline es_modulus es_modulus_make(uint64_t p) {
    __uint128_t m = ((__uint128_t)0 - 1) / p + 1; /* p == 1 gives M = 0: x mod 1 = 0 */
    es_modulus r;
    r.m_lo = (uint64_t)m;
    r.m_hi = (uint64_t)(m >> 64);
    r.p = p;
    return r;
}

/* Floored x mod p, branch-free. For x < 0 let y = ~x = -x-1 >= 0 (no overflow,
 * even for INT64_MIN); then x mod p = p-1 - (y mod p) = (r ^ s) + (s & p)
 * where s is all ones. */
static inline int64_t es_floormod_fast(int64_t x, const es_modulus *d) {
    uint64_t s = (uint64_t)(x >> 63); /* 0 or all ones (arithmetic shift) */
    __uint128_t m = ((__uint128_t)d->m_hi << 64) | d->m_lo;
    __uint128_t low = m * ((uint64_t)x ^ s); /* fractional part of y/p, wraps mod 2^128 */
    __uint128_t bottom = ((__uint128_t)(uint64_t)low * d->p) >> 64;
    uint64_t r = (uint64_t)((bottom + (low >> 64) * d->p) >> 64);
    return (int64_t)((r ^ s) + (s & d->p));
}

/* Compression of one raw id: lookup[id] for id >= 0, negative ids unchanged.
 * The caller has checked id < vocab. lookup == NULL means identity. */
static inline int64_t es_compress(int64_t id, const int64_t *lookup) {
    return (id < 0 || lookup == 0) ? id : lookup[id];
}

/* ---- small primes: four floored mods at once, exactly, in double precision ----------
 * For p < 2^21 (every demo-size table): write y = |mix| (as ~mix when negative, see
 * es_floormod_fast) = hi*2^32 + lo; then y mod p = (hi*c + lo) mod p with c = 2^32 mod p,
 * and x = hi*c + lo < 2^53 is exact in a double. The nearest-integer quotient of x*(1/p)
 * is within 1 of floor(x/p), so r = x - q*p (exact) needs one correction each way. No
 * division, four lanes per instruction; measured against the DIV path in bench_hash. */
#define ES_FP_PRIME_MAX (1u << 21)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(ES_NO_CLONES)
#define ES_HASH_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ES_HASH_CLONES
#endif

typedef double es_v4d __attribute__((vector_size(32), aligned(8)));
typedef int64_t es_v4l __attribute__((vector_size(32), aligned(8)));

static inline __attribute__((always_inline)) void es_fpmod4(double hi, double lo, int neg, const double *p,
                                                            const double *inv, const double *c,
                                                            int64_t *out) {
    const es_v4d M = {0x1p52, 0x1p52, 0x1p52, 0x1p52}; /* x + 2^52 - 2^52: round to integer */
    const es_v4d pv = *(const es_v4d *)p;
    const es_v4d x = hi * *(const es_v4d *)c + lo;
    const es_v4d q = (x * *(const es_v4d *)inv + M) - M;
    es_v4d r = x - q * pv;
    r += (es_v4d)((es_v4l)(r < 0) & (es_v4l)pv);
    r -= (es_v4d)((es_v4l)(r >= pv) & (es_v4l)pv);
    const es_v4l nm = (es_v4l){0, 0, 0, 0} - (int64_t)neg; /* all ones when the mix is negative: */
    const es_v4d flipped = (pv - 1.0) - r;                  /* select, no branch (signs are random) */
    r = (es_v4d)(((es_v4l)flipped & nm) | ((es_v4l)r & ~nm));
    *(es_v4l *)out = (es_v4l)(r + M) - (es_v4l)M; /* exact integer r < 2^52 -> int64 bits */
}

/* All H = (max_ngram-1)*n_head head-local rows of one position.
 * win[k] is the compressed id at t-k (k < max_ngram; pads already filled in),
 * primes[j] the divisors in head order (order-major: heads of n=2, n=3, ...).
 * fp: NULL (hardware division), or double[3*H] = {p[H], 1/p[H], (2^32 mod p)[H]} when
 * every prime is below ES_FP_PRIME_MAX (HashPlan.head_fp). */
static inline __attribute__((always_inline)) void es_hash_window_core(
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
            for (; j + 4 <= n_head; j += 4)
                es_fpmod4(hi, lo, s != 0, fp + off + j, fp + H + off + j, fp + 2 * H + off + j, r + j);
        }
        for (; j < n_head; j++) r[j] = es_floormod((int64_t)h, primes[off + j]);
    }
}

ES_HASH_CLONES static void es_hash_window(const int64_t *win, const int64_t *mult, int max_ngram,
                                          int n_head, const int64_t *primes, const double *fp,
                                          int64_t *rows) {
    es_hash_window_core(win, mult, max_ngram, n_head, primes, fp, rows);
}

/* Rows of a whole sequence of compressed ids c[T] (positions before 0 read pad) into
 * rows[T][H]: one call per sequence, the per-position kernel inlined. */
ES_HASH_CLONES static void es_hash_sequence(const int64_t *c, int64_t T, int64_t pad, const int64_t *mult,
                                            int max_ngram, int n_head, const int64_t *primes,
                                            const double *fp, int64_t *rows) {
    const int H = (max_ngram - 1) * n_head;
    int64_t win[64];
    for (int64_t t = 0; t < T; t++) {
        for (int k = 0; k < max_ngram; k++) win[k] = t - k >= 0 ? c[t - k] : pad;
        es_hash_window_core(win, mult, max_ngram, n_head, primes, fp, rows + t * H);
    }
}

#endif /* ENGRAM_HASH_H */
