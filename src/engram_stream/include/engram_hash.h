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

/* All H = (max_ngram-1)*n_head head-local rows of one position.
 * win[k] is the compressed id at t-k (k < max_ngram; pads already filled in),
 * primes[j] the divisors in head order (order-major: heads of n=2, n=3, ...). */
static inline void es_hash_window(const int64_t *win, const int64_t *mult,
                                  int max_ngram, int n_head,
                                  const int64_t *primes, int64_t *rows) {
    uint64_t h = (uint64_t)win[0] * (uint64_t)mult[0];
    for (int n = 2; n <= max_ngram; n++) {
        h ^= (uint64_t)win[n - 1] * (uint64_t)mult[n - 1];
        const int64_t *p = primes + (n - 2) * n_head;
        int64_t *r = rows + (n - 2) * n_head;
        for (int j = 0; j < n_head; j++) r[j] = es_floormod((int64_t)h, p[j]);
    }
}

#endif /* ENGRAM_HASH_H */
