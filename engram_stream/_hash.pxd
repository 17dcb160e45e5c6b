# Declarations of the shared integer kernels (engram_stream/include/engram_hash.h),
# cimported by _hash.pyx and _engine.pyx.
from libc.stdint cimport int64_t, uint64_t

cdef extern from "engram_hash.h" nogil:
    int64_t es_floormod(int64_t x, int64_t p) noexcept
    ctypedef struct es_modulus:
        uint64_t m_lo
        uint64_t m_hi
        uint64_t p
    es_modulus es_modulus_make(uint64_t p) noexcept
    int64_t es_floormod_fast(int64_t x, const es_modulus *d) noexcept
    int64_t es_compress(int64_t id, const int64_t *lookup) noexcept
    unsigned ES_FP_PRIME_MAX
    void es_hash_window(const int64_t *win, const int64_t *mult, int max_ngram, int n_head,
                        const int64_t *primes, const double *fp, int64_t *rows) noexcept
    void es_hash_sequence(const int64_t *c, int64_t T, int64_t pad, const int64_t *mult, int max_ngram,
                          int n_head, const int64_t *primes, const double *fp, int64_t *rows) noexcept
