"""The demo variant (the public engram_demo_v1 module): one checkpoint file, float32/float16/int8
tables, float32 or bf16 projection weights, the ShortConv tail; the hash hooks are Variant's
defaults (plain history, the reference's multiplier draw, tables of exactly the primes' rows)."""
import os

from .. import variants
from . import checkpoint, reference, weights
from ._engine import StreamEngine
from .weights import WEIGHT_DTYPES, LayerWeights

DEMO = variants.DEFAULT   # "demo-v1": EngramConfig's default variant


class DemoVariant(variants.Variant):
    # the rules' modules first: `weights` below is the layer class, in this class's namespace
    weights_rules = weights
    name = DEMO
    title = "the public demo module (engram_demo_v1)"
    checkpoint_form = "one safetensors file (its own layout: config, hash plan, every layer)"
    example_config = {"engram_vocab_size": [20011, 20011], "hidden_size": 256, "n_embed_per_ngram": 128,
                      "n_head_per_ngram": 4, "vocab_size": 32000}
    layer_class = LayerWeights
    weight_dtypes = WEIGHT_DTYPES
    table_dtypes = ("float32", "float16", "int8")
    engine = StreamEngine

    def with_weight_dtype(self, cfg, layers, name):
        return weights.with_weight_dtype(cfg, layers, name)

    def load(self, path, mmap=True, compression=None):
        if compression is not None:
            raise ValueError(f"a {self.name} checkpoint holds its compression: load it without one")
        return checkpoint.load(path, mmap)

    def save(self, cfg, plan, layers, path, table_dtype=None, progress=None):
        return checkpoint.save(cfg, plan, layers, path, table_dtype=table_dtype, progress=progress)

    def save_init(self, cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
                  progress=None, before_write=None):
        return checkpoint.save_init(cfg, path, seed, graft_zero_init, compression, table_dtype, progress,
                                    before_write)

    def is_checkpoint(self, path):
        return not os.path.isdir(path)

    def forward(self, cfg, w, rows, dead, hidden, ids):
        return reference.forward(cfg, rows, w, hidden)

    def describe(self, cfg):
        return f"conv {cfg.kernel_size} taps x dilation {cfg.max_ngram_size}"

    def step_weights(self, w):
        return w.proj_w


VARIANT = variants.register(DemoVariant())
