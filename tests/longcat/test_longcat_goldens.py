"""longcat-flash-lite against its committed goldens (tests/data/golden_longcat_*.npz), written by
tools/goldens/longcat.py, an independent torch re-implementation of LongCat's NgramEmbedding
(the Hugging Face semantics).

Integers (table sizes, multipliers, offsets, every row) exactly; the oracle and the engine, token
by token on every kernel path, within the suite's float tolerance. Only the regeneration test
needs torch."""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from engram_stream.longcat import config as lconfig
from engram_stream.longcat import reference
from helpers.numeric import close
from helpers.repo import ROOT

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]
GOLDENS = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "golden_longcat_*.npz")))
GENERATOR = os.path.join(ROOT, "tools", "goldens", "longcat.py")
golden = pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p)[15:-4] for p in GOLDENS])


def _load(path):
    with np.load(path, allow_pickle=False) as z:
        d = {k: z[k] for k in z.files}
    return EngramConfig.from_hf_config(json.loads(str(d["config_json"]))), d


def _model(cfg, d):
    return EngramModel.from_reference(cfg, {0: {k[3:]: v for k, v in d.items() if k.startswith("sd.")}})


def test_goldens_present():
    assert len(GOLDENS) >= 3
    assert any("flashlite" in p for p in GOLDENS)


@golden
def test_integers(path):
    cfg, d = _load(path)
    plan = HashPlan(cfg)
    np.testing.assert_array_equal(plan.head_primes[0], d["table_sizes"])
    np.testing.assert_array_equal(lconfig.head_mods(cfg), d["mods"])
    np.testing.assert_array_equal(plan.offsets[0], np.concatenate([[0], np.cumsum(d["table_sizes"])[:-1]]))
    assert plan.table_rows[0] == int(d["table_sizes"].sum())
    np.testing.assert_array_equal(reference.rows(cfg, d["ids"]), d["rows"])
    np.testing.assert_array_equal(plan.hash(d["ids"])[0], d["rows"])
    np.testing.assert_array_equal(plan.hash_numpy(d["ids"])[0], d["rows"])


def test_flashlite_geometry():
    """The released config: E = 12 embedders of 256 values, m = 78 * 131072 = 10,223,616, tables
    of m + 2c + 1 rows (about 10.2M each: ~31.4B values, ~63 GB in bfloat16)."""
    cfg, d = _load(next(p for p in GOLDENS if "flashlite" in p))
    assert (cfg.n_heads, cfg.head_dim, cfg.ngram_vocab, cfg.pad_id) == (12, 256, 10_223_616, 2)
    assert HashPlan(cfg).table_rows[0] == sum(10_223_616 + 2 * c + 1 for c in range(12))
    assert 62e9 < HashPlan(cfg).table_rows[0] * 256 * 2 < 64e9


def _with_weights():
    return [p for p in GOLDENS if "flashlite" not in p]


@pytest.mark.parametrize("path", _with_weights(), ids=[os.path.basename(p)[15:-4] for p in _with_weights()])
def test_oracle_and_engine_token_by_token(path):
    cfg, d = _load(path)
    model = _model(cfg, d)
    ids, want = d["ids"], d["out"]
    close(reference.forward(cfg, model.layer(0), ids), want)
    eng = model.stream(0, n_streams=ids.shape[0])
    got, rows = [], []
    for t in range(ids.shape[1]):
        got.append(eng.step(ids[:, t]))
        rows.append(eng.rows)
    close(np.stack(got, 1), want)
    np.testing.assert_array_equal(np.stack(rows, 1), d["rows"] + model.plan.offsets[0])


@golden
def test_regenerates_bit_for_bit(path):
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gen_goldens_longcat", GENERATOR)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.make(os.path.basename(path)[15:-4])
    _, d = _load(path)
    assert sorted(fresh) == sorted(d)
    for k in d:
        np.testing.assert_array_equal(np.asarray(fresh[k]), d[k], err_msg=k)
