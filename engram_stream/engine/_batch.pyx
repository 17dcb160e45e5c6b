# cython: language_level=3
"""Batch: the batch of one engine call (engine/_batch.pxd declares it).

Every call is a batch of segments: segment k is lengths[k] consecutive tokens of slot
streams[k] (a decode step when 1, a prompt chunk when more). step() is S segments of one
token, prefill() one segment, step_packed() any batch. The batch checks a call's segments and
masked positions before anything changes (segments(), masked(), first_bad_id), then holds the
call's tokens: their slots and ids (take()), the rows and window entries the hash window writes,
and how far the row source has been handed them (window, sub_end).
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, memset

from engram_stream.plan import as_ids

cnp.import_array()


cdef inline void *_regrow(void *p, size_t nbytes) except NULL:
    """realloc, or MemoryError (p is then still valid: the batch frees it)."""
    cdef void *r = realloc(p, nbytes if nbytes else 1)
    if r == NULL:
        raise MemoryError(f"engine scratch: could not allocate {nbytes} bytes")
    return r


cdef int64_t first_bad_id(const int64_t *ids, int64_t n, int64_t vocab) noexcept nogil:
    """The index of the first id >= vocab, or -1."""
    cdef int64_t i
    for i in range(n):
        if ids[i] >= vocab:
            return i
    return -1


cdef bint decode_only(ln) except -1:
    """Every segment of a packed call one token (ln: its lengths, int64[K]), before its feed."""
    cdef const int64_t *pl = <const int64_t *> cnp.PyArray_DATA(ln)
    cdef int64_t k
    for k in range(ln.shape[0]):
        if pl[k] > 1:
            return False
    return True


cdef class Batch:
    """The segments and per-token buffers of an engine's calls (made and driven by EngineBase)."""

    def __cinit__(self, *args, **kwargs):
        self.pending = 0
        self.cap = 0

    def __dealloc__(self):
        free(self.rows); free(self.entries); free(self.stream); free(self.ids)
        free(self.seg_stream); free(self.seg_start); free(self.seg_len); free(self.slot_seg); free(self.mark)

    cdef int setup(self, int64_t n_streams, int H, int64_t chunk, int64_t submit_rows) except -1:
        """Buffers for n_streams slots of H rows a token; a submit hands the row source whole
        chunks of about submit_rows rows."""
        cdef int64_t S = n_streams
        self.S, self.H = S, H
        self.seg_stream = <int64_t *> _regrow(NULL, S * sizeof(int64_t))
        self.seg_start = <int64_t *> _regrow(NULL, S * sizeof(int64_t))
        self.seg_len = <int64_t *> _regrow(NULL, S * sizeof(int64_t))
        self.slot_seg = <int64_t *> _regrow(NULL, S * sizeof(int64_t))
        self.mark = <uint8_t *> _regrow(NULL, S * sizeof(uint8_t))
        memset(self.mark, 0, S)
        self.window = max(1, submit_rows // (chunk * H)) * chunk
        self._steps = (np.arange(S, dtype=np.int64), np.ones(S, dtype=np.int64))  # a step's segments
        self.step_st = <const int64_t *> cnp.PyArray_DATA(self._steps[0])
        self.step_len = <const int64_t *> cnp.PyArray_DATA(self._steps[1])
        self.grow(S)
        return 0

    cdef int grow(self, int64_t n) except -1:
        """Token buffers for a batch of n tokens; made before any state changes."""
        if n <= self.cap:
            return 0
        self.rows = <int64_t *> _regrow(self.rows, n * self.H * sizeof(int64_t))
        self.entries = <int64_t *> _regrow(self.entries, n * sizeof(int64_t))
        self.stream = <int64_t *> _regrow(self.stream, n * sizeof(int64_t))
        self.ids = <int64_t *> _regrow(self.ids, n * sizeof(int64_t))
        self.cap = n
        return 0

    cdef void take(self, const int64_t *ids, int64_t N, const int64_t *streams, const int64_t *lengths,
                   int64_t K) noexcept nogil:
        """A checked call (N ids in K segments, grown for) as the batch: segments, each token's
        slot and id. The rows and entries are the hash window's to write."""
        cdef int64_t k, j, t = 0
        for k in range(self.S):
            self.slot_seg[k] = -1
        for k in range(K):
            self.seg_stream[k], self.seg_start[k], self.seg_len[k] = streams[k], t, lengths[k]
            self.slot_seg[streams[k]] = k
            for j in range(lengths[k]):
                self.stream[t + j] = streams[k]
            t += lengths[k]
        memcpy(self.ids, ids, N * sizeof(int64_t))
        self.nseg = K

    cdef bint steps_only(self) noexcept nogil:
        """Every segment of the call one token (a batch of decode steps)."""
        cdef int64_t k
        for k in range(self.nseg):
            if self.seg_len[k] > 1:
                return False
        return True

    cdef bint names(self, int64_t s) noexcept nogil:
        """Slot s is one of the call's segments."""
        cdef int64_t k
        for k in range(self.nseg):
            if self.seg_stream[k] == s:
                return True
        return False

    def segments(self, streams, lengths, int64_t N):
        """streams[K], lengths[K] as int64 arrays, checked: slots distinct and in range, lengths
        >= 1 and summing to N. Nothing changes on a refusal (and nothing is allocated for int64
        arrays: a serving loop passes its own)."""
        st = as_ids(streams, 1, "streams")
        ln = as_ids(lengths, 1, "lengths")
        if st.shape[0] != ln.shape[0]:
            raise ValueError(f"streams and lengths must have the same length, got {st.shape[0]} and {ln.shape[0]}")
        cdef const int64_t[::1] sv = st
        cdef const int64_t[::1] lv = ln
        cdef int64_t k, s, total = 0, bad = -1, why = 0
        for k in range(sv.shape[0]):
            s = sv[k]
            if s < 0 or s >= self.S:
                bad, why = k, 1
                break
            if self.mark[s]:
                bad, why = k, 2
                break
            self.mark[s] = 1
            if lv[k] < 1:
                bad, why = k, 3
                break
            if lv[k] > N - total:  # the sum so far stays <= N: no int64 wrap can pass the check
                bad, why = k, 4
                break
            total += lv[k]
        for k in range(sv.shape[0]):  # the marks go back whatever happened
            if 0 <= sv[k] < self.S:
                self.mark[sv[k]] = 0
        if why == 1:
            raise IndexError(f"stream {sv[bad]} out of range for an engine with {self.S} streams")
        if why == 2:
            raise ValueError(f"streams must be distinct within a call, got {st.tolist()}")
        if why == 3:
            raise ValueError(f"every segment needs at least one token, got lengths {ln.tolist()}")
        if why == 4:
            raise ValueError(f"lengths[{bad}] = {lv[bad]} takes the lengths past the {N} token ids given "
                             f"(lengths {ln.tolist()} must sum to {N})")
        if total != N:
            raise ValueError(f"lengths sum to {total} but {N} token ids were given")
        return st, ln

    @staticmethod
    def masked(ids, st, ln, masked):
        """(ids, streams, lengths, keep) with the masked positions taken out before the hash, the
        same on every variant: padding is no token, so it reaches no window and no variant state
        (keep: what stays, for compute to scatter back; segments left empty are dropped)."""
        if masked is None:
            return ids, st, ln, None
        m = np.asarray(masked)
        if m.dtype != np.bool_ or m.shape != ids.shape:
            raise ValueError(f"masked must be a bool array of shape {ids.shape}, got "
                             f"{getattr(m, 'dtype', type(masked).__name__)} {m.shape}")
        if not m.any():
            return ids, st, ln, None
        keep = ~m
        per = np.add.reduceat(keep.astype(np.int64), np.concatenate([[0], np.cumsum(ln)[:-1]])) if ln.size else ln
        live = per > 0
        return (np.ascontiguousarray(ids[keep]), np.ascontiguousarray(st[live]), np.ascontiguousarray(per[live]),
                (keep, ln, live))

    def accepted(self, accepted):
        """accepted as counts of the call's fed segments (int64[K]), checked against the call as
        the caller gave it (its own segments, masked positions included); raises unless each is
        0..lengths[k]."""
        a = as_ids(accepted, 1, "accepted")
        keep = self.unmask
        lens = np.array([self.seg_len[k] for k in range(self.nseg)], np.int64)
        given = keep[1] if keep is not None else lens
        if a.shape[0] != given.shape[0] or (a.size and (a.min() < 0 or (a > given).any())):
            raise ValueError(f"accepted must hold one count per segment, 0 <= accepted[k] <= "
                             f"lengths[k] = {given.tolist()}, got {a.tolist()}")
        if keep is not None:  # the call's own segments -> the tokens that were not masked
            mask, ln, live = keep
            starts = np.concatenate([[0], np.cumsum(ln)[:-1]]).astype(np.int64)
            a = np.array([int(mask[b:b + x].sum()) for b, x in zip(starts, a)], np.int64)[live]
        return np.ascontiguousarray(a)
