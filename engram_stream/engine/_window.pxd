# The per-stream hash window (engine/_window.pyx): each stream slot's last n-1 window entries,
# its token count and last rows, the hash of a token through them, and the undo state a call keeps
# so that a rollback or a draft's commit can put its slots back; and the batch hash of whole
# sequences (hash_batch, HashPlan.hash) through the same hooks. The variant's hash is three hooks,
# entry() and rule() (the history rule) and hash_rows() (the hash); a variant with another rule or
# hash subclasses HashWindow in its own folder and names that class as its engine's _window_class.
from libc.stdint cimport int64_t, uint8_t

from engram_stream._hash cimport es_modulus


cdef class HashWindow:
    cdef readonly str history          # the HashPlan.history this window keeps (the engine checks it)
    cdef int n, H, nh                  # max_ngram_size, heads, heads per n-gram order
    cdef int layer                     # the Engram layer whose hash data this window borrows
    cdef int64_t S                     # stream slots
    cdef int64_t pad                   # the plan's pad id
    cdef int64_t start                 # what a window slot before the start holds (default: pad)

    # borrowed, read-only hash data (typed memoryviews taken once, shapes checked)
    cdef bint has_lookup
    cdef const int64_t[::1] lookup     # [vocab] (empty: identity)
    cdef const int64_t[::1] mult       # [n]
    cdef const int64_t[::1] primes     # [H]
    cdef const double[::1] fp          # [3H] division-free mod constants (empty: divide)
    cdef const int64_t[::1] offsets    # [H]
    cdef es_modulus *mods              # [H] the primes' reciprocals when fp is empty (owned), else NULL
    cdef int64_t vocab                 # cfg.vocab_size: hash_batch refuses ids past it
    cdef uint8_t *touched              # optional rows-touched bitmap (track_rows), borrowed
    cdef object _touched_ref

    # owned state, per stream
    cdef int64_t[:, ::1] hist          # [S, n-1] window entries, newest first
    cdef int64_t[::1] seen             # [S] tokens since reset
    cdef int64_t[:, ::1] last_rows     # [S, H] absolute rows of the last token fed (-1: none)

    # the undo state of the last call, per segment (what a rollback or a draft's commit starts from)
    cdef bint has_undo                 # the last call's undo state is valid
    cdef bint draft                    # the last call was a draft: commit may cut it back
    cdef int64_t[:, ::1] rec_hist      # [S, n-1]
    cdef int64_t[::1] rec_seen         # [S]
    cdef int64_t[:, ::1] rec_rows      # [S, H]

    cdef int setup(self, model, int layer, offsets, int64_t n_streams) except -1
    cdef int _bind(self, plan, int layer, offsets, int64_t n_streams) except -1

    # ---- the history rule and the hash (a subclass overrides these) ----
    cdef int _init_rule(self, plan) except -1
    cdef int64_t entry(self, int64_t token) noexcept nogil
    cdef void rule(self, const int64_t *full, int64_t *win) noexcept nogil
    cdef void hash_rows(self, const int64_t *win, int64_t ld, int64_t nt, int64_t *rows, bint stream) noexcept nogil
    cdef int64_t fill_windows(self, const int64_t *ids, int64_t T, int64_t *wins, int64_t ld) noexcept nogil

    # ---- the moves ----
    cdef void hash_one(self, int64_t s, int64_t token, int64_t *rows, int64_t *entry) noexcept nogil
    cdef void hash_segments(self, const int64_t *ids, const int64_t *seg_stream, const int64_t *seg_start,
                            const int64_t *seg_len, int64_t K, int64_t *rows, int64_t *entries) noexcept nogil
    cdef void push(self, int64_t s, int64_t e) noexcept nogil
    cdef void reset_stream(self, int64_t s) noexcept nogil
    cdef void keep_undo(self, const int64_t *seg_stream, int64_t K, bint draft) noexcept nogil
    cdef void rollback(self, const int64_t *seg_stream, int64_t K) noexcept nogil
    cdef void commit_segment(self, int64_t k, int64_t s, const int64_t *entries, const int64_t *rows,
                             int64_t na) noexcept nogil
