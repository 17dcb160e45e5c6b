"""The float8 kernels of the V4.1 engine (include/engram_fp8.h, engram_fp8_kern.h) on every
kernel path the CPU runs (the each_isa fixture; the pytest header says which paths ran),
held to the numpy oracle (engram_stream.v41.reference) and to ml_dtypes: every e4m3 code,
NaN codes, power-of-two scales down to 2^-127 (subnormal products and results: no flush to
zero anywhere), the plain scalar C the benchmarks compare with, Flash's row width, and the
path chosen by ENGRAM_STREAM_ISA in a fresh process as by use_isa.

Where a path departs from the reference, on purpose: the fp16 projections (avx2, avx512) read
the NaN codes of wkv (0x7f, 0xff) as +-480 (checkpoints hold none; see engram_fp8_kern.h);
baseline and bf16 read NaN, as the oracle, and every path's gathers read table NaN codes as NaN.
bf16 reads a factor or sum below 2^-126 as zero (vdpbf16ps: DAZ/FTZ; test_bf16_path.py).
"""
from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest

from engram_stream.engine import isa as _isa
from engram_stream.v41 import _engine as k
from engram_stream.v41 import reference as ref
from helpers.numeric import close
from helpers.processes import run_python

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

each_path = pytest.mark.usefixtures("each_isa")  # the test once per kernel path the CPU runs

CODES = np.arange(256, dtype=np.uint8)
NAN_CODES = (CODES & 0x7F) == 0x7F


def bits_equal(got, want):
    """Equal bits where the oracle is a number (signed zeros and subnormals included), NaN
    where it is NaN."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@each_path
def test_gather_every_code_and_scale_bit_exact():
    """Table rows hold all 256 e4m3 codes under all 256 e8m0 scales (2^-127, a float32
    subnormal, up to NaN): the gather equals e4m3 * e8m0 of ml_dtypes bit for bit."""
    w = np.resize(CODES, (256, 256)).copy()
    w[1::2] = w[1::2, ::-1]                          # codes in other blocks too
    sc = np.resize(CODES, (256, 8)).copy()
    sc[:, 1] = 0                                     # 2^-127 in every row
    rows = np.r_[np.arange(256), 7, 0].astype(np.int64)
    with np.errstate(over="ignore"):  # 448 * 2^127: inf, in the kernel too
        want = (w.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                * np.repeat(sc.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=1))[rows]
    bits_equal(k.gather_rows(w, sc, rows), want)
    assert np.isnan(want).any() and (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()


@pytest.mark.parametrize("one_token", [False, True])
def test_projection_reads_every_code_and_tiny_scales_exactly(each_isa, one_token):
    """One-hot activations (x = 2^-13 at one k) read single weights back through the
    projection: all 256 codes, block scales 2^-127 .. 2^4. The smallest products are
    2^-149, the least float32 subnormal: any flush to zero of a product, a widened weight or
    a sum shows. Many tokens at once (widened rows, tiles) and one at a time (the GEMV)."""
    M, K = 256, 64
    w = np.resize(CODES, (M, K)).copy()
    sc = np.array([[127, 0], [120, 131], [0, 0], [10, 127], [127, 1], [118, 0], [0, 127], [5, 6]], np.uint8)
    x = np.eye(K, dtype=np.float32) * np.float32(2.0 ** -13)
    values = ref.e4m3(w)
    f16 = each_isa in ("avx2", "avx512", "neon", "neon_bf16")  # widened through fp16 bits: the NaN codes read +-480
    if f16:
        values = np.where(NAN_CODES[w], np.where(w & 0x80, -480.0, 480.0), values).astype(np.float32)
    scaled = values * np.repeat(np.repeat(ref.e8m0(sc), 32, 0), 32, 1)
    if one_token:
        got = np.stack([k.fp8_linear(x[i:i + 1], w, sc)[0] for i in range(K)])
    else:
        got = k.fp8_linear(x, w, sc)
    if f16:  # no NaN: each output is its one product, exact (added to +0: no -0)
        bits_equal(got, (scaled * np.float32(2.0 ** -13)).T + np.float32(0))
    elif each_isa == "bf16":  # DAZ/FTZ: the oracle's subnormals read 0 (test_bf16_path.py: the emulation's bits)
        want = ref.fp8_linear(x, w, sc)
        tiny = np.abs(want) < np.finfo(np.float32).tiny
        bits_equal(got[~tiny], want[~tiny])
        assert tiny.any() and (got[tiny] == 0).all()
        return
    else:  # NaN codes as the oracle reads them: a row holding one is NaN for every token
        want = ref.fp8_linear(x, w, sc)
        bits_equal(got, want)
        assert np.isnan(want).any() and not np.isnan(want).all()
    finite = ~np.isnan(got)
    assert (np.abs(got[finite & (got != 0)]) == 2.0 ** -149).any()  # the least subnormal came through


@each_path
@pytest.mark.parametrize("S", [1, 2, 8, 9, 16, 17, 33])
def test_flash_width_against_the_oracle(S):
    """A row of Flash's width (E = 6144: 24 k blocks of the many-token tiles, the GEMV over a
    whole row), positive values (no cancellation: the fp32 sums of any order agree within the
    tolerance), M = 70: a partial last group."""
    rng = np.random.default_rng(S)
    M, K = 70, 6144
    w = rng.uniform(0.01, 2, (M, K)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    sc = rng.integers(118, 124, (-(-M // 32), K // 32)).astype(np.uint8)
    x = rng.uniform(0.0, 3.0, (S, K)).astype(np.float32)
    want = ref.fp8_linear(x, w, sc)
    got = k.fp8_linear(x, w, sc, threads=2)
    close(got, want)
    assert np.array_equal(got, k.fp8_linear(x, w, sc, threads=1))


@each_path
@pytest.mark.parametrize("S", [1, 3, 16, 17])
def test_many_row_groups_over_threads(S):
    """Ten row groups (M = 293: the last one partial) take several grabs of ES8_GRAB groups a
    thread, each thread requesting the rows of the next group it claimed while it computes the
    last of its grab: one, two and three threads give the same bits, within the oracle's
    tolerance."""
    rng = np.random.default_rng(100 + S)
    M, K = 293, 512
    w = rng.uniform(0.01, 2, (M, K)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    sc = rng.integers(118, 124, (-(-M // 32), K // 32)).astype(np.uint8)
    x = rng.uniform(0.0, 3.0, (S, K)).astype(np.float32)
    one = k.fp8_linear(x, w, sc, threads=1)
    close(one, ref.fp8_linear(x, w, sc))
    for threads in (2, 3):
        assert np.array_equal(k.fp8_linear(x, w, sc, threads=threads), one), threads


@each_path
@pytest.mark.parametrize("S", [1, 3, 17])
def test_plain_scalar_projection_matches_the_oracle(S):
    """fp8_linear(plain=True), the plain scalar C that bench_v41.py times the paths against."""
    rng = np.random.default_rng(S)
    M, K = 70, 416
    w = np.clip(rng.standard_normal((M, K)), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    sc = rng.integers(118, 130, (-(-M // 32), K // 32)).astype(np.uint8)
    x = (rng.standard_normal((S, K)) * np.repeat(2.0 ** rng.integers(-12, 6, (S, K // 32)), 32, 1)).astype(np.float32)
    want = ref.fp8_linear(x, w, sc)
    close(k.fp8_linear(x, w, sc, plain=True), want)
    close(k.fp8_linear(x, w, sc), want)


V41_CHECK = """
import numpy as np, engram_stream as es
from engram_stream import EngramConfig, EngramModel
cfg = EngramConfig(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=64,
                   n_head_per_ngram=2, layer_ids=[1], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
                   image_token_id=299)
m = EngramModel.init(cfg, seed=3)
rng = np.random.default_rng(0)
ids = rng.integers(0, 300, (2, 40)); ids[0, 5] = 299
h = rng.standard_normal((2, 40, 2, 64)).astype(np.float32)
want = m.forward(1, ids, h)
one = m.stream(1).prefill(ids[0], h[0])
eng = m.stream(1, n_streams=2)
two = np.stack([eng.step(ids[:, t], h[:, t]) for t in range(40)], axis=1)
ok = all(np.allclose(g, w, rtol=2e-4, atol=2e-5) for g, w in ((one, want[0]), (two, want)))
print(es.kernel_isa(), repr(eng).split("isa=")[1], ok)
"""


@pytest.mark.parametrize("name", _isa.ISA_NAMES)
def test_environment_chooses_the_float8_path(name):
    """ENGRAM_STREAM_ISA in a fresh process: the V4.1 engines run that path (repr names it)
    and match the oracle; a path the CPU lacks is refused at import."""
    r = run_python(["-c", V41_CHECK], env=dict(os.environ, ENGRAM_STREAM_ISA=name))
    if name in _isa.supported_isas():
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [name, f"'{name}')", "True"]
    else:
        assert r.returncode != 0 and "not supported by this CPU" in r.stderr


def test_baseline_on_a_faster_cpu_warns_once(monkeypatch):
    """A V4.1 engine on the baseline path of a build without the CPU's faster path: one
    RuntimeWarning per process naming it; none when the build has it (then baseline was
    chosen), none the second time."""
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.v41._engine import V41StreamEngine
    cfg = EngramConfig(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=64,
                       n_head_per_ngram=2, layer_ids=[1], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
                       image_token_id=299)
    m = EngramModel.init(cfg, seed=0)
    monkeypatch.setattr(_isa, "_warned", False)
    monkeypatch.setattr(_isa, "kernel_isa", lambda: "baseline")
    monkeypatch.setattr(_isa, "cpu_isas", lambda: ("baseline", "avx2"))
    monkeypatch.setattr(_isa, "supported_isas", lambda: ("baseline", "avx2"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        V41StreamEngine(m, 1)  # the build has avx2: baseline was asked for
    monkeypatch.setattr(_isa, "supported_isas", lambda: ("baseline",))
    with pytest.warns(RuntimeWarning, match="this CPU has avx2, which this build of engram_stream lacks"):
        V41StreamEngine(m, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        V41StreamEngine(m, 1)  # once per process


def test_cpu_isas_read_the_cpu_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n")
    assert _isa.cpu_isas(str(f), "x86_64") == ("baseline", "avx2")
    f.write_text("flags\t: sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq\n")
    assert _isa.cpu_isas(str(f), "x86_64") == ("baseline", "avx2", "avx512")
    f.write_text("flags\t: sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512vbmi avx512_bf16\n")
    assert _isa.cpu_isas(str(f), "x86_64") == ("baseline", "avx2", "avx512", "bf16")
    f.write_text("flags\t: sse2 avx2 fma\n")  # no F16C: not the avx2 path
    assert _isa.cpu_isas(str(f), "x86_64") == ("baseline",)
    assert _isa.cpu_isas(str(tmp_path / "missing"), "x86_64") == ("baseline",)
    # aarch64: every CPU has ASIMD; the file is not read (under qemu-user it describes the host)
    f.write_text("flags\t: sse2 avx2 fma f16c\n")
    none = str(tmp_path / "missing")  # no auxiliary vector: neon_bf16 (test_bfdot_path.py) not read
    assert _isa.cpu_isas(str(f), "aarch64", none) == _isa.cpu_isas(none, "aarch64", none) == ("baseline", "neon")
    assert set(_isa.supported_isas()) <= set(_isa.cpu_isas()) or not os.path.exists("/proc/cpuinfo")
