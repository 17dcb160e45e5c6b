"""Shared test helpers.

Tests exercise the installed package: a subprocess runs with its working directory
outside the checkout, so `python -c` / `python -m` cannot import the unbuilt source tree
at the repository root (an in-place development build, or PYTHONPATH, still applies).
"""
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(args, cwd=None, **kw):
    """subprocess.run([sys.executable, *args]) from a folder outside the checkout."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run([sys.executable, *args], cwd=cwd or tempfile.gettempdir(), **kw)


def perturbed(model, rng):
    """The same model with non-trivial norm weights and biases, like trained ones (a model's
    arrays are read-only: the changed ones are new arrays)."""
    from engram_stream import EngramModel
    layers = {}
    for L, w in model.layers.items():
        n1, n2, n3 = (1 + 0.3 * rng.standard_normal(a.shape) for a in (w.norm1, w.norm2, w.conv_norm))
        bias = w.proj_b + 0.2 * rng.standard_normal(w.proj_b.shape)
        layers[L] = w.replace(model.cfg, norm1=n1, norm2=n2, conv_norm=n3, proj_b=bias)
    return EngramModel(model.cfg, model.plan, layers)


def _kernel_isas():
    """Every kernel path this CPU runs (ENGRAM_STREAM_ISA, when set, names the only one)."""
    forced = os.environ.get("ENGRAM_STREAM_ISA", "").strip().lower()
    if forced:
        return [forced]
    from engram_stream._isa import supported_isas
    return list(supported_isas())


@pytest.fixture(scope="module", params=_kernel_isas())
def each_isa(request):
    """Run a module's tests once per kernel path (`pytestmark = pytest.mark.usefixtures("each_isa")`):
    every path is held to the numpy oracle."""
    from engram_stream import _isa
    before = _isa.kernel_isa()
    _isa.use_isa(request.param)
    yield request.param
    _isa.use_isa(before)
