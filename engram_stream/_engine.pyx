# cython: language_level=3
"""StreamEngine: one Engram layer decoded token by token, O(1) per token.

Per stream it keeps a ring of the last max_ngram-1 compressed ids (the hash
window) and the last (K-1)*max_ngram normalized values (the dilated conv state),
both in C buffers owned here. A step hashes, gathers H table rows, runs the G+1
projections as one skinny GEMM over pre-packed weights, then the gate, value and
conv tail: all without the GIL, with no allocation when `out=` is given. Every
check happens before any state changes, so a rejected call leaves the engine as
it was. The oracle it is tested against token by token: EngramModel.forward.
"""
import hashlib
import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, int8_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset
from libc.math cimport sqrt

from engram_stream._hash cimport es_compress, es_hash_window, es_isa_now, es_isa_set
from .model import check_hidden
from .plan import as_ids

cnp.import_array()

PREFILL_CHUNK = 128  # prompt tokens per GEMM in prefill(): scratch stays ~ 128 x (E + M) floats

cdef enum:
    MAX_NGRAM = 64


cdef inline const char *_data(cnp.ndarray a):
    return <const char *> cnp.PyArray_DATA(a)


cdef inline void *_alloc(size_t nbytes) except NULL:
    cdef void *p = malloc(nbytes if nbytes else 1)
    if p == NULL:
        raise MemoryError(f"StreamEngine: could not allocate {nbytes} bytes")
    return p


def _isa_set(int level):
    """Run this module's kernels at `level` (see engram_stream._isa); False if the CPU cannot."""
    return es_isa_set(level) == 0


def _isa_get():
    return es_isa_now()


class EngineSnapshot:
    """A copy of an engine's per-stream state (hash windows, conv rings, positions).

    Restorable into the engine it came from or any engine of the same layer, config
    and stream count (speculative decoding: snapshot, try tokens, restore)."""

    def __init__(self, fingerprint, hist, ring, pos, seen):
        self.fingerprint = fingerprint
        self.hist, self.ring, self.pos, self.seen = hist, ring, pos, seen
        for a in (hist, ring, pos, seen):
            a.flags.writeable = False

    @property
    def nbytes(self):
        return self.hist.nbytes + self.ring.nbytes + self.pos.nbytes + self.seen.nbytes

    def __repr__(self):
        return f"EngineSnapshot(layer={self.fingerprint[0]}, n_streams={self.fingerprint[2]}, {self.nbytes} bytes)"


cdef class StreamEngine:
    """The streaming engine of one layer: `model.stream(layer, n_streams)`.

    step(token_id, hidden[G, D])                       -> float32[G, D]    (n_streams == 1)
    step(token_ids[S], hidden[S, G, D], out=None)      -> float32[S, G, D]
    prefill(ids[T], hidden[T, G, D], stream=0)         -> float32[T, G, D]
    feed(token_ids) then compute(hidden): step in two halves (hash first, see Decoder)
    reset(stream=None), snapshot(), restore(snapshot)

    Inputs: ids are integers (< vocab_size; negative ids pass through uncompressed).
    hidden is float32 C-contiguous for the zero-copy path; float64/float16 or strided
    arrays are converted (one copy). `out` must be float32, C-contiguous, writeable.
    One engine has one owner: a call while another is running raises RuntimeError.
    """

    def __cinit__(self, model, layer, int n_streams=1):
        if n_streams < 1:
            raise ValueError(f"n_streams must be >= 1, got {n_streams}")
        w = model.layer(layer)  # KeyError for a layer that is not an Engram layer
        cfg, plan = model.cfg, model.plan
        self.model, self.layer, self.n_streams = model, layer, n_streams
        self.G, self.D, self.E = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim
        self.C = <int64_t> self.G * self.D
        self.M = (self.G + 1) * self.D
        self.ldx = self.E + 16
        self.H, self.hd = cfg.n_heads, cfg.head_dim
        self.n, self.nh, self.K = cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.kernel_size
        self.conv_len = cfg.conv_len
        self.vocab, self.pad = cfg.vocab_size, plan.pad_id
        if self.n > MAX_NGRAM:
            raise ValueError(f"max_ngram_size > {MAX_NGRAM} is not supported by the engine")

        wp, bp, cw = w.packed()
        table = w.table
        if not (isinstance(table, np.ndarray) and table.flags.c_contiguous
                and table.shape == (plan.table_rows[layer], self.hd)):
            raise ValueError(f"layer {layer}: table must be a C-contiguous [{plan.table_rows[layer]}, {self.hd}] array")
        scale = w.table_scale
        if table.dtype == np.float32:
            self.table_kind = 0
        elif table.dtype == np.float16:
            self.table_kind = 1
        elif table.dtype == np.int8 and scale is not None:
            self.table_kind = 2
            scale = np.ascontiguousarray(scale, dtype=np.float32)
            self.table_scale = <const float *> _data(scale)
        else:
            raise ValueError(f"layer {layer}: unsupported table dtype {table.dtype}")
        lookup = plan.lookup
        mult, primes, offsets = plan.multipliers[layer], plan.head_primes[layer], w.offsets
        fp = plan.head_fp[layer]
        self._keep = (wp, bp, cw, table, scale, lookup, mult, primes, offsets,
                      w.norm1, w.norm2, w.conv_norm, fp)
        self.fp = NULL if fp is None else <const double *> _data(fp)
        self.lookup = NULL if lookup is None else <const int64_t *> _data(lookup)
        self.mult = <const int64_t *> _data(mult)
        self.primes = <const int64_t *> _data(primes)
        self.offsets = <const int64_t *> _data(offsets)
        self.table = _data(table)
        self.rowbytes = self.hd * table.dtype.itemsize
        self.wp = <const float *> _data(wp)
        self.bp = <const float *> _data(bp)
        self.tp.G, self.tp.D, self.tp.K = self.G, self.D, self.K
        self.tp.dil, self.tp.conv_len = self.n, self.conv_len
        self.tp.inv_sqrt_d = <float> (1.0 / sqrt(<double> self.D))
        self.tp.n1 = <const float *> _data(w.norm1)
        self.tp.n2 = <const float *> _data(w.norm2)
        self.tp.n3 = <const float *> _data(w.conv_norm)
        self.tp.cw = <const float *> _data(cw)
        self.prefill_threads = max(1, min(8, os.cpu_count() or 1))
        self._fingerprint = (layer, cfg.to_json(), n_streams, mult.tobytes(),
                             None if lookup is None else hashlib.sha1(lookup.tobytes()).hexdigest())

        cdef int64_t S = n_streams
        self.hist = <int64_t *> _alloc(S * (self.n - 1) * sizeof(int64_t))
        self.ring = <float *> _alloc(S * self.conv_len * self.C * sizeof(float))
        self.pos = <int64_t *> _alloc(S * sizeof(int64_t))
        self.seen = <int64_t *> _alloc(S * sizeof(int64_t))
        self._grow(S)
        self._reset_all()

    def __dealloc__(self):
        free(self.hist); free(self.ring); free(self.pos); free(self.seen)
        free(self.rbuf); free(self.ebuf); free(self.ybuf); free(self.pbuf)

    cdef int _grow(self, int64_t cap) except -1:
        """Scratch for `cap` rows; done before any state changes (a MemoryError is clean)."""
        if cap <= self.cap:
            return 0
        cdef void *r = realloc(self.rbuf, cap * self.H * sizeof(int64_t))
        if r == NULL:
            raise MemoryError("StreamEngine: scratch allocation failed")
        self.rbuf = <int64_t *> r
        r = realloc(self.ebuf, cap * self.ldx * sizeof(float))
        if r == NULL:
            raise MemoryError("StreamEngine: scratch allocation failed")
        self.ebuf = <float *> r
        r = realloc(self.ybuf, cap * self.M * sizeof(float))
        if r == NULL:
            raise MemoryError("StreamEngine: scratch allocation failed")
        self.ybuf = <float *> r
        r = realloc(self.pbuf, cap * self.E * sizeof(float))
        if r == NULL:
            raise MemoryError("StreamEngine: scratch allocation failed")
        self.pbuf = <float *> r
        self.cap = cap
        return 0

    def __repr__(self):
        return (f"StreamEngine(layer={self.layer}, n_streams={self.n_streams}, G={self.G}, D={self.D}, "
                f"H={self.H}x{self.hd}, conv_len={self.conv_len})")

    # ---- nogil pieces --------------------------------------------------------------------
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil:
        cdef int64_t i
        for i in range(n):
            if ids[i] >= self.vocab:
                return i
        return -1

    cdef void _hash_one(self, int64_t s, int64_t token, int64_t *rows) noexcept nogil:
        """rows[H] = absolute table rows of `token` on stream s; pushes it into the window."""
        cdef int64_t win[MAX_NGRAM]
        cdef int64_t *h = self.hist + s * (self.n - 1)
        cdef int k, j
        win[0] = es_compress(token, self.lookup)
        for k in range(1, self.n):
            win[k] = h[k - 1]
        es_hash_window(win, self.mult, self.n, self.nh, self.primes, self.fp, rows)
        for j in range(self.H):
            rows[j] += self.offsets[j]
        if self.touched != NULL:
            es_mark_rows(self.touched, rows, self.H)
        for k in range(self.n - 2, 0, -1):
            h[k] = h[k - 1]
        h[0] = win[0]

    cdef void _gather(self, const int64_t *rows, float *e) noexcept nogil:
        if self.table_kind == 0:
            es_gather_f32(<const float *> self.table, self.hd, rows, self.H, e)
        elif self.table_kind == 1:
            es_gather_f16(<const uint16_t *> self.table, self.hd, rows, self.H, e)
        else:
            es_gather_i8(<const int8_t *> self.table, self.table_scale, self.hd, rows, self.H, e)

    cdef void _tail(self, int64_t s, const float *proj, const float *hid, float *out) noexcept nogil:
        es_tail(&self.tp, proj, hid, self.ring + s * self.conv_len * self.C, self.pos[s], out)
        if self.conv_len:
            self.pos[s] = (self.pos[s] + 1) % self.conv_len
        self.seen[s] += 1

    # ---- argument checks (all before any state changes) -------------------------------------
    cdef _enter(self):
        if self.busy:
            raise RuntimeError("StreamEngine is already running a call: one engine has one owner "
                               "(use one engine per thread)")
        self.busy = True

    def _ids(self, token_ids):
        """(int64[S] ids, False) from an [S] array, or (the id as an int, True) from a scalar
        (n_streams == 1; range-checked here, so the step makes no array for it)."""
        if isinstance(token_ids, (int, np.integer)) and not isinstance(token_ids, (bool, np.bool_)):
            if self.n_streams != 1:
                raise ValueError(f"this engine has {self.n_streams} streams: pass token_ids[{self.n_streams}]")
            if not -(1 << 63) <= token_ids < self.vocab:
                raise ValueError(f"token id {token_ids} out of range: ids must be < vocab_size={self.vocab}")
            return int(token_ids), True
        ids = as_ids(token_ids, 1, "token_ids")
        if ids.shape[0] != self.n_streams:
            raise ValueError(f"expected {self.n_streams} token ids (one per stream), got {ids.shape[0]}")
        return ids, False

    cdef const int64_t *_id_ptr(self, ids, bint single):
        """The ids as a C pointer: into the [S] array, or to a scalar id kept in the engine."""
        if single:
            self.tok1 = ids
            return &self.tok1
        return <const int64_t *> _data(ids)

    def _hidden(self, hidden, shape):
        if (type(hidden) is np.ndarray and hidden.dtype == np.float32
                and hidden.flags.c_contiguous and hidden.shape == shape):
            return hidden
        return check_hidden(hidden, shape)

    def _out(self, out, shape):
        if out is None:
            return np.empty(shape, dtype=np.float32)
        if not (type(out) is np.ndarray and out.dtype == np.float32 and out.flags.c_contiguous
                and out.flags.writeable and out.shape == shape):
            raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {shape}, got "
                             f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}")
        return out

    def _bad_id(self, cnp.ndarray ids, int64_t i):
        return ValueError(f"token id {ids[i]} out of range: ids must be < vocab_size={self.vocab}")

    # ---- the public calls ---------------------------------------------------------------------
    def step(self, token_ids, hidden, out=None):
        """One token per stream: (token_id, hidden[G, D]) for one stream, or
        (token_ids[S], hidden[S, G, D]) for S streams. Returns the Engram output (no residual)."""
        ids, single = self._ids(token_ids)
        cdef object shape = (self.n_streams, self.G, self.D)
        if single:
            shape = (self.G, self.D)
        cdef const int64_t *pid = self._id_ptr(ids, single)
        h = self._hidden(hidden, shape)
        o = self._out(out, shape)
        cdef const float *ph = <const float *> _data(h)
        cdef float *po = <float *> _data(o)
        cdef int64_t bad
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was called: finish that token with compute(hidden) first")
            with nogil:
                bad = self._first_bad_id(pid, self.n_streams)
                if bad < 0:
                    self._feed_nogil(pid)
                    self._compute_nogil(ph, po)
        finally:
            self.busy = False
        if bad >= 0:
            raise self._bad_id(ids, bad)
        return o

    cdef void _feed_nogil(self, const int64_t *ids) noexcept nogil:
        cdef int64_t b
        for b in range(self.n_streams):
            self._hash_one(b, ids[b], self.rbuf + b * self.H)
        es_prefetch_rows(self.table, self.rowbytes, self.rbuf, self.n_streams * self.H)

    cdef void _compute_nogil(self, const float *hid, float *out) noexcept nogil:
        cdef int64_t b, S = self.n_streams
        for b in range(S):
            self._gather(self.rbuf + b * self.H, self.ebuf + b * self.ldx)
        es_gemm_packed(self.ebuf, self.ldx, S, self.E, self.wp, self.bp, self.M, self.ybuf, self.pbuf)
        for b in range(S):
            self._tail(b, self.ybuf + b * self.M, hid + b * self.C, out + b * self.C)

    def feed(self, token_ids):
        """First half of a step: compress and hash the new token(s), advance the hash windows.
        The rows (`.rows`) are then known before the layer runs; compute() finishes the step."""
        ids, single = self._ids(token_ids)
        cdef const int64_t *pid = self._id_ptr(ids, single)
        cdef int64_t bad
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was already called for this token: call compute(hidden) first")
            with nogil:
                bad = self._first_bad_id(pid, self.n_streams)
                if bad < 0:
                    self._feed_nogil(pid)
            self.pending = bad < 0
        finally:
            self.busy = False
        if bad >= 0:
            raise self._bad_id(ids, bad)

    def compute(self, hidden, out=None):
        """Second half of a step, after feed(): gather, project, gate, conv. Shapes as step()."""
        cdef object shape = (self.n_streams, self.G, self.D)
        if self.n_streams == 1 and np.ndim(hidden) == 2:
            shape = (self.G, self.D)
        h = self._hidden(hidden, shape)
        o = self._out(out, shape)
        cdef const float *ph = <const float *> _data(h)
        cdef float *po = <float *> _data(o)
        self._enter()
        try:
            if not self.pending:
                raise RuntimeError("compute() needs feed(token_ids) first")
            with nogil:
                self._compute_nogil(ph, po)
            self.pending = False
        finally:
            self.busy = False
        return o

    @property
    def rows(self):
        """int64[S, H]: absolute table rows of the last fed token of every stream."""
        cdef cnp.ndarray r = np.empty((self.n_streams, self.H), dtype=np.int64)
        memcpy(cnp.PyArray_DATA(r), self.rbuf, self.n_streams * self.H * sizeof(int64_t))
        return r

    def prefetch(self):
        """After feed(): madvise(WILLNEED) the pages of the fed rows, so a file-backed table
        starts reading them now (while earlier layers compute). Returns failed madvise calls."""
        cdef int64_t failed
        self._enter()
        try:
            if not self.pending:
                raise RuntimeError("prefetch() needs feed(token_ids) first")
            with nogil:
                failed = es_advise_rows(self.table, self.rowbytes, self.rbuf, self.n_streams * self.H,
                                        MADV_WILLNEED)
                if self.table_kind == 2:  # int8 rows: their scales live on other pages
                    failed += es_advise_rows(<const char *> self.table_scale, 4, self.rbuf,
                                             self.n_streams * self.H, MADV_WILLNEED)
        finally:
            self.busy = False
        return int(failed)

    def track_rows(self, bitmap):
        """Record every row this engine reads in `bitmap` (uint8[ceil(table_rows/8)], bit r =
        row r), or stop recording with None. The array is borrowed: keep it alive."""
        cdef int64_t need = (self.model.plan.table_rows[self.layer] + 7) // 8
        if bitmap is not None and not (type(bitmap) is np.ndarray and bitmap.dtype == np.uint8
                                       and bitmap.flags.c_contiguous and bitmap.flags.writeable
                                       and bitmap.shape == (need,)):
            raise ValueError(f"bitmap must be a writeable C-contiguous uint8 array of shape ({need},)")
        self._enter()
        try:
            if bitmap is None:
                self.touched, self._touched_ref = NULL, None
            else:
                self._touched_ref = bitmap
                self.touched = <uint8_t *> cnp.PyArray_DATA(bitmap)
        finally:
            self.busy = False

    @property
    def pending_compute(self):
        return bool(self.pending)

    def prefill(self, ids, hidden, stream=0, out=None):
        """A prompt on one stream: ids[T], hidden[T, G, D] -> float32[T, G, D], equal to T
        steps and leaving the same state; projections run as [<=128, E] x [E, M] GEMMs split
        over `engine.prefill_threads` threads (default: the machine's cores, at most 8)."""
        a = as_ids(ids, 1, "ids")
        cdef int64_t T = a.shape[0]
        h = self._hidden(hidden, (T, self.G, self.D))
        o = self._out(out, (T, self.G, self.D))
        self._check_stream(stream)
        cdef int64_t s = stream
        cdef int64_t chunk = min(T, PREFILL_CHUNK)
        cdef const int64_t *pid = <const int64_t *> _data(a)
        cdef const float *ph = <const float *> _data(h)
        cdef float *po = <float *> _data(o)
        cdef int64_t bad = -1, t0, i, nb
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was called: finish that token with compute(hidden) first")
            self._grow(chunk)  # under the guard: the scratch is shared with step()
            with nogil:
                bad = self._first_bad_id(pid, T)
                if bad < 0:
                    t0 = 0
                    while t0 < T:
                        nb = min(chunk, T - t0)
                        for i in range(nb):
                            self._hash_one(s, pid[t0 + i], self.rbuf + i * self.H)
                            self._gather(self.rbuf + i * self.H, self.ebuf + i * self.ldx)
                        es_gemm_packed_mt(self.ebuf, self.ldx, nb, self.E, self.wp, self.bp, self.M, self.ybuf, self.pbuf,
                                          self.prefill_threads if nb >= 32 else 1)
                        for i in range(nb):
                            self._tail(s, self.ybuf + i * self.M, ph + (t0 + i) * self.C,
                                       po + (t0 + i) * self.C)
                        t0 += nb
        finally:
            self.busy = False
        if bad >= 0:
            raise self._bad_id(a, bad)
        return o

    def _check_stream(self, stream):
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
            raise TypeError(f"stream must be an int, got {type(stream).__name__}")
        if not 0 <= stream < self.n_streams:
            raise IndexError(f"stream {stream} out of range for an engine with {self.n_streams} streams")

    cdef void _reset_stream(self, int64_t s) noexcept nogil:
        cdef int k
        for k in range(self.n - 1):
            self.hist[s * (self.n - 1) + k] = self.pad
        memset(self.ring + s * self.conv_len * self.C, 0, self.conv_len * self.C * sizeof(float))
        self.pos[s] = 0
        self.seen[s] = 0

    cdef void _reset_all(self) noexcept nogil:
        cdef int64_t s
        for s in range(self.n_streams):
            self._reset_stream(s)
        self.pending = False

    def reset(self, stream=None):
        """Forget the history of one stream (or of all): back to the state before any token."""
        if stream is not None:
            self._check_stream(stream)
        self._enter()
        try:
            if stream is None:
                self._reset_all()
            elif self.pending:
                raise RuntimeError("feed() was called for every stream: compute(hidden) first, "
                                   "or reset() all streams")
            else:
                self._reset_stream(stream)
        finally:
            self.busy = False

    @property
    def tokens_seen(self):
        """int64[S]: tokens processed per stream since its last reset."""
        cdef cnp.ndarray r = np.empty(self.n_streams, dtype=np.int64)
        memcpy(cnp.PyArray_DATA(r), self.seen, self.n_streams * sizeof(int64_t))
        return r

    @property
    def state_nbytes(self):
        """Bytes of per-stream state (windows, conv rings, positions)."""
        return self.n_streams * ((self.n - 1) * 8 + self.conv_len * self.C * 4 + 16)

    def snapshot(self):
        """A copy of every stream's state, for restore() (speculative decoding rollback)."""
        cdef int64_t S = self.n_streams
        hist = np.empty((S, self.n - 1), dtype=np.int64)
        ring = np.empty((S, self.conv_len, self.C), dtype=np.float32)
        pos = np.empty(S, dtype=np.int64)
        seen = np.empty(S, dtype=np.int64)
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("cannot snapshot between feed() and compute()")
            memcpy(cnp.PyArray_DATA(hist), self.hist, hist.nbytes)
            memcpy(cnp.PyArray_DATA(ring), self.ring, ring.nbytes)
            memcpy(cnp.PyArray_DATA(pos), self.pos, pos.nbytes)
            memcpy(cnp.PyArray_DATA(seen), self.seen, seen.nbytes)
        finally:
            self.busy = False
        return EngineSnapshot(self._fingerprint, hist, ring, pos, seen)

    def _check_snapshot(self, snapshot):
        """Raise unless `snapshot` can be restored here (changes nothing)."""
        if not isinstance(snapshot, EngineSnapshot):
            raise TypeError(f"restore() takes an EngineSnapshot, got {type(snapshot).__name__}")
        fp = snapshot.fingerprint
        if fp != self._fingerprint:
            why = ("layer" if fp[0] != self._fingerprint[0] else
                   "config" if fp[1] != self._fingerprint[1] else
                   "stream count" if fp[2] != self._fingerprint[2] else "hash plan")
            raise ValueError(f"snapshot is from another engine (different {why}): cannot restore")
        cdef int64_t S = self.n_streams
        shapes = {"hist": ((S, self.n - 1), np.int64), "ring": ((S, self.conv_len, self.C), np.float32),
                  "pos": ((S,), np.int64), "seen": ((S,), np.int64)}
        for name, (shape, dtype) in shapes.items():
            a = getattr(snapshot, name, None)
            if not (isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dtype and a.flags.c_contiguous):
                raise ValueError(f"snapshot.{name} is damaged: expected {np.dtype(dtype).name} {shape}")
        if self.conv_len and (snapshot.pos.min() < 0 or snapshot.pos.max() >= self.conv_len):
            raise ValueError("snapshot.pos is damaged: ring positions out of range")

    def restore(self, snapshot):
        """Put back a snapshot of this engine, or of one with the same layer, config and streams."""
        self._check_snapshot(snapshot)
        self._enter()
        try:
            memcpy(self.hist, cnp.PyArray_DATA(snapshot.hist), snapshot.hist.nbytes)
            memcpy(self.ring, cnp.PyArray_DATA(snapshot.ring), snapshot.ring.nbytes)
            memcpy(self.pos, cnp.PyArray_DATA(snapshot.pos), snapshot.pos.nbytes)
            memcpy(self.seen, cnp.PyArray_DATA(snapshot.seen), snapshot.seen.nbytes)
            self.pending = False
        finally:
            self.busy = False
