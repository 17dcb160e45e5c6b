# cython: language_level=3
"""LongcatEngine: the longcat-flash-lite variant's streaming engine (DESIGN.md 4c), an input layer.

One call per token (or a batch of segments) gives the embedding decoder layer 1 takes:
(embed[t] + proj_w @ (the E embedders' rows concatenated)) / (1 + E), proj_w the post_projs side
by side (weights.py), so a chunk is one gather, one GEMM over pre-packed panels (the demo's
kernel) and the token embeddings added. There is no hidden input and no state besides the hash
windows. Oracle: engram_stream.longcat.reference.

LongcatWindow holds LongCat's hash and history rule: each stream slot keeps its last n-1 raw
ids (-1 before the start); a token's look-back walks them newest first and stops before the
start and at an EOS (the EOS itself excluded: it adds nothing); the token itself is always in,
an EOS too. Embedder c's row is sum_delta id[p - delta] * (vocab^delta mod mod_c), mod mod_c
(head_mods: 0 past the embedder's order), plus its offset in the one table.
"""
import ml_dtypes
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

from engram_stream._consts cimport ES_MAX_NGRAM, ES_PREFILL_CHUNK
from engram_stream._hash cimport es_runtime_bind, es_runtime_of_process
from engram_stream.engine._base cimport (ES_GEMM_BF16_ROWS, EngineBase, es_gemm_packed_mt, es_gemm_records_mt,
                                         es_records_job, es_records_job_run, es_split, es_team)
from engram_stream.engine._window cimport HashWindow
from engram_stream.engine.args import view
from engram_stream.rows.gguf import gather_type

cnp.import_array()
es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

cdef extern from "engram_step.h" nogil:
    void es_floats_to_bf16(const float *x, int64_t n, uint16_t *o) noexcept

_BF16 = np.dtype(ml_dtypes.bfloat16)
BEFORE_START = -1   # what a window slot before the start holds (ids are >= 0)


cdef struct ChunkWork:
    # what a chunk's pieces read and write (es_split's ctx): the gather (token i's H row records
    # at dp[i*H + j] into e + i*lde: es_records_job_run) and the tails (token i's projection at
    # y + i*D, its embedding row, out at out + i*D: float32, or bf16 bits where obf)
    es_records_job g
    int D
    const float *y
    const int64_t *ids
    const uint8_t *emb
    int64_t embld
    bint ebf16, obf
    float inv
    void *out


cdef void _tail_part(void *ctx, int64_t i0, int64_t i1) noexcept nogil:
    """Tokens [i0, i1): (y + embed[id]) / (1 + E), into out (bf16: computed in y, then rounded)."""
    cdef ChunkWork *w = <ChunkWork *> ctx
    cdef int64_t i, d
    cdef float *y
    cdef float *o
    cdef const float *ef
    cdef const uint16_t *eb
    for i in range(i0, i1):
        y = <float *> w.y + i * w.D
        o = y if w.obf else <float *> w.out + i * w.D
        if w.ebf16:
            eb = <const uint16_t *> (w.emb + w.ids[i] * w.embld)
            for d in range(w.D):
                o[d] = (y[d] + _bf16(eb[d])) / w.inv
        else:
            ef = <const float *> (w.emb + w.ids[i] * w.embld)
            for d in range(w.D):
                o[d] = (y[d] + ef[d]) / w.inv
        if w.obf:
            es_floats_to_bf16(y, w.D, <uint16_t *> w.out + i * w.D)


cdef inline void *_regrow(void *p, size_t nbytes) except NULL:
    cdef void *r = realloc(p, nbytes if nbytes else 1)
    if r == NULL:
        raise MemoryError(f"engine scratch: could not allocate {nbytes} bytes")
    return r


cdef class LongcatWindow(HashWindow):
    """LongCat's hash windows (see the module doc). Its plan's history is "separator" (an EOS
    ends what the positions after it see); the hash is LongCat's own sum, not the XOR chain."""

    cdef int64_t eos
    cdef const int64_t[:, ::1] hmods   # [H, n] vocab^delta mod mod_c (0 past the head's order)

    def __cinit__(self, *args, **kwargs):
        self.history = "separator"

    cdef int _init_rule(self, plan) except -1:
        self.start = BEFORE_START
        self.eos = plan.cfg.pad_id
        L = plan.cfg.layer_ids[0]   # (the one layer: [0])
        self.hmods = view(plan.head_mods[L], np.int64, (self.H, self.n), f"plan.head_mods[{L}]")
        return 0

    cdef int64_t entry(self, int64_t token) noexcept nogil:
        return token   # raw ids: no compression

    cdef void rule(self, const int64_t *full, int64_t *win) noexcept nogil:
        """The token itself (an EOS too), then its look-back newest first up to (not into) the
        start or an EOS; the ids past that read 0, which adds nothing to the sum (the Hugging
        Face code's shifted ids are 0 there)."""
        cdef int k
        cdef bint cut = False
        win[0] = full[0]
        for k in range(1, self.n):
            cut = cut or full[k] < 0 or full[k] == self.eos
            win[k] = 0 if cut else full[k]

    cdef void hash_rows(self, const int64_t *win, int64_t ld, int64_t nt, int64_t *rows, bint stream) noexcept nogil:
        """The H head-local rows of nt windows (entry k of window i at win[k*ld + i]) into
        rows[nt][H]: head j's sum_k entry[k] * hmods[j, k], mod its table size. The engine's
        steps and HashPlan.hash both run it (HashWindow.hash_one, hash_sequence)."""
        cdef int64_t i, acc
        cdef int j, k
        for i in range(nt):
            for j in range(self.H):
                acc = 0
                for k in range(self.n):
                    acc += win[k * ld + i] * self.hmods[j, k]   # config.validate: n * (vocab-1) * (mod-1) fits int64
                rows[i * self.H + j] = acc % self.primes[j]


cdef class LongcatEngine(EngineBase):
    """The longcat-flash-lite streaming engine: `model.stream(0, n_streams)`. Calls: see
    EngineBase's input-layer shape: no hidden (None, or left out), float32[hidden_size] a token
    (step(token_id) -> [D], step_packed(ids, None, ...) -> [N, D], prefill(ids) -> [T, D]).
    Token ids are in [0, vocab_size): they index the token embedding, so a negative id is
    refused (ValueError; the variant's negative_ids is False)."""

    cdef int table_kind                # 0 float32, 3 bfloat16 (es_gather_*), 6 GGUF rows (es_gg_decode)
    cdef int ggtype                    # kind 6: their GGUF type (rows.gguf.gather_type)
    cdef int wbf16                     # es_gemm_packed's: 0 float32, 1 bfloat16, ES_GEMM_BF16_ROWS with a bf16 table
    cdef bint ebf16
    cdef int64_t ldx
    cdef const uint8_t[:, :, ::1] wp   # [ceil(D/16), D, 16 * 4 or 2] packed projection panels' bytes
    cdef const float[::1] bp           # [16 * ceil(D/16)] zero bias
    cdef const uint8_t[:, ::1] emb     # [vocab, D * 4 or 2] the token embedding's bytes
    cdef float inv                     # (the divisor 1 + E)
    cdef int64_t ccap
    cdef float *ebuf                   # [ccap, ldx] gathered rows
    cdef float *ybuf                   # [ccap, D] projections
    cdef float *pbuf                   # [ccap, E] GEMM packing scratch

    _window_class = LongcatWindow
    input_layer = True   # a token in, float32[hidden_size] out, no hidden (EngineBase's input-layer shape)

    def __cinit__(self, model, layer, int n_streams=1, rows=None):
        self._setup(model, layer, n_streams, ES_PREFILL_CHUNK, rows)

    def __dealloc__(self):
        free(self.ebuf); free(self.ybuf); free(self.pbuf)

    cdef int _init_variant(self, w) except -1:
        self.teamed = True  # _chunk splits its gather, GEMM and tails over the call's workers
        table = w.table
        if not isinstance(table, np.ndarray) or table.dtype not in (np.float32, _BF16):
            raise ValueError(f"layer {self.layer}: a float32 or bfloat16 table expected, got "
                             f"{type(table).__name__} {getattr(table, 'dtype', '')}")
        view(table, table.dtype, (self.src.nrows, self.hd), f"layer {self.layer} table")
        self.table_kind = 0 if table.dtype == np.float32 else 3
        self.ggtype = gather_type(self.src, self.hd, self.layer)
        if self.ggtype >= 0:  # a GGUFTier's rows: decoded in the gather, whatever the folder's table
            self.table_kind = 6
        elif self.src.rowbytes != self.hd * table.dtype.itemsize or self.src.scalebytes != 0:
            raise ValueError(f"layer {self.layer}: row records of {self.src.rowbytes}+{self.src.scalebytes} bytes "
                             f"do not fit a {table.dtype} table")
        wp, bp = w.packed()
        if wp.dtype.name not in ("float32", "bfloat16"):
            raise ValueError(f"layer {self.layer} packed weights: float32 or bfloat16, got {wp.dtype}")
        # a bf16 table's rows are bf16 values: the bf16 path's GEMM multiplies them on vdpbf16ps
        self.wbf16 = ((ES_GEMM_BF16_ROWS if self.table_kind == 3 else 1) if wp.dtype.name == "bfloat16" else 0)
        cdef int64_t P = (self.D + 15) // 16
        self.wp = view(wp.view(np.uint8), np.uint8, (P, self.E, 16 * wp.dtype.itemsize),
                       f"layer {self.layer} packed weights")
        self.bp = view(bp, np.float32, (P * 16,), f"layer {self.layer} packed bias")
        emb = w.embed
        if not isinstance(emb, np.ndarray) or emb.dtype not in (np.float32, _BF16):
            raise ValueError(f"layer {self.layer}: a float32 or bfloat16 token embedding expected")
        self.ebf16 = emb.dtype == _BF16
        self.emb = view(emb.view(np.uint8), np.uint8, (self.vocab, self.D * emb.dtype.itemsize),
                        f"layer {self.layer} token embedding")
        self.inv = <float> (1 + self.H)
        self.ldx = self.E + 16
        self._grow_chunk(self.n_streams, 1)
        return 0

    cdef int _grow_chunk(self, int64_t nb, int threads) except -1:
        if nb <= self.ccap:
            return 0
        self.ebuf = <float *> _regrow(self.ebuf, nb * self.ldx * sizeof(float))
        self.ybuf = <float *> _regrow(self.ybuf, nb * self.D * sizeof(float))
        self.pbuf = <float *> _regrow(self.pbuf, nb * self.E * sizeof(float))
        self.ccap = nb
        return 0

    def __repr__(self):
        return (f"{type(self).__name__}(layer={self.layer}, n_streams={self.n_streams}, D={self.D}, "
                f"embedders={self.H}x{self.hd}, isa={self.isa!r})")

    cdef void _work(self, ChunkWork *w, int64_t t0, float *dst, int64_t ld, void *out) noexcept nogil:
        w.g.dp, w.g.sp, w.g.e, w.g.lde, w.g.lut = self.dp, NULL, dst, ld, NULL
        w.g.kind, w.g.ggtype, w.g.hd, w.g.H, w.D = self.table_kind, self.ggtype, self.hd, self.H, self.D
        w.y, w.ids, w.emb, w.embld = self.ybuf, self.batch.ids + t0, &self.emb[0, 0], self.emb.shape[1]
        w.ebf16, w.obf, w.inv, w.out = self.ebf16, self.obf, self.inv, out

    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil:
        cdef ChunkWork w
        self._work(&w, 0, dst, ld, NULL)
        es_split(NULL, threads if nb >= 32 else 1, nb, 0, es_records_job_run, &w.g)

    cdef void _chunk(self, int64_t t0, int64_t nb, const void *hid, void *out, int threads) noexcept nogil:
        """Tokens [t0, t0+nb): rows gathered, one GEMM, then (y + embed[id]) / (1 + E), into
        ybuf and then out (float32, or rounded to bfloat16 where out is: self.obf). Every token
        is independent of the others (no state but the windows): each part splits over the
        call's workers, one stream's GEMV too (in whole GEMV runs: the same bits)."""
        cdef ChunkWork w
        self._work(&w, t0, self.ebuf, self.ldx, out)
        if threads > 1:
            self._team_open(threads)
        cdef es_team *team = <es_team *> self.team
        # a bf16 table's records go to the pairs GEMM as they are (es_gemm_records_mt; else gathered to float32)
        if self.table_kind != 3 or not es_gemm_records_mt(self.dp, self.H, self.hd, nb, &self.wp[0, 0, 0], self.wbf16,
                                                          &self.bp[0], self.D, self.ybuf, self.pbuf, threads, team):
            es_split(team, threads, nb, 0, es_records_job_run, &w.g)
            es_gemm_packed_mt(self.ebuf, self.ldx, nb, self.E, &self.wp[0, 0, 0], self.wbf16, &self.bp[0], self.D,
                              self.ybuf, self.pbuf, threads, team)
        es_split(team, threads, nb, 0, _tail_part, &w)


cdef inline float _bf16(uint16_t b) noexcept nogil:
    """A bfloat16's value: its bits are a float32's top half."""
    cdef uint32_t u = (<uint32_t> b) << 16
    cdef float f
    memcpy(&f, &u, 4)
    return f
