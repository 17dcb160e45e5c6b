#!/usr/bin/env python
"""Generate the LongCat-Flash-Lite (n-gram embedding) golden vectors in tests/data/golden_longcat_<name>.npz.

What this is
------------
An INDEPENDENT re-implementation, in torch, of LongCat's NgramEmbedding with the Hugging Face
code's semantics (as vLLM 0.33.0's pure-Python reference of its id kernel states them),
written from those semantics: it imports neither vLLM nor engram_stream. The package is tested
against what this script writes.

How it differs in form (not in result) from the model code:
  * the n-gram id of a position is a loop walking back from it, token by token, stopping before
    the start and at an EOS (for delta > 0), each term reduced mod the table size as it is added
    (the model code adds whole-tensor shifts, masked by cummax over EOS positions, then one mod);
  * the powers vocab_size^delta mod mod_c by repeated multiplication;
  * the output is the mean of the E + 1 embeddings taken as torch.stack(...).mean(0), in float64,
    stored as float32 (the model: a running float sum divided by 1 + E).

Each npz holds
  config_json          the Hugging Face config.json keys (longcat_flash_ngram)
  ids                  int64[B, T]      raw ids (EOS at the start, in the middle, twice in a row, last)
  table_sizes          int64[E]         m + 2c + 1
  mods                 int64[E, n]      vocab^delta mod mod_c (0 past the embedder's order)
  rows                 int64[B, T, E]   each embedder's row (head-local)
  and, when it has weights (not the released geometry's hash-only golden):
  sd.<name>            the NgramEmbedding's parameters (word_embeddings.weight, embedders.{c}.weight,
                       post_projs.{c}.weight), float32 holding bfloat16 values (the released dtype)
  out                  float32[B, T, D] the embedding fed to layer 1

Regenerate:  python tools/goldens/longcat.py [NAME ...]      (torch and numpy only)
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")

# name: (config.json keys, ids rows (EOS is the config's eos_token_id), with weights)
CASES = {
    "n4_k2": ({"vocab_size": 40, "hidden_size": 24, "emb_neighbor_num": 4, "emb_split_num": 2,
               "ngram_vocab_size_ratio": 3, "eos_token_id": 2},
              [[2, 7, 11, 39, 2, 5, 2, 2, 13, 0, 31, 8, 22, 9, 2],
               [17, 3, 3, 3, 9, 38, 2, 21, 14, 2, 6, 1, 2, 2, 2]], True),
    "n3_k3_eos0": ({"vocab_size": 29, "hidden_size": 36, "emb_neighbor_num": 3, "emb_split_num": 3,
                    "ngram_vocab_size_ratio": 5, "eos_token_id": 0},
                   [[0, 0, 5, 28, 0, 7, 7, 19, 0, 3, 11, 0]], True),
    # the released LongCat-Flash-Lite geometry (hash only: its tables are ~10.2M rows each)
    "flashlite_rows": ({"vocab_size": 131072, "hidden_size": 3072, "emb_neighbor_num": 4, "emb_split_num": 4,
                        "ngram_vocab_size_ratio": 78, "eos_token_id": 2},
                       [[2, 131071, 131070, 99999, 2, 1, 131071, 2, 2, 65536, 4242, 131071, 131071, 7, 2]], False),
}


def geometry(c):
    V, n, k = c["vocab_size"], c["emb_neighbor_num"], c["emb_split_num"]
    m = c["ngram_vocab_size_ratio"] * V
    E = k * (n - 1)
    sizes = [m + 2 * e + 1 for e in range(E)]
    mods = torch.zeros((E, n), dtype=torch.int64)
    for e in range(E):
        order = e // k + 2
        p = 1
        for d in range(order):
            mods[e, d] = p
            p = (p * V) % sizes[e]
    return E, sizes, mods


def ngram_rows(c, ids, sizes, mods):
    """rows[b, t, e]: walk back from t; delta > 0 stops before the start and at an EOS."""
    eos, n = c["eos_token_id"], c["emb_neighbor_num"]
    B, T = ids.shape
    E = len(sizes)
    out = torch.zeros((B, T, E), dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            seen = [int(ids[b, t])]
            for d in range(1, n):
                if t - d < 0 or int(ids[b, t - d]) == eos:
                    break
                seen.append(int(ids[b, t - d]))
            for e in range(E):
                acc = 0
                for d, tok in enumerate(seen):
                    acc = (acc + tok * int(mods[e, d])) % sizes[e]   # mods past the order are 0
                out[b, t, e] = acc
    return out


def bf16_values(g, shape, scale):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(torch.bfloat16).to(torch.float32)


def make(name):
    c, id_rows, weights = CASES[name]
    ids = torch.tensor(id_rows, dtype=torch.int64)
    E, sizes, mods = geometry(c)
    rows = ngram_rows(c, ids, sizes, mods)
    out = {"config_json": np.array(json.dumps({"model_type": "longcat_flash_ngram", **c})),
           "ids": ids.numpy(), "table_sizes": np.array(sizes, np.int64), "mods": mods.numpy(), "rows": rows.numpy()}
    if weights:
        D, V = c["hidden_size"], c["vocab_size"]
        hd = D // E
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        word = bf16_values(g, (V, D), 1.0)
        tables = [bf16_values(g, (s, hd), 1.0) for s in sizes]
        projs = [bf16_values(g, (D, hd), hd ** -0.5) for _ in range(E)]
        parts = [word[ids].double()]
        for e in range(E):
            parts.append(torch.nn.functional.linear(tables[e][rows[..., e]].double(), projs[e].double()))
        out["out"] = torch.stack(parts).mean(0).to(torch.float32).numpy()
        out["sd.word_embeddings.weight"] = word.numpy()
        for e in range(E):
            out[f"sd.embedders.{e}.weight"] = tables[e].numpy()
            out[f"sd.post_projs.{e}.weight"] = projs[e].numpy()
    return out


def main(names):
    for name in names or CASES:
        path = os.path.join(OUT, f"golden_longcat_{name}.npz")
        np.savez_compressed(path, **make(name))
        print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main(sys.argv[1:])
