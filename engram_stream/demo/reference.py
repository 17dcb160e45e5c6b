"""The numpy batch forward: the oracle every fast path is held to.

Small and obvious on purpose: one line per step of DESIGN.md 1.5-1.9, float32
like the torch reference, no fusion, no cleverness. Do not optimize this file.
"""
from __future__ import annotations

import math

import numpy as np

from .._hash import EPS_CONV, EPS_KEY, GATE_CLAMP  # include/engram_consts.h, their one source

EPS_F32 = EPS_KEY  # float32 machine epsilon: torch RMSNorm's default when eps is None


def rms_norm(x, weight, eps):
    """Weighted RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(ms + np.float32(eps)) * weight).astype(np.float32)


def silu(x):
    with np.errstate(over="ignore"):
        return (x / (np.float32(1) + np.exp(-x))).astype(np.float32)


def forward(cfg, rows, layer, hidden):
    """Engram output for one layer.

    rows    int64[B, T, H]   head-local rows from HashPlan.hash / hash_numpy
    layer   LayerWeights     (demo.weights.LayerWeights: table, key_w, key_b, value_w, ..., eps_qk, eps_conv:
                             EPS_F32 and EPS_CONV for the demo module)
    hidden  float32[B, T, G, D]
    returns float32[B, T, G, D]  (the caller adds the residual)
    """
    B, T, H = rows.shape
    G, D = cfg.hc_mult, cfg.hidden_size
    # 1.5 retrieval: each head's rows start at its offset; concatenate the H rows
    e = layer.table_f32(rows + layer.offsets).reshape(B, T, cfg.engram_dim)
    # 1.6 gate per hyper-connection stream
    gates = []
    for g in range(G):
        k = rms_norm(e @ layer.key_w[g].T + layer.key_b[g], layer.norm1[g], layer.eps_qk)
        q = rms_norm(hidden[:, :, g, :], layer.norm2[g], layer.eps_qk)
        s = np.sum(k * q, axis=-1, dtype=np.float32) / np.float32(math.sqrt(D))
        s = np.sign(s) * np.sqrt(np.maximum(np.abs(s), np.float32(GATE_CLAMP)))
        gates.append(np.float32(1) / (np.float32(1) + np.exp(-s)))
    gate = np.stack(gates, axis=2)[..., None]                        # [B, T, G, 1]
    # 1.7 value: one projection shared by all streams
    v = (gate * (e @ layer.value_w.T + layer.value_b)[:, :, None, :]).astype(np.float32)
    # 1.8 ShortConv: per-stream RMSNorm, channels stream-major, dilated causal taps, SiLU
    x = np.stack([rms_norm(v[:, :, g, :], layer.conv_norm[g], layer.eps_conv) for g in range(G)], axis=2)
    x = x.reshape(B, T, G * D)
    K, dil = cfg.kernel_size, cfg.max_ngram_size
    y = np.zeros_like(x)
    for i in range(K):
        shift = (K - 1 - i) * dil                                    # tap i reads x[t - shift]
        if shift < T:
            y[:, shift:, :] += layer.conv_w[:, i] * x[:, :T - shift, :]
    # 1.9 output
    return (v + silu(y).reshape(B, T, G, D)).astype(np.float32)
