"""The safetensors codec: one header reader and one chunked writer, for every variant (demo
single-file checkpoints, deepseek-v4.1 Hugging Face shards).

    u64 little-endian N | N bytes of JSON header, space-padded | data section
    header = {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}

Offsets are relative to the data section.

  DTYPES              the one dtype table: safetensors code -> the numpy dtype its bytes are read as
  read_header(f, ...) the header with every field checked (Header, TensorInfo)
  SafetensorsFile     an open file: its header, tensors read into RAM or as views of a map
  Tensor, Layout      tensors to write (chunks, never a whole copy) and their file layout
  write(path, ...)    one file, atomically (io.files.atomic_output)

The reader checks, before anything is read: the header length (<= MAX_HEADER, inside the
file), JSON (no duplicate keys; nesting too deep for the parser is refused, not a crash), every
entry (exactly dtype, shape, data_offsets; ints only; begin <= end), each tensor's byte span
against its shape (exact integers: a shape whose product passes 2**64 cannot wrap to a small
size), every span inside the file, and no two spans overlapping. A dtype code outside DTYPES is
allowed in the header (a V4.1 folder's shards hold tensors of other dtypes that engram_stream
never reads); reading such a tensor is refused.
"""
from __future__ import annotations

import json
import math
import mmap as _mmap
import os
import struct
import warnings

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from .files import MappedFile, atomic_output, open_regular

MAX_HEADER = 100 << 20   # the safetensors reader's own limit on N
PAGE = 4096

# The one dtype table. Float8 stays raw bytes (uint8): the V4.1 engine reads the bytes, and
# numpy has no float8 arithmetic of its own.
DTYPES = {"I64": np.dtype("<i8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
          "F8_E4M3": np.dtype("u1"), "F8_E8M0": np.dtype("u1")}
# numpy dtype name -> code, for writers that hold typed arrays (uint8 is U8: float8 callers name their code)
CODES = {"int64": "I64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8", "uint8": "U8"}
# Bits per element of the other safetensors codes: tensors never read, but their spans are checked too.
OTHER_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E5M2": 8, "I16": 16, "U16": 16, "I32": 32,
              "U32": 32, "U64": 64, "F64": 64, "C64": 64}


def _bits(code):
    return DTYPES[code].itemsize * 8 if code in DTYPES else OTHER_BITS.get(code)


class TensorInfo:
    """One header entry, checked: code, shape, absolute file offset `start`, nbytes."""

    __slots__ = ("name", "code", "shape", "start", "nbytes")

    def __init__(self, name, code, shape, start, nbytes):
        self.name, self.code, self.shape, self.start, self.nbytes = name, code, shape, start, nbytes

    @property
    def dtype(self):
        """The numpy dtype the bytes are read as, or None (a code engram_stream does not read)."""
        return DTYPES.get(self.code)


class Header:
    """tensors {name: TensorInfo}, metadata (dict of str or None), data_start, size (of the file)."""

    def __init__(self, tensors, metadata, data_start, size):
        self.tensors, self.metadata, self.data_start, self.size = tensors, metadata, data_start, size


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(f, size, path, error=CheckpointError) -> Header:
    """The header of the open file `f` (`size` bytes), every field checked (see the module doc).
    error: the class raised, with a message that starts with `path` and names the tensor."""
    err = lambda msg: error(f"{path}: {msg}")  # noqa: E731
    if size < 8:
        raise err(f"file is {size} bytes, too short for a safetensors header length (truncated?)")
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER:
        raise err(f"header length {n} is absurd (limit {MAX_HEADER}): not a safetensors file, or corrupted")
    if 8 + n > size:
        raise err(f"header length {n} runs past the end of the file ({size} bytes): truncated or corrupted")
    try:
        hdr = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise err(f"header is not valid JSON ({str(e)[:200] or type(e).__name__})") from None
    if not isinstance(hdr, dict):
        raise err(f"header must be a JSON object, got {type(hdr).__name__}")
    meta = hdr.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise err("__metadata__ must map str to str")
    data_start, tensors, spans = 8 + n, {}, []
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        what = f"tensor {name!r}"
        if not (isinstance(t, dict) and set(t) == {"dtype", "shape", "data_offsets"}):
            raise err(f"{what}: entry must have exactly dtype, shape and data_offsets, got {t!r:.200}")
        code, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(code, str):
            raise err(f"{what}: dtype must be a string, got {code!r:.100}")
        if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
            raise err(f"{what}: shape must be a list of non-negative ints, got {shape!r:.200}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise err(f"{what}: data_offsets must be [begin, end], ints with 0 <= begin <= end, got {offs!r:.200}")
        bits = _bits(code)
        if bits is not None:
            need = -(-math.prod(shape) * bits // 8)  # Python ints: no product wraps
            if offs[1] - offs[0] != need:
                raise err(f"{what}: data_offsets span {offs[1] - offs[0]} bytes but {code} {shape} needs {need}")
        if data_start + offs[1] > size:
            raise err(f"{what}: data ends at byte {data_start + offs[1]}, past the end of the file "
                      f"({size} bytes): truncated?")
        if offs[1] > offs[0]:
            spans.append((offs[0], offs[1], name))
        tensors[name] = TensorInfo(name, code, tuple(shape), data_start + offs[0], offs[1] - offs[0])
    spans.sort()
    for (b0, e0, a), (b1, e1, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise err(f"tensors {a!r} [{b0}, {e0}) and {b!r} [{b1}, {e1}) overlap")
    return Header(tensors, meta, data_start, size)


class SafetensorsFile:
    """An open safetensors file with its checked header (.header, .tensors).

    mmap=True maps the whole file once (a MappedFile: check() refuses it once the file changed);
    array() then gives read-only zero-copy views, advised MADV_RANDOM when random_access (table
    rows must come in one by one: read-ahead would pull in MBs nobody asked for). read() always
    copies into RAM. Use as a context manager, or close(): the mapping outlives the file."""

    def __init__(self, path, error=CheckpointError, mmap=False, random_access=False):
        self.path, self.error, self.mm = os.fspath(path), error, None
        self.f = open_regular(self.path, lambda m: error(f"{self.path}: {m}"))
        try:
            st = os.fstat(self.f.fileno())
            if mmap and random_access:  # before the header's read: its read-ahead would pull in the first tables' pages
                os.posix_fadvise(self.f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # our reads of small tensors too
            self.header = read_header(self.f, st.st_size, self.path, error)
            self.tensors = self.header.tensors
            if mmap:
                self.mm = MappedFile(self.f.fileno(), st, self.path)
                if random_access:
                    self.mm.madvise(_mmap.MADV_RANDOM)
        except BaseException:
            self.f.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.f.close()

    def check(self):
        """FileChangedError when the mapped file changed since it was mapped (else nothing)."""
        if self.mm is not None:
            self.mm.check()

    def info(self, name) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise self.error(f"{self.path}: no tensor {name!r}")
        if t.dtype is None:
            raise self.error(f"{self.path}: tensor {name!r} has dtype {t.code!r}, which engram_stream does not read "
                             f"(it reads {', '.join(DTYPES)})")
        return t

    def array(self, name) -> np.ndarray:
        """The tensor: a read-only view of the mapping (mmap=True), else a copy in RAM. A tensor
        that is not aligned to its element size (never in our files) is copied, with a warning."""
        if self.mm is None:
            return self.read(name)
        t = self.info(name)
        a = np.frombuffer(self.mm, t.dtype, math.prod(t.shape), t.start).reshape(t.shape)
        if not a.flags.aligned:
            warnings.warn(f"{self.path}: {name} is misaligned in the file, copied into RAM instead of mapped",
                          stacklevel=2)
            a = a.copy()
        return a

    def read(self, name, out=None) -> np.ndarray:
        """The tensor in a new array, or read straight into `out` (a C-contiguous slot of its size)."""
        t = self.info(name)
        a = np.empty(t.shape, t.dtype) if out is None else out.reshape(t.shape)
        if a.nbytes:
            buf, got = a.reshape(-1).view(np.uint8).data, 0  # raw bytes (bf16 has no buffer code)
            self.f.seek(t.start)
            while got < a.nbytes:
                k = self.f.readinto(buf[got:got + (1 << 30)])
                if not k:
                    raise self.error(f"{self.path}: tensor {name!r}: the file ended while reading it "
                                     f"(truncated meanwhile?)")
                got += k
        return a


# --- writing ------------------------------------------------------------------------------------
class Tensor:
    """A tensor to write: name, dtype code, shape, and chunks(): a factory of its C-contiguous
    pieces in order (never a whole second copy of a large tensor). page_align: start it on a
    4096-byte file boundary if it is the first such tensor (see Layout)."""

    def __init__(self, name, code, shape, chunks, page_align=False):
        if code not in DTYPES:
            raise ValueError(f"{name}: dtype code {code!r} cannot be written (known: {', '.join(DTYPES)})")
        self.name, self.code, self.shape = name, code, tuple(int(s) for s in shape)
        self.chunks, self.page_align = chunks, page_align
        self.nbytes = math.prod(self.shape) * DTYPES[code].itemsize

    @classmethod
    def of(cls, name, a, code=None, shape=None, chunk_bytes=64 << 20):
        """An array's tensor: its own dtype's code unless `code` names another of the same width
        (float8 bytes held as uint8); `shape` reshapes (same size)."""
        a = np.ascontiguousarray(a)
        if code is None:
            if a.dtype.name not in CODES:
                raise ValueError(f"{name}: dtype {a.dtype} cannot be saved")
            code = CODES[a.dtype.name]
        flat = a.reshape(-1).view(np.uint8)
        return cls(name, code, a.shape if shape is None else shape,
                   lambda: (flat[i:i + chunk_bytes] for i in range(0, max(1, flat.size), chunk_bytes)))


class Layout:
    """The file of `tensors`: ordered by element size (largest first, stable), so with an
    8-aligned data section every tensor is aligned to its element size (engines read through
    raw pointers); the header's space padding puts the first page_align tensor on a 4096-byte
    file boundary whenever the tensors before it sum to a multiple of 8 bytes. The safetensors
    reader wants contiguous spans, so only one tensor can be page-aligned."""

    def __init__(self, tensors, metadata=None):
        self.order = sorted(tensors, key=lambda t: (-DTYPES[t.code].itemsize, not t.page_align))
        hdr, pos, aligned_at = {}, 0, None
        if metadata is not None:
            hdr["__metadata__"] = metadata
        for t in self.order:
            if t.name in hdr:
                raise ValueError(f"tensor {t.name!r} given twice")
            if t.page_align and aligned_at is None:
                aligned_at = pos
            hdr[t.name] = {"dtype": t.code, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(hdr, separators=(",", ":")).encode()
        n = -(-len(raw) // 8) * 8
        if aligned_at is not None and aligned_at % 8 == 0:
            n = -(-(8 + n + aligned_at) // PAGE) * PAGE - 8 - aligned_at
        self.header = struct.pack("<Q", n) + raw + b" " * (n - len(raw))
        self.data_bytes = pos
        self.nbytes = len(self.header) + pos

    def write_to(self, f, progress=None, done=0, total=None):
        """Write the file to the open binary file f; progress(done_bytes, total_bytes) after each
        chunk (done: bytes written before this file; total: of every file of the save).
        Returns done + this file's bytes."""
        total = self.nbytes if total is None else total
        f.write(self.header)
        done += len(self.header)
        for t in self.order:
            wrote = 0
            for c in t.chunks():
                c = np.ascontiguousarray(c)
                if c.nbytes:
                    f.write(c.reshape(-1).view(np.uint8).data)  # raw bytes (bf16 has no buffer code)
                wrote += c.nbytes
                done += c.nbytes
                if progress is not None:
                    progress(done, total)
            if wrote != t.nbytes:  # a bug, not a user error: never write a lying header
                raise RuntimeError(f"{t.name}: wrote {wrote} bytes, the header says {t.nbytes}")
        return done


def write_folder_files(folder, shards, blobs, progress=None):
    """A checkpoint folder's files, each new in `folder` (an atomic_folder's temp): the
    safetensors files of `shards` ((name, Layout) pairs), then `blobs` ((name, bytes): the index,
    config.json); progress(done, total) over all of them. Returns the bytes written."""
    total = sum(lay.nbytes for _, lay in shards) + sum(len(data) for _, data in blobs)
    done = 0
    for name, lay in shards:
        with open(os.path.join(folder, name), "xb") as f:
            done = lay.write_to(f, progress, done, total)
    for name, data in blobs:
        with open(os.path.join(folder, name), "xb") as f:
            f.write(data)
    if progress is not None:
        progress(total, total)
    return total


def write(path, tensors, metadata=None, progress=None, before_write=None):
    """Write one safetensors file at `path`, atomically (io.files.atomic_output: a temp file of
    its own, fsynced, renamed over; temps of dead writers swept). before_write(total_bytes), when
    given, runs once the size is known and before anything is created. Returns the size."""
    lay = Layout(tensors, metadata)
    if before_write is not None:
        before_write(lay.nbytes)
    with atomic_output(path) as f:
        lay.write_to(f, progress)
    return lay.nbytes
