"""The SGLang seam (engram_stream.integrations.sglang) against SGLang 0.5.23's own EngramEmbedding,
on CPU: SGLang's lookup takes its torch path there (its Triton gather is for CUDA tensors), with
get_parallel() stubbed for the tensor-parallel rank. SGLang's embedding is filled by its own
weight_loader from a tiny V4.1 checkpoint; install() makes Engram build the plugin's embedding,
which reads the same checkpoint through each row source. Both give the same bf16 bits, except at
the codes where SGLang's CPU path and its GPU kernel differ, pinned in a test of their own.

SGLang imports on CPU with one stub: torchvision (its CPU wheel is not installed beside the CPU
torch; sglang.srt.configs imports it at the top). The stub goes in only when SGLang is installed
and torchvision is not; tools/ci_vllm.sh runs this file in a pytest process of its own. Skipped
without SGLang (tools/ci_vllm.sh installs it)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (tools/ci_vllm.sh installs sglang==0.5.23)", allow_module_level=True)


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


def _stub_torchvision():
    """Names SGLang's and transformers' module tops take from torchvision (never called here)."""
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io",
                 "torchvision.ops", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
        m = _StubModule(name)
        m.__path__, m.__version__ = [], "0.0"
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = m


if importlib.util.find_spec("torchvision") is None:
    _stub_torchvision()
E = pytest.importorskip("sglang.srt.layers.engram")

from engram_stream.rows import packed  # noqa: E402

from helpers.row_sources import PLUGIN_SOURCES  # noqa: E402

plugin = pytest.importorskip("engram_stream.integrations.sglang")

SOURCES = PLUGIN_SOURCES


@pytest.fixture
def parallel(monkeypatch):
    """get_parallel(): TP world `tp_size`, rank `tp_rank` (set them), no attention DP or CP."""
    st = types.SimpleNamespace(tp_size=1, tp_rank=0, attn_dp_size=1, attn_cp_size=1, attn_cp_rank=0)
    monkeypatch.setattr(E, "get_parallel", lambda: st)
    yield st
    plugin.uninstall()


def layout_of(path):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return E.EngramLayout.from_config(types.SimpleNamespace(**cfg))


def checkpoint_tensors(path):
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys() if ".engram.embed." in k})
    return out


def stock_embeddings(path, layout):
    """SGLang's own embeddings of every layer, filled by their weight_loader (this rank's rows)."""
    tensors = checkpoint_tensors(path)
    embs = {}
    for i, L in enumerate(layout.layer_ids):
        e = E.EngramEmbedding(layout.num_embeddings[i], layout.head_dim, L, layout.column_bounds(i))
        e.weight.weight_loader(e.weight, tensors[f"layers.{L}.engram.embed.weight"])
        e.scale.weight_loader(e.scale, tensors[f"layers.{L}.engram.embed.scale"])
        embs[L] = e
    return embs


def hash_ids(layout, i, T, rng):
    """int32 [T, columns]: each column's rows in its head's range, some -1, rows repeated."""
    b = np.array(layout.column_bounds(i))
    h = b[:-1] + rng.integers(0, np.diff(b), (T, len(b) - 1))
    h[rng.random(h.shape) < 0.1] = -1
    h[T // 2:T // 2 + 3] = h[0]
    return torch.from_numpy(h.astype(np.int32))


def bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("source", list(SOURCES))
def test_sglang_engram_builds_the_plugins_embedding_with_sglangs_bits(plugin_checkpoints, parallel, source):
    """install(); SGLang's Engram (its __init__ builds the embedding) holds no table, and its
    embed_rows() (the forward's lookup) gives the bits of SGLang's own embedding, cold and warm."""
    path = plugin_checkpoints["rows" if "packed" in source else "plain"]
    layout = layout_of(path)
    stock = stock_embeddings(path, layout)
    plugin.install({"checkpoint": path, **SOURCES[source]})
    rng = np.random.default_rng(3)
    config = types.SimpleNamespace(rms_norm_eps=1e-6, hidden_size=32, hc_mult=2)
    for i, L in enumerate(layout.layer_ids):
        layer = E.Engram(config, L, layout)
        m = layer.embed
        assert isinstance(m, plugin.embedding_class()) and isinstance(m, plugin._stock_class)
        assert not list(m.parameters()) and not list(m.buffers())
        assert not hasattr(m, "weight") and not hasattr(m, "scale")   # SGLang's meta table, dropped
        if "packed" in source:
            assert m.model.tier.inner.rows_path == packed.rows_path(path)
        for T in (1, 16, 300):
            ids = hash_ids(layout, i, T, rng)
            want = stock[L](ids)
            assert want.dtype == torch.bfloat16 and want.abs().sum() > 0
            for _ in ("cold", "warm"):
                got = layer.embed_rows(ids, None, False)
                assert got.shape == want.shape and torch.equal(bits(want), bits(got)), (source, L, T)
        assert not bits(m(torch.full((4, len(layout.column_bounds(i)) - 1), -1, dtype=torch.int32))).any()
    st = m.row_cache_stats()
    if SOURCES[source].get("row_cache_mb"):
        assert st["hits"] > 0 and st["misses"] > 0
    if SOURCES[source]["tables"] == "direct":
        assert st["reads"] > 0


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_row_ranges_give_sglangs_bits(plugin_checkpoints, parallel, rank):
    """TP 2: each rank's rows (shard_range: 9 columns do not split in 2, so an equal-row split
    that cuts a head) and zeros for the other rank's; the two ranks' rows sum to every row."""
    path = plugin_checkpoints["plain"]
    parallel.tp_size, parallel.tp_rank = 2, rank
    layout = layout_of(path)
    stock = stock_embeddings(path, layout)
    plugin.install({"checkpoint": path, "tables": "direct", "row_cache_mb": 0.2})
    rng = np.random.default_rng(5 + rank)
    for i, L in enumerate(layout.layer_ids):
        m = plugin.embedding_class()(layout.num_embeddings[i], layout.head_dim, L, layout.column_bounds(i))
        assert (m.row_start, m.rows) == (stock[L].row_start, stock[L].rows)
        ids = hash_ids(layout, i, 40, rng)
        want, got = stock[L]._owned_rows(ids), m._owned_rows(ids)
        assert torch.equal(bits(want), bits(got))
        other = ((ids < m.row_start) | (ids >= m.row_start + m.rows))
        assert other.any() and (~other).any() and not bits(got[other]).any()


def test_install_refuses_bad_settings_with_the_value(plugin_checkpoints, parallel, monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    with pytest.raises(ValueError, match=plugin.ENV):
        plugin.install()
    with pytest.raises(ValueError, match='give "checkpoint"'):
        plugin.install({"tables": "direct"})
    with pytest.raises(ValueError, match='"tables" must be'):
        plugin.install({"checkpoint": plugin_checkpoints["plain"], "tables": "ram"})
    monkeypatch.setenv(plugin.ENV, json.dumps({"checkpoint": plugin_checkpoints["plain"]}))
    assert plugin.install() is E.EngramEmbedding
    layout = layout_of(plugin_checkpoints["plain"])
    with pytest.raises(ValueError, match="give the checkpoint SGLang serves"):
        E.EngramEmbedding(layout.num_embeddings[0] + 1, 256, layout.layer_ids[0], layout.column_bounds(0))
    plugin.uninstall()
    assert E.EngramEmbedding is plugin._stock_class


def test_another_sglang_version_and_sglangs_other_table_layouts_are_refused(plugin_checkpoints, parallel,
                                                                            monkeypatch):
    """A SGLang other than 0.5.23 is refused naming both versions; so are SGLang's host-table and
    peer-shard layouts, which would allocate a table the served rows leave unused."""
    import sglang
    plugin.install({"checkpoint": plugin_checkpoints["plain"]})
    layout = layout_of(plugin_checkpoints["plain"])
    for name in plugin.TABLE_LAYOUTS:
        with monkeypatch.context() as mp:
            mp.setenv(name, "1")
            with pytest.raises(ValueError, match=f"{plugin.ENV}: {name} is set: .* unset it"):
                E.EngramEmbedding(layout.num_embeddings[0], 256, layout.layer_ids[0], layout.column_bounds(0))
    plugin.uninstall()
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    monkeypatch.setattr(plugin, "_embedding_class", None)
    with pytest.raises(RuntimeError, match=r"serves SGLang 0\.5\.23 .* this is SGLang 0\.5\.24: install sglang==0\.5\.23"):
        plugin.embedding_class()


@pytest.mark.native  # drives records_to_bf16 (C over raw pointers): CI's sanitizer stages select it
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_codes_and_extreme_scales_are_pinned(parallel):
    """Every e4m3 code against the e8m0 bytes 0, 1, 2, 9, 10, 127, 200, 254, 255. SGLang's GPU
    kernel (_engram_gather_kernel) scales by the float32 of bits byte << 23, except byte 0:
    2^-127; the plugin gives that: fp32(value) * scale rounded once to bf16 (checked here against
    ml_dtypes). SGLang's CPU path (torch's float8_e8m0fnu) agrees everywhere but at byte 255:
    NaN there, the kernel's +-inf (NaN for a zero value). e4m3 0x7f / 0xff are NaN on both."""
    import ml_dtypes
    from engram_stream.integrations._records import records_to_bf16
    scales = np.array([0, 1, 2, 9, 10, 127, 200, 254, 255], np.uint8)
    n = len(scales)
    w = np.tile(np.arange(256, dtype=np.uint8), (n, 1))
    s = np.repeat(scales[:, None], 8, axis=1)
    stock = E.EngramEmbedding(n, 256, 0, (0, n))
    stock.weight.data.copy_(torch.from_numpy(w).view(torch.float8_e4m3fn))
    stock.scale.data.copy_(torch.from_numpy(s).view(torch.float8_e8m0fnu))
    cpu_path = stock(torch.arange(n, dtype=torch.int32)[:, None])[:, 0].view(torch.int16).numpy().view(np.uint16)
    mine = np.empty((n, 1, 256), np.uint16)
    records_to_bf16(np.concatenate([w, s], axis=1)[:, None].copy(), mine, plugin.ZERO_SCALE)
    mine = mine[:, 0]
    scale_f32 = np.where(scales == 0, np.float32(2.0 ** -127),
                         (scales.astype(np.uint32) << 23).view(np.float32))
    kernel = (w.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale_f32[:, None]).astype(ml_dtypes.bfloat16)
    kernel = kernel.view(np.uint16)
    as_f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    nan = np.isnan(as_f32(kernel))
    np.testing.assert_array_equal(np.isnan(as_f32(mine)), nan)
    np.testing.assert_array_equal(mine[~nan], kernel[~nan])
    assert np.isnan(as_f32(mine[:, (np.arange(256) & 0x7f) == 0x7f])).all()
    r255 = n - 1
    assert np.isinf(as_f32(mine[r255, (np.arange(256) & 0x7f) % 0x7f != 0])).all()
    assert np.isnan(as_f32(cpu_path[r255])).all()           # SGLang's CPU path: NaN at 255
    cpu_nan = np.isnan(as_f32(cpu_path[:r255]))                   # elsewhere the kernel's bits (NaN: any payload)
    np.testing.assert_array_equal(cpu_nan, nan[:r255])
    np.testing.assert_array_equal(mine[:r255][~cpu_nan], cpu_path[:r255][~cpu_nan])
    assert as_f32(mine[0, 0x08:0x7f]).min() > 0   # byte 0: 2^-127 (the smallest codes round to 0), not vLLM's zero scale
