"""The demo variant's weights: LayerWeights, random init, the reference module's state_dicts.

A layer's projection weights are stored fused, [Wk_0; ...; Wk_{G-1}; Wv] as one
[(G+1)*D, E] matrix: the reference names (key_w, value_w, ...) are views of it,
and a streaming step does all G+1 projections in one pass over the weights.
"""
from __future__ import annotations

import math
import mmap

import ml_dtypes
import numpy as np

from .._hash import EPS_CONV, EPS_KEY  # include/engram_consts.h: the demo module's fixed eps
from ..plan import frozen

BF16 = np.dtype(ml_dtypes.bfloat16)

TABLE_DTYPES = ("float32", "float16", "int8")
WEIGHT_DTYPES = ("float32", "bfloat16")  # the projection weights (model.with_weight_dtype)


def weight_dtype_of(a) -> np.dtype:
    """The dtype projection weights keep: bfloat16 (ml_dtypes) stays, anything else is float32."""
    return BF16 if getattr(a, "dtype", None) == BF16 else np.dtype(np.float32)


def reference_shapes(cfg, plan, layer: int) -> dict:
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


HUGE_PAGE = 2 << 20


def aligned_zeros(shape, dtype, align=64) -> np.ndarray:
    """Zeros whose data starts on an `align`-byte boundary. numpy's allocator leaves it to
    chance (16, 32, 48 or 0 mod 64): with packed panels off a 64-byte boundary AVX-512 steps
    measured 1.6x slower (bench/bench_alignment.py). Arrays of a huge page or more come from
    an anonymous map whose aligned 2 MiB pages are advised MADV_HUGEPAGE: the GEMM streams
    every page of its panels each step, and 20 MiB in 4 KiB pages is more than the TLB holds
    (16 streams on 2 threads: ~4% faster, bench/NOTES.md)."""
    dtype = np.dtype(dtype)
    n = math.prod(np.atleast_1d(shape).tolist()) * dtype.itemsize
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        buf = np.zeros(n + align, np.uint8)
        start = -buf.ctypes.data % align
        return buf[start:start + n].view(dtype).reshape(shape)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeros, taken as written
    buf = np.frombuffer(m, np.uint8)
    start = -buf.ctypes.data % HUGE_PAGE  # a multiple of the page size, so of align
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, n - n % HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, same bytes
        pass
    return buf[start:start + n].view(dtype).reshape(shape)


class LayerWeights:
    """One layer's parameters. table: [rows, head_dim] float32, float16, or int8 with a
    float32 scale per row (table_scale); everything else float32.

    Every array is a read-only view (engines read them through raw pointers while they run):
    large arrays given here are shared, not copied, so do not write to your own originals
    under a live engine; the small integer offsets are copied.

    eps_qk / eps_conv: the RMSNorm eps of keys and hidden / of the ShortConv input, what the
    engine's tails and the oracle use (the demo module's constants; a variant that reuses these
    weights with its own eps sets them, as qwen3.8-flash-next does)."""

    eps_qk = float(EPS_KEY)
    eps_conv = float(EPS_CONV)

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
        cls = type(self) if type(self).holds_demo_arrays() else LayerWeights
        return cls(cfg, **{n: arrays.get(n, getattr(self, n)) for n in self.ARRAYS})

    @classmethod
    def holds_demo_arrays(cls) -> bool:
        """Whether the class is built from exactly the demo's arrays (LayerWeights' constructor):
        a variant's weights class that only adds rules of its own (an init, a description) is,
        so a demo-format file and replace() build it; one with arrays of its own is not."""
        return cls.__init__ is LayerWeights.__init__

    def file_arrays(self) -> tuple:
        """The arrays that may be views of a mapped file (checked before they are read)."""
        return tuple(a for a in (self.table, self.table_scale, self.proj_w, self.proj_b, self.norm1, self.norm2,
                                 self.conv_norm, self.conv_w) if isinstance(a, np.ndarray))

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


def check_weight_dtype(dtype) -> str:
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    return name


def validate_layer(cfg, plan, L, w, table_dtypes=TABLE_DTYPES, check_table=True):
    """Shapes and dtypes the engine's raw-pointer code relies on; table_dtypes: what the variant's
    tables may be (the engine also gathers bfloat16, qwen3.8-flash-next's); check_table=False leaves the
    table to a variant's own check (qwen3.8-flash-next's quantized codes)."""
    if not isinstance(w, LayerWeights):
        raise TypeError(f"layer {L}: expected LayerWeights, got {type(w).__name__}")
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    want = {"table": (plan.table_rows[L], cfg.head_dim) if check_table else None, "offsets": (cfg.n_heads,),
            "proj_w": ((G + 1) * D, E), "proj_b": ((G + 1) * D,), "norm1": (G, D), "norm2": (G, D),
            "conv_norm": (G, D), "conv_w": (G * D, K)}
    for name, shape in want.items():
        a = getattr(w, name)
        if shape is not None and (not isinstance(a, np.ndarray) or a.shape != shape):
            raise ValueError(f"layer {L} {name}: expected shape {shape}, got {getattr(a, 'shape', type(a).__name__)}")
    if not check_table:
        return
    if w.table.dtype.name not in table_dtypes:
        raise ValueError(f"layer {L} table: dtype must be one of {table_dtypes}, got {w.table.dtype}")
    if (w.table.dtype == np.int8) != (w.table_scale is not None):
        raise ValueError(f"layer {L} table: int8 tables need a per-row float32 table_scale (and only they)")
    if w.table_scale is not None and np.shape(w.table_scale) != (plan.table_rows[L],):
        raise ValueError(f"layer {L} table_scale: expected shape ({plan.table_rows[L]},)")
    if not w.table.flags.c_contiguous:
        raise ValueError(f"layer {L} table must be C-contiguous")


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


def state_dict_arrays(L, sd, want, optional=()) -> dict:
    """{name: numpy array} of a module's state_dict of layer L: exactly the keys of `want`
    ({name: shape}) besides any of `optional`, each of its shape (torch CPU tensors convert
    through numpy); the optional keys are the caller's to check."""
    if not isinstance(sd, dict):
        raise TypeError(f"layer {L} state_dict must be a dict, got {type(sd).__name__}")
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want) - set(optional))
    if missing or unexpected:
        raise ValueError(f"layer {L} state_dict: missing keys {missing}, unexpected keys {unexpected}")
    arr = {}
    for k, shape in want.items():
        a = _to_numpy(sd[k], f"layer {L} {k}")
        if a.shape != shape:
            raise ValueError(f"layer {L} {k}: expected shape {shape}, got {a.shape}")
        arr[k] = a
    return arr


def layer_from_state_dict(cfg, plan, L, sd) -> LayerWeights:
    """LayerWeights from the reference module's state_dict of layer L: every key and shape
    checked, tensors taken as numpy arrays (torch CPU tensors convert through numpy)."""
    G, D = cfg.hc_mult, cfg.hidden_size
    arr = state_dict_arrays(L, sd, reference_shapes(cfg, plan, L))
    if not np.array_equal(arr["multi_head_embedding.offsets"], plan.offsets[L]):
        raise ValueError(f"layer {L} multi_head_embedding.offsets disagree with the config's prime "
                         f"chain: {arr['multi_head_embedding.offsets'][:4]}... vs {plan.offsets[L][:4]}...")
    f32 = lambda k: np.asarray(arr[k], dtype=np.float32)  # noqa: E731
    proj_w = np.concatenate([f32(f"key_projs.{g}.weight") for g in range(G)] + [f32("value_proj.weight")])
    proj_b = np.concatenate([f32(f"key_projs.{g}.bias") for g in range(G)] + [f32("value_proj.bias")])
    return LayerWeights(
        cfg, plan.offsets[L],
        table=np.ascontiguousarray(f32("multi_head_embedding.embedding.weight")),
        proj_w=proj_w, proj_b=proj_b,
        norm1=np.stack([f32(f"norm1.{g}.weight") for g in range(G)]),
        norm2=np.stack([f32(f"norm2.{g}.weight") for g in range(G)]),
        conv_norm=np.stack([f32(f"short_conv.norms.{g}.weight") for g in range(G)]),
        conv_w=f32("short_conv.conv.weight").reshape(G * D, cfg.kernel_size))


def with_weight_dtype(cfg, layers, dtype) -> dict:
    """{L: LayerWeights} with the projection weights held as `dtype` ("float32" or "bfloat16");
    tables, norms and biases shared."""
    target = BF16 if check_weight_dtype(dtype) == "bfloat16" else np.dtype(np.float32)
    return {L: w if w.proj_w.dtype == target else w.replace(cfg, proj_w=w.proj_w.astype(target))
            for L, w in layers.items()}
