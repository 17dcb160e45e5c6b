# cython: language_level=3
"""Fast (nogil) hashing: compression and n-gram rows for whole [B, T] id arrays.

The numpy oracle is engram_stream.plan.HashPlan.hash_numpy; tests pin the two bit-equal.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t

from engram_stream.errors import id_out_of_range

from ._consts cimport (ES_EPS_CONV, ES_EPS_KEY, ES_GATE_CLAMP, ES_HIST_DEAD, ES_HIST_PLAIN, ES_HIST_SEP,
                       ES_MAX_KERNEL_SIZE, ES_MAX_NGRAM, ES_PREFILL_CHUNK)

cnp.import_array()

# The constants C, Cython and Python share, from include/engram_consts.h (their one source).
MAX_NGRAM = ES_MAX_NGRAM                # largest max_ngram_size (the kernels' stack window)
MAX_KERNEL_SIZE = ES_MAX_KERNEL_SIZE    # largest ShortConv kernel_size
EPS_KEY = <double> ES_EPS_KEY           # RMSNorm eps of keys and hidden: float32 eps
EPS_CONV = <double> ES_EPS_CONV         # RMSNorm eps of the ShortConv norms (float32 1e-5)
GATE_CLAMP = <double> ES_GATE_CLAMP     # the gate's sqrt(max(|s|, GATE_CLAMP)) (float32 1e-6)
PREFILL_CHUNK = ES_PREFILL_CHUNK        # prompt tokens per GEMM in StreamEngine.prefill
HIST_PLAIN = ES_HIST_PLAIN              # history rules of a hash window (HashPlan.history)
HIST_DEAD = ES_HIST_DEAD
HIST_SEP = ES_HIST_SEP


def compress(const int64_t[:, ::1] ids, const int64_t[::1] lookup, int64_t vocab_size, dead_id=None):
    """Compressed copy of ids (lookup may be None: identity). Raises ValueError on id >= vocab.
    dead_id (deepseek-v4.1): that id and negative (unknown) ids become -1, DEAD."""
    cdef Py_ssize_t B = ids.shape[0], T = ids.shape[1], b, t
    out = np.empty((B, T), dtype=np.int64)
    cdef int64_t[:, ::1] o = out
    cdef const int64_t *lk = &lookup[0] if lookup is not None else NULL
    cdef int64_t bad = -1, v
    cdef bint v41 = dead_id is not None
    cdef int64_t dead = dead_id if v41 else -1
    if lk != NULL and lookup.shape[0] != vocab_size:  # ids in [0, vocab_size) index the lookup
        raise ValueError(f"compress: lookup has {lookup.shape[0]} entries, vocab_size is {vocab_size}")
    with nogil:
        for b in range(B):
            for t in range(T):
                v = ids[b, t]
                if v >= vocab_size:
                    bad = v
                    break
                o[b, t] = -1 if v41 and (v < 0 or v == dead) else es_compress(v, lk)
            if bad >= 0:
                break
    if bad >= 0:
        raise id_out_of_range(bad, vocab_size)
    return out


FP_PRIME_MAX = ES_FP_PRIME_MAX


def fp_moduli(primes):
    """float64[3*H] = {p, 1/p, 2^32 mod p} for the double-precision mod, or None when a
    prime is too large for it (then the hash divides)."""
    p = [int(x) for x in primes]
    if not p or max(p) >= ES_FP_PRIME_MAX or min(p) < 1:
        return None
    return np.array(p + [1.0 / x for x in p] + [(1 << 32) % x for x in p], dtype=np.float64)


def hash_compressed(const int64_t[:, ::1] cids, const int64_t[::1] mult,
                    const int64_t[::1] primes, int max_ngram, int n_head, int64_t pad, out=None,
                    const double[::1] fp=None, int latch=ES_HIST_PLAIN):
    """int64[B, T, H] head-local rows of compressed ids (positions before 0 read pad).
    fp: fp_moduli(primes) for the division-free path, or None.
    latch: the history rule. HIST_DEAD (deepseek-v4.1): -1 entries are DEAD, positions before 0
    count as DEAD, and the dead-token latch fills the window (latch_window in _hash.pxd).
    HIST_SEP (qwen3.8-flash-next): a pad entry ends a document (separator_window)."""
    if latch not in (ES_HIST_PLAIN, ES_HIST_DEAD, ES_HIST_SEP):
        raise ValueError(f"hash_compressed: latch must be HIST_PLAIN, HIST_DEAD or HIST_SEP, got {latch}")
    cdef Py_ssize_t B = cids.shape[0], T = cids.shape[1], H = primes.shape[0], b
    cdef int k
    if not 2 <= max_ngram <= ES_MAX_NGRAM:
        raise ValueError(f"max_ngram_size must be in [2, {ES_MAX_NGRAM}]")
    if n_head < 0 or mult.shape[0] != max_ngram or H != (max_ngram - 1) * n_head:
        raise ValueError("hash_compressed: multipliers/primes do not match the geometry")
    for k in range(H):
        if primes[k] < 1:  # x mod 0 is SIGFPE
            raise ValueError(f"hash_compressed: primes must be positive, got {primes[k]}")
    if out is None:
        out = np.empty((B, T, H), dtype=np.int64)
    cdef int64_t[:, :, ::1] o = out
    if o.shape[0] != B or o.shape[1] != T or o.shape[2] != H:
        raise ValueError(f"hash_compressed: out must have shape {(B, T, H)}, got {np.shape(out)}")
    cdef const double *pfp = NULL
    if fp is not None:
        if not _is_fp_moduli(fp, primes):  # the kernel trusts these constants
            raise ValueError("hash_compressed: fp must be fp_moduli(primes)")
        pfp = &fp[0]
    if B == 0 or T == 0:
        return out
    cdef bint stream = B * T * H * 8 >= ES_HASH_STREAM_BYTES  # too large to stay in cache
    with nogil:
        for b in range(B):
            es_hash_sequence(&cids[b, 0], T, pad, latch, &mult[0], max_ngram, n_head, &primes[0], pfp,
                             &o[b, 0, 0], stream)
    return out


cdef bint _is_fp_moduli(const double[::1] fp, const int64_t[::1] primes):
    """fp == fp_moduli(primes), checked per call without building Python objects."""
    cdef Py_ssize_t H = primes.shape[0], j
    cdef int64_t p
    if H == 0 or fp.shape[0] != 3 * H:
        return False
    for j in range(H):
        p = primes[j]
        if not (1 <= p < ES_FP_PRIME_MAX and fp[j] == <double>p and fp[H + j] == 1.0 / <double>p
                and fp[2 * H + j] == <double>((<int64_t>1 << 32) % p)):
            return False
    return True


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
