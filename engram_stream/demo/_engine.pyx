# cython: language_level=3
"""StreamEngine: the demo variant's streaming engine (one Engram layer, O(1) per token).

The skeleton (calls, checks, hash windows, rows, pending batches, records, snapshots) is the
shared EngineBase (engine/_base.pyx). This subclass adds the demo module's parts: the fused
projection [Wk_0..Wk_G-1; Wv] as one skinny GEMM over pre-packed panels, the gate/value tail,
and the ShortConv state, a ring of the last conv_len normalized values x per stream.

This file is the one home of the ring's rules (DESIGN.md, "The streaming engine"): which slot
each tap reads, where x(t) goes, how pos advances, what reset, rollback and commit do. The C
headers only do stateless vector math on the pointers given here. Oracle: EngramModel.forward.
"""
import ml_dtypes
import numpy as np
cimport numpy as cnp
from libc.math cimport sqrt
from libc.stdint cimport int64_t, int8_t, uint8_t, uint16_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, memset

from engram_stream._consts cimport ES_MAX_KERNEL_SIZE, ES_PREFILL_CHUNK
from engram_stream._hash cimport es_isa_now, es_runtime_bind, es_runtime_of_process
from engram_stream.engine._base cimport (ES_GEMM_BF16_ROWS, es_gemm_packed_mt, es_gemm_records_mt, es_records_job,
                                         es_records_job_run, es_split, es_team)
from engram_stream.engine.args import view
from engram_stream.rows.gguf import gather_type

cnp.import_array()

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

PREFILL_CHUNK = ES_PREFILL_CHUNK  # tokens per GEMM of a call (include/engram_consts.h)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_EMPTY_F32 = np.zeros(1, np.float32)


cdef inline void *_regrow(void *p, size_t nbytes) except NULL:
    cdef void *r = realloc(p, nbytes if nbytes else 1)
    if r == NULL:
        raise MemoryError(f"StreamEngine: scratch allocation of {nbytes} bytes failed")
    return r


def _fma_chains(int64_t rounds):
    """n rounds of the running path's register-only FMA chains (es_fma_chains, no GIL):
    returns the float multiply-adds done. bench/bench_step.py times it for the FMA peak."""
    cdef float sink = 0
    cdef int64_t done
    with nogil:
        done = es_fma_chains(rounds, &sink)
    return done


def _gemm(const float[:, ::1] X, wp, const float[::1] bias, int M, int wbf16):
    """Y = X W^T + bias through es_gemm_packed on the running path (one thread), W as model
    weights' packed() panels (float32 or bf16 [ceil(M/16), E, 16]); wbf16 as the engine sets it
    (0, 1, ES_GEMM_BF16_ROWS: X must then be bf16 values). The tests' window on the GEMM."""
    cdef int64_t B = X.shape[0]
    cdef int E = X.shape[1]
    cdef int64_t P = (M + 15) // 16
    wb = view(np.ascontiguousarray(wp).view(np.uint8), np.uint8, (P, E, 16 * wp.dtype.itemsize), "wp")
    cdef const uint8_t[:, :, ::1] w = wb
    if bias.shape[0] != P * 16 or B < 1 or E < 1:
        raise ValueError(f"_gemm: bias of {P * 16} floats and X of at least one row and column expected")
    y = np.empty((B, M), np.float32)
    xpack = np.empty(B * E, np.float32)
    cdef float[:, ::1] yv = y
    cdef float[::1] pv = xpack
    with nogil:
        es_gemm_packed(&X[0, 0], E, B, E, &w[0, 0, 0], wbf16, &bias[0], M, &yv[0, 0], &pv[0])
    return y



def _gemm_records(const uint16_t[:, ::1] table, const int64_t[:, ::1] rows, wp, const float[::1] bias, int M,
                  int threads):
    """Y through es_gemm_records_mt: row b = the table rows rows[b, :] side by side (bf16 bits
    [R, hd], so E = H*hd), bf16 panels wp, on `threads` threads, the pairs packed straight from
    the table rows; None where the running path's GEMM is not the pairs one (the engine then
    gathers to float32). The tests hold it to _gemm on the widened rows."""
    cdef int64_t B = rows.shape[0], i, j
    cdef int H = rows.shape[1], hd = table.shape[1]
    cdef int E = H * hd
    cdef int64_t P = (M + 15) // 16
    wb = view(np.ascontiguousarray(wp).view(np.uint8), np.uint8, (P, E, 2 * 16), "wp")
    cdef const uint8_t[:, :, ::1] w = wb
    if bias.shape[0] != P * 16 or B < 1 or E < 1:
        raise ValueError(f"_gemm_records: bias of {P * 16} floats and at least one row of records expected")
    for i in range(B):
        for j in range(H):
            if not 0 <= rows[i, j] < table.shape[0]:
                raise ValueError(f"_gemm_records: rows[{i}, {j}] = {rows[i, j]} is not a row of the {table.shape[0]}")
    dpa = np.empty(B * H, np.uintp)
    cdef size_t[::1] dpv = dpa
    for i in range(B):
        for j in range(H):
            dpv[i * H + j] = <size_t> &table[rows[i, j], 0]
    y = np.empty((B, M), np.float32)
    xpack = np.empty(B * E, np.float32)
    cdef float[:, ::1] yv = y
    cdef float[::1] pv = xpack
    cdef int done
    with nogil:
        done = es_gemm_records_mt(<const char **> &dpv[0], H, hd, B, &w[0, 0, 0], ES_GEMM_BF16_ROWS, &bias[0], M,
                                  &yv[0, 0], &pv[0], threads, NULL)
    return y if done else None


def _bfdot(acc, a, b):
    """acc[i] + a[i, 0]*b[i, 0] + a[i, 1]*b[i, 1] as this CPU's BFDOT computes it (ARMv8.6 FEAT_BF16:
    each addition rounded to odd, denormals flushed; engram_bfdot.h): acc float32 [n], a and b
    bf16 bits [n, 2]. RuntimeError where the CPU lacks it. The tests' window on the instruction."""
    cdef float[::1] r = np.array(acc, np.float32)
    cdef const uint16_t[:, ::1] av = np.ascontiguousarray(a, np.uint16)
    cdef const uint16_t[:, ::1] bv = np.ascontiguousarray(b, np.uint16)
    if av.shape[0] != r.shape[0] or bv.shape[0] != r.shape[0] or av.shape[1] != 2 or bv.shape[1] != 2:
        raise ValueError(f"_bfdot: a and b of shape ({r.shape[0]}, 2) expected")
    if r.shape[0] and es_bfdot(&r[0], &av[0, 0], &bv[0, 0], r.shape[0]) != 0:
        raise RuntimeError("_bfdot: this CPU lacks BFDOT (FEAT_BF16): run on the neon_bf16 path's CPUs")
    return np.asarray(r)


cdef class StreamEngine(EngineBase):
    """The demo variant's streaming engine of one layer: `model.stream(layer, n_streams)`.
    Calls: see EngineBase (step, prefill, step_packed/commit, feed/compute, reset, snapshot).
    Negative ids pass through uncompressed (as in the reference); masked positions of
    step_packed are no tokens (EngineBase: no part in the hash windows or the conv rings,
    output 0)."""

    def __cinit__(self, model, layer, int n_streams=1, rows=None):
        self._setup(model, layer, n_streams, ES_PREFILL_CHUNK, rows)

    def __dealloc__(self):
        free(self.ebuf); free(self.ybuf); free(self.pbuf); free(self.xbuf); free(self.gbuf)
        free(self.taps); free(self.xdst)

    cdef int _init_variant(self, w) except -1:
        cfg = self.model.cfg
        self.K, self.conv_len = cfg.kernel_size, cfg.conv_len
        self.teamed = True  # _chunk runs its gather, GEMM and tails on the call's workers (started
                            # by step, step_packed of decode steps, or _chunk's first split)
        self.ldx = self.E + 16
        if self.K > ES_MAX_KERNEL_SIZE:  # EngramConfig refuses these already
            raise ValueError(f"kernel_size <= {ES_MAX_KERNEL_SIZE} is what the engine supports")
        cdef int64_t P = (self.M + 15) // 16
        wp, bp, cw = w.packed()
        table = w.table
        lut = getattr(w, "table_lut", None)
        self.lut = _EMPTY_F32
        if lut is not None:  # qwen3.8-flash-next's FP8 / NVFP4 tables: codes, and the value of each code
            nv = w.table_scale is not None
            view(table, np.uint8, (self.src.nrows, self.hd // 2 if nv else self.hd), f"layer {self.layer} table")
            self.lut = view(lut, np.float32, (4096 if nv else 256,), f"layer {self.layer} table_lut")
            self.table_kind = 5 if nv else 4
            rowbytes = self.hd // 2 if nv else self.hd
            scalebytes = self.hd // 16 if nv else 0
        else:
            if not isinstance(table, np.ndarray) or table.dtype not in (np.float32, np.float16, np.int8, _BF16):
                raise ValueError(f"layer {self.layer}: unsupported table {type(table).__name__} "
                                 f"{getattr(table, 'dtype', '')}")
            view(table, table.dtype, (self.src.nrows, self.hd), f"layer {self.layer} table")
            # gather kinds (engram_step.h es_gather_job): bfloat16 tables are qwen3.8-flash-next's (the demo's
            # files hold float32, float16 or int8)
            self.table_kind = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int8): 2, _BF16: 3}[table.dtype]
            if self.table_kind == 2 and w.table_scale is None:
                raise ValueError(f"layer {self.layer}: an int8 table needs its per-row table_scale")
            rowbytes, scalebytes = self.hd * table.dtype.itemsize, (4 if self.table_kind == 2 else 0)
        self.ggtype = gather_type(self.src, self.hd, self.layer)
        if self.ggtype >= 0:  # a GGUF table's rows (GGUFTier): decoded in the gather, whatever the folder's table
            self.table_kind = 6
        elif self.src.rowbytes != rowbytes or self.src.scalebytes != scalebytes:
            raise ValueError(f"layer {self.layer}: row records of {self.src.rowbytes}+{self.src.scalebytes} bytes "
                             f"do not fit a {table.dtype} table")
        if wp.dtype.name not in ("float32", "bfloat16"):
            raise ValueError(f"layer {self.layer} packed weights: float32 or bfloat16, got {wp.dtype}")
        # the GEMM widens bf16 panels in registers; with a bf16 table the rows are bf16 values too, and
        # the bf16 path's GEMM multiplies the pairs on vdpbf16ps (engram_step.h es_gemm_mode)
        self.wbf16 = ((ES_GEMM_BF16_ROWS if self.table_kind == 3 else 1) if wp.dtype.name == "bfloat16" else 0)
        self.wp = view(wp.view(np.uint8), np.uint8, (P, self.E, 16 * wp.dtype.itemsize),
                       f"layer {self.layer} packed weights")
        self.bp = view(bp, np.float32, (P * 16,), f"layer {self.layer} packed bias")
        self.cw = view(cw, np.float32, (self.K, self.C), f"layer {self.layer} conv taps")
        self.n1 = view(w.norm1, np.float32, (self.G, self.D), f"layer {self.layer} norm1")
        self.n2 = view(w.norm2, np.float32, (self.G, self.D), f"layer {self.layer} norm2")
        self.n3 = view(w.conv_norm, np.float32, (self.G, self.D), f"layer {self.layer} conv_norm")
        self.tp.G, self.tp.D, self.tp.K = self.G, self.D, self.K
        self.tp.inv_sqrt_d = <float> (1.0 / sqrt(<double> self.D))
        self.tp.eps_qk, self.tp.eps_conv = w.eps_qk, w.eps_conv  # the variant's (weights carry them)
        self.tp.n1 = &self.n1[0, 0]
        self.tp.n2 = &self.n2[0, 0]
        self.tp.n3 = &self.n3[0, 0]
        self.tp.cw = &self.cw[0, 0]
        cdef int64_t S = self.n_streams
        self.conv_state = np.zeros((S, self.conv_len, self.C), dtype=np.float32)
        self.pos = np.zeros(S, dtype=np.int64)
        self.undo_ring = np.empty((S, self.conv_len, self.C), dtype=np.float32)
        self.undo_pos = np.empty(S, dtype=np.int64)
        self.xsave = np.empty((0, self.C), dtype=np.float32)
        self._grow_chunk(S, 1)  # nothing sized from the config goes on the C stack
        return 0

    cdef int _grow_chunk(self, int64_t nb, int threads) except -1:
        if nb <= self.ccap:
            return 0
        self.ebuf = <float *> _regrow(self.ebuf, nb * self.ldx * sizeof(float))
        self.ybuf = <float *> _regrow(self.ybuf, nb * self.M * sizeof(float))
        self.pbuf = <float *> _regrow(self.pbuf, nb * self.E * sizeof(float))
        self.xbuf = <float *> _regrow(self.xbuf, nb * self.C * sizeof(float))
        self.gbuf = <float *> _regrow(self.gbuf, nb * self.G * sizeof(float))
        self.taps = <const float **> _regrow(self.taps, nb * max(self.K - 1, 1) * sizeof(float *))
        self.xdst = <float **> _regrow(self.xdst, nb * sizeof(float *))
        self.ccap = nb
        return 0

    def __repr__(self):
        return (f"{type(self).__name__}(layer={self.layer}, n_streams={self.n_streams}, G={self.G}, D={self.D}, "
                f"H={self.H}x{self.hd}, conv_len={self.conv_len}, isa={self.isa!r})")

    # ---- a chunk: gather, GEMM, tails and the ring --------------------------------------------
    cdef void _chunk(self, int64_t t0, int64_t nb, const void *hid, void *out, int threads) noexcept nogil:
        """Tokens [t0, t0+nb) of the pending batch: their rows gathered, one GEMM, the tails.

        The ring: conv_state[s] holds the last conv_len = (K-1)*dil values x of stream s (dil =
        max_ngram_size); slot pos[s] holds the oldest, x(t - conv_len), and slot (pos - j) mod
        conv_len holds x(t - j). Tap i < K-1 of a token reads x(t - d), d = (K-1-i)*dil; tap K-1
        is x(t) itself. The chunk's tokens come in pieces, runs of one stream (a segment, or
        the part of it in this chunk). Token j of a piece reads x(t - d) from the xbuf row of
        token j - d when that token is in the piece, else from ring slot (pos + j - d) mod
        conv_len (written before the piece). A chunk of one-token pieces (decode steps) writes
        each x(t) straight over the oldest slot (tap 0 reads it first: es_tail_y reads every
        element before writing it); otherwise the tails run chained (every x first) and the
        last min(len, conv_len) x of each piece go to their slots (pos + j) mod conv_len after.
        pos then advances by the piece's length."""
        cdef es_records_job g
        cdef int64_t L = self.conv_len, j, c, c0, d, s, p, plen
        cdef int k1 = self.K - 1, kk
        cdef bint chained = False
        cdef int gthreads, mthreads
        g.dp, g.sp, g.e, g.lde = self.dp, self.sp, self.ebuf, self.ldx
        g.kind, g.hd, g.H, g.lut, g.ggtype = self.table_kind, self.hd, self.H, &self.lut[0], self.ggtype
        if nb >= 8:  # the tails split at least: the call's workers start here unless they run already
            self._team_open(threads)
        gthreads = threads if (nb >= 32 or self.team != NULL) else 1
        c = 0  # the taps, piece by piece (they read the ring as it is before this chunk)
        while c < nb:
            s, c0 = self.batch.stream[t0 + c], c
            while c < nb and self.batch.stream[t0 + c] == s:
                c += 1
            plen = c - c0
            chained = chained or plen > 1
            if L:
                p = self.pos[s]
                for j in range(plen):
                    for kk in range(k1):
                        d = (k1 - kk) * self.n
                        self.taps[(c0 + j) * k1 + kk] = (self.xbuf + (c0 + j - d) * self.C if j >= d else
                                                         &self.conv_state[s, (p + j - d + L) % L, 0])
                    self.xdst[c0 + j] = &self.conv_state[s, p, 0]
        if not chained and nb >= 2:  # decode steps of several streams: the GEMM and the tails split
            self._team_open(threads)
        mthreads = threads if (not chained or nb >= 32) else 1
        # a bf16 table's records go to the pairs GEMM as they are (es_gemm_records_mt; else gathered to float32)
        if self.table_kind != 3 or not es_gemm_records_mt(self.dp, self.H, self.hd, nb, &self.wp[0, 0, 0], self.wbf16,
                                                          &self.bp[0], self.M, self.ybuf, self.pbuf, mthreads,
                                                          <es_team *> self.team):
            es_split(<es_team *> self.team, gthreads, nb, 0, es_records_job_run, &g)
            es_gemm_packed_mt(self.ebuf, self.ldx, nb, self.E, &self.wp[0, 0, 0], self.wbf16, &self.bp[0], self.M,
                              self.ybuf, self.pbuf, mthreads, <es_team *> self.team)
        es_tails_mt(&self.tp, nb, self.ybuf, self.M, hid, self.hbf, out, self.obf, self.xbuf, self.gbuf, self.taps,
                    NULL if (chained or not L) else self.xdst, chained,
                    threads if (nb >= 8 or (not chained and nb >= 2)) else 1, <es_team *> self.team)
        c = 0  # the rings move (a draft first keeps the x a later token of its call overwrites)
        while c < nb:
            s, c0 = self.batch.stream[t0 + c], c
            while c < nb and self.batch.stream[t0 + c] == s:
                c += 1
            plen = c - c0
            if self.xsaving:
                self._save_x(t0, c0, plen)
            if L:
                p = self.pos[s]
                if chained:
                    for j in range(max(0, plen - L), plen):
                        memcpy(&self.conv_state[s, (p + j) % L, 0], self.xbuf + (c0 + j) * self.C,
                               self.C * sizeof(float))
                self.pos[s] = (p + plen) % L

    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil:
        cdef es_records_job g
        g.dp, g.sp, g.e, g.lde = self.dp, self.sp, dst, ld
        g.kind, g.hd, g.H, g.lut, g.ggtype = self.table_kind, self.hd, self.H, &self.lut[0], self.ggtype
        es_split(NULL, threads if nb >= 32 else 1, nb, 0, es_records_job_run, &g)

    cdef void _save_x(self, int64_t t0, int64_t c0, int64_t plen) noexcept nogil:
        """Draft: of the chunk's piece [c0, c0+plen), the tokens whose ring slot a later token of
        the same segment overwrites (in-segment position + conv_len < its length) keep x(t)."""
        cdef int64_t i0 = t0 + c0, k = self.batch.slot_seg[self.batch.stream[i0]], j
        for j in range(plen):
            if i0 + j - self.batch.seg_start[k] + self.conv_len < self.batch.seg_len[k]:
                memcpy(&self.xsave[i0 + j, 0], self.xbuf + (c0 + j) * self.C, self.C * sizeof(float))

    # ---- the ring's undo state, rollback and commit -----------------------------------------------
    cdef int _keep_undo_extra(self, bint draft, bint needed) except -1:
        """Before the call (when it is a draft or its reads can fail): each segment's ring slots
        it will overwrite (the first min(len, conv_len) from pos) and pos. A draft whose segment
        is longer than the ring also keeps the x its later tokens overwrite (_save_x), so commit
        can put back any prefix."""
        cdef int64_t k, i, s, L = self.conv_len
        self.ring_kept = self.xsaving = False
        if not needed:
            return 0
        for k in range(self.batch.nseg):
            s = self.batch.seg_stream[k]
            self.undo_pos[k] = self.pos[s]
            for i in range(min(self.batch.seg_len[k], L)):
                memcpy(&self.undo_ring[k, i, 0], &self.conv_state[s, (self.pos[s] + i) % L, 0], self.C * sizeof(float))
            if draft and self.batch.seg_len[k] > L:
                self.xsaving = True
        if self.xsaving and self.xsave.shape[0] < self.batch.cap:
            self.xsave = np.empty((self.batch.cap, self.C), dtype=np.float32)
        self.ring_kept = True
        return 0

    cdef void _rollback_extra(self) noexcept nogil:
        cdef int64_t k, i, s, L = self.conv_len
        if not self.ring_kept:
            return
        for k in range(self.batch.nseg):
            s = self.batch.seg_stream[k]
            if L:
                for i in range(min(self.batch.seg_len[k], L)):
                    memcpy(&self.conv_state[s, (self.undo_pos[k] + i) % L, 0], &self.undo_ring[k, i, 0],
                           self.C * sizeof(float))
                self.pos[s] = self.undo_pos[k]
        self.ring_kept = False

    cdef void _commit_extra(self, int64_t k, int64_t a) noexcept nogil:
        """Segment k's ring as if only its first a tokens were fed. Slot (pos0 + i) mod conv_len,
        i < min(len, conv_len), was written by tokens i, i + conv_len, ... of the segment; it must
        hold the x of the last of them before a (x_j: in the ring when j was its last writer of
        the call, else kept by _save_x), or its value before the call when none is."""
        cdef int64_t s = self.batch.seg_stream[k], L = self.conv_len, n = self.batch.seg_len[k], i, j, jl
        cdef int64_t p0
        if not L or not self.ring_kept:  # (a lookup_packed draft: the ring never moved)
            return
        p0 = self.undo_pos[k]
        for i in range(min(n, L)):
            jl = i + L * ((n - 1 - i) // L)   # the slot's last writer in the call
            if a <= i:
                memcpy(&self.conv_state[s, (p0 + i) % L, 0], &self.undo_ring[k, i, 0], self.C * sizeof(float))
            else:
                j = i + L * ((a - 1 - i) // L)
                if j != jl:
                    memcpy(&self.conv_state[s, (p0 + i) % L, 0], &self.xsave[self.batch.seg_start[k] + j, 0],
                           self.C * sizeof(float))
        self.pos[s] = (p0 + a) % L

    cdef void _reset_extra(self, int64_t s) noexcept nogil:
        """x before t = 0 is 0: the ring zeroed, pos at slot 0."""
        cdef int64_t j, c
        for j in range(self.conv_len):
            for c in range(self.C):
                self.conv_state[s, j, c] = 0
        self.pos[s] = 0

    def _extra_state(self):
        return {"ring": np.array(self.conv_state, copy=True), "pos": np.array(self.pos, copy=True)}

    def _extra_expected(self):
        S = self.n_streams
        return (("ring", (S, self.conv_len, self.C), np.float32), ("pos", (S,), np.int64))

    def _check_extra(self, parts):
        pos = parts["pos"]
        if self.conv_len and pos.size and (pos.min() < 0 or pos.max() >= self.conv_len):
            raise ValueError("snapshot.pos is damaged: ring positions out of range")

    def _put_extra(self, parts):
        cdef float[:, :, ::1] ring = parts["ring"]
        cdef int64_t[::1] pos = parts["pos"]
        self.conv_state[:, :, :] = ring
        self.pos[:] = pos
        self.ring_kept = False
