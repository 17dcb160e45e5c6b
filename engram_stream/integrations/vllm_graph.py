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
pinned staging, a device ids buffer, the C view of the row source, scratch, the error slot) is
made per (tokens, out dtype, ids dtype) and kept for the embedding's life: a captured graph holds its addresses. A read that
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

_contexts = []          # every HostLookup made (checked at each eager check); they live as long as the process
_contexts_lock = threading.Lock()


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


# ---- the CUDA driver calls ----------------------------------------------------------------------
class _Driver:
    """The few CUDA driver calls of the stream-ordered lookup, through libcuda.so.1 (ctypes: no
    CUDA toolkit at build time; the driver is there wherever torch runs CUDA). The current
    context is the one torch's runtime made current on this thread (its primary context)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        P, S, U = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self._f = {}
        for name, args in (("cuMemHostAlloc", [ctypes.POINTER(P), S, U]),
                           ("cuMemcpyDtoHAsync_v2", [P, ctypes.c_uint64, S, P]),
                           ("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, P, S, P]),
                           ("cuLaunchHostFunc", [P, P, P]),
                           ("cuThreadExchangeStreamCaptureMode", [ctypes.POINTER(ctypes.c_int)])):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
            self._f[name] = f

    def _call(self, name, *args):
        rc = self._f[name](*args)
        if rc != 0:
            raise RuntimeError(f"engram_stream: the CUDA driver's {name} failed with CUresult {rc}")

    def host_alloc(self, nbytes):
        """Pinned, portable host memory (never freed: a graph may name it for the process's life).
        Allowed during a stream capture: the thread's capture mode is relaxed around it."""
        p = ctypes.c_void_p()
        mode = ctypes.c_int(2)                     # CU_STREAM_CAPTURE_MODE_RELAXED
        self._call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
        try:
            self._call("cuMemHostAlloc", ctypes.byref(p), max(int(nbytes), 1), 0x01)   # PORTABLE
        finally:
            self._call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
        return p.value

    def d2h(self, dst, src, nbytes, stream):
        self._call("cuMemcpyDtoHAsync_v2", dst, src, nbytes, stream)

    def h2d(self, dst, src, nbytes, stream):
        self._call("cuMemcpyHtoDAsync_v2", dst, src, nbytes, stream)

    def host_func(self, stream, fn, data):
        self._call("cuLaunchHostFunc", stream, fn, data)


_driver = None


def driver():
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def _pinned_array(shape, dtype):
    """A numpy array over pinned host memory (driver().host_alloc)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    p = driver().host_alloc(nbytes)
    return np.frombuffer((ctypes.c_uint8 * max(nbytes, 1)).from_address(p), np.uint8)[:nbytes].view(dtype).reshape(shape)


# ---- the stream-ordered lookup -----------------------------------------------------------------
def _context(emb, T, out, ids_dtype):
    """The embedding's context of T tokens into out's dtype, made once and kept (a captured
    graph names its buffers): (pinned ids, pinned staging, HostLookup, device ids, device out or
    None). On CPU tensors (tests) the host buffers are plain memory and there are no device ones."""
    import torch
    key = (T, out.dtype, ids_dtype)
    ctxs = emb.__dict__.setdefault("_graph_contexts", {})
    got = ctxs.get(key)
    if got is not None:
        return got
    k = emb.part_n_hash_cols
    np_ids = np.int64 if ids_dtype == torch.int64 else np.int32
    np_st = np.uint8 if out.dtype == torch.uint8 else np.uint16
    cuda = out.device.type == "cuda"
    ids = _pinned_array((T, k), np_ids) if cuda else np.empty((T, k), np_ids)
    staging = _pinned_array(tuple(out.shape), np_st) if cuda else np.empty(tuple(out.shape), np_st)
    ids.fill(-1)
    staging.fill(0)
    ctx = HostLookup(emb.source, ids, staging, emb.vocab_start_idx, emb.vocab_end_idx, 0.0)
    dev_ids = torch.empty((T, k), dtype=ids_dtype, device=out.device) if cuda else None
    got = ctxs[key] = (ids, staging, ctx, dev_ids)
    with _contexts_lock:
        _contexts.append(ctx)
    return got


def stream_lookup(emb, indices, out):
    """out <- the rows of indices (as the plugin's lookup) as stream-ordered work on the current
    stream: the ids' copy to pinned memory, the host node, the staging's copy to `out`.
    Captured, a graph replays all three on the replay's ids. On CPU tensors the host function
    runs here, between the copies (the tests' stand-in for the stream)."""
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
    ids, staging, ctx, dev_ids = _context(emb, T, out, ids_dtype)
    st = torch.from_numpy(staging)
    if out.dtype == torch.bfloat16:
        st = st.view(torch.bfloat16)
    if indices.device.type == "cpu":
        ctx.check()
        torch.from_numpy(ids).copy_(a)
        ctx.run()
        out.copy_(st)
        ctx.check()
        return
    if not capturing():
        ctx.check()
    d = driver()
    stream = torch.cuda.current_stream().cuda_stream
    dev_ids.copy_(a)                                          # this rank's columns, contiguous, on the device
    d.d2h(ids.ctypes.data, dev_ids.data_ptr(), ids.nbytes, stream)
    d.host_func(stream, host_fn_address(), ctx.address)
    if out.is_contiguous():
        d.h2d(out.data_ptr(), staging.ctypes.data, staging.nbytes, stream)
    else:
        raise ValueError("lookup: a captured lookup needs a contiguous out (vLLM's staged rows are)")


def check_embedding(emb):
    """Raise what the host nodes of this embedding's contexts recorded (an eager lookup's check)."""
    ctxs = emb.__dict__.get("_graph_contexts")
    if ctxs:
        for entry in ctxs.values():
            entry[2].check()


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
