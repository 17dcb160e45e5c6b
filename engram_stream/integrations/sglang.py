"""engram_stream as the Engram row store of SGLang 0.5.23 (DeepSeek-V4.1's Engram tables, Qwen4Exp's
PLE n-gram tables): install() before the model is built.

    import engram_stream.integrations.sglang as es_sglang
    es_sglang.install({"checkpoint": "/models/DeepSeek-V4.1-Flash", "tables": "direct", "row_cache_mb": 4096})
    # ... then SGLang's server / Engine in this process (or ENGRAM_STREAM_SGLANG='{...}' and install())

SGLang has no general-plugin entry point (its wheel's entry points are console scripts only),
so install() patches by name: sglang.srt.layers.engram.EngramEmbedding, which Engram.__init__
constructs, becomes StreamEngramEmbedding, a subclass built through SGLang's own constructor
(its row range of the TP rank) whose table is a meta tensor, dropped: it holds no table. SGLang
other than 0.5.23 is refused (RuntimeError naming the version), and so are SGLang's other table
layouts (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE, SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS: ValueError).
The settings are the vLLM plugin's (integrations.serving.parse_settings: checkpoint, tables,
row_cache_mb, mooncake, host_cache), from the argument or the environment variable ENGRAM_STREAM_SGLANG;
"checkpoint" is required (SGLang's model path does not reach the embedding). In a server
whose model runs in worker processes, call install() in each (the variable is inherited: a
`sitecustomize` calling install() is one way). A Qwen4Exp model's PLE n-gram tables (bf16, FP8)
are served from the same settings, "checkpoint" the Qwen folder: see "Qwen4Exp" below (eager
only on CUDA); so is LongCat-Flash-Lite's n-gram table (NgramEmbedding's oe_embeder), "checkpoint"
its Hugging Face folder: see "LongCat-Flash-Lite" below.

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
import re
import sys

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
    sys.modules[ENGRAM_MODULE].EngramEmbedding = cls
    serving.install_patches(_PATCHES)
    return cls


def uninstall():
    """SGLang's own EngramEmbedding again (tests)."""
    global _settings
    if _stock_class is not None:
        sys.modules[ENGRAM_MODULE].EngramEmbedding = _stock_class
    Q = sys.modules.get(QWEN_MODULE)
    if Q is not None and _qwen_stock is not None:
        Q.Qwen4ExpNGramEmbedding, Q.Qwen4ExpForConditionalGeneration.load_weights = _qwen_stock
    for name in (LONGCAT_MODULE, "sglang.srt.models.longcat_flash"):
        M = sys.modules.get(name)
        if M is not None and _longcat_stock is not None and getattr(M, "NgramEmbedding", None) is not None:
            M.NgramEmbedding = _longcat_stock
    serving.remove_patches(_PATCHES)
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

    class StreamEngramEmbedding(serving.StreamRows, _stock_class):
        """SGLang's Engram embedding of one layer with its rows from engram_stream (no table)."""

        def __init__(self, num_embeddings, dim, layer_id, column_bounds):
            if _settings is None:
                raise RuntimeError(f"{ENGRAM_MODULE}.EngramEmbedding is engram_stream's: call install() first")
            model = serving.open_model(_settings, None, ENV, variant="deepseek-v4.1")
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
            self.stream_from(model, layer_id)
            self._records = np.empty(0, np.uint8)   # scratch (grown, kept)

        def extra_repr(self):
            return self.rows_repr(f"rows={self.row_start}..{self.row_start + self.rows}")

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


# ---- Qwen4Exp: the PLE n-gram tables -------------------------------------------------------------
# install() also patches sglang.srt.models.qwen4_exp (when it is imported): its Qwen4ExpNGramEmbedding
# becomes StreamNGramEmbedding, SGLang's constructor run whole with the table module it builds
# (VocabParallelEmbedding, looked up in qwen4_exp's namespace) made a StreamPLEEmbedding: SGLang's
# VocabParallelEmbedding constructor (its vocabulary shard of the TP rank, its quant method) on
# the meta device, the table dropped. SGLang's lookup is VocabParallelEmbedding.forward (the
# shard's masking, the output dtype, the all-reduce), whose row gather is the quant method's
# embedding(layer, ids): the method is SGLang's, re-classed so that embedding() reads the rows
# from engram_stream's row source and gives what SGLang's table gives: bf16 rows (float32 tables
# cast as SGLang's loader casts them), FP8 codes for FP8 tables (SGLang's own code then casts them
# to bf16 and multiplies by its weight_scale buffer, which it loads). SGLang 0.5.23 has no NVFP4
# PLE table (its loader copies shard_N.weight values only): NVFP4 folders are refused. The
# lookup is synchronous host work: on CUDA every CUDA graph must be off (a captured lookup would
# replay stale rows), and SGLang's --ple-offload-embedding (a host table of its own) is refused.
QWEN_MODULE = "sglang.srt.models.qwen4_exp"
# the table's tensors SGLang's Qwen4Exp loader copies into the embedding (its split_ngram_parts
# shards); the global weight_scale stays SGLang's
QWEN_TABLE_TENSOR = re.compile(r"\.ple_embedding\.ngram_embedding\.shard_\d+\.weight$")
EAGER_FLAGS = "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled"

_ple_class = None
_methods = {}            # SGLang embedding method class -> its subclass whose embedding() reads our rows
_qwen_stock = None       # SGLang's (Qwen4ExpNGramEmbedding, Qwen4ExpForConditionalGeneration.load_weights)


def _process_weights_after_loading(self, layer):
    return None   # a streamed layer has no table to process after loading


def ple_class():
    """StreamPLEEmbedding (made once: it subclasses SGLang's VocabParallelEmbedding)."""
    global _ple_class
    if _ple_class is not None:
        return _ple_class
    import torch
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    class StreamPLEEmbedding(serving.StreamVocabRows, VocabParallelEmbedding):
        """SGLang's table of one layer (a Qwen4Exp PLE n-gram table, LongCat's n-gram table) with its
        rows from engram_stream (no table)."""

        def __init__(self, model, layer, num_embeddings, embedding_dim, *, params_dtype, **kw):
            w = model.layer(layer)
            fmt = w.table_format
            if fmt == "nvfp4":
                raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer}'s PLE table is NVFP4: "
                                 f"SGLang {SGLANG_VERSION} serves bf16 and FP8 PLE tables only (its loader has no "
                                 f"NVFP4 shards); give a bf16 or FP8 checkpoint")
            # SGLang's constructor, whole (its vocabulary shard of this TP rank, its quant method); the
            # table it allocates is a meta tensor here (no memory), dropped below
            with torch.device("meta"):
                super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, **kw)
            del self.weight
            rows = model.plan.table_rows[layer]
            if rows != self.org_vocab_size or embedding_dim != model.cfg.head_dim:
                raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer}'s table is [{rows}, "
                                 f"{model.cfg.head_dim}], SGLang's [{self.org_vocab_size}, {embedding_dim}]: give "
                                 f"the checkpoint SGLang serves")
            self.stream_from(model, layer)
            self.check_gguf_table(fmt, ENV, "SGLang")
            if self.gguf_type >= 0:
                fmt = "bfloat16"   # GGUF rows served as bf16 values (stream_rows)
            self.table_format = fmt
            # the dtype of SGLang's loaded table: FP8 shards switch its storage to FP8; values are
            # cast to its storage dtype (bf16, or FP8 when the config or quant config says so)
            self.storage_dtype = torch.float8_e4m3fn if fmt == "fp8" else params_dtype
            self._values = None if fmt == "fp8" else np.dtype(w.table.dtype)
            serving.stream_method(self.quant_method, _methods,
                                  process_weights_after_loading=_process_weights_after_loading)

        def _use_triton_embedding(self, input_):
            return False   # SGLang's fused gather reads a device table; the rows here come from the host

        def stream_rows(self, ids):
            """What SGLang's embedding method gives for local ids (its masked input):
            [*ids.shape, embedding_dim] of the table's dtype, on ids' device."""
            flat = ids.reshape(-1)
            host = (flat.cpu() if flat.device.type != "cpu" else flat).numpy().astype(np.int64)
            host += self.shard_indices.org_vocab_start_index
            if self.gguf_type >= 0:   # a GGUF's rows, decoded to bf16 as the framework's bf16 table holds them
                out = self.gguf_rows(host, torch).to(self.storage_dtype)
                return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)
            rec = np.empty((host.shape[0], self.recbytes), np.uint8)
            self.source.read_into(host, rec)
            t = torch.from_numpy(rec)
            if self.table_format == "fp8":
                out = t.view(torch.float8_e4m3fn)
            else:
                values = t.view(torch.bfloat16) if self._values.name == "bfloat16" \
                    else torch.from_numpy(rec.view(self._values))
                out = values.to(self.storage_dtype)
            return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    _ple_class = StreamPLEEmbedding
    return _ple_class


def _eager():
    """SGLang runs every phase without CUDA graphs (False before its config is published)."""
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled
    return cuda_graph_fully_disabled()


def _patch_qwen(Q):
    """Qwen4ExpNGramEmbedding becomes StreamNGramEmbedding; Qwen4ExpForConditionalGeneration's
    load_weights skips the table's shards while it holds one."""
    global _qwen_stock
    if _qwen_stock is not None and Q.Qwen4ExpNGramEmbedding is not _qwen_stock[0]:
        return
    stock, stock_load = Q.Qwen4ExpNGramEmbedding, Q.Qwen4ExpForConditionalGeneration.load_weights
    _qwen_stock = (stock, stock_load)

    class StreamNGramEmbedding(stock):
        """SGLang's Qwen4Exp PLE n-gram embedding whose table module is a StreamPLEEmbedding."""

        def __init__(self, config, embedding_dim, ple_layer_index=0, quant_config=None, prefix=""):
            if _settings is None:
                raise RuntimeError(f"{QWEN_MODULE}.Qwen4ExpNGramEmbedding is engram_stream's: call install() first")
            if getattr(config, "ple_offload_embedding", False):
                raise ValueError(f"{ENV}: --ple-offload-embedding is set: SGLang would allocate a host table "
                                 f"engram_stream's rows leave unused; unset it (the rows come from engram_stream's "
                                 f"row source)")
            if serving.cuda_available() and not _eager():
                raise ValueError(f"{ENV}: Qwen4Exp PLE rows are read by a synchronous host lookup, which a CUDA "
                                 f"graph would capture once and replay stale: serve with {EAGER_FLAGS} (or "
                                 f"--disable-cuda-graph)")
            model = serving.open_model(_settings, None, ENV, variant="qwen3.8-flash-next")
            layer = serving.ple_layer(model, ple_layer_index, ENV, "SGLang")
            cls = ple_class()

            def make(*a, **k):
                return cls(model, layer, *a, **k)

            saved = Q.VocabParallelEmbedding
            Q.VocabParallelEmbedding = make
            try:
                super().__init__(config, embedding_dim, ple_layer_index, quant_config, prefix)
            finally:
                Q.VocabParallelEmbedding = saved
            want = np.asarray(model.plan.offsets[layer])
            if not np.array_equal(self.ngram_heads_offsets.cpu().numpy(), want):
                raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer}'s heads start at rows "
                                 f"{want.tolist()}, SGLang's at {self.ngram_heads_offsets.tolist()}: give the "
                                 f"checkpoint SGLang serves")

    def load_weights(self, weights):
        if _ple_class is not None and any(isinstance(m, _ple_class) for m in self.modules()):
            weights = ((name, w) for name, w in weights if not QWEN_TABLE_TENSOR.search(name))
        return stock_load(self, weights)

    Q.Qwen4ExpNGramEmbedding = StreamNGramEmbedding
    Q.Qwen4ExpForConditionalGeneration.load_weights = load_weights


# ---- LongCat-Flash-Lite: the n-gram embedding's table ----------------------------------------------
# After install(), SGLang's NgramEmbedding (sglang.srt.layers.n_gram_embedding, which
# LongcatFlashModel builds when the config sets use_ngram_embedding) is StreamNgramEmbedding: SGLang's
# constructor runs whole, its oe_embeder (the E embedders concatenated at exclusive offsets, one
# VocabParallelEmbedding) built as a StreamPLEEmbedding of layer 0 (the same served-table class as
# Qwen4Exp's: its table a meta tensor, dropped; the rows of SGLang's ids from engram_stream's row
# source, cast to SGLang's params dtype as its loader casts the table), and its load_weight skips the
# embedders' tensors. The token embedding and the projections stay SGLang's. The ids are SGLang's
# (its compute_n_gram_ids kernel): the rows are served by id, so the lookup gives SGLang's bytes for
# whatever ids it computes.
LONGCAT_MODULE = "sglang.srt.layers.n_gram_embedding"
LONGCAT_TABLE_TENSOR = re.compile(r"(?:^|\.)ngram_embeddings\.embedders\.\d+\.weight$")

_longcat_stock = None    # SGLang's NgramEmbedding


def _patch_longcat(N):
    """NgramEmbedding becomes StreamNgramEmbedding (its oe_embeder a served table)."""
    global _longcat_stock
    if _longcat_stock is not None and N.NgramEmbedding is not _longcat_stock:
        return
    stock = _longcat_stock = N.NgramEmbedding

    class StreamNgramEmbedding(stock):
        """SGLang's LongCat n-gram embedding whose oe_embeder is a StreamPLEEmbedding (no table)."""

        def __init__(self, num_embeddings, embedding_dim, over_embedding_m, over_embedding_k, over_embedding_n,
                     eos_token_id):
            if _settings is None:
                raise RuntimeError(f"{LONGCAT_MODULE}.NgramEmbedding is engram_stream's: call install() first")
            import torch
            model = serving.open_model(_settings, None, ENV, variant="longcat-flash-lite")
            rows, cls, vocab_table = model.plan.table_rows[0], ple_class(), N.VocabParallelEmbedding

            def make(num_embeddings, embedding_dim, **kw):
                # the n-gram table has more rows than the vocabulary (E*m + E^2 > vocab): the token
                # embedding (word_embeder) stays SGLang's
                if num_embeddings != rows:
                    return vocab_table(num_embeddings, embedding_dim, **kw)
                kw.setdefault("params_dtype", torch.get_default_dtype())   # SGLang's default for None
                return cls(model, 0, num_embeddings, embedding_dim, **kw)

            N.VocabParallelEmbedding = make
            try:
                super().__init__(num_embeddings, embedding_dim, over_embedding_m, over_embedding_k, over_embedding_n,
                                 eos_token_id)
            finally:
                N.VocabParallelEmbedding = vocab_table
            want = np.asarray(model.plan.offsets[0]).tolist()
            got = self.exclusive_oe_embedder_size_sums.tolist()
            if not isinstance(self.oe_embeder, cls) or got[:-1] != want:
                raise ValueError(f"{ENV}: SGLang's n-gram tables start at rows {got[:4]}... ({got[-1]} rows), the "
                                 f"checkpoint {model.source!r}'s at {want[:4]}... ({rows} rows): give the checkpoint "
                                 f"SGLang serves")

        def load_weight(self, param, weight_name, loaded_weight):
            if LONGCAT_TABLE_TENSOR.search(weight_name):
                return None          # the table's rows are engram_stream's
            return super().load_weight(param, weight_name, loaded_weight)

    N.NgramEmbedding = StreamNgramEmbedding
    L = sys.modules.get("sglang.srt.models.longcat_flash")
    if L is not None and getattr(L, "NgramEmbedding", None) is stock:   # imported by name
        L.NgramEmbedding = StreamNgramEmbedding


def _if_installed(patch):
    """patch(module), while install() holds (after uninstall() the module is SGLang's own)."""
    def run(module):
        if _settings is not None:
            patch(module)
    return run


# install() imports none of them: a V4.1 server never does
_PATCHES = {QWEN_MODULE: _if_installed(_patch_qwen), LONGCAT_MODULE: _if_installed(_patch_longcat)}
