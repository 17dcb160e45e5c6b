"""GGUF files: the header read and checked (no dependency on the gguf package), and table rows
decoded by the C decoders the engines use (include/engram_gguf.h through rows/_gguf.pyx).

    open_gguf(path)                     the file's (or a split model's) keys and tensors
    read_rows(path, tensor, row_ids)    float32[n, row_length]: rows of a tensor of a served type
    table_layout(model)                 the Engram table(s) of a GGUF in a variant's layout
                                        (its gguf_layout: engram_stream/VARIANT/gguf.py), the
                                        constants present and missing
    check_config(model, cfg, plan)      those tables against a model folder's config
    describe(path)                      what `engram-stream inspect model.gguf` prints

The format (GGUF version 2 and 3, little endian): "GGUF", u32 version, u64 tensor count, u64
key count; the keys (string, u32 value type, value); the tensor infos (string name, u32 dims,
u64 ne[dims] with ne[0] the row length, u32 ggml type, u64 offset); then the data, from the
header's end rounded up to general.alignment (32 if absent), each tensor at its offset from
there (a multiple of the alignment: 32 bytes, not a page).

A GGUF is untrusted input: every count, length and offset is checked against the file's size
before anything is read or allocated from it, and a file that fails is refused with a
CheckpointError naming the file and what is wrong.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4            # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4     # arrays of arrays nest at most this deep (llama.cpp writes depth 1)
_CHUNK = 1 << 20        # header bytes read at a time

# ggml type number -> (name, values a block, bytes a block): every ggml type, so that a tensor
# of any type has its extent checked; the types the decoders serve are SERVED.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
E4M3_ROW_BYTES = 264  # a DeepSeek-V4.1 row kept whole: 256 e4m3 bytes, 8 e8m0 scales (an I8 tensor)
SERVED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K",
          "Q4_K", "Q5_K", "Q6_K")
SERVED_TEXT = ", ".join(SERVED) + f" and I8 rows of {E4M3_ROW_BYTES} bytes (256 e4m3 values, 8 e8m0 scales)"

# GGUF value types: number -> (name, struct format or None for string/array)
_SCALARS = {0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
            4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"),
            10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d")}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF: ne as the file gives it (ne[0] the row length), its ggml type, and
    the absolute byte offset of its data in `path`."""
    name: str
    ne: tuple
    ggml_type: int
    offset: int
    nbytes: int
    path: str

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0] if self.ggml_type in GGML_TYPES else f"type {self.ggml_type}"

    @property
    def rows(self) -> int:
        n = 1
        for d in self.ne[1:]:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        _, bv, bb = GGML_TYPES[self.ggml_type]
        return self.ne[0] // bv * bb

    @property
    def is_e4m3_rows(self) -> bool:
        return self.type_name == "I8" and self.ne[0] == E4M3_ROW_BYTES

    @property
    def row_length(self) -> int:
        """Values a decoded row holds (256 for the 264-byte e4m3 rows)."""
        return 256 if self.is_e4m3_rows else self.ne[0]

    @property
    def served_as(self) -> str:
        """How the decoders read it: a SERVED type name, or "E4M3_ROW"."""
        return "E4M3_ROW" if self.is_e4m3_rows else self.type_name

    def decoder_type(self) -> int:
        """The decoders' type number; CheckpointError for a type they do not serve."""
        from . import _gguf
        if self.is_e4m3_rows:
            return _gguf.E4M3_ROW
        if self.type_name not in SERVED:
            raise CheckpointError(f"{self.path}: tensor {self.name} is {self.type_name} "
                                  f"(ne {list(self.ne)}), a type the row decoders do not serve: they serve "
                                  f"{SERVED_TEXT}; requantize the table to one of these (llama-quantize)")
        return self.ggml_type


@dataclass
class GGUFFile:
    """A parsed GGUF (one file, or the shards of a split model as one): its keys, its tensors
    by name, and the files that hold them."""
    path: str
    version: int
    kv: dict
    tensors: dict
    alignment: int
    files: list = field(default_factory=list)

    @property
    def architecture(self):
        return self.kv.get("general.architecture")

    def tensor(self, name) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            some = ", ".join(sorted(self.tensors)[:8])
            raise CheckpointError(f"{self.path}: no tensor {name!r} (it has {len(self.tensors)}: {some}"
                                  f"{', ...' if len(self.tensors) > 8 else ''})")
        return t


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential reads of a file's header with every length checked against the file's size."""

    def __init__(self, fd, size, path):
        self.fd, self.size, self.path = fd, size, path
        self.pos, self.buf, self.at = 0, b"", 0

    def fail(self, what):
        raise CheckpointError(f"{self.path}: not a valid GGUF file: {what}")

    def take(self, n, what) -> memoryview:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file ends at byte {self.size} (truncated?)")
        if not (self.at <= self.pos and self.pos + n <= self.at + len(self.buf)):
            data = os.pread(self.fd, min(max(n, _CHUNK), self.size - self.pos), self.pos)
            if len(data) < n:
                self.fail(f"{what} at byte {self.pos}: the file shrank while being read")
            self.buf, self.at = data, self.pos
        off = self.pos - self.at
        self.pos += n
        return memoryview(self.buf)[off:off + n]

    def scalar(self, fmt, what):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at byte {self.pos - n} is not UTF-8")

    def count(self, what, min_item_bytes):
        """A u64 count of items that take at least min_item_bytes each: refused when the rest of
        the file could not hold them (a hostile count must not size an allocation)."""
        n = self.scalar("<Q", what)
        if n * min_item_bytes > self.size - self.pos:
            self.fail(f"{what} is {n}, more than the {self.size - self.pos} bytes left could hold "
                      f"(truncated, or a corrupted count)")
        return n

    def value(self, vtype, what, depth=0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][1], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            self.fail(f"{what} has value type {vtype}, not a GGUF value type (0..12)")
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        itype = self.scalar("<I", f"the item type of {what}")
        if itype in _NUMPY:
            n = self.count(f"the length of {what}", np.dtype(_NUMPY[itype]).itemsize)
            return np.frombuffer(self.take(n * np.dtype(_NUMPY[itype]).itemsize, what), _NUMPY[itype]).copy()
        if itype == 7:
            n = self.count(f"the length of {what}", 1)
            return np.frombuffer(self.take(n, what), np.uint8) != 0
        if itype not in (_STRING, _ARRAY):
            self.fail(f"{what} is an array of value type {itype}, not a GGUF value type (0..12)")
        n = self.count(f"the length of {what}", 8 if itype == _STRING else 12)
        if itype == _STRING:
            return self.strings(n, what)
        return [self.value(itype, f"{what}[{i}]", depth + 1) for i in range(n)]

    def strings(self, n, what):
        """n strings: those whole in the buffer sliced from it, the others through string() (its
        checks and messages). A tokenizer's 150k-string arrays: no description formatted a string."""
        out, unpack = [], _U64.unpack_from
        for i in range(n):
            buf, off = self.buf, self.pos - self.at
            if off + 8 <= len(buf):
                end = off + 8 + unpack(buf, off)[0]
                if end <= len(buf):
                    try:
                        out.append(str(buf[off + 8:end], "utf-8"))
                    except UnicodeDecodeError:
                        self.fail(f"{what}[{i}] at byte {self.pos + 8} is not UTF-8")
                    self.pos += end - off
                    continue
            out.append(self.string(f"{what}[{i}]"))
        return out


def _parse(path) -> GGUFFile:
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        c = _Cursor(fd, size, path)
        magic = bytes(c.take(4, "the magic"))
        if magic != MAGIC:
            c.fail(f"magic {magic!r}, a GGUF file starts with {MAGIC!r}")
        version = c.scalar("<I", "the version")
        if version not in VERSIONS:
            c.fail(f"version {version}, this reader takes versions {VERSIONS} (little endian)")
        n_tensors = c.scalar("<Q", "the tensor count")
        n_kv = c.count("the key count", 8 + 4 + 1)
        kv = {}
        for i in range(n_kv):
            key = c.string(f"key {i}'s name")
            if key in kv:
                c.fail(f"key {key} appears twice")
            kv[key] = c.value(c.scalar("<I", f"key {key}'s value type"), f"key {key}")
        if n_tensors * (8 + 4 + 8 + 4 + 8) > size - c.pos:
            c.fail(f"the tensor count is {n_tensors}, more than the {size - c.pos} bytes left could hold "
                   f"(truncated, or a corrupted count)")
        alignment = kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                or alignment & (alignment - 1)):
            c.fail(f"general.alignment is {alignment!r}, not a power of two")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor {i}'s name")
            ndim = c.scalar("<I", f"tensor {name}'s dimension count")
            if not 1 <= ndim <= MAX_DIMS:
                c.fail(f"tensor {name} has {ndim} dimensions, ggml tensors have 1 to {MAX_DIMS}")
            ne = tuple(c.scalar("<Q", f"tensor {name}'s ne[{d}]") for d in range(ndim))
            infos.append((name, ne, c.scalar("<I", f"tensor {name}'s type"), c.scalar("<Q", f"tensor {name}'s offset")))
        data = -(-c.pos // alignment) * alignment
        tensors = {}
        for name, ne, gtype, off in infos:
            if name in tensors:
                c.fail(f"tensor {name} appears twice")
            tensors[name] = _tensor(c, path, size, data, alignment, name, ne, gtype, off)
        return GGUFFile(path=path, version=version, kv=kv, tensors=tensors, alignment=alignment, files=[path])
    finally:
        os.close(fd)


def _tensor(c, path, size, data, alignment, name, ne, gtype, off) -> GGUFTensor:
    if gtype not in GGML_TYPES:
        c.fail(f"tensor {name} has type {gtype}, not a ggml type this reader knows (types served: {SERVED_TEXT})")
    tname, bv, bb = GGML_TYPES[gtype]
    if ne[0] % bv:
        c.fail(f"tensor {name} ({tname}) has rows of {ne[0]} values, not whole blocks of {bv}")
    nbytes = ne[0] // bv * bb
    for d in ne[1:]:
        nbytes *= d
    if off % alignment:
        c.fail(f"tensor {name}'s offset {off} is not a multiple of general.alignment {alignment}")
    if data + off + nbytes > size:
        c.fail(f"tensor {name}'s data [{data + off}, {data + off + nbytes}) ends past the end of the file "
               f"(byte {size}; truncated?)")
    return GGUFTensor(name=name, ne=ne, ggml_type=gtype, offset=data + off, nbytes=nbytes, path=path)


def split_paths(path) -> list:
    """The shard paths of a split GGUF (llama.cpp's NAME-00001-of-0000N.gguf), given any shard;
    [path] for a file whose name is not a shard's."""
    path = os.fspath(path)
    m = _SPLIT.match(path)
    if m is None:
        return [path]
    count = int(m["count"])
    return [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def open_gguf(path) -> GGUFFile:
    """The GGUF at path: one file, or every shard of a split model (any shard's path names them
    all) as one GGUFFile whose keys are the first shard's (where llama.cpp's gguf-split puts
    them) and whose tensors are all the shards'."""
    paths = split_paths(path)
    first = _parse(paths[0])
    count = int(first.kv.get("split.count", 1))
    if count != len(paths):
        if count == 1 and len(paths) > 1:
            return _parse(os.fspath(path))  # a name like a shard's, a whole model inside
        raise CheckpointError(f"{paths[0]}: split.count is {count}, the file name says {len(paths)} shards "
                              f"(rename the shards as llama.cpp's gguf-split writes them)")
    if count == 1:
        return first
    model = GGUFFile(path=paths[0], version=first.version, kv=dict(first.kv), tensors=dict(first.tensors),
                     alignment=first.alignment, files=list(paths))
    for i, p in enumerate(paths[1:], start=1):
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: missing, shard {i + 1} of the {count} of {paths[0]}")
        shard = _parse(p)
        if int(shard.kv.get("split.no", -1)) != i or int(shard.kv.get("split.count", -1)) != count:
            raise CheckpointError(f"{p}: split.no {shard.kv.get('split.no')} of split.count "
                                  f"{shard.kv.get('split.count')}, its name says shard {i} (0-based) of {count}")
        for name, t in shard.tensors.items():
            if name in model.tensors:
                raise CheckpointError(f"{p}: tensor {name} is also in {model.tensors[name].path}")
            model.tensors[name] = t
    want = first.kv.get("split.tensors.count")
    if want is not None and int(want) != len(model.tensors):
        raise CheckpointError(f"{paths[0]}: split.tensors.count is {want}, the {count} shards hold "
                              f"{len(model.tensors)} tensors (a shard replaced by another model's?)")
    return model


def read_rows(path, tensor_name, row_ids) -> np.ndarray:
    """float32[len(row_ids), row_length]: rows of tensor `tensor_name` of the GGUF at `path` (a
    split model's shards found from any one), decoded by the engines' C decoders. For tests and
    tools: each row is one pread."""
    from . import _gguf
    model = open_gguf(path)
    t = model.tensor(tensor_name)
    qtype = t.decoder_type()
    ids = np.asarray(row_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"row_ids: a 1-D sequence of integers, got {ids.dtype} of shape {ids.shape}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= t.rows)]
    if bad.size:
        raise IndexError(f"{t.path}: row {int(bad[0])} of tensor {t.name}, which has {t.rows} rows")
    rb = t.row_bytes
    raw = np.empty((ids.size, rb), np.uint8)
    fd = os.open(t.path, os.O_RDONLY)
    try:
        for k, r in enumerate(ids.tolist()):
            got = os.preadv(fd, [raw[k]], t.offset + r * rb)
            if got != rb:
                raise CheckpointError(f"{t.path}: row {r} of tensor {t.name} ends past the end of the file "
                                      f"(the file shrank since it was opened?)")
    finally:
        os.close(fd)
    return _gguf.decode_rows(qtype, raw, t.row_length)


# ---- GGUF rows as an engine's records ---------------------------------------------------------

# A GGUF table's record is its row's bytes as the file holds them (quantized: more rows a MB in a
# row cache); its format names the decoder, "gguf:" then the served type ("gguf:Q4_K",
# "gguf:E4M3_ROW"), and an engine's gather decodes it with include/engram_gguf.h.
RECORD_PREFIX = "gguf:"
E4M3_ROW_RECORD = RECORD_PREFIX + "E4M3_ROW"   # the bytes of records.E4M3_E8M0_RECORD, as ds4 keeps them


def record_format_of(t: GGUFTensor) -> str:
    """The record format of tensor t's rows (CheckpointError for a type not served)."""
    t.decoder_type()
    return RECORD_PREFIX + t.served_as


def record_type(record_format) -> int:
    """The decoders' type number of a GGUF record format, or -1 for any other format."""
    if not (isinstance(record_format, str) and record_format.startswith(RECORD_PREFIX)):
        return -1
    from . import _gguf
    name = record_format[len(RECORD_PREFIX):]
    if name == "E4M3_ROW":
        return _gguf.E4M3_ROW
    if name not in SERVED:
        raise ValueError(f"row records of format {record_format!r}: the decoders serve {SERVED_TEXT}")
    return next(k for k, v in GGML_TYPES.items() if v[0] == name)


def gather_type(source, row_length, layer) -> int:
    """What an engine's gather does with `source`'s records: the decoders' type number for GGUF
    rows of `row_length` values (ValueError when the records are not that long), -1 for any
    other format (the engine's own gathers)."""
    qtype = record_type(source.record_format)
    if qtype < 0:
        return -1
    from . import _gguf
    rb = _gguf.row_bytes(qtype, row_length)
    if source.rowbytes != rb or source.scalebytes != 0:
        raise ValueError(f"layer {layer}: {source.record_format} records of {source.rowbytes}+{source.scalebytes} "
                         f"bytes, a row of {row_length} values is {rb}+0")
    return qtype


# ---- the Engram tables of the converters' layouts ---------------------------------------------

class Layout:
    """Where a converter puts one variant's Engram table(s) and hash constants in a GGUF: a
    variant's `gguf_layout` (engram_stream/VARIANT/gguf.py), found by the file's
    general.architecture (layouts()).

    archs: {general.architecture: the converter that writes it}; keys: the constants a file may
    carry (their prefix {arch}. is the file's architecture). tables(model): (what, tensor name)
    of the table tensors present, in order. expected(arch, cfg, plan): {key with its prefix: the
    model folder's value} of every constant a file may carry. layers(path, cfg, plan, tables):
    {layer: [(GGUFTensor, rows it must have)]} (one tensor a layer, or a split table's tensors
    in row order), CheckpointError when the tables are not the config's layers."""

    archs: dict = {}
    keys: tuple = ()

    def tables(self, model) -> list:
        raise NotImplementedError

    def expected(self, arch, cfg, plan) -> dict:
        return {}

    def layers(self, path, cfg, plan, tables) -> dict:
        raise NotImplementedError


def numbered(model, pattern, what) -> list:
    """(what j, name) of the tensors pattern.format(j), j = 0, 1, ... while present."""
    out, j = [], 0
    while pattern.format(j) in model.tensors:
        out.append((f"{what} {j}", pattern.format(j)))
        j += 1
    return out


def layouts() -> dict:
    """{general.architecture: (Layout, variant name)} of every registered variant with a gguf_layout."""
    from ..variants import variants
    return {arch: (v.gguf_layout, v.name) for v in variants() if v.gguf_layout is not None
            for arch in v.gguf_layout.archs}


def table_layout(model: GGUFFile):
    """(Layout, [(what, GGUFTensor)], {key: value} present, [keys] missing) of a GGUF of a
    variant's layout; CheckpointError for another architecture or a file without its table."""
    arch = model.architecture
    found = layouts()
    if arch not in found:
        raise CheckpointError(f"{model.path}: general.architecture is {arch!r}, not one whose Engram tables "
                              f"engram-stream reads ({', '.join(found)})")
    layout = found[arch][0]
    tables = [(what, model.tensor(name)) for what, name in layout.tables(model)]
    if not tables:
        raise CheckpointError(f"{model.path}: a {arch} GGUF without its Engram table (no tensor named as "
                              f"{layout.archs[arch]} writes it)")
    full = [f"{arch}.{k}" for k in layout.keys]
    present = {k: model.kv[k] for k in full if k in model.kv}
    return layout, tables, present, [k for k in full if k not in model.kv]


def _value_text(v):
    if isinstance(v, (np.ndarray, list)):
        items = [str(x) for x in list(v)[:4]]
        return f"[{', '.join(items)}{', ...' if len(v) > 4 else ''}] ({len(v)} values)"
    return repr(v)


def describe(path) -> list:
    """The lines of `engram-stream inspect model.gguf`: the files, the Engram table(s) (type,
    shape, bytes a row, whether the decoders serve the type) and the constants present or
    missing (a model's Hugging Face folder gives the missing ones)."""
    model = open_gguf(path)
    size = sum(os.path.getsize(f) for f in model.files)
    shards = f", {len(model.files)} shards" if len(model.files) > 1 else ""
    lines = [f"gguf: {model.path} ({size / 2**20:,.1f} MiB{shards}), GGUF v{model.version}, "
             f"{len(model.tensors)} tensor{'s' if len(model.tensors) != 1 else ''}, alignment {model.alignment}"]
    layout, tables, present, missing = table_layout(model)
    lines.append(f"layout: {model.architecture} (as {layout.archs[model.architecture]} writes it), {len(tables)} table"
                 f"{'s' if len(tables) != 1 else ''}")
    for what, t in tables:
        served = "served" if t.is_e4m3_rows or t.type_name in SERVED else f"NOT served (types served: {SERVED_TEXT})"
        kind = "I8 rows of 256 e4m3 values and 8 e8m0 scales" if t.is_e4m3_rows else t.type_name
        lines.append(f"  {what}: {t.name} {kind}, [{t.rows}, {t.row_length}], {t.row_bytes} bytes a row, "
                     f"{t.nbytes / 2**20:,.1f} MiB at byte {t.offset} of {os.path.basename(t.path)}: {served}")
    for k, v in present.items():
        lines.append(f"  constant {k} = {_value_text(v)}")
    if missing:
        lines.append(f"  missing (taken from the model's folder): {', '.join(missing)}")
    return lines


# ---- the checks at open: a GGUF's tables against the model folder's config --------------------

def _same(got, want) -> bool:
    """Integers equal as 64-bit patterns (a converter may write int64 multipliers as UINT64)."""
    g, w = np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want))
    if g.shape != w.shape or g.dtype.kind not in "iub" or w.dtype.kind not in "iub":
        return False
    return bool(np.array_equal(g.astype(np.uint64), w.astype(np.int64).view(np.uint64)))


def check_config(model: GGUFFile, cfg, plan):
    """The GGUF's Engram tables checked against a model folder's config and plan: the
    architecture, each table's row length, row count and type, and every constant the GGUF
    carries (a mismatch names both values). Returns ({layer: [GGUFTensor, ...]} (one tensor, or
    a split table's tensors in row order), [the keys the GGUF lacks, taken from the folder])."""
    from ..variants import variant_of
    arch, path = model.architecture, model.path
    own = variant_of(cfg).gguf_layout
    if own is None:
        served = sorted({name for _, name in layouts().values()})
        raise CheckpointError(f"{path}: a {cfg.variant} model reads no GGUF tables (GGUF tables serve "
                              f"{', '.join(served)})")
    if arch not in own.archs:
        raise CheckpointError(f"{path}: general.architecture is {arch!r}, the folder's config is a {cfg.variant} "
                              f"model (its GGUFs are {' or '.join(own.archs)})")
    layout, tables, present, missing = table_layout(model)
    layers = layout.layers(path, cfg, plan, tables)
    for key, want in layout.expected(arch, cfg, plan).items():
        if key in present and not _same(present[key], want):
            folder = _value_text(np.asarray(want).tolist()) if np.ndim(want) else repr(want)
            raise CheckpointError(f"{path}: {key} is {_value_text(present[key])} in the GGUF, {folder} in the "
                                  f"model folder's config: not this model's table")
    for L, ts in layers.items():
        for t, rows in ts:
            t.decoder_type()  # a type not served: named, with the types served
            if (t.row_length, t.rows) != (cfg.head_dim, rows):
                raise CheckpointError(f"{path}: {t.name} is [{t.rows}, {t.row_length}], layer {L} of the folder's "
                                      f"config is [{rows}, {cfg.head_dim}]")
    return {L: [t for t, _ in ts] for L, ts in layers.items()}, missing
