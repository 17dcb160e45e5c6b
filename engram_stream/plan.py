"""HashPlan: the integer geometry of every Engram layer, and the n-gram hash.

Two hash paths, pinned bit-equal by the tests:
  hash_numpy  the oracle: the reference's numpy expression, nothing clever;
  hash        the fast path: the variant's hash window (Variant.window_class, a HashWindow of
              engine/_window.pyx) hashes the ids nogil through the same cdef hooks (entry, history
              rule, hash) the streaming engine runs per token.

What differs between variants comes from their Variant (engram_stream.variants): the multiplier
draw, the head sizes, more per-layer hash data (plan_extras), the table rows (padding), the raw id
compressed to DEAD, the gate mask, whether negative ids are taken, the numpy oracle's windows and
rows (Variant.windows, rows_numpy) and the fast path's window class. This file branches on none of them.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _hash
from .config import MAX_TABLE_ROWS, EngramConfig
from .errors import LayerError, id_out_of_range, negative_id
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
        sizes = spec.head_sizes(cfg)
        k = cfg.n_head_per_ngram
        self.head_primes = {}   # {layer: int64[H]} each head's table size (its modulus)
        for L in cfg.layer_ids:
            p = np.asarray(sizes.get(L) if isinstance(sizes, dict) else None)
            if p.shape != (cfg.n_heads,) or not np.issubdtype(p.dtype, np.integer) or (p < 1).any():
                raise ValueError(f"{spec.name}: Variant.head_sizes gave layer {L} {p!r}: it must give "
                                 f"int64[{cfg.n_heads}] (n_heads) positive sizes for every layer")
            rows = sum(int(x) for x in p)  # Python ints: never wraps
            if rows > MAX_TABLE_ROWS:
                raise ValueError(f"layer {L}: the head sizes sum to {rows} table rows, past int64 ({MAX_TABLE_ROWS}): "
                                 f"use smaller engram_vocab_size")
            self.head_primes[L] = np.array(p, dtype=np.int64)
        # {layer: [[size]*n_head for each order 2..max_ngram]}: the sizes by order
        self.primes = {L: [p[g * k:(g + 1) * k].tolist() for g in range(cfg.max_ngram_size - 1)]
                       for L, p in self.head_primes.items()}
        self.offsets = {L: np.concatenate([[0], np.cumsum(p)[:-1]]).astype(np.int64)
                        for L, p in self.head_primes.items()}
        # rows past the sizes' sum (a variant's padding) are rows no hash reaches
        self.table_rows = {L: int(spec.table_rows(cfg, int(p.sum()))) for L, p in self.head_primes.items()}
        # the division-free mod's constants (any modulus), when the sizes are small enough (else None)
        self.head_fp = {L: _hash.fp_moduli(p) for L, p in self.head_primes.items()}
        extras = spec.plan_extras(cfg, self)
        for attr, per_layer in extras.items():   # the variant's own hash data, read-only like the rest
            if hasattr(self, attr):
                raise ValueError(f"{spec.name}: Variant.plan_extras names {attr!r}, which HashPlan has already")
            setattr(self, attr, {L: frozen(a) for L, a in per_layer.items()})
        for arrays in (self.multipliers, self.head_primes, self.offsets, self.head_fp):  # shared read-only
            for L, a in arrays.items():
                arrays[L] = None if a is None else frozen(a)
        self.lookup = None if self.lookup is None else frozen(self.lookup)
        self._window_class = spec.window_class
        self._windows = {}  # {layer: the window class's of_plan(self, layer)}, made at the first hash
        self.history = self._window_class().history  # the rule's name, as the window class says it
        self.dead_id = spec.dead_id(cfg)  # raw id of a DEAD position, or None
        spec.check_plan(self)

    def __getstate__(self):
        """Pickled without its windows (they borrow raw pointers): the next hash makes them again."""
        return dict(self.__dict__, _windows={})

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

    def _check_negative(self, a):
        """a, after refusing a negative id where the variant takes none (Variant.negative_ids),
        and there an id past the vocab too (the window's own check says negative ids are taken)."""
        if not self.variant.negative_ids and a.size:
            if a.min() < 0:
                raise negative_id(int(a.min()), self.cfg.vocab_size, self.cfg.variant)
            if a.max() >= self.cfg.vocab_size:
                raise id_out_of_range(int(a.max()), self.cfg.vocab_size, False)
        return a

    def hash(self, ids, layers=None, out=None) -> dict:
        """{layer: int64[B, T, H]} head-local rows for raw ids[B, T] (fast path).

        out: optional {layer: int64[B, T, H]} buffers to fill (saves the page faults
        of fresh multi-MB arrays when hashing batch after batch). Large inputs are
        split by layer and batch row over the machine's cores (the kernel runs nogil)."""
        a = self._check_negative(as_ids(ids, 2))
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
        B, T = a.shape
        for L in layers:  # made here, on the calling thread: the jobs only read them
            if L not in self._windows:
                self._windows[L] = self._window_class.of_plan(self, L)
        windows = self._windows
        if not layers or a.size == 0:
            return res
        # the windows (entry and history rule) depend on the ids alone: made once for every layer,
        # then each layer's hash reads them (8 entries past the last row: its last vector's lanes)
        wins = np.empty((self.cfg.max_ngram_size, a.size + 8), np.int64)
        wins[:, a.size:] = 0
        first = windows[layers[0]]

        def fill(job):
            b0, b1 = job
            first.windows_batch(a[b0:b1], wins, b0)

        def run(job):
            L, b0, b1 = job
            windows[L].hash_windows(wins, res[L][b0:b1], b0)

        workers = _hash_workers()
        if workers > 1 and a.size * len(layers) >= PARALLEL_MIN_POSITIONS and B * len(layers) > 1:
            per = max(1, -(-B // (2 * workers)))
            _run_shared([(b0, min(B, b0 + per)) for b0 in range(0, B, per)], fill, workers)
            per = max(1, -(-B * len(layers) // (2 * workers)) // len(layers))  # ~2 jobs per worker
            _run_shared([(L, b0, min(B, b0 + per)) for L in layers for b0 in range(0, B, per)], run, workers)
        else:
            fill((0, B))
            for L in layers:
                run((L, 0, B))
        return res

    def hash_numpy(self, ids, layers=None) -> dict:
        """The oracle: the reference's numpy expression, step by step."""
        a = self._check_negative(as_ids(ids, 2))
        if a.size and a.max() >= self.cfg.vocab_size:
            raise id_out_of_range(a.max(), self.cfg.vocab_size, self.variant.negative_ids)
        x = a.copy()
        if self.lookup is not None:
            pos = x >= 0
            x[pos] = self.lookup[x[pos]]
        shifted = self.variant.windows(self.cfg, self.pad_id, a, x)
        return {L: self.variant.rows_numpy(self.cfg, self, self.check_layer(L), a, x, shifted)
                for L in (self.cfg.layer_ids if layers is None else layers)}

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
