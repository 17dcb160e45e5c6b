"""The vLLM plugin on a CUDA GPU against vLLM 0.33.0's own Engram embedding (issue 39).

Skipped, before torch is imported, where there is no CUDA driver (the suite's CPU run collects
it as skipped in milliseconds); tests/gpu/README.md says what a bare CUDA machine needs and the
command. On a GPU:

  * eager lookups: vLLM's own lookup kernel with its table in GPU memory and in pinned host
    memory (UVA; vLLM's cpu_offload) and the plugin's, every local source, bf16 and records,
    background (the lanes) and not, byte for byte;
  * a decode loop of a dozen steps with the main stream busy (a queue of matmuls before each
    step's ids exist), the lookup on vLLM's prefetch stream as Engram._start_prefetch runs it;
  * a FULL CUDA graph capture (torch.cuda.graph, and vLLM's own BreakableCUDAGraphCapture in
    FULL mode driving vLLM's Engram._start_prefetch / _finish_prefetch) of the plugin's
    lookup, replayed on new ids: every replay serves the replay's rows (the issue: a capture
    of the lanes would replay the capture-time rows);
  * timings of the lookup (prepare + embed) for 1..2048 tokens: the plugin cold and warm, and
    vLLM's own lookup (GPU table and UVA), printed and written to $ENGRAM_STREAM_GPU_TIMINGS
    (a JSON file) when set. Timings assert nothing;
  * LongCat-Flash-Lite's n-gram embedding (vLLM's NgramEmbedding): embed_batched of the plugin's
    module (no table in GPU memory) gives the bytes of vLLM's with its table on the GPU.
"""
from __future__ import annotations

import ctypes
import json
import os
import time
import types

import numpy as np
import pytest

try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    pytest.skip("no CUDA driver (libcuda.so.1): the GPU suite runs on a CUDA machine (tests/gpu/README.md)",
                allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is false: the GPU suite runs on a CUDA machine", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM 0.33.0's .py files are needed (tests/gpu/README.md)")

from helpers.models import make_v41_model  # noqa: E402
from helpers.row_sources import PLUGIN_SOURCES  # noqa: E402

plugin = pytest.importorskip("engram_stream.integrations.vllm")
from engram_stream.integrations import serving, vllm_graph  # noqa: E402

DEV = torch.device("cuda", 0)
SOURCES = PLUGIN_SOURCES


@pytest.fixture(scope="module")
def E():
    plugin.register()
    import vllm.models.deepseek_v41.common.engram as E
    return E


def uva_view(t):
    """A device view of pinned host tensor t (vLLM's get_accelerator_view_from_cpu_tensor is a
    vllm._C op, absent from the .py files): cupy's cudaHostGetDevicePointer."""
    import cupy
    nbytes = t.numel() * t.element_size()
    dptr = cupy.cuda.runtime.hostGetDevicePointer(t.data_ptr(), 0)
    mem = cupy.cuda.UnownedMemory(dptr, nbytes, t)
    arr = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=DEV).view(t.dtype).view(t.shape)


@pytest.fixture
def env(E, monkeypatch):
    """vLLM's engram module on one GPU process: TP 1, DP 1, a current VllmConfig stand-in."""
    from vllm.config.engram import EngramConfig
    st = types.SimpleNamespace(extra={}, model=None, offload=False)
    monkeypatch.setattr(E, "get_engram_dp_size", lambda: 1)
    monkeypatch.setattr(E, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(E, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(E, "get_accelerator_view_from_cpu_tensor", uva_view)
    config = lambda: types.SimpleNamespace(  # noqa: E731
        engram_config=EngramConfig(cpu_offload=st.offload), model_config=types.SimpleNamespace(model=st.model),
        additional_config=st.extra, scheduler_config=types.SimpleNamespace(max_num_batched_tokens=4096),
        lora_config=None)
    monkeypatch.setattr(E, "get_current_vllm_config", config)
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setattr(plugin, "_serving", False)
    monkeypatch.setattr(serving, "_models", {})
    return st


def layout_of(E, path):
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["engram_pad_token_id"] = cfg["engram_pad_id"]
    return E.EngramLayout(types.SimpleNamespace(**cfg))


def stock(E, path, layout, offload):
    """vLLM's own embeddings (table on the GPU, or pinned host memory read by UVA), filled by
    vLLM's loader."""
    import glob
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    embs, params = {}, {}
    with torch.device("cpu" if offload else DEV):
        for i, L in enumerate(layout.layer_ids):
            sizes = tuple(p for order in layout.primes[i] for p in order)
            embs[L] = E.ParallelEngramEmbedding(layout.num_embeddings[i], layout.head_dim, sizes, cpu_offload=offload)
    for L, emb in embs.items():
        params[f"layers.{L}.engram.embed.weight"] = emb.weight
        params[f"layers.{L}.engram.embed.scale"] = emb.weight_scale_inv
    for name, tensor in safetensors_weights_iterator(sorted(glob.glob(os.path.join(path, "*.safetensors"))), False):
        if name in params:
            params[name].weight_loader(params[name], tensor)
    return embs


def mine(E, env, path, layout, settings, offload=True):
    env.model, env.offload = path, offload
    env.extra = {plugin.KEY: settings}
    return {L: E.Engram._create_embedding(None, layout, i) for i, L in enumerate(layout.layer_ids)}


def hash_ids(layout, i, T, rng):
    """int32 [T, columns] on the GPU as vLLM's hashes (a strided slice; -1s; repeats)."""
    sizes = np.array([p for order in layout.primes[i] for p in order])
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    h = off + rng.integers(0, sizes, (T, len(sizes)))
    h[rng.random(h.shape) < 0.1] = -1
    h[T // 2:T // 2 + 3] = h[0]
    full = np.full((T, 2, len(sizes)), -7, np.int32)
    full[:, 1] = h
    return torch.from_numpy(full).to(DEV)[:, 1]


def out_for(emb, T, dtype):
    return torch.full((T, emb.part_n_hash_cols, 264 if dtype == torch.uint8 else 256), 3, dtype=dtype, device=DEV)


def run_lookup(emb, ids, dtype, background=False):
    o = out_for(emb, ids.shape[0], dtype)
    emb.lookup(ids, o, background=background)
    if hasattr(emb, "wait"):
        emb.wait()
    torch.cuda.synchronize()
    return o


def forward(mode):
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context
    return override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                                                   cudagraph_runtime_mode=getattr(CUDAGraphMode, mode)))


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """A V4.1 folder with the 264-byte record and its copy with the packed row file."""
    import shutil
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    d = tmp_path_factory.mktemp("gpu")
    path = str(d / "v41")
    make_v41_model(seed=11, nh=3, hd=256, D=32, evs=5003).save(path)
    rows = str(d / "v41-rows")
    shutil.copytree(path, rows)
    packed.pack_rows(EngramModel.from_deepseek_v41(rows), packed.rows_path(rows))
    return {"plain": path, "rows": rows}


# ---- eager lookups -------------------------------------------------------------------------------
@pytest.mark.parametrize("table", ["gpu", "uva"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_eager_lookups_give_vllms_bytes(E, env, flash, source, table):
    path = flash["rows" if "packed" in source else "plain"]
    layout = layout_of(E, path)
    ref = stock(E, path, layout, offload=table == "uva")
    embs = mine(E, env, path, layout, SOURCES[source])
    rng = np.random.default_rng(1)
    for i, L in enumerate(layout.layer_ids):
        for T in (1, 16, 300, 2048):
            ids = hash_ids(layout, i, T, rng)
            for dtype in (torch.uint8, torch.bfloat16):
                want = run_lookup(ref[L], ids, dtype)
                for background in (False, True):
                    for _ in ("cold", "warm"):
                        got = run_lookup(embs[L], ids, dtype, background)
                        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (source, table, L, T, dtype)
                with forward("FULL"):       # the stream-ordered path, eagerly
                    got = run_lookup(embs[L], ids, dtype, True)
                assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (source, table, L, T, dtype, "FULL")


def busy(n=24):
    """Queue ~tens of ms of matmuls on the current stream."""
    a = torch.randn(2048, 2048, device=DEV)
    for _ in range(n):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_a_decode_loop_with_the_main_stream_busy(E, env, flash, mode):
    """12 decode steps of 8..40 tokens: each step's ids come out of the busy main stream (so the
    ids' copy must wait for it), the lookup runs on a prefetch stream as Engram._start_prefetch
    runs it, embed waits as _finish_prefetch does; every step gives vLLM's rows."""
    path = flash["plain"]
    layout = layout_of(E, path)
    ref = stock(E, path, layout, offload=False)
    embs = mine(E, env, path, layout, {"tables": "direct", "row_cache_mb": 8})
    rng = np.random.default_rng(2)
    side = torch.cuda.Stream(device=DEV)
    staged = {L: torch.empty(64, e.part_n_hash_cols, 256, dtype=torch.bfloat16, device=DEV) for L, e in embs.items()}
    with forward(mode):
        for step in range(12):
            T = int(rng.integers(8, 41))
            host = [hash_ids(layout, i, T, rng) for i in range(len(layout.layer_ids))]
            want = [run_lookup(ref[L], host[i], torch.bfloat16) for i, L in enumerate(layout.layer_ids)]
            x = busy()
            dep = (x.sum() * 0).nan_to_num(0, 0, 0).to(torch.int32)      # 0, ready only after the matmuls
            ids = [h + dep for h in host]
            done = []
            for i, L in enumerate(layout.layer_ids):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    embs[L].lookup(ids[i], staged[L][:T], background=True)
                ev = torch.cuda.Event()
                ev.record(side)
                done.append(ev)
            for i, L in enumerate(layout.layer_ids):
                embs[L].wait()
                torch.cuda.current_stream().wait_event(done[i])
                got = staged[L][:T].clone()
                torch.cuda.synchronize()
                assert torch.equal(want[i].view(torch.int16), got.view(torch.int16)), (mode, step, L)


# ---- FULL graphs (the issue) ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("source", ["mapped+cache", "direct", "packed row file+cache"])
def test_a_full_graph_capture_replays_new_ids(E, env, flash, source, dtype):
    """torch.cuda.graph captures the plugin's lookup (FULL mode: stream-ordered) on a static ids
    buffer; each replay after new ids are copied in gives vLLM's rows of the new ids."""
    path = flash["rows" if "packed" in source else "plain"]
    layout = layout_of(E, path)
    ref = stock(E, path, layout, offload=False)
    embs = mine(E, env, path, layout, SOURCES[source])
    rng = np.random.default_rng(3)
    L = layout.layer_ids[0]
    m = embs[L]
    for T in (1, 8, 96):
        static_ids = hash_ids(layout, 0, T, rng).contiguous()
        static_out = out_for(m, T, dtype)
        with forward("FULL"):
            s = torch.cuda.Stream(device=DEV)
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):                  # warm up (as torch's docs ask)
                m.lookup(static_ids, static_out, background=True)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                assert vllm_graph.capturing() and vllm_graph.lookup_path() == "stream"
                m.lookup(static_ids, static_out, background=True)
        assert m._lanes is None
        for _ in range(6):
            new = hash_ids(layout, 0, T, rng)
            busy(4)
            static_ids.copy_(new)
            g.replay()
            got = static_out.clone()
            torch.cuda.synchronize()
            want = run_lookup(ref[L], new, dtype)
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (source, T, dtype)
        vllm_graph.check_embedding(m)


def test_vllms_breakable_full_capture_of_the_prefetch_replays_new_ids(E, env, flash):
    """vLLM's own BreakableCUDAGraphCapture in FULL mode around vLLM's Engram._start_prefetch /
    _finish_prefetch (cpu_offload: the prefetch stream): no eager break, one graph; replays on
    new ids give vLLM's rows of the new ids."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    path = flash["plain"]
    layout = layout_of(E, path)
    ref = stock(E, path, layout, offload=False)
    embs = mine(E, env, path, layout, {"tables": "direct", "row_cache_mb": 8})
    rng = np.random.default_rng(4)
    L = layout.layer_ids[0]
    T = 32
    layer = types.SimpleNamespace(embed_tokens=embs[L], _prefetch_stream=torch.cuda.Stream(device=DEV),
                                  _prefetch_done=torch.cuda.Event())
    static_ids = hash_ids(layout, 0, T, rng).contiguous()
    rows = torch.empty(T, embs[L].part_n_hash_cols, 256, dtype=torch.bfloat16, device=DEV)
    out = torch.empty_like(rows)

    def step():
        E.Engram._start_prefetch(layer, static_ids, rows)
        E.Engram._finish_prefetch(layer, layer._prefetch_done)
        out.copy_(rows)

    main = torch.cuda.Stream(device=DEV)        # a capture needs a stream other than the default one
    main.wait_stream(torch.cuda.current_stream())
    with forward("FULL"), torch.cuda.stream(main):
        step()
        torch.cuda.synchronize()
        with BreakableCUDAGraphCapture() as cap:
            step()
    assert cap.num_eager_breaks == 0 and cap.num_graphs == 1
    torch.cuda.synchronize()
    for _ in range(6):
        new = hash_ids(layout, 0, T, rng)
        static_ids.copy_(new)
        torch.cuda.synchronize()
        with torch.cuda.stream(main):
            busy(4)
            cap.replay()
            got = out.clone()
        torch.cuda.synchronize()
        assert torch.equal(run_lookup(ref[L], new, torch.bfloat16).view(torch.int16), got.view(torch.int16))


# ---- timings -------------------------------------------------------------------------------------
def timed(fn, reps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def test_timings_of_prepare_and_embed(E, env, flash):
    """Seconds per lookup (prepare + embed of one layer) for 1..2048 tokens: the plugin's lanes
    (cold: a fresh model and cache; warm: the same ids again), its stream-ordered path (FULL
    mode, eager), and vLLM's own kernel with the table on the GPU and in pinned host memory."""
    path = flash["plain"]
    layout = layout_of(E, path)
    refs = {"vllm gpu table": stock(E, path, layout, offload=False),
            "vllm uva table": stock(E, path, layout, offload=True)}
    L = layout.layer_ids[0]
    rng = np.random.default_rng(5)
    rows = {}
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        ids = hash_ids(layout, 0, T, rng)
        r = {}
        for name, ref in refs.items():
            o = out_for(ref[L], T, torch.bfloat16)
            r[name] = timed(lambda: ref[L].lookup(ids, o), 20)
        for settings in ({"tables": "mapped", "row_cache_mb": 8}, {"tables": "direct", "row_cache_mb": 8}):
            tag = settings["tables"]
            m = mine(E, env, path, layout, settings)[L]
            o = out_for(m, T, torch.bfloat16)

            def lanes():
                m.lookup(ids, o, background=True)
                m.wait()

            r[f"plugin {tag} cold"] = timed(lanes, 1)
            r[f"plugin {tag} warm"] = timed(lanes, 20)
            with forward("FULL"):
                m.lookup(ids, o, background=True)       # its context made (pinned buffers)
                r[f"plugin {tag} stream"] = timed(lambda: m.lookup(ids, o, background=True), 20)
            serving._models.clear()
        rows[T] = r
    names = list(rows[1])
    print("\ntokens " + " | ".join(names))
    for T, r in rows.items():
        print(f"{T:6d} " + " | ".join(f"{r[n] * 1e6:9.1f}us" for n in names))
    if os.environ.get("ENGRAM_STREAM_GPU_TIMINGS"):
        with open(os.environ["ENGRAM_STREAM_GPU_TIMINGS"], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "seconds": rows}, f, indent=1)


# ---- LongCat-Flash-Lite's n-gram table -------------------------------------------------------------
def test_longcat_embed_batched_gives_vllms_bytes_on_the_gpu(tmp_path, monkeypatch):
    """vLLM's NgramEmbedding on the GPU (its table in GPU memory, filled by vLLM's loader) and the
    plugin's (no table; rows from each local source, copied to the GPU): embed_batched gives the
    same bytes for the same device ids (tests/integrations/test_vllm_longcat.py's ids, EOS
    positions included), and the plugin's module allocates no table in GPU memory."""
    import sys
    import vllm.config
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    monkeypatch.setattr(sys, "path", [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integrations")]
                        + sys.path)
    import test_vllm_longcat as lc
    from engram_stream import EngramConfig, EngramModel
    plugin.register()
    import vllm.model_executor.models.longcat_flash_ngram as M
    st = types.SimpleNamespace(model=None)
    monkeypatch.setattr(V, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(V, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=st.model), additional_config={}))
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setattr(plugin, "_serving", False)
    folder = str(EngramModel.init(EngramConfig.from_hf_config(lc.HF), seed=4).save(tmp_path / "lc",
                                                                                   table_dtype="bfloat16"))
    cfg = lc.framework_config()
    reqs = lc.batch(cfg, np.random.default_rng(5))
    input_ids = torch.from_numpy(np.concatenate(reqs)).to(DEV)
    oe_ids = lc.kernel_ids(cfg, reqs).to(DEV)
    with torch.device(DEV):
        stock_m = lc.build(M, cfg)
    lc.load(stock_m, folder)
    want = stock_m.embed_batched(input_ids, oe_ids)
    for settings in lc.SOURCES.values():
        st.model = folder
        monkeypatch.setenv(plugin.ENV, json.dumps(settings))
        monkeypatch.setattr(serving, "_models", {})
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.device(DEV):
            mine_m = lc.build(M, cfg)
        emb = mine_m.oe_embedder
        assert not list(emb.parameters()) and emb.weight.device.type == "meta"
        table_bytes = emb.org_vocab_size * emb.embedding_dim * 2
        assert torch.cuda.memory_allocated() - before < table_bytes   # projections and embedding only
        lc.load(mine_m, folder)
        for _ in range(2):
            got = mine_m.embed_batched(input_ids, oe_ids)
            assert got.device == want.device
            lc.same_bytes(got, want)
        monkeypatch.delenv(plugin.ENV)
