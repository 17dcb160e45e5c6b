#!/usr/bin/env python
"""transformers' DeepSeek-V4 generate() with and without a V4.1 Engram (engram_stream.integrations).

    flock /tmp/bench.lock python bench/bench_transformers.py           # tiny and Flash-dim Engram
    flock /tmp/bench.lock python bench/bench_transformers.py --quick   # tiny only, fewer repetitions

Per case, measured side by side in one run (the contenders take turns, the order rotating every
repetition; medians, and the median of per-repetition ratios beside as the paired check):
  plain     ms per decode step of generate() without the Engram: (t(n tokens) - t(1)) / (n - 1)
  engram    the same with attach(): the added time is the Engram's whole cost in the loop
  hooks     the time spent inside the hooks per decode step (handle.counts["seconds"])
  engines   the floor: the same decode steps through the Decoder alone (begin, layer per Engram
            layer) on bf16 hidden states of the same shape, no transformers around it
and the hooks' overhead over the engines. Cases:
  tiny      the example's model (hidden 64, hc 2, 5 layers, Engram on 1 and 4), fp32, batch 2
  flash     the Engram at DeepSeek-V4.1-Flash dims (hidden 5120, hc 4, 24 x 256 rows, wkv
            [25600, 6144] float8; table rows scaled down) on layers 1 and 3 of a 4-layer V4
            model at hidden 5120 whose other dims are small, bf16 (as V4.1 runs), batch 1 and 4
torch runs one thread (torch.set_num_threads(1)); the engines run their defaults (step_threads 1).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from _lib.common import machine  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.io.safetensors import DTYPES  # noqa: E402
from engram_stream.v41 import hf as hf_v41  # noqa: E402

try:  # the transformers extra; without it --help still works and a run says what to install
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from engram_stream.integrations.transformers import attach
except ImportError as e:
    torch = None
    MISSING = e


def v4_model(hidden, hc, layers, dtype, vocab=300, small=True):
    kw = dict(vocab_size=vocab, hidden_size=hidden, hc_mult=hc, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32 if hidden < 1024 else 64, qk_rope_head_dim=8, q_lora_rank=32,
              o_groups=2, o_lora_rank=16, moe_intermediate_size=32 if hidden < 1024 else 128, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2, index_head_dim=16, index_topk=4,
              sliding_window=64, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=1,
              layer_types=["sliding_attention"] * layers)
    config = DeepseekV4Config(**kw)
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM._from_config(config, dtype=dtype).eval()


def cases(quick):
    tiny_cfg = EngramConfig(variant="deepseek-v4.1", layer_ids=[1, 4], hidden_size=64, hc_mult=2, vocab_size=300,
                            image_token_id=299, max_ngram_size=4, n_head_per_ngram=2, n_embed_per_ngram=64,
                            engram_vocab_size=[211] * 3, pad_id=2)
    yield "tiny", lambda: (v4_model(64, 2, 5, torch.float32), EngramModel.init(tiny_cfg, seed=0)), [2]
    if not quick:
        flash = hf_v41.flash_config(engram_vocab_size=20000, engram_layer_ids=[1, 3], vocab_size=1000,
                                    image_token_id=999)
        yield "flash", lambda: (v4_model(5120, 4, 4, torch.bfloat16, vocab=1000), EngramModel.init(flash, seed=0)), [1, 4]


def prompts(batch, vocab, image, rng, length=24):
    ids = rng.integers(2, vocab - 1, (batch, length))
    ids[0, 5:9] = image   # an image span in the first row
    return torch.from_numpy(ids), torch.ones(batch, length, dtype=torch.long)


def gen_seconds(lm, ids, mask, n):
    t0 = time.perf_counter()
    with torch.no_grad():
        lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return time.perf_counter() - t0


def engines_alone(engram, batch, n, dtype):
    """Seconds per decode step of the Decoder alone: begin(ids) and every layer on [B, G, D] bf16/f32."""
    cfg = engram.cfg
    dec = engram.decoder(n_streams=batch)
    rng = np.random.default_rng(1)
    h = torch.randn(batch, cfg.hc_mult, cfg.hidden_size, dtype=dtype)
    hn = h.view(torch.int16).numpy().view(DTYPES["BF16"]) if dtype == torch.bfloat16 else h.numpy()
    ids = rng.integers(2, min(cfg.vocab_size, 1000) - 1, (n, batch))
    t0 = time.perf_counter()
    for t in range(n):
        dec.begin(ids[t])
        for L in cfg.layer_ids:
            dec.layer(L, hn)
    return (time.perf_counter() - t0) / n


def run_case(name, make, batches, reps, n):
    lm, engram = make()
    dtype = lm.dtype
    out = []
    for B in batches:
        rng = np.random.default_rng(B)
        ids, mask = prompts(B, lm.config.vocab_size, engram.cfg.image_token_id, rng)
        handle = attach(lm, engram)
        handle.detach()
        gen_seconds(lm, ids, mask, 2)   # warm-up
        times = {"plain": [], "engram": [], "hooks": [], "engines": []}
        for r in range(reps):
            order = ["plain", "engram", "engines"]
            order = order[r % 3:] + order[:r % 3]
            for who in order:
                if who == "engines":
                    times["engines"].append(engines_alone(engram, B, n, dtype))
                    continue
                if who == "engram":
                    handle = attach(lm, engram)
                t1 = gen_seconds(lm, ids, mask, 1)
                if who == "engram":
                    c1 = handle.counts
                tn = gen_seconds(lm, ids, mask, n)
                if who == "engram":
                    c2 = handle.counts
                    handle.detach()
                    # hooks per decode step: the n-token run's hook time minus its prefill's (~ the 1-token run's)
                    times["hooks"].append(((c2["seconds"] - c1["seconds"]) - c1["seconds"]) / (n - 1))
                times[who].append((tn - t1) / (n - 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        paired = statistics.median(e - p for e, p in zip(times["engram"], times["plain"]))
        row = {"case": name, "batch": B, "dtype": str(dtype).replace("torch.", ""), "reps": reps, "tokens": n,
               **{f"{k}_ms": 1e3 * v for k, v in med.items()}, "added_ms": 1e3 * (med["engram"] - med["plain"]),
               "added_paired_ms": 1e3 * paired, "hooks_over_engines": med["hooks"] / med["engines"]}
        out.append(row)
        print(f"{name:6s} B={B} {row['dtype']:8s} per decode step: plain {row['plain_ms']:7.2f} ms | with Engram "
              f"{row['engram_ms']:7.2f} ms (+{row['added_ms']:.2f}, paired +{row['added_paired_ms']:.2f}) | in hooks "
              f"{row['hooks_ms']:6.2f} ms | engines alone {row['engines_ms']:6.2f} ms | hooks / engines "
              f"{row['hooks_over_engines']:.2f}x", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    if torch is None:
        sys.exit(f"bench_transformers.py needs torch and transformers ({MISSING}): "
                 "pip install -c .ci/constraints.txt '.[transformers]'")
    torch.set_num_threads(1)
    import transformers
    info = machine(torch=torch.__version__, transformers=transformers.__version__)
    print(json.dumps(info))
    reps = a.reps or (3 if a.quick else 5)
    rows = []
    for name, make, batches in cases(a.quick):
        rows += run_case(name, make, batches, reps, a.tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
