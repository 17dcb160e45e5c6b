"""The longcat-flash-lite variant's config rules (DESIGN.md 4c): its field, its Hugging Face
config.json (read and written), and how LongCat's geometry sits on HashPlan's.

LongCat-Flash-Lite's n-gram embedding is an input layer: the embedding fed to decoder layer 1,
made from the token's own embedding and E = emb_split_num * (emb_neighbor_num - 1) hashed rows.
It maps onto EngramConfig's fields as
  emb_neighbor_num n        -> max_ngram_size (orders 2..n)
  emb_split_num k           -> n_head_per_ngram (the heads of an order are its k splits)
  hidden_size // E          -> head_dim (n_embed_per_ngram = k * head_dim, so engram_dim = hidden_size)
  m = ratio * vocab_size    -> every order's engram_vocab_size
  eos_token_id              -> pad_id
  layer_ids [0]             (layer 0: the input embedding), hc_mult 1 (one hidden row per token).
HashPlan's heads are the E embedders, order-major (head c = (g - 2) k + j, the checkpoint's
embedder index); head c's "prime" is its table size mod_c = m + 2c + 1 (not a prime: the plan's
prime chain is replaced by these, Variant.check_plan), its offset the exclusive prefix sum of
the mod_c (one concatenated table, as vLLM's), and its multipliers vocab_size^delta mod mod_c
(head_mods: one set per head; HashPlan.multipliers holds head 0's).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import EngramConfig, _int, described

LONGCAT = "longcat-flash-lite"
MODEL_TYPES = ("longcat_flash_ngram",)
# LongcatFlashNgramConfig's defaults, for keys a config.json leaves out
HF_DEFAULTS = {"vocab_size": 131072, "hidden_size": 6144, "emb_neighbor_num": 4, "emb_split_num": 4,
               "ngram_vocab_size_ratio": 78, "eos_token_id": 2}
# The config.json keys from_hf_config reads, and of them the n-gram embedding's own: an unread key
# close to one of these is warned about as a misspelling (an absent one takes HF_DEFAULTS').
HF_KEYS = (*HF_DEFAULTS, "model_type", "architectures")
HF_OWN_KEYS = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio")
INT64_MAX = (1 << 63) - 1

EXAMPLE = {"variant": LONGCAT, "vocab_size": 50, "ngram_vocab_size_ratio": 3, "engram_vocab_size": [150, 150],
           "max_ngram_size": 3, "n_head_per_ngram": 2, "n_embed_per_ngram": 16, "hidden_size": 32,
           "hc_mult": 1, "layer_ids": [0], "pad_id": 2}


@dataclass(frozen=True)
class LongcatConfig(EngramConfig):
    """EngramConfig(variant="longcat-flash-lite", ...): the common fields (mapped as the module
    doc says) and LongCat's own: ngram_vocab_size_ratio (None: engram_vocab_size[0] / vocab_size
    when that divides)."""

    variant: str = LONGCAT
    ngram_vocab_size_ratio: int = described(f"{LONGCAT}: m = ratio * vocab_size, the base of every embedder's "
                                            "table size m + 2c + 1 (engram_vocab_size must be "
                                            "[m] * (max_ngram_size - 1))", None)

    @property
    def n_embedders(self) -> int:
        """E = emb_split_num * (emb_neighbor_num - 1): the hashed rows of a token."""
        return self.n_heads

    @property
    def ngram_vocab(self) -> int:
        """m = ngram_vocab_size_ratio * vocab_size."""
        return self.ngram_vocab_size_ratio * self.vocab_size


def validate(cfg, put):
    """LongCat's rules after EngramConfig's common ones."""
    evs = cfg.engram_vocab_size
    ratio = cfg.ngram_vocab_size_ratio
    if ratio is None:
        if evs[0] % cfg.vocab_size:
            raise ValueError(f"EngramConfig.ngram_vocab_size_ratio: not given, and engram_vocab_size[0]={evs[0]} "
                             f"is not a multiple of vocab_size={cfg.vocab_size}: pass the ratio")
        ratio = evs[0] // cfg.vocab_size
    ratio = _int("ngram_vocab_size_ratio", ratio, 1)
    put("ngram_vocab_size_ratio", ratio)
    m = ratio * cfg.vocab_size
    if evs != [m] * len(evs):
        raise ValueError(f"EngramConfig.engram_vocab_size must be [m] * {len(evs)} with m = ngram_vocab_size_ratio * "
                         f"vocab_size = {m} for {LONGCAT}, got {evs}")
    if cfg.hc_mult != 1:
        raise ValueError(f"EngramConfig.hc_mult must be 1 for {LONGCAT} (an input layer: one row per token), "
                         f"got {cfg.hc_mult}")
    if list(cfg.layer_ids) != [0]:
        raise ValueError(f"EngramConfig.layer_ids must be [0] for {LONGCAT} (layer 0: the input embedding), "
                         f"got {cfg.layer_ids}")
    if cfg.engram_dim != cfg.hidden_size:
        raise ValueError(f"EngramConfig: (max_ngram_size-1) * n_embed_per_ngram = {cfg.engram_dim} must equal "
                         f"hidden_size = {cfg.hidden_size} for {LONGCAT} (each of the {cfg.n_heads} embedders "
                         f"holds hidden_size // {cfg.n_heads} values)")
    top = m + 2 * (cfg.n_heads - 1) + 1
    # the hash sums n products id * (vocab^delta mod mod_c) in int64 before its mod
    if cfg.max_ngram_size * (cfg.vocab_size - 1) * (top - 1) > INT64_MAX:
        raise ValueError(f"EngramConfig: max_ngram_size * (vocab_size-1) * (largest table size-1) = "
                         f"{cfg.max_ngram_size} * {cfg.vocab_size - 1} * {top - 1} is past int64: the hash sums "
                         f"those products in int64; use a smaller ngram_vocab_size_ratio")


def table_sizes(cfg) -> np.ndarray:
    """int64[E]: embedder c's rows, mod_c = m + 2c + 1."""
    return np.array([cfg.ngram_vocab + 2 * c + 1 for c in range(cfg.n_heads)], dtype=np.int64)


def head_mods(cfg) -> np.ndarray:
    """int64[E, n]: embedder c's multipliers, vocab_size^delta mod mod_c for delta < its order
    g = c // k + 2, and 0 past it (the ids that far back are not in its n-gram)."""
    E, n, k = cfg.n_heads, cfg.max_ngram_size, cfg.n_head_per_ngram
    out = np.zeros((E, n), dtype=np.int64)
    for c, mod in enumerate(table_sizes(cfg).tolist()):
        for d in range(c // k + 2):
            out[c, d] = pow(cfg.vocab_size, d, mod)
    return out


def draw_multipliers(cfg, compressed_vocab) -> dict:
    """{0: int64[n]}: head 0's multipliers vocab_size^delta mod mod_0 for every delta (HashPlan's
    per-layer multipliers, in the engine's snapshot fingerprint; head_mods has every head's)."""
    mod = int(table_sizes(cfg)[0])
    return {L: np.array([pow(cfg.vocab_size, d, mod) for d in range(cfg.max_ngram_size)], dtype=np.int64)
            for L in cfg.layer_ids}


def table_rows(cfg, rows: int) -> int:
    """The concatenated table's rows: the sum of the mod_c (the prime chain's sum is not used)."""
    return int(table_sizes(cfg).sum())


def reads_hf_config(d) -> bool:
    """A config.json of LongCat-Flash-Lite: model_type longcat_flash_ngram, or its architecture."""
    if not isinstance(d, dict):
        return False
    return d.get("model_type") in MODEL_TYPES or "LongcatFlashNgramForCausalLM" in (d.get("architectures") or [])


def from_hf_config(cls, config, overrides):
    """EngramConfig fields from the parsed config.json; absent keys take LongcatFlashNgramConfig's
    defaults; eos_token_id may be a list (its first id)."""
    def key(name):
        return config[name] if config.get(name) is not None else HF_DEFAULTS[name]

    n = _int("emb_neighbor_num", key("emb_neighbor_num"), 2)
    k = _int("emb_split_num", key("emb_split_num"), 1)
    hidden = _int("hidden_size", key("hidden_size"), 1)
    vocab = _int("vocab_size", key("vocab_size"), 1)
    ratio = key("ngram_vocab_size_ratio")
    if isinstance(ratio, float) and ratio.is_integer():
        ratio = int(ratio)
    ratio = _int("ngram_vocab_size_ratio", ratio, 1)
    E = k * (n - 1)
    if hidden % E:
        raise ValueError(f"config.json: hidden_size {hidden} must be divisible by emb_split_num * (emb_neighbor_num-1) "
                         f"= {E}")
    eos = key("eos_token_id")
    if isinstance(eos, list):
        if not eos:
            raise ValueError("config.json: eos_token_id is an empty list: the n-gram walk stops at the EOS id")
        eos = eos[0]
    fields = dict(variant=LONGCAT, vocab_size=vocab, hidden_size=hidden, hc_mult=1, layer_ids=[0],
                  max_ngram_size=n, n_head_per_ngram=k, n_embed_per_ngram=k * (hidden // E),
                  engram_vocab_size=[ratio * vocab] * (n - 1), ngram_vocab_size_ratio=ratio, pad_id=eos)
    fields.update(overrides)
    return cls(**fields)


def to_hf_config(cfg) -> dict:
    """The n-gram embedding's keys of a LongCat-Flash-Lite config.json."""
    return {"model_type": MODEL_TYPES[0], "architectures": ["LongcatFlashNgramForCausalLM"],
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "emb_neighbor_num": cfg.max_ngram_size,
            "emb_split_num": cfg.n_head_per_ngram, "ngram_vocab_size_ratio": cfg.ngram_vocab_size_ratio,
            "eos_token_id": cfg.pad_id}


def describe(cfg) -> str:
    return (f"input layer: {cfg.n_heads} embedders of {cfg.head_dim} values (tables m + 2c + 1, m = "
            f"{cfg.ngram_vocab}), EOS {cfg.pad_id} ends the n-gram walk, output mean of {cfg.n_heads + 1} embeddings")
