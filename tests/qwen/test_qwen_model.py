"""qwen3.8-flash-next: the numpy oracle and the streaming engine against transformers'
Qwen4ExpTextPLELayer (float32, the same weights), and the engine against the oracle token by
token on every kernel path: step, prefill, step_packed with drafts, snapshot/restore.

Expected outputs come from transformers' module (full sequence, and token by token with its
own cache) or from the numpy oracle (qwen/reference.py), never from the engine."""
from __future__ import annotations

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from helpers.numeric import close

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

EOS = 7
TINY = {"model_type": "qwen4_exp_text", "vocab_size": 100, "hidden_size": 16, "hc_count": 2,
        "num_hidden_layers": 6, "ple_layer_ids": [5, 2, 3], "ple_embed_dim": 16, "ngram_size": 3,
        "heads_per_ngram": 2, "ngram_vocab_size_base": 50, "make_ngram_vocab_size_divisible_by": 8,
        "eos_token_id": [EOS, 9], "seed": 99, "rms_norm_eps": 1e-5, "ple_conv_kernel_size": 3,
        "num_experts": 4, "num_experts_per_tok": 2, "layer_types": ["linear_attention"] * 6}


def eos_ids(rng, shape, vocab=100):
    """Random ids with EOS at the start, in runs and at random places."""
    ids = rng.integers(0, vocab, shape).astype(np.int64)
    ids[rng.random(shape) < 0.2] = EOS
    ids[..., 0] = EOS
    ids[..., 5:7] = EOS
    return ids


def hidden(rng, shape, cfg):
    return rng.standard_normal(tuple(shape) + (cfg.hc_mult, cfg.hidden_size)).astype(np.float32)


@pytest.fixture(scope="module")
def transformers_layers():
    """({L: Qwen4ExpTextPLELayer with random float32 weights}, its config, the torch module)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    tcfg = Qwen4ExpTextConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    torch.manual_seed(0)
    layers = {}
    for i, L in enumerate(tcfg.ple_layer_ids):
        m = M.Qwen4ExpTextPLELayer(tcfg, L - 1, i).float().eval()
        with torch.no_grad():
            for p in m.parameters():  # its init leaves norms and taps 0: draw them all
                p.normal_(0, 0.3)
        layers[L] = m
    return layers, tcfg, torch


def test_oracle_and_engine_equal_transformers(transformers_layers):
    layers, tcfg, torch = transformers_layers
    from transformers import DynamicCache
    cfg = EngramConfig.from_hf_config(TINY)
    model = EngramModel.from_reference(cfg, {L: m.state_dict() for L, m in layers.items()})
    rng = np.random.default_rng(0)
    B, T = 2, 24
    ids, hid = eos_ids(rng, (B, T)), hidden(rng, (B, T), cfg)
    for L, m in layers.items():
        with torch.no_grad():
            want = m(torch.from_numpy(hid.reshape(B, T, -1)), torch.from_numpy(ids), None).numpy()
            cache, steps = DynamicCache(config=tcfg), []
            for t in range(T):  # transformers' own decode: token by token with its cache
                steps.append(m(torch.from_numpy(hid[:, t:t + 1].reshape(B, 1, -1)),
                               torch.from_numpy(ids[:, t:t + 1]), cache).numpy())
        want = want.reshape(B, T, cfg.hc_mult, cfg.hidden_size)
        close(np.concatenate(steps, 1).reshape(want.shape), want)
        close(model.forward(L, ids, hid), want)
        eng = model.stream(L, n_streams=B)
        close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(T)], 1), want)
        pre = model.stream(L)
        close(np.concatenate([pre.prefill(ids[1, :9], hid[1, :9]), pre.prefill(ids[1, 9:], hid[1, 9:])]), want[1])


def test_from_reference_checks_the_buffers(transformers_layers):
    layers, _, torch = transformers_layers
    cfg = EngramConfig.from_hf_config(TINY)
    sd = dict(layers[2].state_dict())
    sd["ple_embedding.layer_multipliers"] = sd["ple_embedding.layer_multipliers"] + 2
    with pytest.raises(ValueError, match="layer_multipliers"):
        EngramModel.from_reference(cfg, {2: sd, 3: layers[3].state_dict(), 5: layers[5].state_dict()})
    sd = dict(layers[2].state_dict())
    sd.update({k: v for k, v in layers[3].state_dict().items() if k.startswith("ple_embedding.ngram_heads")})
    with pytest.raises(ValueError, match="ngram_heads_vocab_sizes"):  # layer 3's primes given as layer 2's
        EngramModel.from_reference(cfg, {2: sd, 3: layers[3].state_dict(), 5: layers[5].state_dict()})


def small_model(seed=0, **kw):
    cfg = EngramConfig.from_hf_config({**TINY, **kw})
    return EngramModel.init(cfg, seed=seed)


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_engine_steps_equal_the_oracle(eps):
    """A large eps too: the engine uses the config's eps, not the demo's constants."""
    model = small_model(rms_norm_eps=eps)
    rng = np.random.default_rng(3)
    S, T = 3, 40
    ids, hid = eos_ids(rng, (S, T)), hidden(rng, (S, T), model.cfg)
    for L in model.cfg.layer_ids:
        want = model.forward(L, ids, hid)
        eng = model.stream(L, n_streams=S)
        close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(T)], 1), want)
        assert eng.rows.tolist() == (HashPlan(model.cfg).hash(ids)[L][:, -1] + model.plan.offsets[L]).tolist()


def test_eps_is_the_configs():
    a, b = small_model(rms_norm_eps=1e-5), small_model(rms_norm_eps=0.5)
    rng = np.random.default_rng(4)
    ids, hid = eos_ids(rng, (1, 12)), hidden(rng, (1, 12), a.cfg)
    assert np.abs(a.stream(2).prefill(ids[0], hid[0]) - b.stream(2).prefill(ids[0], hid[0])).max() > 1e-3


def test_prefill_then_steps_and_packed_segments_equal_the_oracle():
    model = small_model(seed=1)
    L = 3
    rng = np.random.default_rng(5)
    S, T = 3, 160  # past a prefill chunk
    ids, hid = eos_ids(rng, (S, T)), hidden(rng, (S, T), model.cfg)
    want = model.forward(L, ids, hid)
    eng = model.stream(L, n_streams=S)
    # slot 0: a prompt of 150 then steps; slot 1: chunks of 7 in packed calls; slot 2: a draft cut back
    out0 = [eng.prefill(ids[0, :150], hid[0, :150], stream=0)]
    t1 = t2 = 0
    out1, out2 = [], []
    while t1 < T:
        n1 = min(7, T - t1)
        n2 = min(5, T - t2)
        segs, lens, parts_i, parts_h = [], [], [], []
        if n1:
            segs.append(1); lens.append(n1); parts_i.append(ids[1, t1:t1 + n1]); parts_h.append(hid[1, t1:t1 + n1])
        if n2:
            segs.append(2); lens.append(n2); parts_i.append(ids[2, t2:t2 + n2]); parts_h.append(hid[2, t2:t2 + n2])
        res = eng.step_packed(np.concatenate(parts_i), np.concatenate(parts_h), streams=segs, lengths=lens,
                              draft=True)
        keep2 = min(n2, 3)  # slot 2 keeps 3 of its 5 drafted tokens
        eng.commit([n1, keep2][:len(segs)] if n2 else [n1])
        out1.append(res[:n1])
        if n2:
            out2.append(res[n1:n1 + keep2])
        t1 += n1
        t2 += keep2 if n2 else 0
    close(np.concatenate(out1), want[1])
    close(np.concatenate(out2)[:t2], want[2, :t2])
    snap = eng.snapshot()

    def steps():  # slot 0 continues its prompt; slots 1 and 2 take filler tokens
        return [eng.step(np.array([ids[0, t], EOS, 1]), np.stack([hid[0, t], hid[1, 0], hid[2, 0]]))[0]
                for t in range(150, T)]

    close(np.concatenate(out0 + [np.stack(steps())]), want[0])
    eng.restore(snap)  # back to where slot 0's prompt ended: the same steps give the same outputs
    close(np.stack(steps()), want[0, 150:])


def test_bfloat16_projections_equal_the_oracle_on_the_same_weights():
    model = small_model(seed=2).with_weight_dtype("bfloat16")
    L = 5
    w = model.layer(L)
    assert w.key_proj.dtype.name == w.value_proj.dtype.name == "bfloat16"
    assert np.array_equal(w.norm_key_w, small_model(seed=2).layer(L).norm_key_w)  # the rest is kept
    rng = np.random.default_rng(6)
    ids, hid = eos_ids(rng, (2, 30)), hidden(rng, (2, 30), model.cfg)
    eng = model.stream(L, n_streams=2)
    close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(30)], 1), model.forward(L, ids, hid))


def test_bfloat16_tables_are_gathered_as_they_are():
    """The released tables are bfloat16: the engine gathers them (no float32 copy), every kernel path."""
    import ml_dtypes
    f32 = small_model(seed=3)
    cfg = f32.cfg
    bf = EngramModel(cfg, f32.plan, {L: w.replace(cfg, table=w.table.astype(ml_dtypes.bfloat16))
                                      for L, w in f32.layers.items()})
    rng = np.random.default_rng(7)
    ids, hid = eos_ids(rng, (2, 30)), hidden(rng, (2, 30), cfg)
    for L in cfg.layer_ids:
        assert bf.layer(L).table.dtype.name == "bfloat16"
        want = bf.forward(L, ids, hid)
        assert not np.array_equal(want, f32.forward(L, ids, hid))  # the rounding shows: the rows are bf16
        eng = bf.stream(L, n_streams=2)
        close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(30)], 1), want)
        close(bf.stream(L).prefill(ids[1], hid[1]), want[1])


def test_bfloat16_tables_and_projections_equal_the_oracle():
    """The released model's dtypes, bf16 table and projections: on the bf16 path the GEMM runs on
    vdpbf16ps (engram_step.h es_gemm_range_dp); 16 streams' steps and a prefill, every kernel path."""
    import ml_dtypes
    f32 = small_model(seed=4)
    cfg = f32.cfg
    bf = EngramModel(cfg, f32.plan, {L: w.replace(cfg, table=w.table.astype(ml_dtypes.bfloat16))
                                      for L, w in f32.layers.items()}).with_weight_dtype("bfloat16")
    rng = np.random.default_rng(8)
    ids, hid = eos_ids(rng, (16, 12)), hidden(rng, (16, 12), cfg)
    for L in cfg.layer_ids:
        assert bf.layer(L).table.dtype.name == bf.layer(L).key_proj.dtype.name == "bfloat16"
        want = bf.forward(L, ids, hid)
        eng = bf.stream(L, n_streams=16)
        close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(12)], 1), want)
        close(bf.stream(L).prefill(ids[5], hid[5]), want[5])
