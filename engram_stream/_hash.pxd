# Declarations of the shared integer kernels (include/engram_hash.h), cimported by _hash.pyx and
# the hash window (engine/_window.pyx), whose hooks the variants' windows override.
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
    int ES_HASH_STREAM_BYTES
    enum:
        ES_HASH_BLOCK
    void es_hash_windows(const int64_t *win, int64_t ld, int64_t T, const int64_t *mult, int max_ngram,
                         int n_head, const int64_t *primes, const double *fp, const es_modulus *mods,
                         int64_t *rows, int stream) noexcept


# The kernel runtime (include/engram_isa.h): one per process, owned by this module. Every other
# extension binds it at import, `es_runtime_bind(es_runtime_of_process())` (a cdef function, so
# Cython hands it over through this module's capsule table), and from then on es_isa_now() and
# the other calls below reach this module's one state.
cdef extern from "engram_isa.h" nogil:
    ctypedef struct es_runtime:
        pass
    void es_runtime_bind(const es_runtime *rt) noexcept
    int es_isa_now() noexcept
    int es_isa_set(int level) noexcept
    void es_isa_call(int level) noexcept
    void es_isa_force(int on) noexcept
    int es_isa_forced() noexcept
    int es_isa_cpu_best() noexcept
    int es_isa_runs(int level) noexcept
    int es_isa_best_of(int feats) noexcept

cdef const es_runtime *es_runtime_of_process() noexcept nogil
