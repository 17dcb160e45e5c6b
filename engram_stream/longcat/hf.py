"""longcat-flash-lite checkpoints in the model's Hugging Face layout.

    folder/config.json                      model_type longcat_flash_ngram
    folder/model.safetensors                one file, or
    folder/model.safetensors.index.json     {"weight_map": {tensor: shard}} and its shards

load() reads only the n-gram embedding's tensors and the token embedding (decoder layers,
attention and experts are never opened): model.embed_tokens.weight [vocab, hidden],
model.ngram_embeddings.embedders.{c}.weight [m + 2c + 1, hidden/E] and
model.ngram_embeddings.post_projs.{c}.weight [hidden, hidden/E], c = 0..E-1, float32 or bfloat16
(the released files: bfloat16). The embedders are one table (rows at the plan's offsets): a view
of the mapping when they lie back to back in one file, else concatenated in RAM (the loader says
so in table_in_ram). The token embedding stays mapped; the projections are read into one
[hidden, hidden] matrix.
save() writes the same layout: the embedders back to back in the first shard (so a load maps
them as one table), the token embedding and projections in the second, and the index, swapped
in whole.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from ..errors import HFCheckpointError
from ..io import safetensors
from ..io.files import atomic_folder, mapping_of
from ..io.hf_folder import (BF16, INDEX, OWN_FILES, err as _err, joined, open_shards, read_config, table_tensor,
                            weight_map)
from ..io.safetensors import Tensor, write_folder_files
from ..plan import HashPlan
from .config import LONGCAT
from .weights import LongcatWeights

EMBED = "model.embed_tokens.weight"
PREFIX = "model.ngram_embeddings."
DTYPES = (np.dtype(np.float32), BF16)


def embedder(c) -> str:
    return f"{PREFIX}embedders.{c}.weight"


def post_proj(c) -> str:
    return f"{PREFIX}post_projs.{c}.weight"


def load(folder, mmap=True):
    """(cfg, plan, {0: LongcatWeights}) of a LongCat folder (see the module doc)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise HFCheckpointError(f"{folder}: not a folder ({LONGCAT} checkpoints are Hugging Face folders)")
    cfg = read_config(folder, LONGCAT)
    plan = HashPlan(cfg)
    wm = weight_map(folder)
    E, D, hd = cfg.n_heads, cfg.hidden_size, cfg.head_dim
    want = [EMBED] + [embedder(c) for c in range(E)] + [post_proj(c) for c in range(E)]
    missing = [n for n in want if n not in wm]
    if missing:
        raise _err(folder, f"no tensors {missing[:4]}{'...' if len(missing) > 4 else ''} (config.json's "
                           f"emb_split_num * (emb_neighbor_num-1) = {E} embedders need them)")
    with contextlib.ExitStack() as stack:
        files = open_shards(stack, folder, [(name, wm[name]) for name in want], mmap)

        def info(name, shape):
            f = files[wm[name]]
            t = f.info(name)
            if tuple(t.shape) != shape or t.dtype not in DTYPES:
                raise _err(f.path, f"tensor {name!r}: {t.code} {tuple(t.shape)}, expected float32 or bfloat16 "
                                   f"{shape}")
            return f, t

        sizes = plan.head_primes[0].tolist()
        infos = [info(embedder(c), (sizes[c], hd)) for c in range(E)]
        dtypes = {t.dtype for _, t in infos}
        if len(dtypes) != 1:
            raise _err(folder, f"the embedders mix dtypes {sorted(map(str, dtypes))}: one dtype expected")
        parts = [(embedder(c), wm[embedder(c)]) for c in range(E)]
        table = joined(parts, infos, files, next(iter(dtypes)), hd)
        f, t = info(EMBED, (cfg.vocab_size, D))
        embed = f.array(EMBED)
        projs = []
        for c in range(E):
            f, t = info(post_proj(c), (D, hd))
            projs.append(np.asarray(f.array(post_proj(c))))
        pdtype = BF16 if all(p.dtype == BF16 for p in projs) else np.dtype(np.float32)
        proj_w = np.concatenate([p.astype(pdtype, copy=False) for p in projs], axis=1)
        w = LongcatWeights(cfg, plan.offsets[0], table, embed, proj_w)
        if mmap and mapping_of(table) is None:
            w.table_in_ram = "its embedders lie apart in the folder's files, so the loader concatenated them in RAM"
    return cfg, plan, {0: w}


def save(cfg, plan, layers, path, table_dtype=None, progress=None, before_write=None):
    """model.save() for longcat-flash-lite: the Hugging Face layout (see the module doc)."""
    if table_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"table_dtype={table_dtype!r}: a {LONGCAT} checkpoint writes float32 or bfloat16 tables")
    w = layers[0]
    dtype = BF16 if table_dtype == "bfloat16" else np.dtype(np.float32) if table_dtype else np.dtype(w.table.dtype)
    offs = plan.offsets[0].tolist() + [plan.table_rows[0]]
    table_shard = [table_tensor(embedder(c), w.table, offs[c], offs[c + 1], dtype) for c in range(cfg.n_heads)]
    rest = [Tensor.of(EMBED, w.embed)] + [Tensor.of(post_proj(c), np.ascontiguousarray(p))
                                          for c, p in enumerate(w.post_projs(cfg))]
    shards = [table_shard, rest]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    layouts = [safetensors.Layout(ts, {"format": "pt"}) for ts in shards]
    index = json.dumps({"metadata": {"total_size": sum(lay.data_bytes for lay in layouts)},
                        "weight_map": {t.name: f for f, ts in zip(files, shards) for t in ts}},
                       indent=2, sort_keys=True).encode()
    config = json.dumps(cfg.to_hf_config(), indent=2).encode()
    if before_write is not None:
        before_write(sum(lay.nbytes for lay in layouts) + len(index) + len(config))
    path = os.fspath(path)
    with atomic_folder(path, lambda name: OWN_FILES.fullmatch(name) is not None) as tmp:
        write_folder_files(tmp, list(zip(files, layouts)), [(INDEX, index), ("config.json", config)], progress)
    return path
