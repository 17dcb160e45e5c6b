"""The bf16 kernel path (include/engram_fp8.h, AVX512_BF16): vdpbf16ps itself, held to its
emulation es8_dpbf16_lane (the documented pair order, rounding and DAZ/FTZ), and the float8
projection on that path held to the numpy oracle and, where a product meets the DAZ/FTZ
bound, to the emulation.

The emulation's tests run on every CPU; the ones of the real instruction and of the bf16
path skip on a CPU (or build) without it, and the pytest header then says "bf16 not run".
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engram_stream.engine import isa as _isa
from engram_stream.v41 import _engine as k
from engram_stream.v41 import reference as ref
from helpers.isa import on_path
from helpers.numeric import ATOL, RTOL, bf16_bits as h, f32, f32_bits as bits, weight_panels as _panels

HAVE_BF16 = "bf16" in _isa.supported_isas()
needs_bf16 = pytest.mark.skipif(not HAVE_BF16, reason="this CPU (or build) lacks AVX512_BF16: the bf16 path did not run")
CODES = np.arange(256, dtype=np.uint8)


# (acc, a0, a1, b0, b1) -> the float32 bits the documented semantics give, worked out by hand:
# acc + a1*b1 rounded to nearest even, then + a0*b0 rounded; denormal inputs read 0; a
# denormal result of either step flushed to zero of its sign.
CASES = [
    ((1.0, h(2 ** -12), h(2 ** -12), h(2 ** -12), h(2 ** -12)), 0x3F800000),  # two half-ulps: two ties to even
    ((1.0, h(1.5 * 2 ** -12), h(2 ** -12), h(2 ** -12), h(2 ** -12)), 0x3F800001),  # odd pair first
    ((1.0, h(2 ** -12), h(1.5 * 2 ** -12), h(2 ** -12), h(2 ** -12)), 0x3F800002),  # swapped: another result
    ((0.0, 0x0040, 0, h(2.0 ** 100), 0), 0),                                      # a bf16 denormal factor: 0
    ((f32(0x00200000), h(2.0 ** -100), 0, h(2.0 ** -20), 0), 0x03800000),         # a denormal acc: 0
    ((0.0, h(2.0 ** -65), 0, h(2.0 ** -65), 0), 0),                               # a denormal result: +0
    ((0.0, h(-2.0 ** -65), 0, h(2.0 ** -65), 0), 0x80000000),                     # ... of its sign
    ((0.0, h(2.0 ** -63), h(2.0 ** -65), h(2.0 ** -63), h(2.0 ** -65)), 0x00800000),  # the first step flushed
    ((2.0 ** -120, h(2.0 ** -70), 0, h(2.0 ** -70), 0), 0x03800008),              # a tiny product is exact (fused)
    ((1.0, h(-1.0), h(2.0 ** -15), h(1.0), h(2.0 ** -15)), 0),                    # 1 + 2^-30 rounds to 1 first
    ((1.0, h(2.0 ** -15), h(-1.0), h(2.0 ** -15), h(1.0)), bits(2.0 ** -30)),     # cancels first
    ((2.0 ** 127, h(2.0 ** 127), 0, h(2.0), 0), 0x7F800000),                      # overflow: inf
    ((-0.0, 0x8000, 0x8000, 0, 0), 0x80000000),                                   # -0 + -0 + -0
    ((-0.0, 0, 0, 0, 0), 0),                                                      # -0 + +0: +0
]


@pytest.mark.parametrize("emulate", [True, pytest.param(False, marks=needs_bf16)])
def test_dpbf16_documented_cases(emulate):
    acc = np.array([c[0][0] for c in CASES], np.float32)
    a = np.array([[c[0][1], c[0][2]] for c in CASES], np.uint16)
    b = np.array([[c[0][3], c[0][4]] for c in CASES], np.uint16)
    got = k.dpbf16(acc, a, b, emulate=emulate).view(np.uint32)
    assert [hex(g) for g in got] == [hex(c[1]) for c in CASES]
    nan = k.dpbf16([0.0, 0.0], [[0x7FC0, 0], [0x7F80, 0]], [[h(1.0), 0], [0, 0]], emulate=emulate)
    assert np.isnan(nan).all()  # NaN in; inf * 0


def _random_operands(rng, n):
    """bf16 bits and accumulators over the whole range: denormals, zeros, infinities, NaN,
    and values near one another so that sums cancel and round."""
    a = rng.integers(0, 1 << 16, (n, 2), dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, (n, 2), dtype=np.uint32).astype(np.uint16)
    near = rng.integers(0x3F00, 0x4080, (n // 2, 2)).astype(np.uint16)  # 0.5 .. 4, signs mixed below
    a[: n // 2], b[: n // 2] = near ^ (rng.integers(0, 2, near.shape).astype(np.uint16) << 15), near[::-1]
    tiny = rng.integers(0, 0x0100, (n // 8, 2)).astype(np.uint16)  # denormal and least normal bf16
    a[n // 2:n // 2 + n // 8] = tiny
    acc = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    acc[: n // 2] = rng.standard_normal(n // 2).astype(np.float32) * 4
    acc[n // 2:n // 2 + n // 16] = (rng.integers(0, 1 << 23, n // 16) | (rng.integers(0, 2, n // 16) << 31)
                                    ).astype(np.uint32).view(np.float32)  # denormal accumulators
    return acc, a, b


@needs_bf16
def test_real_vdpbf16ps_equals_the_emulation():
    """On this CPU's vdpbf16ps: 400k random lanes (whole bit range, cancelling sums, denormals)
    give the emulation's bits (NaN where it gives NaN)."""
    rng = np.random.default_rng(29)
    acc, a, b = _random_operands(rng, 400_000)
    got, want = k.dpbf16(acc, a, b), k.dpbf16(acc, a, b, emulate=True)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert nan.mean() < 0.02 and (want[~nan] == 0).any()


def test_emulation_is_fused_and_rounds_each_step():
    """Against float64 (exact for these: products of 8-bit significands, sums within 53 bits):
    normal operands and results give fl32(fl32(acc + a1*b1) + a0*b0)."""
    rng = np.random.default_rng(3)
    n = 20_000
    a = (rng.integers(0x3C00, 0x4300, (n, 2)) | (rng.integers(0, 2, (n, 2)) << 15)).astype(np.uint16)
    b = rng.integers(0x3C00, 0x4300, (n, 2)).astype(np.uint16)
    acc = rng.standard_normal(n).astype(np.float32)
    fa, fb = ((x.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for x in (a, b))
    want = (acc.astype(np.float64) + fa[:, 1] * fb[:, 1]).astype(np.float32)
    want = (want.astype(np.float64) + fa[:, 0] * fb[:, 0]).astype(np.float32)
    assert np.array_equal(k.dpbf16(acc, a, b, emulate=True).view(np.uint32), want.view(np.uint32))


@pytest.fixture
def on_bf16():
    with on_path("bf16"):
        yield


def _flush(x):
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


@needs_bf16
@pytest.mark.parametrize("tokens, K, cols", [(1, 64, None), (4, 64, None), (64, 64, None), (9, 288, None),
                                             (16, 288, None), (17, 288, None), (4, 64, True), (16, 288, True),
                                             (17, 288, True), (16, 288, False), (17, 288, False)])
def test_bf16_projection_reads_every_code_exactly(on_bf16, tokens, K, cols):
    """One-hot activations read single weights back: all 256 codes (zeros, subnormals, +-448,
    the NaN codes read NaN as the oracle), block scales 2^-127 .. 2^4. Each output is one
    product, bit for bit the emulation's vdpbf16ps of its two factors: where a factor or the
    product is below 2^-126 (the reference keeps a float32 subnormal) that is zero. K = 288:
    two k blocks of the tiles (ES8_KBLOCK 256) and a last chunk of 32 values; calls of `tokens`
    tokens (the last one fewer); cols: the columns tile forced on or off, or the engine's choice."""
    M = 256
    w = np.tile(np.resize(CODES, (M, 64)), (1, -(-K // 64)))[:, :K].copy()  # a row: 64 codes over and over
    sc = np.array([[127, 0], [120, 131], [0, 0], [10, 127], [127, 1], [118, 0], [0, 127], [5, 6]], np.uint8)
    sc = np.resize(sc, (8, K // 32))
    x = np.eye(K, dtype=np.float32) * np.float32(2.0 ** -13)
    q, a_scale = ref.act_quant(x)
    qx = (q * np.repeat(a_scale, 32, 1)).max(axis=1)                # each token's one value, as quantized
    values = ref.e4m3(w)                                            # NaN for the NaN codes
    s = np.repeat(np.repeat(ref.e8m0(sc), 32, 0), 32, 1)
    got = np.concatenate([k.fp8_linear(x[i:i + tokens], w, sc, cols=cols) for i in range(0, K, tokens)])
    if tokens == 1 or (tokens < 9 and not cols):  # the GEMVs of 1 and 2..8 tokens: both scales on the activation
        factor = _flush(qx[None, :] * s)                 # [M, K]: this k's activation times s_w
        pa, pb = (values.view(np.uint32) >> 16).astype(np.uint16), (factor.view(np.uint32) >> 16).astype(np.uint16)
    else:          # the tiles (9 and more tokens, or the columns tile): s_w on the widened weights
        factor = _flush(values * s)
        pa, pb = (factor.view(np.uint32) >> 16).astype(np.uint16), (qx[None, :].repeat(M, 0).view(np.uint32) >> 16).astype(np.uint16)
    zero = np.zeros(pa.size, np.uint16)
    one = k.dpbf16(np.zeros(pa.size, np.float32), np.stack([zero, pa.reshape(-1)], 1),
                   np.stack([zero, pb.reshape(-1)], 1), emulate=True).reshape(M, K)
    # a row holding a NaN code is NaN for every token (NaN * 0), as the oracle
    want = np.where(np.isnan(values).any(axis=1)[None, :], np.float32(np.nan), (one + np.float32(0)).T)
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    nz = ~nan & (want != 0)  # a zero's sign depends on the order of the zero products: 0 == -0
    assert np.array_equal(got[nz].view(np.uint32), want[nz].view(np.uint32))
    assert (got[~nan & ~nz] == 0).all()
    oracle = ref.fp8_linear(x, w, sc)
    assert np.array_equal(np.isnan(oracle), nan)                  # NaN codes as the reference
    tiny = (oracle != 0) & (np.abs(oracle) < np.finfo(np.float32).tiny)
    assert tiny.any() and (got[tiny] == 0).all()                 # DAZ/FTZ: the documented difference
    assert np.array_equal(got[~nan & ~tiny], oracle[~nan & ~tiny])


@needs_bf16
@pytest.mark.parametrize("S", [1, 3, 8, 9, 16, 17, 40])
def test_bf16_edge_codes_against_the_oracle(on_bf16, S):
    """Rows of zeros (+-0), subnormals, the largest values (+-448) and ordinary codes, real
    block scales, activations of mixed magnitude (so a block's max quantizes to +-448):
    within the oracle's tolerance of the sum of |products|; a row with a NaN code is NaN for every token, as the
    oracle. E = 6144 + 32 (a last half chunk of 64), M = 70 (a partial group)."""
    rng = np.random.default_rng(S)
    M, K = 70, 6144 + 32
    w = rng.integers(0, 256, (M, K)).astype(np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C
    w[0], w[1] = 0x00, 0x80                                         # +0, -0
    w[2] = rng.integers(1, 8, K) | (rng.integers(0, 2, K) << 7)      # subnormals
    w[3] = np.where(rng.integers(0, 2, K), 0x7E, 0xFE)               # +-448
    w[4, 5] = 0x7F                                                  # NaN code
    w[5, 77] = 0xFF
    sc = rng.integers(112, 130, (-(-M // 32), K // 32)).astype(np.uint8)
    x = (rng.standard_normal((S, K)) * np.repeat(2.0 ** rng.integers(-10, 6, (S, K // 32)), 32, 1)).astype(np.float32)
    want = ref.fp8_linear(x, w, sc)
    size = ref.fp8_linear(np.abs(x), w & 0x7F, sc)  # the sum of |products|: signed sums cancel
    got = k.fp8_linear(x, w, sc, threads=2)
    assert np.isnan(want[:, 4:6]).all() and np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert (np.abs(got - want)[ok] <= RTOL * size[ok] + ATOL).all()
    assert np.abs(got - want)[ok].max() > 0  # the sums' order differs from the oracle's
    assert (got[:, :2] == 0).all()
    assert np.array_equal(got, k.fp8_linear(x, w, sc, threads=1), equal_nan=True)


@needs_bf16
@pytest.mark.parametrize("M, K", [(70, 6144 + 32), (33, 96), (256, 512)])
def test_bf16_columns_tile_is_the_lanes_tile(on_bf16, M, K):
    """The columns tile (weight rows in the lanes) sums every output's pairs in the order of the
    tokens-in-lanes tile: the same bits from 9 tokens on (NaN where it is NaN), at any token
    count (full and partial tiles of 8, of 16), partial row groups, a last half chunk of 64;
    below 9 (where the GEMVs run otherwise) within the oracle's tolerance. Two threads give one
    thread's bits."""
    rng = np.random.default_rng(M + K)
    w = rng.integers(0, 256, (M, K)).astype(np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C
    w[M - 1, 7] = 0xFF                                              # a NaN code in the last row
    sc = rng.integers(112, 130, (-(-M // 32), K // 32)).astype(np.uint8)
    for S in (2, 5, 8, 9, 15, 16, 17, 24, 40):
        x = (rng.standard_normal((S, K)) * np.repeat(2.0 ** rng.integers(-8, 6, (S, K // 32)), 32, 1)).astype(np.float32)
        got = k.fp8_linear(x, w, sc, cols=True)
        assert np.isnan(got[:, M - 1]).all() and not np.isnan(got[:, :M - 1]).any()
        assert np.array_equal(got, k.fp8_linear(x, w, sc, cols=True, threads=2), equal_nan=True)
        if S >= 9:
            lanes = k.fp8_linear(x, w, sc, cols=False)
            assert np.array_equal(got.view(np.uint32)[:, :M - 1], lanes.view(np.uint32)[:, :M - 1]), S
        want = ref.fp8_linear(x, w, sc)[:, :M - 1]
        size = ref.fp8_linear(np.abs(x), w & 0x7F, sc)[:, :M - 1]
        assert (np.abs(got[:, :M - 1] - want) <= RTOL * size + ATOL).all(), S


def test_default_isa_is_the_best_this_cpu_runs(monkeypatch):
    """No CPU list: which path is fastest is measured per operation (engine/tune.py)."""
    monkeypatch.setattr(_isa, "supported_isas", lambda: ("baseline", "avx2", "avx512", "bf16"))
    assert _isa.default_isa() == "bf16"
    monkeypatch.setattr(_isa, "supported_isas", lambda: ("baseline", "avx2", "avx512"))
    assert _isa.default_isa() == "avx512"


def test_bf16_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nflags\t\t: sse2 avx2 fma f16c "
                 "avx512f avx512bw avx512vl avx512dq avx512vbmi avx512_bf16\n\nprocessor\t: 1\n"
                 "vendor_id\t: Other\n")
    assert _isa.cpu_isas(str(f)) == ("baseline", "avx2", "avx512", "bf16")
    f.write_text("flags\t: sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16\n")  # no VBMI
    assert _isa.cpu_isas(str(f)) == ("baseline", "avx2", "avx512")
    assert _isa.cpu_isas(str(tmp_path / "missing")) == ("baseline",)


# ---- the projection GEMM on vdpbf16ps (engram_step.h es_gemm_range_dp) ----------------------
BF16 = np.dtype(ml_dtypes.bfloat16)


def _gemm_operands(rng, B, E, M):
    x = rng.standard_normal((B, E)).astype(BF16).astype(np.float32)
    w = rng.standard_normal((M, E)).astype(BF16)
    bias = np.zeros((M + 15) // 16 * 16, np.float32)
    bias[:M] = rng.standard_normal(M)
    return x, w, bias


def _dp_order(x, w, bias):
    """Y the way vdpbf16ps sums it in each lane: bias, then per pair of k the odd k, then the even,
    each addition rounded to float32 (es8_dpbf16_lane; these operands are normal and their float64
    sums exact, so one rounding to float32 is the instruction's)."""
    B, E = x.shape
    M = w.shape[0]
    acc = np.broadcast_to(bias[:M], (B, M)).astype(np.float32)
    xf, wf = x.astype(np.float64), w.astype(np.float32).astype(np.float64)
    for j in range(0, E, 2):
        for k in ([j + 1] if j + 1 < E else []) + [j]:
            acc = (acc + xf[:, k, None] * wf[None, :, k]).astype(np.float32)
    return acc


# rows: 1 (the one-stream step: es_dp_gemv's runs of 8 panels, then tiles), 2 (one small tile), 8 (one
# full), 9 (full + 1), 16 (the 16-stream step), 37, 128 (a prefill chunk); E odd (the last pair padded
# with zero) and even; M past whole panels and pairs of panels
GEMM_SHAPES = [(1, 33, 300), (1, 64, 256), (2, 15, 40), (8, 64, 16), (9, 33, 77), (16, 64, 120), (37, 31, 50),
               (128, 96, 300)]


@needs_bf16
@pytest.mark.parametrize("B,E,M", GEMM_SHAPES)
def test_gemm_on_vdpbf16ps_is_the_pair_order(on_bf16, B, E, M):
    """bf16 weights and bf16 rows on the bf16 path: the GEMM's bits are vdpbf16ps's pair order
    (products exact, sums in pairs), within the project's tolerance of the float64 oracle."""
    from engram_stream.demo import _engine as demo
    x, w, bias = _gemm_operands(np.random.default_rng(B * 1000 + E), B, E, M)
    got = demo._gemm(x, _panels(w), bias, M, 2)
    assert np.array_equal(got.view(np.uint32), _dp_order(x, w, bias).view(np.uint32))
    exact = x.astype(np.float64) @ w.astype(np.float32).astype(np.float64).T + bias[:M]
    np.testing.assert_allclose(got, exact, rtol=RTOL, atol=ATOL)
    widened = demo._gemm(x, _panels(w), bias, M, 1)  # the float32 FMAs on the widened weights
    assert not np.array_equal(got, widened)  # the pair order shows: another kernel ran


@needs_bf16
def test_gemm_on_vdpbf16ps_reads_subnormal_rows_as_zero(on_bf16):
    """DAZ: a bf16 subnormal in a row multiplies as 0 where the float32 FMAs keep it (a loss
    below 2^-126 |w|: nothing at the scale of real weights and rows)."""
    from engram_stream.demo import _engine as demo
    x, w, bias = _gemm_operands(np.random.default_rng(5), 16, 32, 48)
    x[:, 7] = 0
    flushed = x.copy()
    x[3, 7] = 2.0 ** -130  # a bf16 subnormal; flushed holds the zero DAZ reads
    w = w.astype(np.float32)
    w[:, 7] = 2.0 ** 126  # x * w = 2^-4: a product the float32 FMAs keep
    wp = _panels(w.astype(BF16))
    assert not np.array_equal(demo._gemm(x, wp, bias, 48, 1), demo._gemm(flushed, wp, bias, 48, 1))
    assert np.array_equal(demo._gemm(x, wp, bias, 48, 2), demo._gemm(flushed, wp, bias, 48, 2))


# (B, H, hd, M): one row (the GEMV), a part tile, tiles and a part, a prefill chunk; hd odd (pairs
# across two records) and even (a record's words copied), E = H*hd odd too
RECORD_SHAPES = [(1, 4, 16, 300), (5, 3, 5, 40), (37, 2, 12, 77), (128, 6, 16, 130), (9, 3, 7, 48)]


@needs_bf16
@pytest.mark.parametrize("B,H,hd,M", RECORD_SHAPES)
def test_gemm_from_bf16_records_is_the_gemm_of_the_widened_rows(on_bf16, B, H, hd, M):
    """The engines' bf16 tables: es_gemm_records_mt packs the pairs straight from the table rows;
    its bits are the pairs GEMM's on the rows gathered to float32, on any thread count."""
    from engram_stream.demo import _engine as demo
    rng = np.random.default_rng(B * 100 + hd)
    table = rng.standard_normal((40, hd)).astype(BF16)
    rows = rng.integers(0, 40, (B, H))
    table[rows[0, 0], 0] = 2.0 ** -130  # a subnormal: read as 0 either way (DAZ)
    x = table.astype(np.float32)[rows].reshape(B, H * hd)
    _, w, bias = _gemm_operands(rng, 1, H * hd, M)
    want = demo._gemm(x, _panels(w), bias, M, 2)
    assert np.array_equal(want.view(np.uint32), _dp_order(_flush(x), w, bias).view(np.uint32))
    for th in (1, 2, 3):
        got = demo._gemm_records(table.view(np.uint16), rows, _panels(w), bias, M, th)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), th


@pytest.mark.parametrize("isa", [n for n in _isa.supported_isas() if n != "bf16"])
def test_gemm_from_bf16_records_elsewhere_leaves_it_to_the_gather(isa):
    """Off the bf16 path (and neon_bf16's one row) es_gemm_records_mt does nothing and says so: the
    engine gathers the rows to float32 for the GEMM that path runs."""
    from engram_stream.demo import _engine as demo
    rng = np.random.default_rng(3)
    table = rng.standard_normal((10, 8)).astype(BF16)
    _, w, bias = _gemm_operands(rng, 1, 16, 20)
    with on_path(isa):
        got = demo._gemm_records(table.view(np.uint16), np.zeros((1, 2), np.int64), _panels(w), bias, 20, 2)
    assert got is None


@pytest.mark.parametrize("isa", [n for n in _isa.supported_isas()])
def test_gemm_bf16_rows_elsewhere_is_the_widening_gemm(isa):
    """ES_GEMM_BF16_ROWS changes the kernel only on the bf16 path (one row too) and neon_bf16 (two rows
    or more: test_bfdot_path.py): other paths run the bits of the widening GEMM."""
    from engram_stream.demo import _engine as demo
    before = _isa.kernel_isa()
    _isa.use_isa(isa)
    try:
        for B, E, M in [(1, 33, 40), (16, 64, 120)]:
            x, w, bias = _gemm_operands(np.random.default_rng(B), B, E, M)
            same = demo._gemm(x, _panels(w), bias, M, 2), demo._gemm(x, _panels(w), bias, M, 1)
            if isa not in ("bf16", "neon_bf16") or (isa == "neon_bf16" and B == 1):
                assert np.array_equal(*same)
            np.testing.assert_allclose(same[0], x @ w.astype(np.float32).T + bias[:M], rtol=RTOL, atol=ATOL)
    finally:
        _isa.use_isa(before)
