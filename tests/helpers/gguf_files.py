"""GGUF files for the tests: tables of every ggml type (quantized by gguf.quants where it can,
well-formed random blocks where it cannot), their dequantized oracle, and files in the
converters' layouts (gguf.GGUFWriter) for small models of each variant. Import after
pytest.importorskip("gguf"): gguf is in the test extra, and the runtime never imports it."""
from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T

from engram_stream import EngramConfig, EngramModel

QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf.quants.quantize writes these


RANDOM_BLOCKS = ["IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]            # it cannot: random blocks


SCALE_AT = {  # byte offsets of each block's fp16 scales (kept finite in "well-formed" blocks)
    "Q4_0": [0], "IQ4_NL": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


U32, U64, ARR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64, gguf.GGUFValueType.ARRAY


I64 = gguf.GGUFValueType.INT64


def same_bits(got, want):
    """Equal float32 bits, NaN for NaN (numpy's NaN arithmetic may pick another payload)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bad = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)) & ~nan.ravel().reshape(got.shape))
    assert bad.size == 0, f"{bad.size} values differ, first at {bad[0]}: {got.ravel()[bad[0]]} != {want.ravel()[bad[0]]}"


def random_blocks(name, n_rows, row_length, rng):
    """[n_rows, row bytes] of well-formed blocks: every byte random but the fp16 scales, which
    are random finite halves (from tiny subnormals to 65504, both signs)."""
    bv, bb = gguf.GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, (n_rows, row_length // bv, bb), dtype=np.uint8)
    for at in SCALE_AT[name]:
        h = rng.integers(0, 0x7c00, raw.shape[:2], dtype=np.uint16) | (rng.integers(0, 2, raw.shape[:2], dtype=np.uint16) << 15)
        raw[:, :, at:at + 2] = h.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n_rows, -1)


def quantized(name, n_rows, row_length, rng):
    x = (rng.standard_normal((n_rows, row_length)) * rng.choice([1e-3, 1.0, 300.0], (n_rows, 1))).astype(np.float32)
    q = gguf.quants.quantize(x, T[name])
    return np.ascontiguousarray(q).view(np.uint8).reshape(n_rows, -1)


def e4m3_rows(n_rows, rng):
    """Checkpoint rows: 256 e4m3 bytes (every code, NaN 0x7f/0xff included) and 8 e8m0 scales."""
    return rng.integers(0, 256, (n_rows, 264), dtype=np.uint8)


def e4m3_oracle(raw):
    vals = raw[:, :256].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = raw[:, 256:].view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore"):  # 448 * 2^127 is inf in float32, in the C decoder too
        return vals * np.repeat(scales, 32, axis=1)


def table_bytes(name, n_rows, row_length, rng):
    return quantized(name, n_rows, row_length, rng) if name in QUANTIZABLE else random_blocks(name, n_rows, row_length, rng)


def write_gguf(path, arch, tensors, kv=(), alignment=None, **writer_kw):
    """tensors: name -> (raw bytes [rows, row bytes] or a float array, ggml type name)."""
    w = gguf.GGUFWriter(str(path), arch, **writer_kw)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in dict(kv).items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, (data, tname) in tensors.items():
        if tname in ("F32",):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=T[tname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- small models of each variant and GGUFs of their tables ------------------------------------

def qwen_model():
    from engram_stream.qwen.config import EXAMPLE
    cfg = {**EXAMPLE, "layer_ids": [2], "n_embed_per_ngram": 64}   # head_dim 32: one block of the 32-value types
    return EngramModel.init(EngramConfig(**cfg), seed=3)


def qwen_kv(m):
    cfg, plan, L = m.cfg, m.plan, m.cfg.layer_ids[0]
    return {"qwen4exp.ple.layers": ([L], ARR, U32), "qwen4exp.ple.ngram_size": (cfg.max_ngram_size, U32, None),
            "qwen4exp.ple.heads_per_ngram": (cfg.n_head_per_ngram, U32, None),
            "qwen4exp.embedding_length_per_layer_input": (cfg.head_dim, U32, None),
            "qwen4exp.ple.layer_multipliers": ([int(x) % 2**64 for x in plan.multipliers[L]], ARR, U64),
            "qwen4exp.ple.head_vocab_sizes": ([int(x) for x in plan.head_primes[L]], ARR, U64)}


def longcat_model():
    from engram_stream.longcat.config import EXAMPLE
    return EngramModel.init(EngramConfig(**{**EXAMPLE, "n_embed_per_ngram": 64, "hidden_size": 128}), seed=4)  # head_dim 32


def longcat_kv(m):
    cfg = m.cfg
    return {"longcat_flash_ngram.ngram.neighbor_num": (cfg.max_ngram_size, U32, None),
            "longcat_flash_ngram.ngram.split_num": (cfg.n_head_per_ngram, U32, None)}


def v41_kv(m):
    cfg, plan = m.cfg, m.plan
    return {"deepseek41.engram.layer_ids": (list(cfg.layer_ids), ARR, U32),
            "deepseek41.engram.head_count": (cfg.n_head_per_ngram, U32, None),
            "deepseek41.engram.key_length": (cfg.head_dim, U32, None),
            "deepseek41.engram.multipliers": ([int(x) for L in cfg.layer_ids for x in plan.multipliers[L]], ARR, I64)}


def quantized_table(name, rows, hd, rng):
    """(the GGUF tensor's data and type name, float32 [rows, hd] as gguf-py dequantizes it)."""
    if name == "E4M3":   # ds4's I8 tensor of the checkpoint's 264-byte rows, finite scales
        raw = e4m3_rows(rows, rng)
        raw[:, :256] &= 0xF7   # no e4m3 NaN code (0x7f, 0xff): the oracle's numbers stay finite
        raw[:, 256:] = rng.integers(118, 130, (rows, 8))
        return (raw.view(np.int8), "I8"), e4m3_oracle(raw)
    raw = table_bytes(name, rows, hd, rng)
    if name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"):   # random blocks: scales of a real table's size
        deq = gguf.quants.dequantize(raw, T[name]).reshape(rows, hd)
        big = np.abs(deq).max(axis=1) > 64
        raw[big] = table_bytes(name, int(big.sum()), hd, rng) if big.any() else raw[big]
        raw = _tame(name, raw, hd, rng)
    return (raw, name), gguf.quants.dequantize(raw, T[name]).reshape(rows, hd)


def _tame(name, raw, hd, rng):
    """Random K-quant blocks with small fp16 super-scales (the values a quantizer writes)."""
    bv, bb = gguf.GGML_QUANT_SIZES[T[name]]
    b = raw.reshape(raw.shape[0], hd // bv, bb).copy()
    for at in SCALE_AT[name]:
        h = (rng.uniform(1e-4, 2e-2, b.shape[:2]) * rng.choice([-1, 1], b.shape[:2])).astype(np.float16)
        b[:, :, at:at + 2] = h.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(raw.shape[0], -1)


def write_table_gguf(path, model, name, seed=0, split=False):
    """A GGUF of `model`'s layout with random tables of type `name` (split: qwen4exp's per-head
    tensors; LongCat's are always one an embedder); {layer: dequantized table}."""
    rng = np.random.default_rng(seed)
    cfg, plan = model.cfg, model.plan
    tensors, deq = {"output_norm.weight": (np.ones(7, np.float32), "F32")}, {}   # the table 32-aligned, not paged
    arch = {"qwen": "qwen4exp", "deep": "deepseek41", "long": "longcat_flash_ngram"}[cfg.variant[:4]]
    for L in cfg.layer_ids:
        if arch == "deepseek41":
            tensors[f"blk.{L}.engram_embd.weight"], deq[L] = quantized_table(name, plan.table_rows[L], cfg.head_dim, rng)
        elif arch == "qwen4exp" and not split:
            tensors["per_layer_token_embd.weight"], deq[L] = quantized_table(name, plan.table_rows[L], cfg.head_dim, rng)
        else:   # one tensor a head (an embedder), its rows only: the table's padding rows are zeros
            parts = [quantized_table(name, int(p), cfg.head_dim, rng) for p in plan.head_primes[L]]
            pattern = "ple_ngram_embd.{}.weight" if arch == "qwen4exp" else "ngram_embd.{}.weight"
            for h, (data, _) in enumerate(parts):
                tensors[pattern.format(h)] = data
            deq[L] = np.concatenate([d for _, d in parts])
            deq[L] = np.concatenate([deq[L], np.zeros((plan.table_rows[L] - deq[L].shape[0], cfg.head_dim), np.float32)])
    kv = {"qwen4exp": qwen_kv, "deepseek41": v41_kv, "longcat_flash_ngram": longcat_kv}[arch](model)
    write_gguf(path, arch, tensors, kv)
    return deq
