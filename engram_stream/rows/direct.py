"""tables="direct": a model's rows read with pread from its checkpoint's own files.

    model = EngramModel.from_deepseek_v41(folder, tables="direct", row_cache_mb=4096)
    model = EngramModel.from_deepseek_v41(folder, tables=DirectTier(qd=64, scales_in_ram=True))
    model = EngramModel.load("engram.safetensors", tables="direct", row_cache_mb=64)

Where a layer's records come from (record_file):
  the packed row file beside the checkpoint (`engram-stream pack-rows`: FOLDER/engram_rows.bin,
      FILE.rows), when it is there and is this checkpoint's (rows.packed.open_rows): one read of
      one page per missed row;
  else the checkpoint's own tensors: the table's rows and, apart, their scales (V4.1's
      embed.weight and embed.scale: two reads per missed row), at the offsets where the loader
      mapped them; scales_in_ram=True copies the scales into RAM first (V4.1-Flash: ~6 GB), so a
      miss is one read again.

The reads themselves (page planning, O_DIRECT, the I/O pool) are rows/_direct.pyx; one IOPool
serves every layer and engine of a model.
"""
from __future__ import annotations

import os

import numpy as np

from ..io.files import MappedFile, mapping_of
from . import packed
from ._direct import DirectReader, FilePart, IOPool, MemPart, RecordFile
from ._source import DirectRows
from .records import record_arrays, record_format
from .tier import Tables, Tier, register_tier


class DirectTier(Tier):
    """How a model reads its rows from disk (tables=DirectTier(...); tables="direct" is DirectTier()).

    qd: reads in flight per batch (qd - 1 I/O threads and the caller); scales_in_ram: hold the
    rows' scales in RAM when no packed row file is used (one read per miss instead of two);
    rows_file: "auto" (use the packed row file when it is there and matches), False (never), or
    a path; o_direct: bypass the page cache where the file system allows it."""

    def __init__(self, qd=32, scales_in_ram=False, rows_file="auto", o_direct=True):
        if not isinstance(qd, int) or isinstance(qd, bool) or not 1 <= qd <= 256:
            raise ValueError(f"qd (reads in flight) must be an int in [1, 256], got {qd!r}")
        if not (rows_file in ("auto", False, None) or isinstance(rows_file, (str, os.PathLike))):
            raise ValueError(f"rows_file must be 'auto', False or a path, got {rows_file!r}")
        self.qd, self.scales_in_ram, self.rows_file, self.o_direct = qd, bool(scales_in_ram), rows_file, bool(o_direct)

    def __repr__(self):
        return (f"DirectTier(qd={self.qd}, scales_in_ram={self.scales_in_ram}, rows_file={self.rows_file!r}, "
                f"o_direct={self.o_direct})")

    def open(self, model) -> "DirectTables":
        return DirectTables(self, model)


def _extent(a, model=None, layer=None):
    """(path, byte offset) of array `a` in the file it is a mapped view of (else ValueError naming
    why the layer's table is in RAM and the fix: the packed row file, or mmap=True)."""
    mm = mapping_of(a)
    if not isinstance(mm, MappedFile):
        why = getattr(model.layer(layer), "table_in_ram", None) if model is not None else None
        src = getattr(model, "source", None) if model is not None else None
        if why is not None:
            raise ValueError(f"tables='direct' reads rows from the checkpoint's files, but layer {layer}'s table is "
                             f"not a view of one file: {why}. Write the packed row file once, "
                             f"`engram-stream pack-rows {src or 'FOLDER'}` (direct reads then come from it), or "
                             f"rewrite the folder with each table's parts back to back in one file: "
                             f"EngramModel.load(FOLDER).save(NEW_FOLDER)")
        raise ValueError("tables='direct' reads the checkpoint's files: load it with mmap=True "
                         "(its tables must be views of the mapped file), or give it a packed row file "
                         "(`engram-stream pack-rows`)")
    base = np.frombuffer(mm, np.uint8, 1).ctypes.data
    return mm.path, a.ctypes.data - base


def record_file(model, layer, tier, rows_path=None, rows_at=None) -> RecordFile:
    """The RecordFile of one layer's records (see the module doc). rows_path, rows_at: a packed
    row file already opened (open_rows) and its {layer: (offset, per_group, group_bytes, sums,
    seed)}, or None."""
    w = model.layer(layer)
    rows, scales = record_arrays(w)
    n, rb = rows.shape[0], rows.shape[1]
    sb = 0 if scales is None else scales.shape[1]
    if rows_at is not None:
        off, per, gb, sums, seed = rows_at[layer]
        return RecordFile(n, [FilePart(rows_path, off, rb + sb, per, gb, sums=sums, seed=seed)], rowbytes=rb,
                          direct=tier.o_direct, layer=layer)
    path, off = _extent(w.table, model, layer)
    parts = [FilePart(path, off, rb)]
    if scales is not None:
        if tier.scales_in_ram:
            parts.append(MemPart(np.array(scales)))  # a copy: RAM, not the mapping
        else:
            spath, soff = _extent(w.table_scale)
            parts.append(FilePart(spath, soff, sb))
    return RecordFile(n, parts, rowbytes=rb, direct=tier.o_direct, layer=layer)


class DirectTables(Tables):
    """A DirectTier opened for one model: one RecordFile per layer and one IOPool (every engine's
    reader shares them). rows_path: the packed row file read, or None (the checkpoint's files)."""

    def __init__(self, tier: DirectTier, model):
        super().__init__(tier)
        self.rows_path, rows_at = None, None
        if tier.rows_file not in (False, None):
            if tier.rows_file == "auto":
                src = getattr(model, "source", None)
                cand = packed.rows_path(src) if src is not None else None
                path = cand if cand is not None and os.path.exists(cand) else None
            else:
                path = os.fspath(tier.rows_file)
            if path is not None:
                rows_at = packed.open_rows(model, path)  # refuses a file that is not this checkpoint's
                self.rows_path = path
        self.files = {L: record_file(model, L, tier, self.rows_path, rows_at) for L in model.cfg.layer_ids}
        self.formats = {L: record_format(model.layer(L)) for L in model.cfg.layer_ids}
        self.io = IOPool(tier.qd)

    def source(self, layer, read_totals=None) -> DirectRows:
        """One engine's reader of the layer's records (its reads add to read_totals)."""
        return DirectRows(DirectReader(self.files[layer], self.io, totals=read_totals), self.formats[layer])

    def describe(self) -> dict:
        return {L: f.describe() for L, f in self.files.items()}


register_tier("direct", DirectTier)
