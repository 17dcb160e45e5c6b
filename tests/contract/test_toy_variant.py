"""A third variant, defined and registered from this file alone (no shared file names it), passes
the engine and serving contract suites.

The toy is a variant of its own, not the demo under another name:
  * config: ToyConfig, a field of its own (toy_rows_multiple) and a rule (hc_mult 2);
  * hash: its own multiplier draw (small odd multipliers from default_rng([seed, layer, 7])) and
    tables padded to a multiple of toy_rows_multiple rows (rows no hash reaches);
  * weights: ToyWeights, the demo's arrays under an init rule of its own (tables N(0, 1/4),
    scaled projections, norms around 1) and a description of its own;
  * oracle: its own numpy forward (float64 math, rounded to float32 at the end).
The demo's StreamEngine serves it (the weights are the demo's arrays), so no Cython is its own.
It is registered only in a pytest run of its own (this file loaded as a plugin, `-p
test_toy_variant` with ENGRAM_STREAM_TOY=1), so the main run's registry holds the built-in
variants alone."""
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan, variants
from engram_stream.demo import checkpoint
from engram_stream.demo.weights import LayerWeights
from engram_stream.demo.weights import validate_layer as validate_demo_layer

from helpers.suites import run_suite_with_plugin

TOY = "toy-v0"
TOY_MULT_BOUND = 1 << 20   # the toy's multipliers: odd, below this


@dataclass(frozen=True)
class ToyConfig(EngramConfig):
    variant: str = TOY
    toy_rows_multiple: int = 16   # a layer's table rows are padded up to a multiple of this


class ToyWeights(LayerWeights):
    """The demo's arrays (what the demo's engine reads) with the toy's own init."""

    @classmethod
    def random(cls, cfg, plan, L, rng, graft_zero_init=False):
        G, D, E, K, hd = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size, cfg.head_dim
        table = (0.25 * rng.standard_normal((plan.table_rows[L], hd))).astype(np.float32)
        proj_w = (rng.standard_normal(((G + 1) * D, E)) / math.sqrt(2 * E)).astype(np.float32)
        proj_b = (0.01 * rng.standard_normal((G + 1) * D)).astype(np.float32)
        if graft_zero_init:
            proj_w[G * D:] = 0
            proj_b[G * D:] = 0
        norms = [(1 + 0.2 * rng.standard_normal((G, D))).astype(np.float32) for _ in range(3)]
        conv_w = (0.5 * rng.standard_normal((G * D, K))).astype(np.float32)
        return cls(cfg, plan.offsets[L], table, proj_w, proj_b, *norms, conv_w)

    def describe(self):
        return f"toy layer: {self.table.shape[0]} rows x {self.table.shape[1]}"


def toy_forward(cfg, w, rows, hidden):
    """The toy's oracle: the gated value plus the SiLU of the dilated causal conv of its norm, in
    float64 (an expression of its own, not the demo's reference.forward)."""
    B, T, H = rows.shape
    G, D, K, dil = cfg.hc_mult, cfg.hidden_size, cfg.kernel_size, cfg.max_ngram_size
    e = np.asarray(w.table_f32(rows + w.offsets), np.float64).reshape(B, T, -1)
    W, b = np.asarray(w.proj_w, np.float64), np.asarray(w.proj_b, np.float64)
    h = np.asarray(hidden, np.float64)

    def norm(x, weight, eps):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    proj = e @ W.T + b                                          # [B, T, (G+1)*D]
    keys = proj[..., :G * D].reshape(B, T, G, D)
    value = proj[..., G * D:]                                   # [B, T, D]
    k = norm(keys, w.norm1, w.eps_qk)
    q = norm(h, w.norm2, w.eps_qk)
    s = (k * q).sum(-1) / math.sqrt(D)
    s = np.sign(s) * np.sqrt(np.maximum(np.abs(s), 1e-6))
    v = value[:, :, None, :] / (1 + np.exp(-s))[..., None]     # [B, T, G, D]
    x = norm(v, w.conv_norm, w.eps_conv).reshape(B, T, G * D)
    y = np.zeros_like(x)
    for i in range(K):
        shift = (K - 1 - i) * dil
        if shift < T:
            y[:, shift:] += np.asarray(w.conv_w[:, i], np.float64) * x[:, :T - shift]
    return (v + (y / (1 + np.exp(-y))).reshape(B, T, G, D)).astype(np.float32)


class ToyVariant(variants.Variant):
    name = TOY
    config_class = ToyConfig
    field_help = {"toy_rows_multiple": f"{TOY}: table rows padded to a multiple of this"}
    example_config = {"variant": TOY, "engram_vocab_size": [37, 53], "max_ngram_size": 3, "n_embed_per_ngram": 8,
                      "n_head_per_ngram": 2, "layer_ids": [2, 5], "pad_id": 1, "kernel_size": 2,
                      "hidden_size": 24, "hc_mult": 2, "vocab_size": 70}
    layer_class = ToyWeights
    table_dtypes = ("float32",)
    engine = variants.get(variants.DEFAULT).engine   # the demo's: the weights are its arrays

    def validate_config(self, cfg, put):
        if cfg.hc_mult != 2:
            raise ValueError(f"EngramConfig.hc_mult must be 2 for {TOY}, got {cfg.hc_mult}")
        if cfg.toy_rows_multiple < 1:
            raise ValueError(f"EngramConfig.toy_rows_multiple must be >= 1, got {cfg.toy_rows_multiple}")

    def validate_layer(self, cfg, plan, L, w):
        if not isinstance(w, ToyWeights):
            raise TypeError(f"layer {L}: expected ToyWeights, got {type(w).__name__}")
        validate_demo_layer(cfg, plan, L, w, table_dtypes=self.table_dtypes)

    def init_layers(self, cfg, plan, seed, graft_zero_init):
        rng = np.random.default_rng([seed, 99])
        return {L: ToyWeights.random(cfg, plan, L, rng, graft_zero_init) for L in cfg.layer_ids}

    def from_state_dict(self, cfg, plan, L, state_dict):
        raise ValueError(f"{TOY} has no reference module to read a state_dict of")

    def load(self, path, mmap=True, compression=None):
        return checkpoint.load(path, mmap)

    def save(self, cfg, plan, layers, path, table_dtype=None, progress=None):
        return checkpoint.save(cfg, plan, layers, path, table_dtype=table_dtype, progress=progress)

    def save_init(self, cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
                  progress=None, before_write=None):
        plan = HashPlan(cfg, compression=compression)
        return self.save(cfg, plan, self.init_layers(cfg, plan, seed, graft_zero_init), path, table_dtype, progress)

    def is_checkpoint(self, path):
        return not os.path.isdir(path)

    def forward(self, cfg, w, rows, dead, hidden, ids):
        return toy_forward(cfg, w, rows, hidden)

    def describe(self, cfg):
        return f"the toy: hc_mult {cfg.hc_mult}, tables padded to x{cfg.toy_rows_multiple} rows"

    def step_weights(self, w):
        return w.proj_w

    def draw_multipliers(self, cfg, compressed_vocab):
        return {L: np.random.default_rng([cfg.seed, L, 7]).integers(0, TOY_MULT_BOUND // 2, cfg.max_ngram_size,
                                                                      dtype=np.int64) * 2 + 1
                for L in cfg.layer_ids}

    def table_rows(self, cfg, rows):
        m = cfg.toy_rows_multiple
        return -(-rows // m) * m


if os.environ.get("ENGRAM_STREAM_TOY") == "1":   # loaded as the plugin of the suite's own run
    variants.register(ToyVariant())


def test_the_contract_suites_pass_on_a_variant_registered_here():
    passed = run_suite_with_plugin("test_toy_variant", "ENGRAM_STREAM_TOY",
                                   ["test_engine_contract.py", "test_serving.py"], TOY)
    assert passed >= 20   # the suites ran on the toy


def test_an_installed_entry_point_registers_the_toy(tmp_path):
    """The toy as a third-party plugin: an installed distribution (its .dist-info on sys.path)
    whose entry point names ToyVariant. Its module imports EngramModel from the package at its
    top, which works because the variants are discovered at the first lookup, not while
    `import engram_stream` runs."""
    info = tmp_path / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{variants.ENTRY_POINTS}]\ntoy = test_toy_variant:ToyVariant\n")
    here = os.path.dirname(os.path.abspath(__file__))
    path = [str(tmp_path), here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from engram_stream import EngramConfig, variants\n"
            f"cfg = EngramConfig(**variants.get({TOY!r}).example_config)\n"
            "print(type(cfg).__name__, cfg.toy_rows_multiple, variants.registered()[-1])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ToyConfig", "16", TOY]


def test_the_toy_is_not_registered_in_this_run():
    assert TOY not in variants.registered()
    with pytest.raises(ValueError, match="must be one of"):
        EngramConfig(variant=TOY)


@pytest.fixture
def toy():
    v = variants.register(ToyVariant())
    yield v
    variants.unregister(TOY)


def test_a_registered_variant_is_asked_for_its_config_rule_and_files(toy, tmp_path):
    """Registered, the toy is a variant like the others: its own rule refuses a config, a model of
    it saves and loads back under its own name, as its own weights class."""
    with pytest.raises(ValueError, match="hc_mult must be 2"):
        EngramConfig(**dict(toy.example_config, hc_mult=1))
    m = EngramModel.init(EngramConfig(**toy.example_config), seed=1)
    assert m.variant is toy and m.cfg.to_dict()["variant"] == TOY
    back = EngramModel.load(m.save(tmp_path / "toy.st"))
    assert back.cfg == m.cfg and back.variant is toy
    assert all(type(w) is ToyWeights for w in back.layers.values())
    for L in m.cfg.layer_ids:
        np.testing.assert_array_equal(back.layer(L).table, m.layer(L).table)
        np.testing.assert_array_equal(back.plan.multipliers[L], m.plan.multipliers[L])


def test_the_toy_is_not_the_demo(toy):
    """Its own config class and field, multipliers, padded tables, weights and oracle."""
    cfg = EngramConfig(**toy.example_config)
    assert type(cfg) is ToyConfig and cfg.toy_rows_multiple == 16
    demo_cfg = EngramConfig(**{k: v for k, v in toy.example_config.items() if k != "variant"})
    with pytest.raises(ValueError, match=f"toy_rows_multiple is a field of '{TOY}'"):
        EngramConfig(**demo_cfg.to_dict(), toy_rows_multiple=8)
    plan, demo_plan = HashPlan(cfg), HashPlan(demo_cfg)
    for L in cfg.layer_ids:
        assert not np.array_equal(plan.multipliers[L], demo_plan.multipliers[L])
        assert (plan.multipliers[L] < TOY_MULT_BOUND).all() and (plan.multipliers[L] % 2 == 1).all()
        assert plan.table_rows[L] % 16 == 0 and plan.table_rows[L] > demo_plan.table_rows[L]
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    assert any(not np.array_equal(plan.hash(ids)[L], demo_plan.hash(ids)[L]) for L in cfg.layer_ids)
    m = EngramModel.init(cfg, seed=3)
    assert all(type(w) is ToyWeights for w in m.layers.values())
    assert "tables padded to x16" in m.variant.describe(cfg)
    assert m.layer(2).describe() == f"toy layer: {plan.table_rows[2]} rows x {cfg.head_dim}"
    assert abs(float(np.std(m.layer(2).table)) - 0.25) < 0.05   # its own init: N(0, 1/4)
    # its oracle is its own expression and agrees with the demo's reference on the same arrays
    from engram_stream.demo import reference
    h = np.random.default_rng(1).standard_normal((2, 9, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    rows = plan.hash_numpy(ids)[2]
    np.testing.assert_allclose(m.forward(2, ids, h), reference.forward(cfg, rows, m.layer(2), h),
                               rtol=1e-4, atol=1e-5)
    eng = m.stream(2)
    got = np.stack([eng.step(int(ids[0, t]), h[0, t]) for t in range(ids.shape[1])])
    np.testing.assert_allclose(got, m.forward(2, ids[:1], h[:1])[0], rtol=1e-4, atol=1e-5)
