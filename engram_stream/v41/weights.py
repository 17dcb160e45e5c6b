"""The deepseek-v4.1 variant's weights: V41LayerWeights, from_reference, random init.

A layer holds the checkpoint's own bytes: float8 tables and projection stay float8 in
memory (raw uint8 arrays, under mmap views of the file), widened only where used.
Every array is C-contiguous and read-only (the engine reads them through raw pointers).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..config import EngramConfig
from ..plan import frozen
from .config import V41, V41_BLOCK

E4M3, E8M0, BF16 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu),
                    np.dtype(ml_dtypes.bfloat16))
RAW = {"embed.weight": E4M3, "embed.scale": E8M0, "wkv.weight": E4M3, "wkv.scale": E8M0}
FLOAT = ("q_weight", "k_weight")
NAMES = tuple(RAW) + FLOAT  # the module's state_dict names (checkpoint: layers.{L}.engram.<name>)


def shapes(cfg: EngramConfig, table_rows: int) -> dict:
    """{state_dict name: shape} of one V4.1 layer."""
    G, D, E, hd = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.head_dim
    M = (G + 1) * D
    return {"embed.weight": (table_rows, hd), "embed.scale": (table_rows, hd // V41_BLOCK),
            "wkv.weight": (M, E), "wkv.scale": (-(-M // V41_BLOCK), -(-E // V41_BLOCK)),
            "q_weight": (G, D), "k_weight": (G, D)}


class V41LayerWeights:
    """One V4.1 layer (DESIGN.md 4.6-4.9), the interface the Cython engine reads:

    offsets      int64[H]                         first table row of each head
    embed_weight uint8[N, head_dim]               float8_e4m3fn bytes
    embed_scale  uint8[N, head_dim // 32]         float8_e8m0fnu bytes: 2**(byte - 127)
    wkv_weight   uint8[(G+1)*D, E]                e4m3 bytes; rows: key of stream 0..G-1, value
    wkv_scale    uint8[ceil((G+1)*D/32), ceil(E/32)]  e8m0 bytes, one per 32x32 block
    q_weight, k_weight  float32[G, D]
    """

    table_dtype = weight_dtype = "float8_e4m3fn"
    record_format = "e4m3+e8m0"   # rows.records.E4M3_E8M0_RECORD: e4m3 bytes of a row, then its e8m0 scales

    def __init__(self, cfg, offsets, embed_weight, embed_scale, wkv_weight, wkv_scale, q_weight, k_weight):
        self.offsets = frozen(offsets, np.int64)
        self.embed_weight = frozen(embed_weight, np.uint8)
        self.embed_scale = frozen(embed_scale, np.uint8)
        self.wkv_weight = frozen(wkv_weight, np.uint8)
        self.wkv_scale = frozen(wkv_scale, np.uint8)
        self.q_weight = frozen(q_weight, np.float32)
        self.k_weight = frozen(k_weight, np.float32)

    def file_arrays(self) -> tuple:
        """The arrays that may be views of mapped shards (checked before they are read)."""
        return (self.embed_weight, self.embed_scale, self.wkv_weight, self.wkv_scale, self.q_weight, self.k_weight)

    def table_f32(self, rows) -> np.ndarray:
        """Table rows (absolute indices, any shape) as float32 [..., head_dim], as the oracle reads
        them (reference.dequant_rows: e4m3 * its block's scale)."""
        from .reference import dequant_rows
        return dequant_rows(self, rows)

    @property
    def table(self):
        """The table's bytes (what store/residency reports look at)."""
        return self.embed_weight

    @property
    def table_scale(self):
        """The rows' e8m0 scales: store's residency/release count them with the table."""
        return self.embed_scale

    def arrays(self) -> dict:
        """{state_dict name: array}: the float8 tensors as ml_dtypes views of the same bytes."""
        return {"embed.weight": self.embed_weight.view(E4M3), "embed.scale": self.embed_scale.view(E8M0),
                "wkv.weight": self.wkv_weight.view(E4M3), "wkv.scale": self.wkv_scale.view(E8M0),
                "q_weight": self.q_weight, "k_weight": self.k_weight}

    def state_dict(self, cfg=None) -> dict:
        return self.arrays()


def validate_layer(cfg, plan, L, w):
    """Shapes and dtypes the engine's raw-pointer code relies on."""
    if not isinstance(w, V41LayerWeights):
        raise TypeError(f"layer {L}: a {V41} model needs V41LayerWeights, got {type(w).__name__}")
    want = shapes(cfg, plan.table_rows[L])
    for name, shape in want.items():
        a = getattr(w, name.replace(".", "_"))
        if a.shape != shape:
            raise ValueError(f"layer {L} {name}: expected shape {shape}, got {a.shape}")


def to_raw(x, name, what):
    """A float8 tensor as its raw uint8 bytes: torch float8 tensors, ml_dtypes float8 arrays,
    or bytes already (uint8 arrays, bytes/bytearray/memoryview reshaped by the caller)."""
    want = RAW[name]
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor (torch is imported by then)
        import torch
        x = x.detach().cpu()
        tname = str(x.dtype).replace("torch.", "")
        if tname not in (want.name, "uint8"):
            raise TypeError(f"{what}: expected torch.{want.name} (or uint8 bytes), got torch.{tname}")
        return x.contiguous().view(torch.uint8).numpy()
    if isinstance(x, (bytes, bytearray, memoryview)):
        return np.frombuffer(x, dtype=np.uint8)
    a = np.asarray(x)
    if a.dtype == want:
        return a.view(np.uint8)
    if a.dtype != np.uint8:
        raise TypeError(f"{what}: expected {want.name} (ml_dtypes / torch) or raw uint8 bytes, got dtype {a.dtype}")
    return a


def to_f32(x, what):
    """q/k weights: float32, bf16 (torch or ml_dtypes) or any float, as float32 (exact for bf16)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().float().numpy()
    a = np.asarray(x)
    if not (np.issubdtype(a.dtype, np.floating) or a.dtype == BF16):
        raise TypeError(f"{what}: expected a float array (bf16 or float32), got dtype {a.dtype}")
    return a.astype(np.float32)


def layer_from_state_dict(cfg, plan, L, sd) -> V41LayerWeights:
    """V41LayerWeights from the module's own state_dict (names without layers.{L}.engram.)."""
    if not isinstance(sd, dict):
        raise TypeError(f"layer {L} state_dict must be a dict, got {type(sd).__name__}")
    want = shapes(cfg, plan.table_rows[L])
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise ValueError(f"layer {L} state_dict: missing keys {missing}, unexpected keys {unexpected}")
    arr = {}
    for name, shape in want.items():
        what = f"layer {L} {name}"
        a = to_raw(sd[name], name, what) if name in RAW else to_f32(sd[name], what)
        if a.ndim == 1 and isinstance(sd[name], (bytes, bytearray, memoryview)) and a.size == np.prod(shape):
            a = a.reshape(shape)
        if a.shape != shape:
            raise ValueError(f"{what}: expected shape {shape}, got {a.shape}")
        arr[name] = np.array(a, order="C")  # a private copy: the model must not change under us
    return V41LayerWeights(cfg, plan.offsets[L], arr["embed.weight"], arr["embed.scale"], arr["wkv.weight"],
                           arr["wkv.scale"], arr["q_weight"], arr["k_weight"])


def random_e4m3(rng, shape):
    """Random float8_e4m3fn bytes: random sign and mantissa, exponent field 4..8 (magnitudes
    0.125..3.75, about N(0, 1)); drawn as integers, fast enough for GB-sized tables."""
    bits = rng.integers(0, 256, shape, dtype=np.uint8)
    exponent = rng.integers(4, 9, shape, dtype=np.uint8)
    return (bits & 0x87) | (exponent << 3)


def random_layer(cfg, plan, L, rng, graft_zero_init=False) -> V41LayerWeights:
    """Random weights at reference-like magnitudes: row scales 2**-4..2**0, wkv blocks scaled
    near 1/sqrt(E), q/k weights around 1. graft_zero_init zeroes the value rows (delta 0)."""
    s = shapes(cfg, plan.table_rows[L])
    G, D = cfg.hc_mult, cfg.hidden_size
    wkv = random_e4m3(rng, s["wkv.weight"])
    if graft_zero_init:
        wkv[G * D:] = 0
    e_shift = int(np.ceil(np.log2(np.sqrt(cfg.engram_dim))))
    return V41LayerWeights(
        cfg, plan.offsets[L],
        embed_weight=random_e4m3(rng, s["embed.weight"]),
        embed_scale=rng.integers(127 - 4, 128, s["embed.scale"], dtype=np.uint8),
        wkv_weight=wkv,
        wkv_scale=rng.integers(127 - e_shift - 1, 128 - e_shift + 1, s["wkv.scale"], dtype=np.uint8),
        q_weight=rng.uniform(0.5, 1.5, (G, D)).astype(np.float32),
        k_weight=rng.uniform(0.5, 1.5, (G, D)).astype(np.float32))


def init_layers(cfg, plan, seed=0, graft_zero_init=False) -> dict:
    """{L: V41LayerWeights} of random weights (random_layer), one generator for all layers."""
    rng = np.random.default_rng(seed)
    return {L: random_layer(cfg, plan, L, rng, graft_zero_init) for L in cfg.layer_ids}
