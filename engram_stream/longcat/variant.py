"""The longcat-flash-lite variant (DESIGN.md 4c): LongCat-Flash-Lite's n-gram embedding, an input
layer (layer id 0) on raw token ids. Its geometry through the Variant hooks (config.py's module
doc): heads = the E embedders, head sizes mod_c = m + 2c + 1 (head_sizes) at exclusive offsets in
one table, per-head multipliers vocab^delta mod mod_c (plan_extras: plan.head_mods), the numpy
oracle's rows reference.rows (rows_numpy). LongcatEngine (_engine.pyx) serves it."""
import numpy as np

from .. import variants
from ..io.hf_folder import HFFolderVariant
from . import config, gguf, hf, reference, weights
from ._engine import LongcatEngine
from .weights import LongcatWeights


class LongcatVariant(HFFolderVariant, variants.Variant):
    gguf_layout = gguf.LAYOUT   # its tables in a llama.cpp GGUF (GGUFTier, `engram-stream inspect`)
    hf = hf   # load, save, save_init, is_checkpoint, folder_of: the shared Hugging Face folder hooks
    folder_weights_needed = False   # folder_of: its config.json names the folder, weights or not
    weights_rules = weights
    config_rules = config
    name = config.LONGCAT
    title = "LongCat-Flash-Lite's n-gram embedding (an input layer: the embedding fed to layer 1)"
    example_config = config.EXAMPLE
    config_class = config.LongcatConfig
    layer_class = LongcatWeights
    weight_dtypes = ("float32", "bfloat16")
    table_dtypes = ("float32", "bfloat16")
    load_note = "raw token ids: no compression, no tokenizer read; an input layer (layer 0)"
    engine = LongcatEngine
    negative_ids = False    # ids index the token embedding: the plan and the engine refuse negative ids

    def with_weight_dtype(self, cfg, layers, name):
        dtype = np.dtype(weights.BF16 if name == "bfloat16" else np.float32)
        return {L: LongcatWeights(cfg, w.offsets, w.table, w.embed, w.proj_w.astype(dtype))
                for L, w in layers.items()}

    # computing
    def forward(self, cfg, w, rows, dead, hidden, ids):
        """The oracle of an input layer: made from the ids (the token embedding) and their rows;
        hidden is not read."""
        return reference.forward_rows(cfg, w, ids, rows)

    def describe(self, cfg):
        return config.describe(cfg)

    def step_weights(self, w):
        return w.proj_w

    def sample_ids(self, cfg, rng, size):
        ids = rng.integers(0, cfg.vocab_size, size=size)
        ids[rng.random(size) < 0.05] = cfg.pad_id   # EOS: documents end, also in runs
        return ids

    # hashing
    def draw_multipliers(self, cfg, compressed_vocab):
        return config.draw_multipliers(cfg, compressed_vocab)

    def table_rows(self, cfg, rows):
        return config.table_rows(cfg, rows)

    def windows(self, cfg, pad_id, raw, x):
        return reference.windows(cfg, raw)

    def head_sizes(self, cfg):
        return {L: config.table_sizes(cfg) for L in cfg.layer_ids}

    def hash_lines(self, cfg, plan, layer):
        k, mods = cfg.n_head_per_ngram, plan.head_mods[layer]
        return [f"embedder c = (g - 2) * {k} + j: rows mod_c = m + 2c + 1 (m = {cfg.ngram_vocab}), multipliers "
                f"vocab_size^delta mod mod_c"] + [
            f"  order {g}: sizes {sizes}, multipliers "
            f"{[mods[c, :g].tolist() for c in range((g - 2) * k, (g - 1) * k)]}"
            for g, sizes in enumerate(plan.primes[layer], start=2)] + [f"  offsets {plan.offsets[layer].tolist()}"]

    def plan_extras(self, cfg, plan):
        return {"head_mods": {L: config.head_mods(cfg) for L in cfg.layer_ids}}   # LongcatWindow reads them

    def rows_numpy(self, cfg, plan, layer, ids, x, shifted):
        return reference.rows(cfg, ids)


VARIANT = variants.register(LongcatVariant())
