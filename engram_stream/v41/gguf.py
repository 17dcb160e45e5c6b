"""DeepSeek-V4.1's Engram tables in a GGUF: blk.{L}.engram_embd.weight, ne [head_dim, rows], one
a layer (ik_llama.cpp and llama.cpp's port: general.architecture "deepseek41"; ds4: "deepseek4",
whose I8 tensors of 264-byte rows are the checkpoint's e4m3 rows and e8m0 scales); the
constants under {arch}.engram.*, the hash constants in some files only (rows.gguf.Layout: how
the file is checked against the folder's config)."""
from __future__ import annotations

import re

import numpy as np

from ..errors import CheckpointError
from ..rows.gguf import Layout


class V41Layout(Layout):
    archs = {"deepseek41": "ik_llama.cpp, llama.cpp's port", "deepseek4": "ds4"}
    keys = ("engram.layer_ids", "engram.head_count", "engram.key_length", "engram.max_ngram_size",
            "engram.pad_id", "engram.multipliers", "engram.primes", "engram.offsets", "engram.token_map")

    def tables(self, model):
        ids = model.kv.get(f"{model.architecture}.engram.layer_ids")
        if ids is not None:
            return [(f"layer {int(L)}", f"blk.{int(L)}.engram_embd.weight") for L in np.atleast_1d(ids)]
        found = sorted((int(m[1]), n) for n in model.tensors
                       if (m := re.fullmatch(r"blk\.(\d+)\.engram_embd\.weight", n)))
        return [(f"layer {L}", n) for L, n in found]

    def expected(self, arch, cfg, plan):
        a, L = arch, cfg.layer_ids
        return {f"{a}.engram.layer_ids": list(L), f"{a}.engram.head_count": cfg.n_head_per_ngram,
                f"{a}.engram.key_length": cfg.head_dim, f"{a}.engram.max_ngram_size": cfg.max_ngram_size,
                f"{a}.engram.pad_id": cfg.pad_id,
                f"{a}.engram.multipliers": np.concatenate([plan.multipliers[x] for x in L]),
                f"{a}.engram.primes": np.concatenate([plan.head_primes[x] for x in L]),
                f"{a}.engram.offsets": np.concatenate([plan.offsets[x] for x in L]),
                f"{a}.engram.token_map": (np.arange(cfg.vocab_size) if plan.lookup is None else plan.lookup)}

    def layers(self, path, cfg, plan, tables):
        if [w for w, _ in tables] != [f"layer {L}" for L in cfg.layer_ids]:
            raise CheckpointError(f"{path}: tables for {', '.join(w for w, _ in tables)}, the folder's config has "
                                  f"Engram layers {list(cfg.layer_ids)}")
        return {L: [(t, plan.table_rows[L])] for L, (_, t) in zip(cfg.layer_ids, tables)}


LAYOUT = V41Layout()
