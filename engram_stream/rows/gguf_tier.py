"""tables=GGUFTier(path): a model's Engram tables read from a llama.cpp GGUF, the rest of its
weights from its Hugging Face folder.

    model = EngramModel.load(folder, tables=GGUFTier("model-Q4_K.gguf"), row_cache_mb=512)
    model = EngramModel.from_deepseek_v41(folder, tables=GGUFTier("v41-Q8_0-00001-of-00005.gguf", read="direct"))
    model = EngramModel.load(folder, tables={"gguf": {"path": "model-Q4_K.gguf"}})

With a GGUF table the model is the quantized model: every engine's gather decodes the rows the
file holds (include/engram_gguf.h, bit-exact against gguf.quants.dequantize), so the engines
are the oracle run on the dequantized table. A row travels and is cached as the GGUF row's own
bytes (record format "gguf:TYPE", rows.gguf.record_format_of): a Q4_K row of 256 values is 144
bytes, so a row cache holds more rows a MB than of the checkpoint's 264-byte records.

read="mapped": the file (each shard) is mapped read-only and engines point into it (MADV_RANDOM,
rows paged in by prefetch; a table split into tensors, qwen4exp's per-head or LongCat's per
embedder, is read through _source.PartedRows, its padding rows as zeros); read="direct": rows are read with pread, O_DIRECT where the file
system allows it (rows/_direct.pyx reads the whole pages around a row: tensor offsets are
aligned to general.alignment only, often 32 bytes).

At open, the file is checked against the folder's config (rows.gguf.check_config: its
architecture, each table's type, shape and row count, every hash constant it carries; a
mismatch names both values); the constants it lacks are the folder's (`missing`).
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import CheckpointError
from ..io.files import MappedFile, check_file, open_regular
from ..io.memory import advise
from ._direct import DirectReader, FilePart, IOPool, RecordFile
from ._source import DirectRows, MappedRows, PartedRows
from .gguf import check_config, open_gguf, record_format_of
from .tier import Tables, Tier, register_tier

READS = ("mapped", "direct")


class GGUFTier(Tier):
    """A model's Engram tables from the GGUF at `path` (any shard of a split one names them all).
    read: "mapped" (engines read the mapped file) or "direct" (pread, o_direct where the file
    system allows it, qd reads in flight)."""

    def __init__(self, path, read="mapped", qd=32, o_direct=True):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"GGUFTier(path): the path of a .gguf file, got {type(path).__name__}")
        if read not in READS:
            raise ValueError(f"GGUFTier read= must be one of {READS}, got {read!r}")
        if not isinstance(qd, int) or isinstance(qd, bool) or not 1 <= qd <= 256:
            raise ValueError(f"qd (reads in flight) must be an int in [1, 256], got {qd!r}")
        self.path, self.read, self.qd, self.o_direct = os.fspath(path), read, qd, bool(o_direct)

    def __repr__(self):
        return f"GGUFTier({self.path!r}, read={self.read!r}, qd={self.qd}, o_direct={self.o_direct})"

    def open(self, model) -> "GGUFTables":
        return GGUFTables(self, model)


class GGUFTables(Tables):
    """A GGUFTier opened for one model: the file checked against the model's config, each layer's
    table located (tensors), its record format, and the mapped files or the direct readers' files."""

    def __init__(self, tier: GGUFTier, model):
        super().__init__(tier)
        self.path, self.read, self.qd, self.o_direct = tier.path, tier.read, tier.qd, tier.o_direct
        self.gguf = open_gguf(self.path)
        layers, self.missing = check_config(self.gguf, model.cfg, model.plan)
        self.tensors = layers   # {layer: [GGUFTensor]}: one, or a split table's parts in row order
        self.nrows = {L: model.plan.table_rows[L] for L in layers}   # a split table's padding rows read as zeros
        for L, ts in layers.items():
            if len({(t.ggml_type, t.row_bytes) for t in ts}) != 1:
                raise CheckpointError(f"{self.path}: layer {L}'s table is split into tensors of different types "
                                      f"({', '.join(f'{t.name} {t.served_as}' for t in ts)}): requantize them to one")
            if len(ts) > 1 and self.read == "direct":
                raise CheckpointError(f"{self.path}: layer {L}'s table is split into {len(ts)} tensors ({ts[0].name}, "
                                      f"...); read=\"direct\" reads one tensor a table: give read=\"mapped\", or "
                                      f"the merged layout")
        self.formats = {L: record_format_of(ts[0]) for L, ts in layers.items()}
        self.maps, self.tables, self.files, self.io = {}, {}, {}, None
        if self.read == "mapped":
            for L in layers:
                self.tables[L] = self.arrays(L)
        else:
            self.io = IOPool(self.qd)
            self.files = {L: RecordFile(ts[0].rows, [FilePart(ts[0].path, ts[0].offset, ts[0].row_bytes)],
                                        rowbytes=ts[0].row_bytes, direct=self.o_direct, layer=L)
                          for L, ts in layers.items()}

    def arrays(self, layer):
        """The layer's table tensors mapped, uint8 [rows, row bytes] each (a split table's parts in row
        order): what engines read (read="mapped"), and what a Mooncake publish digests (any read)."""
        if layer in self.tables:
            return self.tables[layer]
        parts = []
        for t in self.tensors[layer]:
            if t.path not in self.maps:
                self.maps[t.path] = _map(t.path)
            part = np.frombuffer(self.maps[t.path], np.uint8, t.nbytes, t.offset).reshape(t.rows, t.row_bytes)
            if part.nbytes:
                advise(part, "random")  # a cold gather must not read ahead
            parts.append(part)
        return parts

    def table_f32(self, layer, rows) -> np.ndarray:
        """float32 [*rows.shape, row length]: the layer's rows (absolute ids, any shape) decoded by
        the engines' C decoders (bit-exact against gguf.quants.dequantize): the table the numpy
        oracle (EngramModel.forward) reads, so that the oracle is the quantized model. Reads the
        rows through this tier's own reader, one call's rows at a time."""
        from . import _gguf
        if self.read == "mapped":   # a file changed since it was opened is refused (direct reads check their own)
            for a in self.tables[layer]:
                check_file(a)
        t = self.tensors[layer][0]
        ids = np.asarray(rows, np.int64)
        rec = np.empty((ids.size, t.row_bytes), np.uint8)
        self.source(layer).read_into(ids.reshape(-1), rec)
        return _gguf.decode_rows(t.decoder_type(), rec, t.row_length).reshape(*ids.shape, t.row_length)

    def record_layout(self, layer):
        """(row bytes, scale bytes) of one of this layer's records: the GGUF row's bytes, no scale."""
        return self.tensors[layer][0].row_bytes, 0

    def source(self, layer, read_totals=None):
        """One engine's reader of the layer's GGUF rows (direct reads add to read_totals)."""
        if self.read == "mapped":
            parts = self.tables[layer]
            return (MappedRows(parts[0], None, self.formats[layer]) if len(parts) == 1 else
                    PartedRows(parts, self.formats[layer], self.nrows[layer]))
        return DirectRows(DirectReader(self.files[layer], self.io, totals=read_totals), self.formats[layer])

    def describe(self) -> dict:
        return {L: ", ".join(f"{t.name} {t.served_as} [{t.rows}, {t.row_length}] at byte {t.offset} of {t.path}"
                             for t in ts) + f" ({self.read})" for L, ts in self.tensors.items()}


def _map(path) -> MappedFile:
    with open_regular(path, lambda why: CheckpointError(f"{path}: {why}")) as f:
        return MappedFile(f.fileno(), os.fstat(f.fileno()), path)


register_tier("gguf", GGUFTier)
