"""transformers' DeepSeek-V4 model generating with a DeepSeek-V4.1 Engram served by engram_stream.

    python examples/transformers_generate.py        # needs torch and transformers >= 5.24

A tiny random DeepseekV4ForCausalLM (5 layers, hidden 64, 2 hyper-connection streams) and a tiny
random V4.1 Engram on its layers 1 and 4; greedy generate() of a batch of two prompts, the
second one shorter (left-padded) and holding an image span (image tokens are DEAD for the
Engram). With the released weights, both come from one folder: see the README, "DeepSeek-V4.1
in transformers".
"""
import time

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from engram_stream import EngramConfig, EngramModel
from engram_stream.integrations.transformers import attach

torch.set_num_threads(1)   # a tiny model: handing its small matmuls to a thread pool costs more than they do

config = DeepseekV4Config(
    vocab_size=300, hidden_size=64, hc_mult=2, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2, index_head_dim=16, index_topk=4,
    sliding_window=8, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1)
torch.manual_seed(0)
lm = DeepseekV4ForCausalLM(config).eval()
engram = EngramModel.init(EngramConfig(
    variant="deepseek-v4.1", layer_ids=[1, 4], hidden_size=64, hc_mult=2, vocab_size=300, image_token_id=299,
    max_ngram_size=4, n_head_per_ngram=2, n_embed_per_ngram=64, engram_vocab_size=[211] * 3, pad_id=2), seed=0)

IMAGE = engram.cfg.image_token_id
prompts = [[5, 17, 42, 8, 9, 10, 11, 12], [21, 22, IMAGE, IMAGE, IMAGE, 23]]
width = max(map(len, prompts))
ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])


def generate(n):
    """(new tokens [2, n], seconds) of one greedy generate()."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[:, width:], time.perf_counter() - t0


def step_ms(n=8, repeat=3):
    """Milliseconds per decode step (both rows), prefill excluded: median over runs of
    (time of n tokens - time of 1 token) / (n - 1)."""
    runs = sorted((generate(n)[1] - generate(1)[1]) / (n - 1) for _ in range(repeat))
    return 1e3 * runs[len(runs) // 2]


N = 12
generate(2)                                    # warm-up (first calls allocate)
plain, _ = generate(N)
t_plain = step_ms()
with attach(lm, engram) as handle:             # hooks on lm.model.layers[1] and [4]
    with_engram, _ = generate(N)
    counts = handle.counts                     # of that generate(): the prompts, then N - 1 steps
    t_engram = step_ms()
    before = handle.counts["seconds"]
    generate(1)
    prefill = handle.counts["seconds"] - before
    generate(N)
    hooks = (handle.counts["seconds"] - before - 2 * prefill) / (N - 1)   # seconds in the hooks per decode step

for b, p in enumerate(prompts):
    shown = ["<img>" if t == IMAGE else str(t) for t in p]
    print(f"prompt {b}: {' '.join(shown)}")
    print(f"  without Engram: {plain[b].tolist()}")
    print(f"  with Engram:    {with_engram[b].tolist()}")
print(f"Engram calls: {counts['prefill_tokens']} prompt tokens prefilled, {counts['decode_steps']} multi-stream "
      f"decode steps")
print(f"time per token (a decode step of the batch of 2): {t_plain:.1f} ms without Engram, {t_engram:.1f} ms with "
      f"({1e3 * hooks:.2f} ms of it in the Engram hooks)")
