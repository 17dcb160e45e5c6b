"""The qwen3.8-flash-next variant's registry entry (DESIGN.md 4b): the demo module's computation
with Qwen's weights, eps, hash (raw ids, SplitMix64 multipliers, padded tables) and history (an
EOS ends a document). QwenStreamEngine (_engine.pyx) serves it: the demo's StreamEngine with
Qwen's window rule (the weights carry the eps)."""
from .. import variants
from ..demo.weights import with_weight_dtype
from ..plan import HashPlan
from . import config, hf, reference, weights
from ._engine import QwenStreamEngine


def _load(path, mmap=True, compression=None):
    if compression is not None:
        raise ValueError(f"{config.QWEN} hashes raw token ids: load it without a compression")
    return hf.load(path, mmap=mmap)


def _save(cfg, plan, layers, path, table_dtype=None, progress=None):
    return hf.save(cfg, plan, layers, path, table_dtype=table_dtype, progress=progress)


def _save_init(cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None, progress=None,
               before_write=None):
    if compression is not None:
        raise ValueError(f"{config.QWEN} hashes raw token ids: it takes no compression")
    plan = HashPlan(cfg)
    return hf.save(cfg, plan, weights.init_layers(cfg, plan, seed, graft_zero_init, hold_tables=False), path,
                   table_dtype=table_dtype, progress=progress, before_write=before_write)


VARIANT = variants.register(variants.Variant(
    name=config.QWEN, config_fields=config.FIELDS, validate_config=config.validate,
    example_config=config.EXAMPLE, field_help=config.FIELD_HELP,
    reads_hf_config=config.reads_hf_config, from_hf_config=config.from_hf_config, to_hf_config=config.to_hf_config,
    weights=weights.PLEWeights, validate_layer=weights.validate_layer,
    init_layers=lambda cfg, plan, seed, zero: weights.init_layers(cfg, plan, seed, zero),
    from_state_dict=weights.layer_from_state_dict,
    weight_dtypes=("float32", "bfloat16"), with_weight_dtype=with_weight_dtype,
    load=_load, save=_save, save_init=_save_init, table_dtypes=("float32", "bfloat16"),
    is_checkpoint=hf.is_checkpoint, folder_checkpoint=True, folder_of=hf.folder_of,
    forward=lambda cfg, w, rows, dead, hidden: reference.forward(cfg, rows, w, hidden),
    engine=QwenStreamEngine, describe=config.describe, step_weights=lambda w: w.proj_w,
    history="separator", draw_multipliers=config.draw_multipliers, table_rows=config.table_rows,
    load_note="raw token ids: no compression, no tokenizer read"))
