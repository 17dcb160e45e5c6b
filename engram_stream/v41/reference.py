"""The numpy batch forward of the deepseek-v4.1 variant: the oracle its fast paths are held to.

Small and obvious on purpose, one line per step of DESIGN.md section 4, float8 emulated
explicitly with ml_dtypes (e4m3 values, e8m0 power-of-two scales), float32 everywhere
else: the reference module run with float32 as torch's default dtype (the released
generate.py runs bf16; the goldens pin both). Do not optimize this file.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .config import V41_BLOCK

E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)
FP8_MAX = 448.0
ACT_AMAX_MIN = 1e-4   # the activation quantizer's floor on a block's amax
from .._hash import GATE_CLAMP  # |dot| floor before the signed sqrt (include/engram_consts.h)


def e4m3(raw):
    """float32 values of raw float8_e4m3fn bytes."""
    return np.asarray(raw).view(E4M3).astype(np.float32)


def e8m0(raw):
    """float32 values of raw float8_e8m0fnu bytes: 2**(byte - 127)."""
    return np.asarray(raw).view(E8M0).astype(np.float32)


def dequant_rows(layer, rows):
    """Table rows (absolute indices, any shape) as float32 [..., head_dim]: e4m3 * its block's scale."""
    values = e4m3(layer.embed_weight[rows])                        # [..., head_dim]
    scales = e8m0(layer.embed_scale[rows])                         # [..., head_dim / 32]
    return values * np.repeat(scales, V41_BLOCK, axis=-1)


def pow2_ceil(x):
    """2**ceil(log2(x)) of positive float32 x, from the exponent and mantissa bits (as the
    reference's fast_round_scale does)."""
    bits = np.asarray(x, np.float32).view(np.int32)
    exponent = (bits >> 23) & 0xFF
    log2_ceil = exponent - 127 + ((bits & 0x7FFFFF) != 0)
    return ((log2_ceil + 127) << 23).astype(np.int32).view(np.float32)


def act_quant(x):
    """Per 32 values of the last axis: scale = 2**ceil(log2(max(amax, 1e-4) / 448)), values
    x / scale clamped to +-448 and rounded to e4m3. Returns (float32 values [..., K],
    float32 scales [..., K / 32])."""
    blocks = x.reshape(x.shape[:-1] + (-1, V41_BLOCK))
    amax = np.maximum(np.max(np.abs(blocks), axis=-1), np.float32(ACT_AMAX_MIN))
    scale = pow2_ceil(amax * np.float32(1 / FP8_MAX))
    q = np.clip(blocks / scale[..., None], -FP8_MAX, FP8_MAX).astype(E4M3).astype(np.float32)
    return q.reshape(x.shape), scale


def fp8_linear(x, weight_raw, scale_raw):
    """x[..., K] @ W.T for e4m3 W[M, K] with one e8m0 scale per 32x32 block: the activation is
    quantized per 32 values, each 32-wide K block is a float32 dot, scaled by both scales and
    accumulated in float32 in K order."""
    q, a_scale = act_quant(x)
    M, K = weight_raw.shape
    w = e4m3(weight_raw)
    w_scale = np.repeat(e8m0(scale_raw), V41_BLOCK, axis=0)[:M]    # [M, K / 32]
    acc = np.zeros(x.shape[:-1] + (M,), np.float32)
    for k in range(K // V41_BLOCK):
        cols = slice(k * V41_BLOCK, (k + 1) * V41_BLOCK)
        acc += (q[..., cols] @ w[:, cols].T) * a_scale[..., k:k + 1] * w_scale[:, k]
    return acc


def forward(cfg, rows, dead, layer, hidden):
    """Engram delta of one V4.1 layer.

    rows    int64[B, T, H]      head-local rows (HashPlan.hash / hash_numpy)
    dead    bool[B, T]          DEAD positions (HashPlan.dead_mask): gate 0
    layer   V41LayerWeights
    hidden  float32[B, T, G, D]
    returns float32[B, T, G, D] = gate * value (the reference returns h + that; the caller adds h)
    """
    B, T, H = rows.shape
    G, D = cfg.hc_mult, cfg.hidden_size
    e = layer.table_f32(rows + layer.offsets).reshape(B, T, cfg.engram_dim)   # 4.6: rows (dequant_rows)
    kv = fp8_linear(e, layer.wkv_weight, layer.wkv_scale)                         # 4.7: wkv
    key = kv[..., :G * D].reshape(B, T, G, D)
    value = kv[..., G * D:]                                                       # shared by streams
    eps = np.float32(cfg.norm_eps)                                                # 4.8: gate
    weight = layer.q_weight * layer.k_weight                                      # [G, D]
    rstd = (np.float32(1) / np.sqrt(np.mean(np.square(hidden), axis=-1) + eps)
            * np.float32(1) / np.sqrt(np.mean(np.square(key), axis=-1) + eps))
    dot = np.sum(hidden * weight * key, axis=-1) * rstd * np.float32(D ** -0.5)
    s = np.copysign(np.sqrt(np.maximum(np.abs(dot), np.float32(GATE_CLAMP))), dot)
    gate = np.float32(1) / (np.float32(1) + np.exp(-s))
    gate = np.where(dead[:, :, None], np.float32(0), gate)
    return (gate[..., None] * value[:, :, None, :]).astype(np.float32)
