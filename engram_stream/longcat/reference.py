"""The longcat-flash-lite numpy oracle (DESIGN.md 4c): the hash and the full-sequence forward,
written out plainly; every fast path (the engine, its batch) is held to it, and it is held to
the goldens of an independent torch implementation (tools/goldens/longcat.py).

Hash of position p for embedder c (order g = c // k + 2): sum over delta < g of id[p - delta] *
(vocab_size^delta mod mod_c), mod mod_c, on raw ids. The look-back (delta > 0) reads 0 (adds
nothing) at p - delta < 0 and at and before the newest EOS among ids[p - delta .. p - 1]: an EOS
hashes with its own look-back; the positions after it do not see past it.
"""
from __future__ import annotations

import numpy as np

from ..plan import as_ids
from .config import head_mods, table_sizes


def windows(cfg, ids) -> list:
    """[int64[B, T]] for delta = 0..n-1: the id delta positions back as the hash reads it (0 where
    the look-back stopped: before the start, or at or past an EOS before the position)."""
    a = as_ids(ids, 2)
    B, T = a.shape
    eos = a == cfg.pad_id
    out = [a.copy()]
    cut = np.zeros((B, T), bool)
    for d in range(1, cfg.max_ngram_size):
        back = np.zeros((B, T), np.int64)
        back[:, d:] = a[:, :T - d]
        was_eos = np.ones((B, T), bool)   # p - d < 0: cut
        was_eos[:, d:] = eos[:, :T - d]
        cut = cut | was_eos   # id[p-d] is EOS or before the start: it and every older id read 0
        out.append(np.where(cut, 0, back))
    return out


def rows(cfg, ids) -> np.ndarray:
    """int64[B, T, E]: each embedder's row (head-local, 0 <= row < mod_c) for ids[B, T]."""
    a = as_ids(ids, 2)
    if a.size and (a.min() < 0 or a.max() >= cfg.vocab_size):
        raise ValueError(f"token ids must be in [0, vocab_size={cfg.vocab_size}), got {a.min()}..{a.max()}")
    win = windows(cfg, a)
    mods, sizes = head_mods(cfg), table_sizes(cfg)
    heads = []
    for c in range(cfg.n_heads):
        acc = np.zeros(a.shape, np.int64)
        for d in range(cfg.max_ngram_size):
            acc = acc + win[d] * mods[c, d]
        heads.append(acc % sizes[c])
    return np.stack(heads, axis=2) if heads else np.zeros(a.shape + (0,), np.int64)


def forward_rows(cfg, w, ids, r) -> np.ndarray:
    """float32[B, T, D] from ids and their head-local rows r [B, T, E]: (embed[id] + sum_c
    post_projs[c] @ embedder_c[row_c]) / (1 + E), in float32."""
    a = as_ids(ids, 2)
    E, hd = cfg.n_heads, cfg.head_dim
    x = np.asarray(w.embed[a.reshape(-1)], np.float32).reshape(a.shape + (cfg.hidden_size,))
    for c, p in enumerate(w.post_projs(cfg)):
        e = w.table_f32((r[..., c] + w.offsets[c]).reshape(-1)).reshape(a.shape + (hd,))
        x = x + e @ np.asarray(p, np.float32).T
    return (x / np.float32(1 + E)).astype(np.float32)


def forward(cfg, w, ids) -> np.ndarray:
    """The oracle: float32[B, T, hidden_size], the embedding decoder layer 1 takes, for ids[B, T]."""
    return forward_rows(cfg, w, ids, rows(cfg, ids))
