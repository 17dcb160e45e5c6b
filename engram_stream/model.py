"""EngramModel: the weights of every Engram layer, the batch path, and engines.

A layer's projection weights are stored fused, [Wk_0; ...; Wk_{G-1}; Wv] as one
[(G+1)*D, E] matrix: the reference names (key_w, value_w, ...) are views of it,
and a streaming step does all G+1 projections in one pass over the weights.
"""
from __future__ import annotations

import math
import os

import numpy as np

from . import reference, reference_v41, store, v41
from .config import V41, EngramConfig
from .plan import HashPlan, as_ids, frozen

TABLE_DTYPES = ("float32", "float16", "int8")
WEIGHT_DTYPES = ("float32", "bfloat16")  # the projection weights (model.with_weight_dtype)


def weight_dtype_of(a) -> np.dtype:
    """The dtype projection weights keep: bfloat16 (ml_dtypes) stays, anything else is float32."""
    return v41.BF16 if getattr(a, "dtype", None) == v41.BF16 else np.dtype(np.float32)


def reference_shapes(cfg: EngramConfig, plan: HashPlan, layer: int) -> dict:
    """The reference module's state_dict names and shapes for one layer."""
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    shapes = {
        "multi_head_embedding.embedding.weight": (plan.table_rows[layer], cfg.head_dim),
        "multi_head_embedding.offsets": (cfg.n_heads,),
        "value_proj.weight": (D, E),
        "value_proj.bias": (D,),
        "short_conv.conv.weight": (G * D, 1, K),
    }
    for g in range(G):
        shapes[f"key_projs.{g}.weight"] = (D, E)
        shapes[f"key_projs.{g}.bias"] = (D,)
        shapes[f"norm1.{g}.weight"] = (D,)
        shapes[f"norm2.{g}.weight"] = (D,)
        shapes[f"short_conv.norms.{g}.weight"] = (D,)
    return shapes


def aligned_zeros(shape, dtype, align=64) -> np.ndarray:
    """Zeros whose data starts on an `align`-byte boundary. numpy's allocator leaves it to
    chance (16, 32, 48 or 0 mod 64): with packed panels off a 64-byte boundary AVX-512 steps
    measured 1.6x slower (bench/bench_alignment.py)."""
    dtype = np.dtype(dtype)
    n = math.prod(np.atleast_1d(shape).tolist()) * dtype.itemsize
    buf = np.zeros(n + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + n].view(dtype).reshape(shape)


class LayerWeights:
    """One layer's parameters. table: [rows, head_dim] float32, float16, or int8 with a
    float32 scale per row (table_scale); everything else float32.

    Every array is a read-only view (engines read them through raw pointers while they run):
    large arrays given here are shared, not copied, so do not write to your own originals
    under a live engine; the small integer offsets are copied."""

    def __init__(self, cfg, offsets, table, proj_w, proj_b, norm1, norm2, conv_norm, conv_w,
                 table_scale=None):
        G, D, E = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim
        self.offsets = frozen(np.array(offsets, dtype=np.int64))
        # tables: as given (_validate_layer wants C-contiguous; save_init passes InitTables)
        ro = lambda a: frozen(a) if isinstance(a, np.ndarray) and a.flags.c_contiguous else a  # noqa: E731
        self.table = ro(table)
        self.table_scale = ro(table_scale)
        self.proj_w = frozen(proj_w, weight_dtype_of(proj_w))  # [(G+1)*D, E] float32 or bfloat16
        self.proj_b = frozen(proj_b, np.float32)    # [(G+1)*D]
        self.key_w = self.proj_w[:G * D].reshape(G, D, E)
        self.key_b = self.proj_b[:G * D].reshape(G, D)
        self.value_w = self.proj_w[G * D:]
        self.value_b = self.proj_b[G * D:]
        self.norm1 = frozen(norm1, np.float32)      # [G, D] keys
        self.norm2 = frozen(norm2, np.float32)      # [G, D] hidden
        self.conv_norm = frozen(conv_norm, np.float32)  # [G, D]
        self.conv_w = frozen(conv_w, np.float32)    # [G*D, K]
        self._packed = None

    ARRAYS = ("offsets", "table", "proj_w", "proj_b", "norm1", "norm2", "conv_norm", "conv_w", "table_scale")

    def replace(self, cfg, **arrays) -> "LayerWeights":
        """A new LayerWeights with some arrays replaced, the others shared (these are read-only):
        EngramModel(cfg, model.plan, {L: w.replace(cfg, norm1=n1) for L, w in model.layers.items()})."""
        unknown = sorted(set(arrays) - set(self.ARRAYS))
        if unknown:
            raise TypeError(f"LayerWeights.replace: unknown arrays {unknown} (known: {self.ARRAYS})")
        return LayerWeights(cfg, **{n: arrays.get(n, getattr(self, n)) for n in self.ARRAYS})

    @property
    def table_dtype(self) -> str:
        return self.table.dtype.name

    @property
    def weight_dtype(self) -> str:
        """"float32" or "bfloat16": how the projection weights are held (norms, biases: float32)."""
        return self.proj_w.dtype.name

    def table_f32(self, rows) -> np.ndarray:
        """Rows of the table as float32 (dequantized for int8 tables)."""
        t = self.table[rows]
        if self.table_scale is not None:
            return (t.astype(np.float32) * self.table_scale[rows][..., None]).astype(np.float32)
        return t.astype(np.float32, copy=False)

    def packed(self):
        """Weights in the engine's layout, built once and shared by every engine:
        projection panels [ceil(M/16), E, 16], padded bias, conv taps [K, G*D]."""
        if self._packed is None:
            M, E = self.proj_w.shape
            P = -(-M // 16)
            wp = aligned_zeros((P, E, 16), self.proj_w.dtype)  # bfloat16 panels: the engine widens
            for p in range(P):  # panel by panel: no padded or transposed full copy on the way
                cols = self.proj_w[p * 16:(p + 1) * 16]
                wp[p, :, :cols.shape[0]] = cols.T
            bp = aligned_zeros(P * 16, np.float32)
            bp[:M] = self.proj_b
            cw = aligned_zeros(self.conv_w.T.shape, np.float32)
            cw[...] = self.conv_w.T
            self._packed = (frozen(wp), frozen(bp), frozen(cw))
        return self._packed

    def state_dict(self, cfg) -> dict:
        """The reference module's state_dict (numpy arrays; float32 table)."""
        G = cfg.hc_mult
        sd = {"multi_head_embedding.embedding.weight": self.table_f32(slice(None)),
              "multi_head_embedding.offsets": self.offsets.copy(),
              "value_proj.weight": self.value_w.astype(np.float32, copy=False), "value_proj.bias": self.value_b,
              "short_conv.conv.weight": self.conv_w[:, None, :]}
        for g in range(G):
            sd[f"key_projs.{g}.weight"] = self.key_w[g].astype(np.float32, copy=False)
            sd[f"key_projs.{g}.bias"] = self.key_b[g]
            sd[f"norm1.{g}.weight"] = self.norm1[g]
            sd[f"norm2.{g}.weight"] = self.norm2[g]
            sd[f"short_conv.norms.{g}.weight"] = self.conv_norm[g]
        return sd


class EngramModel:
    """All Engram layers of a model: config, hash plan and weights.

    forward() is the numpy batch path (the oracle); stream() gives the Cython
    streaming engine of one layer; decoder() drives every layer per token.
    """

    def __init__(self, cfg: EngramConfig, plan: HashPlan, layers: dict):
        if not isinstance(cfg, EngramConfig):
            raise TypeError(f"EngramModel needs an EngramConfig, got {type(cfg).__name__}")
        if not isinstance(plan, HashPlan) or plan.cfg != cfg:
            raise ValueError("EngramModel: plan must be a HashPlan of the same config")
        if sorted(layers) != sorted(cfg.layer_ids):
            raise ValueError(f"EngramModel: layers {sorted(layers)} != config layer_ids {cfg.layer_ids}")
        for L, w in layers.items():
            (v41.validate_layer if cfg.variant == V41 else _validate_layer)(cfg, plan, L, w)
        self.cfg, self.plan, self.layers = cfg, plan, dict(layers)

    def __repr__(self):
        c = self.cfg
        return (f"EngramModel(layers={c.layer_ids}, D={c.hidden_size}, G={c.hc_mult}, "
                f"H={c.n_heads}x{c.head_dim}, table_rows={[self.plan.table_rows[L] for L in c.layer_ids]}, "
                f"table_dtype={self.layers[c.layer_ids[0]].table_dtype})")

    # Construction ----------------------------------------------------------------------
    @classmethod
    def from_reference(cls, cfg: EngramConfig, state_dicts: dict, compression=None, multipliers=None,
                       weight_dtype="float32"):
        """Build from the reference module's per-layer state_dicts ({layer: {name: array}}).
        Every key and shape is checked; tensors are taken as numpy arrays (torch CPU tensors
        convert through numpy). weight_dtype="bfloat16" holds the projection weights as bf16
        (exact for a bf16 checkpoint, rounded otherwise) instead of widening them to float32.
        A deepseek-v4.1 config takes that module's names (engram_stream.v41)."""
        _check_weight_dtype(weight_dtype)
        if cfg.variant == V41:
            return v41.from_reference(cls, cfg, state_dicts, compression, multipliers)
        plan = HashPlan(cfg, compression=compression, multipliers=multipliers)
        if not isinstance(state_dicts, dict):
            raise TypeError(f"state_dicts must be a dict {{layer: state_dict}}, got {type(state_dicts).__name__}")
        if sorted(state_dicts) != sorted(cfg.layer_ids):
            raise ValueError(f"state_dicts must have exactly the layers {cfg.layer_ids}, got {sorted(state_dicts)}")
        layers = {}
        G, D = cfg.hc_mult, cfg.hidden_size
        for L in cfg.layer_ids:
            sd, want = state_dicts[L], reference_shapes(cfg, plan, L)
            missing = sorted(set(want) - set(sd))
            unexpected = sorted(set(sd) - set(want))
            if missing or unexpected:
                raise ValueError(f"layer {L} state_dict: missing keys {missing}, unexpected keys {unexpected}")
            arr = {}
            for k, shape in want.items():
                a = _to_numpy(sd[k], f"layer {L} {k}")
                if a.shape != shape:
                    raise ValueError(f"layer {L} {k}: expected shape {shape}, got {a.shape}")
                arr[k] = a
            if not np.array_equal(arr["multi_head_embedding.offsets"], plan.offsets[L]):
                raise ValueError(f"layer {L} multi_head_embedding.offsets disagree with the config's prime "
                                 f"chain: {arr['multi_head_embedding.offsets'][:4]}... vs {plan.offsets[L][:4]}...")
            f32 = lambda k: np.asarray(arr[k], dtype=np.float32)  # noqa: E731
            proj_w = np.concatenate([f32(f"key_projs.{g}.weight") for g in range(G)] + [f32("value_proj.weight")])
            proj_b = np.concatenate([f32(f"key_projs.{g}.bias") for g in range(G)] + [f32("value_proj.bias")])
            layers[L] = LayerWeights(
                cfg, plan.offsets[L],
                table=np.ascontiguousarray(f32("multi_head_embedding.embedding.weight")),
                proj_w=proj_w, proj_b=proj_b,
                norm1=np.stack([f32(f"norm1.{g}.weight") for g in range(G)]),
                norm2=np.stack([f32(f"norm2.{g}.weight") for g in range(G)]),
                conv_norm=np.stack([f32(f"short_conv.norms.{g}.weight") for g in range(G)]),
                conv_w=f32("short_conv.conv.weight").reshape(G * D, cfg.kernel_size))
        model = cls(cfg, plan, layers)
        return model if weight_dtype == "float32" else model.with_weight_dtype(weight_dtype)

    @classmethod
    def init(cls, cfg: EngramConfig, seed: int = 0, graft_zero_init: bool = False, compression=None,
             multipliers=None):
        """Random weights with torch's default initializations (tables N(0,1), Linear and Conv1d
        uniform(+-1/sqrt(fan_in)), norms 1). graft_zero_init zeroes the value projection, so
        the module's output is exactly 0: adding it to a frozen model changes nothing at step 0.
        `seed` seeds the weights (cfg.seed seeds the hash multipliers); demo tables come from
        InitTable, so checkpoint.save_init can write the same model without holding a table.
        deepseek-v4.1: random float8 weights (engram_stream.v41.random_layer)."""
        if cfg.variant == V41:
            return v41.init(cls, cfg, seed, graft_zero_init, compression, multipliers)
        plan = HashPlan(cfg, compression=compression, multipliers=multipliers)
        return cls(cfg, plan, init_layers(cfg, plan, seed, graft_zero_init))

    def with_weight_dtype(self, dtype) -> "EngramModel":
        """The same model with its projection weights held as `dtype`: "bfloat16" (half the
        bytes a step reads; engines widen them in registers, so outputs are float32 math on
        the bf16-rounded weights) or "float32". Tables, norms and biases are shared."""
        dtype = _check_weight_dtype(dtype)
        if self.cfg.variant == V41:
            raise ValueError("with_weight_dtype: the deepseek-v4.1 variant keeps its float8 weights")
        target = v41.BF16 if dtype == "bfloat16" else np.dtype(np.float32)
        layers = {L: w if w.proj_w.dtype == target else w.replace(self.cfg, proj_w=w.proj_w.astype(target))
                  for L, w in self.layers.items()}
        return type(self)(self.cfg, self.plan, layers)

    @property
    def weight_dtype(self) -> str:
        """"float32" or "bfloat16" (see with_weight_dtype)."""
        return self.layers[self.cfg.layer_ids[0]].weight_dtype

    # Paths -------------------------------------------------------------------------------
    def layer(self, layer):
        """The weights of one Engram layer (one of cfg.layer_ids; any other raises KeyError):
        LayerWeights (table [rows, head_dim], fused projection proj_w [(G+1)*D, E], norms,
        conv taps), or V41LayerWeights for a deepseek-v4.1 model. Shared read-only by every
        engine and decoder of this model: copy an array before changing it."""
        return self.layers[self.plan.check_layer(layer)]

    def state_dict(self, layer) -> dict:
        """The reference module's state_dict of one layer (numpy arrays)."""
        return self.layer(layer).state_dict(self.cfg)

    def forward(self, layer, ids, hidden) -> np.ndarray:
        """The numpy batch path: ids int[B, T], hidden float[B, T, G, D] -> float32[B, T, G, D].
        float64 hidden is computed in float32 (the reference's precision)."""
        w = self.layer(layer)
        a = as_ids(ids, 2)
        h = check_hidden(hidden, a.shape + (self.cfg.hc_mult, self.cfg.hidden_size), "hidden")
        rows = self.plan.hash_numpy(a, layers=[layer])[layer]
        store.check_file(w.table)  # a mapped file truncated or rewritten since load is refused
        if self.cfg.variant == V41:
            return reference_v41.forward(self.cfg, rows, self.plan.dead_mask(a), w, h)
        return reference.forward(self.cfg, rows, w, h)

    def stream(self, layer, n_streams: int = 1):
        """The streaming engine of one layer (see engram_stream.StreamEngine; deepseek-v4.1:
        engram_stream._engine_v41.V41StreamEngine)."""
        if self.cfg.variant == V41:
            from ._engine_v41 import V41StreamEngine
            return V41StreamEngine(self, layer, n_streams)
        from ._engine import StreamEngine
        return StreamEngine(self, layer, n_streams)

    def decoder(self, n_streams: int = 1, prefetch="auto"):
        """Every layer's engine behind one per-token driver (see engram_stream.decoder)."""
        from .decoder import Decoder
        return Decoder(self, n_streams, prefetch=prefetch)

    # Files ---------------------------------------------------------------------------------
    def save(self, path, table_dtype=None, progress=None):
        """Write the model to `path`: one safetensors-layout file (config, hash plan, every
        layer's weights), atomically (a temp file beside it, then a rename), tables converted
        chunk by chunk when table_dtype is "float32", "float16" or "int8" (None: as held).
        progress: callable(done_bytes, total_bytes). Returns the path; read it with load().
        deepseek-v4.1 models are written in the model's own HF layout (a folder)."""
        if self.cfg.variant == V41:
            from . import hf_v41
            return hf_v41.save(self, path)
        from . import checkpoint
        return checkpoint.save(self, path, table_dtype=table_dtype, progress=progress)

    @classmethod
    def load(cls, path, mmap: bool = True, tables=None, row_cache_mb=None):
        """Read a checkpoint written by save() (or `engram-stream init`); every header field,
        shape and the prime chain are checked, a bad file raises checkpoint.CheckpointError.
        mmap=True (the default): tables are read-only zero-copy views of the file, so only the
        rows a decode touches come into RAM (the file must not change while the model lives);
        mmap=False reads everything into RAM. A folder is a deepseek-v4.1 HF checkpoint
        (from_deepseek_v41).
        tables: a tiers.MooncakeTier to read table rows from (weights still come from the file,
        whose tables are then mapped and never read); row_cache_mb: a RAM cache of whole rows
        in front of the rows' source (see engram_stream.tiers; demo variant)."""
        if os.path.isdir(path):
            if tables is not None or row_cache_mb:
                raise ValueError("row tiers (tables=, row_cache_mb=) serve the demo-v1 engine; "
                                 "the deepseek-v4.1 engine does not read through them yet")
            return cls.from_deepseek_v41(path, mmap=mmap)
        from . import checkpoint
        model = checkpoint.load(path, mmap=mmap or tables is not None)
        if tables is not None or row_cache_mb:
            from .tiers import RowTiers
            model.row_tiers = RowTiers(model, row_cache_mb or 0, tables)
        return model

    row_tiers = None  # tiers.RowTiers: row cache budget and row source (set by load())

    def row_cache_stats(self) -> dict:
        """Row cache counters summed over this model's engines: hits, misses, bytes_fetched,
        evictions, rows_cached, ... and per layer ("layers"). All zero without a row cache."""
        from .tiers import RowTiers
        return (self.row_tiers or RowTiers(self)).stats()

    @classmethod
    def from_deepseek_v41(cls, ckpt_dir, mmap: bool = True, compression=None):
        """A deepseek-v4.1 model from its HF folder (config.json, model.safetensors.index.json, the
        shards, tokenizer.json): only the layers.{L}.engram.* tensors are read, the tables are
        mapped in place. compression: a lookup to use instead of building it from tokenizer.json."""
        from . import hf_v41
        return hf_v41.load(cls, ckpt_dir, mmap=mmap, compression=compression)


INIT_BLOCK_ROWS = 4096  # table rows per generator in InitTable: any row range is drawn block by block


class InitTable:
    """The N(0, 1) float32 table EngramModel.init gives one layer, produced on demand by row
    slices (`t[a:b]`), never whole: block b of INIT_BLOCK_ROWS rows is drawn from
    default_rng([seed, layer, b]), so a slice costs only its own blocks."""

    dtype = np.dtype(np.float32)

    def __init__(self, seed: int, layer: int, rows: int, head_dim: int):
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seed, self.layer, self.shape = int(seed), int(layer), (int(rows), int(head_dim))

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, step = s.indices(self.shape[0])
        if step != 1:
            raise ValueError("InitTable: only contiguous row slices")
        B, hd = INIT_BLOCK_ROWS, self.shape[1]
        out = np.empty((max(0, stop - start), hd), np.float32)
        for b in range(start // B, -(-stop // B)):
            lo, hi = max(start, b * B), min(stop, (b + 1) * B, self.shape[0])
            block = np.random.default_rng([self.seed, self.layer, b]).standard_normal((hi - b * B, hd),
                                                                                       dtype=np.float32)
            out[lo - start:hi - start] = block[lo - b * B:]
        return out


def init_layers(cfg, plan, seed=0, graft_zero_init=False, hold_tables=True) -> dict:
    """{layer: LayerWeights} of EngramModel.init. hold_tables=False leaves each table as its
    InitTable (for checkpoint.save_init: written in pieces, never held in RAM)."""
    rng = np.random.default_rng(seed)
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    layers = {}
    for L in cfg.layer_ids:
        bound = 1 / math.sqrt(E)
        proj_w = rng.uniform(-bound, bound, ((G + 1) * D, E)).astype(np.float32)
        proj_b = rng.uniform(-bound, bound, (G + 1) * D).astype(np.float32)
        if graft_zero_init:
            proj_w[G * D:] = 0
            proj_b[G * D:] = 0
        table = InitTable(seed, L, plan.table_rows[L], cfg.head_dim)
        layers[L] = LayerWeights(
            cfg, plan.offsets[L], table=table[:] if hold_tables else table,
            proj_w=proj_w, proj_b=proj_b,
            norm1=np.ones((G, D), np.float32), norm2=np.ones((G, D), np.float32),
            conv_norm=np.ones((G, D), np.float32),
            conv_w=rng.uniform(-1 / math.sqrt(K), 1 / math.sqrt(K), (G * D, K)).astype(np.float32))
    return layers


def _check_weight_dtype(dtype) -> str:
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    return name


def _validate_layer(cfg, plan, L, w):
    """Shapes and dtypes the engine's raw-pointer code relies on."""
    if not isinstance(w, LayerWeights):
        raise TypeError(f"layer {L}: expected LayerWeights, got {type(w).__name__}")
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    want = {"table": (plan.table_rows[L], cfg.head_dim), "offsets": (cfg.n_heads,),
            "proj_w": ((G + 1) * D, E), "proj_b": ((G + 1) * D,), "norm1": (G, D), "norm2": (G, D),
            "conv_norm": (G, D), "conv_w": (G * D, K)}
    for name, shape in want.items():
        a = getattr(w, name)
        if not isinstance(a, np.ndarray) or a.shape != shape:
            raise ValueError(f"layer {L} {name}: expected shape {shape}, got {getattr(a, 'shape', type(a).__name__)}")
    if w.table.dtype.name not in TABLE_DTYPES:
        raise ValueError(f"layer {L} table: dtype must be one of {TABLE_DTYPES}, got {w.table.dtype}")
    if (w.table.dtype == np.int8) != (w.table_scale is not None):
        raise ValueError(f"layer {L} table: int8 tables need a per-row float32 table_scale (and only they)")
    if w.table_scale is not None and np.shape(w.table_scale) != (plan.table_rows[L],):
        raise ValueError(f"layer {L} table_scale: expected shape ({plan.table_rows[L]},)")
    if not w.table.flags.c_contiguous:
        raise ValueError(f"layer {L} table must be C-contiguous")
    if not np.array_equal(w.offsets, plan.offsets[L]):
        raise ValueError(f"layer {L} offsets disagree with the config's prime chain")


def _NUMPY_TORCH_FLOATS():
    import torch
    return (torch.float16, torch.float32, torch.float64)


def _to_numpy(x, what):
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu()
        if x.is_floating_point() and x.dtype not in _NUMPY_TORCH_FLOATS():
            x = x.float()  # bfloat16 (numpy has no such dtype): exact in float32
        x = x.numpy()
    a = np.asarray(x)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number)):
        raise TypeError(f"{what}: expected a numeric array, got dtype {a.dtype}")
    return a


def check_hidden(hidden, shape, what="hidden") -> np.ndarray:
    """hidden as C-contiguous float32 of exactly `shape` (float64/float16/bfloat16 and strided
    arrays are converted, bfloat16 exactly: an ml_dtypes array, as a bf16 model's torch tensor
    viewed through numpy is; integer or other dtypes are refused)."""
    if not isinstance(hidden, np.ndarray):
        hidden = np.asarray(hidden)
    if not (np.issubdtype(hidden.dtype, np.floating) or hidden.dtype == v41.BF16):
        raise TypeError(f"{what} must be a float array (float32, float64, float16 or bfloat16), "
                        f"got dtype {hidden.dtype}")
    if hidden.shape != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {hidden.shape}")
    return np.ascontiguousarray(hidden, dtype=np.float32)
