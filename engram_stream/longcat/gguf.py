"""LongCat-Flash-Lite's n-gram table in a llama.cpp GGUF (general.architecture
"longcat_flash_ngram"): one tensor a hashed embedder, ngram_embd.{c}.weight (embedder c's
m + 2c + 1 rows), the constants under longcat_flash_ngram.ngram.* (rows.gguf.Layout: how the
file is checked against the folder's config)."""
from __future__ import annotations

from ..errors import CheckpointError
from ..rows.gguf import Layout, numbered
from .config import table_sizes

ARCH = "longcat_flash_ngram"


class LongcatLayout(Layout):
    archs = {ARCH: "llama.cpp"}
    keys = ("ngram.neighbor_num", "ngram.split_num", "ngram.vocab_size_ratio")

    def tables(self, model):
        return numbered(model, "ngram_embd.{}.weight", "n-gram table")

    def expected(self, arch, cfg, plan):
        return {f"{arch}.ngram.neighbor_num": cfg.max_ngram_size, f"{arch}.ngram.split_num": cfg.n_head_per_ngram,
                f"{arch}.ngram.vocab_size_ratio": cfg.ngram_vocab_size_ratio}

    def layers(self, path, cfg, plan, tables):
        sizes = [int(s) for s in table_sizes(cfg)]
        if len(tables) != len(sizes):
            raise CheckpointError(f"{path}: {len(tables)} n-gram tables (ngram_embd.*), the folder's config has "
                                  f"{len(sizes)} embedders")
        return {cfg.layer_ids[0]: [(t, n) for (_, t), n in zip(tables, sizes)]}


LAYOUT = LongcatLayout()
