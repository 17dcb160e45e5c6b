"""deepseek-v4.1 variant: config, hashing with the dead-token rule, weights, the numpy oracle.

Expected values come from outside the code under test: the public Flash config.json
(table rows, compressed vocab), a pure-Python hash (tests/pyref.py), hand-computed
float8 facts, and float64 recomputations of the float8 arithmetic.
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from engram_stream.v41 import reference as ref
from engram_stream.v41 import V41LayerWeights
from pyref import py_rows

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

# inference/config.json of DeepSeek-V4.1-Flash: the Engram keys and the ones it reads
FLASH_HF = {"vocab_size": 129280, "dim": 5120, "norm_eps": 1e-20, "hc_mult": 4,
            "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
            "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
            "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "image_token_id": 129264,
            "engram_n_heads": 8, "engram_head_dim": 256, "n_layers": 40}

SMALL = dict(variant="deepseek-v4.1", engram_vocab_size=[211, 211, 211], max_ngram_size=4,
             n_embed_per_ngram=64, n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64,
             hc_mult=2, vocab_size=300, image_token_id=299)
IMG = 299


def small(**kw):
    return EngramConfig(**{**SMALL, **kw})


# --- config -----------------------------------------------------------------------------------

def test_from_hf_config_flash(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(FLASH_HF))
    for src in (str(p), tmp_path, FLASH_HF):
        cfg = EngramConfig.from_hf_config(src)
        assert cfg.variant == "deepseek-v4.1"
        assert (cfg.hidden_size, cfg.hc_mult, cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.head_dim) == (
            5120, 4, 4, 8, 256)
        assert (cfg.n_heads, cfg.engram_dim) == (24, 6144)
        assert cfg.engram_vocab_size == [16000000] * 3 and cfg.layer_ids == [1, 14]
        assert (cfg.pad_id, cfg.norm_eps, cfg.image_token_id, cfg.seed) == (2, 1e-20, 129264, 0)
        assert cfg.num_embeddings == [384006168, 384016682] and cfg.compressed_vocab_size == 99092


def test_from_hf_config_other_spellings():
    d = {k: v for k, v in FLASH_HF.items() if k not in ("dim", "norm_eps", "engram_pad_id")}
    d.update(hidden_size=5120, rms_norm_eps=1e-20, engram_pad_token_id=2)
    assert EngramConfig.from_hf_config(d) == EngramConfig.from_hf_config(FLASH_HF)
    with pytest.raises(ValueError, match="dim and hidden_size disagree"):
        EngramConfig.from_hf_config({**FLASH_HF, "hidden_size": 4096})
    with pytest.raises(ValueError, match="engram_head_dim"):
        EngramConfig.from_hf_config({k: v for k, v in FLASH_HF.items() if k != "engram_head_dim"})


def test_to_hf_config_round_trip():
    cfg = EngramConfig.from_hf_config(FLASH_HF)
    assert EngramConfig.from_hf_config(cfg.to_hf_config()) == cfg
    assert EngramConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        EngramConfig().to_hf_config()


def test_demo_stays_default():
    assert EngramConfig().variant == "demo-v1"
    assert not hasattr(EngramConfig(), "norm_eps") and not hasattr(EngramConfig(), "image_token_id")
    assert type(EngramConfig()) is EngramConfig


@pytest.mark.parametrize("kw, match", [
    (dict(variant="v4"), "variant"),
    (dict(seed=3), "seed must be 0"),
    (dict(hidden_size=48), "hidden_size must be a multiple of 32"),
    (dict(n_embed_per_ngram=2 * 48), "head_dim must be a multiple of 32"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(norm_eps=float("nan")), "norm_eps"),
    (dict(image_token_id=300), "image_token_id"),
    (dict(image_token_id=2), "image_token_id"),
    (dict(num_embeddings=[5]), "num_embeddings"),
    (dict(compressed_vocab_size=301), "compressed_vocab_size"),
])
def test_v41_fields_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        small(**kw)


def test_v41_fields_refused_for_demo():
    with pytest.raises(ValueError, match="image_token_id"):
        EngramConfig(image_token_id=5)


# --- plan: Flash geometry from the public config ------------------------------------------------

def flash_lookup():
    return np.arange(129280, dtype=np.int64) % 99092  # dense, 99092 compressed ids


def test_flash_primes_sum_to_num_embeddings_and_multipliers():
    cfg = EngramConfig.from_hf_config(FLASH_HF)
    plan = HashPlan(cfg, compression=flash_lookup())   # refuses to build on any mismatch
    assert [plan.table_rows[L] for L in (1, 14)] == [384006168, 384016682]
    assert plan.compressed_vocab == 99092 and plan.pad_id == 2
    assert all(plan.head_fp[L] is None for L in (1, 14))  # primes past 2**21: hardware division
    for L in (1, 14):  # default_rng(10007*L).integers(0, (2**63-1)//99092//2, 4)*2+1
        r = np.random.default_rng(10007 * L).integers(0, (2 ** 63 - 1) // 99092 // 2, 4, dtype=np.int64)
        assert np.array_equal(plan.multipliers[L], r * 2 + 1)
        p = plan.head_primes[L]
        assert len(p) == 24 and all(q > 16000000 for q in p)
        assert all((p[o * 8:(o + 1) * 8] == np.sort(p[o * 8:(o + 1) * 8])).all() for o in range(3))
        assert np.array_equal(plan.offsets[L], np.concatenate([[0], np.cumsum(p)[:-1]]))
    assert len(set(plan.head_primes[1]) | set(plan.head_primes[14])) == 48


def test_flash_hash_hardware_division_matches_pure_python():
    cfg = EngramConfig.from_hf_config(FLASH_HF)
    lookup = flash_lookup()
    plan = HashPlan(cfg, compression=lookup)
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 129280, (2, 20))
    ids[0, 3] = ids[1, 0] = 129264
    ids[1, 7] = -1
    fast, slow = plan.hash(ids), plan.hash_numpy(ids)
    for L in (1, 14):
        want = np.array(py_rows(ids, lookup, 2, plan.multipliers[L], plan.primes[L], dead_id=129264))
        assert np.array_equal(slow[L], want) and np.array_equal(fast[L], want)


def test_serving_refuses_mismatched_sizes():
    cfg = EngramConfig.from_hf_config({**FLASH_HF, "engram_num_embeddings": [384006168, 384016683]})
    with pytest.raises(ValueError, match="384016682.*384016683"):
        HashPlan(cfg, compression=flash_lookup())
    cfg = EngramConfig.from_hf_config(FLASH_HF)
    with pytest.raises(ValueError, match="129280 ids.*99092"):
        HashPlan(cfg)  # identity compression: 129280 ids


# --- hashing with the dead-token rule ----------------------------------------------------------

def random_ids(rng, B, T, vocab=300):
    ids = rng.integers(0, vocab, (B, T))
    ids[rng.random((B, T)) < 0.15] = IMG
    ids[rng.random((B, T)) < 0.05] = -1
    return ids


@pytest.mark.parametrize("compressed", [False, True])
def test_hash_matches_pure_python(compressed):
    rng = np.random.default_rng(3)
    lookup = rng.permutation(300) % 250 if compressed else None
    plan = HashPlan(small(), compression=lookup)
    ids = random_ids(rng, 3, 40)
    ids[1, :4] = IMG  # dead tokens at the start
    fast, slow = plan.hash(ids), plan.hash_numpy(ids)
    for L in plan.cfg.layer_ids:
        want = np.array(py_rows(ids, lookup, plan.pad_id, plan.multipliers[L], plan.primes[L], dead_id=IMG))
        assert np.array_equal(slow[L], want)
        assert np.array_equal(fast[L], want)


def test_dead_rule_by_hand():
    """A DEAD token makes itself and every older shift pad; newer shifts keep their ids."""
    plan = HashPlan(small())
    seq = np.array([[10, 11, IMG, 12, 13, 14, 15]])
    rows = plan.hash(seq)[1][0]
    alone = plan.hash(np.array([[12, 13, 14, 15]]))[1][0]   # history starts after the DEAD token
    assert np.array_equal(rows[3:], alone)
    all_pad = plan.hash(np.array([[2]]))[1][0, 0]           # window [pad]*4 (pad_id 2, identity)
    assert np.array_equal(rows[2], all_pad)
    assert not np.array_equal(rows[1], all_pad)
    assert np.array_equal(plan.dead_mask(seq), seq == IMG)


def test_negative_ids_block_history_like_the_start():
    plan = HashPlan(small())
    a = plan.hash(np.array([[7, -5, 8, 9]]))[1][0]
    b = plan.hash(np.array([[8, 9]]))[1][0]
    assert np.array_equal(a[2:], b)
    assert not plan.dead_mask(np.array([-5])).any()  # unknown ids do not zero the gate


def test_hash_lookback_is_the_stateless_form():
    rng = np.random.default_rng(4)
    plan = HashPlan(small())
    ids = random_ids(rng, 4, 12)
    full = plan.hash(ids)
    lb = ids[:, 2:5][:, ::-1]                                # the 3 ids before position 5, newest first
    for numpy in (False, True):
        part = plan.hash_lookback(ids[:, 5:], lb, numpy=numpy)
        assert all(np.array_equal(part[L], full[L][:, 5:]) for L in full)
    unknown = plan.hash_lookback(ids[:, :1], np.full((4, 3), -1))   # -1: before the start
    assert all(np.array_equal(unknown[L], full[L][:, :1]) for L in full)
    with pytest.raises(ValueError, match="lookback must have shape"):
        plan.hash_lookback(ids, np.zeros((4, 2), np.int64))


def test_demo_hash_unchanged_by_the_variant():
    """Without DEAD tokens the V4.1 hash is the demo hash on the same geometry."""
    d = {k: v for k, v in SMALL.items() if k not in ("variant", "image_token_id")}
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 299, (2, 30))
    a, b = HashPlan(small()).hash(ids), HashPlan(EngramConfig(**d)).hash(ids)
    assert all(np.array_equal(a[L], b[L]) for L in a)


# --- float8 pieces of the oracle ---------------------------------------------------------------

def test_e8m0_and_e4m3_bytes():
    assert ref.e8m0(np.array([127, 128, 120], np.uint8)).tolist() == [1.0, 2.0, 2.0 ** -7]
    assert ref.e4m3(np.array([0x7E, 0x38, 0xB8, 0x01], np.uint8)).tolist() == [448.0, 1.0, -1.0, 2.0 ** -9]


def test_pow2_ceil():
    x = np.array([1.0, 1.5, 0.25, 0.26, 3e-7], np.float32)
    assert ref.pow2_ceil(x).tolist() == [1.0, 2.0, 0.25, 0.5, 2.0 ** -21]


def test_act_quant_by_hand():
    x = np.zeros(64, np.float32)
    x[0], x[1], x[2] = 448.0, 1.0, 3.3          # block 0: amax 448 -> scale 1, 3.3 -> e4m3 3.25
    x[32], x[33] = 1.0, -0.3                    # block 1: amax 1 -> scale 2**ceil(log2(1/448)) = 2**-8
    q, s = ref.act_quant(x)
    assert s.tolist() == [1.0, 2.0 ** -8]
    assert q[:3].tolist() == [448.0, 1.0, 3.25]
    assert q[32] == 256.0 and q[33] == float(np.float32(-0.3 * 256).astype(ml_dtypes.float8_e4m3fn))
    z, sz = ref.act_quant(np.zeros(32, np.float32))   # amax floor 1e-4
    assert sz[0] == 2.0 ** -22 and not z.any()


def test_fp8_linear_is_exact_dequantized_matmul_on_table_rows():
    """Table rows quantize exactly (one power-of-two scale per 32 values), so the block GEMM is
    the float64 product of the dequantized operands up to float32 accumulation."""
    rng = np.random.default_rng(6)
    model = EngramModel.init(small(), seed=2)
    w = model.layer(1)
    x = ref.dequant_rows(w, np.arange(120).reshape(20, 6)).reshape(20, 192)
    got = ref.fp8_linear(x, w.wkv_weight, w.wkv_scale)
    W = ref.e4m3(w.wkv_weight).astype(np.float64) * np.repeat(np.repeat(ref.e8m0(w.wkv_scale), 32, 0), 32, 1)
    want = x.astype(np.float64) @ W.T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    q, _ = ref.act_quant(x)
    assert q.shape == x.shape and rng is not None


# --- model: weights, oracle behaviour ------------------------------------------------------------

def test_layer_weights_interface():
    cfg = small()
    model = EngramModel.init(cfg, seed=0)
    plan = model.plan
    for L in cfg.layer_ids:
        w = model.layer(L)
        assert isinstance(w, V41LayerWeights)
        G, D, E, N = 2, 64, 192, plan.table_rows[L]
        want = {"offsets": (np.int64, (6,)), "embed_weight": (np.uint8, (N, 32)),
                "embed_scale": (np.uint8, (N, 1)), "wkv_weight": (np.uint8, ((G + 1) * D, E)),
                "wkv_scale": (np.uint8, (6, 6)), "q_weight": (np.float32, (G, D)),
                "k_weight": (np.float32, (G, D))}
        for name, (dt, shape) in want.items():
            a = getattr(w, name)
            assert a.dtype == dt and a.shape == shape and a.flags.c_contiguous, name
            assert not a.flags.writeable, name
        assert np.array_equal(w.offsets, plan.offsets[L])


def sd_variants(model, L):
    sd = model.state_dict(L)
    raw = {k: (np.asarray(v).view(np.uint8) if k not in ("q_weight", "k_weight") else v) for k, v in sd.items()}
    bf16 = dict(sd, q_weight=sd["q_weight"].astype(ml_dtypes.bfloat16),
                k_weight=sd["k_weight"].astype(ml_dtypes.bfloat16))
    as_bytes = dict(raw, **{"embed.weight": raw["embed.weight"].tobytes()})
    return sd, raw, bf16, as_bytes


def test_from_reference_accepts_ml_dtypes_raw_bytes_and_bf16():
    cfg = small()
    m = EngramModel.init(cfg, seed=5)
    ids = np.array([[1, 5, IMG, 9, 9, 10]])
    h = np.random.default_rng(0).standard_normal((1, 6, 2, 64)).astype(np.float32)
    y = m.forward(4, ids, h)
    for variant in sd_variants(m, 4)[:2] + sd_variants(m, 4)[3:]:
        m2 = EngramModel.from_reference(cfg, {L: (variant if L == 4 else m.state_dict(L)) for L in cfg.layer_ids})
        assert np.array_equal(m2.forward(4, ids, h), y)
    bf = sd_variants(m, 4)[2]
    m3 = EngramModel.from_reference(cfg, {1: m.state_dict(1), 4: bf})
    assert np.array_equal(m3.layer(4).q_weight, bf["q_weight"].astype(np.float32))


def test_from_reference_torch_tensors():
    torch = pytest.importorskip("torch")
    cfg = small()
    m = EngramModel.init(cfg, seed=6)
    sds = {}
    for L in cfg.layer_ids:
        sd = m.state_dict(L)
        sds[L] = {"embed.weight": torch.from_numpy(sd["embed.weight"].view(np.uint8).copy()).view(torch.float8_e4m3fn),
                  "embed.scale": torch.from_numpy(sd["embed.scale"].view(np.uint8).copy()).view(torch.float8_e8m0fnu),
                  "wkv.weight": torch.from_numpy(sd["wkv.weight"].view(np.uint8).copy()).view(torch.float8_e4m3fn),
                  "wkv.scale": torch.from_numpy(sd["wkv.scale"].view(np.uint8).copy()).view(torch.float8_e8m0fnu),
                  "q_weight": torch.from_numpy(sd["q_weight"].copy()).bfloat16(),
                  "k_weight": torch.from_numpy(sd["k_weight"].copy())}
    m2 = EngramModel.from_reference(cfg, sds)
    for L in cfg.layer_ids:
        assert np.array_equal(m2.layer(L).embed_weight, m.layer(L).embed_weight)
        assert np.array_equal(m2.layer(L).wkv_scale, m.layer(L).wkv_scale)
        want_q = sds[L]["q_weight"].float().numpy()
        assert np.array_equal(m2.layer(L).q_weight, want_q)


def test_from_reference_refuses_bad_input():
    cfg = small()
    m = EngramModel.init(cfg, seed=0)
    sd = dict(m.state_dict(1))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        EngramModel.from_reference(cfg, {1: dict(sd, **{"embed.weight": ref.e4m3(sd["embed.weight"])}),
                                         4: m.state_dict(4)})
    with pytest.raises(ValueError, match="missing keys"):
        EngramModel.from_reference(cfg, {1: {k: v for k, v in sd.items() if k != "wkv.scale"}, 4: m.state_dict(4)})
    with pytest.raises(ValueError, match="expected shape"):
        EngramModel.from_reference(cfg, {1: dict(sd, q_weight=np.ones((2, 32), np.float32)), 4: m.state_dict(4)})


def test_dead_positions_have_zero_delta_and_graft_is_zero():
    cfg = small()
    m = EngramModel.init(cfg, seed=1)
    rng = np.random.default_rng(7)
    ids = random_ids(rng, 2, 25)
    h = rng.standard_normal((2, 25, 2, 64)).astype(np.float32)
    y = m.forward(1, ids, h)
    assert not y[ids == IMG].any() and np.abs(y[ids != IMG]).min(axis=-1).max() > 0
    g = EngramModel.init(cfg, seed=1, graft_zero_init=True)
    assert not g.forward(1, ids, h).any()


def test_forward_gate_by_float64():
    """The gate of DESIGN.md 4.8 recomputed in float64 from the oracle's own kv inputs."""
    cfg = small()
    m = EngramModel.init(cfg, seed=3)
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 299, (1, 9))
    h = rng.standard_normal((1, 9, 2, 64)).astype(np.float32)
    y = m.forward(1, ids, h)
    w = m.layer(1)
    rows = m.plan.hash_numpy(ids)[1] + w.offsets
    e = ref.dequant_rows(w, rows).reshape(1, 9, 192).astype(np.float64)
    W = ref.e4m3(w.wkv_weight).astype(np.float64) * np.repeat(np.repeat(ref.e8m0(w.wkv_scale), 32, 0), 32, 1)
    kv = e @ W.T
    key, value = kv[..., :128].reshape(1, 9, 2, 64), kv[..., 128:]
    hd = h.astype(np.float64)
    dot = (hd * w.q_weight * w.k_weight * key).sum(-1) / np.sqrt((hd ** 2).mean(-1) + 1e-20) \
        / np.sqrt((key ** 2).mean(-1) + 1e-20) / 8.0
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    want = gate[..., None] * value[:, :, None, :]
    assert np.allclose(y, want, rtol=2e-4, atol=2e-5 + 2e-4 * np.abs(want).max())


# --- declared sizes and the image token in config.json -------------------------------------------

@pytest.mark.parametrize("key, value, match", [
    ("engram_num_embeddings", 0, "num_embeddings"),
    ("engram_num_embeddings", [], "num_embeddings"),
    ("engram_num_embeddings", [0, 0], "num_embeddings"),
    ("engram_compressed_vocab_size", 0, "compressed_vocab_size"),
])
def test_declared_sizes_of_zero_are_declared_and_wrong(key, value, match):
    """0 and [] are values (wrong ones), not "not declared": refused, where they were ignored."""
    with pytest.raises((ValueError, TypeError), match=match):
        EngramConfig.from_hf_config({**FLASH_HF, key: value})


def test_declared_sizes_of_null_are_not_declared():
    cfg = EngramConfig.from_hf_config({**FLASH_HF, "engram_num_embeddings": None, "engram_compressed_vocab_size": None})
    assert cfg.num_embeddings is None and cfg.compressed_vocab_size is None


def test_image_token_id_null_says_null():
    """`image_token_id: null` reported "got 129264" (the default it had silently taken)."""
    with pytest.raises(ValueError, match="image_token_id.*null") as e:
        EngramConfig.from_hf_config({**FLASH_HF, "image_token_id": None})
    assert "129264" not in str(e.value).split("null")[0]


def test_a_default_image_token_id_out_of_range_says_it_is_the_default():
    with pytest.raises(ValueError, match="129264.*default"):
        EngramConfig.from_hf_config({k: v for k, v in {**FLASH_HF, "vocab_size": 1000}.items()
                                     if k not in ("image_token_id", "engram_compressed_vocab_size")})


def test_weight_dtype_of_a_v41_model():
    m = EngramModel.init(small(), seed=0)
    assert m.weight_dtype == "float8_e4m3fn"
    assert m.with_weight_dtype("float8_e4m3fn") is m
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        m.with_weight_dtype("bfloat16")
