"""The SGLang seam's LongCat-Flash-Lite side (engram_stream.integrations.sglang, its LongCat section) against
SGLang 0.5.23's own n-gram embedding (sglang.srt.layers.n_gram_embedding.NgramEmbedding), on CPU, with
get_parallel() stubbed for the tensor-parallel rank.

SGLang's stock module is filled through its load_weight (as LongcatFlashForCausalLM.load_weights
calls it) from a small LongCat folder written by engram_stream; after install() SGLang's
NgramEmbedding builds the plugin's table module, which reads the same folder through each row
source. Given the same n-gram ids (vLLM's kernel's, EOS positions included: the rows are served by
id), SGLang's forward gives the same bytes; load_weight skips the embedders, the plugin's table
module holds no table. Runs in the SGLang pytest process of tools/ci_vllm.sh (test_sglang's
torchvision stub); skipped without SGLang."""
from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import test_sglang  # noqa: E402,F401  (SGLang importable on CPU: its torchvision stub; skips without SGLang)

N = pytest.importorskip("sglang.srt.layers.n_gram_embedding")
import sglang.srt.layers.vocab_parallel_embedding as V  # noqa: E402

from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.integrations import serving  # noqa: E402

from helpers.row_sources import PLUGIN_SOURCES  # noqa: E402
import longcat_ids as LC  # noqa: E402
from test_sglang_qwen import stub_parallel  # noqa: E402

plugin = pytest.importorskip("engram_stream.integrations.sglang")

SOURCES = {k: v for k, v in PLUGIN_SOURCES.items() if "packed" not in k}




class _CpuTorch(types.ModuleType):
    """SGLang's module's `torch` with torch.zeros(device="cuda") on the CPU (its offsets buffer)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*a, device=None, **k):
        return torch.zeros(*a, device="cpu" if device == "cuda" else device, **k)


@pytest.fixture
def parallel(monkeypatch):
    """test_sglang_qwen's stubs (TP rank, no attention DP, all-reduce an identity), the offsets
    buffer SGLang makes on "cuda" on the CPU."""
    st = stub_parallel(monkeypatch, (N,))
    monkeypatch.setattr(N, "torch", _CpuTorch("torch"))
    yield st
    plugin.uninstall()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("longcat_sglang")
    m = EngramModel.init(EngramConfig.from_hf_config(LC.HF), seed=4)
    return {d: str(m.save(tmp / d, table_dtype=d)) for d in ("bfloat16", "float32")}


def build(cfg):
    m = cfg.ngram_vocab_size_ratio * cfg.vocab_size
    mod = N.NgramEmbedding(cfg.vocab_size, cfg.hidden_size, m, cfg.emb_split_num, cfg.emb_neighbor_num,
                           cfg.eos_token_id)
    mod.init_buffers(4, 64, "cpu")
    return mod


def load(mod, folder):
    """LongcatFlashForCausalLM.load_weights's n-gram part: the token embedding through its param's
    weight_loader, the rest through load_weight. Returns the names given."""
    import glob
    from safetensors.torch import load_file
    given = []
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        for name, t in load_file(f).items():
            given.append(name)
            if name == "model.embed_tokens.weight":
                mod.load_weight(mod.word_embeder.weight, "model.embed_tokens.word_embeder.weight", t)
            else:
                mod.load_weight(None, name, t)
    return given


def forward(mod, input_ids, oe_ids):
    """SGLang's forward with the ids given (a forward mode that computes none)."""
    mod.oe_n_gram_ids[:len(input_ids)] = oe_ids.to(torch.int32)
    mode = types.SimpleNamespace(is_extend=lambda: False, is_decode=lambda: False)
    return mod(input_ids, types.SimpleNamespace(forward_mode=mode))


def same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("table_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tp", [(1, 0), (2, 1)])
def test_plugin_forward_is_sglangs(parallel, folders, table_dtype, tp):
    parallel.tp_size, parallel.tp_rank = tp
    folder, cfg = folders[table_dtype], LC.framework_config()
    reqs = LC.batch(cfg, np.random.default_rng(5))
    input_ids, oe_ids = torch.from_numpy(np.concatenate(reqs)), LC.kernel_ids(cfg, reqs)
    stock = build(cfg)
    load(stock, folder)
    if tp[0] > 1:
        start = stock.oe_embeder.shard_indices.org_vocab_start_index
        assert start > 0 and (oe_ids >= start).any() and (oe_ids < start).any()
    want = forward(stock, input_ids, oe_ids)
    assert want.float().abs().sum() > 0
    for name, settings in SOURCES.items():
        plugin.install({**settings, "checkpoint": folder})
        serving._models.clear()
        mine = build(cfg)
        assert type(mine).__name__ == "StreamNgramEmbedding"
        emb = mine.oe_embeder
        assert type(emb).__name__ == "StreamPLEEmbedding" and not list(emb.parameters())   # no table
        assert type(mine.word_embeder) is V.VocabParallelEmbedding                          # SGLang's
        given = load(mine, folder)
        assert any(".embedders." in n for n in given)    # handed to load_weight, which skips them
        for _ in range(2):
            same_bytes(forward(mine, input_ids, oe_ids), want)
        plugin.uninstall()


def test_a_checkpoint_of_another_geometry_is_refused(parallel, folders):
    plugin.install({"checkpoint": folders["bfloat16"]})
    cfg = LC.framework_config()
    cfg.ngram_vocab_size_ratio = 6
    with pytest.raises(ValueError, match="n-gram tables start at rows"):
        build(cfg)


def test_install_needs_settings_before_the_build(parallel, folders):
    plugin.install({"checkpoint": folders["bfloat16"]})
    cls = N.NgramEmbedding
    plugin.uninstall()
    assert N.NgramEmbedding is not cls
    with pytest.raises(RuntimeError, match="call install"):
        object.__new__(cls).__init__(97, 48, 485, 2, 4, 2)
