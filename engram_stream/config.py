"""EngramConfig: the Engram module's hyper-parameters plus the tokenizer vocab size.

The common fields are checked here. A variant's own fields live in its config class, a frozen
dataclass subclass of EngramConfig that its Variant names (Variant.config_class):
EngramConfig(variant=name, ...) returns an instance of that class, so every constructor path
(keywords, dataclasses.replace, from_dict, from_hf_config, pickle and copy) holds exactly the
fields of its variant. Its rules are the Variant's validate_config, run after the common ones.
DESIGN.md 1 and 4 pin the built-in variants' semantics.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
import warnings
from dataclasses import dataclass, field

from . import variants
from .errors import ConfigFieldError, ConfigKeyWarning
from ._hash import MAX_KERNEL_SIZE, MAX_NGRAM  # include/engram_consts.h, their one source

INT64_MAX = (1 << 63) - 1
MAX_VOCAB = 1 << 31  # tokenizer vocab bound: an int64 lookup of this length is already 16 GiB
INT32_MAX = (1 << 31) - 1  # the C kernels index one token's widths ((G+1)*D, E) with int
# The most rows one layer's table (the sum of its primes) may have: offsets and rows are int64
# everywhere (a larger sum wrapped, to 708 rows in one case, and steps read far past the table).
MAX_TABLE_ROWS = INT64_MAX
# The difflib ratio from which a config.json key no variant reads is taken for a misspelling of
# one of the Engram module's own keys (ngram_vocab_base for ngram_vocab_size_base: 0.86); the
# other keys of transformers' Qwen4-Exp and DeepSeek-V4 configs stay below it (at most 0.77:
# pad_token_id to engram_pad_token_id, linear_conv_kernel_dim to ple_conv_kernel_size).
MISSPELLING = 0.8


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


def described(text, default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING):
    """A config field with its help beside it (`engram-stream init --help` prints it: field_help)."""
    return field(default=default, default_factory=default_factory, metadata={"help": text})


def field_help(cls) -> dict:
    """{field: help} of a config class's fields, its own and EngramConfig's (each declared with
    described(); "" where a field has none). variant's lists the registered variants."""
    listed = " or ".join(json.dumps(v.name) + (" (written as a folder)" if v.folder_checkpoint else "")
                         for v in variants.variants())
    return {f.name: listed if f.name == "variant" else f.metadata.get("help", "") for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class EngramConfig:
    """Hyper-parameters of the Engram layers of one model (defaults: the public demo).

    ``vocab_size`` is the tokenizer vocab (the length of the compression table);
    ``hidden_size`` the backbone width D and ``hc_mult`` the number of
    hyper-connection streams G (1 for a plain residual stream).
    """

    engram_vocab_size: list = described(
        "list, one per order 2..max_ngram_size: where each order's prime search starts",
        default_factory=lambda: [646400, 646400])
    max_ngram_size: int = described("longest n-gram hashed (orders 2..max_ngram_size)", 3)
    n_embed_per_ngram: int = described("width of one order's retrieved embedding (split over its heads)", 512)
    n_head_per_ngram: int = described("hash heads per order (each its own prime, its own table rows)", 8)
    layer_ids: list = described("backbone layers that get an Engram module", default_factory=lambda: [1, 15])
    pad_id: int = described("token id read before the start of a sequence", 2)
    seed: int = described("seeds the HASH multipliers (not the weights: see --weight-seed)", 0)
    kernel_size: int = described("taps of the causal ShortConv", 4)
    hidden_size: int = described("backbone width D", 1024)
    hc_mult: int = described("hyper-connection streams G (1: a plain residual stream)", 4)
    vocab_size: int = described("tokenizer vocab (length of a compression lookup)", 129280)
    variant: str = variants.DEFAULT   # its help lists the registered variants (field_help)

    def __new__(cls, *args, **kwargs):
        """An instance of the config class of the variant named (its Variant.config_class);
        a field of another variant's class is refused, naming the variants that use it."""
        if not args and not kwargs:   # copy and pickle: an empty instance of this very class
            return object.__new__(cls)
        given = dict(zip((f.name for f in dataclasses.fields(cls)), args))
        given.update(kwargs)
        target = config_class(given.get("variant", cls.__dataclass_fields__["variant"].default))
        own = {f.name for f in dataclasses.fields(target)}
        for name in set(given) - own:
            users = [v.name for v in variants.variants() if name in variant_fields(v)]
            if users:
                raise ValueError(f"EngramConfig.{name} is a field of {' and '.join(map(repr, users))} "
                                 f"(variant is {given.get('variant', target.variant)!r})")
        if issubclass(target, cls):
            return object.__new__(target)   # type.__call__ runs target's __init__ next
        return target(*args, **kwargs)   # replace() of one variant's config by another's: built whole

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        spec = variants.get(self.variant)
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
        if type(self) is not config_class(self.variant):  # a config class called past __new__'s check
            raise TypeError(f"{type(self).__name__} holds no {self.variant!r} config: build it as "
                            f"EngramConfig(variant={self.variant!r}, ...)")
        spec.validate_config(self, put)

    @classmethod
    def from_hf_config(cls, config, **overrides) -> "EngramConfig":
        """A config from a model's Hugging Face config.json (a path, a folder holding one, or the
        parsed dict), read by the registered variant whose models it describes
        (Variant.reads_hf_config: deepseek-v4.1's engram_* keys, qwen3.8-flash-next's ple_* keys)."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:   # its line and column, and the file's name
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
            where = path
        else:
            where = "config.json"
        if not isinstance(config, dict):
            raise TypeError(f"from_hf_config expects a path or a dict, got {type(config).__name__}")
        spec = next((v for v in variants.variants() if v.reads_hf_config(config)), None)
        if spec is None:
            readers = [v.name for v in variants.variants() if v.hf_config]
            raise ValueError(f"config.json describes no Engram of a known variant (the variants read from "
                             f"config.json: {readers}, each from its own keys)")
        unknown = sorted(set(overrides) - known_fields())
        if unknown:   # a keyword the caller wrote: refused, as EngramConfig(...) refuses one
            raise TypeError(f"EngramConfig.from_hf_config: unknown fields {unknown}{_suggest(unknown, known_fields())}")
        for message in unread_hf_keys(config, spec, where):
            warnings.warn(message, ConfigKeyWarning, stacklevel=2)
        return spec.from_hf_config(cls, config, overrides)

    def __getattr__(self, name):
        """Only for names a normal lookup does not find: a field of other variants' config
        classes says so (ConfigFieldError, also a ValueError); any other name is AttributeError."""
        users = [] if name.startswith("__") else [v.name for v in variants.variants() if name in variant_fields(v)]
        if users:
            raise ConfigFieldError(f"EngramConfig.{name} is a field of {' and '.join(map(repr, users))}, not of "
                                   f"variant {self.variant!r}", name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

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
        """The fields of this config's variant (its config class holds no other): the default
        variant's leaves out its name, so its files and fingerprints do not change when another
        variant is added."""
        d = dataclasses.asdict(self)
        if self.variant == variants.DEFAULT:
            del d["variant"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_hf_config(self) -> dict:
        """The Engram keys of a Hugging Face config.json, for a variant whose models have one."""
        return variants.get(self.variant).to_hf_config(self)

    @classmethod
    def from_dict(cls, d) -> "EngramConfig":
        if not isinstance(d, dict):
            raise TypeError(f"EngramConfig.from_dict expects a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - known_fields(), key=str)
        if unknown:
            raise ValueError(f"EngramConfig: unknown fields {unknown}{_suggest(unknown, known_fields())}")
        return cls(**d)


def config_class(variant_name) -> type:
    """The config class of a registered variant (EngramConfig for one without fields of its own);
    an unknown name raises ValueError naming the known ones."""
    cls = variants.get(variant_name).config_class or EngramConfig
    if not (isinstance(cls, type) and issubclass(cls, EngramConfig) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"the config_class of variant {variant_name!r} must be a dataclass subclass of "
                        f"EngramConfig, got {cls!r}")
    return cls


def check_config_class(variant):
    """register()'s check of a variant's config class (variants.REGISTER_CHECKS): None, or a
    frozen dataclass subclass of EngramConfig decorated itself, whose variant field defaults to
    the variant's name (so TheClass(...) builds one of its configs)."""
    cls, what = variant.config_class, type(variant).__name__
    if cls is None:
        return
    if not (isinstance(cls, type) and issubclass(cls, EngramConfig)):
        raise TypeError(f"{what}.config_class must be None or a subclass of EngramConfig, got {cls!r}")
    params = cls.__dict__.get("__dataclass_params__")   # the class's own decorator, not a base's
    if params is None or not params.frozen:
        raise TypeError(f"{what}.config_class {cls.__name__} must be a frozen dataclass: decorate it with "
                        f"@dataclasses.dataclass(frozen=True)")
    default = cls.__dataclass_fields__["variant"].default
    if default != variant.name:
        raise TypeError(f"{what}.config_class {cls.__name__} must declare variant: str = {variant.name!r} "
                        f"(its default is {default!r}), so {cls.__name__}(...) builds a {variant.name!r} config")


variants.REGISTER_CHECKS.append(check_config_class)


def known_fields() -> set:
    """Every config field of a registered variant: EngramConfig's and each config class's own."""
    return {f.name for f in dataclasses.fields(EngramConfig)}.union(*(variant_fields(v) for v in variants.variants()))


def _closest(name, names, cutoff=0.6):
    """The entry of names most like name (difflib), or None when none is close."""
    found = difflib.get_close_matches(name, sorted(names), n=1, cutoff=cutoff) if isinstance(name, str) else []
    return found[0] if found else None


def _suggest(unknown, names) -> str:
    """' (x: did you mean 'y'?; ...)' for the unknown names that are close to one of names."""
    hints = [f"{u!r}: did you mean {_closest(u, names)!r}?" for u in unknown if _closest(u, names)]
    return f" ({'; '.join(hints)})" if hints else ""


def unread_hf_keys(config: dict, spec, where="config.json") -> list:
    """What from_hf_config warns about: one message for each key of the config.json (its top level
    and text_config) that the variant reading it does not read and that looks like an Engram key:
    close to one of the variant's own keys (Variant.hf_config_keys) or an EngramConfig field's
    name. A whole model's other keys (architectures, num_attention_heads, ...) are not Engram
    keys and are not reported."""
    read, own, defaults = spec.hf_config_keys()
    if not read:   # a variant that lists no keys: nothing to compare with
        return []
    keys = set(config) | (set(config["text_config"]) if isinstance(config.get("text_config"), dict) else set())
    common = {f.name for f in dataclasses.fields(EngramConfig)}
    out = []
    for k in sorted(keys - set(read), key=str):
        if not (k in common or _closest(k, own, MISSPELLING)):
            continue
        best = _closest(k, read)
        msg = f"{where}: key {k!r} is not read by {spec.name}"
        if best is None:
            msg += f" (its Engram keys: {', '.join(own)})"
        else:
            msg += f": did you mean {best!r}?"
            if best not in keys:
                msg += f" ({best!r} is absent: " + (f"its default {defaults[best]!r} is used)" if best in defaults
                                                     else "not set)")
        out.append(msg)
    return out


def variant_fields(variant) -> tuple:
    """The fields a Variant's config class adds to EngramConfig's, in order."""
    if not variant.config_class:
        return ()
    common = {f.name for f in dataclasses.fields(EngramConfig)}
    return tuple(f.name for f in dataclasses.fields(variant.config_class) if f.name not in common)


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
