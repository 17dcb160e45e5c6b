"""The longcat-flash-lite variant (DESIGN.md 4c): LongCat-Flash-Lite's n-gram embedding, an input
layer (layer id 0) on raw token ids. Its geometry on HashPlan (config.py's module doc): heads =
the E embedders, head sizes mod_c = m + 2c + 1 at exclusive offsets in one table, per-head
multipliers vocab^delta mod mod_c (plan.head_mods). LongcatEngine (_engine.pyx) serves it."""
import numpy as np

from .. import variants
from ..plan import HashPlan, as_ids, frozen
from . import config, hf, reference, weights
from ._engine import LongcatEngine
from .weights import LongcatWeights


class RowsOfIds(np.ndarray):
    """Head-local rows [B, T, E] that keep the ids they were hashed from (`ids`): what the plan's
    hash_numpy gives EngramModel.forward, which hands the variant's forward the rows alone, and
    an input layer's output needs the ids too (the token embedding)."""
    ids = None


def _rows_of_ids(rows, ids):
    out = rows.view(RowsOfIds)
    out.ids = ids
    return out


def install_geometry(plan):
    """LongCat's head sizes, offsets and multipliers on a HashPlan made by the common code (its
    prime chain is not LongCat's); plan.hash runs LongcatWindow's hooks (the seam), with negative
    ids refused first, and plan.hash_numpy is the numpy oracle's hash (reference.rows), its rows
    keeping their ids (RowsOfIds)."""
    cfg = plan.cfg
    sizes, k = config.table_sizes(cfg), cfg.n_head_per_ngram
    for L in cfg.layer_ids:
        plan.primes[L] = [sizes[g * k:(g + 1) * k].tolist() for g in range(cfg.max_ngram_size - 1)]
        plan.head_primes[L] = frozen(sizes)
        plan.offsets[L] = frozen(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
        plan.table_rows[L] = int(sizes.sum())
        plan.head_fp[L] = None   # the division-free mod constants are for the XOR chain's primes
    plan.head_mods = {L: frozen(config.head_mods(cfg)) for L in cfg.layer_ids}

    fast = plan.hash

    def hash_checked(ids, layers=None, out=None):
        """The window's fast path, after refusing negative ids (the window hashes them without a word)."""
        a = as_ids(ids, 2)
        if a.size and a.min() < 0:
            raise ValueError(f"token id {a.min()} is negative: {cfg.variant} takes ids in [0, vocab_size="
                             f"{cfg.vocab_size})")
        return fast(a, layers=layers, out=out)

    def hash_numpy(ids, layers=None):
        a = as_ids(ids, 2)
        r = reference.rows(cfg, a)
        return {plan.check_layer(L): _rows_of_ids(r.copy(), a) for L in (cfg.layer_ids if layers is None else layers)}

    plan.hash = hash_checked
    plan.hash_numpy = hash_numpy


class LongcatVariant(variants.Variant):
    weights_rules = weights
    config_rules = config
    name = config.LONGCAT
    example_config = config.EXAMPLE
    config_class = config.LongcatConfig
    field_help = config.FIELD_HELP
    hf_config = True
    weights = LongcatWeights
    weight_dtypes = ("float32", "bfloat16")
    table_dtypes = ("float32", "bfloat16")
    folder_checkpoint = True
    load_note = "raw token ids: no compression, no tokenizer read; an input layer (layer 0)"
    engine = LongcatEngine
    negative_ids = False    # ids index the token embedding: the engine refuses negative ids

    def with_weight_dtype(self, cfg, layers, name):
        dtype = np.dtype(weights.BF16 if name == "bfloat16" else np.float32)
        return {L: LongcatWeights(cfg, w.offsets, w.table, w.embed, w.proj_w.astype(dtype))
                for L, w in layers.items()}

    def load(self, path, mmap=True, compression=None):
        if compression is not None:
            raise ValueError(f"{self.name} hashes raw token ids: load it without a compression")
        return hf.load(path, mmap=mmap)

    def save(self, cfg, plan, layers, path, table_dtype=None, progress=None):
        return hf.save(cfg, plan, layers, path, table_dtype=table_dtype, progress=progress)

    def save_init(self, cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
                  progress=None, before_write=None):
        if compression is not None:
            raise ValueError(f"{self.name} hashes raw token ids: it takes no compression")
        plan = HashPlan(cfg)
        return hf.save(cfg, plan, weights.init_layers(cfg, plan, seed, graft_zero_init, hold_tables=False), path,
                       table_dtype=table_dtype, progress=progress, before_write=before_write)

    def is_checkpoint(self, path):
        return hf.is_checkpoint(path)

    def folder_of(self, path):
        return hf.folder_of(path)

    # computing
    def forward(self, cfg, w, rows, dead, hidden, ids=None):
        """The oracle of an input layer: made from the ids (the token embedding) and their rows;
        hidden is not read. ids: given, or the ones the rows keep (the plan's hash_numpy: RowsOfIds)."""
        if ids is None:
            ids = getattr(rows, "ids", None)
        if ids is None:
            raise ValueError(f"{self.name} is an input layer: its output is made from the token ids (embed_tokens[id]), "
                             f"which this call did not pass; use engram_stream.longcat.reference.forward(cfg, weights, "
                             f"ids)")
        return reference.forward_rows(cfg, w, ids, np.asarray(rows).view(np.ndarray))

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

    def check_plan(self, plan):
        install_geometry(plan)


VARIANT = variants.register(LongcatVariant())
