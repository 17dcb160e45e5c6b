"""The numpy oracle of Qwen4ExpTextPLELayer (DESIGN.md 4b), in the module's own terms.

Small and obvious on purpose: one line per step of the module's forward, float32 like the
torch reference, on the module's arrays (key_proj, value_proj, the raw norm weights w of
x * (1 + w)). Do not optimize this file.
"""
from __future__ import annotations

import math

import numpy as np

GATE_CLAMP = np.float32(1e-6)  # gate.abs().clamp_min(1e-6)


def grouped_rms_norm(x, w, group, eps):
    """Qwen4ExpTextRMSNorm(group_size=group): each group of the last axis normalized on its own,
    then scaled by (1 + w)."""
    g = x.reshape(*x.shape[:-1], -1, group)
    ms = np.mean(np.square(g), axis=-1, keepdims=True, dtype=np.float32)
    out = (g / np.sqrt(ms + np.float32(eps))).reshape(x.shape)
    return (out * (np.float32(1) + w)).astype(np.float32)


def forward(cfg, rows, layer, hidden):
    """PLE output for one layer.

    rows    int64[B, T, H]   head-local rows from HashPlan.hash / hash_numpy
    layer   PLEWeights       (qwen.weights: table, key_proj, value_proj, norm_*_w, conv_w)
    hidden  float32[B, T, G, D]
    returns float32[B, T, G, D]  (the decoder layer adds it to hidden)
    """
    B, T, H = rows.shape
    G, D, eps = cfg.hc_mult, cfg.hidden_size, cfg.norm_eps
    e = layer.table_f32(rows + layer.offsets).reshape(B, T, cfg.engram_dim)  # the H rows concatenated
    key = grouped_rms_norm(e @ layer.key_proj.astype(np.float32).T, layer.norm_key_w, D, eps).reshape(B, T, G, D)
    value = (e @ layer.value_proj.astype(np.float32).T).astype(np.float32)    # [B, T, D]: one for all streams
    query = grouped_rms_norm(hidden.reshape(B, T, G * D), layer.norm_query_w, D, eps).reshape(B, T, G, D)
    s = np.sum(key * query, axis=-1, keepdims=True, dtype=np.float32) / np.float32(math.sqrt(D))
    s = np.sqrt(np.maximum(np.abs(s), GATE_CLAMP)) * np.sign(s)
    gated = (np.float32(1) / (np.float32(1) + np.exp(-s)) * value[:, :, None, :]).astype(np.float32)
    gated = gated.reshape(B, T, G * D)
    x = grouped_rms_norm(gated, layer.norm_conv_w, D, eps)
    # depthwise causal conv over time, dilation ngram_size, K taps: tap i reads x[t - (K-1-i)*dil]
    K, dil = cfg.kernel_size, cfg.max_ngram_size
    y = np.zeros_like(x)
    for i in range(K):
        shift = (K - 1 - i) * dil
        if shift < T:
            y[:, shift:, :] += layer.conv_w[:, i] * x[:, :T - shift, :]
    with np.errstate(over="ignore"):
        silu = y / (np.float32(1) + np.exp(-y))
    return (gated + silu).astype(np.float32).reshape(B, T, G, D)
