"""qwen3.8-flash-next: config.json, hash geometry and the n-gram hash with its EOS history rule.

Expected values come from outside the code under test: transformers' own Qwen4ExpTextNGramEmbedding
(the row ids its embedding receives, its multiplier buffer, its prime search), third-party copies
of the released config.json, a trial-division prime search and the history rule written out as a
loop.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from engram_stream import EngramConfig, HashPlan

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # plan.hash runs every kernel path

QWEN = "qwen3.8-flash-next"
# the released text_config's PLE keys (Qwen3.8-Flash-Next config.json, as third-party readers copy it)
RELEASED = {"model_type": "qwen4_exp", "image_token_id": 248056,
            "text_config": {"model_type": "qwen4_exp_text", "hidden_size": 2560, "hc_count": 4,
                            "vocab_size": 248320, "eos_token_id": 248044, "rms_norm_eps": 1e-6,
                            "ple_layer_ids": [2], "ple_embed_dim": 2560, "ple_conv_kernel_size": 4,
                            "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20000000,
                            "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 128,
                            "num_hidden_layers": 48}}
TINY = {"model_type": "qwen4_exp_text", "vocab_size": 100, "hidden_size": 16, "hc_count": 2,
        "num_hidden_layers": 6, "ple_layer_ids": [5, 2, 3], "ple_embed_dim": 16, "ngram_size": 3,
        "heads_per_ngram": 2, "ngram_vocab_size_base": 50, "make_ngram_vocab_size_divisible_by": 8,
        "eos_token_id": [7, 9], "seed": 99, "rms_norm_eps": 1e-5, "ple_conv_kernel_size": 3,
        "num_experts": 4, "num_experts_per_tok": 2, "layer_types": ["linear_attention"] * 6}
EOS = 7


def trial_prime(n):
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def primes_after(start, count):
    out, p = [], start
    while len(out) < count:
        p += 1
        if trial_prime(p):
            out.append(p)
    return out


def rule_windows(ids, n, eos):
    """The history rule as a loop: shift s of position p reads ids[p-s] unless p-s < 0 or an EOS is
    among ids[p-s .. p-1]; then it reads EOS."""
    out = np.empty(ids.shape + (n,), np.int64)
    for b in range(ids.shape[0]):
        for p in range(ids.shape[1]):
            for s in range(n):
                ok = s == 0 or (p - s >= 0 and eos not in ids[b, p - s:p])
                out[b, p, s] = ids[b, p - s] if ok else eos
    return out


def loop_rows(plan, L, ids):
    """Head-local rows from rule_windows: wrapping int64 XOR of window * multiplier, floored mod."""
    cfg = plan.cfg
    win = rule_windows(ids, cfg.max_ngram_size, cfg.pad_id)
    mult = [int(m) for m in plan.multipliers[L]]
    out = np.empty(ids.shape + (cfg.n_heads,), np.int64)
    wrap = lambda v: (v + (1 << 63)) % (1 << 64) - (1 << 63)  # noqa: E731
    for idx in np.ndindex(ids.shape):
        j = 0
        for n in range(2, cfg.max_ngram_size + 1):
            mix = 0
            for k in range(n):
                mix ^= wrap(int(win[idx][k]) * mult[k])
            for p in plan.primes[L][n - 2]:
                out[idx + (j,)] = mix % p
                j += 1
    return out


def eos_ids(rng, shape, vocab=100, eos=EOS):
    """Random ids with EOS at the start, in the middle, twice in a row and at the end."""
    ids = rng.integers(0, vocab, shape).astype(np.int64)
    ids[rng.random(shape) < 0.15] = eos
    ids[0, 0] = eos
    if shape[1] > 6:
        ids[0, 4:6] = eos
        ids[-1, -1] = eos
    return ids


# --- config.json -------------------------------------------------------------------------------------
def test_released_config_geometry():
    cfg = EngramConfig.from_hf_config(RELEASED)
    assert cfg.variant == QWEN
    assert (cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.pad_id, cfg.layer_ids) == (2560, 4, 248320, 248044, [2])
    assert (cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.n_heads, cfg.head_dim, cfg.engram_dim) == (3, 8, 16, 160, 2560)
    assert (cfg.kernel_size, cfg.seed, cfg.norm_eps, cfg.table_rows_multiple, cfg.table_parts) == (4, 1234, 1e-6, 128, 128)
    plan = HashPlan(cfg)
    want = primes_after(20_000_000 - 1, 16)
    assert plan.head_primes[2].tolist() == want
    assert plan.offsets[2].tolist() == [sum(want[:i]) for i in range(16)]
    assert plan.table_rows[2] == -(-sum(want) // 128) * 128 and plan.table_rows[2] % 128 == 0
    assert sum(want) <= plan.table_rows[2] < sum(want) + 128


def test_released_config_against_transformers_functions():
    m = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    plan = HashPlan(EngramConfig.from_hf_config(RELEASED))
    assert plan.head_primes[2].tolist() == [m._find_nth_prime_after(20_000_000 - 1, k + 1) for k in range(16)]
    assert plan.multipliers[2].tolist() == m._build_layer_multipliers(248320, 3, 0, 1234).tolist()


def test_flat_and_nested_config_agree_and_eos_list_takes_the_first():
    flat = EngramConfig.from_hf_config(TINY)
    nested = EngramConfig.from_hf_config({"model_type": "qwen4_exp", "eos_token_id": 1, "text_config": TINY})
    assert flat == nested
    assert flat.pad_id == 7 and flat.layer_ids == [2, 3, 5]  # sorted, as transformers sorts ple_layer_ids
    assert (flat.seed, flat.norm_eps, flat.kernel_size, flat.table_rows_multiple) == (99, 1e-5, 3, 8)
    assert EngramConfig.from_hf_config(flat.to_hf_config()) == flat


def test_defaults_are_transformers_defaults():
    tf = pytest.importorskip("transformers.models.qwen4_exp.configuration_qwen4_exp")
    cfg = EngramConfig.from_hf_config({"model_type": "qwen4_exp_text", "ple_layer_ids": [1], "eos_token_id": 3})
    t = tf.Qwen4ExpTextConfig(ple_layer_ids=[1], eos_token_id=3)
    assert (cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.norm_eps, cfg.kernel_size, cfg.max_ngram_size,
            cfg.n_head_per_ngram, cfg.engram_vocab_size[0], cfg.table_rows_multiple, cfg.seed, cfg.table_parts) == \
        (t.hidden_size, t.hc_count, t.vocab_size, t.rms_norm_eps, t.ple_conv_kernel_size, t.ngram_size,
         t.heads_per_ngram, t.ngram_vocab_size_base, t.make_ngram_vocab_size_divisible_by, t.seed, t.split_ngram_parts)
    assert cfg.engram_dim == t.ple_embed_dim  # defaults to hidden_size


@pytest.mark.parametrize("bad, needle", [
    ({"ple_layer_ids": []}, "no PLE"),
    ({"eos_token_id": None}, "eos_token_id"),
    ({"eos_token_id": []}, "eos_token_id"),
    ({"ple_embed_dim": 18}, "divisible"),
])
def test_config_json_refusals(bad, needle):
    with pytest.raises(ValueError, match=needle):
        EngramConfig.from_hf_config({**TINY, **bad})


def test_engram_config_refusals():
    base = EngramConfig.from_hf_config(TINY).to_dict()
    for bad, needle in [({"layer_ids": [5, 2]}, "sorted"), ({"engram_vocab_size": [50, 51]}, "one value"),
                        ({"norm_eps": 0.0}, "norm_eps"), ({"table_rows_multiple": 0}, "table_rows_multiple"),
                        ({"image_token_id": 3}, "image_token_id")]:
        with pytest.raises(ValueError, match=needle):
            EngramConfig(**{**base, **bad})


# --- the hash ---------------------------------------------------------------------------------------
def test_hash_equals_the_history_rule_as_a_loop():
    plan = HashPlan(EngramConfig.from_hf_config(TINY))
    rng = np.random.default_rng(1)
    ids = eos_ids(rng, (3, 150))  # past the kernel's 64-position blocks
    fast, slow = plan.hash(ids), plan.hash_numpy(ids)
    for L in plan.cfg.layer_ids:
        want = loop_rows(plan, L, ids)
        np.testing.assert_array_equal(slow[L], want)
        np.testing.assert_array_equal(fast[L], want)


def test_an_eos_keeps_its_own_history_and_cuts_the_next_ones():
    """ids a b EOS c: the EOS position's trigram is (EOS, b, a); c's is (c, EOS, EOS)."""
    plan = HashPlan(EngramConfig.from_hf_config(TINY))
    L = 2
    a, b, c = 11, 12, 13
    rows = plan.hash(np.array([[a, b, EOS, c]]))[L][0]
    alone = lambda seq: plan.hash(np.array([seq]))[L][0, -1]  # noqa: E731
    np.testing.assert_array_equal(rows[2], alone([a, b, EOS]))
    np.testing.assert_array_equal(rows[3], alone([EOS, EOS, c]))
    np.testing.assert_array_equal(rows[3], alone([c]))            # history before the start reads EOS
    assert not np.array_equal(rows[2], alone([EOS, EOS, EOS]))   # not V4.1's DEAD rule (which cuts the EOS itself)


def _transformers_rows(tcfg, ids, torch, module):
    """{L: the row ids the embedding of each PLE layer receives} for ids[B, T], no cache."""
    out = {}
    for i, L in enumerate(tcfg.ple_layer_ids):
        emb = module.Qwen4ExpTextNGramEmbedding(tcfg, tcfg.ple_embed_dim, L - 1, i)
        got = {}
        hook = emb.ngram_embedding.register_forward_hook(lambda mod, inp, o: got.__setitem__("rows", inp[0]))
        with torch.no_grad():
            emb(torch.from_numpy(ids), None)
        hook.remove()
        out[L] = (got["rows"].numpy(), emb)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hash_equals_transformers(seed):
    torch = pytest.importorskip("torch")
    module = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    tcfg = Qwen4ExpTextConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    plan = HashPlan(EngramConfig.from_hf_config(TINY))
    ids = eos_ids(np.random.default_rng(seed), (3, 90))
    fast, slow = plan.hash(ids), plan.hash_numpy(ids)
    for L, (rows, emb) in _transformers_rows(tcfg, ids, torch, module).items():
        np.testing.assert_array_equal(fast[L] + plan.offsets[L], rows)
        np.testing.assert_array_equal(slow[L] + plan.offsets[L], rows)
        np.testing.assert_array_equal(plan.multipliers[L], emb.layer_multipliers.numpy())
        np.testing.assert_array_equal(plan.head_primes[L], emb.ngram_heads_vocab_sizes.numpy())
        np.testing.assert_array_equal(plan.offsets[L], emb.ngram_heads_offsets.numpy())
        assert plan.table_rows[L] == emb.ngram_embedding.weight.shape[0]
