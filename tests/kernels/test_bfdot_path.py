"""The neon_bf16 kernel path (include/engram_bfdot.h, ARMv8.6 FEAT_BF16): BFDOT itself, held to
an emulation of the Arm ARM's BFDotAdd without FEAT_EBF16 (qemu's bfdotadd: the pair's two
exact products added, then that sum added to the lane, each addition rounded to odd, denormal
inputs and results flushed to zero), and the projection GEMM on it bit for bit. The engines with
bf16 tables and projections (Qwen: the demo engine's GEMM; LongCat) are held to the oracle on it
by their own tests, forced onto it under qemu -cpu max (tools/test_aarch64.sh).

The emulation's tests run on every CPU; the ones of the instruction and of the path skip where
the CPU lacks FEAT_BF16 (tools/test_aarch64.sh runs them under qemu -cpu max), and a CPU
without it (qemu's cortex-a72) is checked not to offer the path.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engram_stream.demo import _engine as demo
from engram_stream.engine import isa as _isa
from helpers.isa import on_path
from helpers.numeric import ATOL, RTOL, bf16_bits as h, f32, weight_panels as _panels

HAVE = "neon_bf16" in _isa.supported_isas()
needs_bfdot = pytest.mark.skipif(not HAVE, reason="this CPU (or build) lacks FEAT_BF16: neon_bf16 did not run")
BF16 = np.dtype(ml_dtypes.bfloat16)
TINY, BIG = 2.0 ** -126, 2.0 ** 128


def _f32(x64):
    """float64 values (exactly float32 values, zeros, inf, NaN) as float32."""
    return np.asarray(x64, np.float64).astype(np.float32)


def _flush(x):
    """Denormal inputs and results read as zero of their sign (FPCR.FZ: what BFDOT's steps do)."""
    x = np.asarray(x, np.float64)
    return np.where(np.abs(x) < TINY, np.copysign(0.0, x), x)


def _round_odd(a, b):
    """fl32 of the exact a + b (float64 operands, float32 values) rounded to odd: truncated toward
    zero, its last bit set when inexact; overflow to inf, a result below 2^-126 flushed."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)  # TwoSum: s + err is the exact sum
    with np.errstate(over="ignore", invalid="ignore"):
        t = s.astype(np.float32)
        up = np.abs(t.astype(np.float64)) > np.abs(s)  # rounded away from zero: step back
        t = np.where(up, np.nextafter(t, np.float32(0)), t)
        exact_s = t.astype(np.float64) == s
        below = exact_s & (err != 0) & (np.sign(err) != np.sign(s))  # the exact sum lies just inside t
        t = np.where(below, np.nextafter(t, np.float32(0)), t)
        inexact = ~exact_s | (err != 0)
    bits = t.view(np.uint32) | inexact.astype(np.uint32)
    r = bits.view(np.float32).astype(np.float64)
    r = np.where(np.abs(s) >= BIG, np.copysign(np.inf, s), r)
    r = np.where(~np.isfinite(a) | ~np.isfinite(b), s, r)  # inf and NaN as IEEE adds them
    return _f32(_flush(r))


def _bf(u):
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _product(a, b):
    """fl32 of a*b (bf16 bits; inputs flushed): exact (8-bit significands) but for overflow and
    the flush of a product below 2^-126."""
    with np.errstate(over="ignore", invalid="ignore"):
        p = _flush(_bf(a)) * _flush(_bf(b))
    p = np.where(np.isfinite(p) & (np.abs(p) >= BIG), np.copysign(np.inf, p), p)
    return _flush(p)


def bfdot_emulated(acc, a, b):
    """BFDOT lanes: acc float32 [n]; a, b bf16 bits [n, 2]."""
    a, b = np.asarray(a, np.uint16), np.asarray(b, np.uint16)
    with np.errstate(all="ignore"):  # inf - inf, NaN: as the instruction, no warning
        t = _round_odd(_product(a[:, 0], b[:, 0]), _product(a[:, 1], b[:, 1])).astype(np.float64)
        return _round_odd(_flush(np.asarray(acc, np.float32).astype(np.float64)), t)


# (acc, a0, a1, b0, b1) -> the float32 bits the documented semantics give, worked out by hand
CASES = [
    ((1.0, h(2.0 ** -12), 0, h(2.0 ** -12), 0), 0x3F800001),        # a half ulp: inexact, rounded to odd
    ((1.0, h(2.0 ** -11), 0, h(2.0 ** -11), 0), 0x3F800002),        # exact: no jamming
    ((1.0, h(1.5 * 2.0 ** -11), 0, h(2.0 ** -12), 0), 0x3F800001),  # 1.5 ulp: nearest-even gives ...02
    ((1.0, h(-1.0), h(2.0 ** -15), h(1.0), h(2.0 ** -15)), 0x33800000),  # -1 + 2^-30 rounded to odd first
    ((f32(0x00200000), h(2.0 ** -100), 0, h(2.0 ** -20), 0), 0x03800000),  # a denormal acc: 0
    ((0.0, 0x0040, 0, h(2.0 ** 100), 0), 0),                         # a bf16 denormal factor: 0
    ((-0.0, h(-2.0 ** -65), 0x8000, h(2.0 ** -65), h(1.0)), 0x80000000),  # a product flushed to -0
    ((0.0, h(-2.0 ** -65), 0, h(2.0 ** -65), 0), 0),                 # -0 + +0: +0
    ((0.0, h(2.0 ** -63), h(-2.0 ** -65), h(2.0 ** -63), h(2.0 ** -65)), 0x00800000),  # 2^-126 - 2^-130 -> 2^-126
    ((0.0, h(1.5 * 2.0 ** -63), h(-2.0 ** -63), h(2.0 ** -63), h(2.0 ** -63)), 0),  # the pair's sum flushed
    ((f32(0x7F7FFFFF), h(2.0 ** 103), 0, h(1.0), 0), 0x7F7FFFFF),   # max + half ulp: stays (nearest-even: inf)
    ((2.0 ** 127, h(2.0 ** 127), 0, h(2.0), 0), 0x7F800000),        # overflow: inf
]


def _cases():
    acc = np.array([c[0][0] for c in CASES], np.float32)
    a = np.array([[c[0][1], c[0][2]] for c in CASES], np.uint16)
    b = np.array([[c[0][3], c[0][4]] for c in CASES], np.uint16)
    return acc, a, b


def test_emulation_documented_cases():
    got = bfdot_emulated(*_cases()).view(np.uint32)
    assert [hex(g) for g in got] == [hex(c[1]) for c in CASES]


def test_emulation_of_normal_operands_is_two_roundings_to_odd():
    """Normal products and sums (float64 exact): truncate each sum toward zero, set the last bit
    when something was cut: the emulation's bits, and differing from nearest-even somewhere."""
    rng = np.random.default_rng(3)
    n = 20_000
    a = (rng.integers(0x3C00, 0x4300, (n, 2)) | (rng.integers(0, 2, (n, 2)) << 15)).astype(np.uint16)
    b = rng.integers(0x3C00, 0x4300, (n, 2)).astype(np.uint16)
    acc = rng.standard_normal(n).astype(np.float32)

    def odd(x):  # float64 exact -> float32 rounded to odd, by integers
        t = x.astype(np.float32)
        t = np.where(np.abs(t.astype(np.float64)) > np.abs(x), np.nextafter(t, np.float32(0)), t)
        return (t.view(np.uint32) | (t.astype(np.float64) != x)).view(np.float32)

    pair = odd(_bf(a[:, 0]) * _bf(b[:, 0]) + _bf(a[:, 1]) * _bf(b[:, 1]))
    want = odd(acc.astype(np.float64) + pair.astype(np.float64))
    got = bfdot_emulated(acc, a, b)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    nearest = (acc.astype(np.float64) + (_bf(a[:, 0]) * _bf(b[:, 0]) + _bf(a[:, 1]) * _bf(b[:, 1]))).astype(np.float32)
    assert (got != nearest).any()


def _random_operands(rng, n):
    """bf16 bits and accumulators over the whole range: denormals, zeros, infinities, NaN, and
    values near one another so that sums cancel and round."""
    a = rng.integers(0, 1 << 16, (n, 2), dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, (n, 2), dtype=np.uint32).astype(np.uint16)
    near = rng.integers(0x3F00, 0x4080, (n // 2, 2)).astype(np.uint16)
    a[: n // 2], b[: n // 2] = near ^ (rng.integers(0, 2, near.shape).astype(np.uint16) << 15), near[::-1]
    a[n // 2:n // 2 + n // 8] = rng.integers(0, 0x0100, (n // 8, 2)).astype(np.uint16)  # denormal, least normal
    acc = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    acc[: n // 2] = rng.standard_normal(n // 2).astype(np.float32) * 4
    acc[n // 2:n // 2 + n // 16] = (rng.integers(0, 1 << 23, n // 16) | (rng.integers(0, 2, n // 16) << 31)
                                    ).astype(np.uint32).view(np.float32)
    return acc, a, b


@needs_bfdot
def test_real_bfdot_equals_the_emulation():
    """This CPU's BFDOT: the hand-worked cases, and 100k random lanes (whole bit range, cancelling
    sums, denormals) give the emulation's bits (NaN where it gives NaN)."""
    got = demo._bfdot(*_cases()).view(np.uint32)
    assert [hex(g) for g in got] == [hex(c[1]) for c in CASES]
    acc, a, b = _random_operands(np.random.default_rng(29), 100_000)
    got, want = demo._bfdot(acc, a, b), bfdot_emulated(acc, a, b)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert nan.mean() < 0.02 and (want[~nan] == 0).any()


def test_path_offered_only_with_feat_bf16(tmp_path):
    """neon_bf16 runs where AT_HWCAP2 has HWCAP2_BF16 (qemu -cpu max) and nowhere else (cortex-a72,
    x86): the path list, the instruction's window and cpu_isas agree with the auxiliary vector."""
    assert HAVE == (_isa.aarch64_bf16() and "neon" in _isa.supported_isas())
    if not HAVE:
        with pytest.raises(RuntimeError, match="lacks BFDOT"):
            demo._bfdot(*_cases())
        with pytest.raises(RuntimeError, match="neon_bf16"):
            _isa.use_isa("neon_bf16")
    auxv = tmp_path / "auxv"
    for hwcap2, want in ((1 << 14 | 1 << 1, ("baseline", "neon", "neon_bf16")), (1 << 13, ("baseline", "neon"))):
        auxv.write_bytes(np.array([16, 0xFF, 26, hwcap2, 0, 0], np.uint64).tobytes())  # AT_HWCAP, AT_HWCAP2, AT_NULL
        assert _isa.cpu_isas("/nonexistent", "aarch64", str(auxv)) == want
    assert _isa.cpu_isas("/nonexistent", "aarch64", str(tmp_path / "missing")) == ("baseline", "neon")


# ---- the projection GEMM on BFDOT (engram_bfdot.h es_gemm_range_bfdot) ----------------------
def _bfdot_order(x, w, bias):
    """Y as BFDOT sums each lane: bias, then per pair of k one BFDOT (an odd E's last pair padded
    with zeros), in k order."""
    B, E = x.shape
    M = w.shape[0]
    xb = x.astype(BF16).view(np.uint16)
    wb = np.zeros((M, E + 1), np.uint16)
    wb[:, :E] = w.view(np.uint16)
    xp = np.zeros((B, E + 1), np.uint16)
    xp[:, :E] = xb
    acc = np.broadcast_to(bias[:M], (B, M)).astype(np.float32).reshape(-1)
    for j in range(0, E, 2):
        a = np.stack([np.repeat(xp[:, j], M), np.repeat(xp[:, j + 1], M)], 1)
        b = np.stack([np.tile(wb[:, j], B), np.tile(wb[:, j + 1], B)], 1)
        acc = bfdot_emulated(acc, a, b)
    return acc.reshape(B, M)


@pytest.fixture
def on_neon_bf16():
    with on_path("neon_bf16"):
        yield


# rows: 2, 8 (one full tile), 9, 16 (the 16-stream step), 37; E odd and even; M past whole
# 8-column halves and panels
GEMM_SHAPES = [(2, 15, 40), (8, 64, 16), (9, 33, 77), (16, 64, 120), (37, 31, 50)]


@needs_bfdot
@pytest.mark.parametrize("B,E,M", GEMM_SHAPES)
def test_gemm_on_bfdot_is_its_emulation(on_neon_bf16, B, E, M):
    """bf16 weights and bf16 rows on neon_bf16: the GEMM's bits are the emulated BFDOTs', within
    the project's tolerance of the float64 oracle; one row runs the widening GEMV."""
    rng = np.random.default_rng(B * 1000 + E)
    x = rng.standard_normal((B, E)).astype(BF16).astype(np.float32)
    w = rng.standard_normal((M, E)).astype(BF16)
    bias = np.zeros((M + 15) // 16 * 16, np.float32)
    bias[:M] = rng.standard_normal(M)
    got = demo._gemm(x, _panels(w), bias, M, 2)
    assert np.array_equal(got.view(np.uint32), _bfdot_order(x, w, bias).view(np.uint32))
    exact = x.astype(np.float64) @ w.astype(np.float32).astype(np.float64).T + bias[:M]
    np.testing.assert_allclose(got, exact, rtol=RTOL, atol=ATOL)
    assert not np.array_equal(got, demo._gemm(x, _panels(w), bias, M, 1))  # another kernel ran
    assert np.array_equal(demo._gemm(x[:1], _panels(w), bias, M, 2), demo._gemm(x[:1], _panels(w), bias, M, 1))
