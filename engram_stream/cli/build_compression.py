"""engram-stream build-compression: a tokenizer.json's compression lookup, as a .npy file."""
from __future__ import annotations

import numpy as np

from .common import check_output


def register(command):
    s = command("build-compression", run, "tokenizer.json -> compression lookup .npy")
    s.add_argument("tokenizer", help="a Hugging Face tokenizer.json")
    s.add_argument("-o", "--output", required=True, help="file to write, exactly this name (.npy format)")
    s.add_argument("--force", action="store_true", help="overwrite --output if it exists")


def run(args):
    from ..compression import build_compression
    output = check_output(args.output, args.force, inputs=[args.tokenizer])
    lookup = build_compression(args.tokenizer)
    with open(output, "wb") as f:  # np.save(name) would append ".npy" to a name without it
        np.save(f, lookup)
    print(f"wrote {output}: vocab {lookup.shape[0]} -> {int(lookup.max()) + 1} compressed ids "
          f"({(int(lookup.max()) + 1) / lookup.shape[0]:.1%})")
    return 0
