#!/usr/bin/env python
"""Generate the Qwen3.8-Flash-Next (PLE) golden vectors in tests/data/golden_qwen_<name>.npz.

What this is
------------
An INDEPENDENT re-implementation, in torch, of the PLE layer of transformers' Qwen4-Exp
(models/qwen4_exp/modeling_qwen4_exp.py: Qwen4ExpTextNGramEmbedding, Qwen4ExpTextPLELayer,
Qwen4ExpTextRMSNorm), written from its semantics: it imports neither transformers nor
engram_stream. The package is tested against what this script writes.

How it differs in form (not in result) from transformers:
  * the history rule walks each sequence once, keeping the last ngram_size-1 ids of the current
    document (reset to EOS after an EOS, EOS before the start), instead of cummax over EOS positions;
  * primes by a trial-division walk upwards from ngram_vocab_size_base;
  * the conv is F.conv1d on the zero-padded sequence (no cache).

Each npz holds
  config_json      the Hugging Face config.json keys (flat, qwen4_exp_text)
  ids              int64[B, T]        raw ids (EOS at the start, in runs, at the end)
  hidden           float32[B, T, G, D]
  L{L}.multipliers int64[ngram_size]
  L{L}.primes      int64[H]           order-major
  L{L}.offsets     int64[H]
  L{L}.table_rows  int64[]            padded rows
  L{L}.rows        int64[B, T, H]     absolute table rows
  L{L}.sd.<name>   Qwen4ExpTextPLELayer's parameters, float32
  L{L}.out         float32[B, T, G, D] the PLE output, float32

Regenerate:  python tools/goldens/qwen.py [NAME ...]      (torch and numpy only)
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch

MASK = (1 << 64) - 1
GAMMA, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

CONFIGS = {
    # two PLE layers (unsorted in the file), 3-grams, 2 streams
    "hc2_n3_two_layers": dict(vocab_size=120, hidden_size=24, hc_count=2, ple_layer_ids=[4, 2], ple_embed_dim=24,
                              ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=97,
                              make_ngram_vocab_size_divisible_by=16, eos_token_id=[5, 6], seed=1234,
                              rms_norm_eps=1e-6, ple_conv_kernel_size=4, split_ngram_parts=4, B=2, T=37),
    # 4-grams, 4 streams, another seed and eps, a large divisor
    "hc4_n4_seed7": dict(vocab_size=300, hidden_size=16, hc_count=4, ple_layer_ids=[1], ple_embed_dim=48,
                         ngram_size=4, heads_per_ngram=4, ngram_vocab_size_base=211,
                         make_ngram_vocab_size_divisible_by=128, eos_token_id=299, seed=7, rms_norm_eps=1e-5,
                         ple_conv_kernel_size=3, split_ngram_parts=2, B=3, T=29),
}


def splitmix64(v):
    v = (v + GAMMA) & MASK
    v = ((v ^ (v >> 30)) * M1) & MASK
    v = ((v ^ (v >> 27)) * M2) & MASK
    return (v ^ (v >> 31)) & MASK


def is_prime_trial(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def geometry(c):
    """{L: (multipliers, primes, offsets, padded rows)} in sorted ple_layer_ids order."""
    layers = sorted(set(c["ple_layer_ids"]))
    H = (c["ngram_size"] - 1) * c["heads_per_ngram"]
    primes, p = [], c["ngram_vocab_size_base"] - 1
    while len(primes) < H * len(layers):
        p += 1
        if is_prime_trial(p):
            primes.append(p)
    half = max(1, ((1 << 63) - 1) // c["vocab_size"] // 2)
    out = {}
    for i, L in enumerate(layers):
        base = c["seed"] + 10007 * i
        mult = [2 * (splitmix64((base + GAMMA * (k + 1)) & MASK) % half) + 1 for k in range(c["ngram_size"])]
        mine = primes[i * H:(i + 1) * H]
        offsets = [sum(mine[:j]) for j in range(H)]
        m = c["make_ngram_vocab_size_divisible_by"]
        out[L] = (mult, mine, offsets, -(-sum(mine) // m) * m)
    return out


def windows(c, ids, eos):
    """[B, T, n] ids at p, p-1, ...: the document's last ids, EOS once past its start."""
    n = c["ngram_size"]
    out = np.empty(ids.shape + (n,), np.int64)
    for b in range(ids.shape[0]):
        hist = [eos] * (n - 1)        # newest first; before the start: EOS
        for t, tok in enumerate(ids[b]):
            out[b, t] = [tok] + hist
            hist = [eos] * (n - 1) if tok == eos else [int(tok)] + hist[:-1]
    return out


def hash_rows(c, win, mult, primes, offsets):
    def wrap(v):
        return (v + (1 << 63)) % (1 << 64) - (1 << 63)
    B, T, n = win.shape
    hp = c["heads_per_ngram"]
    rows = np.empty((B, T, len(primes)), np.int64)
    for b in range(B):
        for t in range(T):
            for order in range(2, n + 1):
                mix = 0
                for k in range(order):
                    mix ^= wrap(int(win[b, t, k]) * mult[k])
                for j in range(hp):
                    h = (order - 2) * hp + j
                    rows[b, t, h] = mix % primes[h] + offsets[h]   # Python's % is floored
    return rows


def rms(x, w, group, eps):
    g = x.reshape(*x.shape[:-1], -1, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g.reshape(x.shape) * (1.0 + w)


def ple(c, sd, rows, hidden):
    G, D = c["hc_count"], c["hidden_size"]
    B, T = rows.shape[:2]
    e = sd["ple_embedding.ngram_embedding.weight"][torch.from_numpy(rows)].reshape(B, T, -1)
    key = rms(e @ sd["key_proj.weight"].T, sd["norm_key.weight"], D, c["rms_norm_eps"]).reshape(B, T, G, D)
    value = e @ sd["value_proj.weight"].T
    q = rms(torch.from_numpy(hidden).reshape(B, T, G * D), sd["norm_query.weight"], D,
            c["rms_norm_eps"]).reshape(B, T, G, D)
    s = (key * q).sum(-1, keepdim=True) / math.sqrt(D)
    s = torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=1e-6))
    gated = (torch.sigmoid(s) * value[:, :, None, :]).reshape(B, T, G * D)
    x = rms(gated, sd["norm_conv.weight"], D, c["rms_norm_eps"]).transpose(1, 2)
    K, dil = c["ple_conv_kernel_size"], c["ngram_size"]
    y = torch.nn.functional.conv1d(torch.nn.functional.pad(x, ((K - 1) * dil, 0)), sd["conv1d.weight"],
                                   groups=G * D, dilation=dil)
    return (gated + torch.nn.functional.silu(y.transpose(1, 2))).reshape(B, T, G, D)


def generate(name):
    spec = dict(CONFIGS[name])
    B, T = spec.pop("B"), spec.pop("T")
    c = {**spec, "model_type": "qwen4_exp_text"}
    eos = c["eos_token_id"][0] if isinstance(c["eos_token_id"], list) else c["eos_token_id"]
    rng = np.random.default_rng(sum(map(ord, name)))
    torch.manual_seed(sum(map(ord, name)))
    ids = rng.integers(0, c["vocab_size"], (B, T)).astype(np.int64)
    ids[rng.random((B, T)) < 0.15] = eos
    ids[0, 0] = eos
    ids[-1, 3:5] = eos
    ids[:, -1] = eos
    G, D, E = c["hc_count"], c["hidden_size"], c["ple_embed_dim"]
    hidden = rng.standard_normal((B, T, G, D)).astype(np.float32)
    out = {"config_json": np.array(json.dumps(c)), "ids": ids, "hidden": hidden}
    win = windows(c, ids, eos)
    hd = E // ((c["ngram_size"] - 1) * c["heads_per_ngram"])
    for L, (mult, primes, offsets, nrows) in geometry(c).items():
        sd = {"ple_embedding.ngram_embedding.weight": torch.randn(nrows, hd),
              "key_proj.weight": torch.randn(G * D, E) / math.sqrt(E),
              "value_proj.weight": torch.randn(D, E) / math.sqrt(E),
              "norm_key.weight": 0.3 * torch.randn(G * D), "norm_query.weight": 0.3 * torch.randn(G * D),
              "norm_conv.weight": 0.3 * torch.randn(G * D),
              "conv1d.weight": torch.randn(G * D, 1, c["ple_conv_kernel_size"]) / 2}
        rows = hash_rows(c, win, mult, primes, offsets)
        with torch.no_grad():
            y = ple(c, sd, rows, hidden)
        out.update({f"L{L}.multipliers": np.array(mult, np.int64), f"L{L}.primes": np.array(primes, np.int64),
                    f"L{L}.offsets": np.array(offsets, np.int64), f"L{L}.table_rows": np.array(nrows, np.int64),
                    f"L{L}.rows": rows, f"L{L}.out": y.numpy().astype(np.float32)})
        out.update({f"L{L}.sd.{k}": v.numpy().astype(np.float32) for k, v in sd.items()})
    return out


def write(name, out_dir):
    path = os.path.join(out_dir, f"golden_qwen_{name}.npz")
    np.savez_compressed(path, **generate(name))
    return path


def main(argv=None):
    names = (sys.argv[1:] if argv is None else argv) or list(CONFIGS)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "tests", "data")
    for name in names:
        print(write(name, out_dir))


if __name__ == "__main__":
    main()
