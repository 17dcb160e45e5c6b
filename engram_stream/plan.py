"""HashPlan: the integer geometry of every Engram layer, and the n-gram hash.

Two hash paths, pinned bit-equal by the tests:
  hash_numpy  the oracle: the reference's numpy expression, nothing clever;
  hash        the fast path: the variant's hash window (Variant.window_class, a HashWindow of
              engine/_window.pyx) hashes the ids nogil through the same cdef hooks (entry, history
              rule, hash) the streaming engine runs per token.

What differs between variants comes from their Variant (engram_stream.variants): the multiplier
draw, the table rows (padding), the raw id compressed to DEAD, the gate mask, the numpy oracle's
windows (Variant.windows) and the fast path's window class. This file branches on none of them.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _hash
from .config import MAX_TABLE_ROWS, EngramConfig
from .errors import LayerError
from .variants import Variant, variant_of, variants

DEAD = -1  # a compressed window entry that blocks history (image token, unknown, before start)
# Positions x layers below which plan.hash stays on one thread: a hand-off costs more than it
# saves there (bench_hash's [8, 4096] x 2 layers, ~0.5 ms on one core, ran slower on two threads
# of the shared 2-core machine), and the caller's core is the only one surely free.
PARALLEL_MIN_POSITIONS = 1 << 18
_POOL = None


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _pool():
    """One shared thread pool for plan.hash (the nogil kernel runs in parallel)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_hash_workers(), thread_name_prefix="engram-hash")
    return _POOL


def _forget_pool():
    """In a forked child the pool's threads do not exist (fork copies only the calling thread):
    drop it, so the child's first plan.hash starts its own instead of waiting forever."""
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def _run_shared(jobs, run, workers):
    """run(job) for every job, by this thread and up to workers-1 pool threads taking the next
    job from one shared counter. The caller works too and waits only for jobs another thread
    took: a helper that a busy machine does not schedule in time is cancelled, not waited for."""
    nxt = itertools.count()  # next() is atomic under the GIL

    def take():
        for i in iter(nxt.__next__, None):
            if i >= len(jobs):
                return
            run(jobs[i])

    helpers = [_pool().submit(take) for _ in range(min(workers, len(jobs)) - 1)]
    try:
        take()
    finally:
        for f in helpers:
            if not f.cancel():
                f.result()


def _empty_aligned(count, shape) -> list:
    """`count` int64 arrays of `shape` in one allocation, each starting on a 64-byte boundary
    (numpy's large blocks start 16 bytes past one): the kernel's streaming stores need aligned
    rows. One block: malloc reuses one large block from call to call where separate ones are
    returned to the kernel and fault their pages in again."""
    n = int(np.prod(shape))
    stride = -(-n // 8) * 8
    raw = np.empty(count * stride + 8, dtype=np.int64)
    skip = (-raw.ctypes.data % 64) // 8
    return [raw[skip + i * stride:skip + i * stride + n].reshape(shape) for i in range(count)]


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def prime_chain(cfg: EngramConfig) -> dict:
    """{layer: [[prime]*n_head for each order 2..max_ngram]}, one seen-set across everything."""
    seen, out = set(), {}
    for layer in cfg.layer_ids:
        orders = []
        for n in range(2, cfg.max_ngram_size + 1):
            start, heads = cfg.engram_vocab_size[n - 2] - 1, []
            for _ in range(cfg.n_head_per_ngram):
                c = start + 1
                while c in seen or not is_prime(c):
                    c += 1
                seen.add(c)
                heads.append(c)
                start = c
            orders.append(heads)
        out[layer] = orders
    return out


def frozen(a, dtype=None) -> np.ndarray:
    """A read-only C-contiguous view of `a` (converted only when it has to be): what models and
    plans hold, since engines read them through raw pointers. The caller's array keeps its flags."""
    if not (isinstance(a, np.ndarray) and a.flags.c_contiguous and (dtype is None or a.dtype == dtype)):
        a = np.ascontiguousarray(a, dtype=dtype)
    a = a.view()  # (an np.memmap stays one)
    a.flags.writeable = False
    return a


def as_ids(ids, ndim: int, what: str = "ids") -> np.ndarray:
    """Integer ids as a C-contiguous int64 array of the given ndim (TypeError/ValueError otherwise)."""
    a = np.asarray(ids)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
        raise TypeError(f"{what} must be integers, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{what} must be {ndim}-d, got shape {a.shape}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{what} holds values past int64")
    return np.ascontiguousarray(a, dtype=np.int64)


class HashPlan:
    """Geometry and hashing for all layers of a config.

    compression: int64[vocab_size] lookup (the tokenizer normalization, see
    build_compression) or None for identity. multipliers: {layer: int64[max_ngram]}
    to inject (any int64, even values that wrap), else drawn as the reference does.
    """

    def __init__(self, cfg: EngramConfig, compression=None, multipliers=None):
        if not isinstance(cfg, EngramConfig):
            raise TypeError(f"HashPlan needs an EngramConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.lookup = None if compression is None else validate_compression(compression, cfg.vocab_size)
        self.compressed_vocab = cfg.vocab_size if self.lookup is None else int(self.lookup.max()) + 1
        self.pad_id = cfg.pad_id if self.lookup is None else int(self.lookup[cfg.pad_id])
        spec = self.variant = variant_of(cfg)
        if multipliers is None:
            self.multipliers = spec.draw_multipliers(cfg, self.compressed_vocab)
        else:
            self.multipliers = validate_multipliers(cfg, multipliers)
        self.primes = prime_chain(cfg)
        for L, orders in self.primes.items():
            rows = sum(p for order in orders for p in order)  # Python ints: never wraps
            if rows > MAX_TABLE_ROWS:
                raise ValueError(f"layer {L}: the primes sum to {rows} table rows, past int64 ({MAX_TABLE_ROWS}): "
                                 f"use smaller engram_vocab_size")
        self.head_primes = {L: np.array([p for order in self.primes[L] for p in order], dtype=np.int64)
                            for L in cfg.layer_ids}
        self.offsets = {L: np.concatenate([[0], np.cumsum(p)[:-1]]).astype(np.int64)
                        for L, p in self.head_primes.items()}
        # rows past the primes' sum (a variant's padding) are rows no hash reaches
        self.table_rows = {L: int(spec.table_rows(cfg, int(p.sum()))) for L, p in self.head_primes.items()}
        # the division-free mod's constants, when the primes are small enough (else None)
        self.head_fp = {L: _hash.fp_moduli(p) for L, p in self.head_primes.items()}
        for arrays in (self.multipliers, self.head_primes, self.offsets, self.head_fp):  # shared read-only
            for L, a in arrays.items():
                arrays[L] = None if a is None else frozen(a)
        self.lookup = None if self.lookup is None else frozen(self.lookup)
        self._window_class = spec.window_class
        self._windows = {}  # {layer: the window class's of_plan(self, layer)}, made at the first hash
        self.history = self._window_class().history  # the rule's name, as the window class says it
        self.dead_id = spec.dead_id(cfg)  # raw id of a DEAD position, or None
        spec.check_plan(self)

    def __repr__(self):
        return (f"HashPlan(layers={self.cfg.layer_ids}, heads={self.cfg.n_heads}, "
                f"compressed_vocab={self.compressed_vocab}, pad_id={self.pad_id})")

    def check_layer(self, layer) -> int:
        if layer not in self.head_primes:
            raise LayerError(f"layer {layer!r} is not an Engram layer (layer_ids={self.cfg.layer_ids})")
        return layer

    def compress(self, ids) -> np.ndarray:
        """Compressed ids (same shape). ids >= vocab_size raise; negative ids pass through."""
        a = as_ids(ids, np.ndim(ids))
        return self._compress(a.reshape(1, -1)).reshape(a.shape)

    def _compress(self, a):
        return _hash.compress(a, self.lookup, self.cfg.vocab_size, self.dead_id)  # DEAD = -1

    def dead_mask(self, ids) -> np.ndarray:
        """bool, same shape: the positions whose gate is 0 (the variant's Variant.dead_mask)."""
        a = as_ids(ids, np.ndim(ids))
        return np.asarray(self.variant.dead_mask(self.cfg, a), bool).reshape(a.shape)

    def hash(self, ids, layers=None, out=None) -> dict:
        """{layer: int64[B, T, H]} head-local rows for raw ids[B, T] (fast path).

        out: optional {layer: int64[B, T, H]} buffers to fill (saves the page faults
        of fresh multi-MB arrays when hashing batch after batch). Large inputs are
        split by layer and batch row over the machine's cores (the kernel runs nogil)."""
        a = as_ids(ids, 2)
        if out is not None and not isinstance(out, dict):
            raise TypeError(f"out must be a dict {{layer: int64[B, T, H]}}, got {type(out).__name__}")
        layers = self.cfg.layer_ids if layers is None else [self.check_layer(L) for L in layers]
        shape = a.shape + (self.cfg.n_heads,)
        res = {}
        block = None  # fresh outputs: one allocation (_empty_aligned)
        for i, L in enumerate(layers):
            buf = None if out is None else out.get(L)
            if buf is None:
                if block is None:
                    block = _empty_aligned(len(layers), shape)
                buf = block[i]
            elif not (isinstance(buf, np.ndarray) and buf.dtype == np.int64 and buf.shape == shape
                      and buf.flags.c_contiguous and buf.flags.writeable):
                raise ValueError(f"out[{L}] must be a writeable C-contiguous int64 array of shape {shape}")
            else:
                for M, other in res.items():  # C-contiguous: bounds that meet are shared memory
                    if np.may_share_memory(buf, other):
                        raise ValueError(f"out[{L}] and out[{M}] overlap: each layer needs a buffer of its own")
            res[L] = buf
        B = a.shape[0]
        for L in layers:  # made here, on the calling thread: the jobs only read them
            if L not in self._windows:
                self._windows[L] = self._window_class.of_plan(self, L)
        windows = self._windows

        def run(job):
            L, b0, b1 = job
            windows[L].hash_batch(a[b0:b1], res[L][b0:b1])

        workers = _hash_workers()
        if workers > 1 and a.size * len(layers) >= PARALLEL_MIN_POSITIONS and B * len(layers) > 1:
            per = max(1, -(-B * len(layers) // (2 * workers)) // len(layers))  # ~2 jobs per worker
            _run_shared([(L, b0, min(B, b0 + per)) for L in layers for b0 in range(0, B, per)], run, workers)
        else:
            for L in layers:
                run((L, 0, B))
        return res

    def hash_numpy(self, ids, layers=None) -> dict:
        """The oracle: the reference's numpy expression, step by step."""
        a = as_ids(ids, 2)
        if a.size and a.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id {a.max()} out of range: ids must be < vocab_size={self.cfg.vocab_size}")
        x = a.copy()
        if self.lookup is not None:
            pos = x >= 0
            x[pos] = self.lookup[x[pos]]
        B, T = x.shape
        n_max = self.cfg.max_ngram_size
        shifted = self.variant.windows(self.cfg, self.pad_id, a, x)
        out = {}
        with np.errstate(over="ignore"):
            for L in (self.cfg.layer_ids if layers is None else layers):
                mult, heads = self.multipliers[self.check_layer(L)], []
                for n in range(2, n_max + 1):
                    mix = shifted[0] * mult[0]
                    for k in range(1, n):
                        mix = np.bitwise_xor(mix, shifted[k] * mult[k])
                    heads += [mix % np.int64(p) for p in self.primes[L][n - 2]]
                out[L] = np.stack(heads, axis=2) if heads else np.zeros((B, T, 0), np.int64)
        return out

    def hash_lookback(self, ids, lookback, layers=None, numpy=False) -> dict:
        """The stateless form (vLLM's lookback window): rows of ids[B, T] given the raw ids
        just before them, lookback[B, max_ngram-1] newest first, -1 where unknown (before the start:
        it blocks history like DEAD). Same as hashing the concatenated sequence."""
        a = as_ids(ids, 2)
        lb = as_ids(lookback, 2, "lookback")
        if lb.shape != (a.shape[0], self.cfg.max_ngram_size - 1):
            raise ValueError(f"lookback must have shape ({a.shape[0]}, {self.cfg.max_ngram_size - 1}), "
                             f"got {lb.shape}")
        if self.dead_id is None and (lb < 0).any():
            takers = [v.name for v in variants() if type(v).dead_id is not Variant.dead_id]
            raise ValueError(f"lookback: unknown (-1) entries need a variant with a DEAD token ({takers}), "
                             f"not {self.cfg.variant!r}")
        seq = np.concatenate([lb[:, ::-1], a], axis=1)
        rows = (self.hash_numpy if numpy else self.hash)(seq, layers=layers)
        return {L: np.ascontiguousarray(r[:, lb.shape[1]:]) for L, r in rows.items()}


def validate_multipliers(cfg: EngramConfig, multipliers) -> dict:
    if not isinstance(multipliers, dict):
        raise TypeError(f"multipliers must be a dict {{layer: int64[{cfg.max_ngram_size}]}}, "
                        f"got {type(multipliers).__name__}")
    if sorted(multipliers) != sorted(cfg.layer_ids):
        raise ValueError(f"multipliers must have exactly the layers {cfg.layer_ids}, got {sorted(multipliers)}")
    out = {}
    for L in cfg.layer_ids:
        m = np.asarray(multipliers[L])
        if not np.issubdtype(m.dtype, np.integer):
            raise TypeError(f"multipliers[{L}] must be integers, got dtype {m.dtype}")
        if m.shape != (cfg.max_ngram_size,):
            raise ValueError(f"multipliers[{L}] must have shape ({cfg.max_ngram_size},), got {m.shape}")
        if m.dtype == np.uint64:
            m = m.view(np.int64)  # same bits: injected values may wrap
        out[L] = np.array(m, dtype=np.int64, order="C")  # a private copy: the caller's may change
    return out


def validate_compression(lookup, vocab_size: int) -> np.ndarray:
    """A dense compression table: int64[vocab_size], values >= 0 covering 0..max without gaps."""
    a = np.asarray(lookup)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"compression table must be integers, got dtype {a.dtype}")
    if a.ndim != 1 or a.shape[0] != vocab_size:
        raise ValueError(f"compression table must have shape ({vocab_size},) (vocab_size), got {a.shape}")
    a = np.array(a, dtype=np.int64, order="C")  # a private copy: the plan must not change under us
    if a.min() < 0:
        raise ValueError(f"compression table has negative entries (min {a.min()})")
    if a.max() >= vocab_size:  # V entries cover at most V distinct ids
        raise ValueError(f"compression table has gaps: max id {a.max()} >= its length {vocab_size}")
    used = np.zeros(int(a.max()) + 1, dtype=bool)
    used[a] = True
    if not used.all():
        gap = int(np.flatnonzero(~used)[0])
        raise ValueError(f"compression table has gaps: compressed id {gap} is never used "
                         f"(values must cover 0..{a.max()})")
    return a
