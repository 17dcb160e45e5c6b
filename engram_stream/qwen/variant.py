"""The qwen3.8-flash-next variant (DESIGN.md 4b): the demo module's computation with Qwen's
weights, eps, hash (raw ids, SplitMix64 multipliers, padded tables) and history (an EOS ends a
document). QwenStreamEngine (_engine.pyx) serves it: the demo's StreamEngine with Qwen's window
rule (the weights carry the eps)."""
import numpy as np

from .. import variants
from ..demo.weights import with_weight_dtype
from ..io.hf_folder import HFFolderVariant
from . import config, gguf, hf, reference, weights
from ._engine import QwenStreamEngine
from .weights import PLEWeights


class QwenVariant(HFFolderVariant, variants.Variant):
    gguf_layout = gguf.LAYOUT   # its tables in a llama.cpp GGUF (GGUFTier, `engram-stream inspect`)
    hf = hf   # load, save, save_init, is_checkpoint, folder_of: the shared Hugging Face folder hooks
    # the rules' modules first: `weights` below is the layer class, in this class's namespace
    weights_rules = weights
    config_rules = config
    name = config.QWEN
    title = "Qwen3.8-Flash-Next's PLE (Per-Layer Embedding: its n-gram memory)"
    example_config = config.EXAMPLE
    config_class = config.QwenConfig
    field_help = config.FIELD_HELP
    layer_class = PLEWeights
    weight_dtypes = ("float32", "bfloat16")
    table_dtypes = ("float32", "bfloat16")
    load_note = "raw token ids: no compression, no tokenizer read"
    engine = QwenStreamEngine

    def with_weight_dtype(self, cfg, layers, name):
        return with_weight_dtype(cfg, layers, name)

    # computing
    def forward(self, cfg, w, rows, dead, hidden, ids):
        return reference.forward(cfg, rows, w, hidden)

    def describe(self, cfg):
        return config.describe(cfg)

    def step_weights(self, w):
        return w.proj_w

    # hashing: SplitMix64 multipliers, padded tables, the EOS (pad id) separator
    def draw_multipliers(self, cfg, compressed_vocab):
        return config.draw_multipliers(cfg, compressed_vocab)

    def table_rows(self, cfg, rows):
        return config.table_rows(cfg, rows)

    def windows(self, cfg, pad_id, raw, x):
        """transformers' _shift_right_ignore_eos: shift s of position p reads id[p-s] unless a pad
        id is among ids[p-s .. p-1] or p-s < 0; then it reads pad."""
        T = x.shape[1]
        sep = x == pad_id
        cut = np.zeros(x.shape, bool)
        shifted = [x]
        for s in range(1, cfg.max_ngram_size):
            cut = cut | np.pad(sep, ((0, 0), (s, 0)), constant_values=True)[:, :T]  # id[p-s] is pad, or p-s < 0
            shifted.append(np.where(cut, pad_id, np.pad(x, ((0, 0), (s, 0)))[:, :T]))
        return shifted


VARIANT = variants.register(QwenVariant())
