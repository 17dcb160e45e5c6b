# cython: language_level=3
"""HashWindow: the hash windows of one engine's stream slots, and of HashPlan.hash's sequences
(engine/_window.pxd declares it).

For each of S stream slots it keeps the last n-1 window entries (newest first), the tokens seen
since the slot's reset and the absolute table rows of its last token. A token's rows are the
hash of a window: the token's entry, then the slot's entries, through the history rule; then
the token's entry joins the slot's entries and the oldest falls off.

The variant's hash is three cdef nogil hooks, and the demo's is the default:
  entry(token)          the value a token leaves in the window: its compressed id (negative ids
                        pass through, DESIGN 1.1)
  rule(full, win)       the window the hash reads, from the token's entry and the slot's: as it is
  hash_rows(win, ld, nt, rows, stream)
                        the H head-local rows of nt windows (entry k of window i at win[k*ld + i]):
                        the XOR of the entries times the layer's multipliers, mod each head's prime
                        (the shared C kernels of include/engram_hash.h)
and _init_rule(plan) sets what a slot before the start holds (`start`: the pad id). A variant
with another rule or hash subclasses HashWindow in its own folder, sets `history` to its rule's
name and names the class as its engine's _window_class (Variant.window_class: the same class).
The engines (hash_one) and the batch hash (hash_batch, HashPlan.hash) run the same hooks, so a
rule or a hash is written once, there; the numpy oracle (Variant.windows) stays apart.

The undo state: before a call moves its slots, keep_undo() keeps them (per segment); rollback() puts
them back (a failed read), commit_segment() replays a draft's first tokens from the undo state.
"""
import numpy as np
cimport numpy as cnp
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint64_t

from engram_stream._consts cimport ES_MAX_NGRAM
from engram_stream._hash cimport (ES_HASH_BLOCK, ES_HASH_STREAM_BYTES, es_hash_window, es_hash_windows,
                                  es_modulus, es_modulus_make, es_runtime_bind, es_runtime_of_process)
from engram_stream.engine.args import view
from engram_stream.errors import id_out_of_range

cnp.import_array()
es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

cdef extern from "engram_step.h" nogil:
    void es_mark_rows(uint8_t *bitmap, const int64_t *rows, int64_t n) noexcept

_EMPTY_I64 = np.empty(0, np.int64)
_EMPTY_F64 = np.empty(0, np.float64)


cdef class HashWindow:
    """The hash windows of one engine's stream slots, with the plain history rule (slots before
    the start hold the pad id) and the demo's hash. Made and driven by EngineBase, or by
    HashPlan.hash through of_plan(); a variant's rule or hash subclasses it."""

    def __cinit__(self, *args, **kwargs):
        self.history = "plain"

    def __dealloc__(self):
        PyMem_Free(self.mods)

    cdef int setup(self, model, int layer, offsets, int64_t n_streams) except -1:
        """An engine's windows: layer `layer` of model's plan with the layer's head offsets."""
        return self._bind(model.plan, layer, offsets, n_streams)

    @classmethod
    def of_plan(cls, plan, int layer):
        """The window of plan's layer `layer` that hashes whole sequences (hash_batch): no slots."""
        plan.check_layer(layer)
        w = cls()
        (<HashWindow?> w)._bind(plan, layer, np.zeros(plan.cfg.n_heads, np.int64), 0)
        return w

    cdef int _bind(self, plan, int layer, offsets, int64_t n_streams) except -1:
        """Borrow layer `layer`'s hash data (plan and the layer's head offsets), make the state
        of n_streams slots, then the rule's own setup (_init_rule); every slot reset."""
        cfg = plan.cfg
        self.layer = layer
        self.n, self.nh, self.H = cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.n_heads
        if self.n > ES_MAX_NGRAM:  # EngramConfig refuses these already
            raise ValueError(f"max_ngram_size <= {ES_MAX_NGRAM} is what the engine supports")
        self.S, self.pad = n_streams, plan.pad_id
        self.has_lookup = plan.lookup is not None
        self.lookup = view(plan.lookup, np.int64, (cfg.vocab_size,), "plan.lookup") if self.has_lookup else _EMPTY_I64
        self.mult = view(plan.multipliers[layer], np.int64, (self.n,), f"plan.multipliers[{layer}]")
        self.primes = view(plan.head_primes[layer], np.int64, (self.H,), f"plan.head_primes[{layer}]")
        fp = plan.head_fp[layer]
        self.fp = _EMPTY_F64 if fp is None else view(fp, np.float64, (3 * self.H,), f"plan.head_fp[{layer}]")
        self.offsets = view(offsets, np.int64, (self.H,), f"layer {layer} offsets")
        self.vocab = cfg.vocab_size
        cdef int j
        PyMem_Free(self.mods)
        self.mods = NULL
        if fp is None:  # the batch kernel's reciprocals of the primes past the double-precision mod
            self.mods = <es_modulus *> PyMem_Malloc(max(1, self.H) * sizeof(es_modulus))
            if self.mods == NULL:
                raise MemoryError()
            for j in range(self.H):
                self.mods[j] = es_modulus_make(<uint64_t> self.primes[j])
        cdef int64_t S = n_streams
        self.hist = np.empty((S, self.n - 1), dtype=np.int64)
        self.seen = np.zeros(S, dtype=np.int64)
        self.last_rows = np.empty((S, self.H), dtype=np.int64)
        self.rec_hist = np.empty((S, self.n - 1), dtype=np.int64)
        self.rec_seen = np.empty(S, dtype=np.int64)
        self.rec_rows = np.empty((S, self.H), dtype=np.int64)
        self.start = self.pad
        self._init_rule(plan)
        cdef int64_t s
        for s in range(S):
            self.reset_stream(s)
        return 0

    # ---- the history rule ---------------------------------------------------------------------
    cdef int _init_rule(self, plan) except -1:
        """The rule's and the hash's own fields from the plan, for layer self.layer (after the
        shared hash data; `start` is the pad id)."""
        return 0

    cdef int64_t entry(self, int64_t token) noexcept nogil:
        """The value `token` leaves in the window: its compressed id; a negative id passes through."""
        if self.has_lookup and token >= 0:
            return self.lookup[token]
        return token

    cdef void rule(self, const int64_t *full, int64_t *win) noexcept nogil:
        """The window the hash reads (n entries, newest first) from the token's entry and the
        slot's (full): every entry as it is."""
        cdef int k
        for k in range(self.n):
            win[k] = full[k]

    # ---- the hash ------------------------------------------------------------------------------
    cdef void hash_rows(self, const int64_t *win, int64_t ld, int64_t nt, int64_t *rows, bint stream) noexcept nogil:
        """The H head-local rows of nt windows (entry k of window i at win[k*ld + i]; for nt > 1
        each window row holds nt rounded up to 8 readable entries) into rows[nt][H]: mix =
        XOR_k entry[k]*mult[k] (wrapping int64), each order's heads mix mod prime, floored.
        stream: the batch is too large to stay in cache (streaming stores where aligned)."""
        cdef const double *fp = &self.fp[0] if self.fp.shape[0] else NULL
        cdef int64_t one[ES_MAX_NGRAM]
        cdef int k
        if nt == 1:  # a token of a stream: the per-position kernel
            if ld != 1:
                for k in range(self.n):
                    one[k] = win[k * ld]
                win = one
            es_hash_window(win, &self.mult[0], self.n, self.nh, &self.primes[0], fp, rows)
        elif nt > 1:
            es_hash_windows(win, ld, nt, &self.mult[0], self.n, self.nh, &self.primes[0], fp, self.mods,
                            rows, stream)

    cdef int64_t fill_windows(self, const int64_t *ids, int64_t T, int64_t *wins, int64_t ld) noexcept nogil:
        """The windows of raw ids[T] hashed from a slot's start, as hash_one would read them on a
        fresh slot: each position's entry (entry()) and the n-1 before it (`start` before the
        first) through rule(); entry k of position t at wins[k*ld + t]. Returns the first id >=
        vocab_size (the windows are not all written then), or -1."""
        # buf: entries newest first, position i of the block at buf[BLK-1-i] and the n-1 entries
        # before the block at buf[BLK..], so a position's window entries are contiguous (rule's full)
        cdef int64_t buf[ES_HASH_BLOCK + ES_MAX_NGRAM]
        cdef int64_t past[ES_MAX_NGRAM]
        cdef int64_t win[ES_MAX_NGRAM]
        cdef int64_t t0 = 0, tok
        cdef int BLK = ES_HASH_BLOCK, back = self.n - 1, n = self.n, nt, i, k
        for k in range(back):
            buf[BLK + k] = self.start
        while t0 < T:
            nt = <int> min(<int64_t> BLK, T - t0)
            for i in range(nt):  # the entries first: their lookups are independent loads
                tok = ids[t0 + i]
                if tok >= self.vocab:
                    return tok
                buf[BLK - 1 - i] = self.entry(tok)
            for i in range(nt):
                self.rule(&buf[BLK - 1 - i], win)
                for k in range(n):
                    wins[k * ld + t0 + i] = win[k]
            for k in range(back):  # the block's newest n-1 entries precede the next block
                past[k] = buf[BLK - nt + k]
            for k in range(back):
                buf[BLK + k] = past[k]
            t0 += nt
        return -1

    def windows_batch(self, ids, wins, Py_ssize_t b0=0):
        """The windows of raw ids[B, T] (each row a sequence from its start) through entry()
        and rule(), nogil: entry k of position t of row b at wins[k, (b0 + b)*T + t]. wins:
        int64[n, W] with W >= (b0 + B)*T + 8 (hash_windows reads up to 8 past a row's last).
        They depend on the plan alone, not the layer: one window's serve every layer.
        ids >= vocab_size raise ValueError."""
        cdef const int64_t[:, ::1] a = ids
        cdef int64_t[:, ::1] w = wins
        cdef Py_ssize_t B = a.shape[0], T = a.shape[1], b
        cdef int64_t bad = -1
        if w.shape[0] != self.n or b0 < 0 or w.shape[1] < (b0 + B) * T + 8:
            raise ValueError(f"windows_batch: wins must be int64[{self.n}, >= {(b0 + B) * T + 8}], "
                             f"got {np.shape(wins)} (b0={b0})")
        if B == 0 or T == 0:
            return wins
        with nogil:
            for b in range(B):
                bad = self.fill_windows(&a[b, 0], T, &w[0, (b0 + b) * T], w.shape[1])
                if bad >= 0:
                    break
        if bad >= 0:
            raise id_out_of_range(bad, self.vocab)
        return wins

    def hash_windows(self, wins, out, Py_ssize_t b0=0):
        """out[B, T, H] = the head-local rows of windows_batch's windows of rows b0..b0+B
        through hash_rows(), nogil; out is written in place and returned."""
        cdef const int64_t[:, ::1] w = wins
        cdef int64_t[:, :, ::1] o = out
        cdef Py_ssize_t B = o.shape[0], T = o.shape[1], b
        if o.shape[2] != self.H or w.shape[0] != self.n or b0 < 0 or w.shape[1] < (b0 + B) * T + 8:
            raise ValueError(f"hash_windows: out must be int64[B, T, {self.H}] and wins int64[{self.n}, "
                             f">= (b0 + B)*T + 8], got {np.shape(out)} and {np.shape(wins)} (b0={b0})")
        if B == 0 or T == 0:
            return out
        cdef bint stream = B * T * self.H * 8 >= ES_HASH_STREAM_BYTES  # too large to stay in cache
        with nogil:
            for b in range(B):
                self.hash_rows(&w[0, (b0 + b) * T], w.shape[1], T, &o[b, 0, 0], stream)
        return out

    def hash_batch(self, ids, out):
        """out[B, T, H] = the head-local rows of raw ids[B, T] (each row a sequence from its
        start) through this window's hooks (windows_batch, then hash_windows); ids >=
        vocab_size raise ValueError. HashPlan.hash runs the two steps itself, the windows once
        for every layer."""
        a = np.ascontiguousarray(ids, dtype=np.int64)
        if np.ndim(out) != 3 or np.shape(out)[:2] != a.shape or np.shape(out)[2] != self.H:
            raise ValueError(f"hash_batch: out must have shape {a.shape + (self.H,)}, got {np.shape(out)}")
        wins = np.zeros((self.n, a.size + 8), np.int64)
        return self.hash_windows(self.windows_batch(a, wins), out)

    # ---- the moves -----------------------------------------------------------------------------
    cdef void hash_one(self, int64_t s, int64_t token, int64_t *rows, int64_t *entry) noexcept nogil:
        """`token` on slot s: its H absolute rows into rows, its window entry into *entry; then
        the slot's window takes the entry."""
        cdef int64_t full[ES_MAX_NGRAM]
        cdef int64_t win[ES_MAX_NGRAM]
        cdef int64_t e0 = self.entry(token)
        cdef int k, j
        full[0] = e0
        for k in range(1, self.n):
            full[k] = self.hist[s, k - 1]
        self.rule(full, win)
        self.hash_rows(win, 1, 1, rows, False)
        for j in range(self.H):
            rows[j] += self.offsets[j]
        if self.touched != NULL:
            es_mark_rows(self.touched, rows, self.H)
        self.push(s, e0)
        entry[0] = e0

    cdef void hash_segments(self, const int64_t *ids, const int64_t *seg_stream, const int64_t *seg_start,
                            const int64_t *seg_len, int64_t K, int64_t *rows, int64_t *entries) noexcept nogil:
        """K segments (segment k: seg_len[k] tokens of ids from seg_start[k], on slot
        seg_stream[k]) through their slots' windows, in order: each token's rows (H apiece) and
        entry at its index; each slot's last rows and count then follow its segment."""
        cdef int64_t k, j, s, i0, L
        for k in range(K):
            s, i0, L = seg_stream[k], seg_start[k], seg_len[k]
            for j in range(L):
                self.hash_one(s, ids[i0 + j], rows + (i0 + j) * self.H, entries + i0 + j)
            for j in range(self.H):
                self.last_rows[s, j] = rows[(i0 + L - 1) * self.H + j]
            self.seen[s] += L

    cdef void push(self, int64_t s, int64_t e) noexcept nogil:
        """Slot s's window takes entry e (newest first; the oldest falls off)."""
        cdef int k
        for k in range(self.n - 2, 0, -1):
            self.hist[s, k] = self.hist[s, k - 1]
        if self.n > 1:
            self.hist[s, 0] = e

    cdef void reset_stream(self, int64_t s) noexcept nogil:
        """Slot s as before any token: every window slot `start`, no rows, nothing seen."""
        cdef int64_t k
        for k in range(self.n - 1):
            self.hist[s, k] = self.start
        for k in range(self.H):
            self.last_rows[s, k] = -1
        self.seen[s] = 0

    cdef void keep_undo(self, const int64_t *seg_stream, int64_t K, bint draft) noexcept nogil:
        """The slots of K segments as they are before a call (segment k's slot: seg_stream[k])."""
        cdef int64_t k, j, s
        for k in range(K):
            s = seg_stream[k]
            for j in range(self.n - 1):
                self.rec_hist[k, j] = self.hist[s, j]
            for j in range(self.H):
                self.rec_rows[k, j] = self.last_rows[s, j]
            self.rec_seen[k] = self.seen[s]
        self.has_undo = True
        self.draft = draft

    cdef void rollback(self, const int64_t *seg_stream, int64_t K) noexcept nogil:
        """The kept slots back as before the call (nothing when no undo state); the undo state is spent."""
        cdef int64_t k, j, s
        if not self.has_undo:
            return
        for k in range(K):
            s = seg_stream[k]
            for j in range(self.n - 1):
                self.hist[s, j] = self.rec_hist[k, j]
            for j in range(self.H):
                self.last_rows[s, j] = self.rec_rows[k, j]
            self.seen[s] = self.rec_seen[k]
        self.has_undo = False
        self.draft = False

    cdef void commit_segment(self, int64_t k, int64_t s, const int64_t *entries, const int64_t *rows,
                             int64_t na) noexcept nogil:
        """Recorded segment k (slot s) as if only its first na tokens were fed: the window
        replays their entries (entries[0..na)), rows[] holds the segment's rows (H a token)."""
        cdef int64_t j
        for j in range(self.n - 1):
            self.hist[s, j] = self.rec_hist[k, j]
        for j in range(na):
            self.push(s, entries[j])
        self.seen[s] = self.rec_seen[k] + na
        for j in range(self.H):
            self.last_rows[s, j] = rows[(na - 1) * self.H + j] if na else self.rec_rows[k, j]

    # ---- what a snapshot holds ------------------------------------------------------------------
    def parts(self):
        """{name: array copy} of the windows' state: hist, seen, rows."""
        return {"hist": np.array(self.hist, copy=True), "seen": np.array(self.seen, copy=True),
                "rows": np.array(self.last_rows, copy=True)}

    def expected_parts(self):
        """((name, shape, dtype), ...) of parts()."""
        S = self.S
        return (("hist", (S, self.n - 1), np.int64), ("seen", (S,), np.int64), ("rows", (S, self.H), np.int64))

    def check_parts(self, parts, int64_t nrows):
        """Raise ValueError unless parts (shape- and dtype-checked copies) can be windows of a
        table of nrows rows."""
        if parts["seen"].size and parts["seen"].min() < 0:
            raise ValueError("snapshot.seen is damaged: negative token counts")
        rows = parts["rows"]
        if rows.size and ((rows < -1) | (rows >= nrows)).any():
            raise ValueError("snapshot.rows is damaged: rows out of the table")

    def put_parts(self, parts):
        """Put back checked parts; the undo state is void."""
        cdef int64_t[:, ::1] hist = parts["hist"], rows = parts["rows"]
        cdef int64_t[::1] seen = parts["seen"]
        self.hist[:, :] = hist
        self.seen[:] = seen
        self.last_rows[:, :] = rows
        self.has_undo = self.draft = False

    @property
    def nbytes(self):
        """Bytes of the windows' state (what a snapshot holds of it)."""
        return int(self.S * ((self.n - 1) * 8 + 8 + self.H * 8))

    def track(self, bitmap):
        """Mark every row hashed in `bitmap` (checked by the caller; borrowed), or stop with None."""
        self._touched_ref = bitmap
        self.touched = NULL if bitmap is None else <uint8_t *> cnp.PyArray_DATA(bitmap)
