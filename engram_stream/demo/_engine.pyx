# cython: language_level=3
"""StreamEngine: one Engram layer decoded token by token, O(1) per token.

Per stream it keeps the last max_ngram-1 compressed ids (the hash window) and the
last (K-1)*max_ngram normalized values (the dilated conv state), as typed memoryviews
owned by the engine. A step hashes, gathers H table rows, runs the G+1 projections as
one skinny GEMM over pre-packed weights, then the gate, value and conv tail: all
without the GIL, with no allocation when `out=` is given. Every check happens before
any state changes, so a rejected call leaves the engine as it was. The oracle it is
tested against token by token: EngramModel.forward.

This file is the one home of the state's rules (DESIGN.md, "The streaming engine"):
which conv_state slot each tap reads, where x(t) goes, how pos advances, what reset and
restore do. The C headers only do stateless vector math on the pointers given here.
"""
import hashlib
import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, int8_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc, realloc
from libc.math cimport sqrt
from libc.string cimport memcpy
from posix.stat cimport fstat, struct_stat

from engram_stream._hash cimport es_hash_window, es_isa_now, es_isa_set
from engram_stream._consts cimport ES_MAX_KERNEL_SIZE, ES_MAX_NGRAM, ES_PREFILL_CHUNK
from engram_stream.rows._cache cimport RowCache, es_rc_peek, es_rc_row
from engram_stream.engine import args
from engram_stream.engine import isa as _isa
from engram_stream.io import files
from engram_stream.plan import as_ids

cnp.import_array()

PREFILL_CHUNK = ES_PREFILL_CHUNK  # prompt tokens per GEMM in prefill() (include/engram_consts.h)

_EMPTY_I64 = np.empty(0, np.int64)      # stands in for an absent lookup
_EMPTY_F64 = np.empty(0, np.float64)    # ... absent division-free mod constants
_EMPTY_F32 = np.empty(0, np.float32)    # ... absent int8 row scales


cdef inline const char *_data(cnp.ndarray a):
    return <const char *> cnp.PyArray_DATA(a)


def _view(a, dtype, shape, what):
    """`a` as a read-only C-contiguous array of exactly this dtype and shape (no copy), for
    the engine's typed memoryviews: anything else is a broken model, refused here."""
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == tuple(shape)
            and a.flags.c_contiguous):
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} array of shape "
                         f"{tuple(shape)}, got {getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    return a


cdef inline void *_alloc(size_t nbytes) except NULL:
    cdef void *p = malloc(nbytes if nbytes else 1)
    if p == NULL:
        raise MemoryError(f"StreamEngine: could not allocate {nbytes} bytes")
    return p


cdef inline void *_regrow(void *p, size_t nbytes) except NULL:
    """realloc, or MemoryError (p is then still valid: the engine frees it)."""
    cdef void *r = realloc(p, nbytes if nbytes else 1)
    if r == NULL:
        raise MemoryError(f"StreamEngine: scratch allocation of {nbytes} bytes failed")
    return r


def _isa_set(int level):
    """Run this module's kernels at `level` (see engram_stream._isa); False if the CPU cannot."""
    return es_isa_set(level) == 0


def _isa_get():
    return es_isa_now()


def _fma_chains(int64_t rounds):
    """n rounds of the running path's register-only FMA chains (es_fma_chains, no GIL):
    returns the float multiply-adds done. bench/bench_step.py times it for the FMA peak."""
    cdef float sink = 0
    cdef int64_t done
    with nogil:
        done = es_fma_chains(rounds, &sink)
    return done


class EngineSnapshot:
    """A copy of an engine's per-stream state: hash windows (hist), conv state (ring),
    positions (pos), tokens seen (seen) and the last token's rows (rows; None: unknown).

    Restorable into the engine it came from or any engine of the same layer, config
    and stream count (speculative decoding: snapshot, try tokens, restore)."""

    def __init__(self, fingerprint, hist, ring, pos, seen, rows=None):
        self.fingerprint = fingerprint
        self.hist, self.ring, self.pos, self.seen, self.rows = hist, ring, pos, seen, rows
        for a in (hist, ring, pos, seen, rows):
            if isinstance(a, np.ndarray):
                a.flags.writeable = False

    @property
    def nbytes(self):
        return sum(a.nbytes for a in (self.hist, self.ring, self.pos, self.seen, self.rows) if a is not None)

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
    arrays are converted (one copy). `out` must be float32, C-contiguous, writeable and
    must not overlap `hidden`. One engine has one owner: a call while another is running
    raises RuntimeError.
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
        if self.n > ES_MAX_NGRAM or self.K > ES_MAX_KERNEL_SIZE:  # EngramConfig refuses these already
            raise ValueError(f"max_ngram_size <= {ES_MAX_NGRAM} and kernel_size <= {ES_MAX_KERNEL_SIZE} "
                             f"are what the engine supports")

        # The borrowed model arrays, taken once as typed memoryviews (shape and dtype checked).
        cdef int64_t rows = plan.table_rows[layer], P = (self.M + 15) // 16
        wp, bp, cw = w.packed()
        table = w.table
        if not isinstance(table, np.ndarray) or table.dtype not in (np.float32, np.float16, np.int8):
            raise ValueError(f"layer {layer}: unsupported table {type(table).__name__} "
                             f"{getattr(table, 'dtype', '')}")
        _view(table, table.dtype, (rows, self.hd), f"layer {layer} table")
        self.table_kind = 0 if table.dtype == np.float32 else 1 if table.dtype == np.float16 else 2
        scale = _EMPTY_F32
        if self.table_kind == 2:
            if w.table_scale is None:
                raise ValueError(f"layer {layer}: an int8 table needs its per-row table_scale")
            scale = _view(np.ascontiguousarray(w.table_scale, dtype=np.float32), np.float32, (rows,),
                          f"layer {layer} table_scale")
        self.rowbytes = self.hd * table.dtype.itemsize
        self._file, self.file_fd = files.mapping_of(table), -1
        if isinstance(self._file, files.MappedFile):
            self.file_fd = self._file.fd
            for i, v in enumerate(self._file.stamp):
                self.file_stamp[i] = v
        else:
            self._file = None
        self.table = table.view(np.uint8)                      # [rows, rowbytes]
        self.table_scale = scale
        self.has_lookup = plan.lookup is not None
        self.lookup = _view(plan.lookup, np.int64, (self.vocab,), "plan.lookup") if self.has_lookup else _EMPTY_I64
        self.mult = _view(plan.multipliers[layer], np.int64, (self.n,), f"plan.multipliers[{layer}]")
        self.primes = _view(plan.head_primes[layer], np.int64, (self.H,), f"plan.head_primes[{layer}]")
        fp = plan.head_fp[layer]
        self.fp = _EMPTY_F64 if fp is None else _view(fp, np.float64, (3 * self.H,), f"plan.head_fp[{layer}]")
        self.offsets = _view(w.offsets, np.int64, (self.H,), f"layer {layer} offsets")
        if wp.dtype.name not in ("float32", "bfloat16"):
            raise ValueError(f"layer {layer} packed weights: float32 or bfloat16, got {wp.dtype}")
        self.wbf16 = wp.dtype.name == "bfloat16"  # the GEMM widens bf16 panels in registers
        self.wp = _view(wp.view(np.uint8), np.uint8, (P, self.E, 16 * wp.dtype.itemsize),
                        f"layer {layer} packed weights")
        self.bp = _view(bp, np.float32, (P * 16,), f"layer {layer} packed bias")
        self.cw = _view(cw, np.float32, (self.K, self.C), f"layer {layer} conv taps")
        self.n1 = _view(w.norm1, np.float32, (self.G, self.D), f"layer {layer} norm1")
        self.n2 = _view(w.norm2, np.float32, (self.G, self.D), f"layer {layer} norm2")
        self.n3 = _view(w.conv_norm, np.float32, (self.G, self.D), f"layer {layer} conv_norm")
        self.tp.G, self.tp.D, self.tp.K = self.G, self.D, self.K
        self.tp.inv_sqrt_d = <float> (1.0 / sqrt(<double> self.D))
        self.tp.n1 = &self.n1[0, 0]
        self.tp.n2 = &self.n2[0, 0]
        self.tp.n3 = &self.n3[0, 0]
        self.tp.cw = &self.cw[0, 0]
        self._prefill_threads = max(1, min(8, os.cpu_count() or 1))
        self._fingerprint = (layer, cfg.to_json(), n_streams, np.asarray(self.mult).tobytes(),
                             hashlib.sha1(np.asarray(self.lookup).tobytes()).hexdigest()
                             if self.has_lookup else None)

        # Row tiers: EngramModel.load(path, row_cache_mb=, tables=) gave the model a RowTiers.
        tiers = getattr(model, "row_tiers", None)
        if tiers is not None:
            self.remote = tiers.new_source(layer)
            cache = tiers.new_cache(layer)
            if cache.nslots or self.remote is not None:  # remote mode plans through one, maybe empty
                self.rcache = cache
                self.rc = &self.rcache.c

        # Owned state (set to the before-any-token state by _reset_all).
        cdef int64_t S = n_streams
        self.hist = np.empty((S, self.n - 1), dtype=np.int64)
        self.conv_state = np.empty((S, self.conv_len, self.C), dtype=np.float32)
        self.pos = np.empty(S, dtype=np.int64)
        self.seen = np.empty(S, dtype=np.int64)
        self.last_rows = np.empty((S, self.H), dtype=np.int64)
        self._step_threads = 1
        self._grow(S)  # scratch, the tap lists included: nothing sized from the config goes on the C stack
        self._reset_all()

    def __dealloc__(self):
        free(self.rbuf); free(self.ebuf); free(self.ybuf); free(self.pbuf); free(self.taps)
        free(self.src); free(self.mpos); free(self.xbuf); free(self.gbuf); free(self.xdst)

    cdef int _grow(self, int64_t cap) except -1:
        """Scratch for `cap` rows; done before any state changes (a MemoryError is clean)."""
        if cap <= self.cap:
            return 0
        self.rbuf = <int64_t *> _regrow(self.rbuf, cap * self.H * sizeof(int64_t))
        self.ebuf = <float *> _regrow(self.ebuf, cap * self.ldx * sizeof(float))
        self.ybuf = <float *> _regrow(self.ybuf, cap * self.M * sizeof(float))
        self.pbuf = <float *> _regrow(self.pbuf, cap * self.E * sizeof(float))
        self.src = <const char **> _regrow(self.src, cap * self.H * sizeof(char *))
        self.mpos = <int64_t *> _regrow(self.mpos, cap * self.H * sizeof(int64_t))
        self.xbuf = <float *> _regrow(self.xbuf, cap * self.C * sizeof(float))
        self.gbuf = <float *> _regrow(self.gbuf, cap * self.G * sizeof(float))
        self.taps = <const float **> _regrow(self.taps, cap * (self.K - 1) * sizeof(float *))
        self.xdst = <float **> _regrow(self.xdst, cap * sizeof(float *))
        self.cap = cap
        return 0

    def __repr__(self):
        return (f"StreamEngine(layer={self.layer}, n_streams={self.n_streams}, G={self.G}, D={self.D}, "
                f"H={self.H}x{self.hd}, conv_len={self.conv_len}, isa={_isa.ISA_NAMES[es_isa_now()]!r})")

    # ---- the state's rules, nogil ---------------------------------------------------------
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil:
        cdef int64_t i
        for i in range(n):
            if ids[i] >= self.vocab:
                return i
        return -1

    cdef void _hash_one(self, int64_t s, int64_t token, int64_t *rows) noexcept nogil:
        """rows[H] = absolute table rows of `token` on stream s; pushes it into the window."""
        cdef int64_t win[ES_MAX_NGRAM]  # a fixed bound (the config's), not a size from the config
        cdef int k, j
        # compression: lookup[id] for id >= 0, negative ids pass through (DESIGN 1.1)
        win[0] = self.lookup[token] if (self.has_lookup and token >= 0) else token
        for k in range(1, self.n):
            win[k] = self.hist[s, k - 1]
        es_hash_window(win, &self.mult[0], self.n, self.nh, &self.primes[0],
                       &self.fp[0] if self.fp.shape[0] else NULL, rows)
        for j in range(self.H):
            rows[j] += self.offsets[j]
        if self.tracking:
            es_mark_rows(&self.touched[0], rows, self.H)
        # the id window: newest first, the oldest falls off
        for k in range(self.n - 2, 0, -1):
            self.hist[s, k] = self.hist[s, k - 1]
        self.hist[s, 0] = win[0]

    cdef void _gather(self, const int64_t *rows, int64_t k, float *e) noexcept nogil:
        """e = the H rows of one token (k: its place in the batch the last _fetch planned)."""
        cdef const uint8_t *t = &self.table[0, 0]
        cdef const char *p
        cdef int j
        if self.rc != NULL:  # through the row cache: its slots, or (remote) the fetched records
            for j in range(self.H):
                if self.remote is not None:
                    p = self.src[k * self.H + j]
                else:
                    p = es_rc_row(self.rc, rows[j], <const char *> t, self.rowbytes,
                                  <const char *> &self.table_scale[0] if self.table_kind == 2 else NULL, 4)
                    if p == NULL:  # no slot to give (cannot happen with slots: nothing is pinned here)
                        p = <const char *> t + rows[j] * self.rowbytes
                self._record(p, e + j * self.hd)
            return
        if self.table_kind == 0:
            es_gather_f32(<const float *> t, self.hd, rows, self.H, e)
        elif self.table_kind == 1:
            es_gather_f16(<const uint16_t *> t, self.hd, rows, self.H, e)
        else:
            es_gather_i8(<const int8_t *> t, &self.table_scale[0], self.hd, rows, self.H, e)

    cdef void _record(self, const char *p, float *e) noexcept nogil:
        """One row record (the row's bytes, then an int8 row's float32 scale) to floats, by
        the kernels that convert table rows: every tier gives the same bits."""
        cdef int64_t zero = 0
        cdef float sc
        if self.table_kind == 0:
            es_gather_f32(<const float *> p, self.hd, &zero, 1, e)
        elif self.table_kind == 1:
            es_gather_f16(<const uint16_t *> p, self.hd, &zero, 1, e)
        else:
            memcpy(&sc, p + self.rowbytes, sizeof(float))
            es_gather_i8(<const int8_t *> p, &sc, self.hd, &zero, 1, e)

    cdef int _fetch(self, const int64_t *rows, int64_t n) except -1:
        """Remote mode, n rows hashed: cache hits pinned for this step, the distinct misses read
        in one batched call, every row pointed at its record (src). Raises tiers.TierError
        when the store fails (nothing it returned is used)."""
        return self.rcache.plan_fetch(rows, n, self.src, self.mpos, self.remote.fetch)

    cdef int _feed_remote(self, const int64_t *ids) except -1:
        """feed() in remote mode: hash (nogil), then fetch with the GIL; when the fetch fails the
        windows and rows are put back, so the refused token changes nothing."""
        hist0, rows0 = np.array(self.hist), np.array(self.last_rows)
        with nogil:
            self._feed_nogil(ids)
        try:
            self._fetch(&self.last_rows[0, 0], self.n_streams * self.H)
        except BaseException:
            np.asarray(self.hist)[...] = hist0
            np.asarray(self.last_rows)[...] = rows0
            raise
        return 0

    cdef void _tails_step(self, const float *hid, float *out) noexcept nogil:
        """Gate, value and ShortConv of one token on every stream (projections in ybuf), and
        the conv rings' move.

        The ring: conv_state[s] holds the last conv_len = (K-1)*dil values x of stream s
        (dil = max_ngram_size); slot pos[s] holds the oldest, x(t - conv_len), and slot
        (pos - j) mod conv_len holds x(t - j). Tap i < K-1 reads x(t - (K-1-i)*dil); tap
        K-1 is x(t) itself. x(t) overwrites the oldest slot (tap 0 reads it first: es_tail_y
        reads every element before writing it), then pos advances by one."""
        cdef int64_t L = self.conv_len, S = self.n_streams, p, i, b
        cdef int k1 = self.K - 1
        for b in range(S):
            self.xdst[b] = NULL
            if L:
                p = self.pos[b]
                for i in range(k1):
                    self.taps[b * k1 + i] = &self.conv_state[b, (p + L - (k1 - i) * self.n) % L, 0]
                self.xdst[b] = &self.conv_state[b, p, 0]
        es_tails_mt(&self.tp, S, self.ybuf, self.M, hid, out, self.xbuf, self.gbuf, self.taps, self.xdst, 0,
                    self._step_threads if S >= 2 else 1)
        for b in range(S):
            if L:
                self.pos[b] = (self.pos[b] + 1) % L
            self.seen[b] += 1

    cdef void _tails_prefill(self, int64_t s, int64_t nb, const float *hid, float *out) noexcept nogil:
        """The tails of nb consecutive tokens of stream s (projections in ybuf), and the ring's
        move: the same rules as nb steps. Every token's x goes to xbuf first (x(t) does not
        depend on the ring), so tap i of token j reads x(t_j - d), d = (K-1-i)*dil, from xbuf
        row j - d when that token is in this block, else from ring slot (pos + j - d) mod
        conv_len (the value before the block). Then the last min(nb, conv_len) values of x
        go to their slots (pos + j) mod conv_len, as the steps would leave them."""
        cdef int64_t L = self.conv_len, p = 0, i, j, d
        cdef int k1 = self.K - 1
        if L:
            p = self.pos[s]
            for j in range(nb):
                for i in range(k1):
                    d = (k1 - i) * self.n
                    self.taps[j * k1 + i] = (self.xbuf + (j - d) * self.C if j >= d else
                                             &self.conv_state[s, (p + j - d + L) % L, 0])
        es_tails_mt(&self.tp, nb, self.ybuf, self.M, hid, out, self.xbuf, self.gbuf, self.taps, NULL, 1,
                    self._prefill_threads if nb >= 8 else 1)
        if L:
            for j in range(max(0, nb - L), nb):
                memcpy(&self.conv_state[s, (p + j) % L, 0], self.xbuf + j * self.C, self.C * sizeof(float))
            self.pos[s] = (p + nb) % L
        self.seen[s] += nb

    cdef void _reset_stream(self, int64_t s) noexcept nogil:
        """Stream s as before any token: pads in the window, zeros in the conv state (x before
        t = 0 is 0), pos at slot 0, no rows."""
        cdef int64_t k, j, c
        for k in range(self.n - 1):
            self.hist[s, k] = self.pad
        for j in range(self.conv_len):
            for c in range(self.C):
                self.conv_state[s, j, c] = 0
        for k in range(self.H):
            self.last_rows[s, k] = -1
        self.pos[s] = 0
        self.seen[s] = 0

    cdef void _reset_all(self) noexcept nogil:
        cdef int64_t s
        for s in range(self.n_streams):
            self._reset_stream(s)
        self.pending = False

    cdef void _feed_nogil(self, const int64_t *ids) noexcept nogil:
        cdef int64_t b
        for b in range(self.n_streams):
            self._hash_one(b, ids[b], &self.last_rows[b, 0])
        if self.rc == NULL:  # (through a cache the gather reads slots, not the table)
            es_prefetch_rows(<const char *> &self.table[0, 0], self.rowbytes, &self.last_rows[0, 0],
                             self.n_streams * self.H)

    cdef void _compute_nogil(self, const float *hid, float *out) noexcept nogil:
        cdef int64_t b, S = self.n_streams
        for b in range(S):
            self._gather(&self.last_rows[b, 0], b, self.ebuf + b * self.ldx)
        es_gemm_packed_mt(self.ebuf, self.ldx, S, self.E, &self.wp[0, 0, 0], self.wbf16, &self.bp[0], self.M,
                          self.ybuf, self.pbuf, self._step_threads)
        self._tails_step(hid, out)

    # ---- argument checks (all before any state changes) -------------------------------------
    cdef _enter(self):
        if self.busy:
            raise RuntimeError("StreamEngine is already running a call: one engine has one owner "
                               "(use one engine per thread)")
        self.busy = True

    cdef int _check_file(self) except -1:
        """Before a table read: a mapped file truncated (SIGBUS) or rewritten in place (mixed
        tables) since load raises FileChangedError (one fstat; see io.files.MappedFile)."""
        cdef struct_stat st
        if self.file_fd < 0:
            return 0
        if (fstat(self.file_fd, &st) != 0 or <int64_t> st.st_dev != self.file_stamp[0]
                or <int64_t> st.st_ino != self.file_stamp[1] or <int64_t> st.st_size != self.file_stamp[2]
                or <int64_t> st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != self.file_stamp[3]):
            self._file.check()  # raises, with the message
        return 0

    def _ids(self, token_ids):
        """(int64[S] ids, False) or (the scalar id, True), range-checked (engine_args.token_ids);
        the Decoder checks a token for every layer through it before feeding any."""
        return args.token_ids(token_ids, self.n_streams, self.vocab)

    cdef _refuse_overlap(self, cnp.ndarray o, cnp.ndarray h):
        """The caller's `out` must share no byte with the hidden state the call reads (a stream's
        output is written while later streams' hidden is still to be read)."""
        cdef const char *o0 = _data(o)
        cdef const char *h0 = _data(h)
        if o0 < h0 + cnp.PyArray_NBYTES(h) and h0 < o0 + cnp.PyArray_NBYTES(o):
            raise ValueError("out must not overlap hidden: pass another array (or out=None)")

    # ---- the public calls ---------------------------------------------------------------------
    def step(self, token_ids, hidden, out=None):
        """One token per stream: (token_id, hidden[G, D]) for one stream, or
        (token_ids[S], hidden[S, G, D]) for S streams. Returns the Engram output (no residual)."""
        ids, single = args.token_ids(token_ids, self.n_streams, self.vocab)
        cdef object shape = (self.n_streams, self.G, self.D)
        if single:
            shape = (self.G, self.D)
        h = args.hidden(hidden, shape)
        o = args.out(out, shape)
        if out is not None:
            self._refuse_overlap(o, h)
        cdef int64_t tok = ids if single else 0  # a scalar id lives in this call, not in the engine
        cdef const int64_t *pid = &tok
        if not single:
            pid = <const int64_t *> _data(ids)
        cdef const float *ph = <const float *> _data(h)
        cdef float *po = <float *> _data(o)
        cdef int64_t bad
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was called: finish that token with compute(hidden) first")
            self._check_file()
            with nogil:
                bad = self._first_bad_id(pid, self.n_streams)
                if bad < 0 and self.remote is None:
                    self._feed_nogil(pid)
                    self._compute_nogil(ph, po)
            if bad < 0 and self.remote is not None:
                self._feed_remote(pid)  # misses fetched with the GIL, before the nogil gather
                with nogil:
                    self._compute_nogil(ph, po)
        finally:
            self.busy = False
        if bad >= 0:
            raise args.bad_id(ids, bad, self.vocab)
        return o

    def feed(self, token_ids):
        """First half of a step: compress and hash the new token(s), advance the hash windows.
        The rows (`.rows`) are then known before the layer runs; compute() finishes the step."""
        ids, single = args.token_ids(token_ids, self.n_streams, self.vocab)
        cdef int64_t tok = ids if single else 0
        cdef const int64_t *pid = &tok
        if not single:
            pid = <const int64_t *> _data(ids)
        cdef int64_t bad
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was already called for this token: call compute(hidden) first")
            with nogil:
                bad = self._first_bad_id(pid, self.n_streams)
                if bad < 0 and self.remote is None:
                    self._feed_nogil(pid)
            if bad < 0 and self.remote is not None:
                self._feed_remote(pid)  # the rows are read now, while earlier layers compute
            self.pending = bad < 0
        finally:
            self.busy = False
        if bad >= 0:
            raise args.bad_id(ids, bad, self.vocab)

    def compute(self, hidden, out=None):
        """Second half of a step, after feed(): gather, project, gate, conv. Shapes as step()."""
        cdef object shape = (self.n_streams, self.G, self.D)
        if self.n_streams == 1 and np.ndim(hidden) == 2:
            shape = (self.G, self.D)
        h = args.hidden(hidden, shape)
        o = args.out(out, shape)
        if out is not None:
            self._refuse_overlap(o, h)
        cdef const float *ph = <const float *> _data(h)
        cdef float *po = <float *> _data(o)
        self._enter()
        try:
            if not self.pending:
                raise RuntimeError("compute() needs feed(token_ids) first")
            self._check_file()
            with nogil:
                self._compute_nogil(ph, po)
            self.pending = False
        finally:
            self.busy = False
        return o

    @property
    def step_threads(self):
        """Threads a multi-stream step (n_streams >= 2) splits its projection and tails over
        (by output panels and by streams: bitwise equal to 1 thread). Default 1; a set value
        is clamped to [1, ES_MAX_THREADS]."""
        return self._step_threads

    @step_threads.setter
    def step_threads(self, n):
        self._step_threads = args.threads(n, ES_MAX_THREADS)

    @property
    def prefill_threads(self):
        """Threads prefill splits its GEMMs, gathers and tails over (bitwise equal to 1
        thread). Default: the machine's cores, at most 8; a set value is clamped to
        [1, ES_MAX_THREADS]."""
        return self._prefill_threads

    @prefill_threads.setter
    def prefill_threads(self, n):
        self._prefill_threads = args.threads(n, ES_MAX_THREADS)

    @property
    def rows(self):
        """int64[S, H]: absolute table rows of the last token fed to each stream (by step, feed
        or the last token of a prefill); -1 for a stream with no token since its reset."""
        return np.array(self.last_rows, dtype=np.int64)

    def prefetch(self):
        """After feed(): madvise(WILLNEED) the pages of the fed rows, so a file-backed table
        starts reading them now (while earlier layers compute). Returns failed madvise calls."""
        cdef int64_t failed = 0, i
        cdef const int64_t *rows = &self.last_rows[0, 0]
        self._enter()
        try:
            if not self.pending:
                raise RuntimeError("prefetch() needs feed(token_ids) first")
            if self.remote is not None:
                return 0  # feed() has read the remote rows already
            if self.rc != NULL:  # only the pages of rows the cache lacks
                with nogil:
                    for i in range(self.n_streams * self.H):
                        if es_rc_peek(self.rc, rows[i]) < 0:
                            failed += es_advise_rows(<const char *> &self.table[0, 0], self.rowbytes, rows + i, 1,
                                                     MADV_WILLNEED)
                            if self.table_kind == 2:
                                failed += es_advise_rows(<const char *> &self.table_scale[0], 4, rows + i, 1,
                                                         MADV_WILLNEED)
                return int(failed)
            with nogil:
                failed = es_advise_rows(<const char *> &self.table[0, 0], self.rowbytes, &self.last_rows[0, 0],
                                        self.n_streams * self.H, MADV_WILLNEED)
                if self.table_kind == 2:  # int8 rows: their scales live on other pages
                    failed += es_advise_rows(<const char *> &self.table_scale[0], 4, &self.last_rows[0, 0],
                                             self.n_streams * self.H, MADV_WILLNEED)
        finally:
            self.busy = False
        return int(failed)

    def track_rows(self, bitmap):
        """Record every row this engine reads in `bitmap` (uint8[ceil(table_rows/8)], bit r =
        row r), or stop recording with None. The array is borrowed: keep it alive."""
        args.rows_bitmap(bitmap, self.model.plan.table_rows[self.layer])
        self._enter()
        try:
            self.tracking = bitmap is not None
            self.touched = bitmap
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
        h = args.hidden(hidden, (T, self.G, self.D))
        o = args.out(out, (T, self.G, self.D))
        if out is not None:
            self._refuse_overlap(o, h)
        args.stream_index(stream, self.n_streams)
        cdef int64_t s = stream
        cdef int64_t chunk = min(T, ES_PREFILL_CHUNK)
        cdef const int64_t *pid = <const int64_t *> _data(a)
        cdef const float *ph = <const float *> _data(h)
        cdef float *po = <float *> _data(o)
        cdef int64_t bad = -1, t0, i, j, nb = 0
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("feed() was called: finish that token with compute(hidden) first")
            self._grow(chunk)  # under the guard: the scratch is shared with step()
            self._check_file()
            with nogil:
                bad = self._first_bad_id(pid, T)
                if bad < 0 and self.remote is None:
                    t0 = 0
                    while t0 < T:
                        nb = min(chunk, T - t0)
                        for i in range(nb):
                            self._hash_one(s, pid[t0 + i], self.rbuf + i * self.H)
                        if self.rc == NULL:  # straight from the table: the tokens' gathers over threads
                            es_gather_mt(self.table_kind, &self.table[0, 0], &self.table_scale[0] if
                                         self.table_kind == 2 else NULL, self.hd, self.rbuf, self.H, nb,
                                         self.ebuf, self.ldx, self._prefill_threads if nb >= 32 else 1)
                        else:  # through the row cache (one owner: no threads)
                            for i in range(nb):
                                self._gather(self.rbuf + i * self.H, i, self.ebuf + i * self.ldx)
                        self._project_tail(s, nb, ph + t0 * self.C, po + t0 * self.C)
                        t0 += nb
            if bad < 0 and self.remote is not None:
                self._prefill_remote(s, pid, T, chunk, ph, po)
            if bad < 0 and T:  # the stream's rows are now those of the prompt's last token
                nb = (T - 1) % chunk + 1
                for j in range(self.H):
                    self.last_rows[s, j] = self.rbuf[(nb - 1) * self.H + j]
        finally:
            self.busy = False
        if bad >= 0:
            raise args.bad_id(a, bad, self.vocab)
        return o

    cdef void _project_tail(self, int64_t s, int64_t nb, const float *ph, float *po) noexcept nogil:
        """The rest of a prefill chunk whose nb rows are gathered: one GEMM, then nb tails."""
        es_gemm_packed_mt(self.ebuf, self.ldx, nb, self.E, &self.wp[0, 0, 0], self.wbf16, &self.bp[0],
                          self.M, self.ybuf, self.pbuf, self._prefill_threads if nb >= 32 else 1)
        self._tails_prefill(s, nb, ph, po)

    cdef int _prefill_remote(self, int64_t s, const int64_t *pid, int64_t T, int64_t chunk,
                             const float *ph, float *po) except -1:
        """prefill in remote mode: per chunk, hash (nogil), fetch the misses (GIL), then gather,
        GEMM and tails (nogil). A failed fetch puts stream s back as it was before the call."""
        cdef int64_t t0 = 0, i, nb
        saved = (np.array(self.hist[s]), np.array(self.conv_state[s]), self.pos[s], self.seen[s])
        try:
            while t0 < T:
                nb = min(chunk, T - t0)
                with nogil:
                    for i in range(nb):
                        self._hash_one(s, pid[t0 + i], self.rbuf + i * self.H)
                self._fetch(self.rbuf, nb * self.H)
                with nogil:
                    for i in range(nb):
                        self._gather(self.rbuf + i * self.H, i, self.ebuf + i * self.ldx)
                    self._project_tail(s, nb, ph + t0 * self.C, po + t0 * self.C)
                t0 += nb
        except BaseException:
            np.asarray(self.hist)[s] = saved[0]
            np.asarray(self.conv_state)[s] = saved[1]
            self.pos[s], self.seen[s] = saved[2], saved[3]
            raise
        return 0

    def reset(self, stream=None):
        """Forget the history of one stream (or of all): back to the state before any token."""
        if stream is not None:
            args.stream_index(stream, self.n_streams)
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
        return np.array(self.seen, dtype=np.int64)

    @property
    def state_nbytes(self):
        """Bytes of per-stream state (windows, conv state, positions, rows)."""
        return self.n_streams * ((self.n - 1) * 8 + self.conv_len * self.C * 4 + 16 + self.H * 8)

    def snapshot(self):
        """A copy of every stream's state, for restore() (speculative decoding rollback)."""
        self._enter()
        try:
            if self.pending:
                raise RuntimeError("cannot snapshot between feed() and compute()")
            parts = [np.array(self.hist, copy=True), np.array(self.conv_state, copy=True),
                     np.array(self.pos, copy=True), np.array(self.seen, copy=True),
                     np.array(self.last_rows, copy=True)]
        finally:
            self.busy = False
        return EngineSnapshot(self._fingerprint, *parts)

    def _read_snapshot(self, snapshot):
        """The snapshot's state, read once into the engine's own fresh arrays and checked
        (changes nothing): (hist, conv_state, pos, seen, rows). An object whose attributes
        change between reads cannot slip anything past the checks."""
        if not isinstance(snapshot, EngineSnapshot):
            raise TypeError(f"restore() takes an EngineSnapshot, got {type(snapshot).__name__}")
        fp = snapshot.fingerprint
        if fp != self._fingerprint:
            why = ("layer" if fp[0] != self._fingerprint[0] else
                   "config" if fp[1] != self._fingerprint[1] else
                   "stream count" if fp[2] != self._fingerprint[2] else "hash plan")
            raise ValueError(f"snapshot is from another engine (different {why}): cannot restore")
        cdef int64_t S = self.n_streams
        want = (("hist", (S, self.n - 1), np.int64), ("ring", (S, self.conv_len, self.C), np.float32),
                ("pos", (S,), np.int64), ("seen", (S,), np.int64), ("rows", (S, self.H), np.int64))
        parts = []
        for name, shape, dtype in want:
            a = getattr(snapshot, name, None)
            if a is None and name == "rows":
                a = np.full(shape, -1, np.int64)  # a snapshot without rows: none known
            if not (isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dtype and a.flags.c_contiguous):
                raise ValueError(f"snapshot.{name} is damaged: expected {np.dtype(dtype).name} {shape}")
            parts.append(np.array(a, copy=True))  # the one read; the checks below see this copy
        pos = parts[2]
        if self.conv_len and (pos.min() < 0 or pos.max() >= self.conv_len):
            raise ValueError("snapshot.pos is damaged: ring positions out of range")
        return parts

    def _check_snapshot(self, snapshot):
        """Raise unless `snapshot` can be restored here (changes nothing)."""
        self._read_snapshot(snapshot)

    def restore(self, snapshot):
        """Put back a snapshot of this engine, or of one with the same layer, config and streams."""
        hist, conv_state, pos, seen, rows = self._read_snapshot(snapshot)
        cdef int64_t[:, ::1] hist_v = hist, rows_v = rows
        cdef float[:, :, ::1] conv_v = conv_state
        cdef int64_t[::1] pos_v = pos, seen_v = seen
        self._enter()
        try:  # commit: memoryview copies of the checked arrays, shapes equal by the checks
            self.hist[:, :] = hist_v
            self.conv_state[:, :, :] = conv_v
            self.pos[:] = pos_v
            self.seen[:] = seen_v
            self.last_rows[:, :] = rows_v
            self.pending = False
        finally:
            self.busy = False


_isa.register(__import__("sys").modules[__name__])  # this module's kernels follow the one selector
