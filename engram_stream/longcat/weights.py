"""The longcat-flash-lite variant's weights: LongcatWeights, random init, the module's state_dict.

LongCat's NgramEmbedding (DESIGN.md 4c) holds the token embedding (word_embeddings, the
checkpoint's model.embed_tokens), E embedders (embedders.{c}, [mod_c, hidden/E]) and E
projections (post_projs.{c}, Linear(hidden/E -> hidden), weight [hidden, hidden/E]). Here the
embedders are one table (rows at the plan's offsets, as vLLM concatenates them) and the
projections one matrix proj_w [hidden, hidden] whose columns [c*hd, (c+1)*hd) are post_projs[c]:
sum_c post_projs[c] @ row_c is proj_w @ (the E rows concatenated), one GEMM a chunk.
"""
from __future__ import annotations

import math

import numpy as np

from ..demo.weights import BF16, InitTable, aligned_zeros, state_dict_arrays, weight_dtype_of
from ..plan import frozen

TABLE_DTYPES = ("float32", "bfloat16")   # the engine gathers each (bfloat16: the released tables')
EMBED = "word_embeddings.weight"


def embedder(c) -> str:
    return f"embedders.{c}.weight"


def post_proj(c) -> str:
    return f"post_projs.{c}.weight"


def shapes(cfg, plan) -> dict:
    """{state_dict name: shape} of the NgramEmbedding module."""
    D, hd = cfg.hidden_size, cfg.head_dim
    out = {EMBED: (cfg.vocab_size, D)}
    for c, p in enumerate(plan.head_primes[0].tolist()):
        out[embedder(c)] = (p, hd)
        out[post_proj(c)] = (D, hd)
    return out


class LongcatWeights:
    """The n-gram embedding: table [sum mod_c, head_dim] (float32 or bfloat16; embedder c's rows
    from offsets[c]), embed [vocab, hidden] (float32 or bfloat16), proj_w [hidden, hidden]
    (float32 or bfloat16; post_projs concatenated by columns). Read-only views: the engines read
    them through raw pointers."""

    table_scale = None   # (the row sources' interface: no per-row scales)
    table_lut = None
    table_in_ram = None  # why a table loaded with mmap=True is not a view of its file

    def __init__(self, cfg, offsets, table, embed, proj_w):
        self.offsets = frozen(np.array(offsets, dtype=np.int64))
        self.table = frozen(table) if isinstance(table, np.ndarray) else table   # (save_init: an InitTable)
        self.embed = frozen(embed, weight_dtype_of(embed)) if isinstance(embed, np.ndarray) else embed
        self.proj_w = frozen(proj_w, weight_dtype_of(proj_w))
        self._packed = None

    def file_arrays(self) -> tuple:
        """The arrays that may be views of a mapped file (checked before they are read)."""
        return tuple(a for a in (self.table, self.embed, self.proj_w) if isinstance(a, np.ndarray))

    @property
    def table_dtype(self) -> str:
        return self.table.dtype.name

    table_format = table_dtype

    @property
    def weight_dtype(self) -> str:
        return self.proj_w.dtype.name

    def table_f32(self, rows) -> np.ndarray:
        return np.asarray(self.table[rows]).astype(np.float32)

    def post_projs(self, cfg) -> list:
        hd = cfg.head_dim
        return [self.proj_w[:, c * hd:(c + 1) * hd] for c in range(cfg.n_heads)]

    def packed(self):
        """proj_w in the engine's GEMM layout, built once and shared by every engine: panels
        [ceil(D/16), D, 16] (output columns 16 at a time), and a zero bias of 16*ceil(D/16)."""
        if self._packed is None:
            M, E = self.proj_w.shape
            P = -(-M // 16)
            wp = aligned_zeros((P, E, 16), self.proj_w.dtype)
            for p in range(P):
                cols = self.proj_w[p * 16:(p + 1) * 16]
                wp[p, :, :cols.shape[0]] = cols.T
            self._packed = (frozen(wp), frozen(aligned_zeros(P * 16, np.float32)))
        return self._packed

    def state_dict(self, cfg) -> dict:
        """The NgramEmbedding module's parameters (numpy float32), its names."""
        sd = {EMBED: np.asarray(self.embed, np.float32)}
        for c, p in enumerate(self.post_projs(cfg)):
            o = int(self.offsets[c])
            n = int(self.offsets[c + 1]) - o if c + 1 < cfg.n_heads else self.table.shape[0] - o
            sd[embedder(c)] = self.table_f32(slice(o, o + n))
            sd[post_proj(c)] = np.ascontiguousarray(p, np.float32)
        return sd


def validate_layer(cfg, plan, L, w):
    if not isinstance(w, LongcatWeights):
        raise TypeError(f"layer {L}: expected LongcatWeights, got {type(w).__name__}")
    D = cfg.hidden_size
    want = {"table": ((plan.table_rows[L], cfg.head_dim), TABLE_DTYPES), "embed": ((cfg.vocab_size, D), TABLE_DTYPES),
            "proj_w": ((D, D), TABLE_DTYPES)}
    for name, (shape, dtypes) in want.items():
        a = getattr(w, name)
        if not (isinstance(a, np.ndarray) and a.shape == shape and a.dtype.name in dtypes and a.flags.c_contiguous):
            raise ValueError(f"layer {L} {name}: expected a C-contiguous {' or '.join(dtypes)} array {shape}, got "
                             f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    if not np.array_equal(w.offsets, plan.offsets[L]):
        raise ValueError(f"layer {L} offsets {w.offsets[:4]}... are not the plan's {plan.offsets[L][:4]}...")


def init_layers(cfg, plan, seed=0, graft_zero_init=False, hold_tables=True) -> dict:
    """{0: LongcatWeights}, random: N(0, 1) table (InitTable) and embedding, uniform projections
    (graft_zero_init: projections 0, so the output is the token embedding / (1 + E))."""
    rng = np.random.default_rng(seed)
    D = cfg.hidden_size
    bound = 1 / math.sqrt(cfg.head_dim)
    proj = rng.uniform(-bound, bound, (D, D)).astype(np.float32)
    if graft_zero_init:
        proj[:] = 0
    embed = rng.standard_normal((cfg.vocab_size, D)).astype(np.float32)
    out = {}
    for L in cfg.layer_ids:
        table = InitTable(seed, L, plan.table_rows[L], cfg.head_dim)
        out[L] = LongcatWeights(cfg, plan.offsets[L], table[:] if hold_tables else table, embed, proj)
    return out


def layer_from_state_dict(cfg, plan, L, sd) -> LongcatWeights:
    """LongcatWeights from an NgramEmbedding's state_dict (torch tensors or numpy arrays; its
    names: word_embeddings.weight, embedders.{c}.weight, post_projs.{c}.weight), shapes checked."""
    arr = state_dict_arrays(L, sd, shapes(cfg, plan))
    keep = lambda a: a if a.dtype == BF16 else np.asarray(a, np.float32)  # noqa: E731
    tables = [keep(arr[embedder(c)]) for c in range(cfg.n_heads)]
    dtype = BF16 if all(t.dtype == BF16 for t in tables) else np.float32
    table = np.concatenate([t.astype(dtype, copy=False) for t in tables])
    projs = [keep(arr[post_proj(c)]) for c in range(cfg.n_heads)]
    pdtype = BF16 if all(p.dtype == BF16 for p in projs) else np.float32
    return LongcatWeights(cfg, plan.offsets[L], table, keep(arr[EMBED]),
                          np.concatenate([p.astype(pdtype, copy=False) for p in projs], axis=1))
