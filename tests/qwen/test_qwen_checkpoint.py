"""qwen3.8-flash-next checkpoints: the folder transformers' save_pretrained writes (float32 and
bfloat16, the table in split_ngram_parts parts) loads into a model whose oracle and engine equal
that model's own PLE layers; hand-made folders (a text_config, the model.language_model. prefix,
an index over shards, table parts spread over files, other tensors beside) load to the same
weights; damaged folders are refused; `engram-stream init` writes a folder that loads."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.errors import CheckpointError
from engram_stream.io import safetensors
from engram_stream.io.files import MappedFile, mapping_of
from helpers.numeric import close

pytestmark = pytest.mark.native

EOS = 7
HF = {"model_type": "qwen4_exp_text", "vocab_size": 100, "hidden_size": 16, "hc_count": 2, "num_hidden_layers": 4,
      "ple_layer_ids": [1, 3], "ple_embed_dim": 16, "ngram_size": 3, "heads_per_ngram": 2,
      "ngram_vocab_size_base": 50, "make_ngram_vocab_size_divisible_by": 8, "eos_token_id": [EOS],
      "split_ngram_parts": 4, "rms_norm_eps": 1e-5}
# the rest of a tiny Qwen4-Exp text model, for transformers
BACKBONE = {"hc_lowrank": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
            "indexer_budget": 8, "indexer_compress_ratio": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"]}


def inputs(cfg, B=2, T=20, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int64)
    ids[rng.random(ids.shape) < 0.2] = EOS
    ids[:, 0] = EOS
    return ids, rng.standard_normal((B, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loads_what_transformers_saves(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    tcfg = Qwen4ExpTextConfig(**{k: v for k, v in {**HF, **BACKBONE}.items() if k != "model_type"})
    torch.manual_seed(1)
    lm = M.Qwen4ExpForCausalLM(tcfg)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".ple." in name:  # its init leaves norms and taps 0
                p.normal_(0, 0.3)
    lm = lm.to(getattr(torch, dtype))
    lm.save_pretrained(tmp_path)
    names = safetensors.SafetensorsFile(tmp_path / "model.safetensors").tensors
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight" in names  # the parts layout

    model = EngramModel.load(tmp_path)
    cfg = model.cfg
    assert cfg.variant == "qwen3.8-flash-next" and cfg.layer_ids == [1, 3]
    ids, hid = inputs(cfg)
    for L in cfg.layer_ids:
        ple = lm.model.layers[L - 1].ple.float()  # the weights as stored, in float32 arithmetic
        with torch.no_grad():
            want = ple(torch.from_numpy(hid.reshape(2, 20, -1)), torch.from_numpy(ids), None).numpy()
        want = want.reshape(hid.shape)
        close(model.forward(L, ids, hid), want)
        eng = model.stream(L, n_streams=2)
        close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(ids.shape[1])], 1), want)


def _tensors(model, prefix):
    """{name: array} of a model's PLE layers as a checkpoint names them, the table in table_parts parts."""
    out = {}
    for L, w in model.layers.items():
        sd = w.state_dict(model.cfg)
        table = sd.pop("ple_embedding.ngram_embedding.weight")
        bounds = np.linspace(0, len(table), model.cfg.table_parts + 1).astype(int)
        for i in range(model.cfg.table_parts):
            out[f"{prefix}layers.{L - 1}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"] = table[bounds[i]:bounds[i + 1]]
        out.update({f"{prefix}layers.{L - 1}.ple.{k}": v for k, v in sd.items()})
    return out


def _write_folder(folder, cfg_json, tensors, n_files):
    """An indexed folder: tensors dealt round-robin over n_files files (a layer's parts land in several)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg_json))
    names = sorted(tensors)
    files = {f"model-{i + 1:05d}-of-{n_files:05d}.safetensors": names[i::n_files] for i in range(n_files)}
    for f, ns in files.items():
        safetensors.write(folder / f, [safetensors.Tensor.of(n, np.ascontiguousarray(tensors[n])) for n in ns])
    wm = {n: f for f, ns in files.items() for n in ns}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def test_a_nested_config_prefixed_names_and_parts_over_files(tmp_path):
    cfg = EngramConfig.from_hf_config(HF)
    orig = EngramModel.init(cfg, seed=3)
    tensors = _tensors(orig, "model.language_model.")
    tensors["model.language_model.layers.1.mlp.gate.weight"] = np.ones((4, 16), np.float32)  # not PLE: not read
    tensors["model.language_model.layers.1.ple.key_proj.weight"] = np.ones((3, 3), np.float32)  # not a PLE layer
    nested = {"model_type": "qwen4_exp", "image_token_id": 99, "text_config": {**HF, "model_type": "qwen4_exp_text"}}
    _write_folder(tmp_path / "q", nested, tensors, n_files=3)
    model = EngramModel.load(tmp_path / "q")
    assert model.cfg == cfg
    ids, hid = inputs(cfg, seed=4)
    for L in cfg.layer_ids:
        np.testing.assert_array_equal(model.layer(L).table, orig.layer(L).table)
        np.testing.assert_array_equal(model.forward(L, ids, hid), orig.forward(L, ids, hid))


def test_save_then_load_keeps_every_bit_and_maps_the_tables(tmp_path):
    cfg = EngramConfig.from_hf_config(HF)
    orig = EngramModel.init(cfg, seed=5)
    orig.save(tmp_path / "q")
    back = EngramModel.load(tmp_path / "q")
    ids, hid = inputs(cfg, seed=6)
    for L in cfg.layer_ids:
        assert back.layer(L).table.base is not None and not back.layer(L).table.flags.owndata  # a view of the file
        np.testing.assert_array_equal(back.forward(L, ids, hid), orig.forward(L, ids, hid))
    assert EngramConfig.from_hf_config(json.loads((tmp_path / "q" / "config.json").read_text())) == cfg


@pytest.mark.parametrize("damage, needle", [
    ("drop part", "shard_0..shard_"),
    ("short table", "rows"),
    ("bad multipliers", "layer_multipliers"),
    ("no key_proj", "key_proj"),
])
def test_damaged_folders_are_refused(tmp_path, damage, needle):
    cfg = EngramConfig.from_hf_config(HF)
    tensors = _tensors(EngramModel.init(cfg, seed=7), "model.")
    if damage == "drop part":
        del tensors["model.layers.2.ple.ple_embedding.ngram_embedding.shard_1.weight"]
    elif damage == "short table":
        t = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight"
        tensors[t] = tensors[t][:-1]
    elif damage == "bad multipliers":
        tensors["model.layers.0.ple.ple_embedding.layer_multipliers"] = np.array([1, 3, 5], np.int64)
    else:
        del tensors["model.layers.2.ple.key_proj.weight"]
    _write_folder(tmp_path / "q", HF, tensors, n_files=2)
    with pytest.raises(CheckpointError, match=needle):
        EngramModel.load(tmp_path / "q")


def test_cli_init_writes_a_folder_that_loads(tmp_path):
    from engram_stream.cli import main
    from engram_stream.qwen.config import EXAMPLE
    (tmp_path / "cfg.json").write_text(json.dumps(EXAMPLE))
    assert main(["init", str(tmp_path / "cfg.json"), "-o", str(tmp_path / "q")]) == 0
    model = EngramModel.load(tmp_path / "q")
    assert model.cfg == EngramConfig(**EXAMPLE)
    ids, hid = inputs(model.cfg, seed=8)
    want = EngramModel.init(model.cfg, seed=0)  # init's default weight seed
    for L in model.cfg.layer_ids:
        close(model.forward(L, ids, hid), want.forward(L, ids, hid))



def test_a_file_of_the_folder_names_the_qwen_folder(tmp_path):
    from engram_stream.cli import main
    EngramModel.init(EngramConfig.from_hf_config(HF), seed=0).save(tmp_path / "q")
    with pytest.raises(CheckpointError, match="qwen3.8-flash-next folder"):
        EngramModel.load(tmp_path / "q" / "config.json")
    assert main(["inspect", str(tmp_path / "q")]) == 0


# --- vLLM's quantized tables --------------------------------------------------------------------------
def _quantized_folder(tmp_path, kind, seed=9, scale=None, scale_code=None):
    """A folder whose tables are FP8 (vLLM: float8_e4m3fn parts, one global weight_scale) or NVFP4
    (uint8 parts of packed E2M1, shard_i.weight_scale E4M3 block scales, a global weight_scale_2),
    head_dim 16; returns (folder, {L: the raw arrays}). scale, scale_code: the global scale's stored
    array and safetensors code (float32 0.0123 / 0.37 by default)."""
    cfg = EngramConfig.from_hf_config({**HF, "ple_embed_dim": 64})
    tensors = _tensors(EngramModel.init(cfg, seed=seed), "model.")
    rng = np.random.default_rng(seed)
    raw = {}
    for L in cfg.layer_ids:
        pre = f"model.layers.{L - 1}.ple.ple_embedding.ngram_embedding"
        parts = [f"{pre}.shard_{i}.weight" for i in range(cfg.table_parts)]
        rows = [len(tensors[k]) for k in parts]
        for k in parts:
            del tensors[k]
        n = sum(rows)
        if kind == "fp8":
            codes = rng.integers(0, 256, (n, 16), dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
            g = np.array([0.0123], np.float32) if scale is None else scale
            raw[L] = (codes, g)
            tensors[f"{pre}.weight_scale"] = g
        else:
            codes = rng.integers(0, 256, (n, 8), dtype=np.uint8)
            bs = rng.integers(0x20, 0x50, (n, 1), dtype=np.uint8)  # e4m3 block scales around 1
            scale2 = np.array([0.37], np.float32) if scale is None else scale
            raw[L] = (codes, bs, scale2)
            tensors[f"{pre}.weight_scale_2"] = scale2
        bounds = np.cumsum([0] + rows)
        for i in range(len(rows)):  # the parts back to back in the file (then the scale parts): mapped
            tensors[f"{pre}.shard_{i}.weight"] = codes[bounds[i]:bounds[i + 1]]
        for i in range(len(rows) if kind == "nvfp4" else 0):
            tensors[f"{pre}.shard_{i}.weight_scale"] = bs[bounds[i]:bounds[i + 1]]
    folder = tmp_path / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**HF, "ple_embed_dim": 64}))
    e4m3 = lambda k: ".shard_" in k and (k.endswith(".weight_scale") or kind == "fp8")  # noqa: E731
    glob = lambda k: k.endswith((".ngram_embedding.weight_scale", ".weight_scale_2"))  # noqa: E731
    items = [safetensors.Tensor.of(k, np.ascontiguousarray(v), code="F8_E4M3" if e4m3(k) else
                                   scale_code if glob(k) else None) for k, v in tensors.items()]
    safetensors.write(folder / "model.safetensors", items)
    return folder, raw


def test_fp8_tables_as_vllm_dequantizes_them(tmp_path):
    """vLLM: embeddings.to(bf16) * weight_scale.to(bf16), in torch."""
    torch = pytest.importorskip("torch")
    folder, raw = _quantized_folder(tmp_path, "fp8")
    model = EngramModel.load(folder)
    for L, (codes, scale) in raw.items():
        want = (torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.bfloat16)
                * torch.from_numpy(scale).to(torch.bfloat16)).float().numpy()
        w = model.layer(L)
        assert w.table_format == "fp8" and w.table.dtype == np.uint8 and isinstance(mapping_of(w.table), MappedFile)
        np.testing.assert_array_equal(w.table_f32(slice(None)), want)
    ids, hid = inputs(model.cfg, seed=10)
    eng = model.stream(1)
    close(np.stack([eng.step(int(t), h) for t, h in zip(ids[0], hid[0])]), model.forward(1, ids, hid)[0])


def test_nvfp4_tables_as_vllm_dequantizes_them(tmp_path):
    """vLLM's NVFP4 lookup, written out in torch: low nibble first, E2M1 magnitudes, one E4M3
    scale per 16 values, times the global scale in float32, stored as bf16."""
    torch = pytest.importorskip("torch")
    folder, raw = _quantized_folder(tmp_path, "nvfp4")
    model = EngramModel.load(folder)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for L, (codes, bs, scale2) in raw.items():
        c = torch.from_numpy(codes).long()
        nib = torch.stack([c & 0xF, c >> 4], dim=-1).reshape(len(codes), -1)
        v = lut[nib & 7] * torch.where((nib & 8) != 0, -1.0, 1.0)
        s = torch.from_numpy(bs).view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
        want = (v * s * torch.from_numpy(scale2)).to(torch.bfloat16).float().numpy()
        w = model.layer(L)
        assert w.table_format == "nvfp4" and w.table.shape == (len(codes), 8)
        assert isinstance(mapping_of(w.table), MappedFile) and isinstance(mapping_of(w.table_scale), MappedFile)
        np.testing.assert_array_equal(w.table_f32(slice(None)), want)
    ids, hid = inputs(model.cfg, seed=11)
    for L in model.cfg.layer_ids:  # the engine gathers the codes: every row source gives the oracle's rows
        want = model.forward(L, ids, hid)
        for m in (model, EngramModel.load(folder, row_cache_mb=1), EngramModel.load(folder, tables="direct")):
            eng = m.stream(L, n_streams=2)
            close(np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(ids.shape[1])], 1), want)
    model.save(tmp_path / "values")  # written as the values vLLM gives
    back = EngramModel.load(tmp_path / "values")
    np.testing.assert_array_equal(back.layer(1).table, model.layer(1).table_f32(slice(None)))


def _dir(tmp_path, name):
    (tmp_path / name).mkdir()
    return tmp_path / name


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_a_global_scale_stored_as_e4m3_is_read_as_its_value(tmp_path, kind):
    """A global scale stored as F8_E4M3 (byte 0x38 = 1.0, 0x40 = 2.0) counts as its e4m3 value,
    as vLLM's float32 parameter takes it: the tables equal those of the same scale stored as float32."""
    for byte, value in ((0x38, 1.0), (0x40, 2.0)):
        e4m3, _ = _quantized_folder(_dir(tmp_path, f"e{byte}"), kind, scale=np.array([byte], np.uint8),
                                    scale_code="F8_E4M3")
        f32, _ = _quantized_folder(_dir(tmp_path, f"f{byte}"), kind, scale=np.array([value], np.float32))
        a, b = EngramModel.load(e4m3), EngramModel.load(f32)
        for L in a.cfg.layer_ids:
            got = a.layer(L).table_f32(slice(None))
            np.testing.assert_array_equal(got, b.layer(L).table_f32(slice(None)))


@pytest.mark.parametrize("code, stored", [("U8", np.array([0x38], np.uint8)), ("I8", np.array([1], np.int8)),
                                          ("F8_E4M3", np.array([0x7F], np.uint8))])
def test_a_global_scale_of_an_integer_dtype_or_not_finite_is_refused(tmp_path, code, stored):
    """Integer bytes are no scale value (vLLM's float parameter would take 0x38 as 56.0), an e4m3
    NaN no scale at all: refused, naming the tensor."""
    for kind, short in (("fp8", "ngram_embedding.weight_scale"), ("nvfp4", "weight_scale_2")):
        folder, _ = _quantized_folder(_dir(tmp_path, kind), kind, scale=stored, scale_code=code)
        with pytest.raises(CheckpointError, match=short) as e:
            EngramModel.load(folder)
        assert (code in str(e.value)) if code != "F8_E4M3" else "not a finite number" in str(e.value)


def test_direct_names_why_a_table_over_files_is_in_ram_and_reads_the_packed_row_file(tmp_path):
    """A table whose parts lie in several files is concatenated in RAM: tables="direct" refuses it
    naming that and pack-rows; with the packed row file written from the RAM table, direct reads
    the same bytes and the engine the same outputs as the table in RAM."""
    from engram_stream.cli import main
    from engram_stream.rows import packed
    cfg = EngramConfig.from_hf_config(HF)
    _write_folder(tmp_path / "q", HF, _tensors(EngramModel.init(cfg, seed=9), ""), n_files=3)
    ram = EngramModel.load(tmp_path / "q")
    assert all(mapping_of(ram.layer(L).table) is None for L in cfg.layer_ids)  # parts over files: in RAM
    with pytest.raises(ValueError) as e:
        EngramModel.load(tmp_path / "q", tables="direct")
    msg = str(e.value)
    assert "several files" in msg and "pack-rows" in msg and "mmap=True" not in msg
    assert main(["pack-rows", str(tmp_path / "q"), "--quiet"]) == 0
    direct = EngramModel.load(tmp_path / "q", tables="direct", row_cache_mb=1)
    assert direct.tier.inner.rows_path == packed.rows_path(tmp_path / "q")
    assert all(packed.verify_rows(direct, packed.rows_path(tmp_path / "q")).values())  # every record's bytes
    ids, hid = inputs(cfg, seed=10)
    for L in cfg.layer_ids:
        a, b = ram.stream(L, n_streams=2), direct.stream(L, n_streams=2)
        for t in range(ids.shape[1]):
            np.testing.assert_array_equal(b.step(ids[:, t], hid[:, t]), a.step(ids[:, t], hid[:, t]))
