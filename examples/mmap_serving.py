"""Serve tables from an mmap checkpoint: only the rows a decode touches come into memory.

    python examples/mmap_serving.py [path.safetensors]   (default: a temp folder, removed at the end)
"""
import argparse
import dataclasses
import os
import tempfile

import numpy as np

from engram_stream import EngramModel
from engram_stream.demo import checkpoint
from engram_stream.io import memory
from tiny_lm import CONFIG

# The tiny LM's geometry with big tables (2 layers x ~50 MiB in float16): far more rows than a
# short decode reads (200 tokens x 8 heads).
cfg = dataclasses.replace(CONFIG, engram_vocab_size=[200003, 200003])


def serve(path, tokens=200):
    checkpoint.save_init(cfg, path, table_dtype="float16")   # random weights, written in pieces
    model = EngramModel.load(path, mmap=True)                 # tables are views of the file
    memory.evict_file(path)                                    # cold start: drop the file from the page cache

    dec = model.decoder()                                     # prefetch="auto": madvise WILLNEED per token
    rng = np.random.default_rng(0)
    h = rng.standard_normal((cfg.hc_mult, cfg.hidden_size), dtype=np.float32)
    for tok in rng.integers(0, cfg.vocab_size, size=tokens):
        dec.begin(int(tok))
        for L in dec.layers:
            dec.layer(L, h)

    report = memory.residency(model)
    for L, r in report.items():
        print(f"layer {L}: table {r['table_bytes'] / 2**20:.1f} MiB, resident {r['resident_bytes'] / 2**20:.2f} MiB")
    table = sum(r["table_bytes"] for r in report.values())
    resident = sum(r["resident_bytes"] for r in report.values())
    print(f"after {tokens} tokens: {resident / 2**20:.2f} MiB of {table / 2**20:.1f} MiB of tables resident "
          f"({resident / table:.1%})")


ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("path", nargs="?", help="checkpoint file to write and serve (default: a temp folder, removed at the end)")
path = ap.parse_args().path
if path:
    serve(path)
else:
    with tempfile.TemporaryDirectory() as tmp:
        serve(os.path.join(tmp, "engram.safetensors"))
    print(f"temp folder {tmp} removed")
