# Declarations of the shared integer kernels (include/engram_hash.h), cimported by _hash.pyx,
# the engines' hash window (engine/_window.pyx) and the variants' windows (v41/, qwen/_engine.pyx).
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
    void es_hash_sequence(const int64_t *c, int64_t T, int64_t pad, int latch, const int64_t *mult,
                          int max_ngram, int n_head, const int64_t *primes, const double *fp,
                          int64_t *rows, int stream) noexcept


# deepseek-v4.1: the dead-token latch (DESIGN.md 4.4). hist[k] is the compressed id at t-k, or
# a negative value (DEAD: an image token, an unknown id, a slot before the start). The first
# DEAD entry turns itself and every older one into pad; newer entries keep their ids.
cdef inline void latch_window(const int64_t *hist, int n, int64_t pad, int64_t *win) noexcept nogil:
    cdef bint blocked = False
    cdef int k
    for k in range(n):
        blocked = blocked or hist[k] < 0
        win[k] = pad if blocked else hist[k]

# qwen3.8-flash-next: the separator (DESIGN.md 4b). hist[k] is the id at t-k, pad (its EOS)
# before the start. A pad entry at k >= 1 ends the document before t: the older entries read pad.
# The entry at t itself cuts nothing (an EOS keeps the history of the document it ends).
cdef inline void separator_window(const int64_t *hist, int n, int64_t pad, int64_t *win) noexcept nogil:
    cdef bint blocked = False
    cdef int k
    win[0] = hist[0]
    for k in range(1, n):
        win[k] = pad if blocked else hist[k]
        blocked = blocked or hist[k] == pad

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
