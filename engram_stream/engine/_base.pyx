# cython: language_level=3
"""EngineBase: the orchestrator every variant's streaming engine shares.

An engine serves one Engram layer for S stream slots. Every call is a batch of segments
(engine/_batch.pyx): segment k is lengths[k] consecutive tokens of slot streams[k].

A call runs in two halves, which feed()/compute() expose separately:
  feed     check the ids, hash every token of every segment through its slot's window
           (engine/_window.pyx: the window advances, the rows are known), hand the rows to the
           row source (submit: a remote source reads them now, so the Decoder starts every
           layer's reads first; a long prompt's rows go in windows of SUBMIT_ROWS, the next at
           the chunk that needs it)
  compute  per chunk of tokens: the row source resolves the rows' pointers, then the variant's
           hook gathers, projects and runs the tails without the GIL

The parts, one responsibility each:
  HashWindow  (engine/_window.pyx)  per-stream windows, the history rule (the variant's window
              class: _window_class), seen, last rows, the undo state a rollback or commit reads
  Batch       (engine/_batch.pyx)   the call's segments, per-token buffers, masks, checks
  RowSource   (rows/_source.pyx)    where the rows come from
  FileStamps  (rows/_stamps.pyx)    the mapped files under the layer's arrays
This file runs a call through them: the one-owner guard, the argument checks (all before any
state changes; a scalar id lives in the call), the file check before every read, the call's
undo and rollback, snapshot/restore (read once, validate, commit). A variant adds its own
state (a conv ring) through the hooks at the end of _base.pxd.

Two shapes of engine, declared by the class (input_layer):
  a residual layer (input_layer = False): reads the hidden state, hidden[.., G, D] in and
      [.., G, D] out (the Engram delta the caller adds);
  an input layer (input_layer = True): a token in, [.., D] out (D = hidden_size), no
      hidden: every call takes hidden=None (or leaves it out) and the hooks get hid = NULL.
Each hidden and out is float32 or bfloat16 (hbf / obf: the hooks read and write them in place).
out_shape(n) is a call's output shape either way.
"""
import os

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t
from libc.stdlib cimport free, realloc

from engram_stream._hash cimport es_isa_call, es_isa_forced, es_isa_now, es_runtime_bind, es_runtime_of_process
from engram_stream.engine import args
from engram_stream.engine import isa as _isa
from engram_stream.engine._batch cimport Batch, decode_only, first_bad_id
from engram_stream.engine._window cimport HashWindow
from engram_stream.engine.snapshot import EngineSnapshot, fingerprint, why_foreign
from engram_stream.errors import negative_id
from engram_stream.plan import as_ids
from engram_stream.rows._source cimport MappedRows, RowSource
from engram_stream.rows._stamps cimport FileStamps

cnp.import_array()

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

cdef extern from "engram_step.h" nogil:
    int ES_MAX_THREADS
    int64_t ES_TEAM_SPIN_NS
    es_team *es_team_keep(int nthreads, int64_t spin_ns) noexcept
    void es_floats_to_bf16(const float *x, int64_t n, uint16_t *o) noexcept
    void es_team_put(es_team *t) noexcept
    int es_team_slots_held() noexcept

MAX_THREADS = ES_MAX_THREADS
OPS = ("step", "batch", "prefill")  # the operations a kernel choice is made for (index: OP_*)
cdef enum:
    OP_STEP = 0
    OP_BATCH = 1
    OP_PREFILL = 2
SUBMIT_ROWS = 1 << 16  # rows one submit() hands a source: a long prompt goes in windows of whole
                       # chunks, so a source's scratch (its staged records) stays ~20 MB, not the prompt's


cdef inline void *_regrow(void *p, size_t nbytes) except NULL:
    """realloc, or MemoryError (p is then still valid: the engine frees it)."""
    cdef void *r = realloc(p, nbytes if nbytes else 1)
    if r == NULL:
        raise MemoryError(f"engine scratch: could not allocate {nbytes} bytes")
    return r


cdef inline const void *_data(h):
    """A checked hidden's data (float32 or bfloat16), or NULL for an input layer's None."""
    return NULL if h is None else <const void *> cnp.PyArray_DATA(h)


cdef class EngineBase:
    """The streaming engine of one layer: `model.stream(layer, n_streams)` (see the subclasses).

    step(token_id, hidden[G, D])                       -> float32[G, D]    (n_streams == 1)
    step(token_ids[S], hidden[S, G, D], out=None)      -> float32[S, G, D]
    prefill(ids[T], hidden[T, G, D], stream=0)         -> float32[T, G, D]
    step_packed(ids[N], hidden[N, G, D], streams[K], lengths[K], out=None, draft=False, masked=None)
    commit(accepted[K])                                after a draft=True call
    feed(...) / feed_packed(...) then compute(hidden): a call in two halves (see Decoder)
    reset(stream=None), snapshot(), restore(snapshot)

    An input layer (input_layer = True) takes no hidden (None, or left out) and returns
    float32[D], [S, D], [T, D], [N, D] instead (out_shape).

    Returns the Engram delta (the caller adds h). Ids are integers < vocab_size. hidden is read
    in place when it is float32 or bfloat16 C-contiguous (an ml_dtypes array, or a torch bf16
    tensor: engine.args.as_array); other float dtypes and strided arrays are converted (one copy).
    `out` is float32 or bfloat16, C-contiguous, writeable, and must not overlap `hidden`; without
    it a call returns bfloat16 for a bfloat16 hidden, else float32 (an input layer: float32).
    bfloat16 is widened exactly as the tails load it and rounded to nearest even as they store
    it: a bf16 result is bit for bit the float32 call's on the widened hidden, rounded (DESIGN.md
    14). One engine has one owner: a call while another runs raises RuntimeError.
    """

    _window_class = HashWindow  # the history rule's window (a variant with another rule names its own)
    # The engine's shape: False, a residual layer (hidden[.., G, D] in, [.., G, D] out); True, an
    # input layer (a token in, [.., D] out, no hidden). A class attribute, read once by _setup.
    input_layer = False

    def __dealloc__(self):
        free(self.dp); free(self.sp)

    cdef int _setup(self, model, layer, int n_streams, int64_t chunk, rows) except -1:
        """Everything the variants share, then the variant's _init_variant(weights). Called by
        the subclass's __cinit__ (a base __cinit__ cannot reach the subclass's hooks)."""
        if n_streams < 1:
            raise ValueError(f"n_streams must be >= 1, got {n_streams}")
        w = model.layer(layer)  # KeyError for a layer that is not an Engram layer
        cfg, plan = model.cfg, model.plan
        self.model, self.layer, self.n_streams = model, layer, n_streams
        self.G, self.D, self.E = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim
        self.no_hidden = bool(type(self).input_layer)
        self.C = <int64_t> self.D if self.no_hidden else <int64_t> self.G * self.D
        self.M = (self.G + 1) * self.D
        self.H, self.hd, self.n = cfg.n_heads, cfg.head_dim, cfg.max_ngram_size
        self.vocab = cfg.vocab_size
        self.negative_ids = bool(plan.variant.negative_ids)
        self.chunk = chunk

        # A class attribute, not a cdef hook: an engine that subclasses another variant's engine runs
        # the parent's __cinit__ (and so this), where cdef methods still resolve to the parent's.
        win = type(self)._window_class()
        if not isinstance(win, HashWindow):
            raise TypeError(f"{type(self).__name__}._window_class must make a HashWindow, got {type(win).__name__}")
        if win.history != plan.history:
            raise ValueError(f"{type(self).__name__} keeps the {win.history!r} history rule but the model's plan "
                             f"has {plan.history!r}: serve this variant with the engine its registry entry names")
        self.win = win
        self.win.setup(model, layer, w.offsets, n_streams)

        if rows is None:
            rows = model.row_source(layer)
        if not isinstance(rows, RowSource):
            raise TypeError(f"rows must be a RowSource (engram_stream.rows), got {type(rows).__name__}")
        if (<RowSource> rows).bound and not isinstance(rows, MappedRows):
            raise ValueError("this RowSource already feeds an engine (it keeps one call's rows): give each "
                             "engine its own, model.row_source(layer)")
        self.src = rows
        self.src.bound = True
        # the weights' mapped files and those the source points into (a GGUF's), stamped at load
        self.files = FileStamps(list(w.file_arrays()) + list(rows.mapped_arrays()), f"layer {layer}")
        if self.src.nrows != plan.table_rows[layer]:
            raise ValueError(f"layer {layer}: the row source has {self.src.nrows} rows, the plan "
                             f"{plan.table_rows[layer]}")

        self.batch = Batch()
        self.batch.setup(n_streams, self.H, chunk, SUBMIT_ROWS)
        self.dp = <const char **> _regrow(NULL, chunk * self.H * sizeof(char *))
        self.sp = <const char **> _regrow(NULL, chunk * self.H * sizeof(char *))
        self._step_threads = self._prefill_threads = 0
        self._op_threads[OP_STEP] = self._op_threads[OP_BATCH] = 1
        self._op_threads[OP_PREFILL] = args.threads(os.cpu_count() or 1, 8)
        self._op_isa[OP_STEP] = self._op_isa[OP_BATCH] = self._op_isa[OP_PREFILL] = -1
        self._op_why = ("default",) * 3
        self._init_variant(w)
        for s in range(n_streams):
            self._reset_extra(s)
        self._fingerprint = fingerprint(cfg, layer, n_streams, np.asarray(self.win.mult),
                                        np.asarray(self.win.lookup) if self.win.has_lookup else None)
        return 0

    # ---- the hooks (a variant overrides them) ---------------------------------------------
    cdef int _init_variant(self, w) except -1:
        return 0

    cdef int _grow_chunk(self, int64_t nb, int threads) except -1:
        """Variant scratch for chunks of up to nb tokens on `threads` threads."""
        return 0

    cdef void _chunk(self, int64_t t0, int64_t nb, const void *hid, void *out, int threads) noexcept nogil:
        """Tokens [t0, t0+nb) of the pending batch: rows resolved in dp/sp (H per token), hidden
        and out at their first token, each float32 or bfloat16 (self.hbf, self.obf: the tails read
        and write them in place). Gather, project, tails; the variant's own state moves here."""
        pass

    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil:
        """The chunk's rows (resolved in dp/sp, H per token) as floats: token i's E values at
        dst + i*ld, exactly as the step gathers them (lookup_packed)."""
        pass

    cdef int _keep_undo_extra(self, bint draft, bint needed) except -1:
        """Before a call changes anything: when `needed` (a draft, or reads that can fail), keep
        what _rollback_extra / _commit_extra need; else forget the last call's."""
        return 0

    cdef void _rollback_extra(self) noexcept nogil:
        pass

    cdef void _commit_extra(self, int64_t k, int64_t a) noexcept nogil:
        """Segment k of the last (draft) call stands as if only its first a tokens were fed."""
        pass

    cdef void _reset_extra(self, int64_t s) noexcept nogil:
        pass

    def _extra_state(self):
        """{name: array copy} of the variant's per-stream state (snapshot)."""
        return {}

    def _extra_expected(self):
        """((name, shape, dtype), ...) of the variant's snapshot arrays."""
        return ()

    def _check_extra(self, parts):
        """Raise ValueError unless the variant's snapshot arrays (already shape/dtype-checked) hold."""
        pass

    def _put_extra(self, parts):
        pass

    # ---- the run of a call, nogil ------------------------------------------------------------
    cdef void _rollback(self) noexcept nogil:
        """Every slot of the last call back as before it (a failed read; commit of 0 tokens)."""
        if not self.win.has_undo:
            return
        self.win.rollback(self.batch.seg_stream, self.batch.nseg)
        self._rollback_extra()
        self.batch.pending = 0

    cdef void _reset_stream(self, int64_t s) noexcept nogil:
        """Stream s as before any token: its window and the variant's state."""
        self.win.reset_stream(s)
        self._reset_extra(s)

    cdef int _op(self) noexcept nogil:
        """The operation of the pending batch: OP_PREFILL when a segment has more than one token,
        else OP_STEP (one segment) or OP_BATCH (a decode step of several streams)."""
        if not self.batch.steps_only():
            return OP_PREFILL
        return OP_STEP if self.batch.nseg <= 1 else OP_BATCH

    cdef int _threads_of(self, int op) noexcept nogil:
        """The caller's step_threads / prefill_threads when set, else the operation's tuned count."""
        cdef int mine = self._prefill_threads if op == OP_PREFILL else self._step_threads
        return mine if mine > 0 else self._op_threads[op]

    cdef int _threads(self) noexcept nogil:
        return self._threads_of(self._op())

    # ---- the two halves of a call ---------------------------------------------------------
    cdef int _feed(self, const int64_t *ids, int64_t N, const int64_t *streams, const int64_t *lengths,
                   int64_t K, bint draft) except -1:
        """Hash a checked batch (segments valid, ids < vocab) and submit its rows. Under the
        guard, nothing pending. A failed submit puts every slot back and raises."""
        cdef Batch b = self.batch
        b.grow(N)  # before any state changes: a MemoryError changes nothing
        self.win.has_undo = self.win.draft = False
        with nogil:
            b.take(ids, N, streams, lengths, K)
            self.win.keep_undo(b.seg_stream, K, draft)
        self._keep_undo_extra(draft, draft or self.src.fallible)
        with nogil:
            self.win.hash_segments(ids, b.seg_stream, b.seg_start, b.seg_len, K, b.rows, b.entries)
        b.pending = N
        try:  # the first window now (the Decoder feeds every layer before any computes)
            b.sub_end = min(N, b.window)
            self.src.submit(b.rows, b.sub_end * self.H)
        except BaseException:
            self._rollback()
            raise
        return 0

    cdef int _resolve(self, int64_t t0, int64_t nb) except -1:
        """The rows of tokens [t0, t0+nb) (a chunk) resolved into dp/sp; the next window is
        submitted first when the chunk starts past the last one (windows are whole chunks)."""
        cdef int64_t n
        cdef Batch b = self.batch
        if t0 >= b.sub_end:
            self.src.release()
            n = min(b.window, b.pending - t0)
            self.src.submit(b.rows + t0 * self.H, n * self.H)
            b.sub_end = t0 + n
        self.src.resolve(b.rows + t0 * self.H, nb * self.H, self.dp, self.sp)
        return 0

    cdef int _run(self, h, o) except -1:
        """_compute of the pending batch from a checked hidden (or None) into a checked out, each
        float32 or bfloat16 (_io)."""
        self.hbf = h is not None and h.dtype == args.BF16
        self.obf = o.dtype == args.BF16
        return self._compute(_data(h), cnp.PyArray_DATA(o))

    cdef int _compute(self, const void *hid, void *out) except -1:
        """The pending batch, chunk by chunk: resolve the rows, then the variant's nogil hook.
        A failure (a read, scratch) puts every slot of the call back and raises. hid / out:
        float32, or bfloat16 where self.hbf / self.obf (set by _run)."""
        cdef int64_t t0 = 0, nb, N = self.batch.pending
        cdef int64_t hb = 2 if self.hbf else 4, ob = 2 if self.obf else 4
        self.hid_addr = <size_t> hid
        cdef int op = self._op()
        cdef int threads = self._threads_of(op)
        cdef bint own = self.team == NULL  # (a teamed variant's _chunk may open one: closed here)
        es_isa_call(self._op_isa[op])  # this thread's kernels on the operation's fastest path (unless forced)
        try:
            self._grow_chunk(min(self.chunk, N), threads)
            while t0 < N:
                nb = min(self.chunk, N - t0)
                self._resolve(t0, nb)
                with nogil:
                    self._chunk(t0, nb, <const char *> hid + t0 * self.C * hb if hid != NULL else NULL,
                                <char *> out + t0 * self.C * ob, threads)
                self.src.release()
                t0 += nb
        except BaseException:
            self.src.release()
            self._rollback()
            raise
        finally:
            es_isa_call(-1)
            if own:
                self._team_close()
        self.batch.pending = 0
        return 0

    cdef void _team_open(self, int threads) noexcept nogil:
        """The workers of this call (a variant whose splits run on them, threads > 1; nothing when
        they run already): the calling thread's kept team (es_team_keep: started by its first
        call that splits, woken for this one), parked by the call before it returns
        (_team_close), so no worker spins between calls. Taken only for a call that splits."""
        if self.teamed and threads > 1 and self.team == NULL:
            self.team = es_team_keep(threads, ES_TEAM_SPIN_NS)

    cdef void _team_close(self) noexcept nogil:
        if self.team != NULL:
            es_team_put(<es_team *> self.team)
            self.team = NULL

    # ---- checks -----------------------------------------------------------------------------
    cdef _enter(self):
        if self.busy:
            raise RuntimeError(f"{type(self).__name__} is already running a call: one engine has one owner "
                               "(use one engine per thread)")
        self.busy = True

    def _ids(self, token_ids):
        """(int64[S] ids, False) or (the scalar id, True), range-checked (engine.args.token_ids);
        the Decoder checks a token for every layer through it before feeding any."""
        return args.token_ids(token_ids, self.n_streams, self.vocab, self.negative_ids)

    def out_shape(self, n=None):
        """The output shape of a call of n tokens ([n, G, D], an input layer's [n, D]), or of one
        token of a one-stream step(token_id) when n is None ([G, D], [D])."""
        return self._shape(n)

    cdef tuple _shape(self, object n):
        if self.no_hidden:
            return (self.D,) if n is None else (int(n), self.D)
        return (self.G, self.D) if n is None else (int(n), self.G, self.D)

    def hidden_shape(self, n=None):
        """The hidden a call of n tokens takes (as out_shape), or None: an input layer takes none."""
        return None if self.no_hidden else self.out_shape(n)

    def _io(self, hidden, out, n):
        """(hidden, out) of a call of n tokens (None: one token of a one-stream step) checked:
        hidden float32 or bfloat16 C-contiguous (read in place; another dtype or a strided array
        converted), or None for an input layer (which refuses any other); out float32 or bfloat16,
        writeable and sharing no byte with hidden (a stream's output is written while later
        streams' hidden is still to be read); no out: a fresh one of hidden's dtype (bfloat16 for
        bfloat16, else float32; an input layer's float32)."""
        cdef tuple shape = self._shape(n)
        if self.no_hidden:
            if hidden is not None:
                raise ValueError(f"{type(self).__name__} serves an input layer (a token in, float32{list(shape)} "
                                 f"out): it takes no hidden; pass hidden=None or leave it out, got "
                                 f"{type(hidden).__name__} {getattr(hidden, 'shape', '')}")
            return None, args.out(out, shape)
        if hidden is None:
            raise ValueError(f"{type(self).__name__} serves a residual layer: it needs hidden of shape {shape} "
                             f"(the hidden state it reads), got None")
        h = args.hidden(hidden, shape)
        o = args.out(out, shape, h.dtype if h.dtype == args.BF16 else np.float32)
        cdef const char *o0 = <const char *> cnp.PyArray_DATA(o)
        cdef const char *h0 = <const char *> cnp.PyArray_DATA(h)
        if out is not None and o0 < h0 + cnp.PyArray_NBYTES(h) and h0 < o0 + cnp.PyArray_NBYTES(o):
            raise ValueError("out must not overlap hidden: pass another array (or out=None)")
        return h, o

    def _segments(self, streams, lengths, int64_t N):
        """streams[K], lengths[K] checked (Batch.segments)."""
        return self.batch.segments(streams, lengths, N)

    cdef int _check_call(self, object ids, const int64_t *pid, int64_t n, str pending) except -1:
        """Every feeding call's checks, inside the guard and before any change: no fed batch
        awaits compute (else RuntimeError(pending)), the ids in range, the mapped files unchanged."""
        cdef int64_t bad = -1, i
        if self.batch.pending:
            raise RuntimeError(pending)
        with nogil:
            if not self.negative_ids:
                for i in range(n):
                    if pid[i] < 0:
                        bad = i
                        break
        if bad >= 0:
            raise negative_id(pid[bad], self.vocab, self.model.cfg.variant)
        with nogil:
            bad = first_bad_id(pid, n, self.vocab)
        if bad >= 0:
            raise args.bad_id(ids, bad, self.vocab, self.negative_ids)
        self.files.check()
        return 0

    cdef int _feed_steps(self, object ids, bint single, str pending) except -1:
        """step's and feed()'s first half, inside the guard: one token per stream, checked, then
        the windows advanced."""
        cdef int64_t tok = ids if single else 0  # a scalar id lives in this call, not in the engine
        cdef const int64_t *pid = &tok if single else <const int64_t *> cnp.PyArray_DATA(ids)
        self._check_call(ids, pid, self.n_streams, pending)
        self._feed(pid, self.n_streams, self.batch.step_st, self.batch.step_len, self.n_streams, False)
        return 0

    # ---- the public calls ---------------------------------------------------------------------
    def step(self, token_ids, hidden=None, out=None):
        """One token per stream: (token_id, hidden[G, D]) for one stream, or
        (token_ids[S], hidden[S, G, D]) for S streams. Returns the Engram delta. An input
        layer: step(token_id) -> float32[D], step(token_ids[S]) -> float32[S, D].
        A token id is an int below vocab_size. Where the engine's variant takes negative ids
        (Variant.negative_ids, the default) a negative id is taken too (it has no compression
        entry: DESIGN.md 14), so step(-1, h) is a valid call; a variant whose negative_ids is False
        refuses one (ValueError), as its engine's class docstring says."""
        ids, single = args.token_ids(token_ids, self.n_streams, self.vocab, self.negative_ids)
        h, o = self._io(hidden, out, None if single else self.n_streams)
        self._enter()
        try:
            if self.n_streams > 1:  # the workers start while the tokens are hashed and their rows found
                self._team_open(self._threads_of(OP_BATCH))
            self._feed_steps(ids, single, "feed() was called: finish that token with compute(hidden) first")
            self._run(h, o)
        finally:
            self._team_close()
            self.busy = False
        return o if out is None else out  # the caller's own (a torch tensor stays one)

    def step_packed(self, token_ids, hidden, streams, lengths, out=None, draft=False, masked=None):
        """A serving batch: segment k is lengths[k] consecutive tokens of slot streams[k] (a prompt
        chunk when > 1, a decode step when 1), token_ids[N] and hidden[N, G, D] the segments one
        after another. Slots in one call are distinct; slots not named keep their state. One
        projection GEMM (per chunk of tokens) for all of them. Returns float32[N, G, D] (an
        input layer: hidden None, float32[N, D]).

        draft=True: commit(accepted) may then cut each segment back to its first accepted[k]
        tokens (speculative decoding); a new call without commit accepts everything.
        masked: bool[N], padding: positions that are no token on any variant. They take no part
        in any n-gram and leave their slot untouched (output 0): a slot fed [a, b, pad, pad, c, d]
        with the pads masked equals the slot fed [a, b, c, d], fresh or with history."""
        ids = as_ids(token_ids, 1, "token_ids")
        N = ids.shape[0]
        st, ln = self._segments(streams, lengths, N)
        h, o = self._io(hidden, out, N)
        ids, st, ln, keep = self._masked(ids, st, ln, masked)
        cdef int64_t n = ids.shape[0]
        cdef const int64_t *pid = <const int64_t *> cnp.PyArray_DATA(ids)
        self._enter()
        try:
            self._check_call(ids, pid, n, "feed() was called: finish that batch with compute(hidden) first")
            if n > 1 and self.teamed and decode_only(ln):  # the workers start while the tokens
                self._team_open(self._threads_of(OP_BATCH))  # are hashed and their rows found
            if ids.shape[0]:
                self._feed(pid, ids.shape[0], <const int64_t *> cnp.PyArray_DATA(st),
                           <const int64_t *> cnp.PyArray_DATA(ln), st.shape[0], bool(draft))
                self.batch.unmask = keep
                self._compute_unmasked(h, o)
            else:  # nothing to compute (every position masked, or no token): a call of no segment
                self._no_segment(bool(draft), keep)
                if keep is not None:
                    o[...] = 0
        finally:
            self._team_close()
            self.busy = False
        return o if out is None else out  # the caller's own (a torch tensor stays one)

    def _masked(self, ids, st, ln, masked):
        """The masked positions taken out before the hash (Batch.masked)."""
        return Batch.masked(ids, st, ln, masked)

    cdef _no_segment(self, bint draft, keep):
        """The undo state of a call with no token left (every position masked, or none given): no
        segment, nothing to put back; commit() of its zero counts is valid."""
        self.batch.nseg = 0
        self.batch.unmask = keep
        self.win.has_undo, self.win.draft = True, draft

    def _compute_unmasked(self, h, o):
        """compute() of the pending batch into o (h: the call's hidden), through the mask's
        compaction when the last feed took positions out."""
        keep = self.batch.unmask
        if keep is None:
            self._run(h, o)
            return
        k = keep[0]
        hk = None if h is None else np.ascontiguousarray(h[k])
        ok = np.empty(self.out_shape(self.batch.pending), o.dtype)  # the tokens fed: those kept
        self._run(hk, ok)
        o[k] = ok
        o[~k] = 0

    def _check_commit(self, accepted):
        """accepted as the counts of this engine's segments (int64[K]), checked against the last
        call; raises (changing nothing) unless commit(accepted) can run."""
        if not (self.win.draft and self.win.has_undo) or self.batch.pending:
            raise RuntimeError("commit() needs the last call to be step_packed(..., draft=True) "
                               "(and nothing since)")
        return self.batch.accepted(accepted)

    def commit(self, accepted):
        """After a draft=True call: segment k's slot stands exactly as if only its first
        accepted[k] tokens (0..lengths[k]) had been fed: hash window, tokens seen, rows and the
        variant's own state (a conv ring). The outputs of the tokens kept are the ones
        the draft call returned."""
        cdef int64_t k, i0
        cdef Batch b = self.batch
        self._enter()
        try:
            a = self._check_commit(accepted)
            for k in range(b.nseg):
                i0 = b.seg_start[k]
                self.win.commit_segment(k, b.seg_stream[k], b.entries + i0, b.rows + i0 * self.H, a[k])
                self._commit_extra(k, a[k])
            self.win.has_undo = self.win.draft = False
        finally:
            self.busy = False

    def lookup_packed(self, token_ids, streams, lengths, out=None, dtype=None, draft=False, masked=None):
        """The rows alone, for a caller that runs the projection elsewhere (a GPU): hash a serving
        batch through the slots' windows (the windows advance as in step_packed; draft/commit
        and masked as there) and return every token's rows dequantized, [N, E] (E = H * head_dim,
        heads order-major), as "float32" or "bfloat16" (rounded to nearest even, chunk by chunk
        as gathered): `dtype`, else out's, else float32. `out`, if given, must be writeable
        C-contiguous [N, E] of that dtype (a numpy array or a torch tensor). Rows come through
        the row source, as a step's do. The variant's own state (a conv ring) does not move."""
        if dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        ids = as_ids(token_ids, 1, "token_ids")
        N = ids.shape[0]
        st, ln = self._segments(streams, lengths, N)
        want = None if dtype is None else (args.BF16 if dtype == "bfloat16" else np.dtype(np.float32))
        o = args.out(out, (N, self.E), want if want is not None else np.float32)
        if want is not None and o.dtype != want:
            raise ValueError(f"lookup_packed: out is {o.dtype.name} but dtype={dtype!r}: pass out of that dtype "
                             f"(or leave dtype out: out's dtype is returned)")
        ids, st, ln, keep = self._masked(ids, st, ln, masked)
        cdef int64_t n = ids.shape[0], t0, nb
        cdef const int64_t *pid = <const int64_t *> cnp.PyArray_DATA(ids)
        cdef float *po
        cdef uint16_t *pb = NULL
        cdef bint obf = o.dtype == args.BF16
        res = o if keep is None else np.zeros((n, self.E), o.dtype)
        if obf:  # each chunk gathered as floats, then rounded into its rows
            scratch = np.empty((min(n, self.chunk), self.E), np.float32)
            po = <float *> cnp.PyArray_DATA(scratch)
            pb = <uint16_t *> cnp.PyArray_DATA(res)
        else:
            po = <float *> cnp.PyArray_DATA(res)
        self._enter()
        try:
            self._check_call(ids, pid, n, "feed() was called: finish that batch with compute(hidden) first")
            if n:
                self._feed(pid, n, <const int64_t *> cnp.PyArray_DATA(st), <const int64_t *> cnp.PyArray_DATA(ln),
                           st.shape[0], bool(draft))
                self._keep_undo_extra(False, False)  # the ring does not move: nothing of it to put back
                self.batch.unmask = keep
                t0 = 0
                try:
                    while t0 < n:
                        nb = min(self.chunk, n - t0)
                        self._resolve(t0, nb)
                        with nogil:
                            if obf:
                                self._gather_rows(nb, po, self.E, self._threads_of(OP_PREFILL))
                                es_floats_to_bf16(po, nb * self.E, pb + t0 * self.E)
                            else:
                                self._gather_rows(nb, po + t0 * self.E, self.E, self._threads_of(OP_PREFILL))
                        self.src.release()
                        t0 += nb
                except BaseException:
                    self.src.release()
                    self._rollback()
                    raise
                self.batch.pending = 0
            else:
                self._no_segment(bool(draft), keep)
        finally:
            self.busy = False
        if keep is not None:
            o[keep[0]] = res
            o[~keep[0]] = 0
        return o if out is None else out

    def feed(self, token_ids):
        """First half of a step: hash the new token(s) and advance the windows; the rows
        (`.rows`) are known from here on (a remote row source reads them now). compute(hidden)
        finishes the step."""
        ids, single = args.token_ids(token_ids, self.n_streams, self.vocab, self.negative_ids)
        self._enter()
        try:
            self._feed_steps(ids, single, "feed() was already called for this token: call compute(hidden) first")
            self.batch.unmask = None
            self.batch.given = 0
            self.fed_single = single
        finally:
            self.busy = False

    def feed_packed(self, token_ids, streams, lengths, draft=False, masked=None):
        """First half of step_packed (same arguments but hidden and out); compute(hidden[N, G, D])
        finishes it."""
        ids = as_ids(token_ids, 1, "token_ids")
        st, ln = self._segments(streams, lengths, ids.shape[0])
        ids, st, ln, keep = self._masked(ids, st, ln, masked)
        cdef const int64_t *pid = <const int64_t *> cnp.PyArray_DATA(ids)
        cdef int64_t n = ids.shape[0]
        self._enter()
        try:
            self._check_call(ids, pid, n, "feed() was already called: call compute(hidden) first")
            if not ids.shape[0]:
                raise ValueError("feed_packed needs at least one token that is not masked")
            self._feed(pid, ids.shape[0], <const int64_t *> cnp.PyArray_DATA(st),
                       <const int64_t *> cnp.PyArray_DATA(ln), st.shape[0], bool(draft))
            self.batch.unmask = keep
            self.batch.given = ids.shape[0] if keep is None else keep[0].shape[0]
            self.fed_single = False
        finally:
            self.busy = False

    def compute(self, hidden=None, out=None):
        """Second half of a call, after feed() / feed_packed(): hidden [G, D] or [S, G, D] after
        feed() (as step()), [N, G, D] after feed_packed(); an input layer's is None."""
        cdef int64_t N
        self._enter()
        try:
            if not self.batch.pending:
                raise RuntimeError("compute() needs feed(token_ids) first")
            h, o = self._io(hidden, out, self._pending_n(hidden))
            self.files.check()
            self._compute_unmasked(h, o)
            self.batch.given = 0
        except BaseException:
            raise
        finally:
            self.busy = False
        return o if out is None else out  # the caller's own (a torch tensor stays one)

    def _pending_n(self, hidden):
        """The tokens of compute()'s call for the fed batch (as _io takes them): N after
        feed_packed(), S after feed(), None (one token) on a one-stream engine fed a scalar id
        (an input layer) or given a 2-d hidden."""
        if self.batch.given == 0 and self.n_streams == 1 and (
                self.fed_single if self.no_hidden else np.ndim(hidden) == 2):
            return None
        return self.batch.given if self.batch.given else self.batch.pending

    def fetch(self):
        """Second half of a call that wants only its rows brought in, after feed() / feed_packed():
        the row source reads them (a row cache keeps them) and nothing is computed; the windows
        stay where feed() moved them. Raises as compute() would when the rows cannot be read
        (every slot of the call put back). model.warm() seeds the row cache this way."""
        cdef int64_t t0 = 0, nb
        self._enter()
        try:
            if not self.batch.pending:
                raise RuntimeError("fetch() needs feed(token_ids) first")
            self.files.check()
            try:
                while t0 < self.batch.pending:
                    nb = min(self.chunk, self.batch.pending - t0)
                    self._resolve(t0, nb)
                    self.src.release()
                    t0 += nb
            except BaseException:
                self.src.release()
                self._rollback()
                raise
            self._keep_undo_extra(False, False)  # nothing computed: the variant's state did not move
            self.batch.pending = 0
            self.batch.given = 0
        finally:
            self.busy = False

    def _abort(self):
        """Put every slot of the last call back as before it (the Decoder's all-or-nothing token:
        a later layer's read failed). A no-op when the last call left no undo state."""
        self._enter()
        try:
            self.src.release()
            self._rollback()
            self.batch.given = 0
        finally:
            self.busy = False

    def prefill(self, ids, hidden=None, stream=0, out=None):
        """A prompt on one stream: ids[T], hidden[T, G, D] -> float32[T, G, D] (an input layer:
        no hidden, float32[T, D]), equal to T steps and leaving the same state, in chunks of
        the variant's size (one GEMM per chunk, split over `prefill_threads`)."""
        a = as_ids(ids, 1, "ids")
        cdef int64_t T = a.shape[0]
        h, o = self._io(hidden, out, T)
        cdef int64_t s = args.stream_index(stream, self.n_streams)
        cdef const int64_t *pid = <const int64_t *> cnp.PyArray_DATA(a)
        self._enter()
        try:
            self._check_call(a, pid, T, "feed() was called: finish that token with compute(hidden) first")
            if T:
                self._feed(pid, T, &s, &T, 1, False)
                self.batch.unmask = None
                self._run(h, o)
        finally:
            self.busy = False
        return o if out is None else out  # the caller's own (a torch tensor stays one)

    def reset(self, stream=None):
        """Forget the history of one stream (or of all, which also drops a fed batch): back to
        the state before any token. A finished request's slot is reset and reused."""
        cdef int64_t s
        if stream is not None:
            args.stream_index(stream, self.n_streams)
        self._enter()
        try:
            if stream is None:
                self.src.release()
                self.batch.pending = 0
                self.batch.given = 0
                for s in range(self.n_streams):
                    self._reset_stream(s)
            elif self.batch.pending:
                raise RuntimeError("feed() was called: compute(hidden) first, or reset() all streams")
            else:
                self._reset_stream(stream)
            if stream is None or (self.win.has_undo and self.batch.names(stream)):
                self.win.has_undo = self.win.draft = False  # the last call's undo state names this slot: void
        finally:
            self.busy = False

    def __repr__(self):  # a variant's engine names its own geometry
        return f"{type(self).__name__}(layer={self.layer}, n_streams={self.n_streams}, isa={self.isa!r})"

    # ---- threads, rows, files ------------------------------------------------------------------
    @property
    def isa(self):
        """The kernel path of this engine's one-stream step: a name of engine.isa.ISA_NAMES
        (kernel_choice() has each operation's, and why)."""
        return self.kernel_choice()["step"][0]

    def kernel_choice(self):
        """{operation: (path, threads, why)} for "step" (one stream, one token), "batch" (a decode
        step of several streams) and "prefill" (a segment of several tokens). why: "forced"
        (ENGRAM_STREAM_ISA or engine.isa.use_isa hold every kernel on one path), "tuned" (measured
        fastest on this CPU, engine/tune.py), "default" (the best path this CPU runs), with
        "threads set" when the caller's step_threads / prefill_threads count runs."""
        cdef int op, level
        forced = es_isa_forced() != 0
        out = {}
        for op, name in enumerate(OPS):
            level = self._op_isa[op]
            why = "forced" if forced else self._op_why[op]
            if forced or level < 0:
                level = _isa.process_level()
            if (self._prefill_threads if op == OP_PREFILL else self._step_threads) > 0:
                why += ", threads set"
            out[name] = (_isa.ISA_NAMES[level], self._threads_of(op), why)
        return out

    def _use_choice(self, int op, int level, int threads, str why):
        """Run operation `op` (OP_STEP, OP_BATCH, OP_PREFILL) at kernel level `level` (-1: the
        process's) on `threads` threads when the caller set none (engine/tune.py applies its
        measured choice through this)."""
        if not 0 <= op < 3:
            raise ValueError(f"operation {op}: expected 0 (step), 1 (batch) or 2 (prefill)")
        if level >= 0 and not _isa.runs_level(level):
            raise ValueError(f"kernel level {level} does not run on this CPU: it runs {_isa.supported_isas()}")
        self._op_isa[op] = level
        self._op_threads[op] = args.threads(threads, ES_MAX_THREADS)
        self._op_why = tuple(why if k == op else w for k, w in enumerate(self._op_why))

    @property
    def step_threads(self):
        """Threads a batch of decode steps splits its projection, gathers and tails over (bitwise
        equal to one thread): the count set here, else the one measured fastest for the step
        (one stream) or the batched step (several) (engine/tune.py; untuned: 1). A set value is
        clamped to [1, ES_MAX_THREADS] and wins over the measured one."""
        return self._threads_of(OP_STEP if self.n_streams == 1 else OP_BATCH)

    @step_threads.setter
    def step_threads(self, n):
        self._step_threads = args.threads(n, ES_MAX_THREADS)

    @property
    def prefill_threads(self):
        """Threads a batch with prompt chunks (prefill, step_packed) splits its work over (bitwise
        equal to one thread): the count set here, else the one measured fastest (engine/tune.py;
        untuned: the machine's cores, at most 8). A set value is clamped to [1, ES_MAX_THREADS]
        and wins over the measured one."""
        return self._threads_of(OP_PREFILL)

    @prefill_threads.setter
    def prefill_threads(self, n):
        self._prefill_threads = args.threads(n, ES_MAX_THREADS)

    @property
    def rows(self):
        """int64[S, H]: absolute table rows of the last token fed to each stream (by any call;
        after a prompt, its last token's); -1 for a stream with no token since its reset."""
        return np.array(self.win.last_rows, dtype=np.int64)

    @property
    def pending_rows(self):
        """int64[N, H]: the rows of the batch fed and not yet computed (empty: none)."""
        cdef int64_t N = self.batch.pending
        return np.array(<int64_t[:N * self.H]> self.batch.rows, copy=True).reshape(N, self.H) \
            if N else np.empty((0, self.H), np.int64)

    @property
    def row_source(self):
        """The RowSource this engine reads its rows through (rows/_source.pyx)."""
        return self.src

    def prefetch(self):
        """After feed(): ask the row source to start loading the fed rows (a mapped table:
        madvise WILLNEED of their pages, while earlier layers compute). Returns failed advice calls."""
        self._enter()
        try:
            if not self.batch.pending:
                raise RuntimeError("prefetch() needs feed(token_ids) first")
            return int(self.src.prefetch(self.batch.rows, self.batch.pending * self.H))
        finally:
            self.busy = False

    def track_rows(self, bitmap):
        """Record every row this engine reads in `bitmap` (uint8[ceil(table_rows/8)], bit r =
        row r), or stop recording with None. The array is borrowed: keep it alive."""
        args.rows_bitmap(bitmap, self.model.plan.table_rows[self.layer])
        self._enter()
        try:
            self.win.track(bitmap)
        finally:
            self.busy = False


    @property
    def _hidden_address(self):
        """The hidden address the last computing call handed the kernels (its first chunk's; 0:
        no hidden): the tests' check that a float32 or bfloat16 hidden is read in place."""
        return self.hid_addr

    @property
    def pending_compute(self):
        return self.batch.pending > 0

    @property
    def tokens_seen(self):
        """int64[S]: tokens processed per stream since its last reset."""
        return np.array(self.win.seen, dtype=np.int64)

    @property
    def state_nbytes(self):
        """Bytes of per-stream state (what a snapshot holds)."""
        return self.win.nbytes + sum(
            int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in self._extra_expected())

    # ---- snapshot / restore ---------------------------------------------------------------------
    def snapshot(self):
        """A copy of every stream's state, for restore() (speculative decoding rollback)."""
        self._enter()
        try:
            if self.batch.pending:
                raise RuntimeError("cannot snapshot between feed() and compute()")
            parts = self.win.parts()
            parts.update(self._extra_state())
        finally:
            self.busy = False
        return EngineSnapshot(self._fingerprint, **parts)

    def _read_snapshot(self, snapshot):
        """The snapshot's arrays, each read once into a fresh copy and checked (changes nothing):
        an object whose attributes change between reads cannot slip past the checks."""
        if not isinstance(snapshot, EngineSnapshot):
            raise TypeError(f"restore() takes an EngineSnapshot, got {type(snapshot).__name__}")
        fp = snapshot.fingerprint
        if fp != self._fingerprint:
            raise ValueError(f"snapshot is from another engine (different {why_foreign(fp, self._fingerprint)}): "
                             f"cannot restore")
        want = tuple(self.win.expected_parts()) + tuple(self._extra_expected())
        parts = {}
        for name, shape, dtype in want:
            a = getattr(snapshot, name, None)
            if a is None and name == "rows":
                a = np.full(shape, -1, np.int64)  # a snapshot without rows: none known
            if not (isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dtype and a.flags.c_contiguous):
                raise ValueError(f"snapshot.{name} is damaged: expected {np.dtype(dtype).name} {shape}")
            parts[name] = np.array(a, copy=True)  # the one read; the checks below see this copy
        self.win.check_parts(parts, self.src.nrows)
        self._check_extra(parts)
        return parts

    def _check_snapshot(self, snapshot):
        """Raise unless `snapshot` can be restored here (changes nothing)."""
        self._read_snapshot(snapshot)

    def restore(self, snapshot):
        """Put back a snapshot of this engine, or of one with the same layer, config, hash plan
        and stream count. A fed batch or a draft's undo state is dropped."""
        parts = self._read_snapshot(snapshot)
        self._enter()
        try:
            self.src.release()
            self.win.put_parts(parts)
            self._put_extra(parts)
            self.batch.pending = 0
            self.batch.given = 0
        finally:
            self.busy = False


def _teams_held():
    """Team slots held now (engine/_base): one for each thread whose calls keep a team (until
    it exits), and a nested call's while its workers exit."""
    return es_team_slots_held()
