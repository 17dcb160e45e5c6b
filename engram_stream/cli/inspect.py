"""engram-stream inspect: a checkpoint's config, geometry, tables and residency (a .gguf file: its Engram tables)."""
from __future__ import annotations

import json
import os

from .. import variants
from .common import kernels, load_checkpoint


def register(command):
    s = command("inspect", run, "config, geometry, tables and residency of a checkpoint")
    s.add_argument("checkpoint", help="a checkpoint of any variant (as init or EngramModel.save writes it): "
                                      + "; ".join(f"{v.name}: {variants.describe_checkpoint(v)}"
                                                  for v in variants.variants()))


def run(args):
    """Print a checkpoint's config, hash plan, tables and their residency (a .gguf file: its tables)."""
    if os.fspath(args.checkpoint).endswith(".gguf"):  # a llama.cpp file: its Engram tables, no model to load
        from ..rows import gguf
        print("\n".join(gguf.describe(args.checkpoint)))
        return 0
    from ..io import memory
    model = load_checkpoint(args.checkpoint)
    cfg, plan = model.cfg, model.plan
    from ..rows import packed
    path = args.checkpoint
    rows = packed.rows_path(path)   # the packed row file: its own line, not in the checkpoint's size
    files = ([os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path])
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f) and f != rows)
    print(f"checkpoint: {path} ({size / 2**20:,.1f} MiB{', without the row file' if os.path.exists(rows) else ''})")
    if os.path.exists(rows):
        print(f"row file: {rows} ({os.path.getsize(rows) / 2**20:,.1f} MiB, packed rows: one read a missed row "
              f"with tables=\"direct\")")
    else:
        print(f"row file: none ({rows} once engram-stream pack-rows {path} writes it)")
    print(f"kernels: {kernels()}")
    print("config: " + json.dumps(cfg.to_dict()))
    tail = model.variant.describe(cfg)
    print(f"geometry: orders 2..{cfg.max_ngram_size}, {cfg.n_head_per_ngram} heads/order, H={cfg.n_heads}, "
          f"head_dim={cfg.head_dim}, E={cfg.engram_dim}, D={cfg.hidden_size}, G={cfg.hc_mult}, {tail}")
    print(f"compression: {'identity' if plan.lookup is None else 'table'} "
          f"(vocab {cfg.vocab_size} -> {plan.compressed_vocab}), compressed pad {plan.pad_id}")
    for L in cfg.layer_ids:
        w = model.layer(L)
        res = memory.resident_bytes(w.table)
        lines = model.variant.hash_lines(cfg, plan, L)
        print(f"layer {L}: {lines[0]}")
        print("\n".join(lines[1:]))
        print(f"  table [{plan.table_rows[L]}, {cfg.head_dim}] {w.table_dtype}: "
              f"{w.table.nbytes / 2**20:,.1f} MiB, resident {res / 2**20:,.1f} MiB")
    return 0
