"""Write a synthetic DeepSeek-V4.1 Engram checkpoint in the HF layout (random weights).

    python tools/make_v41_checkpoint.py OUT_DIR                      # Flash dims, ~1.3 GB tables a layer
    python tools/make_v41_checkpoint.py OUT_DIR --engram-vocab-size 50000 --layers 1
    python tools/make_v41_checkpoint.py OUT_DIR --tiny               # test size

Flash dims: hidden 5120, hc 4, 24 heads x 256, wkv [25600, 6144]; only the table rows are
scaled down (engram_vocab_size: each of the 24 primes per layer is just above it, a row is
264 bytes). Real weights cannot be downloaded here; the layout, names and dtypes are the
real checkpoint's (engram_stream.hf_v41). Needs the tokenizers package unless --no-tokenizer.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from engram_stream import EngramConfig, hf_v41  # noqa: E402

TINY = dict(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=64,
            n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
            image_token_id=299)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--engram-vocab-size", type=int, default=200000)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 14])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="test dimensions instead of Flash's")
    ap.add_argument("--no-tokenizer", action="store_true", help="identity compression (no tokenizer.json)")
    a = ap.parse_args(argv)
    if a.tiny:
        cfg = EngramConfig(**TINY)
    else:
        cfg = hf_v41.flash_config(engram_vocab_size=a.engram_vocab_size, engram_layer_ids=a.layers)
    t0 = time.perf_counter()
    out = hf_v41.make_synthetic(a.out, cfg, seed=a.seed, n_shards=a.shards, tokenizer=not a.no_tokenizer)
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(f"{a.out}: {size / 2**30:.2f} GiB, table rows {out.num_embeddings}, compressed vocab "
          f"{out.compressed_vocab_size}, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
