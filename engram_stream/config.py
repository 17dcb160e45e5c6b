"""EngramConfig: the demo module's hyper-parameters plus the tokenizer vocab size."""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field

INT64_MAX = (1 << 63) - 1
MAX_NGRAM = 64  # the C kernels keep a window of at most this many ids on the stack


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

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        put("max_ngram_size", _int("max_ngram_size", self.max_ngram_size, 2))
        if self.max_ngram_size > MAX_NGRAM:
            raise ValueError(f"EngramConfig.max_ngram_size must be <= {MAX_NGRAM}, got {self.max_ngram_size}")
        for name in ("n_embed_per_ngram", "n_head_per_ngram", "kernel_size", "hidden_size",
                     "hc_mult", "vocab_size"):
            put(name, _int(name, getattr(self, name), 1))
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
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d) -> "EngramConfig":
        if not isinstance(d, dict):
            raise TypeError(f"EngramConfig.from_dict expects a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"EngramConfig: unknown fields {unknown}")
        return cls(**d)
