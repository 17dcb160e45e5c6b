"""The kernel path: kernel_isa(), ENGRAM_STREAM_ISA, and the portable pieces of the headers.

The engine and hash tests themselves run on every path the CPU supports (the each_isa
fixture of conftest.py); here: the switch, its refusals, and header portability."""
import os
import shutil
import subprocess

import numpy as np
import pytest

import engram_stream
from engram_stream.engine import isa as _isa
from helpers.processes import run_python

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

INCLUDE = engram_stream.get_include()

STEP_CHECK = """
import numpy as np, engram_stream as es
from engram_stream import EngramConfig, EngramModel
cfg = EngramConfig(engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=64, n_head_per_ngram=4,
                   layer_ids=[1], kernel_size=3, hidden_size=48, hc_mult=2, vocab_size=60)
m = EngramModel.init(cfg, seed=1)
rng = np.random.default_rng(0)
ids = rng.integers(0, 60, (1, 40)); h = rng.standard_normal((1, 40, 2, 48)).astype(np.float32)
want = m.forward(1, ids, h)[0]
got = m.stream(1).prefill(ids[0], h[0])
print(es.kernel_isa(), bool(np.allclose(got, want, rtol=2e-4, atol=2e-5)))
"""


def test_kernel_isa_names_the_running_path():
    assert engram_stream.kernel_isa() in _isa.ISA_NAMES
    assert _isa.supported_isas()[0] == "baseline"
    before = _isa.kernel_isa()
    try:
        for name in _isa.supported_isas():
            _isa.use_isa(name)
            assert engram_stream.kernel_isa() == name
            assert _isa.forced() and "use_isa" in _isa.choice()[1]
    finally:
        _isa.use_isa(before)


def test_one_runtime_drives_every_extension():
    """Every extension's kernels read the one runtime of _hash: forcing a path there moves the
    engines' kernels (their fma loops count the lanes of the path that ran), with no per-module copy."""
    from engram_stream.demo import _engine
    lanes = {"baseline": 12 * 4, "avx2": 12 * 8, "avx512": 12 * 16, "bf16": 12 * 16, "neon": 16 * 4, "neon_bf16": 16 * 4}
    before = _isa.kernel_isa()
    try:
        for name in _isa.supported_isas():
            _isa.use_isa(name)
            assert _engine._fma_chains(10) == 10 * lanes[name], name
    finally:
        _isa.use_isa(before)
    assert not hasattr(_isa, "_modules") and not hasattr(_isa, "register")


def test_every_extension_that_cimports_the_kernels_binds_the_one_runtime():
    """An extension that cimports _hash compiles engram_isa.h's static view of the runtime: unbound,
    it would keep a path of its own (the forced path and the measured choice would not reach it)."""
    import glob
    import os
    root = os.path.dirname(os.path.dirname(_isa.__file__))
    users = []
    for path in glob.glob(os.path.join(root, "**", "*.pyx"), recursive=True):
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if "from engram_stream._hash cimport" in src:
            users.append(os.path.relpath(path, root))
            assert "es_runtime_bind(es_runtime_of_process())" in src, path
    assert len(users) >= 6, users


def test_unforced_runtime_takes_the_best_path_and_honours_a_call_level():
    """use_isa(None): nothing forced, the best path is the process's, and a thread's call level
    (an engine's measured choice) runs; forced, the call level is ignored."""
    from engram_stream import _hash
    from engram_stream.demo import _engine
    lanes = {"baseline": 12 * 4, "avx2": 12 * 8, "avx512": 12 * 16, "bf16": 12 * 16, "neon": 16 * 4, "neon_bf16": 16 * 4}
    before = _isa.kernel_isa()
    try:
        _isa.use_isa(None)
        assert not _isa.forced() and _isa.kernel_isa() == _isa.supported_isas()[-1]
        _hash._isa_call(0)
        try:
            assert _hash._isa_get() == 0 and _engine._fma_chains(10) == 10 * lanes["baseline"]
            _isa.use_isa(_isa.supported_isas()[-1])  # forced: the call level no longer counts
            assert _hash._isa_get() == _isa.ISA_NAMES.index(_isa.supported_isas()[-1])
        finally:
            _hash._isa_call(-1)
    finally:
        _isa.use_isa(before)


@pytest.mark.parametrize("name", _isa.ISA_NAMES)
def test_environment_forces_a_path(name):
    env = dict(os.environ, ENGRAM_STREAM_ISA=name)
    r = run_python(["-c", STEP_CHECK], env=env)
    if name in _isa.supported_isas():
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [name, "True"]
    else:  # refused at import, saying why
        assert r.returncode != 0 and "not supported by this CPU" in r.stderr


def test_fma_chains_run_on_every_path():
    """The register-only FMA loop bench_step times for its floor: 12 chains of one vector
    a path (16 on neon), and the loop really runs (a removed one would print a peak of 10^5 GMAC/s)."""
    import time
    from engram_stream.demo import _engine
    from engram_stream.v41 import _engine as v41
    # chains x lanes a round; bf16: the demo runs its avx512 kernels
    per_round = {"baseline": 12 * 4, "avx2": 12 * 8, "avx512": 12 * 16, "bf16": 12 * 16, "neon": 16 * 4, "neon_bf16": 16 * 4}
    mac_per_round = dict(per_round, bf16=12 * 32)  # the V4.1 projection's own: vdpbf16ps, 32 products a zmm
    before = _isa.kernel_isa()
    try:
        for name in _isa.supported_isas():
            _isa.use_isa(name)
            rounds = 1_000_000
            for chains, n in ((_engine._fma_chains, per_round[name]), (v41._mac_chains, mac_per_round[name])):
                s = time.perf_counter()
                done = chains(rounds)
                took = time.perf_counter() - s
                assert done == rounds * n, name
                assert took > done / 1e12, (name, took)  # no core multiply-adds 10^12 floats a second
    finally:
        _isa.use_isa(before)


def test_default_is_the_best_path():
    env = {k: v for k, v in os.environ.items() if k != "ENGRAM_STREAM_ISA"}
    r = run_python(["-c", "import engram_stream as es; print(es.kernel_isa())"], env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == _isa.default_isa()


def test_unknown_isa_refused_at_import():
    env = dict(os.environ, ENGRAM_STREAM_ISA="sse9")
    r = run_python(["-c", "import engram_stream"], env=env)
    assert r.returncode != 0
    assert "ENGRAM_STREAM_ISA='sse9'" in r.stderr and "baseline, avx2, avx512" in r.stderr


def test_unsupported_isa_refused_state_unchanged(monkeypatch):
    before = _isa.kernel_isa()
    monkeypatch.setattr(_isa, "supported_isas", lambda: ("baseline",))
    with pytest.raises(RuntimeError, match="not supported by this CPU"):
        _isa.use_isa("avx2")
    with pytest.raises(ValueError, match="unknown kernel ISA"):
        _isa.use_isa("AVX-512")
    assert _isa.kernel_isa() == before


# ---- header portability ---------------------------------------------------------------

HALF_PROGRAM = r"""
#include <stdio.h>
#include "engram_hash.h"
#include "engram_step.h"
int main(void) {
    for (unsigned h = 0; h < 65536; h++) {
        float f = es_half_to_float((uint16_t)h);
        fwrite(&f, sizeof f, 1, stdout);
    }
    return 0;
}
"""


def _cc():
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


@pytest.mark.skipif(_cc() is None, reason="no C compiler")
def test_half_conversion_without_float16(tmp_path):
    """The bit-level float16 fallback (compilers without _Float16) equals numpy on all 65536 values."""
    src = tmp_path / "half.c"
    src.write_text(HALF_PROGRAM)
    exe = tmp_path / "half"
    subprocess.run([_cc(), "-O2", "-DES_NO_FLOAT16", "-DES_NO_X86_PATHS", f"-I{INCLUDE}", str(src), "-o",
                    str(exe), "-lm", "-lpthread"], check=True, capture_output=True)
    got = np.frombuffer(subprocess.run([str(exe)], check=True, capture_output=True).stdout, np.float32)
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # signed zeros too


def _compile_only(cc, *flags):
    r = subprocess.run([cc, "-fsyntax-only", "-Wall", "-Werror", "-Wno-psabi", "-Wno-unused-function",
                        *flags, f"-I{INCLUDE}", "-x", "c", "-"],
                       input='#include "engram_hash.h"\n#include "engram_step.h"\n#include "engram_fp8.h"\n'
                             'int main(void){return 0;}\n',
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# .ci/run sets ENGRAM_STREAM_CI_TOOLCHAINS=1: there a missing compiler fails instead of skipping
NEED_TOOLCHAINS = os.environ.get("ENGRAM_STREAM_CI_TOOLCHAINS") == "1"


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None and not NEED_TOOLCHAINS,
                    reason="no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)")
def test_headers_compile_for_aarch64():
    _compile_only("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(shutil.which("clang") is None and not NEED_TOOLCHAINS, reason="no clang (apt-get install clang)")
def test_headers_compile_with_clang():
    _compile_only("clang")
    _compile_only("clang", "-DES_NO_X86_PATHS")


def test_a_path_needs_every_feature_its_copies_use():
    """es_isa_best_of: avx2 needs AVX2, FMA and F16C (the copies convert halves with F16C), avx512
    those and AVX-512 F/BW/VL/DQ; a CPU lacking one runs the path below."""
    from engram_stream import _hash
    AVX2, FMA, F16C, AVX512 = 1, 2, 4, 8
    if _hash._isa_best_of(AVX2 | FMA | F16C | AVX512) == 0:  # a build without the x86 copies
        pytest.skip("this build carries the baseline path only")
    best = {0: 0, AVX2 | FMA: 0, AVX2 | F16C: 0, FMA | F16C: 0, AVX2 | FMA | F16C: 1,
            AVX2 | FMA | AVX512: 0, AVX2 | FMA | F16C | AVX512: 2, AVX512: 0}
    for feats, level in best.items():
        assert _hash._isa_best_of(feats) == level, feats
