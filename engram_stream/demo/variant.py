"""The demo variant's registry entry (the public engram_demo_v1 module): one checkpoint file,
float32/float16/int8 tables, float32 or bf16 projection weights, the ShortConv tail."""
import os

from .. import variants
from . import checkpoint, reference, weights
from ._engine import StreamEngine

DEMO = variants.DEFAULT   # "demo-v1": EngramConfig's default variant


def _save_init(cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None, progress=None,
               before_write=None):
    return checkpoint.save_init(cfg, path, seed, graft_zero_init, compression, table_dtype, progress, before_write)


def _load(path, mmap=True, compression=None):
    if compression is not None:
        raise ValueError("a demo-v1 checkpoint holds its compression: load it without one")
    return checkpoint.load(path, mmap)


VARIANT = variants.register(variants.Variant(
    name=DEMO, config_fields=(), validate_config=lambda cfg, put: None,
    example_config={"engram_vocab_size": [20011, 20011], "hidden_size": 256, "n_embed_per_ngram": 128,
                    "n_head_per_ngram": 4, "vocab_size": 32000},
    weights=weights.LayerWeights, validate_layer=weights.validate_layer,
    init_layers=lambda cfg, plan, seed, zero: weights.init_layers(cfg, plan, seed, zero),
    from_state_dict=weights.layer_from_state_dict,
    weight_dtypes=weights.WEIGHT_DTYPES, with_weight_dtype=weights.with_weight_dtype,
    load=_load, save=checkpoint.save, save_init=_save_init, table_dtypes=("float32", "float16", "int8"),
    is_checkpoint=lambda path: not os.path.isdir(path), folder_checkpoint=False, folder_of=lambda path: None,
    forward=lambda cfg, w, rows, dead, hidden: reference.forward(cfg, rows, w, hidden),
    engine=StreamEngine,
    describe=lambda cfg: f"conv {cfg.kernel_size} taps x dilation {cfg.max_ngram_size}",
    step_weights=lambda w: w.proj_w))
