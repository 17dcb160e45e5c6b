"""Checkpoints: one self-describing file in the safetensors layout, with mmap-able tables.

File layout: the safetensors layout (engram_stream.io.safetensors, the codec every variant
shares; readable by the `safetensors` package): tensors ordered by element size (I64, F32,
BF16/F16, I8), so each is aligned to its element size, and the first table on a 4096-byte
file boundary (whenever the tensors before it sum to a multiple of 8 bytes, which they do
unless hidden_size * engram_dim is odd).

Tensors: `layers.{L}.<reference state_dict name>` (the demo module's names, see
model.reference_shapes), `layers.{L}.multi_head_embedding.embedding.scale` (F32
[rows], int8 tables only), `plan.{L}.multipliers` (I64 [max_ngram]), `plan.{L}.primes`
(I64 [H]), `plan.compression` (I64 [vocab_size], when the model has one).
Metadata: format, format_version, config (EngramConfig JSON), table_dtype (informative).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from ..config import EngramConfig
from ..errors import CheckpointError
from ..io import safetensors
from ..io.files import check_file
from ..io.safetensors import CODES, SafetensorsFile, Tensor
from ..config import min_chain_rows
from ..plan import HashPlan
from ..variants import variant_of
from .weights import TABLE_DTYPES, LayerWeights, init_layers

FORMAT, FORMAT_VERSION = "engram_stream", "1"
CHUNK_BYTES = 16 << 20      # float32 bytes converted per step when tables change dtype
BAR_MIN_BYTES = 256 << 20   # the default stderr bar only for files bigger than this
TABLE = "multi_head_embedding.embedding.weight"
SCALE = "multi_head_embedding.embedding.scale"


# ---------------------------------------------------------------------------------------------
# Table conversion: float32 / float16 / int8 (+ per-row scale), chunk by chunk
# ---------------------------------------------------------------------------------------------
def _chunk_rows(w) -> int:
    return max(1, CHUNK_BYTES // max(1, 4 * w.table.shape[1]))


def _row_slices(n, step):
    for i in range(0, n, step):
        yield slice(i, min(n, i + step))


def int8_scale(rows_f32) -> np.ndarray:
    """Per-row scale max|row|/127 (float32); all-zero rows get 1 so they stay exactly 0."""
    m = np.max(np.abs(rows_f32), axis=1) if rows_f32.shape[1] else np.zeros(len(rows_f32), np.float32)
    if not np.isfinite(m).all():
        raise ValueError("table has non-finite values: cannot quantize it to int8")
    s = (m / np.float32(127)).astype(np.float32)
    s[s == 0] = 1
    return s


def _to(chunk_f32, dtype, scale=None):
    """One float32 chunk in the target dtype (scale: the chunk's int8 row scales)."""
    if dtype == np.int8:
        q = np.rint(chunk_f32 / scale[:, None])
        return np.clip(q, -127, 127).astype(np.int8)
    with np.errstate(over="ignore"):  # overflow is reported below, with the value
        out = chunk_f32.astype(dtype)
    if dtype == np.float16:
        bad = ~np.isfinite(out) & np.isfinite(chunk_f32)
        if bad.any():
            v = chunk_f32[bad][0]
            raise ValueError(f"table value {v} is out of float16 range (|x| <= 65504): keep float32 or use int8")
    return out


def _table_plan(w, table_dtype):
    """(scale or None, chunks()) for writing w's table as table_dtype. chunks() yields
    C-contiguous pieces of the converted table, at most CHUNK_BYTES of float32 at a time:
    never a second full copy of the table."""
    dtype = np.dtype(table_dtype)
    step = _chunk_rows(w)
    n = w.table.shape[0]
    if dtype == w.table.dtype:  # as is (an int8 table keeps its own scale)
        return w.table_scale, lambda: (w.table[s] for s in _row_slices(n, step))
    scale = None
    if dtype == np.int8:  # scales first (a small [rows] array), then quantize with them
        scale = np.empty(n, dtype=np.float32)
        for s in _row_slices(n, step):
            scale[s] = int8_scale(w.table_f32(s))
    return scale, lambda: (_to(w.table_f32(s), dtype, None if scale is None else scale[s])
                           for s in _row_slices(n, step))


def _check_table_dtype(table_dtype):
    if table_dtype is None:
        return None
    try:
        name = np.dtype(table_dtype).name
    except TypeError:
        name = None
    if name not in TABLE_DTYPES:
        raise ValueError(f"table_dtype must be one of {TABLE_DTYPES} (or None to keep), got {table_dtype!r}")
    return name


def compact(model, table_dtype):
    """The same model with its tables converted in memory to table_dtype ("float16", "int8"
    with a per-row float32 scale, or "float32"). Other weights are shared, not copied."""
    table_dtype = _check_table_dtype(table_dtype)
    layers = {}
    for L, w in model.layers.items():
        scale, chunks = _table_plan(w, table_dtype)
        table = np.empty(w.table.shape, dtype=table_dtype)
        i = 0
        for c in chunks():
            table[i:i + len(c)] = c
            i += len(c)
        layers[L] = LayerWeights(model.cfg, w.offsets, table, w.proj_w, w.proj_b, w.norm1, w.norm2,
                                 w.conv_norm, w.conv_w, table_scale=scale)
    return type(model)(model.cfg, model.plan, layers)


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def _tensors(cfg, plan, layers, table_dtype):
    """Every tensor of the file (safetensors.Tensor): tables as chunks, converted on the way."""
    G, D, K = cfg.hc_mult, cfg.hidden_size, cfg.kernel_size
    of = Tensor.of
    out = []
    if plan.lookup is not None:
        out.append(of("plan.compression", plan.lookup))
    for L in cfg.layer_ids:
        w, p = layers[L], f"layers.{L}."
        check_file(w.table)  # saving a mapped model whose file changed under it: refused
        out.append(of(f"plan.{L}.multipliers", plan.multipliers[L]))
        out.append(of(f"plan.{L}.primes", plan.head_primes[L]))
        out.append(of(p + "multi_head_embedding.offsets", w.offsets))
        dtype = table_dtype or w.table_dtype
        scale, chunks = _table_plan(w, dtype)
        out.append(Tensor(p + TABLE, CODES[np.dtype(dtype).name], w.table.shape, chunks, page_align=True))
        if scale is not None:
            out.append(of(p + SCALE, scale))
        out.append(of(p + "value_proj.weight", w.value_w))
        out.append(of(p + "value_proj.bias", w.value_b))
        out.append(of(p + "short_conv.conv.weight", w.conv_w, shape=(G * D, 1, K)))
        for g in range(G):
            out.append(of(p + f"key_projs.{g}.weight", w.key_w[g]))
            out.append(of(p + f"key_projs.{g}.bias", w.key_b[g]))
            out.append(of(p + f"norm1.{g}.weight", w.norm1[g]))
            out.append(of(p + f"norm2.{g}.weight", w.norm2[g]))
            out.append(of(p + f"short_conv.norms.{g}.weight", w.conv_norm[g]))
    return out


class _Bar:
    """A minimal stderr progress bar."""

    def __init__(self, path, total):
        self.path, self.total, self.last = os.path.basename(path), total, -1

    def __call__(self, done, total):
        pct = 100 * done // max(1, total)
        if pct != self.last:
            self.last = pct
            end = "\n" if done >= total else ""
            sys.stderr.write(f"\rsaving {self.path}: {pct:3d}% ({done / 1e9:.2f}/{total / 1e9:.2f} GB){end}")
            sys.stderr.flush()


def save(cfg, plan, layers, path, table_dtype=None, progress=None):
    """Write `model` to one file at `path`, atomically: a temp file of its own beside it, then
    os.replace, so `path` is either the old file or the complete new one, never a partial file
    (concurrent saves to one path: the last rename wins, whole). A `path` that exists and is
    not a regular file (a FIFO, a device node, a folder) is refused with a ValueError.

    table_dtype: None keeps each table's dtype; "float32", "float16" or "int8" (per-row
    float32 scale) converts while writing, chunk by chunk (never a second copy of a table).
    progress: callable(done_bytes, total_bytes); by default a stderr bar for files > 256 MB
    when stderr is a terminal. Returns `path`. Read it back with load()."""
    return _write(cfg, plan, layers, path, table_dtype, progress)


def save_init(cfg: EngramConfig, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
              progress=None, before_write=None):
    """Write what EngramModel.init(cfg, seed, graft_zero_init, compression).save(path, table_dtype)
    writes, with flat memory whatever the table size: tables are drawn and written in pieces
    (model.InitTable), never held. before_write(total_bytes), when given, runs once the file's
    size is known and before anything is created (a place to print it, or to refuse it)."""
    plan = HashPlan(cfg, compression=compression)
    layers = init_layers(cfg, plan, seed, graft_zero_init, hold_tables=False)
    return _write(cfg, plan, layers, path, table_dtype, progress, before_write)


def _write(cfg, plan, layers, path, table_dtype, progress, before_write=None):
    """save()'s writer: layers may hold real tables or InitTables (anything sliceable by rows)."""
    table_dtype = _check_table_dtype(table_dtype)
    path = os.fspath(path)
    tensors = _tensors(cfg, plan, layers, table_dtype)
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": cfg.to_json(),
                "table_dtype": table_dtype or layers[cfg.layer_ids[0]].table_dtype}
    lay = safetensors.Layout(tensors, metadata)
    if before_write is not None:
        before_write(lay.nbytes)
    if progress is None and lay.nbytes > BAR_MIN_BYTES and sys.stderr.isatty():
        progress = _Bar(path, lay.nbytes)
    with safetensors.atomic_output(path) as f:
        lay.write_to(f, progress)
    return path


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def _config(meta, err):
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise err("no __metadata__ of str -> str: not an engram_stream checkpoint")
    if meta.get("format") != FORMAT:
        raise err(f"metadata format is {meta.get('format')!r}, expected {FORMAT!r}: not an engram_stream checkpoint")
    if meta.get("format_version") != FORMAT_VERSION:
        raise err(f"format_version {meta.get('format_version')!r} is not supported (this reader: {FORMAT_VERSION})")
    try:
        return EngramConfig.from_dict(json.loads(meta["config"]))
    except KeyError:
        raise err("metadata has no config") from None
    except (ValueError, TypeError, RecursionError) as e:
        raise err(f"metadata config is invalid: {e}") from None


def _expected(cfg, tensors):
    """{name: (allowed dtypes, shape)}; table rows are None here (they need the prime chain)."""
    G, D, E, K, H, n = (cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size, cfg.n_heads,
                        cfg.max_ngram_size)
    i64, f32 = ("I64",), ("F32",)
    code = lambda name: tensors[name].code if name in tensors else None  # noqa: E731
    want = {}
    if "plan.compression" in tensors:
        want["plan.compression"] = (i64, (cfg.vocab_size,))
    for L in cfg.layer_ids:
        p = f"layers.{L}."
        want[f"plan.{L}.multipliers"] = (i64, (n,))
        want[f"plan.{L}.primes"] = (i64, (H,))
        want[p + "multi_head_embedding.offsets"] = (i64, (H,))
        want[p + TABLE] = (("F32", "F16", "I8"), (None, cfg.head_dim))
        if code(p + TABLE) == "I8":
            want[p + SCALE] = (f32, (None,))
        # projection weights: float32, or all bfloat16 (a model.with_weight_dtype("bfloat16"))
        proj = ("BF16",) if code(p + "value_proj.weight") == "BF16" else f32
        want[p + "value_proj.weight"] = (("F32", "BF16"), (D, E))
        want[p + "value_proj.bias"] = (f32, (D,))
        want[p + "short_conv.conv.weight"] = (f32, (G * D, 1, K))
        for g in range(G):
            want[p + f"key_projs.{g}.weight"] = (proj, (D, E))
            want[p + f"key_projs.{g}.bias"] = (f32, (D,))
            for norm in ("norm1", "norm2", "short_conv.norms"):
                want[p + f"{norm}.{g}.weight"] = (f32, (D,))
    return want


def _check_tensors(cfg, tensors, err):
    # Count first: a hostile config (hc_mult = 10**9) must not make us build a huge name list.
    count = len(cfg.layer_ids) * (7 + 5 * cfg.hc_mult)
    if count > 2 * len(tensors) + 16:
        raise err(f"the config needs at least {count} tensors, the file has {len(tensors)}")
    want = _expected(cfg, tensors)
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise err(f"tensors do not match the config: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                  f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
    for name, (codes, shape) in want.items():
        got = tensors[name].shape
        if tensors[name].code not in codes:
            raise err(f"tensor {name!r}: dtype {tensors[name].code}, expected {' or '.join(codes)}")
        if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
            raise err(f"tensor {name!r}: shape {list(got)} disagrees with the config (expected "
                      f"{['rows' if s is None else s for s in shape]})")
    # Rows against the config's least possible prime chain: cheap, so before the prime search.
    rows = [tensors[f"layers.{L}.{TABLE}"].shape[0] for L in cfg.layer_ids]
    least = min_chain_rows(cfg)
    if min(rows) < least or sum(rows) < min_chain_rows(cfg, len(rows)):
        raise err(f"tables of {rows} rows cannot hold the config's prime chain (at least {least} rows a layer, "
                  f"more over all layers): wrong config or corrupted")


def load(path, mmap: bool = True):
    """Read a checkpoint written by save(). Everything is validated before use; a bad file
    raises CheckpointError (a ValueError) naming the problem.

    mmap=True: tables (and int8 scales) are read-only zero-copy views of the file, advised
    MADV_RANDOM (a cold gather must not read ahead); other weights are small copies.
    mmap=False: everything is read into RAM. Returns (cfg, plan, {layer: LayerWeights})."""
    path = os.fspath(path)
    err = lambda msg: CheckpointError(f"{path}: {msg}")  # noqa: E731
    with SafetensorsFile(path, CheckpointError, mmap=mmap, random_access=True) as r:
        cfg = _config(r.header.metadata, err)
        _check_tensors(cfg, r.tensors, err)
        compression = r.read("plan.compression") if "plan.compression" in r.tensors else None
        mult = {L: r.read(f"plan.{L}.multipliers") for L in cfg.layer_ids}
        try:
            plan = HashPlan(cfg, compression=compression, multipliers=mult)
        except (ValueError, TypeError) as e:
            raise err(f"hash plan: {e}") from None
        layers = {L: _layer(cfg, plan, L, r, err) for L in cfg.layer_ids}
        r.check()  # not changed while we read it
    return cfg, plan, layers


def _layer(cfg, plan, L, r, err):
    G, D = cfg.hc_mult, cfg.hidden_size
    p = f"layers.{L}."
    if not np.array_equal(r.read(f"plan.{L}.primes"), plan.head_primes[L]):
        raise err(f"plan.{L}.primes disagree with the prime chain of the config (wrong config or corrupted)")
    offsets = r.read(p + "multi_head_embedding.offsets")
    if not np.array_equal(offsets, plan.offsets[L]):
        raise err(f"{p}multi_head_embedding.offsets disagree with the config's prime chain")
    rows = r.tensors[p + TABLE].shape[0]
    if rows != plan.table_rows[L]:
        raise err(f"tensor {p + TABLE!r}: {rows} rows, the config's primes need {plan.table_rows[L]}")
    table = r.array(p + TABLE)
    scale = None
    if table.dtype == np.int8:
        if r.tensors[p + SCALE].shape != (rows,):
            raise err(f"tensor {p + SCALE!r}: shape {list(r.tensors[p + SCALE].shape)}, expected [{rows}]")
        scale = r.array(p + SCALE)
    get = r.read
    # The fused projection [Wk_0; ...; Wk_{G-1}; Wv] is read in place: no concatenation copy.
    proj_w = np.empty(((G + 1) * D, cfg.engram_dim), r.tensors[p + "value_proj.weight"].dtype)  # F32 or BF16
    proj_b = np.empty((G + 1) * D, np.float32)
    names = [p + f"key_projs.{g}." for g in range(G)] + [p + "value_proj."]
    for i, name in enumerate(names):
        get(name + "weight", out=proj_w[i * D:(i + 1) * D])
        get(name + "bias", out=proj_b[i * D:(i + 1) * D])
    stack = lambda norm: np.stack([get(p + f"{norm}.{g}.weight") for g in range(G)])  # noqa: E731
    # the file holds the demo's arrays: built as the config's variant's class when that class is
    # those arrays (LayerWeights.holds_demo_arrays), else as LayerWeights for its validate_layer to judge
    cls = variant_of(cfg).layer_class
    cls = cls if isinstance(cls, type) and issubclass(cls, LayerWeights) and cls.holds_demo_arrays() else LayerWeights
    return cls(cfg, offsets, table, proj_w, proj_b, stack("norm1"), stack("norm2"),
               stack("short_conv.norms"), get(p + "short_conv.conv.weight").reshape(G * D, cfg.kernel_size),
               table_scale=scale)
