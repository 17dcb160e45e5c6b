"""The deepseek-v4.1 variant: Hugging Face folders of float8 shards, the wkv projection and the
q/k gate, DEAD tokens and their rule in the hash windows (config.py holds its config rules)."""
import json
import os

import numpy as np

from .. import variants
from ..plan import HashPlan
from ..rows.gguf import E4M3_ROW_RECORD
from ..rows.records import E4M3_E8M0_RECORD
from . import config, gguf, hf, reference, weights
from ._engine import V41StreamEngine
from .weights import V41LayerWeights


def hf_config_of(folder):
    """The parsed config.json of a folder, or None (absent, not JSON, not an object)."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            d = json.loads(f.read(1 << 20))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


class V41Variant(variants.Variant):
    gguf_layout = gguf.LAYOUT   # its tables in a llama.cpp GGUF (GGUFTier, `engram-stream inspect`)
    # vLLM's and SGLang's V4.1 embeddings widen the checkpoint's 264-byte records themselves
    framework_records = (E4M3_E8M0_RECORD, E4M3_ROW_RECORD)
    # the rules' modules first: `weights` below is the layer class, in this class's namespace
    weights_rules = weights
    config_rules = config
    name = config.V41
    title = "DeepSeek-V4.1's Engram"
    checkpoint_form = ("a Hugging Face folder: config.json, model.safetensors.index.json, the shards, tokenizer.json "
                       "(or engram_compression.npy)")
    example_config = config.EXAMPLE
    config_class = config.V41Config
    declared_fields = ("num_embeddings", "compressed_vocab_size")
    hf_config = True
    layer_class = V41LayerWeights
    weight_dtypes = ("float8_e4m3fn",)   # with_weight_dtype keeps the float8 it holds
    folder_checkpoint = True
    init_table_dtype = "float8_e4m3fn"
    load_note = "the compression: built from tokenizer.json the first time, then read from the user's cache"
    engine = V41StreamEngine

    def load(self, path, mmap=True, compression=None):
        return hf.load(path, mmap=mmap, compression=compression)

    def _no_table_dtype(self, table_dtype):
        if table_dtype is not None:
            raise ValueError(f"table_dtype={table_dtype!r}: a {self.name} checkpoint keeps its float8 tables")

    def save(self, cfg, plan, layers, path, table_dtype=None, progress=None):
        self._no_table_dtype(table_dtype)
        return hf.save(cfg, plan, layers, path, progress=progress)

    def save_init(self, cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
                  progress=None, before_write=None):
        self._no_table_dtype(table_dtype)
        plan = HashPlan(cfg, compression=compression)
        return hf.save(cfg, plan, weights.init_layers(cfg, plan, seed, graft_zero_init), path,
                       progress=progress, before_write=before_write)

    def is_checkpoint(self, path):
        """A folder with a config.json, unless that describes another variant's models (a Qwen
        folder): one that is not JSON is V4.1's to refuse with its own message. A folder without
        config.json is no variant's (EngramModel.load's error lists what each variant reads)."""
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            return False
        d = hf_config_of(path)
        if d is None or config.reads_hf_config(d):
            return True
        return not any(v.reads_hf_config(d) for v in variants.variants() if v is not self)

    def folder_of(self, path):
        """The V4.1 folder a file belongs to (hf.folder_of), not another variant's folder."""
        folder = hf.folder_of(path)
        return folder if folder is not None and self.is_checkpoint(folder) else None

    # computing
    def forward(self, cfg, w, rows, dead, hidden, ids):
        return reference.forward(cfg, rows, dead, w, hidden)

    def describe(self, cfg):
        return f"gate eps {cfg.norm_eps}, DEAD token {cfg.image_token_id}, float8 wkv"

    def step_weights(self, w):
        return w.wkv_weight

    def sample_ids(self, cfg, rng, size):
        """Uniform ids with a few DEAD (image) tokens: they cut the n-gram history and close the gate."""
        ids = rng.integers(0, cfg.vocab_size, size=size)
        ids[rng.random(size) < 0.05] = cfg.image_token_id
        return ids

    # hashing: DEAD tokens (compressed to -1) and their rule
    def dead_id(self, cfg):
        return cfg.image_token_id

    def dead_mask(self, cfg, ids):
        return np.asarray(ids) == cfg.image_token_id

    def windows(self, cfg, pad_id, raw, x):
        """The V4.1 reference's expression: for shift s, blocked |= (pos < s) | DEAD(t-s), where
        DEAD is the image token or a negative (unknown) id; a blocked shift reads pad."""
        B, T = x.shape
        dead = (raw < 0) | (raw == cfg.image_token_id)
        pos = np.arange(T)[None, :]
        blocked = np.zeros((B, T), bool)
        shifted = []
        for s in range(cfg.max_ngram_size):
            src = np.pad(x, ((0, 0), (s, 0)))[:, :T]
            src_dead = np.pad(dead, ((0, 0), (s, 0)))[:, :T]
            blocked = blocked | (pos < s) | src_dead
            shifted.append(np.where(blocked, pad_id, src))
        return shifted

    def check_plan(self, plan):
        """Refuse to serve when the declared table rows or compressed vocab differ from what the
        plan derives: every row would be silently rehashed."""
        cfg = plan.cfg
        if cfg.num_embeddings is not None:
            for L, want in zip(cfg.layer_ids, cfg.num_embeddings):
                if plan.table_rows[L] != want:
                    raise ValueError(f"layer {L}: the primes sum to {plan.table_rows[L]} table rows but the "
                                     f"config declares engram_num_embeddings {want}")
        if cfg.compressed_vocab_size is not None and plan.compressed_vocab != cfg.compressed_vocab_size:
            raise ValueError(f"the compression has {plan.compressed_vocab} ids but the config declares "
                             f"engram_compressed_vocab_size {cfg.compressed_vocab_size}")


VARIANT = variants.register(V41Variant())
