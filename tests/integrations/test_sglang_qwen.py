"""The SGLang seam's Qwen4Exp side (engram_stream.integrations.sglang, its Qwen4Exp section) against SGLang
0.5.23's own PLE n-gram embedding (sglang.srt.models.qwen4_exp.Qwen4ExpNGramEmbedding), on CPU, with
get_parallel() stubbed for the tensor-parallel rank.

SGLang's stock module is filled by SGLang's own loader (Qwen4ExpForConditionalGeneration.load_weights,
called on a container that holds the PLE modules under their checkpoint names) from a tiny Qwen folder;
after install() SGLang's Qwen4ExpNGramEmbedding builds the plugin's table module, which reads the same
folder through each row source. Both give the same bytes: the table's lookup (bf16 rows, FP8 codes)
and SGLang's whole lookup (_embed_ngram_ids: the cast to bf16 and its weight_scale), for bf16 and float32
tables written by engram_stream, FP8 tables (declared in the config, or switched to by SGLang's loader)
and a bf16 table SGLang stores as FP8; the loader skips the table's shards, the plugin's module holds
no table; SGLang's row ids equal engram_stream's hash. Runs in the SGLang pytest process of
tools/ci_vllm.sh (test_sglang's torchvision stub); skipped without SGLang."""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import test_sglang  # noqa: E402,F401  (SGLang importable on CPU: its torchvision stub; skips without SGLang)

Q = pytest.importorskip("sglang.srt.models.qwen4_exp")
import sglang.srt.layers.linear as L  # noqa: E402
import sglang.srt.layers.vocab_parallel_embedding as V  # noqa: E402

from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.integrations import serving  # noqa: E402

from helpers.row_sources import PLUGIN_SOURCES  # noqa: E402

plugin = pytest.importorskip("engram_stream.integrations.sglang")

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = {k: v for k, v in PLUGIN_SOURCES.items() if "packed" not in k}


def _qwen_checkpoint_tests():
    spec = importlib.util.spec_from_file_location("_qwen_ckpt_tests", os.path.join(HERE, "..", "qwen",
                                                                                   "test_qwen_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


QC = _qwen_checkpoint_tests()


def stub_parallel(monkeypatch, modules):
    """get_parallel(): TP world `tp_size`, rank `tp_rank` (set them on the returned namespace), no
    attention DP (is_dp_attention_enabled of each of `modules`); SGLang's all-reduce an identity
    (one process)."""
    st = types.SimpleNamespace(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1,
                               attn_cp_size=1, attn_cp_rank=0, tp_group=None, attn_tp_group=None)
    for mod in (*modules, V, L):
        monkeypatch.setattr(mod, "get_parallel", lambda: st, raising=False)
    for mod in modules:
        monkeypatch.setattr(mod, "is_dp_attention_enabled", lambda: False)
    monkeypatch.setattr(V, "use_symmetric_memory", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(V, "is_allocation_symmetric", lambda: True)
    monkeypatch.setattr(V, "get_attn_tp_context", lambda: types.SimpleNamespace(input_scattered=False))
    monkeypatch.setattr(V, "tensor_model_parallel_all_reduce", lambda x: x)
    monkeypatch.setattr(serving, "_models", {})
    return st


@pytest.fixture
def parallel(monkeypatch):
    yield stub_parallel(monkeypatch, (Q,))
    plugin.uninstall()


def hf_config(folder, storage=None):
    """What SGLang's Qwen4ExpTextConfig gives the module (the keys it reads); storage: its
    ple_embedding_dtype."""
    d = json.load(open(os.path.join(folder, "config.json")))
    d = d.get("text_config", d)
    eos = d["eos_token_id"]
    return types.SimpleNamespace(
        ngram_size=d["ngram_size"], heads_per_ngram=d["heads_per_ngram"], vocab_size=d["vocab_size"],
        eos_token_id=eos[0] if isinstance(eos, list) else eos, seed=d.get("seed", 1234),
        split_ngram_parts=d.get("split_ngram_parts", 512), ngram_vocab_size_base=d["ngram_vocab_size_base"],
        make_ngram_vocab_size_divisible_by=d["make_ngram_vocab_size_divisible_by"],
        ple_embed_dim=d["ple_embed_dim"], ple_layer_ids=d["ple_layer_ids"], ple_embedding_dtype=storage,
        ple_offload_embedding=False, num_experts=None, tie_word_embeddings=False)


def build(cfg, index):
    return Q.Qwen4ExpNGramEmbedding(cfg, int(cfg.ple_embed_dim), ple_layer_index=index,
                                    prefix="model.layers.x.ple.ple_embedding")


def prefix(layer):
    return f"model.layers.{layer - 1}.ple.ple_embedding"


def load(cfg, modules, folder):
    """SGLang's Qwen4Exp loader over the folder's PLE tensors, into {checkpoint layer: module}.
    Returns (names given, names it loaded)."""
    from safetensors import safe_open
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleDict()
    for layer, module in modules.items():
        holder = torch.nn.Module()
        holder.ple = torch.nn.Module()
        holder.ple.ple_embedding = module
        root.model.layers[str(layer - 1)] = holder
    root.config, root.start_layer, root.end_layer, root.language_model_only = cfg, 0, 1 << 20, False
    root.pp_group = types.SimpleNamespace(is_last_rank=True)
    G = Q.Qwen4ExpForConditionalGeneration
    root._load_qwen4_exp_ple_buffer = types.MethodType(G._load_qwen4_exp_ple_buffer, root)
    given = []
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            given += [(k, st.get_tensor(k)) for k in st.keys()
                      if any(k.startswith(prefix(layer) + ".") for layer in modules)]
    loaded = G.load_weights(root, iter(given))
    return [k for k, _ in given], loaded


def row_ids(module, T, rng):
    """int64 [T, heads]: each head's rows in its range (SGLang's hash output), rows repeated."""
    sizes = module.ngram_heads_vocab_sizes.numpy()
    ids = module.ngram_heads_offsets.numpy() + rng.integers(0, sizes, (T, len(sizes)))
    ids[T // 2:T // 2 + 3] = ids[0]
    return torch.from_numpy(ids)


def lookups(module, ids):
    """SGLang's table lookup (VocabParallelEmbedding.forward: bf16), and its whole lookup (times
    the module's weight_scale)."""
    return module.ngram_embedding(ids), module._embed_ngram_ids(ids, None, ids.shape[0])


def gathered(module, ids):
    """The table's rows as stored (the quant method's gather of ids on TP rank 0 of 1)."""
    emb = module.ngram_embedding
    return emb.quant_method.embedding(emb, ids)


def same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: folder}: bf16 and float32 tables written by engram_stream (split_ngram_parts parts, as
    SGLang's loader reads them), FP8 and NVFP4 tables (tests/qwen's fixtures)."""
    tmp = tmp_path_factory.mktemp("qwen_sglang")
    out = {}
    m = EngramModel.init(EngramConfig.from_hf_config({**QC.HF, "ple_embed_dim": 32}), seed=3)
    out["bfloat16"] = m.save(tmp / "bf16", table_dtype="bfloat16")
    out["float32"] = m.save(tmp / "f32", table_dtype="float32")
    for kind in ("fp8", "nvfp4"):
        out[kind] = QC._quantized_folder(tmp, kind)[0]
    return {k: str(v) for k, v in out.items()}


# (folder, SGLang's ple_embedding_dtype, the dtype of SGLang's table lookup)
CASES = {"bfloat16": ("bfloat16", None, torch.bfloat16), "float32": ("float32", None, torch.bfloat16),
         "fp8": ("fp8", "float8_e4m3fn", torch.float8_e4m3fn),
         "fp8 switched by the loader": ("fp8", None, torch.float8_e4m3fn),
         "bfloat16 stored as fp8": ("bfloat16", "float8_e4m3fn", torch.float8_e4m3fn)}


@pytest.mark.parametrize("case", list(CASES))
def test_plugin_lookup_is_sglangs(parallel, folders, case):
    kind, storage, dtype = CASES[case]
    folder = folders[kind]
    cfg = hf_config(folder, storage)
    layers = sorted(cfg.ple_layer_ids)
    stock = {layer: build(cfg, i) for i, layer in enumerate(layers)}
    given, loaded = load(cfg, stock, folder)
    assert any(".shard_" in n for n in given)
    assert all(f"{prefix(layer)}.ngram_embedding.weight" in loaded for layer in layers)
    rng = np.random.default_rng(5)
    inputs = {(layer, T): row_ids(stock[layer], T, rng) for layer in layers for T in (1, 23)}
    wants = {k: (gathered(stock[k[0]], ids), *lookups(stock[k[0]], ids)) for k, ids in inputs.items()}
    for rows, table, whole in wants.values():
        assert rows.dtype == dtype and table.dtype == whole.dtype == torch.bfloat16
        assert whole.float().abs().sum() > 0
    for name, settings in SOURCES.items():
        serving._models.clear()
        plugin.install({"checkpoint": folder, **settings})
        mine = {layer: build(cfg, i) for i, layer in enumerate(layers)}
        for layer, m in mine.items():
            emb = m.ngram_embedding
            assert type(emb).__name__ == "StreamPLEEmbedding" and emb.layer == layer
            assert not hasattr(emb, "weight") and not any(p.numel() for p in emb.parameters())
            assert [n for n, _ in emb.named_buffers()] == ["weight_scale"]   # SGLang's, loaded by SGLang
        given_m, loaded_m = load(cfg, mine, folder)
        assert given_m == given
        assert not any(n.endswith(".ngram_embedding.weight") for n in loaded_m)   # the shards were skipped
        for (layer, T), ids in inputs.items():
            for _ in ("cold", "warm"):
                got = (gathered(mine[layer], ids), *lookups(mine[layer], ids))
                for a, b in zip(got, wants[layer, T]):
                    same_bytes(a, b)
        st = mine[layers[0]].ngram_embedding.row_cache_stats()
        if settings.get("row_cache_mb"):
            assert st["hits"] > 0 and st["misses"] > 0
        plugin.uninstall()
        assert Q.Qwen4ExpNGramEmbedding is plugin._qwen_stock[0]


def test_sglang_row_ids_are_engram_streams(parallel, folders):
    """SGLang's _hash_contexts over one request's windows (EOS before its start and inside it) =
    engram_stream's hash + the heads' row offsets."""
    folder = folders["bfloat16"]
    cfg = hf_config(folder)
    model = EngramModel.load(folder)
    parallel_pool = types.SimpleNamespace(ple_window_cache=None)
    Qpool = Q.get_req_to_token_pool
    Q.get_req_to_token_pool = lambda: parallel_pool
    try:
        rng = np.random.default_rng(7)
        ids = rng.integers(0, cfg.vocab_size, 40)
        ids[17] = cfg.eos_token_id
        n = cfg.ngram_size
        padded = np.concatenate([np.full(n - 1, cfg.eos_token_id), ids])
        windows = np.lib.stride_tricks.sliding_window_view(padded, n)
        for i, layer in enumerate(model.cfg.layer_ids):
            got = build(cfg, i)._hash_contexts(torch.from_numpy(windows.copy())).numpy()
            want = model.plan.hash(ids[None])[layer][0] + np.asarray(model.plan.offsets[layer])
            np.testing.assert_array_equal(got, want)
    finally:
        Q.get_req_to_token_pool = Qpool


@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_a_tp_rank_serves_its_rows(parallel, folders, kind):
    """TP 2, rank 1 (the all-reduce an identity): SGLang's loader gives the rank its vocabulary range
    of the shards and its lookup zeros for other rows; the plugin's rank reads the same rows."""
    parallel.tp_size, parallel.tp_rank = 2, 1
    folder = folders[kind]
    cfg = hf_config(folder, "float8_e4m3fn" if kind == "fp8" else None)
    layer = sorted(cfg.ple_layer_ids)[1]
    stock = build(cfg, 1)
    load(cfg, {layer: stock}, folder)
    assert stock.ngram_embedding.shard_indices.org_vocab_start_index > 0
    ids = row_ids(stock, 40, np.random.default_rng(11))
    want = lookups(stock, ids)
    plugin.install({"checkpoint": folder, "tables": "direct", "row_cache_mb": 0.2})
    mine = build(cfg, 1)
    load(cfg, {layer: mine}, folder)
    got = lookups(mine, ids)
    same_bytes(got[0], want[0])
    same_bytes(got[1], want[1])
    start = stock.ngram_embedding.shard_indices.org_vocab_start_index
    assert (ids < start).any() and not got[0][ids < start].float().abs().sum()


def test_the_loader_skips_only_the_tables_shards():
    skip = plugin.QWEN_TABLE_TENSOR.search
    pre = "model.layers.3.ple.ple_embedding.ngram_embedding."
    assert skip(pre + "shard_0.weight") and skip(pre + "shard_511.weight")
    assert not skip(pre + "weight_scale") and not skip(pre + "shard_0.weight_scale")
    assert not skip("model.layers.3.ple.key_proj.weight") and not skip("model.embed_tokens.weight")


def test_refusals_name_the_setting(parallel, folders, monkeypatch):
    """NVFP4 tables (SGLang has none), SGLang's --ple-offload-embedding (its own host table), CUDA
    graphs on a CUDA machine (a captured host lookup replays stale rows), a checkpoint whose heads
    are not SGLang's."""
    plugin.install({"checkpoint": folders["nvfp4"]})
    with pytest.raises(ValueError, match=r"NVFP4: SGLang 0\.5\.23 serves bf16 and FP8 PLE tables only"):
        build(hf_config(folders["nvfp4"]), 0)
    folder = folders["bfloat16"]
    plugin.install({"checkpoint": folder})
    cfg = hf_config(folder)
    cfg.ple_offload_embedding = True
    with pytest.raises(ValueError, match=f"{plugin.ENV}: --ple-offload-embedding is set: .* unset it"):
        build(cfg, 0)
    cfg = hf_config(folder)
    monkeypatch.setattr(serving, "cuda_available", lambda: True)
    monkeypatch.setattr(plugin, "_eager", lambda: False)
    with pytest.raises(ValueError, match="serve with --cuda-graph-backend-decode=disabled "
                                         "--cuda-graph-backend-prefill=disabled"):
        build(cfg, 0)
    monkeypatch.setattr(plugin, "_eager", lambda: True)
    assert type(build(cfg, 0).ngram_embedding).__name__ == "StreamPLEEmbedding"
    monkeypatch.setattr(serving, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="PLE layer 2 is not one of"):
        build(cfg, 2)
    cfg.ngram_vocab_size_base += 10
    with pytest.raises(ValueError, match="give the checkpoint SGLang serves"):
        build(cfg, 0)


def test_another_sglang_version_leaves_qwen_alone(parallel, folders, monkeypatch):
    import sglang
    stock = Q.Qwen4ExpNGramEmbedding
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    monkeypatch.setattr(plugin, "_embedding_class", None)
    with pytest.raises(RuntimeError, match=r"serves SGLang 0\.5\.23 .* this is SGLang 0\.5\.24"):
        plugin.install({"checkpoint": folders["bfloat16"]})
    assert Q.Qwen4ExpNGramEmbedding is stock


def test_install_patches_qwen4_exp_when_sglang_imports_it(folders):
    """A server's order: install() (a sitecustomize) before SGLang imports its Qwen4Exp model; the
    module is patched as it is imported, and uninstall() gives SGLang's class back."""
    script = f"""
import sys
sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}]   # the engram_stream under test: conftest's PYTHONPATH
import test_sglang
import engram_stream.integrations.sglang as plugin
plugin.install({{"checkpoint": {folders["bfloat16"]!r}}})
assert "sglang.srt.models.qwen4_exp" not in sys.modules
import sglang.srt.models.qwen4_exp as Q
assert Q.Qwen4ExpNGramEmbedding.__name__ == "StreamNGramEmbedding", Q.Qwen4ExpNGramEmbedding
plugin.uninstall()
assert Q.Qwen4ExpNGramEmbedding.__name__ == "Qwen4ExpNGramEmbedding", Q.Qwen4ExpNGramEmbedding
print("patched on import")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd="/",
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0 and "patched on import" in r.stdout, r.stderr[-3000:]


def test_a_gguf_table_is_served_as_the_bf16_checkpoint_of_its_rows(parallel, tmp_path):
    """tables={"gguf": ...}: the plugin's table gives what SGLang's own gives from a bf16
    checkpoint whose table is gguf.quants.dequantize's rows rounded to bf16 (the GGUF decoded in
    the lookup), mapped and direct."""
    pytest.importorskip("gguf")
    from helpers.gguf_files import write_table_gguf
    ecfg = EngramConfig.from_hf_config({**QC.HF, "ple_embed_dim": 128, "ple_layer_ids": [1]})  # head_dim 32: a block
    m = EngramModel.init(ecfg, seed=3)
    layer = ecfg.layer_ids[0]
    folder = str(m.save(tmp_path / "bf16", table_dtype="bfloat16"))
    deq = write_table_gguf(tmp_path / "t.gguf", EngramModel.load(folder), "Q4_0", seed=4)[layer]
    sd = m.state_dict(layer)
    sd["ple_embedding.ngram_embedding.weight"] = deq   # the oracle: the bf16 checkpoint of the GGUF's rows
    want_folder = str(EngramModel.from_reference(ecfg, {layer: sd}).save(tmp_path / "want", table_dtype="bfloat16"))
    cfg = hf_config(folder)
    stock = {layer: build(cfg, 0)}
    load(cfg, stock, want_folder)
    ids = row_ids(stock[layer], 23, np.random.default_rng(5))
    want = (gathered(stock[layer], ids), *lookups(stock[layer], ids))
    assert want[2].float().abs().sum() > 0
    for read in ("mapped", "direct"):
        serving._models.clear()
        plugin.install({"checkpoint": folder, "row_cache_mb": 0.2,
                        "tables": {"gguf": {"path": str(tmp_path / "t.gguf"), "read": read}}})
        try:
            mine = {layer: build(cfg, 0)}
            assert mine[layer].ngram_embedding.source.record_format == "gguf:Q4_0"
            load(cfg, mine, folder)
            for _ in ("cold", "warm"):
                for a, b in zip((gathered(mine[layer], ids), *lookups(mine[layer], ids)), want):
                    same_bytes(a, b)
        finally:
            plugin.uninstall()
