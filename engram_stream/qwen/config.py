"""The qwen3.8-flash-next variant's config rules (DESIGN.md 4b): its fields' checks, its
Hugging Face config.json (read and written), and the two pieces of its hash geometry that
differ from the demo's: SplitMix64 multipliers and tables padded to a multiple of rows.
EngramConfig and HashPlan ask them through the registry.

The config maps onto EngramConfig's fields: ngram_size -> max_ngram_size, heads_per_ngram ->
n_head_per_ngram, ngram_vocab_size_base -> every order's engram_vocab_size (the demo's prime
chain over equal bases is transformers' "(global head index + 1)-th prime after base - 1"),
ple_embed_dim / (ngram_size - 1) -> n_embed_per_ngram, ple_layer_ids -> layer_ids (sorted, as
transformers sorts them: a layer's index in them seeds its multipliers), eos_token_id -> pad_id
(history before the start and before an EOS reads EOS), hc_count -> hc_mult,
ple_conv_kernel_size -> kernel_size, rms_norm_eps -> norm_eps (every norm of the PLE layer).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..config import EngramConfig, _int, described

QWEN = "qwen3.8-flash-next"
# transformers' Qwen4ExpTextConfig defaults, for keys a config.json leaves out
HF_DEFAULTS = {"vocab_size": 248320, "hidden_size": 2048, "rms_norm_eps": 1e-6, "hc_count": 4,
               "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
               "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128,
               "seed": 1234, "split_ngram_parts": 512}
# The config.json keys from_hf_config reads, and of them the PLE module's own: an unread key
# close to one of these is warned about as a misspelling (an absent one takes HF_DEFAULTS').
HF_KEYS = (*HF_DEFAULTS, "ple_layer_ids", "ple_embed_dim", "eos_token_id", "model_type", "text_config")
HF_OWN_KEYS = ("ple_layer_ids", "ple_embed_dim", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram",
               "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "split_ngram_parts", "hc_count")
DEFAULTS = {"norm_eps": 1e-6, "table_rows_multiple": 128, "table_parts": 512}
MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
PRIME_1 = 10007  # the layer seed stride (the same constant as the demo's)
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment and its two mixing multipliers
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

EXAMPLE = {"variant": QWEN, "engram_vocab_size": [211, 211], "max_ngram_size": 3, "n_embed_per_ngram": 32,
           "n_head_per_ngram": 2, "layer_ids": [2, 5], "pad_id": 299, "seed": 1234, "hidden_size": 48,
           "hc_mult": 4, "vocab_size": 300, "norm_eps": 1e-6, "table_rows_multiple": 128, "table_parts": 4}


@dataclass(frozen=True)
class QwenConfig(EngramConfig):
    """EngramConfig(variant="qwen3.8-flash-next", ...): the common fields and Qwen's own: the eps
    of every norm of the PLE layer, the multiple a table's rows are padded to, the parts a
    checkpoint splits a table into (None: transformers' defaults, DEFAULTS)."""

    variant: str = QWEN
    norm_eps: float = described(f"{QWEN}: eps of every norm of the PLE layer (rms_norm_eps; null: 1e-6)", None)
    table_rows_multiple: int = described(f"{QWEN}: a layer's table rows are padded up to a multiple of this "
                                         "(make_ngram_vocab_size_divisible_by; null: 128)", None)
    table_parts: int = described(f"{QWEN}: the shards a checkpoint splits each table into (split_ngram_parts; "
                                 "null: 512)", None)


def validate(cfg, put):
    """Qwen's rules after EngramConfig's common ones."""
    for name, default in DEFAULTS.items():
        if getattr(cfg, name) is None:
            put(name, default)
    evs = cfg.engram_vocab_size
    if len(set(evs)) != 1:  # one ngram_vocab_size_base for every order
        raise ValueError(f"EngramConfig.engram_vocab_size must be one value for every order for {QWEN} "
                         f"(ngram_vocab_size_base), got {evs}")
    if list(cfg.layer_ids) != sorted(cfg.layer_ids):  # transformers sorts ple_layer_ids: the index seeds
        raise ValueError(f"EngramConfig.layer_ids must be sorted for {QWEN} (a layer's index in ple_layer_ids "
                         f"seeds its multipliers), got {cfg.layer_ids}")
    eps = cfg.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < float(eps) < 1 and math.isfinite(eps)):
        raise ValueError(f"EngramConfig.norm_eps must be a float in (0, 1), got {eps!r}")
    put("norm_eps", float(eps))
    put("table_rows_multiple", _int("table_rows_multiple", cfg.table_rows_multiple, 1))
    put("table_parts", _int("table_parts", cfg.table_parts, 1))


def table_rows(cfg, rows: int) -> int:
    """transformers' padded_vocab_size: the primes' sum rounded up to table_rows_multiple."""
    m = cfg.table_rows_multiple
    return -(-rows // m) * m


def splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def draw_multipliers(cfg, compressed_vocab) -> dict:
    """{L: int64[max_ngram]}: multiplier k of the layer with index i in layer_ids is
    2 * (splitmix64(seed + 10007*i + GAMMA*(k+1)) mod half) + 1, half = (INT64_MAX // vocab) // 2.
    Qwen hashes raw ids, so the vocab is the tokenizer's (compressed_vocab is vocab_size)."""
    half = max(1, ((1 << 63) - 1) // max(cfg.vocab_size, 1) // 2)
    out = {}
    for i, L in enumerate(cfg.layer_ids):
        base = cfg.seed + PRIME_1 * i
        out[L] = np.array([2 * (splitmix64((base + _GAMMA * (k + 1)) & _MASK64) % half) + 1
                           for k in range(cfg.max_ngram_size)], dtype=np.int64)
    return out


def _text_config(config: dict) -> dict:
    """The text model's keys: a "text_config" (qwen4_exp) read over the top level."""
    if isinstance(config.get("text_config"), dict):
        return {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}
    return config


def reads_hf_config(d) -> bool:
    """A config.json of a Qwen4-Exp model (Qwen3.8-Flash-Next): its model_type or ple_* keys."""
    if not isinstance(d, dict):
        return False
    t = _text_config(d)
    return t.get("model_type") in MODEL_TYPES or d.get("model_type") in MODEL_TYPES or "ple_layer_ids" in t


def from_hf_config(cls, config, overrides):
    """EngramConfig fields from the parsed config.json (flat, or a qwen4_exp one with text_config);
    absent keys take transformers' Qwen4ExpTextConfig defaults; eos_token_id may be a list (its
    first id is the one PLE uses, as transformers reads it)."""
    t = _text_config(config)

    def key(name):
        return t[name] if name in t else HF_DEFAULTS[name]

    ple = t.get("ple_layer_ids")
    if not ple:
        raise ValueError("config.json: ple_layer_ids is absent or empty: this model has no PLE (n-gram) layers")
    eos = t.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("config.json: eos_token_id must be set: PLE reads history before an EOS as EOS")
    n = _int("ngram_size", key("ngram_size"), 2)
    heads = _int("heads_per_ngram", key("heads_per_ngram"), 1)
    hidden = key("hidden_size")
    dim = t.get("ple_embed_dim") if t.get("ple_embed_dim") is not None else hidden
    dim = _int("ple_embed_dim", dim, 1)
    if dim % ((n - 1) * heads):
        raise ValueError(f"config.json: ple_embed_dim {dim} must be divisible by (ngram_size-1)*heads_per_ngram "
                         f"= {(n - 1) * heads}")
    base = _int("ngram_vocab_size_base", key("ngram_vocab_size_base"), 2)
    fields = dict(
        variant=QWEN, engram_vocab_size=[base] * (n - 1), max_ngram_size=n,
        n_embed_per_ngram=dim // (n - 1), n_head_per_ngram=heads,
        layer_ids=sorted(set(_int(f"ple_layer_ids[{i}]", v) for i, v in enumerate(ple))),
        pad_id=eos, seed=key("seed"), kernel_size=key("ple_conv_kernel_size"),
        hidden_size=hidden, hc_mult=key("hc_count"), vocab_size=key("vocab_size"),
        norm_eps=key("rms_norm_eps"), table_rows_multiple=key("make_ngram_vocab_size_divisible_by"),
        table_parts=key("split_ngram_parts"))
    fields.update(overrides)
    return cls(**fields)


def to_hf_config(cfg) -> dict:
    """The PLE keys of a flat (qwen4_exp_text) config.json."""
    return {"model_type": "qwen4_exp_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "hc_count": cfg.hc_mult, "rms_norm_eps": cfg.norm_eps, "eos_token_id": cfg.pad_id,
            "ple_layer_ids": list(cfg.layer_ids), "ple_embed_dim": cfg.engram_dim,
            "ple_conv_kernel_size": cfg.kernel_size, "ngram_size": cfg.max_ngram_size,
            "heads_per_ngram": cfg.n_head_per_ngram, "ngram_vocab_size_base": cfg.engram_vocab_size[0],
            "make_ngram_vocab_size_divisible_by": cfg.table_rows_multiple, "seed": cfg.seed,
            "split_ngram_parts": cfg.table_parts}


def describe(cfg) -> str:
    return (f"EOS {cfg.pad_id} separates documents, norm eps {cfg.norm_eps}, rows padded to "
            f"x{cfg.table_rows_multiple}, conv {cfg.kernel_size} taps x dilation {cfg.max_ngram_size}")
