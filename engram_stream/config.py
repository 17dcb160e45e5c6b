"""EngramConfig: the Engram module's hyper-parameters plus the tokenizer vocab size.

Two variants (DESIGN.md): "demo-v1" (the public demo module, the default) and
"deepseek-v4.1" (the production module of DeepSeek-V4.1; section 4). The V4.1-only
fields (norm_eps, image_token_id, num_embeddings, compressed_vocab_size) stay None
for the demo.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass, field

from ._hash import MAX_KERNEL_SIZE, MAX_NGRAM  # include/engram_consts.h, their one source

INT64_MAX = (1 << 63) - 1
DEMO, V41 = "demo-v1", "deepseek-v4.1"
VARIANTS = (DEMO, V41)
V41_BLOCK = 32  # V4.1: one float8 scale per 32 values (rows, activations) / 32x32 weight block
V41_ONLY = ("norm_eps", "image_token_id", "num_embeddings", "compressed_vocab_size")
V41_DEFAULTS = {"norm_eps": 1e-20, "image_token_id": 129264}  # DeepSeek-V4.1-Flash config.json
MAX_VOCAB = 1 << 31  # tokenizer vocab bound: an int64 lookup of this length is already 16 GiB
INT32_MAX = (1 << 31) - 1  # the C kernels index one token's widths ((G+1)*D, E) with int
# The most rows one layer's table (the sum of its primes) may have: offsets and rows are int64
# everywhere (a larger sum wrapped, to 708 rows in one case, and steps read far past the table).
MAX_TABLE_ROWS = INT64_MAX
_UNSET = object()  # a config.json key that is absent (None: present, JSON null)


def _int(name, value, lo=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"EngramConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"EngramConfig.{name} must be >= {lo}, got {value}")
    return value


def _int_list(name, value):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"EngramConfig.{name} must be a list of ints, got {type(value).__name__}")
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


@dataclass(frozen=True)
class EngramConfig:
    """Hyper-parameters of the Engram layers of one model (defaults: the public demo).

    ``vocab_size`` is the tokenizer vocab (the length of the compression table);
    ``hidden_size`` the backbone width D and ``hc_mult`` the number of
    hyper-connection streams G (1 for a plain residual stream).
    """

    engram_vocab_size: list = field(default_factory=lambda: [646400, 646400])
    max_ngram_size: int = 3
    n_embed_per_ngram: int = 512
    n_head_per_ngram: int = 8
    layer_ids: list = field(default_factory=lambda: [1, 15])
    pad_id: int = 2
    seed: int = 0
    kernel_size: int = 4
    hidden_size: int = 1024
    hc_mult: int = 4
    vocab_size: int = 129280
    variant: str = DEMO
    # deepseek-v4.1 only (None for the demo): gate eps, the DEAD (image) token id, the table rows
    # the checkpoint declares per layer and the compressed vocab it was trained with (both checked
    # by HashPlan before serving)
    norm_eps: float = None
    image_token_id: int = None
    num_embeddings: list = None
    compressed_vocab_size: int = None

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.variant not in VARIANTS:
            raise ValueError(f"EngramConfig.variant must be one of {VARIANTS}, got {self.variant!r}")
        put("max_ngram_size", _int("max_ngram_size", self.max_ngram_size, 2))
        if self.max_ngram_size > MAX_NGRAM:
            raise ValueError(f"EngramConfig.max_ngram_size must be <= {MAX_NGRAM}, got {self.max_ngram_size}")
        for name in ("n_embed_per_ngram", "n_head_per_ngram", "kernel_size", "hidden_size",
                     "hc_mult", "vocab_size"):
            put(name, _int(name, getattr(self, name), 1))
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(f"EngramConfig.vocab_size must be <= {MAX_VOCAB}, got {self.vocab_size}")
        if self.kernel_size > MAX_KERNEL_SIZE:
            raise ValueError(f"EngramConfig.kernel_size must be <= {MAX_KERNEL_SIZE}, got {self.kernel_size}")
        if max((self.hc_mult + 1) * self.hidden_size,
               (self.max_ngram_size - 1) * self.n_embed_per_ngram) > INT32_MAX:
            raise ValueError("EngramConfig: (hc_mult+1)*hidden_size and (max_ngram_size-1)*n_embed_per_ngram "
                             "must be < 2**31 (the kernels' int widths)")
        put("seed", _int("seed", self.seed, 0))
        put("pad_id", _int("pad_id", self.pad_id))
        evs = _int_list("engram_vocab_size", self.engram_vocab_size)
        if len(evs) != self.max_ngram_size - 1:
            raise ValueError(
                f"EngramConfig.engram_vocab_size needs max_ngram_size-1 = {self.max_ngram_size - 1} "
                f"entries (one per order 2..{self.max_ngram_size}), got {len(evs)}")
        for i, v in enumerate(evs):
            if not 2 <= v < (1 << 62):
                raise ValueError(f"EngramConfig.engram_vocab_size[{i}] must be in [2, 2**62), got {v}")
        put("engram_vocab_size", evs)
        if self.n_embed_per_ngram % self.n_head_per_ngram:
            raise ValueError(
                f"EngramConfig.n_embed_per_ngram ({self.n_embed_per_ngram}) must be divisible by "
                f"n_head_per_ngram ({self.n_head_per_ngram})")
        ids = _int_list("layer_ids", self.layer_ids)
        if not ids:
            raise ValueError("EngramConfig.layer_ids must name at least one layer")
        if min(ids) < 0:
            raise ValueError(f"EngramConfig.layer_ids must be non-negative, got {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"EngramConfig.layer_ids must be unique, got {ids}")
        put("layer_ids", ids)
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(
                f"EngramConfig.pad_id must be in [0, vocab_size={self.vocab_size}), got {self.pad_id}")
        if self.seed + 10007 * max(ids) > INT64_MAX:
            raise ValueError("EngramConfig.seed + 10007*max(layer_ids) must fit in int64")
        least = min_chain_rows(self)
        if least > MAX_TABLE_ROWS:  # cheap (the prime search could take hours on such a config)
            raise ValueError(f"EngramConfig: a layer's primes (engram_vocab_size {evs} x {self.n_head_per_ngram} "
                             f"heads per order) sum to at least {least} table rows, past int64 ({MAX_TABLE_ROWS}): "
                             f"use smaller engram_vocab_size")
        if self.variant == V41:
            self._validate_v41(put)
        else:
            for name in V41_ONLY:
                if getattr(self, name) is not None:
                    raise ValueError(f"EngramConfig.{name} is a {V41!r} field (variant is {self.variant!r})")

    def _validate_v41(self, put):
        defaulted = [name for name, default in V41_DEFAULTS.items() if getattr(self, name) is None]
        for name in defaulted:
            put(name, V41_DEFAULTS[name])
        if self.seed != 0:  # the reference draws the multipliers from default_rng(10007 * layer)
            raise ValueError(f"EngramConfig.seed must be 0 for {V41} (its multipliers have no seed), "
                             f"got {self.seed}")
        for name in ("hidden_size", "head_dim"):
            if getattr(self, name) % V41_BLOCK:
                raise ValueError(f"EngramConfig.{name} must be a multiple of {V41_BLOCK} for {V41} "
                                 f"(float8 blocks), got {getattr(self, name)}")
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < float(eps) < 1
                                                                               and math.isfinite(eps)):
            raise ValueError(f"EngramConfig.norm_eps must be a float in (0, 1), got {eps!r}")
        put("norm_eps", float(eps))
        img = _int("image_token_id", self.image_token_id)
        if not 0 <= img < self.vocab_size or img == self.pad_id:
            how = " (the default: DeepSeek-V4.1-Flash's; set image_token_id)" if "image_token_id" in defaulted else ""
            raise ValueError(f"EngramConfig.image_token_id must be in [0, vocab_size={self.vocab_size}) "
                             f"and differ from pad_id={self.pad_id}, got {img}{how}")
        put("image_token_id", img)
        if self.num_embeddings is not None:
            ne = _int_list("num_embeddings", self.num_embeddings)
            if len(ne) != len(self.layer_ids) or min(ne) < 1:
                raise ValueError(f"EngramConfig.num_embeddings needs one positive row count per layer "
                                 f"{self.layer_ids}, got {ne}")
            put("num_embeddings", ne)
        if self.compressed_vocab_size is not None:
            cv = _int("compressed_vocab_size", self.compressed_vocab_size, 1)
            if cv > self.vocab_size:
                raise ValueError(f"EngramConfig.compressed_vocab_size must be <= vocab_size={self.vocab_size}, "
                                 f"got {cv}")
            put("compressed_vocab_size", cv)

    @classmethod
    def from_hf_config(cls, config, **overrides) -> "EngramConfig":
        """A deepseek-v4.1 config from the model's config.json (a path, a folder holding one, or
        the parsed dict). Reads either spelling of the three keys third-party readings rename:
        dim / hidden_size, norm_eps / rms_norm_eps, engram_pad_id / engram_pad_token_id; keys
        nested in a "text_config" (a multimodal config.json) are read over the top level's."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        if not isinstance(config, dict):
            raise TypeError(f"from_hf_config expects a path or a dict, got {type(config).__name__}")
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

    # Derived geometry -------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Width of one head's table row."""
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def n_heads(self) -> int:
        """H: heads over all orders (order-major)."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def engram_dim(self) -> int:
        """E: width of the concatenated retrieved rows."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram

    @property
    def conv_len(self) -> int:
        """Rows of history the dilated causal conv needs: (K-1)*dilation."""
        return (self.kernel_size - 1) * self.max_ngram_size

    # Serialization ------------------------------------------------------------
    def to_dict(self) -> dict:
        """All fields; a demo config leaves out the variant and the V4.1-only fields (as before
        there were variants: its files and fingerprints do not change)."""
        d = dataclasses.asdict(self)
        if self.variant == DEMO:
            for name in ("variant",) + V41_ONLY:
                del d[name]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_hf_config(self) -> dict:
        """The deepseek-v4.1 keys of config.json (the reference's ModelArgs names)."""
        if self.variant != V41:
            raise ValueError(f"to_hf_config is for the {V41!r} variant, not {self.variant!r}")
        d = {"vocab_size": self.vocab_size, "dim": self.hidden_size, "hc_mult": self.hc_mult,
             "norm_eps": self.norm_eps, "image_token_id": self.image_token_id,
             "engram_layer_ids": list(self.layer_ids), "engram_max_ngram_size": self.max_ngram_size,
             "engram_n_heads": self.n_head_per_ngram, "engram_head_dim": self.head_dim,
             "engram_pad_id": self.pad_id}
        evs = self.engram_vocab_size
        d["engram_vocab_size"] = evs[0] if len(set(evs)) == 1 else list(evs)
        if self.num_embeddings is not None:
            d["engram_num_embeddings"] = list(self.num_embeddings)
        if self.compressed_vocab_size is not None:
            d["engram_compressed_vocab_size"] = self.compressed_vocab_size
        return d

    @classmethod
    def from_dict(cls, d) -> "EngramConfig":
        if not isinstance(d, dict):
            raise TypeError(f"EngramConfig.from_dict expects a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"EngramConfig: unknown fields {unknown}")
        return cls(**d)


def min_chain_rows(cfg: EngramConfig, n_layers: int = 1) -> int:
    """A lower bound on the table rows (sums of primes) of n_layers layers, in O(max_ngram):
    the chain takes distinct integers, those of order n above engram_vocab_size[n-2] - 1
    (the fewest and smallest such). Configs and loaders check it before the prime search,
    which a crafted config could make take hours."""
    total, free = 0, 0
    for v in sorted(cfg.engram_vocab_size):
        k = n_layers * cfg.n_head_per_ngram
        start = max(v, free)
        total += k * start + k * (k - 1) // 2
        free = start + k
    return total
