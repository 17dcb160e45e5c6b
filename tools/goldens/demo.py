#!/usr/bin/env python
"""Generate the golden test vectors in tests/data/golden_<name>.npz.

What this is
------------
An INDEPENDENT re-implementation, in torch, of the Engram module of DeepSeek's
public demo (`engram_demo_v1.py`, deepseek-ai/Engram). It does not import
engram_stream at all: the package is tested against what this script writes.
The only departure from the demo is the tokenizer: the demo's
CompressedTokenizer is replaced by a given compression table (an int64 lookup
over the tokenizer vocab, dense with collisions, as the tokenizer
normalization makes) or by the identity.

Per config it computes, per Engram layer L:
  * compression: ids >= 0 go through the table, negative ids pass through; the
    pad id is compressed through the same table;
  * multipliers: numpy default_rng(seed + 10007*L).integers(0, half,
    size=max_ngram, dtype=int64)*2 + 1, half = max(1, (INT64_MAX // C) // 2),
    C = max(table)+1 (identity: vocab_size);
  * the global prime chain (own trial-division primality test; one seen-set
    across layers and orders);
  * the n-gram hash: XOR of (window[k] * mult[k]) in wrapping int64, floored
    mod per head prime. Computed twice, with exact Python integers (explicit
    2**64 wrap) and with torch int64 tensor ops, and asserted equal;
  * the forward pass of a torch nn.Module whose state_dict() keys are exactly
    the demo's names (MultiHeadEmbedding with offsets, key projections,
    RMSNorms, signed-sqrt sigmoid gate, value projection, dilated causal
    depthwise ShortConv + SiLU, output = value + short_conv(value)).

Weights are drawn with numpy (so they are bit-identical whatever the torch
version); only the float forward depends on torch kernels.

Each npz holds
  config_json            JSON of the EngramConfig fields
  compression            int64[vocab]           (only when a table is used)
  ids                    int64[B, T]            (raw ids, some negative)
  hidden                 float32[B, T, G, D]
  multipliers_injected   bool scalar            (only when multipliers are injected: pass
                                                 L{L}.multipliers as HashPlan(multipliers=))
  L{L}.multipliers       int64[max_ngram]
  L{L}.primes            int64[H]               (order-major, flat)
  L{L}.offsets           int64[H]
  L{L}.hash              int64[B, T, H]         (head-local rows, before offsets)
  L{L}.output            float32[B, T, G, D]
  L{L}.sd.<key>          every state_dict entry (float32; offsets int64)

Regenerate
----------
    . /work/venv/bin/activate            # needs torch and numpy only
    python tools/goldens/demo.py           # writes tests/data/golden_*.npz
    python tools/goldens/demo.py --out DIR # somewhere else
    python tools/goldens/demo.py --only NAME [--only NAME ...]

The script is deterministic (fixed seeds per config); tests/demo/test_goldens.py
re-runs it into a temporary directory and checks it reproduces the committed
files (integers bit-for-bit, floats to a tight tolerance).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn

INT64_MAX = (1 << 63) - 1
LAYER_SEED_STRIDE = 10007
_MASK64 = (1 << 64) - 1

# ---------------------------------------------------------------------------
# The configs. Each entry: EngramConfig fields + generation knobs.
#   comp_classes: None -> identity, else draw a dense table with that many labels
#   negatives:    raw ids written over some positions of the random ids
#   data_seed:    seeds every random draw of this config
#   inject_multipliers: optional {layer: [int64]*max_ngram} used instead of the draw
# Kernel sizes 2..5, max_ngram 2..4, hc_mult 1/2/4; every config has
# T > (K-1)*max_ngram so the conv reaches back through its whole window.
# ---------------------------------------------------------------------------
CONFIGS = [
    dict(name="hc1_n2_k2_ident",
         engram_vocab_size=[31], max_ngram_size=2, n_embed_per_ngram=8, n_head_per_ngram=2,
         layer_ids=[0, 5], pad_id=2, seed=0, kernel_size=2, hidden_size=16, hc_mult=1,
         vocab_size=50, comp_classes=None, B=2, T=12, negatives=[], data_seed=101),
    dict(name="hc4_n3_k4_comp",
         engram_vocab_size=[97, 97], max_ngram_size=3, n_embed_per_ngram=16, n_head_per_ngram=4,
         layer_ids=[1, 3], pad_id=17, seed=0, kernel_size=4, hidden_size=24, hc_mult=4,
         vocab_size=300, comp_classes=120, B=2, T=20, negatives=[(0, 3, -1), (1, 10, -5)],
         data_seed=202),
    dict(name="hc4_n4_k5_ident",
         engram_vocab_size=[61, 61, 67], max_ngram_size=4, n_embed_per_ngram=12, n_head_per_ngram=3,
         layer_ids=[0, 5], pad_id=0, seed=7, kernel_size=5, hidden_size=8, hc_mult=4,
         vocab_size=200, comp_classes=None, B=2, T=20, negatives=[(0, 0, -1), (1, 7, -5), (1, 8, -1)],
         data_seed=303),
    dict(name="hc1_n3_k3_comp",
         engram_vocab_size=[400, 250], max_ngram_size=3, n_embed_per_ngram=16, n_head_per_ngram=2,
         layer_ids=[2, 7], pad_id=7, seed=42, kernel_size=3, hidden_size=48, hc_mult=1,
         vocab_size=500, comp_classes=200, B=2, T=14,
         # a huge negative id makes window[k]*mult[k] wrap around int64
         negatives=[(0, 5, -1), (1, 2, -(1 << 40) + 3), (1, 13, -5)], data_seed=404),
    dict(name="hc2_n2_k5_comp",
         engram_vocab_size=[53], max_ngram_size=2, n_embed_per_ngram=16, n_head_per_ngram=4,
         layer_ids=[1, 3], pad_id=30, seed=123, kernel_size=5, hidden_size=32, hc_mult=2,
         vocab_size=90, comp_classes=40, B=2, T=18, negatives=[], data_seed=505),
    # injected multipliers (any int64: even, negative, near the limits) so products wrap;
    # the npz then carries `multipliers_injected` and the consumer passes them in.
    dict(name="hc2_n3_k3_injected",
         engram_vocab_size=[43, 47], max_ngram_size=3, n_embed_per_ngram=8, n_head_per_ngram=2,
         layer_ids=[4, 1], pad_id=3, seed=9, kernel_size=3, hidden_size=12, hc_mult=2,
         vocab_size=70, comp_classes=30, B=2, T=15, negatives=[(0, 6, -1)], data_seed=606,
         inject_multipliers={4: [INT64_MAX, -3, (1 << 62) + 12345],
                             1: [-(1 << 63), 0x5DEECE66D << 20, -987654321987654321]}),
]

CONFIG_FIELDS = ("engram_vocab_size", "max_ngram_size", "n_embed_per_ngram", "n_head_per_ngram",
                 "layer_ids", "pad_id", "seed", "kernel_size", "hidden_size", "hc_mult", "vocab_size")


# ---------------------------------------------------------------------------
# Integer geometry
# ---------------------------------------------------------------------------
def is_prime_trial(n: int) -> bool:
    """Primality by trial division over 2 and the odd numbers up to sqrt(n)."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def head_primes(spec) -> dict:
    """{layer: [[prime]*n_head for order 2..max_ngram]} with one seen-set over everything."""
    taken = set()
    chain = {}
    for layer in spec["layer_ids"]:
        per_order = []
        for order in range(2, spec["max_ngram_size"] + 1):
            last = spec["engram_vocab_size"][order - 2] - 1
            primes = []
            for _head in range(spec["n_head_per_ngram"]):
                cand = last + 1
                while not (is_prime_trial(cand) and cand not in taken):
                    cand += 1
                taken.add(cand)
                primes.append(cand)
                last = cand
            per_order.append(primes)
        chain[layer] = per_order
    return chain


def layer_multipliers(spec, compressed_vocab: int) -> dict:
    half = max(1, (INT64_MAX // compressed_vocab) // 2)
    out = {}
    for layer in spec["layer_ids"]:
        gen = np.random.default_rng(int(spec["seed"] + LAYER_SEED_STRIDE * layer))
        draw = gen.integers(0, half, size=spec["max_ngram_size"], dtype=np.int64)
        out[layer] = draw * 2 + 1
    return out


def make_compression(vocab: int, classes: int, rng: np.random.Generator) -> np.ndarray:
    """A dense lookup vocab -> [0, C): random labels relabelled in first-seen order (no gaps)."""
    raw = rng.integers(0, classes, size=vocab)
    relabel = {}
    table = np.empty(vocab, dtype=np.int64)
    for i, r in enumerate(raw.tolist()):
        if r not in relabel:
            relabel[r] = len(relabel)
        table[i] = relabel[r]
    return table


def compress_ids(ids: np.ndarray, table) -> np.ndarray:
    if table is None:
        return ids.copy()
    out = ids.copy()
    nonneg = ids >= 0
    out[nonneg] = table[ids[nonneg]]
    return out


def _wrap64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v > INT64_MAX else v


def hash_exact(cids: np.ndarray, pad: int, mult, primes_by_order) -> np.ndarray:
    """Head-local rows [B, T, H] with exact Python integers (explicit int64 wrap)."""
    B, T = cids.shape
    n_max = len(mult)
    H = sum(len(p) for p in primes_by_order)
    out = np.zeros((B, T, H), dtype=np.int64)
    m = [int(x) for x in mult]
    for b in range(B):
        row = [int(x) for x in cids[b]]
        for t in range(T):
            mix = _wrap64(row[t] * m[0])
            col = 0
            for order in range(2, n_max + 1):
                k = order - 1
                tok = row[t - k] if t - k >= 0 else pad
                mix = mix ^ _wrap64(tok * m[k])  # XOR of two int64 values stays in int64
                for p in primes_by_order[order - 2]:
                    out[b, t, col] = mix % p     # Python's % is floored: result in [0, p)
                    col += 1
    return out


def hash_torch(cids: np.ndarray, pad: int, mult, primes_by_order) -> np.ndarray:
    """Same quantity with torch int64 tensor ops (wrapping mul, xor, floored remainder)."""
    x = torch.from_numpy(cids)
    B, T = x.shape
    n_max = len(mult)
    pad_block = torch.full((B, n_max), pad, dtype=torch.int64)
    padded = torch.cat([pad_block, x], dim=1)               # [B, n_max + T]
    window = [padded[:, n_max - k: n_max - k + T] for k in range(n_max)]
    mt = torch.tensor([int(v) for v in mult], dtype=torch.int64)
    mix = window[0] * mt[0]
    heads = []
    for order in range(2, n_max + 1):
        mix = torch.bitwise_xor(mix, window[order - 1] * mt[order - 1])
        for p in primes_by_order[order - 2]:
            heads.append(torch.remainder(mix, p))
    return torch.stack(heads, dim=-1).numpy()


# ---------------------------------------------------------------------------
# The module (state_dict keys are the demo's names)
# ---------------------------------------------------------------------------
class _HeadTables(nn.Module):
    """All heads' tables in one embedding; head j's rows start at offsets[j]."""

    def __init__(self, rows_per_head, dim):
        super().__init__()
        starts = np.concatenate([[0], np.cumsum(rows_per_head)[:-1]]).astype(np.int64)
        self.register_buffer("offsets", torch.from_numpy(starts))
        self.embedding = nn.Embedding(int(sum(rows_per_head)), dim)

    def forward(self, local_rows):                          # [B, T, H]
        return self.embedding(local_rows + self.offsets)    # [B, T, H, dim]


class _CausalDilatedConv(nn.Module):
    """Per-stream RMSNorm (eps 1e-5), depthwise causal dilated conv, SiLU."""

    def __init__(self, width, streams, taps, dilation):
        super().__init__()
        channels = width * streams
        self.streams = streams
        self.norms = nn.ModuleList(nn.RMSNorm(width, eps=1e-5) for _ in range(streams))
        self.conv = nn.Conv1d(channels, channels, taps, groups=channels, bias=False,
                              padding=(taps - 1) * dilation, dilation=dilation)

    def forward(self, v):                                   # [B, T, G, D]
        B, T, G, D = v.shape
        x = torch.cat([self.norms[g](v[:, :, g]) for g in range(G)], dim=-1)  # stream-major channels
        y = self.conv(x.transpose(1, 2))[:, :, :T]          # keep the causal part
        return torch.nn.functional.silu(y).transpose(1, 2).reshape(B, T, G, D)


class GoldenEngramLayer(nn.Module):
    def __init__(self, spec, rows_per_head):
        super().__init__()
        D, G = spec["hidden_size"], spec["hc_mult"]
        E = (spec["max_ngram_size"] - 1) * spec["n_embed_per_ngram"]
        self.width = D
        self.multi_head_embedding = _HeadTables(rows_per_head,
                                                spec["n_embed_per_ngram"] // spec["n_head_per_ngram"])
        self.short_conv = _CausalDilatedConv(D, G, spec["kernel_size"], spec["max_ngram_size"])
        self.value_proj = nn.Linear(E, D)
        self.key_projs = nn.ModuleList(nn.Linear(E, D) for _ in range(G))
        self.norm1 = nn.ModuleList(nn.RMSNorm(D) for _ in range(G))   # eps=None: float32 machine eps
        self.norm2 = nn.ModuleList(nn.RMSNorm(D) for _ in range(G))

    def forward(self, local_rows, hidden):                  # [B,T,H] int64, [B,T,G,D] float32
        e = self.multi_head_embedding(local_rows).flatten(-2)            # [B, T, E]
        gates = []
        for g in range(len(self.key_projs)):
            k = self.norm1[g](self.key_projs[g](e))
            q = self.norm2[g](hidden[:, :, g])
            s = (k * q).sum(-1) / math.sqrt(self.width)
            s = torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=1e-6))
            gates.append(torch.sigmoid(s))
        gate = torch.stack(gates, dim=2).unsqueeze(-1)                   # [B, T, G, 1]
        value = gate * self.value_proj(e).unsqueeze(2)                   # [B, T, G, D]
        return value + self.short_conv(value)


def random_weights(spec, rows_per_head, rng):
    """Non-trivial parameters for one layer, {reference key: float32 array} (numpy draws)."""
    D, G, K = spec["hidden_size"], spec["hc_mult"], spec["kernel_size"]
    E = (spec["max_ngram_size"] - 1) * spec["n_embed_per_ngram"]
    hd = spec["n_embed_per_ngram"] // spec["n_head_per_ngram"]
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    w = {"multi_head_embedding.embedding.weight": f32(rng.standard_normal((int(sum(rows_per_head)), hd)))}
    scale = 1.0 / math.sqrt(E)
    w["value_proj.weight"] = f32(rng.standard_normal((D, E)) * scale)
    w["value_proj.bias"] = f32(rng.standard_normal(D) * 0.2)
    for g in range(G):
        w[f"key_projs.{g}.weight"] = f32(rng.standard_normal((D, E)) * scale)
        w[f"key_projs.{g}.bias"] = f32(rng.standard_normal(D) * 0.2)
    for g in range(G):
        w[f"norm1.{g}.weight"] = f32(1.0 + 0.3 * rng.standard_normal(D))
        w[f"norm2.{g}.weight"] = f32(1.0 + 0.3 * rng.standard_normal(D))
        w[f"short_conv.norms.{g}.weight"] = f32(1.0 + 0.3 * rng.standard_normal(D))
    w["short_conv.conv.weight"] = f32(rng.standard_normal((G * D, 1, K)) * 0.5)
    return w


# ---------------------------------------------------------------------------
# One config -> arrays
# ---------------------------------------------------------------------------
def generate(spec) -> dict:
    rng = np.random.default_rng(spec["data_seed"])
    V, B, T = spec["vocab_size"], spec["B"], spec["T"]
    G, D = spec["hc_mult"], spec["hidden_size"]

    table = None if spec["comp_classes"] is None else make_compression(V, spec["comp_classes"], rng)
    compressed_vocab = V if table is None else int(table.max()) + 1
    pad = spec["pad_id"] if table is None else int(table[spec["pad_id"]])

    ids = rng.integers(0, V, size=(B, T)).astype(np.int64)
    for b, t, v in spec["negatives"]:
        ids[b, t] = v
    hidden = rng.standard_normal((B, T, G, D)).astype(np.float32)

    cids = compress_ids(ids, table)
    injected = spec.get("inject_multipliers")
    if injected is None:
        mults = layer_multipliers(spec, compressed_vocab)
    else:
        mults = {L: np.array(injected[L], dtype=np.int64) for L in spec["layer_ids"]}
    chain = head_primes(spec)

    out = {"config_json": np.array(json.dumps({k: spec[k] for k in CONFIG_FIELDS}, sort_keys=True)),
           "ids": ids, "hidden": hidden}
    if table is not None:
        out["compression"] = table
    if injected is not None:
        out["multipliers_injected"] = np.array(True)

    torch.manual_seed(spec["data_seed"])   # module init is overwritten below; seed for tidiness
    for layer in spec["layer_ids"]:
        primes = [p for order in chain[layer] for p in order]
        rows = hash_exact(cids, pad, mults[layer], chain[layer])
        rows_t = hash_torch(cids, pad, mults[layer], chain[layer])
        if not np.array_equal(rows, rows_t):
            raise AssertionError(f"{spec['name']} L{layer}: exact and torch hashes disagree")
        assert rows.min() >= 0 and (rows < np.array(primes)).all()

        module = GoldenEngramLayer(spec, primes)
        weights = random_weights(spec, primes, rng)
        sd = module.state_dict()
        if set(sd) != set(weights) | {"multi_head_embedding.offsets"}:
            raise AssertionError(f"state_dict keys {sorted(sd)} != {sorted(weights)}")
        module.load_state_dict({**{k: torch.from_numpy(v) for k, v in weights.items()},
                                "multi_head_embedding.offsets": sd["multi_head_embedding.offsets"]})
        module.eval()
        with torch.no_grad():
            y = module(torch.from_numpy(rows), torch.from_numpy(hidden)).numpy()
        assert y.dtype == np.float32 and y.shape == (B, T, G, D) and np.isfinite(y).all()

        offsets = module.multi_head_embedding.offsets.numpy().astype(np.int64)
        p = f"L{layer}."
        out[p + "multipliers"] = np.asarray(mults[layer], dtype=np.int64)
        out[p + "primes"] = np.asarray(primes, dtype=np.int64)
        out[p + "offsets"] = offsets
        out[p + "hash"] = rows
        out[p + "output"] = y
        for k, v in module.state_dict().items():
            v = v.detach().numpy()
            out[p + "sd." + k] = v.astype(np.int64) if k.endswith("offsets") else v.astype(np.float32)
    return out


def write(spec, out_dir) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"golden_{spec['name']}.npz")
    np.savez_compressed(path, **generate(spec))
    return path


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(here, os.pardir, os.pardir, "tests", "data"),
                    help="output folder (default: tests/data)")
    ap.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="generate only this config (repeatable); names: "
                         + ", ".join(c["name"] for c in CONFIGS))
    args = ap.parse_args(argv)
    names = {c["name"] for c in CONFIGS}
    if args.only and not set(args.only) <= names:
        ap.error(f"unknown config(s) {sorted(set(args.only) - names)}")
    for spec in CONFIGS:
        if args.only and spec["name"] not in args.only:
            continue
        path = write(spec, args.out)
        print(f"{os.path.relpath(path)}  {os.path.getsize(path):>7d} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
