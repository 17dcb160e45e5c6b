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

#include <float.h>
#include <stdint.h>

#include "engram_isa.h"
#include "engram_consts.h"
#if ES_X86_PATHS
#include <immintrin.h> /* the streaming (non-temporal) stores */
#endif

/* Floored x mod p (p > 0, result in [0, p)), as numpy's %: a hardware
 * division and one correction. The per-token path's mod for primes past
 * ES_FP_PRIME_MAX; batches use es_floormod_fast (0.5x its time in bench_hash). */
static inline int64_t es_floormod(int64_t x, int64_t p) {
    int64_t r = x % p;
    return r < 0 ? r + p : r;
}

/* The reciprocal alternative (es_hash_windows, primes past ES_FP_PRIME_MAX; measured
 * beside the division in bench_hash): Lemire's "fastmod" with a 128-bit magic
 * M = floor((2^128-1)/p) + 1, exact for every 64-bit numerator and divisor
 * (Lemire, Kaser, Kurz 2019): four multiplies, no division. */
/* Needs a 128-bit integer type (64-bit GCC/clang). Without one (32-bit targets) the
 * "fast" mod falls back to the division: same results, no reciprocal. */
#if defined(__SIZEOF_INT128__)
#define ES_HAVE_INT128 1
#else
#define ES_HAVE_INT128 0
#endif

typedef struct {
    uint64_t m_lo;
    uint64_t m_hi;
    uint64_t p;
} es_modulus;

static inline es_modulus es_modulus_make(uint64_t p) {
    es_modulus r;
    r.p = p;
#if ES_HAVE_INT128
    __uint128_t m = ((__uint128_t)0 - 1) / p + 1; /* p == 1 gives M = 0: x mod 1 = 0 */
    r.m_lo = (uint64_t)m;
    r.m_hi = (uint64_t)(m >> 64);
#else
    r.m_lo = r.m_hi = 0;
#endif
    return r;
}

/* Floored x mod p, branch-free. For x < 0 let y = ~x = -x-1 >= 0 (no overflow,
 * even for INT64_MIN); then x mod p = p-1 - (y mod p) = (r ^ s) + (s & p)
 * where s is all ones. */
static inline int64_t es_floormod_fast(int64_t x, const es_modulus *d) {
#if !ES_HAVE_INT128
    return es_floormod(x, (int64_t)d->p);
#else
    uint64_t s = (uint64_t)(x >> 63); /* 0 or all ones (arithmetic shift) */
    __uint128_t m = ((__uint128_t)d->m_hi << 64) | d->m_lo;
    __uint128_t low = m * ((uint64_t)x ^ s); /* fractional part of y/p, wraps mod 2^128 */
    __uint128_t bottom = ((__uint128_t)(uint64_t)low * d->p) >> 64;
    uint64_t r = (uint64_t)((bottom + (low >> 64) * d->p) >> 64);
    return (int64_t)((r ^ s) + (s & d->p));
#endif
}

/* Compression of one raw id: lookup[id] for id >= 0, negative ids unchanged.
 * The caller has checked id < vocab. lookup == NULL means identity. */
static inline int64_t es_compress(int64_t id, const int64_t *lookup) {
    return (id < 0 || lookup == 0) ? id : lookup[id];
}

/* ---- primes below 2^21: floored mods without division, in double precision -------------
 * Split the mix as h = hi*2^32 + lo (hi = h >> 32 signed, lo in [0, 2^32)); then
 * h mod p = x mod p for x = hi*c + lo, c = 2^32 mod p, and |x| < 2^31*p + 2^32 < 2^53 is
 * exact in a double (for every int64 h). q = x*(1/p) rounded to the nearest integer is
 * within 0.5 + 2^-19 of x/p (|x/p| < 2^33), so r = x - q*p (exact) lies in (-p, p) and one
 * correction (r < 0: r += p) gives the floored mod. No division; ES_VD heads per
 * instruction, about seven instructions per vector of results.
 * The rounding trick needs doubles evaluated in double precision (not x87's extended). */
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#define ES_FP_PRIME_MAX 0u /* no exact double path: every prime divides */
#else
#define ES_FP_PRIME_MAX (1u << 21)
#endif

/* es_hash_windows's stack scratch: positions per block, and doubles per mix array (every
 * order of a block; the block shrinks for long windows, down to 8 positions). ~12 KB. */
#define ES_HASH_BLOCK 64
#define ES_HASH_SCRATCH 512
/* Outputs at least this large (a core's L2) are written with streaming stores when aligned: they
 * do not stay in cache anyway, and a cache-missing store first reads its line (twice the
 * traffic). Measured in bench_hash: ~1.9x faster on outputs that other work evicted. */
#define ES_HASH_STREAM_BYTES (1 << 21)
_Static_assert(ES_HASH_SCRATCH >= 8 * (ES_MAX_NGRAM - 1), "a block holds at least 8 positions of every order");

/* The per-ISA copies of the hash kernels (engram_hash_kern.h), then one dispatching
 * name each. primes[j] are the divisors in head order (order-major: heads of n=2, n=3,
 * ...); fp: NULL (hardware division), or double[3*H] = {p[H], 1/p[H], (2^32 mod p)[H]}
 * when every prime is below ES_FP_PRIME_MAX (HashPlan.head_fp). */
#define ES_PATH ES_ISA_BASELINE /* ES_VD 2, one SSE2/NEON register: wider generic vectors lower to scalar compares */
#define ES_CVT 0
#if ES_X86_PATHS
#define ES_STREAM(p, v) _mm_stream_si128((__m128i *)(p), (__m128i)(v))
#define ES_SFENCE() _mm_sfence()
#else
#define ES_STREAM(p, v) (*(p) = (v))
#define ES_SFENCE() ((void)0)
#endif
#include "engram_hash_kern.h"
#if ES_X86_PATHS
#define ES_PATH ES_ISA_AVX2
#define ES_CVT 0
#define ES_STREAM(p, v) _mm256_stream_si256((__m256i *)(p), (__m256i)(v))
#define ES_SFENCE() _mm_sfence()
#include "engram_hash_kern.h"
#define ES_PATH ES_ISA_AVX512
#define ES_CVT 1
#define ES_STREAM(p, v) _mm512_stream_si512((void *)(p), (__m512i)(v))
#define ES_SFENCE() _mm_sfence()
#include "engram_hash_kern.h"
#endif /* ES_X86_PATHS */
#if ES_NEON_PATHS
#define ES_PATH ES_ISA_NEON
#define ES_CVT 1 /* FCVTZS / SCVTF: double <-> int64 lanes */
#define ES_STREAM(p, v) (*(p) = (v))
#define ES_SFENCE() ((void)0)
#include "engram_hash_kern.h"
#endif

/* All H = (max_ngram-1)*n_head head-local rows of one position. win[k] is the compressed
 * id at t-k (k < max_ngram; pads already filled in). */
static inline void es_hash_window(const int64_t *win, const int64_t *mult, int max_ngram, int n_head,
                                  const int64_t *primes, const double *fp, int64_t *rows) {
    ES_DISPATCH(es_hash_window, (win, mult, max_ngram, n_head, primes, fp, rows));
}

/* Rows of T positions from their windows, win[k*ld + t] (es_hash_windows_core): what a hash
 * window's default hash hook (HashWindow.hash_rows) runs on a block of positions. mods: the
 * primes' es_modulus (used when fp is NULL), or NULL. stream: write with streaming stores where
 * rows are aligned to a vector and n_head is a multiple of one (see ES_HASH_STREAM_BYTES). */
static inline void es_hash_windows(const int64_t *win, int64_t ld, int64_t T, const int64_t *mult, int max_ngram,
                                   int n_head, const int64_t *primes, const double *fp, const es_modulus *mods,
                                   int64_t *rows, int stream) {
    ES_DISPATCH(es_hash_windows, (win, ld, T, mult, max_ngram, n_head, primes, fp, mods, rows, stream));
}

#endif /* ENGRAM_HASH_H */
