"""The vLLM plugin's lookup inside CUDA graphs (issue 39): the path per graph mode, and the
stream-ordered lookup a FULL graph captures.

vLLM 0.33.0 captures DeepseekV41ForCausalLM with breakable CUDA graphs
(DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES) and its default cudagraph_mode FULL_AND_PIECEWISE
gives decode batches FULL graphs. In a PIECEWISE graph, Engram._start_prefetch /
_finish_prefetch are eager breaks (eager_break_during_capture): they run in Python at every
replay, and the plugin's lanes (threads) serve them. In a FULL graph the breaks run inside the
capture (eager_break_during_capture returns fn(...) when the forward context's
cudagraph_runtime_mode is FULL): whatever the lookup does on the host happens once, at capture,
and a replay repeats only its device work. So there the lookup is stream-ordered work:

    ids[:, :]  <- this rank's columns of the hash ids       (device -> pinned host copy)
    host node: hf_run(ctx)                                   (cuLaunchHostFunc; _vllm_graph.pyx)
    out        <- staging                                    (pinned host -> device copy)

which a graph captures and every replay repeats on the replay's ids. The same three steps run
eagerly (not capturing) in FULL mode, so FULL mode has one path. A context (pinned ids,
pinned staging, the C view of the row source, scratch, the error slot) is made per (tokens,
dtype) and kept for the embedding's life: a captured graph holds its addresses. A read that
fails in the host node is recorded in the slot (its rows served as zeros) and raised at the
next eager check: the next eager lookup of the layer, or the next replay of a breakable graph
(BreakableCUDAGraphWrapper._replay, patched).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from ._vllm_graph import HostLookup, graph_capable, host_fn_address

FULL_GRAPH_FLAGS = ("--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' (-cc.cudagraph_mode=PIECEWISE), "
                    "or --enforce-eager")
REPLAY_MODULE = "vllm.compilation.breakable_cudagraph"

_contexts = []          # every HostLookup made (checked at each eager check); they live as long as the process
_contexts_lock = threading.Lock()
_launch = None


# ---- which path --------------------------------------------------------------------------------
def graph_mode():
    """vLLM's CUDA graph mode of the forward running now: "full", "piecewise" or "none"
    (no forward context, vLLM absent, or an eager forward)."""
    try:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return "none"
    if not is_forward_context_available():
        return "none"
    mode = get_forward_context().cudagraph_runtime_mode
    if mode == CUDAGraphMode.FULL:
        return "full"
    if mode == CUDAGraphMode.PIECEWISE:
        return "piecewise"
    return "none"


def capturing():
    """A CUDA graph is being captured on the current stream."""
    import torch
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def lookup_path():
    """"stream" (the stream-ordered lookup) when the lookup runs inside a capture or in a FULL
    graph forward; "lanes" (the plugin's threads, at vLLM's eager boundaries) otherwise:
    piecewise graphs (their Engram prefetch is an eager break) and eager forwards."""
    if capturing() or graph_mode() == "full":
        return "stream"
    return "lanes"


def check_startup(vllm_config, emb):
    """Refuse, when the model is built, a FULL-graph configuration whose rows need the GIL: the
    FULL graphs' lookups are host nodes that must not take it (they would otherwise serve the
    rows read at capture on every replay)."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    if mode is None or not callable(has_full) or not has_full():
        return
    ok, why = graph_capable(emb.source)
    if not ok:
        raise ValueError(f"engram_stream: vLLM captures FULL CUDA graphs (cudagraph_mode {mode.name}), whose "
                         f"Engram lookups run as host nodes without the GIL; {why}. Run vLLM with "
                         f"{FULL_GRAPH_FLAGS}, or serve the rows from tables \"mapped\" / \"direct\"")


# ---- the host function's launch ----------------------------------------------------------------
def _libcudart():
    """The CUDA runtime torch loaded (its path from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return None


def _launcher():
    """launch(stream_handle, fn, data): cudaLaunchHostFunc of torch's CUDA runtime, else the
    driver's cuLaunchHostFunc (libcuda.so.1); either is captured as a host node."""
    global _launch
    if _launch is not None:
        return _launch
    lib = _libcudart()
    name = "cudaLaunchHostFunc"
    if lib is None or not hasattr(lib, name):
        lib, name = ctypes.CDLL("libcuda.so.1"), "cuLaunchHostFunc"
    f = getattr(lib, name)
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    f.restype = ctypes.c_int

    def launch(stream, fn, data):
        rc = f(stream, fn, data)
        if rc != 0:
            raise RuntimeError(f"engram_stream: {name} failed with error {rc}")

    _launch = launch
    return launch


# ---- the stream-ordered lookup -----------------------------------------------------------------
def _context(emb, T, out, ids_dtype):
    """The embedding's HostLookup of T tokens into out's dtype (made once, kept: a captured
    graph names its buffers)."""
    import torch
    key = (T, out.dtype, ids_dtype)
    ctxs = emb.__dict__.setdefault("_graph_contexts", {})
    got = ctxs.get(key)
    if got is not None:
        return got
    pin = out.device.type == "cuda"
    k = emb.part_n_hash_cols
    ids = torch.full((T, k), -1, dtype=ids_dtype, pin_memory=pin)
    staging = torch.zeros(tuple(out.shape), dtype=out.dtype, pin_memory=pin)
    st = staging.numpy() if out.dtype == torch.uint8 else staging.view(torch.int16).numpy().view(np.uint16)
    ctx = HostLookup(emb.source, ids.numpy(), st, emb.vocab_start_idx, emb.vocab_end_idx, 0.0)
    got = ctxs[key] = (ids, staging, ctx)
    with _contexts_lock:
        _contexts.append(ctx)
    return got


def stream_lookup(emb, indices, out):
    """out <- the rows of indices (as the plugin's lookup) as stream-ordered work on the current
    stream: the ids' copy, the host node, the staging's copy. Captured, a graph replays all
    three on the replay's ids. On CPU tensors the host function runs here, between the copies."""
    import torch
    T, k = indices.shape[0], emb.part_n_hash_cols
    if not T * k:
        return
    if out.dtype not in (torch.uint8, torch.bfloat16) or tuple(out.shape[:2]) != (T, k):
        raise TypeError(f"lookup: out must be bfloat16 rows or uint8 records [{T}, {k}, ...], got "
                        f"{out.dtype} {tuple(out.shape)}")
    ids_dtype = torch.int64 if indices.dtype == torch.int64 else torch.int32
    a = indices[:, emb.head_start:emb.head_start + k]
    if a.dtype != ids_dtype:
        a = a.to(ids_dtype)
    if a.shape[1] < k:   # the padded heads of the last TP shard: no rows
        a = torch.nn.functional.pad(a, (0, k - a.shape[1]), value=-1)
    ids, staging, ctx = _context(emb, T, out, ids_dtype)   # staging: contiguous, out any strides
    if indices.device.type == "cpu":
        ctx.check()
        ids.copy_(a)
        ctx.run()
        out.copy_(staging)
        ctx.check()
        return
    if not capturing():
        ctx.check()
    ids.copy_(a, non_blocking=True)
    _launcher()(torch.cuda.current_stream().cuda_stream, host_fn_address(), ctx.address)
    out.copy_(staging, non_blocking=True)


def check_embedding(emb):
    """Raise what the host nodes of this embedding's contexts recorded (an eager lookup's check)."""
    ctxs = emb.__dict__.get("_graph_contexts")
    if ctxs:
        for _, _, ctx in ctxs.values():
            ctx.check()


def check_errors():
    """Raise the first error a host node recorded since the last check, of any context."""
    with _contexts_lock:
        ctxs = list(_contexts)
    for ctx in ctxs:
        ctx.check()


def patch_replay(B):
    """BreakableCUDAGraphWrapper._replay (every replay of vLLM's breakable graphs, FULL ones
    included) first raises what the plugin's host nodes recorded: the eager check of FULL mode."""
    W = B.BreakableCUDAGraphWrapper
    original = W._replay
    if getattr(original, "_engram_stream", False):
        return

    def _replay(self, *args, **kwargs):
        if _contexts:
            check_errors()
        return original(self, *args, **kwargs)

    _replay._engram_stream = True
    W._replay = _replay
