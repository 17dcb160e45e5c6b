"""The vLLM plugin's Qwen4Exp side: vLLM 0.33.0's PLE n-gram embedding with its rows from engram_stream.

When the plugin's settings are given (engram_stream.integrations.vllm) and vLLM builds a Qwen4Exp
model, each PLE layer's n-gram table (Qwen4ExpNGramEmbedding.ngram_embedding, vLLM's
Qwen4ExpPLEDeviceEmbedding or Qwen4ExpPLEPinnedHostEmbedding) is a StreamPLEEmbedding:

  - vLLM's own constructor chain runs (Qwen4ExpPLEDeviceEmbedding -> PLEVocabParallelEmbedding ->
    VocabParallelEmbedding, the embedding method's create_weights); only the table's storage,
    which vLLM asks of allocate_embedding_weight (the rows, and NVFP4's block scales), is made on
    the meta device and dropped from the parameters: no table, nothing for vLLM's loader to fill.
    The global scales (FP8 weight_scale, NVFP4 weight_scale_2: one float each) stay vLLM's
    parameters, loaded by vLLM, so dequantize() is vLLM's own.
  - vLLM's loader skips the `...ple_embedding.ngram_embedding.shard_{i}.weight|weight_scale`
    tensors (should_skip_weight, TABLE_TENSOR of vllm.py).
  - the lookup is the embedding method's embedding(layer, ids) (vLLM's seam for the row gather,
    under VocabParallelEmbedding.forward's ETP masking and reduction): the method is vLLM's, of a
    subclass made here whose embedding() reads the rows from engram_stream's row source of the
    layer (source.read_into) and gives what vLLM's gives: bf16 rows for bf16 tables (float32 /
    float16 tables cast to the model dtype, as vLLM's loader casts them), FP8 codes for FP8
    (dequantize() then multiplies by the scale, vLLM's code), decoded bf16 rows for NVFP4
    (the variant's nvfp4_lut: vLLM's kernel's values).

The row ids are vLLM's (compute_ngram_ids); engram_stream's hash gives the same ids
(tests/integrations/test_vllm_qwen.py compares them). The lookup is synchronous host work
(supports_prefetch is False whatever engram_config.cpu_offload says): eager only, so on CUDA
the plugin refuses a model without enforce_eager; nothing of it has run on a GPU yet.
"""
from __future__ import annotations

import numpy as np

NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
COMMON_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"
VLLM_VERSION = "0.33.0"   # the version whose classes and seams this module patches

_stream_class = None
_methods = {}


def _check_version():
    import vllm
    v = getattr(vllm, "__version__", "")
    if not v.startswith(VLLM_VERSION):
        raise RuntimeError(f"engram_stream's vLLM plugin serves Qwen4Exp PLE tables on vLLM {VLLM_VERSION} "
                           f"(its Qwen4ExpPLEEmbedding seams), this is vLLM {v}")


def stream_method(method):
    """vLLM's embedding method object, re-classed to a subclass whose embedding() reads the layer's
    rows from engram_stream (everything else, dequantize() included, is vLLM's)."""
    base = type(method)
    cls = _methods.get(base)
    if cls is None:
        def embedding(self, layer, input_):
            return layer.stream_rows(input_)
        cls = _methods[base] = type(f"Stream{base.__name__}", (base,), {"embedding": embedding})
    method.__class__ = cls
    return method


def stream_class():
    """StreamPLEEmbedding (made once: it subclasses vLLM's Qwen4ExpPLEDeviceEmbedding)."""
    global _stream_class
    if _stream_class is not None:
        return _stream_class
    import sys
    import torch
    C = sys.modules.get(COMMON_MODULE) or __import__(COMMON_MODULE, fromlist=["_"])
    from .vllm import ENV

    class StreamPLEEmbedding(C.Qwen4ExpPLEDeviceEmbedding):
        """vLLM's PLE n-gram embedding of one layer with its rows from engram_stream (no table)."""

        supports_prefetch = False

        def __init__(self, model, layer, num_embeddings, embedding_dim, **kw):
            method = kw["embedding_method"]
            object.__setattr__(self, "_meta_names", [])
            super().__init__(num_embeddings, embedding_dim, **kw)
            for name in self._meta_names:          # the table's storage: not a parameter of vLLM's
                meta = self._parameters.pop(name)
                object.__setattr__(self, name, meta.data)
            w = model.layer(layer)
            fmt = w.table_format
            want = ("nvfp4" if isinstance(method, C.Qwen4ExpPLENvFp4EmbeddingMethod) else
                    "fp8" if isinstance(method, C.Qwen4ExpPLEFp8EmbeddingMethod) else None)
            if (want or "values") != (fmt if fmt in ("fp8", "nvfp4") else "values"):
                raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer}'s table is {fmt}, vLLM's "
                                 f"PLE embedding method is {type(method).__name__}: give the checkpoint vLLM serves")
            rows = model.plan.table_rows[layer]
            if rows != self.org_vocab_size or embedding_dim != model.cfg.head_dim:
                raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer}'s table is [{rows}, "
                                 f"{model.cfg.head_dim}], vLLM's [{self.org_vocab_size}, {embedding_dim}]: give "
                                 f"the checkpoint vLLM serves")
            if fmt == "nvfp4" and self.params_dtype != torch.bfloat16:
                raise ValueError(f"{ENV}: NVFP4 PLE tables are served for bfloat16 models, got {self.params_dtype}")
            self.model, self.layer, self.table_format = model, layer, fmt
            self.source = model.row_source(layer)
            self.recbytes = self.source.rowbytes + self.source.scalebytes
            self._values = None if fmt in ("fp8", "nvfp4") else np.dtype(w.table.dtype)
            self._lut = None if fmt != "nvfp4" else torch.from_numpy(np.asarray(w.table_lut, np.float32))
            stream_method(self.embedding_method)

        def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
            """The table's storage (vLLM's create_weights asks here): a meta tensor, no memory."""
            # the parameter's name is the one create_weights registers next: weight, then NVFP4's weight_scale
            self._meta_names.append(("weight", "weight_scale")[len(self._meta_names)])
            return torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")

        def extra_repr(self):
            return (f"layer={self.layer}, rows {self.shard_indices.org_vocab_start_index}.."
                    f"{self.shard_indices.org_vocab_end_index} of {self.org_vocab_size}, {self.table_format}, "
                    f"rows from engram_stream ({type(self.source).__name__})")

        def row_cache_stats(self):
            return self.model.row_cache_stats()

        def stream_rows(self, ids):
            """What vLLM's embedding method gives for local ids (VocabParallelEmbedding.forward's
            masked input): [*ids.shape, embedding_dim] of the lookup dtype, on ids' device."""
            start = self.shard_indices.org_vocab_start_index
            flat = ids.reshape(-1)
            host = (flat.cpu() if flat.device.type != "cpu" else flat).numpy().astype(np.int64) + start
            rec = np.empty((host.shape[0], self.recbytes), np.uint8)
            self.source.read_into(host, rec)
            t = torch.from_numpy(rec)
            hd = self.embedding_dim
            if self.table_format == "fp8":
                out = t.view(torch.float8_e4m3fn)
            elif self.table_format == "nvfp4":
                packed, scales = t[:, :hd // 2].long(), t[:, hd // 2:].long()
                codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(-1, hd)
                out = self._lut[scales.repeat_interleave(16, dim=1) * 16 + codes].to(torch.bfloat16)
            else:
                values = torch.from_numpy(rec.view(self._values)) if self._values.name != "bfloat16" \
                    else t.view(torch.bfloat16)
                out = values.to(self.params_dtype)
            return out.reshape(*ids.shape, hd).to(ids.device)

    _stream_class = StreamPLEEmbedding
    return _stream_class


def patch_ngram(N):
    """Qwen4ExpNGramEmbedding.__init__ builds a StreamPLEEmbedding as its ngram_embedding when
    the plugin is configured (vLLM's constructor runs whole; the backend it picks is ours)."""
    original = N.Qwen4ExpNGramEmbedding.__init__
    if getattr(original, "_engram_stream", False):
        return
    from . import vllm as plugin

    def __init__(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, **kw):
        vllm_config = N.get_current_vllm_config()
        s = plugin.settings(vllm_config)
        if s is None:
            return original(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, **kw)
        _check_version()
        if plugin._cuda() and not getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
            raise ValueError(f"{plugin.ENV}: Qwen4Exp PLE rows are read by a synchronous host lookup, which a CUDA "
                             f"graph would capture once and replay stale: serve with --enforce-eager")
        model = plugin.open_model(s, getattr(getattr(vllm_config, "model_config", None), "model", None), qwen=True)
        ids = model.cfg.layer_ids                  # sorted ple_layer_ids: vLLM's dense id indexes them
        if not 0 <= ple_dense_layer_id < len(ids):
            raise ValueError(f"{plugin.ENV}: vLLM's PLE layer {ple_dense_layer_id} is not one of the checkpoint "
                             f"{model.source!r}'s {len(ids)} PLE layers")
        layer = ids[ple_dense_layer_id]
        cls = stream_class()

        def make(*a, **k):
            return cls(model, layer, *a, **k)

        saved = (N.Qwen4ExpPLEDeviceEmbedding, N.Qwen4ExpPLEPinnedHostEmbedding)
        N.Qwen4ExpPLEDeviceEmbedding = N.Qwen4ExpPLEPinnedHostEmbedding = make
        try:
            original(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, **kw)
        finally:
            N.Qwen4ExpPLEDeviceEmbedding, N.Qwen4ExpPLEPinnedHostEmbedding = saved
        plugin.serving(True)

    __init__._engram_stream = True
    N.Qwen4ExpNGramEmbedding.__init__ = __init__
