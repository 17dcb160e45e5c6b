# The engine base: the orchestrator every variant's streaming engine shares (engine/_base.pyx).
# It holds the parts (the hash window of engine/_window.pxd, the batch of engine/_batch.pxd,
# the row source, the file stamps) and runs a call through them and the variant's hooks. A
# variant engine is a thin subclass that supplies the hooks at the end (gather + project + tail
# of a chunk of hashed tokens, its own state) and, when its plan's history rule is not the
# plain one, its window class (_window_class).
from libc.stdint cimport int64_t, uint8_t

from engram_stream.engine._batch cimport Batch
from engram_stream.engine._window cimport HashWindow
from engram_stream.rows._source cimport RowSource
from engram_stream.rows._stamps cimport FileStamps

cdef extern from "engram_gguf.h" nogil:
    # a chunk's gather (es_split's ctx) for every engine whose rows are records of any kind:
    # token i's H records at dp[i*H + j] (their scales at sp[...]), converted by the kernel of
    # the table's kind into e + i*lde, so every row source gives the same bits
    ctypedef struct es_records_job:
        const char **dp
        const char **sp
        float *e
        int64_t lde
        const float *lut
        int kind, hd, H, ggtype
    void es_records_job_run(void *arg, int64_t i0, int64_t i1)

cdef extern from "engram_step.h" nogil:
    # the call's kept workers (engram_team.h), and the split and the projection GEMMs every
    # variant's engine runs on them
    ctypedef void (*es_range_fn)(void *ctx, int64_t i0, int64_t i1) noexcept nogil
    ctypedef struct es_team:
        pass
    void es_split(es_team *team, int nthreads, int64_t n, int64_t grain, es_range_fn fn, void *ctx) noexcept
    void es_gemm_packed_mt(const float *X, int64_t ldx, int64_t B, int E, const void *Wp, int wbf16,
                           const float *biasp, int M, float *Y, float *xpack, int nthreads,
                           es_team *team) noexcept
    int es_gemm_records_mt(const char **dp, int H, int hd, int64_t B, const void *Wp, int wbf16,
                           const float *biasp, int M, float *Y, float *xpack, int nthreads,
                           es_team *team) noexcept
    int ES_GEMM_BF16_ROWS


cdef class EngineBase:
    cdef readonly object model
    cdef readonly object layer
    cdef readonly int n_streams
    cdef object _fingerprint           # what a snapshot must match to be restored here

    # geometry
    cdef int G, D, E, M, H, hd, n
    cdef int64_t C                     # output floats of one token: G*D, or D for an input layer
    cdef bint no_hidden                # an input layer (the class's input_layer): no hidden is read
    cdef bint fed_single               # the pending batch came from feed(scalar id): compute() returns one token
    cdef int64_t vocab
    cdef bint negative_ids             # negative ids are taken (the variant's Variant.negative_ids)
    cdef int64_t chunk                 # tokens per compute chunk (the variant's GEMM size)

    # the parts
    cdef HashWindow win                # per-stream windows, the history rule, the undo state
    cdef Batch batch                   # the call's segments and per-token buffers
    cdef RowSource src                 # where rows come from
    cdef FileStamps files              # the mapped files under the layer's arrays (checked before every read)
    cdef const char **dp               # [chunk * H] rows' data of the chunk being computed
    cdef const char **sp               # [chunk * H] and their scales

    cdef bint busy                     # a call is running (one owner at a time)
    cdef int _step_threads, _prefill_threads  # the caller's (0: unset, the tuned or default count runs)
    cdef int _op_threads[3]            # threads of each operation (OP_STEP, OP_BATCH, OP_PREFILL) when unset
    cdef int _op_isa[3]                # its kernel level measured fastest (engine/tune.py; -1: the process's)
    cdef object _op_why                # (why, ...) per operation: what chose its path and threads
    cdef bint hbf, obf                 # the call's hidden / out hold bfloat16 (else float32): _chunk reads them
    cdef size_t hid_addr               # the hidden the last call's first chunk got (the no-copy test)
    cdef bint teamed                   # the variant's _chunk runs its splits on self.team
    cdef void *team                    # es_team * of the call in flight (NULL: none, or one thread)
    cdef void _team_open(self, int threads) noexcept nogil
    cdef void _team_close(self) noexcept nogil

    # ---- the run of a call (base) ----
    cdef int _setup(self, model, layer, int n_streams, int64_t chunk, rows) except -1
    cdef int _check_call(self, object ids, const int64_t *pid, int64_t n, str pending) except -1
    cdef int _feed_steps(self, object ids, bint single, str pending) except -1
    cdef tuple _shape(self, object n)
    cdef _enter(self)
    cdef _no_segment(self, bint draft, keep)
    cdef int _feed(self, const int64_t *ids, int64_t N, const int64_t *streams, const int64_t *lengths,
                   int64_t K, bint draft) except -1
    cdef int _compute(self, const void *hid, void *out) except -1
    cdef int _run(self, h, o) except -1
    cdef int _resolve(self, int64_t t0, int64_t nb) except -1
    cdef void _rollback(self) noexcept nogil
    cdef void _reset_stream(self, int64_t s) noexcept nogil
    cdef int _op(self) noexcept nogil
    cdef int _threads(self) noexcept nogil
    cdef int _threads_of(self, int op) noexcept nogil

    # ---- the hooks (each variant) ----
    cdef int _init_variant(self, w) except -1
    cdef int _grow_chunk(self, int64_t nb, int threads) except -1
    cdef void _chunk(self, int64_t t0, int64_t nb, const void *hid, void *out, int threads) noexcept nogil
    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil
    cdef int _keep_undo_extra(self, bint draft, bint needed) except -1
    cdef void _rollback_extra(self) noexcept nogil
    cdef void _commit_extra(self, int64_t k, int64_t a) noexcept nogil
    cdef void _reset_extra(self, int64_t s) noexcept nogil
