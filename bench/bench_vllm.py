#!/usr/bin/env python
"""The vLLM plugin's host side: StreamEngramEmbedding.lookup filling vLLM's bf16 staging rows
[T, 24, 256] with every row in the row cache (warm), against engram_stream's lookup_packed of the
same rows (bf16) from tables in RAM. Needs vLLM 0.33.0 (tools/ci_vllm.sh's venv); vLLM's own
kernel is not run (no GPU), only its module's classes.

    flock /tmp/bench.lock python bench/bench_vllm.py                  # 16-request decode, 4096-token chunk
    flock /tmp/bench.lock python bench/bench_vllm.py --rows 50000      # rows per head of the table

Flash dims (24 heads x 256, 264-byte records), random rows; the rows a call reads are the hashes
of random token ids (plan.hash), the same rows for both. Goal (issue): warm <= 1.1x lookup_packed.
Rounds interleaved, ratios of medians; the machine is shared, absolute times indicative only.
"""
import argparse
import json
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from common import machine  # noqa: E402
from engram_stream import EngramModel  # noqa: E402
from engram_stream.v41.hf import flash_config  # noqa: E402

LAYER = 1


def stub_vllm():
    """vLLM's engram module on one CPU process (TP 1), as the tests run it."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import vllm.models.deepseek_v41.common.engram as E
    E.get_tensor_model_parallel_world_size = lambda: 1
    E.get_tensor_model_parallel_rank = lambda: 0
    return E


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000, help="engram_vocab_size: rows per head ~ this")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    import torch
    stub_vllm()
    from engram_stream.integrations import vllm as plugin
    cfg = flash_config(engram_vocab_size=a.rows, engram_layer_ids=[LAYER])
    ram = EngramModel.init(cfg, seed=0)                      # tables in RAM: lookup_packed's
    cached = EngramModel.init(cfg, seed=0)._with_tiers(None, 1 << 16)   # every row fits the row cache
    plan = ram.plan
    sizes = tuple(int(p) for p in plan.head_primes[LAYER])
    emb = plugin.embedding_class()(cached, LAYER, plan.table_rows[LAYER], cfg.head_dim, sizes)
    H = len(sizes)
    rng = np.random.default_rng(0)
    results = {}
    for name, S, T in (("decode: 16 requests x 1 token", 16, 1), ("prompt chunk: 4096 tokens", 1, 4096)):
        eng = ram.stream(LAYER, n_streams=S)
        N = S * T
        ids = rng.integers(0, cfg.vocab_size, N).astype(np.int64)
        streams = np.arange(S, dtype=np.int64)
        lengths = np.full(S, T, np.int64)
        # the rows lookup_packed reads: each stream's tokens hashed from a fresh window
        rows = plan.hash(ids.reshape(S, T))[LAYER].reshape(N, H) + plan.offsets[LAYER]
        idx = torch.from_numpy(rows.astype(np.int32))
        out = torch.empty(N, H, cfg.head_dim, dtype=torch.bfloat16)
        emb.lookup(idx, out)                                 # warm: every row now cached
        eng.reset()
        want = eng.lookup_packed(ids, streams, lengths, dtype="bfloat16")
        assert np.array_equal(out.view(torch.int16).numpy().reshape(N, -1), want.view(np.int16)), \
            "the plugin's rows differ from lookup_packed's"
        t_plugin, t_packed = [], []
        for r in range(a.reps):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                if which == 0:
                    t0 = time.perf_counter()
                    emb.lookup(idx, out)
                    t_plugin.append(time.perf_counter() - t0)
                else:
                    eng.reset()
                    t0 = time.perf_counter()
                    eng.lookup_packed(ids, streams, lengths, dtype="bfloat16")
                    t_packed.append(time.perf_counter() - t0)
        mp, mk = float(np.median(t_plugin)), float(np.median(t_packed))
        results[name] = {"plugin_warm_ms": mp * 1e3, "lookup_packed_ms": mk * 1e3, "ratio": mp / mk,
                         "rows": N * H}
        print(f"{name}: plugin warm {mp * 1e3:.3f} ms, lookup_packed {mk * 1e3:.3f} ms, ratio {mp / mk:.2f}")
    st = cached.row_cache_stats()
    print(json.dumps({"results": results, "cache_hits": st["hits"], "cache_misses": st["misses"],
                      "machine": machine(torch=torch.__version__)}, indent=1))


if __name__ == "__main__":
    main()
