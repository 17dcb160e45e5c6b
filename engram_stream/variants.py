"""The variant registry: everything that differs between Engram modules, one entry a variant.

A variant is one folder (engram_stream/demo, engram_stream/v41) whose variant.py builds its
`Variant` and registers it here; EngramConfig, HashPlan, EngramModel and the CLI ask the
registry (`get(name)`, `variant_of(cfg)`, `registered()`), never a variant's name. This module
imports nothing of the package, so the config (below every variant) can ask it too. The
package's __init__ imports the built-in variants' variant.py; another variant registers itself
the same way (tests/contract/test_toy_variant.py does, from a test file).

Config (EngramConfig asks these):
    config_fields    the optional EngramConfig fields this variant uses (None for every other)
    validate_config  (cfg, put): the variant's own rules after the common ones; put(name, value)
                     sets a field (defaults, normalized values)
    reads_hf_config  (dict) -> bool: a Hugging Face config.json of this variant's models, or None
    from_hf_config   (cls, dict, overrides) -> EngramConfig from such a config.json, or None
    to_hf_config     (cfg) -> the config.json keys, or None
    field_help       {field: text} of its own fields, for `engram-stream init --help`
    example_config   a small config of this variant (dict of fields), for help texts and tests
Weights and files:
    weights          the class of one layer's weights (what the engine reads)
    validate_layer   (cfg, plan, L, w): shapes and dtypes the engine relies on
    init_layers      (cfg, plan, seed, graft_zero_init) -> {L: weights}, random
    from_state_dict  (cfg, plan, L, state_dict) -> weights: the reference module's names
    weight_dtypes    what with_weight_dtype accepts; with_weight_dtype (cfg, layers, name) -> layers
    load / save      the checkpoint format: load(path, mmap, compression=None) -> (cfg, plan, layers);
                     save(cfg, plan, layers, path, table_dtype, progress)
    save_init        (cfg, path, seed, graft_zero_init, compression, table_dtype, progress, before_write)
    table_dtypes     what save/save_init take as table_dtype (empty: the tables stay as they are)
    is_checkpoint    (path) -> bool: a checkpoint of this variant's format
    folder_checkpoint  a checkpoint is a folder (else one file)
    folder_of        (path) -> the checkpoint folder file `path` is part of, or None
    load_note        what load does besides mapping the tables, for the CLI's loading line
                     (e.g. where the compression comes from), or "" for nothing
    init_table_dtype the table dtype save_init writes when given no table_dtype
Computing:
    forward          (cfg, w, rows, dead, hidden) -> float32 delta: the numpy oracle
    engine           the streaming engine class: engine(model, layer, n_streams)
    describe         (cfg) -> str: the variant's own geometry, for `engram-stream inspect`
    step_weights     (w) -> the weight matrix one step reads whole (`engram-stream bench`'s floor)
Hashing (HashPlan asks these; the defaults are the demo's):
    history          how a window treats the ids before a position: "plain" (before the start:
                     pad), "dead" (deepseek-v4.1: the DEAD id cuts itself and every older id, its
                     gate is 0), "separator" (qwen3.8-flash-next: the positions after a pad id
                     read pad for it and every older id; no gate changes)
    draw_multipliers (cfg, compressed_vocab) -> {L: int64[max_ngram]}, or None: the demo's draw
    table_rows       (cfg, rows) -> the rows a layer's table holds given the sum of its primes
                     (padding), or None: exactly that sum
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

DEFAULT = "demo-v1"   # EngramConfig's default variant: the public demo module


@dataclass(frozen=True)
class Variant:
    name: str
    # config
    config_fields: tuple
    validate_config: Callable
    example_config: dict
    # weights and files
    weights: type
    validate_layer: Callable
    init_layers: Callable
    from_state_dict: Callable
    weight_dtypes: tuple
    with_weight_dtype: Callable
    load: Callable
    save: Callable
    save_init: Callable
    table_dtypes: tuple
    is_checkpoint: Callable
    folder_checkpoint: bool
    folder_of: Callable
    # computing
    forward: Callable
    engine: type
    describe: Callable
    step_weights: Callable
    # optional
    reads_hf_config: Optional[Callable] = None
    from_hf_config: Optional[Callable] = None
    to_hf_config: Optional[Callable] = None
    field_help: dict = field(default_factory=dict)
    history: str = "plain"
    draw_multipliers: Optional[Callable] = None
    table_rows: Optional[Callable] = None
    load_note: str = ""
    init_table_dtype: str = "float32"

    def __post_init__(self):
        if self.history not in HISTORIES:
            raise ValueError(f"Variant.history must be one of {HISTORIES}, got {self.history!r}")


HISTORIES = ("plain", "dead", "separator")


_REGISTRY: dict = {}


def register(variant: Variant) -> Variant:
    """Add a variant (its name must be new); returns it."""
    if not isinstance(variant, Variant):
        raise TypeError(f"register takes a Variant, got {type(variant).__name__}")
    if variant.name in _REGISTRY and _REGISTRY[variant.name] is not variant:
        raise ValueError(f"a variant named {variant.name!r} is registered already")
    _REGISTRY[variant.name] = variant
    return variant


def unregister(name: str):
    """Take a variant out again (a test's own variant, at its end)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple:
    """The names of every registered variant, in registration order."""
    return tuple(_REGISTRY)


def variants() -> tuple:
    """Every registered Variant, in registration order."""
    return tuple(_REGISTRY.values())


def get(name) -> Variant:
    """The entry of variant `name`; an unknown name raises ValueError naming the known ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"EngramConfig.variant must be one of {registered()}, got {name!r}") from None


def variant_of(cfg) -> Variant:
    """The registry entry of cfg.variant."""
    return get(cfg.variant)

