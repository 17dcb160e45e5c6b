# The batch of one engine call (engine/_batch.pyx): its segments (segment k: seg_len[k]
# consecutive tokens of slot seg_stream[k]), the per-token buffers the hash fills and the chunks
# read, the masked positions taken out, and the checks of a call's arguments.
from libc.stdint cimport int64_t, uint8_t


cdef class Batch:
    cdef int64_t S                     # stream slots of the engine
    cdef int H                         # rows per token
    cdef int64_t pending               # tokens fed, not yet computed (0: nothing pending)
    cdef int64_t window                # tokens whose rows one submit() hands over (a multiple of chunk)
    cdef int64_t sub_end               # the pending batch's tokens [.., sub_end) are submitted
    cdef int64_t nseg                  # segments of the call
    cdef int64_t cap                   # tokens the buffers below hold
    cdef int64_t *rows                 # [cap, H] absolute rows of each token
    cdef int64_t *entries              # [cap] each token's window entry (a draft's commit replays them)
    cdef int64_t *stream               # [cap] the slot of each token
    cdef int64_t *ids                  # [cap] each token's id as fed (a variant's gate may read it)
    cdef int64_t *seg_stream           # [S] the slot of segment k
    cdef int64_t *seg_start            # [S] its first token
    cdef int64_t *seg_len              # [S] its tokens
    cdef int64_t *slot_seg             # [S] the segment of each slot in this call (-1: not named)
    cdef uint8_t *mark                 # [S] scratch of the argument checks (all 0 between calls)
    cdef object unmask                 # masked positions taken out: (keep, lengths, live segments), or None
    cdef int64_t given                 # tokens of a fed packed batch as the caller gave them (0: a fed step)
    cdef object _steps                 # (arange(S), ones(S)): a step's segments
    cdef const int64_t *step_st
    cdef const int64_t *step_len

    cdef int setup(self, int64_t n_streams, int H, int64_t chunk, int64_t submit_rows) except -1
    cdef int grow(self, int64_t n) except -1
    cdef void take(self, const int64_t *ids, int64_t N, const int64_t *streams, const int64_t *lengths,
                   int64_t K) noexcept nogil
    cdef bint steps_only(self) noexcept nogil
    cdef bint names(self, int64_t s) noexcept nogil


cdef int64_t first_bad_id(const int64_t *ids, int64_t n, int64_t vocab) noexcept nogil
cdef bint decode_only(ln) except -1
