"""attach(): engram_stream serving the PLE layers inside transformers' own Qwen4-Exp model, through
the one attach of engram_stream.integrations.transformers (it chooses by the model it is given).

Expected values come from the same transformers model with its own PLE layers: a forward's logits,
and generate()'s tokens (greedy, left-padded batch, EOS in the prompt)."""
from __future__ import annotations

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from engram_stream.integrations.transformers import attach  # noqa: E402

pytestmark = pytest.mark.native

EOS = 7
HF = {"vocab_size": 64, "hidden_size": 16, "hc_count": 2, "num_hidden_layers": 4, "ple_layer_ids": [1, 3],
      "ple_embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 50,
      "make_ngram_vocab_size_divisible_by": 8, "eos_token_id": EOS, "pad_token_id": 0, "split_ngram_parts": 4,
      "rms_norm_eps": 1e-5, "hc_lowrank": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "shared_expert_intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
      "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
      "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
      "indexer_compress_ratio": 4,
      "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"]}


@pytest.fixture(scope="module")
def lm_and_ple():
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    torch.manual_seed(0)
    lm = M.Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**HF)).float().eval()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".ple." in name:  # its init leaves norms and taps 0: a PLE that matters
                p.normal_(0, 0.5)
    cfg = EngramConfig.from_hf_config({**HF, "model_type": "qwen4_exp_text"})
    ple = EngramModel.from_reference(cfg, {L: lm.model.layers[L - 1].ple.state_dict() for L in cfg.layer_ids})
    return lm, ple


def _batch():
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 64, (3, 12))
    ids[0, 4] = ids[1, 2:4] = EOS
    mask = np.ones_like(ids)
    ids[2, :5], mask[2, :5] = 0, 0  # left padding
    return torch.from_numpy(ids), torch.from_numpy(mask)


def test_logits_equal_the_models_own(lm_and_ple):
    lm, ple = lm_and_ple
    ids, mask = _batch()
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=mask).logits
        with attach(lm, ple):
            got = lm(input_ids=ids, attention_mask=mask).logits
        again = lm(input_ids=ids, attention_mask=mask).logits  # detached: the model's own PLE again
        with attach(lm, EngramModel.init(ple.cfg, seed=1)):  # other PLE weights: the PLE shows in the logits
            other = lm(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(again, want)
    assert (other[real] - want[real]).abs().max() > 1e-2


def test_generate_gives_the_models_own_tokens(lm_and_ple):
    lm, ple = lm_and_ple
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = lm.generate(**kw)
        with attach(lm, ple):
            got = lm.generate(**kw)
            got2 = lm.generate(**kw)  # a second generate starts fresh
    assert torch.equal(got, want) and torch.equal(got2, want)


def test_attach_refuses_another_ple(lm_and_ple):
    lm, _ = lm_and_ple
    other = EngramModel.init(EngramConfig.from_hf_config({**HF, "model_type": "qwen4_exp_text",
                                                           "ple_layer_ids": [1]}), seed=0)
    with pytest.raises(ValueError, match="ple_layer_ids"):
        attach(lm, other)


def test_one_attach_serves_both_kinds_and_refuses_a_mismatch(lm_and_ple):
    """The README's `from engram_stream.integrations.transformers import attach` refused a
    Qwen4ExpForCausalLM ("needs a transformers DeepSeek-V4 model"): one attach, chosen by the
    model, and no second public attach elsewhere."""
    from engram_stream.integrations import transformers as tr, transformers_qwen
    lm, ple = lm_and_ple
    with attach(lm, ple) as handle:
        assert type(handle) is transformers_qwen.Handle
        assert all(type(layer.ple) is transformers_qwen.StreamPLE for L, layer in enumerate(lm.model.layers, 1)
                   if L in ple.cfg.layer_ids)
    assert not any(type(layer.ple) is transformers_qwen.StreamPLE for layer in lm.model.layers)
    assert not hasattr(transformers_qwen, "attach") and "attach" not in transformers_qwen.__all__
    assert "attach" in tr.__all__
    v41 = EngramModel.init(EngramConfig(variant="deepseek-v4.1", engram_vocab_size=[211, 211, 211], max_ngram_size=4,
                                        n_embed_per_ngram=64, n_head_per_ngram=2, layer_ids=[1, 3], hidden_size=32,
                                        hc_mult=2, vocab_size=64, image_token_id=63), seed=0)
    with pytest.raises(TypeError, match="qwen3.8-flash-next EngramModel .* got a deepseek-v4.1 EngramModel"):
        attach(lm, v41)
    with pytest.raises(TypeError, match=r"DeepSeek-V4 model.*; a Qwen4-Exp model.* got Linear"):
        attach(torch.nn.Linear(2, 2), ple)
