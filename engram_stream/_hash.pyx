# cython: language_level=3
"""The shared integer kernels' Python side: compression of whole [B, T] id arrays, the mods alone
(tests, bench_hash), the division-free mod's constants and the process's kernel runtime.

The n-gram rows of [B, T] ids are hashed by the variant's hash window (engine/_window.pyx,
HashWindow.hash_batch) through its history rule and hash hooks; HashPlan.hash drives it.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t

from ._consts cimport ES_EPS_CONV, ES_EPS_KEY, ES_GATE_CLAMP, ES_MAX_KERNEL_SIZE, ES_MAX_NGRAM, ES_PREFILL_CHUNK

cnp.import_array()

# The constants C, Cython and Python share, from include/engram_consts.h (their one source).
MAX_NGRAM = ES_MAX_NGRAM                # largest max_ngram_size (the kernels' stack window)
MAX_KERNEL_SIZE = ES_MAX_KERNEL_SIZE    # largest ShortConv kernel_size
EPS_KEY = <double> ES_EPS_KEY           # RMSNorm eps of keys and hidden: float32 eps
EPS_CONV = <double> ES_EPS_CONV         # RMSNorm eps of the ShortConv norms (float32 1e-5)
GATE_CLAMP = <double> ES_GATE_CLAMP     # the gate's sqrt(max(|s|, GATE_CLAMP)) (float32 1e-6)
PREFILL_CHUNK = ES_PREFILL_CHUNK        # prompt tokens per GEMM in StreamEngine.prefill


def compress(const int64_t[:, ::1] ids, const int64_t[::1] lookup, int64_t vocab_size, dead_id=None):
    """Compressed copy of ids (lookup may be None: identity). Raises ValueError on id >= vocab.
    dead_id (a variant's Variant.dead_id, or None): that id and negative (unknown) ids become -1, DEAD."""
    cdef Py_ssize_t B = ids.shape[0], T = ids.shape[1], b, t
    out = np.empty((B, T), dtype=np.int64)
    cdef int64_t[:, ::1] o = out
    cdef const int64_t *lk = &lookup[0] if lookup is not None else NULL
    cdef int64_t bad = -1, v
    cdef bint has_dead = dead_id is not None
    cdef int64_t dead = dead_id if has_dead else -1
    if lk != NULL and lookup.shape[0] != vocab_size:  # ids in [0, vocab_size) index the lookup
        raise ValueError(f"compress: lookup has {lookup.shape[0]} entries, vocab_size is {vocab_size}")
    with nogil:
        for b in range(B):
            for t in range(T):
                v = ids[b, t]
                if v >= vocab_size:
                    bad = v
                    break
                o[b, t] = -1 if has_dead and (v < 0 or v == dead) else es_compress(v, lk)
            if bad >= 0:
                break
    if bad >= 0:
        raise ValueError(f"token id {bad} out of range: ids must be < vocab_size={vocab_size}")
    return out


FP_PRIME_MAX = ES_FP_PRIME_MAX


def fp_moduli(primes):
    """float64[3*H] = {p, 1/p, 2^32 mod p} for the double-precision mod, or None when a
    prime is too large for it (then the hash divides)."""
    p = [int(x) for x in primes]
    if not p or max(p) >= ES_FP_PRIME_MAX or min(p) < 1:
        return None
    return np.array(p + [1.0 / x for x in p] + [(1 << 32) % x for x in p], dtype=np.float64)


# The mods alone, for tests and for bench/bench_hash.py ------------------------

def floormod(const int64_t[::1] x, const int64_t[::1] primes, bint reciprocal=False):
    """int64[N, P]: floored x[i] % primes[j], by hardware division or by the reciprocal kernel."""
    out = np.empty((x.shape[0], primes.shape[0]), dtype=np.int64)
    cdef int64_t[:, ::1] o = out
    cdef Py_ssize_t i, j, P = primes.shape[0]
    cdef es_modulus mods[256]
    if P > 256 or (P and min(primes) < 1):
        raise ValueError("floormod: at most 256 positive primes")
    for j in range(P):
        mods[j] = es_modulus_make(<uint64_t>primes[j])
    with nogil:
        if reciprocal:
            for i in range(x.shape[0]):
                for j in range(P):
                    o[i, j] = es_floormod_fast(x[i], &mods[j])
        else:
            for i in range(x.shape[0]):
                for j in range(P):
                    o[i, j] = es_floormod(x[i], primes[j])
    return out


# The kernel runtime of the process (include/engram_isa.h): this module's, which every other
# extension binds at import; engram_stream.engine.isa drives it ------------------------------

cdef extern from "engram_runtime.h" nogil:
    const es_runtime es_runtime_own


cdef const es_runtime *es_runtime_of_process() noexcept nogil:
    return &es_runtime_own


def _isa_set(int level, bint force=False):
    """Run every extension's kernels at `level` (0 baseline, 1 avx2, 2 avx512, 3 bf16, 4 neon);
    force: every call's measured path (es_isa_call) is ignored until unforced (False: honoured). False
    if the CPU or this build cannot run it (nothing changes)."""
    if es_isa_set(level) != 0:
        return False
    es_isa_force(force)
    return True


def _isa_get():
    """The level the calling thread's kernels run."""
    return es_isa_now()


def _isa_forced():
    """Whether the process's level is forced (ENGRAM_STREAM_ISA, use_isa)."""
    return es_isa_forced() != 0


def _isa_call(int level):
    """The calling thread's level for its next kernels (-1: the process's again), as an engine
    sets it around an operation; ignored while the level is forced."""
    es_isa_call(level)


def _isa_cpu_best():
    """The best level this CPU and build run."""
    return es_isa_cpu_best()


def _isa_runs(int level):
    """Whether this CPU and build run `level`."""
    return es_isa_runs(level) != 0


def _isa_best_of(int feats):
    """The best level of a CPU with the feature bits `feats` (engram_isa.h ES_CPU_*: 1 AVX2, 2 FMA,
    4 F16C, 8 AVX-512 F/BW/VL/DQ, 16 AVX512_BF16 + VBMI) in this build."""
    return es_isa_best_of(feats)
