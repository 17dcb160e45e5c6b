"""Checkpoints: one self-describing file in the safetensors layout, with mmap-able tables.

File layout (readable by the `safetensors` package):
    u64 little-endian N | N bytes of JSON header, space-padded | data section
    header = {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}

Offsets are relative to the data section. The safetensors reader insists that they
are contiguous and cover the data section exactly (no gaps), so tables cannot each
be padded to a page boundary. Instead:
  * tensors are ordered by element size (I64, F32, F16, I8): with an 8-aligned data
    section every tensor is aligned to its element size (the engine reads tables
    through raw pointers);
  * the header's space padding is sized so the first table starts on a 4096-byte
    file boundary (whenever the tensors before it sum to a multiple of 8 bytes, which
    they do unless hidden_size * engram_dim is odd).

Tensors: `layers.{L}.<reference state_dict name>` (the demo module's names, see
model.reference_shapes), `layers.{L}.multi_head_embedding.embedding.scale` (F32
[rows], int8 tables only), `plan.{L}.multipliers` (I64 [max_ngram]), `plan.{L}.primes`
(I64 [H]), `plan.compression` (I64 [vocab_size], when the model has one).
Metadata: format, format_version, config (EngramConfig JSON), table_dtype (informative).
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap as _mmap
import os
import stat
import struct
import sys
import warnings

import ml_dtypes
import numpy as np

from ..config import EngramConfig
from ..errors import CheckpointError
from ..io.files import MappedFile, atomic_output, check_file, open_regular, remove_stale_temps  # noqa: F401
from ..plan import HashPlan, min_chain_rows
from .weights import TABLE_DTYPES, LayerWeights, init_layers

FORMAT, FORMAT_VERSION = "engram_stream", "1"
PAGE = 4096
MAX_HEADER = 100 << 20      # the safetensors reader's own limit on N
CHUNK_BYTES = 16 << 20      # float32 bytes converted per step when tables change dtype
BAR_MIN_BYTES = 256 << 20   # the default stderr bar only for files bigger than this

DTYPES = {"I64": np.dtype("<i8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I8": np.dtype("i1"),
          "BF16": np.dtype(ml_dtypes.bfloat16)}  # BF16: projection weights (with_weight_dtype)
CODES = {d.name: c for c, d in DTYPES.items()}
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
class _Entry:
    """One tensor to write: name, dtype, shape and a factory of its C-contiguous chunks."""

    def __init__(self, name, dtype, shape, chunks, is_table=False):
        self.name, self.dtype, self.shape = name, np.dtype(dtype), tuple(int(s) for s in shape)
        self.chunks, self.is_table = chunks, is_table
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def array(cls, name, a, shape=None):
        a = np.ascontiguousarray(a)
        return cls(name, a.dtype, a.shape if shape is None else shape, lambda: iter((a,)))


def _entries(cfg, plan, layers, table_dtype):
    G, D, K = cfg.hc_mult, cfg.hidden_size, cfg.kernel_size
    out = []
    if plan.lookup is not None:
        out.append(_Entry.array("plan.compression", plan.lookup))
    for L in cfg.layer_ids:
        w, p = layers[L], f"layers.{L}."
        check_file(w.table)  # saving a mapped model whose file changed under it: refused
        out.append(_Entry.array(f"plan.{L}.multipliers", plan.multipliers[L]))
        out.append(_Entry.array(f"plan.{L}.primes", plan.head_primes[L]))
        out.append(_Entry.array(p + "multi_head_embedding.offsets", w.offsets))
        scale, chunks = _table_plan(w, table_dtype or w.table_dtype)
        out.append(_Entry(p + TABLE, table_dtype or w.table_dtype, w.table.shape, chunks, is_table=True))
        if scale is not None:
            out.append(_Entry.array(p + SCALE, scale))
        out.append(_Entry.array(p + "value_proj.weight", w.value_w))
        out.append(_Entry.array(p + "value_proj.bias", w.value_b))
        out.append(_Entry.array(p + "short_conv.conv.weight", w.conv_w, (G * D, 1, K)))
        for g in range(G):
            out.append(_Entry.array(p + f"key_projs.{g}.weight", w.key_w[g]))
            out.append(_Entry.array(p + f"key_projs.{g}.bias", w.key_b[g]))
            out.append(_Entry.array(p + f"norm1.{g}.weight", w.norm1[g]))
            out.append(_Entry.array(p + f"norm2.{g}.weight", w.norm2[g]))
            out.append(_Entry.array(p + f"short_conv.norms.{g}.weight", w.conv_norm[g]))
    for e in out:
        if e.dtype.name not in CODES:
            raise ValueError(f"{e.name}: dtype {e.dtype} cannot be saved")
    return out


def _layout(entries, metadata):
    """(ordered entries, header bytes): element-size order, first table on a page boundary."""
    order = sorted(entries, key=lambda e: (-e.dtype.itemsize, not e.is_table))  # stable
    hdr, pos, before_table = {"__metadata__": metadata}, 0, None
    for e in order:
        if e.is_table and before_table is None:
            before_table = pos
        hdr[e.name] = {"dtype": CODES[e.dtype.name], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    n = -(-len(raw) // 8) * 8
    if before_table is not None and before_table % 8 == 0:
        n = -(-(8 + n + before_table) // PAGE) * PAGE - 8 - before_table
    return order, raw + b" " * (n - len(raw))


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
    entries = _entries(cfg, plan, layers, table_dtype)
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": cfg.to_json(),
                "table_dtype": table_dtype or layers[cfg.layer_ids[0]].table_dtype}
    order, header = _layout(entries, metadata)
    total = 8 + len(header) + sum(e.nbytes for e in order)
    if before_write is not None:
        before_write(total)
    if progress is None and total > BAR_MIN_BYTES and sys.stderr.isatty():
        progress = _Bar(path, total)
    with atomic_output(path) as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        done = 8 + len(header)
        for e in order:
            wrote = 0
            for c in e.chunks():
                c = np.ascontiguousarray(c, dtype=e.dtype)
                f.write(c.view(np.uint8).data if c.ndim else c.tobytes())  # raw bytes (bf16 has no buffer code)
                wrote += c.nbytes
                done += c.nbytes
                if progress is not None:
                    progress(done, total)
            if wrote != e.nbytes:  # a bug, not a user error: never write a lying header
                raise RuntimeError(f"{e.name}: wrote {wrote} bytes, header says {e.nbytes}")
    return path


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(f, size, path="checkpoint"):
    """(header dict, data_start, {name: (dtype, shape, absolute offset)}) with the layout checked:
    sane length, JSON, known dtypes, byte sizes, offsets inside the file, no overlaps."""
    err = lambda msg: CheckpointError(f"{path}: {msg}")  # noqa: E731
    if size < 8:
        raise err(f"file is {size} bytes, too short for a header length (truncated?)")
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER:
        raise err(f"header length {n} is absurd (limit {MAX_HEADER}): not a checkpoint, or corrupted")
    if 8 + n > size:
        raise err(f"header length {n} runs past the end of the file ({size} bytes): truncated or corrupted")
    raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise err(f"header is not valid JSON ({e})") from None
    if not isinstance(hdr, dict):
        raise err(f"header must be a JSON object, got {type(hdr).__name__}")
    data_start, spans, tensors = 8 + n, [], {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        if not (isinstance(t, dict) and set(t) == {"dtype", "shape", "data_offsets"}):
            raise err(f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets, got {t!r:.200}")
        code, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if code not in DTYPES:
            raise err(f"tensor {name!r}: unsupported dtype {code!r} (known: {', '.join(DTYPES)})")
        if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
            raise err(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r:.200}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise err(f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offs!r:.200}")
        need = math.prod(shape) * DTYPES[code].itemsize
        if offs[1] - offs[0] != need:
            raise err(f"tensor {name!r}: data_offsets span {offs[1] - offs[0]} bytes but {code} {shape} "
                      f"needs {need}")
        if data_start + offs[1] > size:
            raise err(f"tensor {name!r}: data ends at byte {data_start + offs[1]}, past the end of the file "
                      f"({size} bytes): truncated?")
        spans.append((offs[0], offs[1], name))
        tensors[name] = (DTYPES[code], tuple(shape), data_start + offs[0])
    spans.sort()
    for (b0, e0, a), (b1, e1, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise err(f"tensors {a!r} [{b0}, {e0}) and {b!r} [{b1}, {e1}) overlap")
    return hdr, data_start, tensors


def _config(hdr, err):
    meta = hdr.get("__metadata__")
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
    want = {}
    if "plan.compression" in tensors:
        want["plan.compression"] = (i64, (cfg.vocab_size,))
    for L in cfg.layer_ids:
        p = f"layers.{L}."
        want[f"plan.{L}.multipliers"] = (i64, (n,))
        want[f"plan.{L}.primes"] = (i64, (H,))
        want[p + "multi_head_embedding.offsets"] = (i64, (H,))
        want[p + TABLE] = (("F32", "F16", "I8"), (None, cfg.head_dim))
        table = tensors.get(p + TABLE)
        if table is not None and table[0] == DTYPES["I8"]:
            want[p + SCALE] = (f32, (None,))
        # projection weights: float32, or all bfloat16 (a model.with_weight_dtype("bfloat16"))
        proj = ("BF16",) if tensors.get(p + "value_proj.weight", (None,))[0] == DTYPES["BF16"] else f32
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
        dtype, got, _ = tensors[name]
        if CODES[dtype.name] not in codes:
            raise err(f"tensor {name!r}: dtype {CODES[dtype.name]}, expected {' or '.join(codes)}")
        if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
            raise err(f"tensor {name!r}: shape {list(got)} disagrees with the config (expected "
                      f"{['rows' if s is None else s for s in shape]})")
    # Rows against the config's least possible prime chain: cheap, so before the prime search.
    rows = [tensors[f"layers.{L}.{TABLE}"][1][0] for L in cfg.layer_ids]
    least = min_chain_rows(cfg)
    if min(rows) < least or sum(rows) < min_chain_rows(cfg, len(rows)):
        raise err(f"tables of {rows} rows cannot hold the config's prime chain (at least {least} rows a layer, "
                  f"more over all layers): wrong config or corrupted")


class _Reader:
    """Tensors of an open file: table() is an mmap view (zero-copy, read-only) when mapping,
    read() a fresh array read into RAM."""

    def __init__(self, f, st, tensors, use_mmap, path):
        self.f, self.tensors, self.mm = f, tensors, None
        if use_mmap:
            # No read-ahead, neither for the mapping nor for our reads of the small tensors:
            # tables must come in row by row (read-ahead would pull in MBs nobody asked for).
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            self.mm = MappedFile(f.fileno(), st, path)  # check(): the file is still as validated
            self.mm.madvise(_mmap.MADV_RANDOM)

    def table(self, name):
        if self.mm is None:
            return self.read(name)
        dtype, shape, off = self.tensors[name]
        a = np.frombuffer(self.mm, dtype, math.prod(shape), off).reshape(shape)
        if not a.flags.aligned:  # never in our files (see the layout above); maybe in others'
            warnings.warn(f"{name}: misaligned in the file, copied into RAM instead of mapped", stacklevel=4)
            a = a.copy()
        return a

    def read(self, name, out=None):
        """The tensor in a new array, or read straight into `out` (a C-contiguous slot of its size)."""
        dtype, shape, off = self.tensors[name]
        a = np.empty(shape, dtype) if out is None else out.reshape(shape)
        if a.nbytes:
            buf, got = a.reshape(-1).view(np.uint8).data, 0  # raw bytes (bf16 has no buffer code)
            self.f.seek(off)
            while got < a.nbytes:
                k = self.f.readinto(buf[got:got + (1 << 30)])
                if not k:
                    raise CheckpointError(f"tensor {name!r}: file ended while reading it (truncated meanwhile?)")
                got += k
        return a


def load(path, mmap: bool = True):
    """Read a checkpoint written by save(). Everything is validated before use; a bad file
    raises CheckpointError (a ValueError) naming the problem.

    mmap=True: tables (and int8 scales) are read-only zero-copy views of the file, advised
    MADV_RANDOM (a cold gather must not read ahead); other weights are small copies.
    mmap=False: everything is read into RAM. Returns (cfg, plan, {layer: LayerWeights})."""
    path = os.fspath(path)
    err = lambda msg: CheckpointError(f"{path}: {msg}")  # noqa: E731
    with open_regular(path, err) as f:
        st = os.fstat(f.fileno())
        hdr, _, tensors = read_header(f, st.st_size, path)
        cfg = _config(hdr, err)
        _check_tensors(cfg, tensors, err)
        r = _Reader(f, st, tensors, mmap, path)
        compression = r.read("plan.compression") if "plan.compression" in tensors else None
        mult = {L: r.read(f"plan.{L}.multipliers") for L in cfg.layer_ids}
        try:
            plan = HashPlan(cfg, compression=compression, multipliers=mult)
        except (ValueError, TypeError) as e:
            raise err(f"hash plan: {e}") from None
        layers = {}
        for L in cfg.layer_ids:
            layers[L] = _layer(cfg, plan, L, r, err)
        if r.mm is not None:
            r.mm.check()  # not changed while we read it
    return cfg, plan, layers


def _layer(cfg, plan, L, r, err):
    G, D = cfg.hc_mult, cfg.hidden_size
    p = f"layers.{L}."
    if not np.array_equal(r.read(f"plan.{L}.primes"), plan.head_primes[L]):
        raise err(f"plan.{L}.primes disagree with the prime chain of the config (wrong config or corrupted)")
    offsets = r.read(p + "multi_head_embedding.offsets")
    if not np.array_equal(offsets, plan.offsets[L]):
        raise err(f"{p}multi_head_embedding.offsets disagree with the config's prime chain")
    rows = r.tensors[p + TABLE][1][0]
    if rows != plan.table_rows[L]:
        raise err(f"tensor {p + TABLE!r}: {rows} rows, the config's primes need {plan.table_rows[L]}")
    table = r.table(p + TABLE)
    scale = None
    if table.dtype == np.int8:
        if r.tensors[p + SCALE][1] != (rows,):
            raise err(f"tensor {p + SCALE!r}: shape {list(r.tensors[p + SCALE][1])}, expected [{rows}]")
        scale = r.table(p + SCALE)
    get = r.read
    # The fused projection [Wk_0; ...; Wk_{G-1}; Wv] is read in place: no concatenation copy.
    proj_w = np.empty(((G + 1) * D, cfg.engram_dim), r.tensors[p + "value_proj.weight"][0])  # F32 or BF16
    proj_b = np.empty((G + 1) * D, np.float32)
    names = [p + f"key_projs.{g}." for g in range(G)] + [p + "value_proj."]
    for i, name in enumerate(names):
        get(name + "weight", out=proj_w[i * D:(i + 1) * D])
        get(name + "bias", out=proj_b[i * D:(i + 1) * D])
    stack = lambda norm: np.stack([get(p + f"{norm}.{g}.weight") for g in range(G)])  # noqa: E731
    return LayerWeights(cfg, offsets, table, proj_w, proj_b, stack("norm1"), stack("norm2"),
                        stack("short_conv.norms"), get(p + "short_conv.conv.weight").reshape(G * D, cfg.kernel_size),
                        table_scale=scale)
