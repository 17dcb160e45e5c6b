"""The deepseek-v4.1 variant's registry entry: Hugging Face folders of float8 shards, the wkv
projection and the q/k gate, DEAD tokens (config.py holds its config rules)."""
import os

from .. import variants
from ..plan import HashPlan
from . import config, hf, reference, weights
from ._engine import V41StreamEngine


def _no_table_dtype(table_dtype):
    if table_dtype is not None:
        raise ValueError(f"table_dtype={table_dtype!r}: a {config.V41} checkpoint keeps its float8 tables")


def _save(cfg, plan, layers, path, table_dtype=None, progress=None):
    _no_table_dtype(table_dtype)
    return hf.save(cfg, plan, layers, path, progress=progress)


def _save_init(cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None, progress=None,
               before_write=None):
    _no_table_dtype(table_dtype)
    plan = HashPlan(cfg, compression=compression)
    return hf.save(cfg, plan, weights.init_layers(cfg, plan, seed, graft_zero_init), path,
                   progress=progress, before_write=before_write)


def _is_checkpoint(path):
    """A folder, unless its config.json describes another variant's models (a Qwen folder): a
    folder without one is still V4.1's to refuse with its own message."""
    if not os.path.isdir(path):
        return False
    d = hf_config_of(path)
    if d is None or config.reads_hf_config(d):
        return True
    return not any(v.reads_hf_config and v.reads_hf_config(d) for v in variants.variants() if v.name != config.V41)


def _folder_of(path):
    """The V4.1 folder a file belongs to (hf.folder_of), not another variant's folder."""
    folder = hf.folder_of(path)
    return folder if folder is not None and _is_checkpoint(folder) else None


def hf_config_of(folder):
    """The parsed config.json of a folder, or None (absent, not JSON, not an object)."""
    import json
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            d = json.loads(f.read(1 << 20))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def _with_weight_dtype(cfg, layers, name):
    return layers   # weight_dtypes has only the float8 it holds


VARIANT = variants.register(variants.Variant(
    name=config.V41, config_fields=config.FIELDS, validate_config=config.validate,
    example_config=config.EXAMPLE, field_help=config.FIELD_HELP,
    reads_hf_config=config.reads_hf_config, from_hf_config=config.from_hf_config, to_hf_config=config.to_hf_config,
    weights=weights.V41LayerWeights, validate_layer=weights.validate_layer,
    init_layers=weights.init_layers, from_state_dict=weights.layer_from_state_dict,
    weight_dtypes=("float8_e4m3fn",), with_weight_dtype=_with_weight_dtype,
    load=lambda path, mmap=True, compression=None: hf.load(path, mmap=mmap, compression=compression),
    save=_save, save_init=_save_init, table_dtypes=(),
    is_checkpoint=_is_checkpoint, folder_checkpoint=True, folder_of=_folder_of,
    forward=lambda cfg, w, rows, dead, hidden: reference.forward(cfg, rows, dead, w, hidden),
    engine=V41StreamEngine, history="dead", init_table_dtype="float8_e4m3fn",
    load_note="the compression: built from tokenizer.json the first time, then read from the user's cache",
    describe=lambda cfg: f"gate eps {cfg.norm_eps}, DEAD token {cfg.image_token_id}, float8 wkv",
    step_weights=lambda w: w.wkv_weight))
