"""qwen3.8-flash-next against its committed goldens (tests/data/golden_qwen_*.npz), written by
tools/goldens/qwen.py, an independent torch re-implementation of transformers' PLE layer.

Integers (multipliers, primes, offsets, padded rows, every row id) exactly; the oracle and the
engine, token by token on every kernel path, within the suite's float tolerance. Only the
regeneration test needs torch."""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from engram_stream.qwen.weights import NAMES
from helpers.numeric import close
from helpers.repo import ROOT

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]
GOLDENS = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "golden_qwen_*.npz")))
GENERATOR = os.path.join(ROOT, "tools", "goldens", "qwen.py")
golden = pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p)[12:-4] for p in GOLDENS])


def _load(path):
    with np.load(path, allow_pickle=False) as z:
        d = {k: z[k] for k in z.files}
    return EngramConfig.from_hf_config(json.loads(str(d["config_json"]))), d


def test_goldens_present():
    assert len(GOLDENS) >= 2


@golden
def test_integers(path):
    cfg, d = _load(path)
    plan = HashPlan(cfg)
    fast, slow = plan.hash(d["ids"]), plan.hash_numpy(d["ids"])
    for L in cfg.layer_ids:
        for mine, key in ((plan.multipliers[L], "multipliers"), (plan.head_primes[L], "primes"),
                          (plan.offsets[L], "offsets")):
            np.testing.assert_array_equal(mine, d[f"L{L}.{key}"])
        assert plan.table_rows[L] == int(d[f"L{L}.table_rows"])
        np.testing.assert_array_equal(fast[L] + plan.offsets[L], d[f"L{L}.rows"])
        np.testing.assert_array_equal(slow[L] + plan.offsets[L], d[f"L{L}.rows"])


@golden
def test_oracle_and_engine(path):
    cfg, d = _load(path)
    model = EngramModel.from_reference(cfg, {L: {k: d[f"L{L}.sd.{k}"] for k in NAMES} for L in cfg.layer_ids})
    ids, hid = d["ids"], d["hidden"]
    for L in cfg.layer_ids:
        want = d[f"L{L}.out"]
        close(model.forward(L, ids, hid), want)
        eng = model.stream(L, n_streams=ids.shape[0])
        close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(ids.shape[1])], 1), want)


@golden
def test_regenerates(path):
    """The generator writes the committed file again: every input and integer bit for bit, the
    float32 outputs within a few float32 roundings (torch's float32 kernels sum in an order of
    their own per CPU: this golden's outputs, written on one CPU, differ in the last bits on
    another)."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gen_goldens_qwen", GENERATOR)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(os.path.basename(path)[12:-4])
    _, d = _load(path)
    assert sorted(fresh) == sorted(d)
    for k in d:
        if k.endswith(".out"):
            np.testing.assert_allclose(np.asarray(fresh[k]), d[k], rtol=1e-5, atol=1e-6, err_msg=k)
        else:
            np.testing.assert_array_equal(np.asarray(fresh[k]), d[k], err_msg=k)
