# cython: language_level=3
"""V41StreamEngine: the deepseek-v4.1 variant's streaming engine (DESIGN.md 4).

The skeleton (calls, checks, hash windows, rows, pending batches, records, snapshots) is the
shared EngineBase (engine/_base.pyx). This file adds V4.1's history rule, DeadWindow (the
DEAD rule, DESIGN.md 4.4), and V4.1's parts of a step: per
chunk it gathers the H float8 rows (e4m3 x e8m0, dequantized), quantizes them per 32 values as
the reference does, runs the float8 wkv projection with its 32x32 block scales straight from the
checkpoint's bytes (include/engram_fp8.h), then the gate; without the GIL and with no allocation
when `out=` is given. Oracle: EngramModel.forward (engram_stream.v41.reference).
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport INT32_MAX, int64_t, uint8_t, uint16_t, uint64_t
from libc.string cimport memcpy

from engram_stream._hash cimport es_isa_now, es_runtime_bind, es_runtime_of_process
from engram_stream.engine import args
from engram_stream.engine import isa as _isa
from engram_stream.engine.args import view
from engram_stream.rows.gguf import gather_type

cdef extern from "engram_gguf.h" nogil:
    int es_gg_decode(int type, const uint8_t *src, int64_t n, float *dst)

cnp.import_array()

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)


PREFILL_CHUNK = ES8_PREFILL_CHUNK  # prompt tokens per projection in prefill(): wkv is widened once per chunk

cdef struct TokenWork:
    # what the per-token work of a chunk reads and writes (es_split's ctx)
    const char **dp        # [n, H] each row's e4m3 bytes
    const char **sp        # [n, H] and its e8m0 scales
    float *q               # [n, ldq]
    float *s               # [n, E/32]
    const float *y         # [n, M]
    const char *hid        # [n, G, D] float32, or bfloat16 where hbf
    char *out              # [n, G, D] float32, or bfloat16 where obf
    int hbf, obf
    const float *qw
    const float *kw
    const int64_t *ids     # [n] the tokens' ids: the DEAD one's gate is 0
    int64_t dead_id
    int hd, H, E, G, D, M
    int ggtype             # >= 0: the rows are GGUF rows of this type (include/engram_gguf.h), sp unused
    int64_t ldq
    float eps


cdef void _prep_part(void *ctx, int64_t i0, int64_t i1) noexcept nogil:
    """Tokens [i0, i1): rows gathered (dequantized, from whichever record the row source gave),
    then quantized in place per 32 values as the reference's wkv input."""
    cdef TokenWork *w = <TokenWork *> ctx
    cdef int64_t i, zero = 0
    cdef int j
    for i in range(i0, i1):
        for j in range(w.H):
            if w.ggtype >= 0:
                es_gg_decode(w.ggtype, <const uint8_t *> w.dp[i * w.H + j], w.hd, w.q + i * w.ldq + j * w.hd)
            else:
                es8_gather(<const uint8_t *> w.dp[i * w.H + j], <const uint8_t *> w.sp[i * w.H + j], w.hd, &zero,
                           1, w.q + i * w.ldq + j * w.hd)
        es8_act_quant(w.q + i * w.ldq, w.E, w.q + i * w.ldq, w.s + i * (w.E // ES8_BLOCK))


cdef void _tail_part(void *ctx, int64_t i0, int64_t i1) noexcept nogil:
    """Tokens [i0, i1): the gate times the value, from their projections."""
    cdef TokenWork *w = <TokenWork *> ctx
    cdef int64_t i, C = <int64_t> w.G * w.D, hb = 2 if w.hbf else 4, ob = 2 if w.obf else 4
    for i in range(i0, i1):
        es8_gate_tail(w.y + i * w.M, w.hid + i * C * hb, w.hbf, w.qw, w.kw, w.G, w.D, w.eps,
                      w.ids[i] == w.dead_id, w.out + i * C * ob, w.obf)


cdef _check_dims(int64_t M, int64_t E, m_name, e_name):
    """The float8 kernels' size limits: the many-token tile scatters 16 tokens at int32
    offsets t * M, and the one-token path keeps E scaled values on the stack."""
    if 16 * M > INT32_MAX:
        raise ValueError(f"{m_name} = {M} is too large for the V4.1 engine (at most {INT32_MAX // 16})")
    if E > ES8_MAX_E:
        raise ValueError(f"{e_name} = {E} is too large for the V4.1 engine (at most {ES8_MAX_E})")


cdef class DeadWindow(HashWindow):
    """V4.1's hash windows (HashPlan.history "dead", DESIGN.md 4.4): the image token id and
    negative ids are DEAD, entry -1; a slot before the start is DEAD too. The first DEAD entry of
    a window turns itself and every older one into pad (rule), so the rule is re-derived from the
    window at every token and a snapshot holds nothing else. The hash is the default."""

    def __cinit__(self, *args, **kwargs):
        self.history = "dead"

    cdef int _init_rule(self, plan) except -1:
        self.dead_id = plan.cfg.image_token_id
        self.start = -1
        return 0

    cdef int64_t entry(self, int64_t token) noexcept nogil:
        if token < 0 or token == self.dead_id:
            return -1
        return HashWindow.entry(self, token)

    cdef void rule(self, const int64_t *full, int64_t *win) noexcept nogil:
        """full[k]: the entry at t-k, negative when DEAD; the first DEAD one and every older read pad."""
        cdef bint blocked = False
        cdef int k
        for k in range(self.n):
            blocked = blocked or full[k] < 0
            win[k] = self.pad if blocked else full[k]


cdef class V41StreamEngine(EngineBase):
    """The deepseek-v4.1 streaming engine of one layer: `model.stream(layer, n_streams)`.
    Calls: see EngineBase (step, prefill, step_packed/commit, feed/compute, reset, snapshot).

    Returns the Engram delta gate * value (the caller adds h). The image token id is DEAD (gate
    0, blocks history), negative ids block history too; masked positions of step_packed are no
    tokens (EngineBase: skipped, output 0). Per stream it keeps only the window (newest first:
    compressed ids, -1 = DEAD; slots before the start are DEAD): the rule is re-derived from it
    at every token.
    """

    def __cinit__(self, model, layer, int n_streams=1, rows=None):
        if getattr(model.cfg, "image_token_id", None) is None:   # a config of another variant
            raise ValueError(f"V41StreamEngine needs a deepseek-v4.1 model, got variant {model.cfg.variant!r}")
        self._setup(model, layer, n_streams, ES8_PREFILL_CHUNK, rows)

    _window_class = DeadWindow

    cdef int _init_variant(self, w) except -1:
        cfg = self.model.cfg
        self.eps = cfg.norm_eps
        self.dead_id = cfg.image_token_id
        if self.hd % ES8_BLOCK or self.E % ES8_BLOCK:
            raise ValueError(f"head_dim must be a multiple of {ES8_BLOCK}")
        _check_dims(self.M, self.E, "(hc_mult+1)*hidden_size", "engram_dim")
        self.ggtype = gather_type(self.src, self.hd, self.layer)  # GGUF rows (GGUFTier): decoded in the gather
        if self.ggtype < 0 and (self.src.rowbytes != self.hd or self.src.scalebytes != self.hd // ES8_BLOCK):
            raise ValueError(f"layer {self.layer}: row records of {self.src.rowbytes}+{self.src.scalebytes} bytes "
                             f"are not float8 rows of {self.hd} values")
        B = ES8_BLOCK
        self.ww = view(w.wkv_weight, np.uint8, (self.M, self.E), f"layer {self.layer} wkv_weight")
        self.ws = view(w.wkv_scale, np.uint8, ((self.M + B - 1) // B, self.E // B), f"layer {self.layer} wkv_scale")
        self.qw = view(w.q_weight, np.float32, (self.G, self.D), f"layer {self.layer} q_weight")
        self.kw = view(w.k_weight, np.float32, (self.G, self.D), f"layer {self.layer} k_weight")
        _isa.warn_if_slower_than_cpu("the DeepSeek-V4.1 engine")
        self.teamed = True  # _chunk runs its gather, projection and tails on the call's workers
        self._grow_chunk(self.n_streams, 1)
        return 0

    cdef int _grow_chunk(self, int64_t nb, int threads) except -1:
        """Scratch for chunks of nb tokens on `threads` threads; made before any state changes."""
        cdef int64_t nw
        if nb > self.qcap:
            self.qbuf = np.empty((nb, es8_ldq(self.E)), dtype=np.float32)
            self.sbuf = np.empty((nb, self.E // ES8_BLOCK), dtype=np.float32)
            self.ybuf = np.empty((nb, self.M), dtype=np.float32)
            self.qcap = nb
        if nb > 1:
            nw = es8_scratch_floats(nb, self.E, threads)
            if nw > self.wscr_n:
                self.wscr = np.empty(nw, dtype=np.float32)
                self.wscr_n = nw
        return 0

    def __repr__(self):
        return (f"V41StreamEngine(layer={self.layer}, n_streams={self.n_streams}, G={self.G}, D={self.D}, "
                f"H={self.H}x{self.hd}, isa={self.isa!r})")

    cdef void _tokens(self, es_range_fn fn, int64_t t0, const void *hid, void *out, int64_t n,
                      int threads) noexcept nogil:
        """fn (_prep_part or _tail_part) over the chunk's tokens [0, n), split over the call's workers."""
        cdef TokenWork w
        w.dp, w.sp = self.dp, self.sp
        w.q, w.s, w.y = &self.qbuf[0, 0], &self.sbuf[0, 0], &self.ybuf[0, 0]
        w.hid, w.out, w.qw, w.kw = <const char *> hid, <char *> out, &self.qw[0, 0], &self.kw[0, 0]
        w.hbf, w.obf = self.hbf, self.obf
        w.ids, w.dead_id = self.batch.ids + t0, self.dead_id
        w.hd, w.H, w.E, w.G, w.D, w.M, w.eps = self.hd, self.H, self.E, self.G, self.D, self.M, self.eps
        w.ggtype = self.ggtype
        w.ldq = self.qbuf.shape[1]
        es_split(<es_team *> self.team, threads, n, 0, fn, &w)

    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil:
        cdef int64_t i, zero = 0
        cdef int j
        for i in range(nb):
            for j in range(self.H):
                if self.ggtype >= 0:
                    es_gg_decode(self.ggtype, <const uint8_t *> self.dp[i * self.H + j], self.hd,
                                 dst + i * ld + j * self.hd)
                else:
                    es8_gather(<const uint8_t *> self.dp[i * self.H + j], <const uint8_t *> self.sp[i * self.H + j],
                               self.hd, &zero, 1, dst + i * ld + j * self.hd)

    cdef void _chunk(self, int64_t t0, int64_t nb, const void *hid, void *out, int threads) noexcept nogil:
        """Tokens [t0, t0+nb): rows gathered and quantized, the float8 projection (wkv read once
        for the chunk), the gate tails, each split over the call's kept workers (engram_team.h:
        none started per split, each start a thread's creation and its stack's mapping). No state
        of its own moves here."""
        cdef float *scratch = &self.wscr[0] if self.wscr_n else NULL
        if threads > 1:
            self._team_open(threads)
        self._tokens(_prep_part, t0, NULL, NULL, nb, threads)
        es8_wkv_mt(&self.qbuf[0, 0], self.qbuf.shape[1], nb, self.E, &self.ww[0, 0], &self.ws[0, 0],
                   self.M, &self.ybuf[0, 0], threads, scratch if nb > 1 else NULL, <es_team *> self.team)
        self._tokens(_tail_part, t0, hid, out, nb, threads)



# ---- the kernels alone, for tests and benchmarks ------------------------------------------

ctypedef float (*_byte_decoder)(uint8_t b) noexcept nogil


cdef object _decoded(const uint8_t[::1] raw, _byte_decoder decode):
    """float32[len(raw)]: decode applied to every byte."""
    out = np.empty(raw.shape[0], dtype=np.float32)
    cdef float[::1] o = out
    cdef Py_ssize_t i
    for i in range(raw.shape[0]):
        o[i] = decode(raw[i])
    return out


def decode_e4m3(const uint8_t[::1] raw):
    """float32 values of float8_e4m3fn bytes (the kernels' scalar decoder)."""
    return _decoded(raw, es8_e4m3)


def decode_e8m0(const uint8_t[::1] raw):
    """float32 values of float8_e8m0fnu bytes: 2**(byte - 127)."""
    return _decoded(raw, es8_e8m0)


def gather_rows(const uint8_t[:, ::1] weight, const uint8_t[:, ::1] scale, const int64_t[::1] rows):
    """float32[len(rows), head_dim]: table rows dequantized as a step gathers them (es8_gather)."""
    cdef int hd = weight.shape[1], n = rows.shape[0], i
    if hd % ES8_BLOCK or scale.shape[0] != weight.shape[0] or scale.shape[1] != hd // ES8_BLOCK:
        raise ValueError("gather_rows: shapes do not match")
    for i in range(n):
        if not 0 <= rows[i] < weight.shape[0]:
            raise IndexError(f"gather_rows: row {rows[i]} is not in [0, {weight.shape[0]})")
    e = np.empty((n, hd), dtype=np.float32)
    cdef float[:, ::1] ev = e
    if n and hd:
        es8_gather(&weight[0, 0], &scale[0, 0], hd, &rows[0], n, &ev[0, 0])
    return e


def act_quant(const float[:, ::1] x):
    """(q float32[S, K], scales float32[S, K/32]): the kernels' activation quantization
    (q: the e4m3 values, as the oracle's act_quant returns them)."""
    cdef Py_ssize_t S = x.shape[0], K = x.shape[1], t
    if K % ES8_BLOCK:
        raise ValueError(f"act_quant: the last axis must be a multiple of {ES8_BLOCK}")
    qx = np.empty((S, K), dtype=np.float32)
    s = np.empty((S, K // ES8_BLOCK), dtype=np.float32)
    cdef float[:, ::1] qv = qx, sv = s
    for t in range(S):
        if K:
            es8_act_quant(&x[t, 0], K, &qv[t, 0], &sv[t, 0])
    return qx / np.repeat(s, ES8_BLOCK, axis=1), s


def fp8_linear(const float[:, ::1] x, const uint8_t[:, ::1] weight, const uint8_t[:, ::1] scale,
               int threads=1, bint plain=False, cols=None):
    """x[S, K] through the float8 projection (weight e4m3 [M, K], scale e8m0 [ceil(M/32), K/32])
    as the engine runs it, on the running kernel path: float32[S, M]. plain: the plain scalar C
    loop instead (es8_wkv_plain: what the vector paths are measured against). cols (bf16 path):
    True or False runs 2 tokens or more on the columns tile or not, for this call (None: the
    engine's choice, es8_cols_for)."""
    global es8_cols_mode
    cdef Py_ssize_t S = x.shape[0], K = x.shape[1], M = weight.shape[0], t
    if K % ES8_BLOCK or weight.shape[1] != K or scale.shape[0] != (M + ES8_BLOCK - 1) // ES8_BLOCK \
            or scale.shape[1] != K // ES8_BLOCK or S < 1 or M < 1:
        raise ValueError("fp8_linear: shapes do not match")
    cdef int cmode = -1 if cols is None else (1 if cols else 0)
    _check_dims(M, K, "fp8_linear: weight rows", "fp8_linear: values per row of x")
    qx = np.empty((S, es8_ldq(<int> K)), dtype=np.float32)
    s = np.empty(K // ES8_BLOCK, dtype=np.float32)
    y = np.empty((S, M), dtype=np.float32)
    cdef float[:, ::1] qv = qx, yv = y
    cdef float[::1] sv = s
    threads = args.threads(threads, ES8_MAX_THREADS)
    cdef float[::1] scratch = np.empty(es8_scratch_floats(S, <int> K, threads), dtype=np.float32)
    with nogil:
        for t in range(S):
            es8_act_quant(&x[t, 0], <int> K, &qv[t, 0], &sv[0])
        if plain:
            es8_wkv_plain(&qv[0, 0], qv.shape[1], S, <int> K, &weight[0, 0], &scale[0, 0], <int> M, &yv[0, 0])
        else:
            es8_cols_mode = cmode
            es8_wkv_mt(&qv[0, 0], qv.shape[1], S, <int> K, &weight[0, 0], &scale[0, 0], <int> M, &yv[0, 0],
                       threads, &scratch[0], NULL)
            es8_cols_mode = -1
    return y

def dpbf16(acc, a, b, bint emulate=False):
    """vdpbf16ps lane by lane: acc float32[n] + the bf16 pairs of a and b (uint16 bits [n, 2]):
    the real instruction, or with emulate its emulation (es8_dpbf16_lane, what the tests hold the
    instruction and the bf16 path to). RuntimeError: the CPU lacks the instruction."""
    acc, a, b = (np.array(acc, dtype=np.float32).reshape(-1), np.ascontiguousarray(a, dtype=np.uint16),
                 np.ascontiguousarray(b, dtype=np.uint16))
    if a.shape != (acc.shape[0], 2) or b.shape != a.shape:
        raise ValueError(f"dpbf16: acc [n], a and b [n, 2] (got {acc.shape}, {a.shape}, {b.shape})")
    cdef float[::1] o = acc
    cdef const uint16_t[:, ::1] av = a
    cdef const uint16_t[:, ::1] bv = b
    cdef int64_t n = o.shape[0]
    cdef int rc = 0
    if n:
        with nogil:
            rc = es8_dpbf16(&o[0], &av[0, 0], &bv[0, 0], n, emulate)
    if rc:
        raise RuntimeError("dpbf16: this CPU lacks AVX512_BF16 (emulate=True runs the emulation)")
    return np.asarray(o)


def _mac_chains(int64_t rounds):
    """n rounds of the register-only multiply-add chains of the running path's projection
    (es8_mac_chains, no GIL: vdpbf16ps on bf16, else the FMA chains): the multiply-adds done.
    bench_v41.py's floor of the float8 projection."""
    cdef float sink = 0
    cdef int64_t done
    with nogil:
        done = es8_mac_chains(rounds, &sink)
    return done


def read_bytes(const uint8_t[::1] a):
    """Read every byte of `a` once (XOR of 64-byte lines): the memory-bandwidth floor of a step."""
    cdef uint64_t r = 0
    if a.shape[0]:
        with nogil:
            r = es8_read_bytes(&a[0], a.shape[0])
    return int(r)
