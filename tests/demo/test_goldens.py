"""The package against the committed golden vectors (tests/data/golden_*.npz).

The goldens come from tools/goldens/demo.py, an independent torch
re-implementation of the reference Engram module (deepseek-ai/Engram,
engram_demo_v1.py). Every test here runs without torch except
test_generator_reproduces_committed_file, which re-runs the generator and
skips cleanly when torch is missing.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, HashPlan
from helpers.numeric import ATOL, RTOL
from helpers.repo import ROOT

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

DATA = os.path.join(ROOT, "tests", "data")
GENERATOR = os.path.join(ROOT, "tools", "goldens", "demo.py")
GOLDENS = sorted(glob.glob(os.path.join(DATA, "golden_hc*.npz")))   # the demo's (golden_<variant>_*: the others')


def _name(path):
    return os.path.basename(path)[len("golden_"):-len(".npz")]


def test_goldens_present():
    assert len(GOLDENS) >= 5, f"expected the committed goldens in {DATA}, found {GOLDENS}"


golden = pytest.mark.parametrize("path", GOLDENS, ids=[_name(p) for p in GOLDENS])


def _load(path):
    with np.load(path, allow_pickle=False) as z:
        d = {k: z[k] for k in z.files}
    cfg = EngramConfig(**json.loads(str(d["config_json"])))
    return cfg, d.get("compression"), d


def _multipliers(cfg, d):
    """Injected multipliers ({layer: int64[max_ngram]}) for configs that carry them, else None."""
    if "multipliers_injected" not in d:
        return None
    return {L: d[f"L{L}.multipliers"] for L in cfg.layer_ids}


def _state_dicts(cfg, d):
    out = {}
    for L in cfg.layer_ids:
        prefix = f"L{L}.sd."
        out[L] = {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}
        assert out[L], f"no state dict for layer {L}"
    return out


# --- integer geometry and the hash (exact) -----------------------------------------------------

@golden
def test_plan_geometry(path):
    cfg, comp, d = _load(path)
    plan = HashPlan(cfg, compression=comp, multipliers=_multipliers(cfg, d))
    want_pad = cfg.pad_id if comp is None else int(comp[cfg.pad_id])
    assert plan.pad_id == want_pad
    for L in cfg.layer_ids:
        mult = np.asarray(plan.multipliers[L])
        assert mult.dtype == np.int64
        np.testing.assert_array_equal(mult, d[f"L{L}.multipliers"])
        nested = plan.primes[L]
        assert len(nested) == cfg.max_ngram_size - 1
        assert all(len(heads) == cfg.n_head_per_ngram for heads in nested)
        flat = np.array([int(p) for heads in nested for p in heads], dtype=np.int64)
        np.testing.assert_array_equal(flat, d[f"L{L}.primes"])
        offsets = np.asarray(plan.offsets[L])
        np.testing.assert_array_equal(offsets, d[f"L{L}.offsets"])
        np.testing.assert_array_equal(offsets, d[f"L{L}.sd.multi_head_embedding.offsets"])


@golden
@pytest.mark.parametrize("method", ["hash", "hash_numpy"])
def test_plan_hash(path, method):
    cfg, comp, d = _load(path)
    plan = HashPlan(cfg, compression=comp, multipliers=_multipliers(cfg, d))
    got = getattr(plan, method)(d["ids"])
    assert sorted(got) == sorted(cfg.layer_ids)
    for L in cfg.layer_ids:
        assert got[L].dtype == np.int64
        assert got[L].shape == d[f"L{L}.hash"].shape
        np.testing.assert_array_equal(got[L], d[f"L{L}.hash"], err_msg=f"{method} layer {L}")


# --- the forward pass (close) -------------------------------------------------------------------

@golden
def test_model_forward(path):
    import engram_stream
    if not hasattr(engram_stream, "EngramModel"):
        pytest.fail("engram_stream.EngramModel is missing")
    cfg, comp, d = _load(path)
    model = engram_stream.EngramModel.from_reference(cfg, _state_dicts(cfg, d), compression=comp,
                                                     multipliers=_multipliers(cfg, d))
    for L in cfg.layer_ids:
        y = np.asarray(model.forward(L, d["ids"], d["hidden"]))
        want = d[f"L{L}.output"]
        assert y.shape == want.shape
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, want, atol=ATOL, rtol=RTOL, err_msg=f"layer {L}")


# --- provenance: the committed data is what the tool writes -------------------------------------

def _generator():
    spec = importlib.util.spec_from_file_location("_gen_goldens", GENERATOR)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generator_configs_match_committed_files():
    """No stale or missing golden files: one file per config of the tool (text scan, no torch)."""
    with open(GENERATOR, encoding="utf-8") as f:
        src = f.read()
    for path in GOLDENS:
        assert f'name="{_name(path)}"' in src, f"{path} has no config in tools/goldens/demo.py"


@golden
def test_generator_reproduces_committed_file(path, tmp_path):
    pytest.importorskip("torch")
    gen = _generator()
    names = [c["name"] for c in gen.CONFIGS]
    assert sorted(names) == sorted(_name(p) for p in GOLDENS)
    spec = next(c for c in gen.CONFIGS if c["name"] == _name(path))
    fresh_path = gen.write(spec, str(tmp_path))
    with np.load(path, allow_pickle=False) as z:
        committed = {k: z[k] for k in z.files}
    with np.load(fresh_path, allow_pickle=False) as z:
        fresh = {k: z[k] for k in z.files}
    assert sorted(fresh) == sorted(committed)
    for k, want in committed.items():
        got = fresh[k]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        if k.endswith(".output"):
            # the forward depends on torch's float32 kernels (SIMD width, reduction order
            # differ between machines): close, not bit-equal
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=k)
        else:
            # integers, config, and the numpy-drawn hidden states and weights: bit-equal
            np.testing.assert_array_equal(got, want, err_msg=k)
