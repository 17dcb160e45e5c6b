"""The qwen3.8-flash-next variant's weights: PLEWeights, random init, the module's state_dicts.

Qwen4ExpTextPLELayer is the demo module's computation with other weights (DESIGN.md 4b): one
key projection for all hyper-connection streams, [G*D, E], is the demo's G key projections
stacked; no biases; the three grouped RMSNorms scale by (1 + w). So a layer is held as the
demo's LayerWeights, which the demo's engine and kernels read: key_proj and value_proj fused as
proj_w, zero biases, norm weights 1 + w (computed in float32, as transformers does: the same
bits), eps = the config's rms_norm_eps. The module's own arrays stay beside them (state_dict,
the oracle).
"""
from __future__ import annotations

import math

import numpy as np

from ..demo.weights import BF16, InitTable, LayerWeights, _to_numpy, state_dict_arrays, weight_dtype_of
from ..demo.weights import validate_layer as _validate_demo_layer
from ..plan import frozen

TABLE_DTYPES = ("float32", "float16", "bfloat16")  # the demo engine gathers each (bfloat16: the released tables')
TABLE = "ple_embedding.ngram_embedding.weight"
NAMES = (TABLE, "key_proj.weight", "value_proj.weight", "norm_key.weight", "norm_query.weight",
         "norm_conv.weight", "conv1d.weight")
# the module's buffers: derived from the config, checked against the plan when a state_dict has them
BUFFERS = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
           "ple_embedding.ngram_heads_offsets")


def shapes(cfg, plan, layer) -> dict:
    """{state_dict name: shape} of one PLE layer (Linear weights [out, in])."""
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    return {TABLE: (plan.table_rows[layer], cfg.head_dim), "key_proj.weight": (G * D, E),
            "value_proj.weight": (D, E), "norm_key.weight": (G * D,), "norm_query.weight": (G * D,),
            "norm_conv.weight": (G * D,), "conv1d.weight": (G * D, 1, K)}


def one_plus(w) -> np.ndarray:
    """transformers' (1.0 + weight.float()): float32."""
    return (np.float32(1) + np.asarray(w, dtype=np.float32)).astype(np.float32)


class PLEWeights(LayerWeights):
    """One PLE layer: the demo's LayerWeights (what the engine reads) built from the module's arrays,
    which it keeps: key_proj [G*D, E], value_proj [D, E] (views of proj_w), norm_key, norm_query,
    norm_conv (the raw w of x * (1 + w), float32 [G*D]).

    A table is float32, float16 or bfloat16 values [rows, head_dim], or vLLM's quantized codes with
    table_lut, the value of each code (float32, what vLLM's dequantization gives): FP8, uint8
    [rows, head_dim] and table_lut[256]; NVFP4, uint8 [rows, head_dim/2] (two E2M1 nibbles a byte, the
    low one first), table_scale uint8 [rows, head_dim/16] (an E4M3 byte per 16 values) and
    table_lut[scale byte * 16 + nibble]."""

    table_lut = None
    table_in_ram = None  # why a table loaded with mmap=True is not a view of its file (tables="direct" says)

    def __init__(self, cfg, offsets, table, key_proj, value_proj, norm_key, norm_query, norm_conv, conv_w,
                 table_scale=None, table_lut=None):
        G, D = cfg.hc_mult, cfg.hidden_size
        dtype = weight_dtype_of(key_proj)
        proj_w = np.concatenate([np.asarray(key_proj, dtype), np.asarray(value_proj, dtype)])
        self.norm_key_w = frozen(norm_key, np.float32)
        self.norm_query_w = frozen(norm_query, np.float32)
        self.norm_conv_w = frozen(norm_conv, np.float32)
        super().__init__(cfg, offsets, table, proj_w=proj_w, proj_b=np.zeros(proj_w.shape[0], np.float32),
                         norm1=one_plus(self.norm_key_w).reshape(G, D),
                         norm2=one_plus(self.norm_query_w).reshape(G, D),
                         conv_norm=one_plus(self.norm_conv_w).reshape(G, D),
                         conv_w=np.asarray(conv_w, np.float32).reshape(G * D, cfg.kernel_size),
                         table_scale=table_scale)
        self.table_lut = None if table_lut is None else frozen(table_lut, np.float32)
        self.key_proj = self.proj_w[:G * D]
        self.value_proj = self.proj_w[G * D:]
        self.eps_qk = self.eps_conv = float(cfg.norm_eps)

    def replace(self, cfg, **arrays) -> "PLEWeights":
        """A new PLEWeights with the table or the fused projection replaced (with_weight_dtype)."""
        unknown = sorted(set(arrays) - {"table", "table_scale", "proj_w"})
        if unknown:
            raise TypeError(f"PLEWeights.replace: {unknown} cannot be replaced (table, table_scale, proj_w can)")
        G, D = cfg.hc_mult, cfg.hidden_size
        proj_w = arrays.get("proj_w", self.proj_w)
        new = PLEWeights(cfg, self.offsets, arrays.get("table", self.table), proj_w[:G * D], proj_w[G * D:],
                          self.norm_key_w, self.norm_query_w, self.norm_conv_w, self.conv_w,
                          table_scale=arrays.get("table_scale", self.table_scale),
                          table_lut=None if "table" in arrays else self.table_lut)
        if "table" not in arrays:
            new.table_in_ram = self.table_in_ram
        return new

    @property
    def table_format(self) -> str:
        """The table's dtype name, or "fp8" / "nvfp4" for vLLM's codes."""
        return self.table.dtype.name if self.table_lut is None else "nvfp4" if self.table_scale is not None else "fp8"

    def table_f32(self, rows) -> np.ndarray:
        """Rows of the table as float32 (codes through table_lut)."""
        if self.table_lut is None:
            return super().table_f32(rows)
        t = np.asarray(self.table[rows])
        if self.table_scale is None:
            return self.table_lut[t]
        codes = np.stack([t & 0xF, t >> 4], axis=-1).reshape(*t.shape[:-1], -1)  # the low nibble first
        scales = np.repeat(np.asarray(self.table_scale[rows]).astype(np.int64), 16, axis=-1)
        return self.table_lut[scales * 16 + codes]

    def state_dict(self, cfg) -> dict:
        """The module's parameters (numpy; float32 table), Qwen4ExpTextPLELayer's names."""
        return {TABLE: self.table_f32(slice(None)),
                "key_proj.weight": self.key_proj.astype(np.float32, copy=False),
                "value_proj.weight": self.value_proj.astype(np.float32, copy=False),
                "norm_key.weight": self.norm_key_w, "norm_query.weight": self.norm_query_w,
                "norm_conv.weight": self.norm_conv_w, "conv1d.weight": self.conv_w[:, None, :]}


def validate_layer(cfg, plan, L, w):
    if not isinstance(w, PLEWeights):
        raise TypeError(f"layer {L}: expected PLEWeights, got {type(w).__name__}")
    _validate_demo_layer(cfg, plan, L, w, table_dtypes=TABLE_DTYPES, check_table=w.table_lut is None)
    if w.table_lut is not None:
        rows, hd, nv = plan.table_rows[L], cfg.head_dim, w.table_scale is not None
        want = {"table": (rows, hd // 2 if nv else hd), "table_scale": (rows, hd // 16) if nv else None,
                "table_lut": (4096 if nv else 256,)}
        for name, shape in want.items():
            a = getattr(w, name)
            if shape is not None and not (isinstance(a, np.ndarray) and a.shape == shape and a.flags.c_contiguous
                                          and a.dtype == (np.float32 if name == "table_lut" else np.uint8)):
                raise ValueError(f"layer {L} {name} of an {w.table_format} table: expected "
                                 f"{'float32' if name == 'table_lut' else 'uint8'} {shape}, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
        if nv and hd % 16:
            raise ValueError(f"layer {L}: an NVFP4 table needs head_dim a multiple of 16, got {hd}")
    if w.eps_qk != cfg.norm_eps:
        raise ValueError(f"layer {L}: weights made for norm eps {w.eps_qk}, the config has {cfg.norm_eps}")


def init_layers(cfg, plan, seed=0, graft_zero_init=False, hold_tables=True) -> dict:
    """{layer: PLEWeights}, random: N(0, 1) tables (InitTable), uniform projections and taps, and
    norm weights around 0 (scale 1 + w around 1) so that a test sees them. graft_zero_init: the
    value projection 0, so the layer adds nothing until trained."""
    rng = np.random.default_rng(seed)
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    layers = {}
    for L in cfg.layer_ids:
        bound = 1 / math.sqrt(E)
        key = rng.uniform(-bound, bound, (G * D, E)).astype(np.float32)
        value = rng.uniform(-bound, bound, (D, E)).astype(np.float32)
        if graft_zero_init:
            value[:] = 0
        norms = [(0.1 * rng.standard_normal(G * D)).astype(np.float32) for _ in range(3)]
        conv = rng.uniform(-1 / math.sqrt(K), 1 / math.sqrt(K), (G * D, 1, K)).astype(np.float32)
        table = InitTable(seed, L, plan.table_rows[L], cfg.head_dim)
        layers[L] = PLEWeights(cfg, plan.offsets[L], table[:] if hold_tables else table, key, value, *norms, conv)
    return layers


def layer_from_state_dict(cfg, plan, L, sd) -> PLEWeights:
    """PLEWeights from a Qwen4ExpTextPLELayer's state_dict (torch tensors or numpy arrays): every
    parameter's name and shape checked; the buffers, when present, must be the plan's multipliers,
    primes and offsets."""
    arr = state_dict_arrays(L, sd, shapes(cfg, plan, L), optional=BUFFERS)
    planned = dict(zip(BUFFERS, (plan.multipliers[L], plan.head_primes[L], plan.offsets[L])))
    for k, mine in planned.items():
        if k in sd and not np.array_equal(_to_numpy(sd[k], f"layer {L} {k}"), mine):
            raise ValueError(f"layer {L} {k} disagrees with the config's hash plan: {_to_numpy(sd[k], k)[:4]}... "
                             f"vs {mine[:4]}...")
    weight = lambda k: arr[k] if arr[k].dtype == BF16 else np.asarray(arr[k], np.float32)  # noqa: E731
    return PLEWeights(cfg, plan.offsets[L], np.ascontiguousarray(np.asarray(arr[TABLE], np.float32)),
                      weight("key_proj.weight"), weight("value_proj.weight"), arr["norm_key.weight"],
                      arr["norm_query.weight"], arr["norm_conv.weight"], arr["conv1d.weight"])
