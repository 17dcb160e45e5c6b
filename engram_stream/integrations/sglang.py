"""engram_stream as the Engram row store of SGLang 0.5.23 (DeepSeek-V4.1): install() before the
model is built.

    import engram_stream.integrations.sglang as es_sglang
    es_sglang.install({"checkpoint": "/models/DeepSeek-V4.1-Flash", "tables": "direct", "row_cache_mb": 4096})
    # ... then SGLang's server / Engine in this process (or ENGRAM_STREAM_SGLANG='{...}' and install())

SGLang has no general-plugin entry point (its wheel's entry points are console scripts only),
so install() patches one name: sglang.srt.layers.engram.EngramEmbedding, which Engram.__init__
constructs, becomes StreamEngramEmbedding, a subclass built through SGLang's own constructor
(its row range of the TP rank) whose table is a meta tensor, dropped: it holds no table. SGLang
other than 0.5.23 is refused (RuntimeError naming the version), and so are SGLang's other table
layouts (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE, SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS: ValueError).
The settings are the vLLM plugin's (integrations.serving.parse_settings: checkpoint, tables,
row_cache_mb, mooncake, host_cache), from the argument or the environment variable ENGRAM_STREAM_SGLANG;
"checkpoint" is required (SGLang's model path does not reach the embedding). In a server
whose model runs in worker processes, call install() in each (the variable is inherited: a
`sitecustomize` calling install() is one way).

SGLang's lookups all end in EngramEmbedding._owned_rows(indices): the rows of this rank's row
range (shard_range), zeros for the rest, summed over the TP group by SGLang's all-reduce. The
subclass answers it from engram_stream's row source of the layer (row cache, mapped or direct
tables, the packed row file, Mooncake), with SGLang's Triton gather's bf16 bits (e8m0 byte 0
scales by 2^-127, 255 by +inf; integrations._records.records_to_bf16). Ids outside the range, and -1,
give zeros.

What this does not reach without patching SGLang:
  * the table tensors are still read by SGLang's weight iterator: DeepseekV4ForCausalLM.
    load_weights skips a name that has no parameter ("not found in params_dict", a warning per
    tensor) only after the iterator has read it; skipping them unread needs a filter in
    sglang/srt/model_loader (its safetensors iterator), not in the Engram seam.
  * EngramRowStager (SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING) gathers from EngramEmbedding.weight on
    the scheduler's threads; the subclass has no shared host table, so SGLang does not build
    one, and the lookups run in the forward instead.
  * the peer-shard path (SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS, CUDA VMM) is refused: its table is
    device memory by design.
"""
from __future__ import annotations

import os

import numpy as np

from . import serving

ENV = "ENGRAM_STREAM_SGLANG"
SGLANG_VERSION = "0.5.23"   # the version whose EngramEmbedding is built through its constructor and hooked
ENGRAM_MODULE = "sglang.srt.layers.engram"
# SGLang's table layouts other than its plain one (a parameter per rank): each allocates a table
# (host memory, or peer-mapped device memory) that the rows served here would leave unused
TABLE_LAYOUTS = ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS")
ZERO_SCALE = 2.0 ** -127   # SGLang's kernel: "e8m0 has no zero: the exponent byte 0 encodes 2**-127"

_settings = None
_embedding_class = None
_stock_class = None


def settings():
    """The settings install() was given, or None before it."""
    return _settings


def install(value=None):
    """Serve SGLang's Engram rows from engram_stream in this process: `value` (a dict or a JSON
    object string; default: ENGRAM_STREAM_SGLANG) as the vLLM plugin's settings, with
    "checkpoint" given. Call it before the model is built; calling it again replaces the
    settings. Returns the StreamEngramEmbedding class."""
    global _settings
    where = "install()"
    if value is None:
        value, where = os.environ.get(ENV), ENV
        if not value:
            raise ValueError(f"install(): give the settings or set {ENV} to a JSON object such as "
                             f'{{"checkpoint": "/models/DeepSeek-V4.1-Flash", "tables": "direct"}}')
    s = serving.parse_settings(value, where)
    if s["checkpoint"] is None:
        raise ValueError(f'{where}: give "checkpoint" (the V4.1 folder SGLang serves): SGLang\'s model path '
                         f"does not reach its Engram embedding")
    _settings = s
    cls = embedding_class()
    import sys
    sys.modules[ENGRAM_MODULE].EngramEmbedding = cls
    return cls


def uninstall():
    """SGLang's own EngramEmbedding again (tests)."""
    global _settings
    if _stock_class is not None:
        import sys
        sys.modules[ENGRAM_MODULE].EngramEmbedding = _stock_class
    _settings = None


def embedding_class():
    """StreamEngramEmbedding (made once: it subclasses SGLang's EngramEmbedding)."""
    global _embedding_class, _stock_class
    if _embedding_class is not None:
        return _embedding_class
    import importlib

    import sglang
    import torch
    serving.check_version("SGLang", sglang, SGLANG_VERSION)
    E = importlib.import_module(ENGRAM_MODULE)
    _stock_class = E.EngramEmbedding
    from ._records import records_to_bf16

    class StreamEngramEmbedding(_stock_class):
        """SGLang's Engram embedding of one layer with its rows from engram_stream (no table)."""

        def __init__(self, num_embeddings, dim, layer_id, column_bounds):
            if _settings is None:
                raise RuntimeError(f"{ENGRAM_MODULE}.EngramEmbedding is engram_stream's: call install() first")
            model = serving.open_model(_settings, None, ENV)
            sizes = [int(p) for p in model.plan.head_primes[layer_id]] if layer_id in model.cfg.layer_ids else None
            if sizes is None or tuple(np.concatenate([[0], np.cumsum(sizes)])) != tuple(column_bounds) \
                    or model.plan.table_rows[layer_id] != num_embeddings:
                raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer_id} has heads of {sizes} "
                                 f"rows, SGLang's config bounds {list(column_bounds)}: give the checkpoint "
                                 f"SGLang serves")
            if dim != model.cfg.head_dim:
                raise ValueError(f"{ENV}: head_dim {dim}, the checkpoint's {model.cfg.head_dim}")
            on = [name for name in TABLE_LAYOUTS if getattr(E.envs, name).get()]
            if on:
                raise ValueError(f"{ENV}: {on[0]} is set: SGLang would allocate a table engram_stream's rows leave "
                                 f"unused; unset it (the rows come from engram_stream's row source)")
            # SGLang's constructor, whole (its row range of this TP rank: shard_range); its table is a
            # meta tensor here (no memory), dropped below: SGLang's loader finds no parameter to fill
            with torch.device("meta"):
                super().__init__(num_embeddings, dim, layer_id, column_bounds)
            del self.weight, self.scale
            self.model, self.layer = model, layer_id
            self.source = model.row_source(layer_id)
            self.recbytes = self.source.rowbytes + self.source.scalebytes
            self._records = np.empty(0, np.uint8)   # scratch (grown, kept)

        def extra_repr(self):
            return (f"layer={self.layer}, rows={self.row_start}..{self.row_start + self.rows}, rows from "
                    f"engram_stream ({type(self.source).__name__})")

        def row_cache_stats(self):
            return self.model.row_cache_stats()

        def _owned_rows(self, indices):
            """bf16 [*indices.shape, dim]: the rows of this rank's range, zeros elsewhere."""
            a = (indices.cpu() if indices.device.type != "cpu" else indices).numpy().reshape(-1)
            rows = np.where((a >= self.row_start) & (a < self.row_start + self.rows), a, -1).astype(np.int64)
            need = rows.size * self.recbytes
            if self._records.size < need:
                self._records = np.empty(need, np.uint8)
            rec = self._records[:need].reshape(rows.size, 1, self.recbytes)
            self.source.read_into(rows[:, None], rec)
            out = torch.empty(rows.size, 1, self.dim, dtype=torch.bfloat16)
            records_to_bf16(rec, out.view(torch.int16).numpy().view(np.uint16), ZERO_SCALE)
            out = out.view(*indices.shape, self.dim)
            return out if indices.device.type == "cpu" else out.to(indices.device, non_blocking=True)

    _embedding_class = StreamEngramEmbedding
    return _embedding_class
