"""The deepseek-v4.1 variant's config (DESIGN.md 4): V41Config, its fields; their defaults and
checks; its Hugging Face config.json (read and written). EngramConfig asks them through the registry."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass

from ..config import EngramConfig, _int, _int_list, described

V41 = "deepseek-v4.1"
V41_BLOCK = 32  # one float8 scale per 32 values (rows, activations) / 32x32 weight block
DEFAULTS = {"norm_eps": 1e-20, "image_token_id": 129264}  # DeepSeek-V4.1-Flash config.json
_UNSET = object()  # a config.json key that is absent (None: present, JSON null)

# The config.json keys from_hf_config reads (either spelling of a renamed one), and of them the
# Engram module's own: an unread key close to one of these is warned about as a misspelling.
HF_KEYS = ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_layer_ids",
           "engram_pad_id", "engram_pad_token_id", "dim", "hidden_size", "hc_mult", "vocab_size", "norm_eps",
           "rms_norm_eps", "image_token_id", "engram_num_embeddings", "engram_compressed_vocab_size", "text_config")
HF_OWN_KEYS = tuple(k for k in HF_KEYS if k.startswith("engram_"))

EXAMPLE = {"variant": V41, "engram_vocab_size": [211, 211, 211], "max_ngram_size": 4, "n_embed_per_ngram": 64,
           "n_head_per_ngram": 2, "hidden_size": 64, "vocab_size": 300, "image_token_id": 299}


@dataclass(frozen=True)
class V41Config(EngramConfig):
    """EngramConfig(variant="deepseek-v4.1", ...): the common fields and V4.1's own: the gate's
    eps, the DEAD (image) token id, and the table rows per layer and compressed vocab a
    checkpoint declares (None: not declared; HashPlan checks them before serving)."""

    variant: str = V41
    norm_eps: float = described(f"{V41}: eps of the q/k gate's norm (null: 1e-20, Flash's)", None)
    image_token_id: int = described(f"{V41}: the DEAD (image) token: gate 0, cuts the n-gram history (null: 129264)",
                                    None)
    num_embeddings: list = described(f"{V41}: table rows per layer the checkpoint declares, checked "
                                     "(null: not declared)", None)
    compressed_vocab_size: int = described(f"{V41}: ids of the compression, checked (null: not declared)", None)


def validate(cfg, put):
    """V4.1's rules after EngramConfig's common ones; the two defaulted fields take Flash's values."""
    defaulted = [name for name, default in DEFAULTS.items() if getattr(cfg, name) is None]
    for name in defaulted:
        put(name, DEFAULTS[name])
    if cfg.seed != 0:  # the reference draws the multipliers from default_rng(10007 * layer)
        raise ValueError(f"EngramConfig.seed must be 0 for {V41} (its multipliers have no seed), got {cfg.seed}")
    for name in ("hidden_size", "head_dim"):
        if getattr(cfg, name) % V41_BLOCK:
            raise ValueError(f"EngramConfig.{name} must be a multiple of {V41_BLOCK} for {V41} "
                             f"(float8 blocks), got {getattr(cfg, name)}")
    eps = cfg.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < float(eps) < 1 and math.isfinite(eps)):
        raise ValueError(f"EngramConfig.norm_eps must be a float in (0, 1), got {eps!r}")
    put("norm_eps", float(eps))
    img = _int("image_token_id", cfg.image_token_id)
    if not 0 <= img < cfg.vocab_size or img == cfg.pad_id:
        how = " (the default: DeepSeek-V4.1-Flash's; set image_token_id)" if "image_token_id" in defaulted else ""
        raise ValueError(f"EngramConfig.image_token_id must be in [0, vocab_size={cfg.vocab_size}) "
                         f"and differ from pad_id={cfg.pad_id}, got {img}{how}")
    put("image_token_id", img)
    if cfg.num_embeddings is not None:
        ne = _int_list("num_embeddings", cfg.num_embeddings)
        if len(ne) != len(cfg.layer_ids) or min(ne) < 1:
            raise ValueError(f"EngramConfig.num_embeddings needs one positive row count per layer "
                             f"{cfg.layer_ids}, got {ne}")
        put("num_embeddings", ne)
    if cfg.compressed_vocab_size is not None:
        cv = _int("compressed_vocab_size", cfg.compressed_vocab_size, 1)
        if cv > cfg.vocab_size:
            raise ValueError(f"EngramConfig.compressed_vocab_size must be <= vocab_size={cfg.vocab_size}, got {cv}")
        put("compressed_vocab_size", cv)


def reads_hf_config(d) -> bool:
    """A config.json of a model with V4.1's Engram (its engram_* keys)."""
    return isinstance(d, dict) and any(k in d or k in (d.get("text_config") or {})
                                       for k in ("engram_n_heads", "engram_layer_ids"))


def from_hf_config(cls, config, overrides):
    """EngramConfig fields from the parsed config.json. Reads either spelling of the three keys
    third-party readings rename: dim / hidden_size, norm_eps / rms_norm_eps, engram_pad_id /
    engram_pad_token_id; keys nested in a "text_config" (a multimodal config.json) are read over
    the top level's."""
    if isinstance(config.get("text_config"), dict):  # a multimodal folder: the text model's keys nest
        config = {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}

    def key(*names, default=_UNSET):
        found = {n: config[n] for n in names if n in config}
        if len({json.dumps(v) for v in found.values()}) > 1:
            raise ValueError(f"config.json: {' and '.join(found)} disagree: {found}")
        if found:
            return next(iter(found.values()))
        if default is _UNSET:
            raise ValueError(f"config.json has no {' / '.join(names)}")
        return default

    n = _int("engram_max_ngram_size", key("engram_max_ngram_size"), 2)
    evs = key("engram_vocab_size")
    evs = [evs] * (n - 1) if isinstance(evs, numbers.Integral) else evs
    heads, head_dim = key("engram_n_heads"), key("engram_head_dim")
    fields = dict(
        variant=V41, engram_vocab_size=evs, max_ngram_size=n,
        n_embed_per_ngram=_int("engram_n_heads", heads, 1) * _int("engram_head_dim", head_dim, 1),
        n_head_per_ngram=heads, layer_ids=key("engram_layer_ids"),
        pad_id=key("engram_pad_id", "engram_pad_token_id"), seed=0,
        hidden_size=key("dim", "hidden_size"), hc_mult=key("hc_mult"), vocab_size=key("vocab_size"),
        norm_eps=key("norm_eps", "rms_norm_eps"),
        image_token_id=key("image_token_id", default="absent"),
        # declared sizes: absent or null is "not declared"; any other value (0, []) is checked
        num_embeddings=key("engram_num_embeddings", default=None),
        compressed_vocab_size=key("engram_compressed_vocab_size", default=None))
    if fields["image_token_id"] is None:
        raise ValueError("config.json: image_token_id is null: give the DEAD (image) token's id, or leave the "
                         "key out for DeepSeek-V4.1-Flash's")
    if fields["image_token_id"] == "absent":
        fields["image_token_id"] = None  # EngramConfig takes the default (and says so if it does not fit)
    fields.update(overrides)
    return cls(**fields)


def to_hf_config(cfg) -> dict:
    """The V4.1 keys of config.json (the reference's ModelArgs names)."""
    d = {"vocab_size": cfg.vocab_size, "dim": cfg.hidden_size, "hc_mult": cfg.hc_mult,
         "norm_eps": cfg.norm_eps, "image_token_id": cfg.image_token_id,
         "engram_layer_ids": list(cfg.layer_ids), "engram_max_ngram_size": cfg.max_ngram_size,
         "engram_n_heads": cfg.n_head_per_ngram, "engram_head_dim": cfg.head_dim,
         "engram_pad_id": cfg.pad_id}
    evs = cfg.engram_vocab_size
    d["engram_vocab_size"] = evs[0] if len(set(evs)) == 1 else list(evs)
    if cfg.num_embeddings is not None:
        d["engram_num_embeddings"] = list(cfg.num_embeddings)
    if cfg.compressed_vocab_size is not None:
        d["engram_compressed_vocab_size"] = cfg.compressed_vocab_size
    return d
