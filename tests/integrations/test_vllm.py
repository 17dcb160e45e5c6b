"""The vLLM plugin (engram_stream.integrations.vllm) against vLLM 0.33.0's own Engram embedding,
on CPU: vLLM's Triton lookup kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors, with cpu_offload=False and stubs for the tensor-parallel rank and the device queries.

vLLM's stock ParallelEngramEmbedding is filled by vLLM's own loader (safetensors_weights_iterator
and the parameters' weight_loader) from a tiny V4.1 checkpoint; the plugin's embedding (made by
vLLM's Engram._create_embedding, patched by register()) reads the same checkpoint through each
row source (Mooncake: the real test servers, marked `mooncake`). Both lookups must give the same
bytes: uint8 records and bf16 rows, cold and warm, in the background (the lanes) and not,
-1 ids, ids outside the rank's rows, repeated rows, padded heads of a TP shard. The e4m3 NaN
codes and the e8m0 bytes 0 and 255, where vLLM's kernel, Triton's interpreter and engram_stream's
dequantization differ, are pinned in a test of their own. Skipped without vLLM (tools/ci_vllm.sh
installs it)."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import types

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: vLLM's kernels on CPU
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (tools/ci_vllm.sh installs vllm==0.33.0)")
pytest.importorskip("triton")

from engram_stream import EngramModel  # noqa: E402
from engram_stream.rows import packed  # noqa: E402
from engram_stream.v41 import reference as v41_reference  # noqa: E402

from helpers.row_sources import PLUGIN_SOURCES  # noqa: E402

plugin = pytest.importorskip("engram_stream.integrations.vllm")
from engram_stream.integrations import serving  # noqa: E402

SOURCES = PLUGIN_SOURCES


@pytest.fixture(scope="module")
def E():
    import vllm.models.deepseek_v41.common.engram as E
    return E


@pytest.fixture
def vllm_env(E, monkeypatch):
    """vLLM's engram module on one CPU process: TP world `tp` (set by .tp/.rank), DP size 1, a
    device with 4 SMs, and a current VllmConfig with cpu_offload=False and additional_config."""
    from vllm.config.engram import EngramConfig
    st = types.SimpleNamespace(tp=1, rank=0, extra={}, model=None, offload=False)
    monkeypatch.setattr(E, "get_engram_dp_size", lambda: 1)
    monkeypatch.setattr(E, "get_tensor_model_parallel_world_size", lambda: st.tp)
    monkeypatch.setattr(E, "get_tensor_model_parallel_rank", lambda: st.rank)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    config = lambda: types.SimpleNamespace(  # noqa: E731
        engram_config=EngramConfig(cpu_offload=st.offload), model_config=types.SimpleNamespace(model=st.model),
        additional_config=st.extra, scheduler_config=types.SimpleNamespace(max_num_batched_tokens=512),
        lora_config=None)
    monkeypatch.setattr(E, "get_current_vllm_config", config)
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    for mod in (linear, parameter):  # the Engram's wkv (a ColumnParallelLinear) on TP 1
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1, raising=False)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0, raising=False)
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    monkeypatch.setattr(plugin, "_serving", False)
    monkeypatch.setattr(serving, "_models", {})
    return st


def layout_of(E, path):
    """vLLM's EngramLayout from the checkpoint's config.json."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["engram_pad_token_id"] = cfg["engram_pad_id"]
    return E.EngramLayout(types.SimpleNamespace(**cfg))


def stock_embeddings(E, path, layout):
    """vLLM's own embeddings of every layer, filled by vLLM's loader from the checkpoint."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    embs = {}
    for i, L in enumerate(layout.layer_ids):
        sizes = tuple(p for order in layout.primes[i] for p in order)
        embs[L] = E.ParallelEngramEmbedding(layout.num_embeddings[i], layout.head_dim, sizes, cpu_offload=False)
    params = {}
    for L, emb in embs.items():
        params[f"layers.{L}.engram.embed.weight"] = emb.weight
        params[f"layers.{L}.engram.embed.scale"] = emb.weight_scale_inv
    loaded = set()
    for name, tensor in safetensors_weights_iterator(sorted(glob.glob(os.path.join(path, "*.safetensors"))), False):
        if name in params:
            params[name].weight_loader(params[name], tensor)
            loaded.add(name)
    assert loaded == set(params)
    return embs


def plugin_embeddings(E, layout):
    return {L: E.Engram._create_embedding(None, layout, i) for i, L in enumerate(layout.layer_ids)}


def hash_ids(layout, i, T, rng):
    """int32 [T, layers, columns] as vLLM's hashes: each column's rows in its head's range, some
    -1 (DEAD) and rows repeated across tokens."""
    sizes = np.array([p for order in layout.primes[i] for p in order])
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    h = off + rng.integers(0, sizes, (T, len(sizes)))
    h[rng.random(h.shape) < 0.1] = -1
    h[T // 2:T // 2 + 3] = h[0]
    full = np.full((T, 2, len(sizes)), -7, np.int32)
    full[:, 1] = h
    return torch.from_numpy(full)[:, 1]  # the strided [T, columns] slice vLLM passes


def both_lookups(stock, mine, ids, part, dtype):
    return lookup(stock, ids, part, dtype), lookup(mine, ids, part, dtype)


def configure(st, monkeypatch, path, how, settings):
    st.model = path
    if how == "env":
        monkeypatch.setenv(plugin.ENV, json.dumps(settings))
    else:
        st.extra = {plugin.KEY: settings}


@pytest.fixture(scope="module")
def expected(E, plugin_checkpoints):
    """{path: (layout, {layer: table bytes}, [(layer, ids, dtype, vLLM's out)])}: the calls and
    what vLLM's stock embeddings give (the interpreter is slow: run once per checkpoint)."""
    from _pytest.monkeypatch import MonkeyPatch
    mp = MonkeyPatch()
    mp.setattr(E, "get_engram_dp_size", lambda: 1)
    mp.setattr(E, "get_tensor_model_parallel_world_size", lambda: 1)
    mp.setattr(E, "get_tensor_model_parallel_rank", lambda: 0)
    mp.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=4))
    mp.setattr(torch.accelerator, "current_device_index", lambda: 0)
    out = {}
    try:
        for path in [plugin_checkpoints["plain"]]:  # the other folder is its copy (with the row file)
            layout = layout_of(E, path)
            stock = stock_embeddings(E, path, layout)
            rng = np.random.default_rng(1)
            calls = []
            for i, L in enumerate(layout.layer_ids):
                part = stock[L].part_n_hash_cols
                for T in (1, 16, 300):
                    ids = hash_ids(layout, i, T, rng)
                    for dtype in (torch.uint8, torch.bfloat16):
                        calls.append((L, ids, dtype, lookup(stock[L], ids, part, dtype)))
                calls.append((L, torch.full((4, stock[L].n_hash_cols), -1, dtype=torch.int32), torch.bfloat16, None))
            sizes = {L: e.weight.numel() + e.weight_scale_inv.numel() for L, e in stock.items()}
            out[path] = out[plugin_checkpoints["rows"]] = (layout, sizes, calls)
    finally:
        mp.undo()
    return out


def lookup(emb, ids, part, dtype):
    o = torch.full((ids.shape[0], part, 256 + 8 if dtype == torch.uint8 else 256), 3, dtype=dtype)
    emb.lookup(ids, o)
    return o


@pytest.mark.parametrize("source", list(SOURCES))
def test_plugin_lookup_gives_vllms_bytes(E, vllm_env, plugin_checkpoints, expected, monkeypatch, source):
    path = plugin_checkpoints["rows" if "packed" in source else "plain"]
    layout, table_bytes, calls = expected[path]
    configure(vllm_env, monkeypatch, path, "env" if "cache" in source else "additional_config", SOURCES[source])
    mine = plugin_embeddings(E, layout)
    for L, m in mine.items():
        assert isinstance(m, plugin.embedding_class()) and isinstance(m, E.ParallelEngramEmbedding)
        if "packed" in source:
            assert m.model.tier.inner.rows_path == packed.rows_path(path)
        own = sum(p.numel() * p.element_size() for p in list(m.parameters()) + list(m.buffers()))
        assert own < table_bytes[L] // 100
        assert not hasattr(m, "weight") and not hasattr(m, "weight_scale_inv")   # vLLM's meta table, dropped
    for L, ids, dtype, want in calls:
        m = mine[L]
        for _ in ("cold", "warm"):
            got = lookup(m, ids, m.part_n_hash_cols, dtype)
            if want is None:  # every id -1: zeros
                assert not got.view(torch.int16).any()
            else:
                assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (source, L, ids.shape, dtype)
    st = m.row_cache_stats()
    if SOURCES[source].get("row_cache_mb"):
        assert st["hits"] > 0 and st["misses"] > 0
    if SOURCES[source]["tables"] == "direct":
        assert st["reads"] > 0
    assert serving.stats()[os.path.realpath(path)]["layers"].keys() == set(layout.layer_ids)


@pytest.mark.mooncake
def test_plugin_lookup_from_mooncake_gives_vllms_bytes(E, vllm_env, plugin_checkpoints, expected, monkeypatch, tier, mooncake):
    """"mooncake": the rows from a real Mooncake Store (the session's test servers) the checkpoint
    was published to, behind the row cache: vLLM's bytes cold and warm, background and not."""
    path = plugin_checkpoints["plain"]
    layout, _, calls = expected[path]
    tier.publish(EngramModel.from_deepseek_v41(path))
    configure(vllm_env, monkeypatch, path, "env", {"tables": "mapped", "row_cache_mb": 0.2, "mooncake": {
        "master": mooncake.master, "metadata": mooncake.metadata, "local_host": "127.0.0.1"}})
    mine = plugin_embeddings(E, layout)
    for L, ids, dtype, want in calls:
        m = mine[L]
        for background in (False, True):
            got = torch.full((ids.shape[0], m.part_n_hash_cols, 264 if dtype == torch.uint8 else 256), 3, dtype=dtype)
            m.lookup(ids, got, background=background)
            m.wait()
            if want is None:
                assert not got.view(torch.int16).any()
            else:
                assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (L, ids.shape, dtype)
    st = serving.stats()[os.path.realpath(path)]
    assert st["fetches"] > 0 and st["misses"] > 0 and st["hits"] > 0


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_give_vllms_bytes(E, vllm_env, plugin_checkpoints, monkeypatch, rank):
    """TP 2 of 9 columns: rank 0 heads 0..4, rank 1 heads 5..8 and a padded head (zeros); ids of
    the other rank's rows read zeros."""
    path = plugin_checkpoints["plain"]
    vllm_env.tp, vllm_env.rank = 2, rank
    layout = layout_of(E, path)
    stock = stock_embeddings(E, path, layout)
    configure(vllm_env, monkeypatch, path, "env", {"tables": "direct", "row_cache_mb": 0.2})
    mine = plugin_embeddings(E, layout)
    rng = np.random.default_rng(2 + rank)
    for i, L in enumerate(layout.layer_ids):
        m = mine[L]
        assert (m.head_start, m.part_n_hash_cols, m.vocab_start_idx, m.vocab_end_idx) == \
            (stock[L].head_start, stock[L].part_n_hash_cols, stock[L].vocab_start_idx, stock[L].vocab_end_idx)
        ids = hash_ids(layout, i, 40, rng)
        ids[::3] = torch.from_numpy(np.roll(ids[::3].numpy(), 4, axis=1))  # other heads' rows: out of shard
        for dtype in (torch.uint8, torch.bfloat16):
            a, b = both_lookups(stock[L], m, ids, m.part_n_hash_cols, dtype)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        if rank == 1:
            assert not b[:, -1].view(torch.int16).any()  # the padded head


def engram_layer(E, path, layout, i):
    """vLLM's Engram module of layout.layer_ids[i] (no quantization config: wkv a bf16
    ColumnParallelLinear holding the checkpoint's wkv dequantized), its other weights from the
    checkpoint; its embedding whatever Engram._create_embedding makes."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    L = layout.layer_ids[i]
    cfg = json.load(open(os.path.join(path, "config.json")))
    c = types.SimpleNamespace(**cfg, hidden_size=cfg["dim"], rms_norm_eps=cfg["norm_eps"])
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM builds a bf16 model
    try:
        layer = E.Engram(c, None, layout, i, False, f"layers.{L}.engram")
    finally:
        torch.set_default_dtype(dtype)
    t = {n[len(f"layers.{L}.engram."):]: w for n, w in
         safetensors_weights_iterator(sorted(glob.glob(os.path.join(path, "*.safetensors"))), False)
         if n.startswith(f"layers.{L}.engram.")}
    w = t["wkv.weight"].view(torch.uint8).numpy()
    sc = np.repeat(np.repeat(v41_reference.e8m0(t["wkv.scale"].view(torch.uint8).numpy()), 32, 0), 32, 1)
    layer.wkv.weight.data.copy_(torch.from_numpy(v41_reference.e4m3(w) * sc[:w.shape[0], :w.shape[1]]))
    layer.q_weight.data.copy_(t["q_weight"])
    layer.k_weight.data.copy_(t["k_weight"])
    if type(layer.embed_tokens) is E.ParallelEngramEmbedding:
        layer.embed_tokens.weight.data.copy_(t["embed.weight"])
        layer.embed_tokens.weight_scale_inv.data.copy_(t["embed.scale"].view(torch.uint8))
    return layer


def test_a_whole_engram_layer_is_the_same_with_the_plugin(E, vllm_env, plugin_checkpoints, monkeypatch):
    """vLLM's Engram layer with vLLM's embedding and with the plugin's: prepare_embeddings (the
    staging rows), embed() and the wkv projection, as Engram.forward runs them, give the same
    bits. The fused gate kernel after wkv (_fused_engram_post_wkv_kernel) does not run in
    Triton's interpreter (a scalar & block load mask: "mask has unsupported dtype"); its inputs
    are equal, and its output is vLLM's own on both sides."""
    path = plugin_checkpoints["plain"]
    layout = layout_of(E, path)
    rng = np.random.default_rng(9)
    T = 20
    hashes = [hash_ids(layout, i, T, rng) for i in range(len(layout.layer_ids))]
    outs = {}
    for how in ("vllm", "plugin"):
        if how == "plugin":
            configure(vllm_env, monkeypatch, path, "env", {"tables": "direct", "row_cache_mb": 0.2})
        outs[how] = []
        for i in range(len(layout.layer_ids)):
            layer = engram_layer(E, path, layout, i)
            assert isinstance(layer.embed_tokens, plugin.embedding_class()) == (how == "plugin")
            layer.prepare_embeddings(hashes[i])
            outs[how].append(layer.wkv(layer.embed(hashes[i]).flatten(-2)))
    for a, b in zip(outs["vllm"], outs["plugin"]):
        assert a.dtype == torch.bfloat16 and a.shape == (T, 3 * 32) and a.abs().sum() > 0
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


class FakeStreams:
    """torch.cuda's streams and events as vLLM's prefetch path uses them, on CPU: they record
    which calls were made (the CPU runs everything in order, so they need do nothing)."""

    def __init__(self, monkeypatch):
        self.calls = []
        fake = self

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                fake.calls.append("wait_stream")

            def wait_event(self, event):
                fake.calls.append("wait_event")

        class Event:
            def record(self, stream=None):
                fake.calls.append("record")

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)


class Gate:
    """Holds every lane's fill of an embedding until opened: what ran while it was closed ran
    before any row was read."""

    def __init__(self, emb, monkeypatch):
        self.event, self.entered, self.background = threading.Event(), threading.Semaphore(0), []
        fill, lookup = type(emb)._fill.__get__(emb), type(emb).lookup.__get__(emb)

        def gated_fill(*args):
            self.entered.release()
            assert self.event.wait(30), "the gate was never opened"
            return fill(*args)

        def recording_lookup(indices, out, background=False):
            self.background.append(background)
            return lookup(indices, out, background)

        monkeypatch.setattr(emb, "_fill", gated_fill)
        monkeypatch.setattr(emb, "lookup", recording_lookup)


def test_a_background_lookup_returns_before_its_rows_are_read(E, vllm_env, plugin_checkpoints, expected, monkeypatch):
    """lookup(background=True) hands the rows to the lanes and returns; wait() gives vLLM's bytes.
    A 300-token lookup with a 64-token window: 5 windows over both lanes, each held at the gate
    until the lookup has returned."""
    path = plugin_checkpoints["plain"]
    layout, _, calls = expected[path]
    configure(vllm_env, monkeypatch, path, "env", {"tables": "direct", "row_cache_mb": 0.2})
    mine = plugin_embeddings(E, layout)
    for L, ids, dtype, want in calls:
        if want is None:
            continue
        m = mine[L]
        monkeypatch.setattr(m, "window", 64)
        gate = Gate(m, monkeypatch)
        out = torch.full(want.shape, 3, dtype=dtype)
        m.lookup(ids, out, background=True)
        windows = -(-ids.shape[0] // 64)
        assert len(m._pending) == windows
        assert gate.entered.acquire(timeout=30)       # a lane is reading (held) while we run
        assert torch.equal(out, torch.full(want.shape, 3, dtype=dtype))   # no row written yet
        gate.event.set()
        m.wait()
        assert not m._pending
        assert torch.equal(want.view(torch.uint8), out.view(torch.uint8)), (L, ids.shape, dtype)
    threads = {t.name for t in threading.enumerate()}
    assert any(n.startswith(f"engram-rows-L{L}") for n in threads for L in layout.layer_ids)


def test_a_background_read_error_is_raised_where_vllm_waits(E, vllm_env, plugin_checkpoints, expected, monkeypatch):
    path = plugin_checkpoints["plain"]
    layout, _, calls = expected[path]
    configure(vllm_env, monkeypatch, path, "env", {"tables": "direct"})
    m = plugin_embeddings(E, layout)[calls[0][0]]

    def failing(*args):
        raise OSError(5, "injected read error")

    monkeypatch.setattr(m, "_fill", failing)
    L, ids, dtype, want = calls[4]
    m.lookup(ids, torch.empty(want.shape, dtype=dtype), background=True)
    with pytest.raises(OSError, match="injected"):
        m.wait()
    m.wait()  # the error is raised once; nothing is left in flight


def vllms_own_projected_rows(E, path, T=20):
    """(layout, hashes, want): T tokens' hash ids for every Engram layer of the checkpoint and
    vLLM's own embedding of them (its table, no plugin) after the wkv projection, per layer."""
    layout = layout_of(E, path)
    rng = np.random.default_rng(9)
    hashes = [hash_ids(layout, i, T, rng) for i in range(len(layout.layer_ids))]
    want = []
    for i in range(len(layout.layer_ids)):
        layer = engram_layer(E, path, layout, i)
        layer.prepare_embeddings(hashes[i])
        want.append(layer.wkv(layer.embed(hashes[i]).flatten(-2)))
    return layout, hashes, want


def test_vllms_prefetch_path_waits_for_the_plugins_lanes(E, vllm_env, plugin_checkpoints, monkeypatch):
    """vLLM's Engram layers with cpu_offload (on CPU with stub streams): prepare_embeddings of
    every layer (Engram._start_prefetch: lookup(background=True)) returns while every layer's
    rows are still held at the gate; embed() (Engram._finish_prefetch, where vLLM waits) gives
    the rows of vLLM's own embedding, bit for bit, after the wkv projection."""
    path = plugin_checkpoints["plain"]
    layout, hashes, want = vllms_own_projected_rows(E, path)
    streams = FakeStreams(monkeypatch)
    vllm_env.offload = True
    configure(vllm_env, monkeypatch, path, "env", {"tables": "direct", "row_cache_mb": 0.2})
    layers = [engram_layer(E, path, layout, i) for i in range(len(layout.layer_ids))]
    gates = [Gate(layer.embed_tokens, monkeypatch) for layer in layers]
    for layer, h in zip(layers, hashes):
        assert layer._prefetch_stream is not None   # vLLM's offload path
        layer.prepare_embeddings(h)
    for g in gates:
        assert g.background == [True] and g.entered.acquire(timeout=30)
    assert streams.calls.count("record") == len(layers)
    for g in gates:
        g.event.set()
    for layer, h, w in zip(layers, hashes, want):
        got = layer.wkv(layer.embed(h).flatten(-2))
        assert not layer.embed_tokens._pending
        assert torch.equal(w.view(torch.int16), got.view(torch.int16))
    assert streams.calls.count("wait_event") == len(layers)
    assert E.Engram._finish_prefetch._engram_stream


def test_loader_skips_the_tables_only_when_serving(E, vllm_env, plugin_checkpoints, monkeypatch):
    from vllm.model_executor.model_loader import weight_utils
    path = plugin_checkpoints["plain"]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    names = lambda: {n for n, _ in weight_utils.safetensors_weights_iterator(files, False)}  # noqa: E731
    tables = {n for n in names() if plugin.TABLE_TENSOR.search(n)}
    assert len(tables) == 4
    layout = layout_of(E, path)
    assert type(plugin_embeddings(E, layout)[layout.layer_ids[0]]) is E.ParallelEngramEmbedding  # not configured
    assert names() >= tables
    configure(vllm_env, monkeypatch, path, "env", {"tables": "mapped"})
    plugin_embeddings(E, layout)
    assert not names() & tables and names()  # the rest is still read


def test_bad_settings_are_refused_with_the_value(E, vllm_env, plugin_checkpoints, monkeypatch):
    for bad, msg in (('{"tables": "ram"}', '"tables" must be'), ("[1]", "JSON object"), ("{", "not JSON"),
                     ('{"row_cache_mb": -1}', "row_cache_mb"), ('{"cache": 1}', "unknown keys"),
                     ('{"checkpoint": "/nonexistent"}', "is not a folder"),
                     ('{"mooncake": {"master": "x"}}', '"metadata"')):
        monkeypatch.setenv(plugin.ENV, bad)
        with pytest.raises(ValueError, match=msg):
            plugin.register()
    monkeypatch.setenv(plugin.ENV, '{"tables": "mapped"}')
    vllm_env.model = "deepseek-ai/DeepSeek-V4.1-Flash"  # a hub name, not a folder
    with pytest.raises(ValueError, match='give "checkpoint"'):
        plugin_embeddings(E, layout_of(E, plugin_checkpoints["plain"]))
    vllm_env.model = plugin_checkpoints["plain"]
    monkeypatch.setattr(serving, "cuda_available", lambda: True)  # cpu_offload=False on a CUDA machine: inline lookups
    with pytest.raises(ValueError, match="cpu_offload=true"):
        plugin_embeddings(E, layout_of(E, plugin_checkpoints["plain"]))


def test_vllm_finds_the_entry_point_and_it_is_inert_unconfigured(tmp_path, monkeypatch):
    """pyproject's entry point, as the installed package's metadata, is what vLLM's plugin loader
    finds and calls; without settings, vLLM's embedding is its own."""
    import sys
    import tomllib
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    meta = tomllib.load(open(os.path.join(root, "pyproject.toml"), "rb"))
    group = meta["project"]["entry-points"][DEFAULT_PLUGINS_GROUP]
    assert group == {"engram_stream": "engram_stream.integrations.vllm:register"}
    info = tmp_path / "engram_stream_test_metadata-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: engram-stream-test-metadata\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{DEFAULT_PLUGINS_GROUP}]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in group.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugin.ENV, raising=False)
    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert found["engram_stream"] is plugin.register
    found["engram_stream"]()
    assert sys.modules["vllm.models.deepseek_v41.common.engram"].Engram._create_embedding._engram_stream


# ---- the codes where vLLM's kernel, Triton's interpreter and engram_stream's oracle differ ----------
def test_another_vllm_version_is_refused_naming_the_supported_one(E, vllm_env, monkeypatch):
    """The embedding is built through vLLM's constructor and hooks its methods by name: a vLLM
    other than the one written against is refused when the class is made, naming both."""
    import vllm
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(plugin, "_embedding_class", None)
    with pytest.raises(RuntimeError, match=r"serves vLLM 0\.33\.0 .* this is vLLM 0\.34\.0: install vllm==0\.33\.0"):
        plugin.embedding_class()


@pytest.mark.native  # drives records_to_bf16 (C over raw pointers): CI's sanitizer stages select it
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf and NaN products, on purpose
def test_nan_codes_and_extreme_scales_are_pinned(E, vllm_env):
    """Every e4m3 code against the e8m0 bytes 0, 1, 2, 9, 10, 127, 200, 254, 255, through vLLM's
    kernel (interpreted) and the plugin's bf16 conversion:

    * e8m0 0: vLLM's kernel scales by the float of bits 0 << 23, +0.0, so a row is +-0; the
      checkpoint's value (engram_stream's oracle, ml_dtypes) is 2^-127, a nonzero subnormal
      for the larger codes. The plugin gives vLLM's +-0.
    * e8m0 255: vLLM's scale is +inf (bits 0x7f800000): +-inf, NaN for a zero value; the oracle
      gives NaN (float8_e8m0fnu 0xff). The plugin gives vLLM's.
    * e4m3 0x7f / 0xff: NaN in float8_e4m3fn (the GPU's float8e4nv, ml_dtypes); Triton's CPU
      interpreter widens them to +-480. The plugin gives NaN: the GPU's reading.
    * e8m0 1..9: some products are float32 subnormals; the plugin rounds them to bf16 to
      nearest even (ml_dtypes' rounding of the exact product, as the GPU's cvt.rn.bf16.f32 on a
      product that is not flushed); Triton's interpreter gives other bits there (its float32 ->
      bf16 of subnormals). Not checked on a GPU here.
    Every other (code, scale) pair: the plugin's bits equal the interpreted kernel's."""
    import ml_dtypes
    scales = np.array([0, 1, 2, 9, 10, 127, 200, 254, 255], np.uint8)
    n = len(scales)
    w = np.tile(np.arange(256, dtype=np.uint8), (n, 1))          # row r: every code, scale byte scales[r]
    s = np.repeat(scales[:, None], 8, axis=1)
    stock = E.ParallelEngramEmbedding(n, 256, (n,), cpu_offload=False)
    stock.weight.data.copy_(torch.from_numpy(w).view(torch.float8_e4m3fn))
    stock.weight_scale_inv.data.copy_(torch.from_numpy(s))
    ids = torch.arange(n, dtype=torch.int32)[:, None]
    vllm_bf16 = torch.empty(n, 1, 256, dtype=torch.bfloat16)
    stock.lookup(ids, vllm_bf16)
    vllm_bits = vllm_bf16.view(torch.int16).numpy().view(np.uint16)[:, 0]

    from engram_stream.integrations._records import records_to_bf16
    mine = np.empty((n, 1, 256), np.uint16)
    records_to_bf16(np.concatenate([w, s], axis=1)[:, None].copy(), mine)
    mine = mine[:, 0]
    nan_code = (np.arange(256) & 0x7f) == 0x7f
    normal = (scales == 0) | (scales >= 10)                       # every product a normal float32 (or 0, inf)
    np.testing.assert_array_equal(mine[normal][:, ~nan_code], vllm_bits[normal][:, ~nan_code])
    as_f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    assert np.isnan(as_f32(mine[:, nan_code])).all()
    interp = as_f32(vllm_bits[:, nan_code])                       # the interpreter's +-480 * scale
    for r, sb in enumerate(scales):
        if sb >= 10 and sb != 255:
            np.testing.assert_array_equal(interp[r], np.array([480, -480], np.float32) * np.float32(2.0 ** (int(sb) - 127)))

    oracle = w.view(v41_reference.E4M3).astype(np.float32) * v41_reference.e8m0(scales)[:, None]
    sub = (scales >= 1) & (scales < 10)                           # subnormal products: nearest even
    np.testing.assert_array_equal(mine[sub][:, ~nan_code],
                                  oracle[sub][:, ~nan_code].astype(ml_dtypes.bfloat16).view(np.uint16))
    assert (vllm_bits[sub][:, ~nan_code] != mine[sub][:, ~nan_code]).any()   # the interpreter's own bits
    mine_f = as_f32(mine)
    r0, r255 = 0, n - 1
    assert (np.abs(oracle[r0, ~nan_code]) > 0).any() and not mine_f[r0, ~nan_code].any()
    assert (np.signbit(mine_f[r0]) == (np.arange(256) >= 128)).all()   # +-0 by the value's sign
    assert np.isnan(oracle[r255]).all()
    zero = (np.arange(256) & 0x7f) == 0
    assert np.isinf(mine_f[r255, ~nan_code & ~zero]).all() and np.isnan(mine_f[r255, zero]).all()
