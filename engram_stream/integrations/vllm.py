"""engram_stream as the Engram row store of vLLM 0.33.0 (DeepSeek-V4.1): a general plugin.

    pip install . vllm==0.33.0     # from the engram_stream checkout, on a CUDA machine
    ENGRAM_STREAM_VLLM='{"tables": "direct", "row_cache_mb": 4096}' vllm serve /models/DeepSeek-V4.1-Flash

On CUDA the plugin needs vLLM's engram_config.cpu_offload left true (vLLM's default): its
lookups are host work, run at the eager boundary of vLLM's prefetch, and inline a CUDA graph
would replay stale rows, so it refuses cpu_offload=false there. Tested on CPU only, vLLM's
kernels in Triton's interpreter (tools/ci_vllm.sh); nothing of it has run on a GPU yet.

vLLM loads the entry point `engram_stream = "engram_stream.integrations.vllm:register"` (group
vllm.general_plugins) in every process. register() changes nothing vLLM does unless the
settings are given, as a JSON object in the environment variable ENGRAM_STREAM_VLLM or in
vLLM's additional_config["engram_stream"] (--additional-config '{"engram_stream": {...}}'); they are
parsed by integrations.serving.parse_settings, as SGLang's are:

    checkpoint    the V4.1 folder the rows are read from (default: the folder vLLM loads)
    tables        "mapped" (the checkpoint's shards mapped; the page cache holds what is read)
                  or "direct" (pread / O_DIRECT from the shards or the packed row file
                  engram_rows.bin: `engram-stream pack-rows DIR`)
                  or {"gguf": {"path": "m.gguf", "read": ...}} (a llama.cpp GGUF's tables:
                  Qwen4Exp's and LongCat's rows decoded to bf16 in the lookup; V4.1's from a
                  GGUF of the raw 264-byte rows only, byte for byte: other types are refused)
    row_cache_mb  the RAM row cache (MiB) of the process, split over the Engram layers
    host_cache    a name ("vllm"): the row cache is the host's, one for every process (the
                  data-parallel ranks) with the same settings, row_cache_mb its one budget
                  (files under /dev/shm; EngramModel.load's host_cache). Default: none, each
                  process has its own cache
    mooncake      {"master": "host:port", "metadata": "http://...", "local_host": "..."}: rows
                  from a Mooncake Store the tables were published to (MooncakeTier.publish)

When set, each Engram layer's embedding (vLLM's ParallelEngramEmbedding) is a
StreamEngramEmbedding, built through vLLM's own constructor (its head sharding, its checks) with
its table on the meta device, then dropped: it allocates no table (no parameter, no buffer). vLLM
other than 0.33.0 is refused (RuntimeError naming the version). vLLM's loader skips the
`layers.L.engram.embed.weight|scale` tensors (should_skip_weight) before reading them, and
lookup(indices, out, background) fills `out` from engram_stream's row source of the layer: uint8
out takes the 264-byte records (256 e4m3 + 8 e8m0 bytes per head) as they are, bf16 out the rows
dequantized as vLLM's kernel does (integrations._records.records_to_bf16: the bytes vLLM gives). Ids
outside this rank's heads or rows, and -1, give zeros, as in vLLM. The rows are this rank's
heads (TP shards as vLLM's); every rank reads its own rows (no DP exchange: dp_size 1, as
vLLM's DP-shared host table), so the embedding's forward() and vLLM's staging need no
collective. row_cache_stats() of an embedding (or serving.stats()) gives the cache's counters.

A Qwen4Exp model's PLE n-gram tables (bf16, FP8, NVFP4) are served too, from the folder
EngramModel.load reads: see "Qwen4Exp" below (vLLM 0.33.0's Qwen4ExpNGramEmbedding; eager only).
So is LongCat-Flash-Lite's n-gram table (NgramEmbedding.oe_embedder, the E embedders
concatenated), from its Hugging Face folder: see "LongCat-Flash-Lite" below (rows by vLLM's ids;
vLLM 0.33.0's ids differ from the Hugging Face model's at EOS positions).

What runs where: vLLM hashes on its device (NgramHashState) at forward entry, then calls every
Engram layer's prepare_embeddings before the first decoder layer; with cpu_offload (vLLM's
default) that is lookup(..., background=True) on its prefetch stream. lookup() queues the copy
of this rank's ids to a pinned host buffer (an event after it), hands the rows to the
embedding's two lanes (threads of the plugin, each with its own row source) and returns without
waiting for the device: every layer's reads start as soon as the hashes reach the host. A lane
reads the rows (the row cache, then the files or the store; a direct source's I/O pool threads
do the preads), converts them on the host and writes them to `out` (a device `out`: to a pinned
staging buffer). vLLM's wait for the layer's rows (Engram._finish_prefetch, patched) joins the
lanes and queues the staging's copy to `out` on the current stream. A chunk longer than
`window` tokens goes in windows alternating between the lanes: one window's reads in flight
while the other's are converted.
"""
from __future__ import annotations

import os
import re
import sys
import threading

import numpy as np

from . import serving
from . import vllm_graph as graph
from ._records import records_to_bf16

ENV = "ENGRAM_STREAM_VLLM"
KEY = "engram_stream"  # in vLLM's additional_config
VLLM_VERSION = "0.33.0"   # the version whose classes are built through their constructors and whose seams are hooked
ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
LOADER_MODULE = "vllm.model_executor.model_loader.weight_utils"
# the tables' tensors: V4.1's (as vLLM's _ENGRAM_WEIGHT_RE), Qwen4Exp's PLE n-gram table and its shards (their
# NVFP4 block scales too; not the global weight_scale / weight_scale_2, which vLLM loads), LongCat's embedders
TABLE_TENSOR = re.compile(r"(?:^|\.)(?:engram\.embed\.(?:weight|scale)"
                          r"|ple_embedding\.ngram_embedding\.(?:weight|shard_\d+\.(?:weight|weight_scale))"
                          r"|ngram_embeddings\.embedders\.\d+\.weight)$")
WINDOW_ROWS = 1 << 14   # rows of one window of a long lookup (its records: 4 MiB of scratch a lane)

_serving = False        # a StreamEngramEmbedding was made: the loader skips the table tensors
_embedding_class = None


def settings(vllm_config=None):
    """The plugin's settings, or None when it is not configured: ENGRAM_STREAM_VLLM first, then
    vllm_config.additional_config["engram_stream"]."""
    env = os.environ.get(ENV)
    if env:
        return serving.parse_settings(env, ENV)
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict) and extra.get(KEY) is not None:
        return serving.parse_settings(extra[KEY], f'additional_config["{KEY}"]')
    return None


def _engram_module():
    """vLLM's V4.1 Engram module (imported at its first use)."""
    return sys.modules.get(ENGRAM_MODULE) or __import__(ENGRAM_MODULE, fromlist=["_"])


def embedding_class():
    """StreamEngramEmbedding: EngramRows over serving.StreamRows and vLLM's
    ParallelEngramEmbedding, made once (after vLLM's version is checked)."""
    global _embedding_class
    if _embedding_class is None:
        _check_version()
        _embedding_class = type("StreamEngramEmbedding",
                                (EngramRows, serving.StreamRows, _engram_module().ParallelEngramEmbedding),
                                {"__module__": __name__, "__doc__": EngramRows.__doc__})
    return _embedding_class


class EngramRows:
    """The methods of StreamEngramEmbedding (embedding_class(): this, serving.StreamRows and vLLM's
    ParallelEngramEmbedding): vLLM's Engram embedding of one layer with its rows from
    engram_stream (no table). torch and vLLM are imported by the methods that use them: this
    module imports without either."""

    def __init__(self, model, layer, num_embeddings, dim, head_sizes, block_size=32, cpu_offload=False):
        import torch
        E = _engram_module()
        primes = [int(p) for p in model.plan.head_primes[layer]]
        if tuple(primes) != tuple(head_sizes) or model.plan.table_rows[layer] != num_embeddings:
            raise ValueError(f"{ENV}: the checkpoint {model.source!r} layer {layer} has heads of {primes} rows, "
                             f"vLLM's config {list(head_sizes)}: give the checkpoint vLLM serves")
        if dim != model.cfg.head_dim or block_size != 32:
            raise ValueError(f"{ENV}: head_dim {dim} / block {block_size}: the checkpoint's rows are "
                             f"{model.cfg.head_dim} values with one e8m0 scale per 32")
        # every rank reads its own rows from the host, as vLLM's DP-shared host table: vLLM's
        # dp_shared_memory (which needs cpu_offload) gives dp_size 1, so no DP exchange
        dp = E.get_engram_dp_size()
        if dp > 1 and not cpu_offload:
            raise ValueError(f"{ENV}: an Engram data-parallel group of {dp} ranks reads its rows from the "
                             f"host: keep vLLM's engram_config cpu_offload=true (the default)")
        # vLLM's constructor, whole (its head sharding over the TP ranks, its checks); the table it
        # allocates on the default device is a meta tensor here (no memory), dropped below: no
        # parameter for vLLM's loader to fill
        with torch.device("meta"):
            super().__init__(num_embeddings, dim, tuple(head_sizes), block_size, cpu_offload=cpu_offload,
                             dp_shared_memory=dp > 1, use_thp=False)
        del self.weight, self.weight_scale_inv
        self.stream_from(model, layer)
        # tokens of one window: a long prompt chunk's windows alternate between two lanes
        self.window = max(1, WINDOW_ROWS // self.part_n_hash_cols)
        self._inline = (None, self.source, [np.empty(0, np.uint8)])  # a lane without a thread
        self._lanes = None                     # (executor, its RowSource, its record scratch) x 2
        self._pending = []                     # futures of the lookup in flight
        self._pending_copy = None              # (host rows, device out) copied at wait()
        self._copied = None                    # a CUDA event: the staging's last copy is done
        self._staging = None                   # pinned host rows of a device `out`
        self._ids_pinned = None                # pinned host ids of a device background lookup
        self._lookup_lock = threading.RLock()

    def extra_repr(self):
        return self.rows_repr(f"heads={self.head_start}..{self.head_start + self.part_n_hash_cols} "
                              f"of {self.n_hash_cols}")

    def _rows(self, indices, rows=None):
        """int64 [T, part] table rows of this rank's heads (-1: zeros), into `rows` if given."""
        a = indices[:, self.head_start:self.head_start + self.part_n_hash_cols]
        a = (a.cpu() if a.device.type != "cpu" else a).numpy()
        if rows is None:
            rows = np.empty((a.shape[0], self.part_n_hash_cols), np.int64)
        rows[:, a.shape[1]:] = -1
        owned = (a >= self.vocab_start_idx) & (a < self.vocab_end_idx)
        rows[:, :a.shape[1]] = np.where(owned, a, -1)
        return rows

    def _ids_to_host(self, indices):
        """This rank's columns of device `indices` copied to a pinned buffer on the current
        stream without waiting, and an event recorded after the copy: a lane waits for it,
        so a background lookup does not block the host on the device's hash kernel."""
        import torch
        a = indices[:, self.head_start:self.head_start + self.part_n_hash_cols]
        buf = self._ids_pinned
        if buf is None or buf.numel() < a.numel():
            buf = self._ids_pinned = torch.empty(max(a.numel(), 1), dtype=a.dtype, pin_memory=True)
        host = buf[:a.numel()].view(a.shape)
        host.copy_(a, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _rows_when_ready(self, ids, ready, rows):
        ready.synchronize()
        self._rows(ids, rows)

    def _fill(self, lane, rows, host, rows_ready=None):
        """One window: its records read into `host` (uint8) or through the lane's scratch
        converted to bf16. Runs on a lane's thread or the caller's; the GIL is released
        while the rows are read and converted. rows_ready: the future that fills `rows`."""
        if rows_ready is not None:
            rows_ready.result()
        source, scratch = lane[1], lane[2]
        if host.dtype == np.uint8:
            source.read_into(rows, host)
            return
        need = rows.size * self.recbytes
        if scratch[0].size < need:
            scratch[0] = np.empty(need, np.uint8)
        rec = scratch[0][:need].reshape(rows.shape[0], self.part_n_hash_cols, self.recbytes)
        source.read_into(rows, rec)
        records_to_bf16(rec, host)

    def _lane_set(self):
        if self._lanes is None:
            from concurrent.futures import ThreadPoolExecutor
            self._lanes = [(ThreadPoolExecutor(1, thread_name_prefix=f"engram-rows-L{self.layer}"),
                            src, scratch)
                           for src, scratch in ((self.source, self._inline[2]),
                                                (self.model.row_source(self.layer), [np.empty(0, np.uint8)]))]
        return self._lanes

    def lookup(self, indices, out, background=False):
        """vLLM's lookup: out[t, h] = the row of indices[t, head_start + h] of this rank's
        heads, as uint8 records or bf16 (vLLM's rounding); zeros where no row.

        background=True (Engram._start_prefetch, at forward entry for every layer) returns
        once the rows are handed to this embedding's two lanes (threads, each its own row
        source): every layer's reads are in flight before the first layer runs, and
        Engram._finish_prefetch, where vLLM waits for the rows, calls wait(). A chunk of more
        than `window` tokens is read in windows alternating between the lanes, so one
        window's reads are in flight while the other's are copied and converted; a shorter
        lookup without background runs on the caller's thread."""
        import torch
        T = indices.shape[0]
        if not T * self.part_n_hash_cols:
            return
        if out.dtype not in (torch.uint8, torch.bfloat16):
            raise TypeError(f"lookup: out must be bfloat16 rows or uint8 records, got {out.dtype}")
        if graph.lookup_path() == "stream":   # a CUDA graph captures it, or FULL mode: vllm_graph.py
            with self._lookup_lock:
                if graph.capturing():
                    if self._pending or self._pending_copy is not None:
                        raise RuntimeError("lookup: a CUDA graph capture began with this layer's rows in flight")
                else:
                    self.wait()
                return graph.stream_lookup(self, indices, out)
        graph.check_embedding(self)
        with self._lookup_lock:
            self.wait()                       # the previous lookup's rows (and its staging)
            lanes, rows_ready = None, None
            if background and indices.device.type != "cpu":
                lanes = self._lane_set()
                rows = np.empty((T, self.part_n_hash_cols), np.int64)
                rows_ready = lanes[0][0].submit(self._rows_when_ready, *self._ids_to_host(indices), rows)
                self._pending.append(rows_ready)
            else:
                rows = self._rows(indices)
            host = out if out.device.type == "cpu" else self._host(out)
            dst = host.numpy() if host.dtype == torch.uint8 else host.view(torch.int16).numpy().view(np.uint16)
            if host is not out:
                self._pending_copy = (host, out)
            if not background and T <= self.window:
                self._fill(self._inline, rows, dst)
                if host is not out:
                    self.wait()
                return
            lanes = lanes or self._lane_set()
            for k, t0 in enumerate(range(0, T, self.window)):
                t1 = min(T, t0 + self.window)
                self._pending.append(lanes[k % 2][0].submit(self._fill, lanes[k % 2], rows[t0:t1], dst[t0:t1],
                                                            rows_ready))
            if not background:
                self.wait()

    def wait(self):
        """Block until the lookup in flight has filled `out` (a device `out`: its copy from
        the pinned staging is queued on the current stream). Raises what a read raised."""
        import torch
        if not self._pending and self._pending_copy is None:
            return                            # nothing in flight (a decode step's inline lookup)
        with self._lookup_lock:
            pending, self._pending = self._pending, []
            error = None
            for f in pending:                 # every window finishes before the staging is reused
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001  (the first error is raised below)
                    error = error or e
            copy, self._pending_copy = self._pending_copy, None
            if error is not None:
                raise error
            if copy is not None:
                host, out = copy
                out.copy_(host, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record()

    def _host(self, out):
        """A pinned host tensor shaped as `out` (kept and reused once its last copy is done)."""
        import torch
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        st = self._staging
        if st is None or st.dtype != out.dtype or st.numel() < out.numel():
            st = self._staging = torch.empty(out.numel(), dtype=out.dtype, pin_memory=True)
        return st[:out.numel()].view(out.shape)


# ---- the hooks -----------------------------------------------------------------------------------
def _patch_engram(E):
    """Engram._create_embedding makes a StreamEngramEmbedding when the plugin is configured."""
    original = E.Engram._create_embedding
    if getattr(original, "_engram_stream", False):
        return

    def _create_embedding(self, layout, layer_hash_index):
        global _serving
        config = E.get_current_vllm_config()
        s = settings(config)
        if s is None:
            return original(self, layout, layer_hash_index)
        model = serving.open_model(s, getattr(getattr(config, "model_config", None), "model", None), ENV,
                                   variant="deepseek-v4.1")
        engram_config = config.engram_config
        offload = bool(engram_config is not None and engram_config.cpu_offload)
        if not offload and serving.cuda_available():
            raise ValueError(f"{ENV}: keep vLLM's engram_config cpu_offload=true (the default): the plugin's "
                             f"lookups are host work, run at the eager boundary of vLLM's prefetch (inline, a "
                             f"CUDA graph would replay stale rows)")
        emb = embedding_class()(
            model, layout.layer_ids[layer_hash_index], layout.num_embeddings[layer_hash_index], layout.head_dim,
            tuple(size for order in layout.primes[layer_hash_index] for size in order),
            cpu_offload=offload)
        from .vllm_graph import check_startup
        check_startup(config, emb)   # FULL CUDA graphs and rows that need the GIL: refused here
        _serving = True
        return emb

    _create_embedding._engram_stream = True
    E.Engram._create_embedding = _create_embedding
    _patch_wait(E)


def _patch_wait(E):
    """Engram._finish_prefetch, where vLLM waits for a layer's background lookup, first waits for
    the plugin's lanes (and queues the rows' copy to the device), in the same eager segment."""
    original = E.Engram._finish_prefetch
    if getattr(original, "_engram_stream", False):
        return
    body = getattr(original, "__wrapped__", original)   # inside vLLM's eager_break_during_capture

    def _finish_prefetch(self, event):
        if _embedding_class is not None and isinstance(self.embed_tokens, _embedding_class):
            self.embed_tokens.wait()
        return body(self, event)

    wrapped = E.eager_break_during_capture(_finish_prefetch)
    wrapped._engram_stream = True
    E.Engram._finish_prefetch = wrapped


def _patch_loader(W):
    """should_skip_weight skips the Engram tables once this process serves them."""
    original = W.should_skip_weight
    if getattr(original, "_engram_stream", False):
        return

    def should_skip_weight(weight_name, local_expert_ids):
        if _serving and TABLE_TENSOR.search(weight_name):
            return True
        return original(weight_name, local_expert_ids)

    should_skip_weight._engram_stream = True
    W.should_skip_weight = should_skip_weight


def _patch_replay(B):
    from .vllm_graph import patch_replay
    patch_replay(B)


# ---- Qwen4Exp: the PLE n-gram tables -------------------------------------------------------------
# When the settings are given and vLLM builds a Qwen4Exp model, each PLE layer's n-gram table
# (Qwen4ExpNGramEmbedding.ngram_embedding) is a StreamPLEEmbedding:
#   - vLLM's own constructor chain runs (Qwen4ExpPLEDeviceEmbedding -> PLEVocabParallelEmbedding ->
#     VocabParallelEmbedding, the embedding method's create_weights); only the table's storage,
#     which vLLM asks of allocate_embedding_weight (the rows, and NVFP4's block scales), is made on
#     the meta device and dropped from the parameters: no table, nothing for vLLM's loader to fill.
#     The global scales (FP8 weight_scale, NVFP4 weight_scale_2: one float each) stay vLLM's
#     parameters, loaded by vLLM, so dequantize() is vLLM's own.
#   - vLLM's loader skips the `...ple_embedding.ngram_embedding.shard_{i}.weight|weight_scale`
#     tensors (should_skip_weight, TABLE_TENSOR).
#   - the lookup is the embedding method's embedding(layer, ids) (vLLM's seam for the row gather,
#     under VocabParallelEmbedding.forward's ETP masking and reduction): the method is vLLM's, of a
#     subclass made here whose embedding() reads the rows from engram_stream's row source of the
#     layer (source.read_into) and gives what vLLM's gives: bf16 rows for bf16 tables (float32 /
#     float16 tables cast to the model dtype, as vLLM's loader casts them), FP8 codes for FP8
#     (dequantize() then multiplies by the scale, vLLM's code), decoded bf16 rows for NVFP4
#     (the variant's nvfp4_lut: vLLM's kernel's values).
#
# The row ids are vLLM's (compute_ngram_ids); engram_stream's hash gives the same ids
# (tests/integrations/test_vllm_qwen.py compares them). The lookup is synchronous host work
# (supports_prefetch is False whatever engram_config.cpu_offload says): eager only, so on CUDA
# the plugin refuses a model without enforce_eager; nothing of it has run on a GPU yet.
COMMON_MODULE = "vllm.models.qwen4_exp.common.ngram_embedding"

_stream_class = None
_methods = {}            # vLLM PLE embedding method class -> its subclass whose embedding() reads our rows


def _check_version():
    import vllm
    serving.check_version("vLLM", vllm, VLLM_VERSION)


class VocabRowsLookup:
    """stream_rows of a served vocabulary-parallel table (Qwen4Exp's PLE tables, LongCat's n-gram
    table): what vLLM's embedding method gives for this rank's local ids. The class sets
    table_format ("fp8", "nvfp4" or the values' dtype name), _values (the values' numpy dtype,
    None for FP8 / NVFP4) and _lut (NVFP4's decode table)."""

    def stream_rows(self, ids):
        """What vLLM's embedding method gives for local ids (VocabParallelEmbedding.forward's
        masked input): [*ids.shape, embedding_dim] of the lookup dtype, on ids' device."""
        import torch
        start = self.shard_indices.org_vocab_start_index
        flat = ids.reshape(-1)
        host = (flat.cpu() if flat.device.type != "cpu" else flat).numpy().astype(np.int64) + start
        if self.gguf_type >= 0:   # a GGUF's rows, decoded to bf16 as the framework's bf16 table holds them
            out = self.gguf_rows(host, torch).to(self.params_dtype)
            return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)
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


def stream_class():
    """StreamPLEEmbedding (made once: it subclasses vLLM's Qwen4ExpPLEDeviceEmbedding)."""
    global _stream_class
    if _stream_class is not None:
        return _stream_class
    import torch
    C = sys.modules.get(COMMON_MODULE) or __import__(COMMON_MODULE, fromlist=["_"])

    class StreamPLEEmbedding(VocabRowsLookup, serving.StreamVocabRows, C.Qwen4ExpPLEDeviceEmbedding):
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
            self.stream_from(model, layer)
            fmt = "bfloat16" if self.gguf_type >= 0 else w.table_format
            self.check_gguf_table(w.table_format, ENV, "vLLM")
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
            self.table_format = fmt
            self._values = None if fmt in ("fp8", "nvfp4") or self.gguf_type >= 0 else np.dtype(w.table.dtype)
            self._lut = None if fmt != "nvfp4" else torch.from_numpy(np.asarray(w.table_lut, np.float32))
            serving.stream_method(self.embedding_method, _methods)

        def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
            """The table's storage (vLLM's create_weights asks here): a meta tensor, no memory."""
            # the parameter's name is the one create_weights registers next: weight, then NVFP4's weight_scale
            self._meta_names.append(("weight", "weight_scale")[len(self._meta_names)])
            return torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")

    _stream_class = StreamPLEEmbedding
    return _stream_class


def _patch_qwen(N):
    """Qwen4ExpNGramEmbedding.__init__ builds a StreamPLEEmbedding as its ngram_embedding when
    the plugin is configured (vLLM's constructor runs whole; the backend it picks is ours)."""
    original = N.Qwen4ExpNGramEmbedding.__init__
    if getattr(original, "_engram_stream", False):
        return
    plugin = sys.modules[__name__]

    def __init__(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, **kw):
        vllm_config = N.get_current_vllm_config()
        s = plugin.settings(vllm_config)
        if s is None:
            return original(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, **kw)
        _check_version()
        if serving.cuda_available() and not getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
            raise ValueError(f"{plugin.ENV}: Qwen4Exp PLE rows are read by a synchronous host lookup, which a CUDA "
                             f"graph would capture once and replay stale: serve with --enforce-eager")
        model = serving.open_model(s, getattr(getattr(vllm_config, "model_config", None), "model", None), plugin.ENV,
                                   variant="qwen3.8-flash-next")
        layer = serving.ple_layer(model, ple_dense_layer_id, plugin.ENV, "vLLM")
        cls = stream_class()

        def make(*a, **k):
            return cls(model, layer, *a, **k)

        saved = (N.Qwen4ExpPLEDeviceEmbedding, N.Qwen4ExpPLEPinnedHostEmbedding)
        N.Qwen4ExpPLEDeviceEmbedding = N.Qwen4ExpPLEPinnedHostEmbedding = make
        try:
            original(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, **kw)
        finally:
            N.Qwen4ExpPLEDeviceEmbedding, N.Qwen4ExpPLEPinnedHostEmbedding = saved
        global _serving
        _serving = True

    __init__._engram_stream = True
    N.Qwen4ExpNGramEmbedding.__init__ = __init__


# ---- LongCat-Flash-Lite: the n-gram embedding's table ----------------------------------------------
# When the settings are given and vLLM builds LongCat-Flash-Lite's NgramEmbedding, its oe_embedder
# (the E embedders' tables concatenated at exclusive offsets, one VocabParallelEmbedding) is a
# StreamNgramTable:
#   - vLLM's own VocabParallelEmbedding constructor runs (its vocabulary sharding over the TP
#     ranks) on the meta device; its weight is dropped from the parameters: no table, nothing for
#     vLLM's loader to fill. oe_projection and the token embedding stay vLLM's, loaded by vLLM.
#   - vLLM's loader skips the `model.ngram_embeddings.embedders.{c}.weight` tensors
#     (should_skip_weight, TABLE_TENSOR).
#   - the lookup is the embedding method's embedding(layer, ids), as for Qwen4Exp (stream_method,
#     VocabRowsLookup.stream_rows): the rows of the global ids vLLM computed, read from
#     engram_stream's row source of layer 0, cast to vLLM's params_dtype as vLLM's loader casts
#     the table. TP > 1 takes VocabParallelEmbedding's masked path (its fused CUDA kernel reads
#     the weight), so each rank reads its own vocabulary range and vLLM's all-reduce sums them.
# The ids are vLLM's (its ngram_compute_n_gram_ids kernel, in LongcatNgramModelState.prepare_inputs,
# eager, outside any CUDA graph): the plugin serves rows by id, so embed_batched gives vLLM's
# bytes for whatever ids vLLM computes. vLLM 0.33.0's kernel has no EOS-position fix-up (at an
# EOS the walk stops at once: every embedder's row 0), where engram_stream follows the Hugging
# Face semantics; the served rows are vLLM's ids' rows either way.
LONGCAT_MODULE = "vllm.model_executor.models.longcat_flash_ngram"

_table_class = None


def table_class():
    """StreamNgramTable (made once: it subclasses vLLM's VocabParallelEmbedding)."""
    global _table_class
    if _table_class is not None:
        return _table_class
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    class StreamNgramTable(VocabRowsLookup, serving.StreamVocabRows, VocabParallelEmbedding):
        """vLLM's LongCat n-gram table (oe_embedder) with its rows from engram_stream (no table)."""

        def __init__(self, model, num_embeddings, embedding_dim, params_dtype=None, **kw):
            with torch.device("meta"):              # the table vLLM's create_weights allocates: no memory
                super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, **kw)
            if type(self.quant_method) is not UnquantizedEmbeddingMethod:
                raise ValueError(f"{ENV}: LongCat's n-gram table is served unquantized, vLLM chose "
                                 f"{type(self.quant_method).__name__}")
            object.__setattr__(self, "weight", self._parameters.pop("weight").data)
            # the fused kernel (TP > 1 on CUDA) gathers from the weight: the masked path asks embedding()
            self.use_fused_embedding = False
            w, rows = model.layer(0), model.plan.table_rows[0]
            if rows != self.org_vocab_size or embedding_dim != model.cfg.head_dim:
                raise ValueError(f"{ENV}: the checkpoint {model.source!r}'s n-gram table is [{rows}, "
                                 f"{model.cfg.head_dim}], vLLM's [{self.org_vocab_size}, {embedding_dim}]: give "
                                 f"the checkpoint vLLM serves")
            self.stream_from(model, 0)
            self.table_format = "bfloat16" if self.gguf_type >= 0 else w.table_format
            self._values, self._lut = np.dtype(w.table.dtype), None
            serving.stream_method(self.quant_method, _methods)

    _table_class = StreamNgramTable
    return _table_class


def _patch_longcat(M):
    """NgramEmbedding.__init__ builds a StreamNgramTable as its oe_embedder when the plugin is
    configured (vLLM's constructor runs whole; the table class it picks is ours)."""
    original = M.NgramEmbedding.__init__
    if getattr(original, "_engram_stream", False):
        return
    plugin = sys.modules[__name__]

    def __init__(self, config, base_embeddings):
        from vllm.config import get_current_vllm_config
        vllm_config = get_current_vllm_config()
        s = plugin.settings(vllm_config)
        if s is None:
            return original(self, config, base_embeddings)
        _check_version()
        model = serving.open_model(s, getattr(getattr(vllm_config, "model_config", None), "model", None), plugin.ENV,
                                   variant="longcat-flash-lite")
        cls = table_class()

        def make(*a, **k):
            return cls(model, *a, **k)

        saved = M.VocabParallelEmbedding
        M.VocabParallelEmbedding = make
        try:
            original(self, config, base_embeddings)
        finally:
            M.VocabParallelEmbedding = saved
        want = np.asarray(model.plan.offsets[0]).tolist()
        if list(self._offsets[:-1]) != want:
            raise ValueError(f"{plugin.ENV}: vLLM's n-gram tables start at rows {list(self._offsets[:4])}..., the "
                             f"checkpoint {model.source!r}'s at {want[:4]}...: give the checkpoint vLLM serves")
        global _serving
        _serving = True

    __init__._engram_stream = True
    M.NgramEmbedding.__init__ = __init__


_PATCHES = {ENGRAM_MODULE: _patch_engram, LOADER_MODULE: _patch_loader,
            "vllm.compilation.breakable_cudagraph": _patch_replay,
            "vllm.models.qwen4_exp.nvidia.ngram_embedding": _patch_qwen, LONGCAT_MODULE: _patch_longcat}


def register():
    """vLLM's entry point (every process). Nothing of vLLM changes unless the settings are given
    (ENGRAM_STREAM_VLLM here, or additional_config["engram_stream"] at the model's build): the
    hooks defer to vLLM's own code. A bad ENGRAM_STREAM_VLLM fails here, naming the value."""
    if os.environ.get(ENV):
        serving.parse_settings(os.environ[ENV], ENV)
    serving.install_patches(_PATCHES)
