"""The deepseek-v4.1 variant against its committed goldens (tests/data/golden_v41_*.npz),
written by tools/goldens/v41.py, an independent torch re-implementation of the public
reference (DeepSeek-V4.1-Flash inference/engram.py + model.py, float8 kernels).

Integers (multipliers, primes, offsets, rows, dead masks) exactly; the float oracle within
2e-5 + 2e-4*|x| of the reference run in float32; h + delta within the reference's own bf16
rounding (rtol = atol = 1e-2) of its bf16 output. Only the regeneration test needs torch.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from engram_stream.v41 import NAMES

from helpers.numeric import ATOL, RTOL  # noqa: E402
from helpers.repo import ROOT  # noqa: E402

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang
GOLDENS = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "golden_v41_*.npz")))
GENERATOR = os.path.join(ROOT, "tools", "goldens", "v41.py")


def _name(path):
    return os.path.basename(path)[len("golden_v41_"):-len(".npz")]


golden = pytest.mark.parametrize("path", GOLDENS, ids=[_name(p) for p in GOLDENS])


def _load(path):
    with np.load(path, allow_pickle=False) as z:
        d = {k: z[k] for k in z.files}
    return EngramConfig(**json.loads(str(d["config_json"]))), d.get("compression"), d


def _model(cfg, comp, d):
    sds = {L: {k: d[f"L{L}.sd.{k}"] for k in NAMES} for L in cfg.layer_ids}
    return EngramModel.from_reference(cfg, sds, compression=comp)


def test_goldens_present():
    assert len(GOLDENS) >= 3


@golden
def test_integers(path):
    cfg, comp, d = _load(path)
    plan = HashPlan(cfg, compression=comp)
    fast, slow = plan.hash(d["ids"]), plan.hash_numpy(d["ids"])
    assert np.array_equal(plan.dead_mask(d["ids"]), d["dead"])
    for L in cfg.layer_ids:
        assert np.array_equal(plan.multipliers[L], d[f"L{L}.multipliers"])
        assert np.array_equal(plan.head_primes[L], d[f"L{L}.primes"])
        assert np.array_equal(plan.offsets[L], d[f"L{L}.offsets"])
        assert np.array_equal(slow[L], d[f"L{L}.hash"])
        assert np.array_equal(fast[L], d[f"L{L}.hash"])


@golden
def test_forward_against_float32_and_bf16_references(path):
    cfg, comp, d = _load(path)
    model = _model(cfg, comp, d)
    for L in cfg.layer_ids:
        y = model.forward(L, d["ids"], d["hidden"])
        want = d[f"L{L}.delta_f32"]
        err = np.abs(y - want) - (ATOL + RTOL * np.abs(want))
        assert err.max() <= 0, f"layer {L}: worst excess {err.max():.3g}"
        assert not y[d["dead"]].any()
        np.testing.assert_allclose(d["hidden"] + y, d[f"L{L}.out_bf16"], rtol=1e-2, atol=1e-2)


def test_tiny_scales_layer_pins_the_activation_quantizer():
    """Layer 14 of the hc1 case has tiny rows (every block's amax < 1e-4): the quantizer rounds
    there, the gate sees the rounded key, and the delta (about 1e-8, so compared relative to its
    own scale) follows the reference only when the quantizer is emulated exactly."""
    from engram_stream.v41 import reference as ref
    path = next(p for p in GOLDENS if _name(p) == "hc1_tiny_scales")
    cfg, comp, d = _load(path)
    model = _model(cfg, comp, d)
    w = model.layer(14)
    rows = HashPlan(cfg, compression=comp).hash_numpy(d["ids"])[14] + w.offsets
    e = ref.dequant_rows(w, rows).reshape(-1, cfg.engram_dim)
    q, s = ref.act_quant(e)
    assert np.abs(e).max() < 1e-4 and not np.array_equal(q * np.repeat(s, 32, axis=-1), e)
    want = d["L14.delta_f32"]
    scale = np.abs(want).max()
    assert 0 < scale < 1e-5
    y = model.forward(14, d["ids"], d["hidden"])
    assert (np.abs(y - want) <= ATOL * scale + RTOL * np.abs(want)).all()


@golden
def test_generator_reproduces_committed_file(path, tmp_path):
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("_gen_goldens_v41", GENERATOR)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert sorted(c["name"] for c in gen.CONFIGS) == sorted(_name(p) for p in GOLDENS)
    fresh_path = gen.write(next(c for c in gen.CONFIGS if c["name"] == _name(path)), str(tmp_path))
    with np.load(path, allow_pickle=False) as z, np.load(fresh_path, allow_pickle=False) as f:
        assert sorted(z.files) == sorted(f.files)
        for k in z.files:
            want, got = z[k], f[k]
            assert got.dtype == want.dtype and got.shape == want.shape, k
            if k.endswith(("delta_f32", "out_bf16")):   # torch float kernels: close, not bit-equal
                np.testing.assert_allclose(got, want, rtol=1e-2 if "bf16" in k else RTOL,
                                           atol=1e-2 if "bf16" in k else ATOL, err_msg=k)
            else:
                assert np.array_equal(got, want), k
