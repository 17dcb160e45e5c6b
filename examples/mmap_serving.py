"""Serve tables from an mmap checkpoint: only the rows a decode touches come into memory.

    python examples/mmap_serving.py [path.safetensors]
"""
import os
import sys
import tempfile

import numpy as np

from engram_stream import EngramModel, store
from tiny_lm import CONFIG, engram_model

path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "engram.safetensors")
engram_model().save(path, table_dtype="float16")          # half the bytes; compute stays float32
model = EngramModel.load(path, mmap=True)                 # tables are views of the file
store.evict_file(path)                                    # cold start: drop the file from the page cache

dec = model.decoder()                                     # prefetch="auto": madvise WILLNEED per token
rng = np.random.default_rng(0)
h = rng.standard_normal((CONFIG.hc_mult, CONFIG.hidden_size), dtype=np.float32)
for tok in rng.integers(0, CONFIG.vocab_size, size=200):
    dec.begin(int(tok))
    for L in dec.layers:
        dec.layer(L, h)

for L, r in store.residency(model).items():
    print(f"layer {L}: table {r['table_bytes'] / 2**20:.2f} MiB, resident {r['resident_bytes'] / 2**20:.2f} MiB")
