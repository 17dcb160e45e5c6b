"""What the LongCat serving tests (test_vllm_longcat.py, test_sglang_longcat.py, tests/gpu) share: a small
LongCat geometry, the frameworks' view of its config, a batch with EOS positions and the n-gram ids
vLLM 0.33.0's ngram_compute_n_gram_ids kernel gives for it (a CUDA kernel: written out here from its
source). No framework import."""
from __future__ import annotations

import types

import numpy as np
import torch

HF = {"model_type": "longcat_flash_ngram", "architectures": ["LongcatFlashNgramForCausalLM"], "vocab_size": 97,
      "hidden_size": 48, "emb_neighbor_num": 4, "emb_split_num": 2, "ngram_vocab_size_ratio": 5, "eos_token_id": 2}


def framework_config(dtype=torch.bfloat16):
    """What vLLM's LongcatFlashConfig gives its NgramEmbedding (the keys it reads; SGLang's takes them too)."""
    keys = ("vocab_size", "hidden_size", "emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio", "eos_token_id")
    return types.SimpleNamespace(**{k: HF[k] for k in keys}, pad_token_id=0, torch_dtype=dtype)


def kernel_ids(cfg, reqs):
    """vLLM 0.33.0's ngram_compute_n_gram_ids for requests from their start (LongcatNgramModelState:
    context -1, EOS negated): per position and embedder c = i*k + j (order i+2), sum over
    delta < i+2 of token[t-delta] * ne_weights mod ne_mod, the walk stopping at a negative token or
    the context's start; plus the embedder's offset. int64 [T, E]."""
    n, k, V = cfg.emb_neighbor_num, cfg.emb_split_num, cfg.vocab_size
    m = cfg.ngram_vocab_size_ratio * V
    sizes = [m + 2 * c + 1 for c in range(k * (n - 1))]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out = []
    for toks in reqs:
        table = [-1] * (n - 1) + [-t if t == cfg.eos_token_id else int(t) for t in toks]
        for p in range(n - 1, len(table)):
            row = []
            for i in range(n - 1):
                for j in range(k):
                    c = i * k + j
                    acc = 0
                    for d in range(i + 2):
                        if table[p - d] < 0:
                            break
                        acc += table[p - d] * pow(V, d, sizes[c]) % sizes[c]
                    row.append(acc % sizes[c] + offsets[c])
            out.append(row)
    return torch.tensor(out, dtype=torch.int64)


def batch(cfg, rng):
    """Two requests from their start with EOS inside (one at the start, a run of two)."""
    a = rng.integers(0, cfg.vocab_size, 13)
    a[[0, 6, 7]] = cfg.eos_token_id
    b = rng.integers(0, cfg.vocab_size, 9)
    b[4] = cfg.eos_token_id
    return [a, b]
