# The engine base: what both variants' streaming engines share (engine/_base.pyx holds the
# rules). A variant engine (demo/_engine.pyx, v41/_engine.pyx) is a thin subclass that supplies
# the hooks at the end: gather + project + tail of a chunk of hashed tokens, its own state.
from libc.stdint cimport int64_t, uint8_t

from engram_stream.rows._source cimport RowSource


cdef class EngineBase:
    cdef readonly object model
    cdef readonly object layer
    cdef readonly int n_streams
    cdef object _fingerprint           # what a snapshot must match to be restored here

    # geometry
    cdef int G, D, E, M, H, hd, n, nh
    cdef int64_t C                     # G*D: hidden / output floats of one token
    cdef int64_t vocab, pad
    cdef int64_t chunk                 # tokens per compute chunk (the variant's GEMM size)
    cdef bint latch                    # DEAD tokens (V4.1): the image id and negative ids block history
    cdef int64_t dead_id               # the raw id whose gate is 0 (V4.1's image token; -1: none)
    cdef int64_t hist_reset            # a window slot before the start: the pad id, or DEAD (-1)
    cdef bint sep                      # the pad id ends a document (Qwen's EOS): separator_window

    # borrowed, read-only hash data (typed memoryviews taken once, shapes checked)
    cdef bint has_lookup
    cdef const int64_t[::1] lookup     # [vocab] (empty: identity)
    cdef const int64_t[::1] mult       # [n]
    cdef const int64_t[::1] primes     # [H]
    cdef const double[::1] fp          # [3H] division-free mod constants (empty: divide)
    cdef const int64_t[::1] offsets    # [H]

    # where rows come from, and the files under the model's arrays
    cdef RowSource src
    cdef object _files                 # the MappedFiles the engine reads (checked before every read)
    cdef int nfiles
    cdef int fds[16]
    cdef int64_t stamps[16][4]         # (dev, ino, size, mtime_ns) at load

    # owned state, per stream (the rules that move it: _base.pyx)
    cdef int64_t[:, ::1] hist          # [S, n-1] window entries, newest first
    cdef int64_t[::1] seen             # [S] tokens since reset
    cdef int64_t[:, ::1] last_rows     # [S, H] absolute rows of the last token fed (-1: none)
    cdef uint8_t *touched              # optional rows-touched bitmap (track_rows), borrowed
    cdef object _touched_ref

    # the batch between feed and compute (a call's tokens, grouped in segments of one stream)
    cdef int64_t pn                    # tokens hashed, not yet computed (0: nothing pending)
    cdef int64_t window                # tokens whose rows one submit() hands over (a multiple of chunk)
    cdef int64_t sub_end               # the pending batch's tokens [.., sub_end) are submitted
    cdef int64_t npieces               # segments of the pending batch
    cdef int64_t tcap                  # tokens the buffers below hold
    cdef int64_t *rbuf                 # [tcap, H] absolute rows
    cdef uint8_t *dbuf                 # [tcap] gate 0 (a DEAD position)
    cdef int64_t *tstream              # [tcap] the stream of each token
    cdef int64_t *wbuf                 # [tcap] each token's window entry (draft commit replays them)
    cdef int64_t *seg_stream           # [S] the slot of segment k
    cdef int64_t *seg_start            # [S] its first token
    cdef int64_t *seg_len              # [S] its tokens
    cdef int64_t *slot_seg             # [S] the segment of each slot in this call (-1: not named)
    cdef uint8_t *mark                 # [S] scratch of the argument checks (all 0 between calls)
    cdef const char **dp               # [chunk * H] rows' data of the chunk being computed
    cdef const char **sp               # [chunk * H] and their scales
    cdef object _unmask                # masked positions taken out (demo): (keep, lengths, live segments)
    cdef int64_t _pending_n            # tokens of a fed packed batch as the caller gave them (0: a fed step)
    cdef object _steps                 # (arange(S), ones(S)): a step's segments
    cdef const int64_t *step_st
    cdef const int64_t *step_len

    # what a rollback (failed read, draft commit) needs, per segment of the last call
    cdef bint has_record               # the last call's record is valid
    cdef bint draft                    # the last call was a draft: commit() may cut it back
    cdef int64_t[:, ::1] rec_hist      # [S, n-1] window before the call
    cdef int64_t[::1] rec_seen         # [S]
    cdef int64_t[:, ::1] rec_rows      # [S, H]

    cdef bint busy                     # a call is running (one owner at a time)
    cdef int _step_threads, _prefill_threads  # the caller's (0: unset, the tuned or default count runs)
    cdef int _op_threads[3]            # threads of each operation (OP_STEP, OP_BATCH, OP_PREFILL) when unset
    cdef int _op_isa[3]                # its kernel level measured fastest (engine/tune.py; -1: the process's)
    cdef object _op_why                # (why, ...) per operation: what chose its path and threads
    cdef bint teamed                   # the variant's _chunk runs its splits on self.team
    cdef void *team                    # es_team * of the call in flight (NULL: none, or one thread)
    cdef bint _decode_only(self, ln) except -1
    cdef void _team_open(self, int threads) noexcept nogil
    cdef void _team_close(self) noexcept nogil

    # ---- the rules (base) ----
    cdef int _setup(self, model, layer, int n_streams, int64_t chunk, bint latch, rows) except -1
    cdef int _grow_tokens(self, int64_t n) except -1
    cdef int _check_files(self) except -1
    cdef int _check_call(self, object ids, const int64_t *pid, int64_t n, str pending) except -1
    cdef int _feed_steps(self, object ids, bint single, str pending) except -1
    cdef _enter(self)
    cdef int64_t _first_bad_id(self, const int64_t *ids, int64_t n) noexcept nogil
    cdef void _hash_one(self, int64_t s, int64_t token, int64_t i) noexcept nogil
    cdef void _hash_segments(self, const int64_t *ids) noexcept nogil
    cdef int _feed(self, const int64_t *ids, int64_t N, const int64_t *streams, const int64_t *lengths,
                   int64_t K, bint draft) except -1
    cdef int _compute(self, const float *hid, float *out) except -1
    cdef int _resolve(self, int64_t t0, int64_t nb) except -1
    cdef void _record(self, bint draft) noexcept nogil
    cdef void _rollback(self) noexcept nogil
    cdef bint _in_record(self, int64_t s) noexcept
    cdef void _reset_stream(self, int64_t s) noexcept nogil
    cdef int _op(self) noexcept nogil
    cdef int _threads(self) noexcept nogil
    cdef int _threads_of(self, int op) noexcept nogil
    cdef void _push(self, int64_t s, int64_t e) noexcept nogil

    # ---- the hooks (each variant) ----
    cdef int _init_variant(self, w) except -1
    cdef int _grow_chunk(self, int64_t nb, int threads) except -1
    cdef void _chunk(self, int64_t t0, int64_t nb, const float *hid, float *out, int threads) noexcept nogil
    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil
    cdef int _record_extra(self, bint draft, bint needed) except -1
    cdef void _rollback_extra(self) noexcept nogil
    cdef void _commit_extra(self, int64_t k, int64_t a) noexcept nogil
    cdef void _reset_extra(self, int64_t s) noexcept nogil
