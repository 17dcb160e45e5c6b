# cython: language_level=3
"""V41StreamEngine: one deepseek-v4.1 Engram layer decoded token by token (DESIGN.md 4).

Per stream it keeps the last max_ngram-1 window entries (compressed ids, -1 = DEAD; slots
before the start are DEAD) and re-derives the dead-token latch from them at every step. A step
hashes, gathers the H float8 rows (e4m3 x e8m0, dequantized in registers), quantizes them per
32 values as the reference does, runs the float8 wkv projection with its 32x32 block scales
straight from the checkpoint's bytes, then the gate: all without the GIL and with no
allocation when `out=` is given. Checks happen before any state changes, so a refused call
leaves the engine as it was. The oracle it is tested against token by token:
EngramModel.forward (engram_stream.reference_v41).
"""
import hashlib
import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport INT32_MAX, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy

from engram_stream._hash cimport es_compress, es_hash_window, es_isa_now, es_isa_set, latch_window
from engram_stream.engine import args
from engram_stream.engine import isa as _isa
from engram_stream.io.files import mapping_of
from engram_stream.plan import as_ids
from engram_stream.rows.mapped import advise

cnp.import_array()

from engram_stream._consts cimport ES_MAX_NGRAM as MAX_NGRAM

PREFILL_CHUNK = ES8_PREFILL_CHUNK  # prompt tokens per projection in prefill(): wkv is widened once per chunk

def _isa_set(int level):
    """Run this module's kernels (the float8 ones and the hash) at `level`, kept with the other
    modules' by engram_stream._isa; False if the CPU cannot."""
    return es_isa_set(level) == 0


def _isa_get():
    return es_isa_now()


class V41EngineSnapshot:
    """A copy of a V41StreamEngine's per-stream state (windows and token counts), restorable
    into any engine of the same layer, config, hash plan and stream count."""

    def __init__(self, fingerprint, hist, seen):
        self.fingerprint = fingerprint
        self.hist, self.seen = hist, seen
        for a in (hist, seen):
            a.flags.writeable = False

    @property
    def nbytes(self):
        return self.hist.nbytes + self.seen.nbytes

    def __repr__(self):
        return f"V41EngineSnapshot(layer={self.fingerprint[0]}, n_streams={self.fingerprint[2]}, {self.nbytes} bytes)"


cdef struct TokenWork:
    # what the per-token work of a step or prefill chunk reads and writes (es_parallel's ctx)
    const uint8_t *tw
    const uint8_t *ts
    const int64_t *rows    # [n, H]
    float *q               # [n, ldq]
    float *s               # [n, E/32]
    const float *y         # [n, M]
    const float *hid       # [n, G, D]
    float *out             # [n, G, D]
    const float *qw
    const float *kw
    const uint8_t *dead    # [n]
    int hd, H, E, G, D, M
    int64_t ldq
    float eps


cdef void _prep_part(void *ctx, int64_t i0, int64_t i1) noexcept nogil:
    """Tokens [i0, i1): rows gathered (dequantized), then quantized in place per 32 values as
    the reference's wkv input."""
    cdef TokenWork *w = <TokenWork *> ctx
    cdef int64_t i
    for i in range(i0, i1):
        es8_gather(w.tw, w.ts, w.hd, w.rows + i * w.H, w.H, w.q + i * w.ldq)
        es8_act_quant(w.q + i * w.ldq, w.E, w.q + i * w.ldq, w.s + i * (w.E // ES8_BLOCK))


cdef void _tail_part(void *ctx, int64_t i0, int64_t i1) noexcept nogil:
    """Tokens [i0, i1): the gate times the value, from their projections."""
    cdef TokenWork *w = <TokenWork *> ctx
    cdef int64_t i, C = <int64_t> w.G * w.D
    for i in range(i0, i1):
        es8_gate_tail(w.y + i * w.M, w.hid + i * C, w.qw, w.kw, w.G, w.D, w.eps, w.dead[i], w.out + i * C)


cdef _check_dims(int64_t M, int64_t E, m_name, e_name):
    """The float8 kernels' size limits: the many-token tile scatters 16 tokens at int32
    offsets t * M, and the one-token path keeps E scaled values on the stack."""
    if 16 * M > INT32_MAX:
        raise ValueError(f"{m_name} = {M} is too large for the V4.1 engine (at most {INT32_MAX // 16})")
    if E > ES8_MAX_E:
        raise ValueError(f"{e_name} = {E} is too large for the V4.1 engine (at most {ES8_MAX_E})")


def _ro_array(a, dtype, shape, what):
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous and a.shape == shape):
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} array of shape {shape}, got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    return a


cdef class V41StreamEngine:
    """The streaming engine of one deepseek-v4.1 layer: `model.stream(layer, n_streams)`.

    step(token_id, hidden[G, D])                       -> float32[G, D]    (n_streams == 1)
    step(token_ids[S], hidden[S, G, D], out=None)      -> float32[S, G, D]
    prefill(ids[T], hidden[T, G, D], stream=0)         -> float32[T, G, D]
    feed(token_ids) then compute(hidden): step in two halves (hash first, see Decoder)
    reset(stream=None), snapshot(), restore(snapshot); isa: the kernel path running now

    Returns the Engram delta gate * value (the caller adds h). Ids are integers < vocab_size:
    the image token id is DEAD (gate 0, blocks history), negative ids block history too.
    One engine has one owner: a call while another is running raises RuntimeError.
    """

    def __cinit__(self, model, layer, int n_streams=1):
        if n_streams < 1:
            raise ValueError(f"n_streams must be >= 1, got {n_streams}")
        w = model.layer(layer)  # KeyError for a layer that is not an Engram layer
        cfg, plan = model.cfg, model.plan
        if cfg.variant != "deepseek-v4.1":
            raise ValueError(f"V41StreamEngine needs a deepseek-v4.1 model, got variant {cfg.variant!r}")
        self.model, self.layer, self.n_streams = model, layer, n_streams
        self.G, self.D, self.E = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim
        self.C = <int64_t> self.G * self.D
        self.M = (self.G + 1) * self.D
        self.H, self.hd = cfg.n_heads, cfg.head_dim
        self.n, self.nh = cfg.max_ngram_size, cfg.n_head_per_ngram
        self.vocab, self.pad, self.dead_id = cfg.vocab_size, plan.pad_id, cfg.image_token_id
        self.eps = cfg.norm_eps
        if self.n > MAX_NGRAM:
            raise ValueError(f"max_ngram_size > {MAX_NGRAM} is not supported by the engine")
        if self.hd % ES8_BLOCK or self.E % ES8_BLOCK:
            raise ValueError(f"head_dim must be a multiple of {ES8_BLOCK}")
        _check_dims(self.M, self.E, "(hc_mult+1)*hidden_size", "engram_dim")
        N, B = plan.table_rows[layer], ES8_BLOCK
        u8 = np.uint8
        tw = _ro_array(w.embed_weight, u8, (N, self.hd), f"layer {layer} embed_weight")
        ts = _ro_array(w.embed_scale, u8, (N, self.hd // B), f"layer {layer} embed_scale")
        ww = _ro_array(w.wkv_weight, u8, (self.M, self.E), f"layer {layer} wkv_weight")
        ws = _ro_array(w.wkv_scale, u8, ((self.M + B - 1) // B, self.E // B), f"layer {layer} wkv_scale")
        qw = _ro_array(w.q_weight, np.float32, (self.G, self.D), f"layer {layer} q_weight")
        kw = _ro_array(w.k_weight, np.float32, (self.G, self.D), f"layer {layer} k_weight")
        offsets = _ro_array(w.offsets, np.int64, (self.H,), f"layer {layer} offsets")
        lookup, mult, primes, fp = plan.lookup, plan.multipliers[layer], plan.head_primes[layer], plan.head_fp[layer]
        self._keep = (tw, ts, ww, ws, qw, kw, offsets, lookup, mult, primes, fp)
        self.tw, self.ts = <const uint8_t *> cnp.PyArray_DATA(tw), <const uint8_t *> cnp.PyArray_DATA(ts)
        self.ww, self.ws = <const uint8_t *> cnp.PyArray_DATA(ww), <const uint8_t *> cnp.PyArray_DATA(ws)
        self.qw, self.kw = <const float *> cnp.PyArray_DATA(qw), <const float *> cnp.PyArray_DATA(kw)
        self.offsets = <const int64_t *> cnp.PyArray_DATA(offsets)
        self.lookup = NULL if lookup is None else <const int64_t *> cnp.PyArray_DATA(lookup)
        self.mult = <const int64_t *> cnp.PyArray_DATA(mult)
        self.primes = <const int64_t *> cnp.PyArray_DATA(primes)
        self.fp = NULL if fp is None else <const double *> cnp.PyArray_DATA(fp)
        for a in (tw, ts):  # rows are read at random: a cold gather must not read ahead
            if mapping_of(a) is not None and a.nbytes:
                advise(a, "random")
        _isa.warn_if_slower_than_cpu("the DeepSeek-V4.1 engine")
        self._prefill_threads = max(1, min(8, os.cpu_count() or 1))
        self._step_threads = 1
        self._fingerprint = (layer, cfg.to_json(), n_streams, mult.tobytes(),
                             None if lookup is None else hashlib.sha1(lookup.tobytes()).hexdigest())
        self.hist = np.full((n_streams, self.n - 1), -1, dtype=np.int64)
        self.seen = np.zeros(n_streams, dtype=np.int64)
        self._grow(n_streams)

    cdef int _grow(self, int64_t cap) except -1:
        """Scratch for `cap` tokens; made before any state changes (a MemoryError leaves the
        engine as it was)."""
        if cap > self.cap:
            rbuf = np.empty((cap, self.H), dtype=np.int64)
            gdead = np.empty(cap, dtype=np.uint8)
            qbuf = np.empty((cap, es8_ldq(self.E)), dtype=np.float32)
            sbuf = np.empty((cap, self.E // ES8_BLOCK), dtype=np.float32)
            ybuf = np.empty((cap, self.M), dtype=np.float32)
            self.rbuf, self.gdead, self.qbuf, self.sbuf, self.ybuf = rbuf, gdead, qbuf, sbuf, ybuf
            self.cap = cap
        return 0

    cdef int _grow_scratch(self, int64_t S, int threads) except -1:
        """Projection scratch for up to S tokens on `threads` threads (many-token calls only;
        before any state changes, as _grow)."""
        cdef int64_t n = es8_scratch_floats(S, self.E, threads)
        if n > self.wscr_n:
            self.wscr = np.empty(n, dtype=np.float32)
            self.wscr_n = n
        return 0

    def __repr__(self):
        return (f"V41StreamEngine(layer={self.layer}, n_streams={self.n_streams}, G={self.G}, D={self.D}, "
                f"H={self.H}x{self.hd}, isa={self.isa!r})")

    property step_threads:
        """Threads of a step: the projection's row groups (one stream too), the gathers and the
        gate tails split over them; the output is bitwise the same for any count. Default 1;
        set values are clamped to [1, 16] (ES8_MAX_THREADS)."""
        def __get__(self):
            return self._step_threads

        def __set__(self, n):
            self._step_threads = args.threads(n, ES8_MAX_THREADS)

    property prefill_threads:
        """Threads prefill splits its gathers, quantization, projection and gate tails over
        (bitwise equal to 1 thread). Default: the machine's cores, at most 8; set values are
        clamped to [1, 16] (ES8_MAX_THREADS)."""
        def __get__(self):
            return self._prefill_threads

        def __set__(self, n):
            self._prefill_threads = args.threads(n, ES8_MAX_THREADS)

    @property
    def isa(self):
        """The kernel path this engine runs now: "avx512", "avx2" or "baseline", the one
        engram_stream.kernel_isa() names (ENGRAM_STREAM_ISA, engram_stream._isa.use_isa)."""
        return _isa.ISA_NAMES[es_isa_now()]

    # ---- nogil pieces --------------------------------------------------------------------
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil:
        cdef int64_t i
        for i in range(n):
            if ids[i] >= self.vocab:
                return i
        return -1

    cdef void _hash_one(self, int64_t s, int64_t token, int64_t i) noexcept nogil:
        """Rows of `token` on stream s into rbuf[i] (absolute), its gate flag into gdead[i];
        pushes the token into the stream's window."""
        cdef int64_t win[MAX_NGRAM]
        cdef int64_t full[MAX_NGRAM]
        cdef int64_t *h = &self.hist[s, 0]
        cdef int64_t *rows = &self.rbuf[i, 0]
        cdef int k, j
        # DEAD (-1): the image token, and negative (unknown) ids; it blocks every older entry
        full[0] = -1 if (token < 0 or token == self.dead_id) else es_compress(token, self.lookup)
        for k in range(1, self.n):
            full[k] = h[k - 1]
        latch_window(full, self.n, self.pad, win)
        es_hash_window(win, self.mult, self.n, self.nh, self.primes, self.fp, rows)
        for j in range(self.H):
            rows[j] += self.offsets[j]
        if self.touched != NULL:
            es_mark_rows(self.touched, rows, self.H)
        for k in range(self.n - 2, 0, -1):
            h[k] = h[k - 1]
        h[0] = full[0]
        self.gdead[i] = token == self.dead_id

    cdef void _tokens(self, es_range_fn fn, const float *hid, float *out, int64_t n, int threads) noexcept nogil:
        """fn (_prep_part or _tail_part) over the scratch tokens [0, n), split over threads."""
        cdef TokenWork w
        w.tw, w.ts, w.rows = self.tw, self.ts, &self.rbuf[0, 0]
        w.q, w.s, w.y = &self.qbuf[0, 0], &self.sbuf[0, 0], &self.ybuf[0, 0]
        w.hid, w.out, w.qw, w.kw, w.dead = hid, out, self.qw, self.kw, &self.gdead[0]
        w.hd, w.H, w.E, w.G, w.D, w.M, w.eps = self.hd, self.H, self.E, self.G, self.D, self.M, self.eps
        w.ldq = self.qbuf.shape[1]
        es_parallel(threads, n, fn, &w)

    cdef void _feed_nogil(self, const int64_t *ids) noexcept nogil:
        cdef int64_t b
        for b in range(self.n_streams):
            self._hash_one(b, ids[b], b)
        es_prefetch_rows(<const char *> self.tw, self.hd, &self.rbuf[0, 0], self.n_streams * self.H)

    cdef void _compute_nogil(self, const float *hid, float *out, int64_t n, int threads) noexcept nogil:
        """The scratch tokens [0, n) (hashed): gather and quantize, project, gate. Many tokens
        need wscr for `threads` threads (_grow_scratch)."""
        cdef float *scratch = &self.wscr[0] if self.wscr_n else NULL
        self._tokens(_prep_part, NULL, NULL, n, threads)
        es8_wkv_mt(&self.qbuf[0, 0], self.qbuf.shape[1], n, self.E, self.ww, self.ws, self.M, &self.ybuf[0, 0],
                   threads, scratch)
        self._tokens(_tail_part, hid, out, n, threads)

    cdef int _step_scratch(self) except -1:
        """Threads of this engine's steps, their scratch made (before any state changes; one
        stream needs none)."""
        if self.n_streams > 1:
            self._grow_scratch(self.n_streams, self._step_threads)
        return self._step_threads

    cdef void _count_step(self) noexcept nogil:
        cdef int64_t b
        for b in range(self.n_streams):
            self.seen[b] += 1

    # ---- argument checks (all before any state changes) -------------------------------------
    cdef _enter(self):
        if self.busy:
            raise RuntimeError("V41StreamEngine is already running a call: one engine has one owner "
                               "(use one engine per thread)")
        self.busy = True

    def _ids(self, token_ids):
        """(int64[S] ids, False) or (a scalar id, True), checked (the Decoder checks every layer)."""
        return args.token_ids(token_ids, self.n_streams, self.vocab)

    cdef const int64_t *_id_ptr(self, ids, bint single):
        """The ids as a C pointer: into the [S] array, or to a scalar id kept in the engine."""
        if single:
            self.tok1 = ids
            return &self.tok1
        return <const int64_t *> cnp.PyArray_DATA(ids)

    # ---- the public calls ---------------------------------------------------------------------
    def step(self, token_ids, hidden, out=None):
        """One token per stream: (token_id, hidden[G, D]) for one stream, or
        (token_ids[S], hidden[S, G, D]) for S streams. Returns the Engram delta."""
        ids, single = self._ids(token_ids)
        cdef object shape = (self.n_streams, self.G, self.D)
        if single:
            shape = (self.G, self.D)
        cdef const int64_t *pid = self._id_ptr(ids, single)
        h = args.hidden(hidden, shape)
        o = args.out(out, shape)
        cdef const float *ph = <const float *> cnp.PyArray_DATA(h)
        cdef float *po = <float *> cnp.PyArray_DATA(o)
        cdef int64_t bad
        cdef int threads
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was called: finish that token with compute(hidden) first")
            threads = self._step_scratch()
            with nogil:
                bad = self._first_bad_id(pid, self.n_streams)
                if bad < 0:
                    self._feed_nogil(pid)
                    self._compute_nogil(ph, po, self.n_streams, threads)
                    self._count_step()
        finally:
            self.busy = False
        if bad >= 0:
            raise args.bad_id(ids, bad, self.vocab)
        return o

    def feed(self, token_ids):
        """First half of a step: hash the new token(s) and advance the windows; the rows
        (`.rows`) are known from here on. compute(hidden) finishes the step."""
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
            raise args.bad_id(ids, bad, self.vocab)

    def compute(self, hidden, out=None):
        """Second half of a step, after feed(): gather, quantize, project, gate. Shapes as step()."""
        cdef object shape = (self.n_streams, self.G, self.D)
        if self.n_streams == 1 and np.ndim(hidden) == 2:
            shape = (self.G, self.D)
        h = args.hidden(hidden, shape)
        o = args.out(out, shape)
        cdef const float *ph = <const float *> cnp.PyArray_DATA(h)
        cdef float *po = <float *> cnp.PyArray_DATA(o)
        cdef int threads
        self._enter()
        try:
            if not self.pending:
                raise RuntimeError("compute() needs feed(token_ids) first")
            threads = self._step_scratch()
            with nogil:
                self._compute_nogil(ph, po, self.n_streams, threads)
                self._count_step()
            self.pending = False
        finally:
            self.busy = False
        return o

    @property
    def rows(self):
        """int64[S, H]: absolute table rows of the last fed token of every stream."""
        return np.array(self.rbuf[:self.n_streams], dtype=np.int64)

    def prefetch(self):
        """After feed(): madvise(WILLNEED) the pages of the fed rows and of their scales, so a
        mapped checkpoint starts reading them now. Returns the failed madvise calls."""
        cdef int64_t failed
        cdef int64_t n = self.n_streams * self.H
        self._enter()
        try:
            if not self.pending:
                raise RuntimeError("prefetch() needs feed(token_ids) first")
            with nogil:
                failed = es_advise_rows(<const char *> self.tw, self.hd, &self.rbuf[0, 0], n, MADV_WILLNEED)
                failed += es_advise_rows(<const char *> self.ts, self.hd // ES8_BLOCK, &self.rbuf[0, 0], n,
                                         MADV_WILLNEED)
        finally:
            self.busy = False
        return int(failed)

    def track_rows(self, bitmap):
        """Record every row this engine reads in `bitmap` (uint8[ceil(table_rows/8)], bit r =
        row r), or stop recording with None. The array is borrowed: keep it alive."""
        args.rows_bitmap(bitmap, self.model.plan.table_rows[self.layer])
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
        """A prompt on one stream: ids[T], hidden[T, G, D] -> float32[T, G, D], equal to T steps
        and leaving the same state. Chunks of up to 256 tokens: hashed in order, then their
        gathers, the projection (wkv read once per chunk) and the gate tails split over
        `engine.prefill_threads` threads."""
        a = as_ids(ids, 1, "ids")
        cdef int64_t T = a.shape[0]
        h = args.hidden(hidden, (T, self.G, self.D))
        o = args.out(out, (T, self.G, self.D))
        cdef int64_t s = args.stream_index(stream, self.n_streams)
        cdef int64_t chunk = max(1, min(T, PREFILL_CHUNK))
        cdef int threads = self._prefill_threads
        cdef const int64_t *pid = <const int64_t *> cnp.PyArray_DATA(a)
        cdef const float *ph = <const float *> cnp.PyArray_DATA(h)
        cdef float *po = <float *> cnp.PyArray_DATA(o)
        cdef int64_t bad = -1, t0, i, nb
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was called: finish that token with compute(hidden) first")
            self._grow(chunk)  # under the guard: the scratch is shared with step()
            if T > 1:
                self._grow_scratch(chunk, threads)
            with nogil:
                bad = self._first_bad_id(pid, T)
                if bad < 0:
                    t0 = 0
                    while t0 < T:
                        nb = min(chunk, T - t0)
                        for i in range(nb):  # serial: the window and the dead latch carry over
                            self._hash_one(s, pid[t0 + i], i)
                        self._compute_nogil(ph + t0 * self.C, po + t0 * self.C, nb,
                                            threads if nb >= ES8_TILE_TOKENS else 1)
                        self.seen[s] += nb
                        t0 += nb
        finally:
            self.busy = False
        if bad >= 0:
            raise args.bad_id(a, bad, self.vocab)
        return o

    cdef void _reset_stream(self, int64_t s) noexcept nogil:
        cdef int k
        for k in range(self.n - 1):
            self.hist[s, k] = -1  # slots before the start are DEAD
        self.seen[s] = 0

    def reset(self, stream=None):
        """Forget the history of one stream (or of all): back to the state before any token."""
        cdef int64_t s
        if stream is not None:
            args.stream_index(stream, self.n_streams)
        self._enter()
        try:
            if stream is None:
                for s in range(self.n_streams):
                    self._reset_stream(s)
                self.pending = False
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
        return np.array(self.seen, dtype=np.int64)

    @property
    def state_nbytes(self):
        """Bytes of per-stream state (windows and token counts)."""
        return self.n_streams * ((self.n - 1) * 8 + 8)

    def snapshot(self):
        """A copy of every stream's state, for restore() (speculative decoding rollback)."""
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("cannot snapshot between feed() and compute()")
            hist, seen = np.array(self.hist, dtype=np.int64), np.array(self.seen, dtype=np.int64)
        finally:
            self.busy = False
        return V41EngineSnapshot(self._fingerprint, hist, seen)

    def _check_snapshot(self, snapshot):
        """Raise unless `snapshot` can be restored here (changes nothing)."""
        if not isinstance(snapshot, V41EngineSnapshot):
            raise TypeError(f"restore() takes a V41EngineSnapshot, got {type(snapshot).__name__}")
        fp = snapshot.fingerprint
        if fp != self._fingerprint:
            why = ("layer" if fp[0] != self._fingerprint[0] else
                   "config" if fp[1] != self._fingerprint[1] else
                   "stream count" if fp[2] != self._fingerprint[2] else "hash plan")
            raise ValueError(f"snapshot is from another engine (different {why}): cannot restore")
        shapes = {"hist": (self.n_streams, self.n - 1), "seen": (self.n_streams,)}
        for name, shape in shapes.items():
            a = getattr(snapshot, name, None)
            if not (isinstance(a, np.ndarray) and a.shape == shape and a.dtype == np.int64 and a.flags.c_contiguous):
                raise ValueError(f"snapshot.{name} is damaged: expected int64 {shape}")
        if snapshot.seen.size and snapshot.seen.min() < 0:
            raise ValueError("snapshot.seen is damaged: negative token counts")

    def restore(self, snapshot):
        """Put back a snapshot of this engine, or of one with the same layer, config and streams."""
        self._check_snapshot(snapshot)
        cdef const int64_t[:, ::1] hist = snapshot.hist
        cdef const int64_t[::1] seen = snapshot.seen
        self._enter()
        try:
            self.hist[:, :] = hist
            self.seen[:] = seen
            self.pending = False
        finally:
            self.busy = False


# ---- the kernels alone, for tests and benchmarks ------------------------------------------

def decode_e4m3(const uint8_t[::1] raw):
    """float32 values of float8_e4m3fn bytes (the kernels' scalar decoder)."""
    out = np.empty(raw.shape[0], dtype=np.float32)
    cdef float[::1] o = out
    cdef Py_ssize_t i
    for i in range(raw.shape[0]):
        o[i] = es8_e4m3(raw[i])
    return out


def decode_e8m0(const uint8_t[::1] raw):
    """float32 values of float8_e8m0fnu bytes: 2**(byte - 127)."""
    out = np.empty(raw.shape[0], dtype=np.float32)
    cdef float[::1] o = out
    cdef Py_ssize_t i
    for i in range(raw.shape[0]):
        o[i] = es8_e8m0(raw[i])
    return out


def gather_rows(const uint8_t[:, ::1] weight, const uint8_t[:, ::1] scale, const int64_t[::1] rows):
    """float32[len(rows), head_dim]: table rows dequantized as a step gathers them (es8_gather)."""
    cdef int hd = weight.shape[1], n = rows.shape[0], i
    if hd % ES8_BLOCK or scale.shape[0] != weight.shape[0] or scale.shape[1] != hd // ES8_BLOCK:
        raise ValueError("gather_rows: shapes do not match")
    for i in range(n):
        if not 0 <= rows[i] < weight.shape[0]:
            raise IndexError(f"gather_rows: row {rows[i]} is not in [0, {weight.shape[0]})")
    e = np.empty((n, hd), dtype=np.float32)
    cdef float[:, ::1] ev = e
    if n and hd:
        es8_gather(&weight[0, 0], &scale[0, 0], hd, &rows[0], n, &ev[0, 0])
    return e


def act_quant(const float[:, ::1] x):
    """(q float32[S, K], scales float32[S, K/32]): the kernels' activation quantization
    (q: the e4m3 values, as the oracle's act_quant returns them)."""
    cdef Py_ssize_t S = x.shape[0], K = x.shape[1], t
    if K % ES8_BLOCK:
        raise ValueError(f"act_quant: the last axis must be a multiple of {ES8_BLOCK}")
    qx = np.empty((S, K), dtype=np.float32)
    s = np.empty((S, K // ES8_BLOCK), dtype=np.float32)
    cdef float[:, ::1] qv = qx, sv = s
    for t in range(S):
        if K:
            es8_act_quant(&x[t, 0], K, &qv[t, 0], &sv[t, 0])
    return qx / np.repeat(s, ES8_BLOCK, axis=1), s


def fp8_linear(const float[:, ::1] x, const uint8_t[:, ::1] weight, const uint8_t[:, ::1] scale,
               int threads=1, bint plain=False):
    """x[S, K] through the float8 projection (weight e4m3 [M, K], scale e8m0 [ceil(M/32), K/32])
    as the engine runs it, on the running kernel path: float32[S, M]. plain: the plain scalar C
    loop instead (es8_wkv_plain: what the vector paths are measured against)."""
    cdef Py_ssize_t S = x.shape[0], K = x.shape[1], M = weight.shape[0], t
    if K % ES8_BLOCK or weight.shape[1] != K or scale.shape[0] != (M + ES8_BLOCK - 1) // ES8_BLOCK \
            or scale.shape[1] != K // ES8_BLOCK or S < 1 or M < 1:
        raise ValueError("fp8_linear: shapes do not match")
    _check_dims(M, K, "fp8_linear: weight rows", "fp8_linear: values per row of x")
    qx = np.empty((S, es8_ldq(<int> K)), dtype=np.float32)
    s = np.empty(K // ES8_BLOCK, dtype=np.float32)
    y = np.empty((S, M), dtype=np.float32)
    cdef float[:, ::1] qv = qx, yv = y
    cdef float[::1] sv = s
    threads = args.threads(threads, ES8_MAX_THREADS)
    cdef float[::1] scratch = np.empty(es8_scratch_floats(S, <int> K, threads), dtype=np.float32)
    with nogil:
        for t in range(S):
            es8_act_quant(&x[t, 0], <int> K, &qv[t, 0], &sv[0])
        if plain:
            es8_wkv_plain(&qv[0, 0], qv.shape[1], S, <int> K, &weight[0, 0], &scale[0, 0], <int> M, &yv[0, 0])
        else:
            es8_wkv_mt(&qv[0, 0], qv.shape[1], S, <int> K, &weight[0, 0], &scale[0, 0], <int> M, &yv[0, 0],
                       threads, &scratch[0])
    return y

def read_bytes(const uint8_t[::1] a):
    """Read every byte of `a` once (XOR of 64-byte lines): the memory-bandwidth floor of a step."""
    cdef uint64_t r = 0
    if a.shape[0]:
        with nogil:
            r = es8_read_bytes(&a[0], a.shape[0])
    return int(r)


_isa.register(__import__("sys").modules[__name__])  # this module's kernels follow the one selector
