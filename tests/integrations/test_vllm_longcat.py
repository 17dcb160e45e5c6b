"""The vLLM plugin's LongCat-Flash-Lite side (engram_stream.integrations.vllm, its LongCat section) against
vLLM 0.33.0's own n-gram embedding (vllm.model_executor.models.longcat_flash_ngram.NgramEmbedding), on CPU.

vLLM's stock module is filled by vLLM's loader (safetensors_weights_iterator, then the module's
load_weight) from a small LongCat folder written by engram_stream; the plugin's module (the same
class, its oe_embedder made by the patched constructor) reads the same folder through each row
source. embed_batched gives the same bytes for the same ids: the ids vLLM's ngram_compute_n_gram_ids
kernel gives (a CUDA kernel, so written out here from its source: the walk back from each
position stops at a negated EOS or the request's start), EOS positions included. The loader skips
the embedders' tensors and the plugin's oe_embedder holds no table. Skipped without vLLM
(tools/ci_vllm.sh installs it)."""
from __future__ import annotations

import glob
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

from helpers.row_sources import PLUGIN_SOURCES  # noqa: E402
from longcat_ids import HF, batch, framework_config, kernel_ids  # noqa: E402

SOURCES = {k: v for k, v in PLUGIN_SOURCES.items() if "packed" not in k}   # the packed row file is V4.1's
@pytest.fixture(scope="module")
def M():
    import vllm.model_executor.models.longcat_flash_ngram as M
    return M


@pytest.fixture
def vllm_env(M, monkeypatch):
    """One CPU process, TP 1, a current VllmConfig whose model is st.model."""
    import vllm.config
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    st = types.SimpleNamespace(model=None, extra={})
    monkeypatch.setattr(V, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(V, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=st.model), additional_config=st.extra))
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    monkeypatch.setattr(plugin, "_serving", False)
    monkeypatch.setattr(serving, "_models", {})
    return st


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{table dtype: folder} written by engram_stream's LongCat writer."""
    tmp = tmp_path_factory.mktemp("longcat_vllm")
    m = EngramModel.init(EngramConfig.from_hf_config(HF), seed=4)
    return {d: str(m.save(tmp / d, table_dtype=d)) for d in ("bfloat16", "float32")}


def build(M, cfg):
    return M.NgramEmbedding(cfg, torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype))


def load(module, folder):
    """vLLM's loader over the folder (should_skip_weight applied): the n-gram tensors into the
    module's load_weight, the token embedding into word_embeddings. Returns the names given."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    given = []
    for name, t in safetensors_weights_iterator(sorted(glob.glob(os.path.join(folder, "*.safetensors"))), False):
        given.append(name)
        if name == "model.embed_tokens.weight":
            module.word_embeddings.weight.data.copy_(t)
        else:
            module.load_weight(name[len("model."):], t)
    return given


def same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("table_dtype", ["bfloat16", "float32"])
def test_plugin_embed_batched_is_vllms(M, vllm_env, folders, table_dtype, monkeypatch):
    folder, cfg = folders[table_dtype], framework_config()
    reqs = batch(cfg, np.random.default_rng(5))
    input_ids, oe_ids = torch.from_numpy(np.concatenate(reqs)), kernel_ids(cfg, reqs)
    stock = build(M, cfg)
    given = load(stock, folder)
    assert any(".embedders." in n for n in given)
    want = stock.embed_batched(input_ids, oe_ids)
    assert want.dtype == torch.bfloat16 and want.float().abs().sum() > 0
    # the rows vLLM's ids select differ by position (EOS positions: row 0 of every embedder)
    assert stock.oe_embedder(oe_ids.T.contiguous()).float().abs().sum() > 0
    for name, settings in SOURCES.items():
        vllm_env.model = folder
        monkeypatch.setenv(plugin.ENV, json.dumps(settings))
        monkeypatch.setattr(serving, "_models", {})
        mine = build(M, cfg)
        emb = mine.oe_embedder
        assert type(emb).__name__ == "StreamNgramTable" and emb.layer == 0
        assert not list(emb.parameters()) and emb.weight.device.type == "meta"   # no table
        assert mine.oe_projection.device.type == "cpu"                           # vLLM's, loaded by vLLM
        given_m = load(mine, folder)
        assert not any(".embedders." in n for n in given_m)                      # skipped by the loader
        assert any(".post_projs." in n for n in given_m)
        for _ in range(2):                                                       # cold, then warm
            same_bytes(mine.embed_batched(input_ids, oe_ids), want)
        monkeypatch.delenv(plugin.ENV)


def test_vllm_ids_are_engram_streams_but_at_eos(vllm_env, folders):
    """vLLM 0.33.0's ids = engram_stream's hash (Hugging Face semantics) + the offsets at every
    position but an EOS one, where vLLM's kernel gives every embedder's row 0."""
    cfg = framework_config()
    model = EngramModel.load(folders["bfloat16"])
    ids = batch(cfg, np.random.default_rng(9))[0]
    got = kernel_ids(cfg, [ids]).numpy()
    want = model.plan.hash(ids[None])[0][0] + np.asarray(model.plan.offsets[0])
    eos = ids == cfg.eos_token_id
    np.testing.assert_array_equal(got[~eos], want[~eos])
    np.testing.assert_array_equal(got[eos], np.broadcast_to(model.plan.offsets[0], got[eos].shape))
    assert (got[eos] != want[eos]).any()


def test_a_tp_rank_serves_its_rows(M, vllm_env, folders, monkeypatch):
    """TP 2, rank 1 (the all-reduce an identity): vLLM's loader gives the rank its vocabulary range,
    its lookup zeros for other rows; the plugin's rank reads the same rows."""
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    monkeypatch.setattr(V, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(V, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(V, "tensor_model_parallel_all_reduce", lambda x: x)
    folder, cfg = folders["bfloat16"], framework_config()
    reqs = batch(cfg, np.random.default_rng(11))
    input_ids, oe_ids = torch.from_numpy(np.concatenate(reqs)), kernel_ids(cfg, reqs)
    stock = build(M, cfg)
    load(stock, folder)
    start = stock.oe_embedder.shard_indices.org_vocab_start_index
    assert start > 0 and (oe_ids >= start).any() and (oe_ids < start).any()
    want = stock.embed_batched(input_ids, oe_ids)
    vllm_env.model = folder
    monkeypatch.setenv(plugin.ENV, json.dumps({"tables": "direct", "row_cache_mb": 0.2}))
    mine = build(M, cfg)
    load(mine, folder)
    same_bytes(mine.embed_batched(input_ids, oe_ids), want)


def test_a_checkpoint_of_another_geometry_is_refused(M, vllm_env, folders, monkeypatch):
    vllm_env.model = folders["bfloat16"]
    monkeypatch.setenv(plugin.ENV, json.dumps({"tables": "mapped"}))
    cfg = framework_config()
    cfg.ngram_vocab_size_ratio = 6
    with pytest.raises(ValueError, match="n-gram table is .*vLLM's"):
        build(M, cfg)


def test_loader_skips_only_the_tables(vllm_env):
    skip = plugin.TABLE_TENSOR.search
    assert skip("model.ngram_embeddings.embedders.0.weight") and skip("model.ngram_embeddings.embedders.11.weight")
    assert not skip("model.ngram_embeddings.post_projs.0.weight") and not skip("model.embed_tokens.weight")
