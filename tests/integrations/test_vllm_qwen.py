"""The vLLM plugin's Qwen4Exp side (engram_stream.integrations.vllm, its Qwen4Exp section) against vLLM 0.33.0's own
PLE n-gram embedding (vllm.models.qwen4_exp.nvidia.ngram_embedding.Qwen4ExpNGramEmbedding), on CPU
with ETP/TP 1 and the device backend (engram_config.cpu_offload=False).

vLLM's stock module is filled by vLLM's own loader (safetensors_weights_iterator, then the
module's load_weights) from a tiny Qwen folder; the plugin's module (the same class, its
ngram_embedding made by the patched constructor) reads the same folder through each row source.
Both give the same bytes: the lookup's output (bf16 rows, FP8 codes, NVFP4 decoded rows) and
vLLM's dequantize() of it, for bf16 and float32 tables written by engram_stream and vLLM's FP8 and
NVFP4 tables; the loader skips the table's shards (and NVFP4's block scale shards), the plugin's
embedding holds no table parameter; vLLM's row ids equal engram_stream's hash. Skipped without
vLLM (tools/ci_vllm.sh installs it)."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import types

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (tools/ci_vllm.sh installs vllm==0.33.0)")

from engram_stream import EngramConfig, EngramModel  # noqa: E402

plugin = pytest.importorskip("engram_stream.integrations.vllm")
from engram_stream.integrations import serving  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = {"mapped": {"tables": "mapped"}, "mapped+cache": {"tables": "mapped", "row_cache_mb": 0.2},
           "direct": {"tables": "direct"}, "direct+cache": {"tables": "direct", "row_cache_mb": 0.2}}


def _qwen_checkpoint_tests():
    spec = importlib.util.spec_from_file_location("_qwen_ckpt_tests", os.path.join(HERE, "..", "qwen",
                                                                                   "test_qwen_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


Q = _qwen_checkpoint_tests()


@pytest.fixture(scope="module")
def N():
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as N
    return N


@pytest.fixture
def vllm_env(N, monkeypatch):
    """One CPU process: ETP = TP = 1, a current VllmConfig with cpu_offload=False."""
    import vllm.models.qwen4_exp.common.ngram_embedding as C
    from vllm.config.engram import EngramConfig as VEngramConfig
    st = types.SimpleNamespace(model=None, extra={})
    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    for mod in (N, C):
        monkeypatch.setattr(mod, "get_etp_group", lambda: group)
        monkeypatch.setattr(mod, "get_tp_group", lambda: group)
    monkeypatch.setattr(N, "get_current_vllm_config", lambda: types.SimpleNamespace(
        engram_config=VEngramConfig(cpu_offload=False), model_config=types.SimpleNamespace(model=st.model),
        additional_config=st.extra))
    import vllm.model_executor.parameter as parameter   # the FP8 / NVFP4 parameters' TP rank
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1, raising=False)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0, raising=False)
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    monkeypatch.setattr(plugin, "_serving", False)
    monkeypatch.setattr(serving, "_models", {})
    return st


def hf_config(folder, kind):
    """What vLLM's Qwen4ExpTextConfig gives the module (the keys it reads)."""
    d = json.load(open(os.path.join(folder, "config.json")))
    d = d.get("text_config", d)
    eos = d["eos_token_id"]
    c = {"ngram_size": d["ngram_size"], "heads_per_ngram": d["heads_per_ngram"],
         "eos_token_id": eos[0] if isinstance(eos, list) else eos, "vocab_size": d["vocab_size"],
         "split_ngram_parts": d.get("split_ngram_parts", 512), "seed": d.get("seed", 1234),
         "ngram_vocab_size_base": d["ngram_vocab_size_base"],
         "make_ngram_vocab_size_divisible_by": d["make_ngram_vocab_size_divisible_by"],
         "ple_embed_dim": d["ple_embed_dim"], "ple_layer_ids": d["ple_layer_ids"]}
    if kind in ("fp8", "nvfp4"):
        c["ple_embedding_dtype"] = "float8_e4m3fn" if kind == "fp8" else "nvfp4"
    return types.SimpleNamespace(**c)


def build(N, cfg, dense):
    return N.Qwen4ExpNGramEmbedding(cfg, int(cfg.ple_embed_dim), dense, 64, data_parallel_rank=0,
                                    prefix=f"model.layers.x.ple.ple_embedding", params_dtype=torch.bfloat16)


def load(module, folder, layer):
    """vLLM's loader: the folder's tensors (should_skip_weight applied) under this layer's
    ple.ple_embedding., into the module's load_weights. Returns (names given, loaded)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    pre = f"model.layers.{layer - 1}.ple.ple_embedding."
    given = [(n[len(pre):], t) for n, t in safetensors_weights_iterator(
        sorted(glob.glob(os.path.join(folder, "*.safetensors"))), False) if n.startswith(pre)]
    loaded = module.load_weights(given)
    module.ngram_embedding.embedding_method.process_weights_after_loading(module.ngram_embedding)
    return [n for n, _ in given], loaded


def requests(cfg, rng, eos):
    """Three requests (one with an EOS inside), their query_start_loc and ngram contexts."""
    lens = [7, 1, 12]
    ids = rng.integers(0, cfg.vocab_size, sum(lens))
    ids[10] = eos
    qsl = np.concatenate([[0], np.cumsum(lens)])
    ctx = rng.integers(0, cfg.vocab_size, (3, cfg.ngram_size - 1))
    ctx[0] = eos   # a request's start
    return torch.from_numpy(ids), torch.from_numpy(qsl), torch.from_numpy(ctx)


def outputs(module, inputs):
    ids, qsl, ctx = inputs
    hidden = torch.zeros(ids.shape[0], 4, dtype=torch.bfloat16)
    emb = module(hidden, ids, qsl, ctx)
    return emb, module.ngram_embedding.dequantize(emb, torch.bfloat16)


def same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: folder}: bf16 and float32 tables written by engram_stream (split_ngram_parts parts,
    as vLLM's loader wants), vLLM's FP8 and NVFP4 tables (tests/qwen's fixtures)."""
    tmp = tmp_path_factory.mktemp("qwen_vllm")
    out = {}
    cfg = EngramConfig.from_hf_config({**Q.HF, "ple_embed_dim": 32})
    m = EngramModel.init(cfg, seed=3)
    out["bfloat16"] = m.save(tmp / "bf16", table_dtype="bfloat16")
    out["float32"] = m.save(tmp / "f32", table_dtype="float32")
    for kind in ("fp8", "nvfp4"):
        out[kind] = str(Q._quantized_folder(tmp, kind)[0])
    return {k: str(v) for k, v in out.items()}


@pytest.mark.parametrize("kind", ["bfloat16", "float32", "fp8", "nvfp4"])
def test_plugin_lookup_is_vllms(N, vllm_env, folders, kind, monkeypatch):
    folder = folders[kind]
    cfg = hf_config(folder, kind)
    rng = np.random.default_rng(5)
    for dense, layer in enumerate(sorted(cfg.ple_layer_ids)):
        monkeypatch.setattr(plugin, "_serving", False)   # vLLM's own model: its loader reads every tensor
        stock = build(N, cfg, dense)
        given, loaded = load(stock, folder, layer)
        assert any(".shard_" in n for n in given)
        inputs = requests(cfg, rng, cfg.eos_token_id)
        want = outputs(stock, inputs)
        assert want[1].float().abs().sum() > 0
        if kind == "fp8":
            assert want[0].dtype == torch.float8_e4m3fn
        for name, settings in SOURCES.items():
            vllm_env.model = folder
            monkeypatch.setenv(plugin.ENV, json.dumps(settings))
            monkeypatch.setattr(serving, "_models", {})
            mine = build(N, cfg, dense)
            emb = mine.ngram_embedding
            assert type(emb).__name__ == "StreamPLEEmbedding" and emb.layer == layer
            assert not any(p.numel() > 1 for p in emb.parameters())   # no table; a global scale at most
            assert emb.weight.device.type == "meta"
            given_m, _ = load(mine, folder, layer)
            assert not any(plugin.TABLE_TENSOR.search("x." + n) for n in given_m)   # skipped by the loader
            for _ in range(2):                      # cold, then warm (a row cache)
                got = outputs(mine, inputs)
                same_bytes(got[0], want[0])
                same_bytes(got[1], want[1])
            monkeypatch.delenv(plugin.ENV)


def test_vllm_row_ids_are_engram_streams(N, vllm_env, folders):
    """vLLM's compute_ngram_ids for one request from its start = engram_stream's hash + head offsets."""
    folder = folders["bfloat16"]
    cfg = hf_config(folder, "bfloat16")
    model = EngramModel.load(folder)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, cfg.vocab_size, 40)
    ids[17] = cfg.eos_token_id
    for dense, layer in enumerate(model.cfg.layer_ids):
        mod = build(N, cfg, dense)
        got = mod.compute_ngram_ids(torch.from_numpy(ids), torch.tensor([0, 40]),
                                    torch.full((1, cfg.ngram_size - 1), cfg.eos_token_id)).numpy()
        want = model.plan.hash(ids[None])[layer][0] + np.asarray(model.plan.offsets[layer])
        np.testing.assert_array_equal(got, want)


def test_loader_skips_only_the_table(vllm_env):
    skip = plugin.TABLE_TENSOR.search
    pre = "model.layers.3.ple.ple_embedding.ngram_embedding."
    assert skip(pre + "shard_0.weight") and skip(pre + "shard_511.weight_scale") and skip(pre + "weight")
    assert not skip(pre + "weight_scale") and not skip(pre + "weight_scale_2")   # global scales: vLLM's
    assert not skip("model.layers.3.ple.key_proj.weight")


@pytest.mark.parametrize("kind", ["bfloat16", "fp8", "nvfp4"])
def test_an_etp_rank_serves_its_rows(N, vllm_env, folders, kind, monkeypatch):
    """ETP = TP = 2, rank 1 (the all-reduce an identity): vLLM's loader gives the rank its vocabulary
    range of the shards, its lookup zeros for other rows; the plugin's rank reads the same rows."""
    import vllm.models.qwen4_exp.common.ngram_embedding as C
    group = types.SimpleNamespace(world_size=2, rank_in_group=1, all_reduce=lambda x: x)
    for mod in (N, C):
        monkeypatch.setattr(mod, "get_etp_group", lambda: group)
        monkeypatch.setattr(mod, "get_tp_group", lambda: group)
    folder = folders[kind]
    cfg = hf_config(folder, kind)
    inputs = requests(cfg, np.random.default_rng(11), cfg.eos_token_id)
    monkeypatch.setattr(plugin, "_serving", False)
    stock = build(N, cfg, 1)
    load(stock, folder, sorted(cfg.ple_layer_ids)[1])
    assert stock.ngram_embedding.shard_indices.org_vocab_start_index > 0
    want = outputs(stock, inputs)
    vllm_env.model = folder
    monkeypatch.setenv(plugin.ENV, json.dumps({"tables": "direct", "row_cache_mb": 0.2}))
    mine = build(N, cfg, 1)
    load(mine, folder, sorted(cfg.ple_layer_ids)[1])
    got = outputs(mine, inputs)
    same_bytes(got[0], want[0])
    same_bytes(got[1], want[1])


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_a_gguf_table_is_served_as_the_bf16_checkpoint_of_its_rows(N, vllm_env, tmp_path, name, monkeypatch):
    """tables={"gguf": ...}: the plugin's module gives what vLLM's own module gives from a bf16
    checkpoint whose table is gguf.quants.dequantize's rows rounded to bf16 (the GGUF decoded in
    the lookup: _records.gguf_to_bf16), for mapped and direct reads."""
    pytest.importorskip("gguf")
    from helpers.gguf_files import write_table_gguf
    ecfg = EngramConfig.from_hf_config({**Q.HF, "ple_embed_dim": 128, "ple_layer_ids": [1]})   # head_dim 32: a block
    m = EngramModel.init(ecfg, seed=3)
    L = ecfg.layer_ids[0]
    folder = str(m.save(tmp_path / "bf16", table_dtype="bfloat16"))
    deq = write_table_gguf(tmp_path / "t.gguf", EngramModel.load(folder), name, seed=4)[L]
    sd = m.state_dict(L)
    sd["ple_embedding.ngram_embedding.weight"] = deq   # the oracle: the bf16 checkpoint of the GGUF's rows
    want_folder = str(EngramModel.from_reference(ecfg, {L: sd}).save(tmp_path / "want", table_dtype="bfloat16"))
    cfg = hf_config(folder, "bfloat16")
    inputs = requests(cfg, np.random.default_rng(9), cfg.eos_token_id)
    monkeypatch.setattr(plugin, "_serving", False)
    stock = build(N, cfg, 0)
    load(stock, want_folder, L)
    want = outputs(stock, inputs)
    assert want[1].float().abs().sum() > 0
    vllm_env.model = folder
    for read in ("mapped", "direct"):
        monkeypatch.setenv(plugin.ENV, json.dumps({"tables": {"gguf": {"path": str(tmp_path / "t.gguf"), "read": read}},
                                                   "row_cache_mb": 0.2}))
        monkeypatch.setattr(serving, "_models", {})
        mine = build(N, cfg, 0)
        assert mine.ngram_embedding.source.record_format == f"gguf:{name}"
        load(mine, folder, L)
        for _ in range(2):   # cold, then warm (the row cache holds the GGUF's records)
            got = outputs(mine, inputs)
            same_bytes(got[0], want[0])
            same_bytes(got[1], want[1])
