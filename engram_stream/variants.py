"""The variant registry: everything that differs between the two Engram modules, in one place.

A variant is one folder (engram_stream/demo, engram_stream/v41) plus one entry here. EngramModel,
the CLI and the tests ask the registry (`variant_of(cfg)`, `VARIANTS`), never `cfg.variant`.

    weights          the class of one layer's weights (what the engine reads)
    validate_layer   (cfg, plan, L, w): shapes and dtypes the engine relies on
    init_layers      (cfg, plan, seed, graft_zero_init) -> {L: weights}, random
    from_state_dict  (cfg, plan, L, state_dict) -> weights: the reference module's names
    forward          (cfg, w, rows, dead, hidden) -> float32 delta: the numpy oracle
    engine           the streaming engine class: engine(model, layer, n_streams)
    load / save      the checkpoint format: load(path, mmap) -> (cfg, plan, layers);
                     save(cfg, plan, layers, path, table_dtype, progress)
    save_init        (cfg, path, seed, graft_zero_init, compression, table_dtype, progress, before_write)
    is_checkpoint    (path) -> bool: a checkpoint of this variant's format
    folder_of        (path) -> the checkpoint folder file `path` is part of, or None (for "pass the folder")
    describe         (cfg) -> str: the variant's own geometry, for `engram-stream inspect`
    step_weights     (w) -> the weight matrix one step reads whole (`engram-stream bench`'s floor)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from .config import DEMO, V41
from .demo import checkpoint as demo_checkpoint
from .demo import reference as demo_reference
from .demo import weights as demo_weights
from .demo._engine import StreamEngine
from .plan import HashPlan
from .v41 import hf as v41_hf
from .v41 import reference as v41_reference
from .v41 import weights as v41_weights
from .v41._engine import V41StreamEngine


@dataclass(frozen=True)
class Variant:
    name: str
    weights: type
    validate_layer: Callable
    init_layers: Callable
    from_state_dict: Callable
    forward: Callable
    engine: type
    load: Callable
    save: Callable
    save_init: Callable
    is_checkpoint: Callable
    folder_of: Callable
    describe: Callable
    step_weights: Callable
    weight_dtypes: tuple      # what with_weight_dtype accepts


def _demo_save_init(cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None, progress=None,
                    before_write=None):
    return demo_checkpoint.save_init(cfg, path, seed, graft_zero_init, compression, table_dtype, progress,
                                     before_write)


def _v41_table_dtype(table_dtype):
    if table_dtype is not None:
        raise ValueError(f"table_dtype={table_dtype!r}: a {V41} checkpoint keeps its float8 tables (table_dtype is for "
                         f"{DEMO} checkpoints)")


def _v41_save(cfg, plan, layers, path, table_dtype=None, progress=None):
    _v41_table_dtype(table_dtype)
    return v41_hf.save(cfg, plan, layers, path, progress=progress)


def _v41_save_init(cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None, progress=None,
                   before_write=None):
    _v41_table_dtype(table_dtype)
    plan = HashPlan(cfg, compression=compression)
    return v41_hf.save(cfg, plan, v41_weights.init_layers(cfg, plan, seed, graft_zero_init), path,
                       progress=progress, before_write=before_write)


VARIANTS = {
    DEMO: Variant(
        name=DEMO, weights=demo_weights.LayerWeights, validate_layer=demo_weights.validate_layer,
        init_layers=lambda cfg, plan, seed, zero: demo_weights.init_layers(cfg, plan, seed, zero),
        from_state_dict=demo_weights.layer_from_state_dict,
        forward=lambda cfg, w, rows, dead, hidden: demo_reference.forward(cfg, rows, w, hidden),
        engine=StreamEngine, load=demo_checkpoint.load,
        save=demo_checkpoint.save,
        save_init=_demo_save_init, is_checkpoint=lambda path: not os.path.isdir(path),
        folder_of=lambda path: None,
        describe=lambda cfg: f"conv {cfg.kernel_size} taps x dilation {cfg.max_ngram_size}",
        step_weights=lambda w: w.proj_w,
        weight_dtypes=demo_weights.WEIGHT_DTYPES),
    V41: Variant(
        name=V41, weights=v41_weights.V41LayerWeights, validate_layer=v41_weights.validate_layer,
        init_layers=v41_weights.init_layers, from_state_dict=v41_weights.layer_from_state_dict,
        forward=lambda cfg, w, rows, dead, hidden: v41_reference.forward(cfg, rows, dead, w, hidden),
        engine=V41StreamEngine,
        load=lambda path, mmap=True: v41_hf.load(path, mmap=mmap),
        save=_v41_save, save_init=_v41_save_init, is_checkpoint=os.path.isdir, folder_of=v41_hf.folder_of,
        describe=lambda cfg: f"gate eps {cfg.norm_eps}, DEAD token {cfg.image_token_id}, float8 wkv",
        step_weights=lambda w: w.wkv_weight,
        weight_dtypes=("float8_e4m3fn",)),
}


def variant_of(cfg) -> Variant:
    """The registry entry of cfg.variant."""
    return VARIANTS[cfg.variant]
