"""deepseek-v4.1 files: the HF folder layout (config.json, index, shards, tokenizer.json),
save/load, tables mapped in place, the synthetic checkpoint writer, build_compression(decode=)."""
from __future__ import annotations

import json
import mmap
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, build_compression
from engram_stream import hf_v41

SMALL = dict(variant="deepseek-v4.1", engram_vocab_size=[211, 211, 211], max_ngram_size=4,
             n_embed_per_ngram=64, n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64,
             hc_mult=2, vocab_size=300, image_token_id=299)


def is_file_view(a):
    """True when the array's memory is a mapping of a file (np.memmap / mmap in the .base chain)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return False


def inputs(seed=0, T=11):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 300, (2, T))
    ids[0, 4] = 299
    return ids, rng.standard_normal((2, T, 2, 64)).astype(np.float32)


@pytest.mark.parametrize("mmap_", [True, False])
def test_save_load_round_trip(tmp_path, mmap_):
    lookup = np.random.default_rng(1).permutation(300) % 260
    m = EngramModel.init(EngramConfig(**SMALL), seed=4, compression=lookup)
    m.save(tmp_path / "ckpt")
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert "config.json" in files and hf_v41.INDEX in files and hf_v41.COMPRESSION in files
    assert sum(f.endswith(".safetensors") for f in files) == 2
    back = EngramModel.load(str(tmp_path / "ckpt"), mmap=mmap_)
    assert back.cfg.num_embeddings == [back.plan.table_rows[1], back.plan.table_rows[4]]
    assert back.cfg.compressed_vocab_size == 260
    assert np.array_equal(back.plan.lookup, lookup)
    for L in (1, 4):
        for name in ("embed_weight", "embed_scale", "wkv_weight", "wkv_scale", "q_weight", "k_weight"):
            a, b = getattr(m.layer(L), name), getattr(back.layer(L), name)
            assert np.array_equal(a, b) and not b.flags.writeable and b.flags.c_contiguous, name
        assert is_file_view(back.layer(L).embed_weight) == mmap_
    ids, h = inputs()
    assert np.array_equal(back.forward(4, ids, h), m.forward(4, ids, h))


def test_synthetic_checkpoint_with_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    cfg = hf_v41.make_synthetic(tmp_path, EngramConfig(**SMALL), seed=3, n_shards=3)
    with open(tmp_path / hf_v41.INDEX) as f:
        wm = json.load(f)["weight_map"]
    assert len(set(wm.values())) == 3 and "embed.weight" in wm and "layers.1.attn_norm.weight" in wm
    assert {n for n in wm if ".engram." in n} == {f"layers.{L}.engram.{s}" for L in (1, 4) for s in hf_v41.NAMES}
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    # make_tokenizer: "wN", "WN", " wN" share a key; the pad and image tokens have their own
    assert hf["engram_compressed_vocab_size"] == cfg.compressed_vocab_size == 2 + len({i // 3 for i in range(300)
                                                                                    if i not in (2, 299)})
    m = EngramModel.from_deepseek_v41(tmp_path)
    assert m.cfg == cfg == EngramConfig.from_hf_config(tmp_path)
    assert m.plan.lookup[3] == m.plan.lookup[4] == m.plan.lookup[5]   # w1, W1, " w1"
    assert all(is_file_view(m.layer(L).embed_weight) for L in (1, 4))
    ids, h = inputs(2)
    y = m.forward(1, ids, h)
    assert np.isfinite(y).all() and not y[0, 4].any() and np.abs(y).max() > 0


def test_loader_accepts_model_prefix_f32_qk_and_single_file(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=5)
    tensors = []
    for L in (1, 4):
        for short in hf_v41.NAMES:
            a = getattr(m.layer(L), short.replace(".", "_"))
            tensors.append(hf_v41.Tensor(f"model.layers.{L}.engram.{short}", hf_v41.RAW_CODE.get(short, "F32"),
                                         a.shape, hf_v41._array_chunks(a)))
    hf_v41.write(tmp_path, hf_v41.declared(m.cfg, m.plan), tensors, n_shards=1)
    os.rename(tmp_path / "model-00001-of-00001.safetensors", tmp_path / "model.safetensors")
    os.remove(tmp_path / hf_v41.INDEX)
    back = EngramModel.from_deepseek_v41(tmp_path)
    ids, h = inputs(3)
    assert np.array_equal(back.forward(1, ids, h), m.forward(1, ids, h))


def test_safetensors_reads_our_shards(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    m = EngramModel.init(EngramConfig(**SMALL), seed=6)
    m.save(tmp_path)
    with open(tmp_path / hf_v41.INDEX) as f:
        wm = json.load(f)["weight_map"]
    for L in (1, 4):
        name = f"layers.{L}.engram.embed.scale"
        t = st.load_file(str(tmp_path / wm[name]))[name]
        assert t.dtype == torch.float8_e8m0fnu
        assert np.array_equal(t.view(torch.uint8).numpy(), m.layer(L).embed_scale)


def test_mismatched_declared_sizes_refuse_to_load(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    rows = hf["engram_num_embeddings"][1]
    hf["engram_num_embeddings"][1] = rows + 1
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"{rows}.*{rows + 1}"):
        EngramModel.from_deepseek_v41(tmp_path)


def test_truncated_or_missing_shards_are_refused(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    shard = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))[0]
    with open(tmp_path / shard, "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / shard) - 100)
    with pytest.raises(hf_v41.HFCheckpointError, match="do not fit"):
        EngramModel.from_deepseek_v41(tmp_path)
    os.remove(tmp_path / shard)
    with pytest.raises(OSError):
        EngramModel.from_deepseek_v41(tmp_path)
    with pytest.raises(hf_v41.HFCheckpointError, match="no config.json"):
        EngramModel.from_deepseek_v41(tmp_path / "nothing")



def test_hostile_shards_are_refused_cleanly(tmp_path):
    """A shard that is a FIFO (opening it would block), a header nested 1e5 deep, and an index
    that is not JSON: each a HFCheckpointError naming the file, never a hang or RecursionError."""
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    saved = (tmp_path / shards[0]).read_bytes()
    os.remove(tmp_path / shards[0])
    os.mkfifo(tmp_path / shards[0])
    with pytest.raises(hf_v41.HFCheckpointError, match="not a regular file"):
        EngramModel.from_deepseek_v41(tmp_path)
    os.remove(tmp_path / shards[0])
    deep = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / shards[0]).write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(hf_v41.HFCheckpointError, match="not JSON"):
        EngramModel.from_deepseek_v41(tmp_path)
    (tmp_path / shards[0]).write_bytes(saved)
    (tmp_path / hf_v41.INDEX).write_text("{" * 100_000)
    with pytest.raises(hf_v41.HFCheckpointError, match="not a JSON index"):
        EngramModel.from_deepseek_v41(tmp_path)


def test_shard_writes_are_atomic_and_never_follow_a_planted_link(tmp_path, monkeypatch):
    """A shard is written to a temp file of its own and renamed: a failing write leaves the old
    shard and no temp file; a symlink planted at the temp name is neither followed nor removed."""
    from engram_stream.io import files
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_bytes(b"keep me")
    planted = str(tmp_path / "planted.tmp")
    os.symlink(victim, planted)
    monkeypatch.setattr(files, "_temp_name", lambda path: planted)
    with pytest.raises(FileExistsError):
        m.save(tmp_path)
    assert victim.read_bytes() == b"keep me" and os.path.islink(planted)
    os.remove(planted)
    monkeypatch.undo()
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        m.save(tmp_path)
    monkeypatch.undo()
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before  # old files, no temps


# --- build_compression(decode=) ------------------------------------------------------------------

def test_build_compression_decode_modes():
    pytest.importorskip("tokenizers")
    tok = hf_v41.make_tokenizer(30, 2, 29)
    backend = build_compression(tok, decode="backend")
    assert np.array_equal(backend, build_compression(tok))  # a tokenizers.Tokenizer: no Python layer

    class TransformersLike:  # a Python decode with a clean-up step of its own (upper-cases "w")
        backend_tokenizer = tok

        def decode(self, ids, skip_special_tokens=False):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens).replace("w", "X")

        def convert_ids_to_tokens(self, i):
            return tok.id_to_token(i)

    obj = TransformersLike()
    assert np.array_equal(build_compression(obj, decode="backend"), backend)
    python = build_compression(obj, decode="python")   # "X1" lower-cases to "x1", apart from "W1"
    assert backend[3] == backend[4] == backend[5]       # w1, W1, " w1"
    assert python[3] == python[5] != python[4]          # X1, W1, " X1"
    with pytest.raises(ValueError, match="decode must be one of"):
        build_compression(tok, decode="rust")


# --- the command line ----------------------------------------------------------------------------

def test_cli_inspect_v41_folder(tmp_path, capsys):
    from engram_stream.cli import main
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    primes = m.plan.primes[4][2]
    assert "DEAD token 299" in out and "gate eps 1e-20" in out and f"order 4: primes {primes}" in out
    assert f"table [{m.plan.table_rows[4]}, 32] float8_e4m3fn" in out


def test_cli_demo_v41_folder(tmp_path, capsys):
    pytest.importorskip("engram_stream._engine_v41")  # the V4.1 streaming engine (its own branch)
    from engram_stream.cli import main
    EngramModel.init(EngramConfig(**SMALL), seed=0).save(tmp_path / "ckpt")
    assert main(["demo", "--checkpoint", str(tmp_path / "ckpt"), "--tokens", "40"]) == 0
    assert ": OK" in capsys.readouterr().out


def test_readme_v41_snippet_runs(tmp_path):
    """The README's V4.1 decode, run on a tiny synthetic folder in place of the real one."""
    pytest.importorskip("engram_stream._engine_v41")
    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "README.md")).read()
    block = readme.split("## DeepSeek-V4.1", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    EngramModel.init(EngramConfig(**{**SMALL, "layer_ids": [1, 14]}), seed=0).save(tmp_path)
    scope = {}
    exec(block.replace('"DeepSeek-V4.1-Flash"', repr(str(tmp_path))), scope)
    assert scope["delta"].shape == (2, 64) and np.abs(scope["delta"]).max() > 0


def test_forward_refuses_a_shard_rewritten_after_mapping(tmp_path):
    from engram_stream.store import FileChangedError
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    back = EngramModel.from_deepseek_v41(tmp_path)
    ids, h = inputs()
    back.forward(1, ids, h)
    with open(tmp_path / "model.safetensors.index.json") as f:
        shard = json.load(f)["weight_map"]["layers.1.engram.embed.weight"]
    with open(tmp_path / shard, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(FileChangedError):
        back.forward(1, ids, h)


def test_tokenizer_shorter_than_vocab_maps_the_rest_to_pad(tmp_path):
    """Real checkpoints pad the embedding past the tokenizer's last id (vocab_size 129280)."""
    pytest.importorskip("tokenizers")
    cfg = EngramConfig(**SMALL)
    tok = hf_v41.make_tokenizer(300, 2, 299)
    lookup = build_compression(tok, decode="backend")
    short = hf_v41.make_tokenizer(250, 2, 299)   # ids 250.. have no token (the image id 299 too)
    m = EngramModel.init(cfg, seed=0, compression=np.concatenate([build_compression(short, decode="backend"),
                                                                   np.full(50, lookup[2])]))
    m.save(tmp_path)
    os.remove(tmp_path / hf_v41.COMPRESSION)
    short.save(str(tmp_path / "tokenizer.json"))
    back = EngramModel.from_deepseek_v41(tmp_path)
    assert len(back.plan.lookup) == 300 and (back.plan.lookup[250:] == back.plan.lookup[2]).all()
    assert np.array_equal(back.plan.lookup, m.plan.lookup)
