# Type stubs of the compiled row sources (engram_stream/rows/_source.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Optional, Sequence

import numpy as np
import numpy.typing as npt

from engram_stream.rows._cache import RowCache
from engram_stream.rows._direct import DirectReader

READ_WINDOW: int  # rows read_into hands one submit()

class RowSource:
    """Where an engine's rows come from (the seam: submit, resolve, release, prefetch in C)."""

    nrows: int
    rowbytes: int    # bytes of a row's data
    scalebytes: int  # bytes of its scale (0: none)
    record_format: Optional[str]  # what a record's bytes are (rows.records.record_format); None: unknown
    fallible: bool   # reads can fail (remote, disk)
    bound: bool      # an engine reads through it (one engine a source, but a MappedRows)
    nogil_reads: bool  # its C reader (read_nogil) reads without the GIL: a CUDA graph's host node may call it
    @property
    def reading(self) -> bool: ...  # reads submitted and not yet waited for
    def read(self, rows: npt.ArrayLike) -> npt.NDArray[np.uint8]: ...  # [n, rowbytes + scalebytes]
    # rows int [n] or [T, k] (negative: a zero record) -> out uint8 rows.shape + (record bytes,)
    def read_into(self, rows: npt.ArrayLike, out: npt.NDArray[np.uint8]) -> None: ...
    # the exception of a read_nogil() failure (ES_READ_* code, row, errno)
    def read_error(self, code: int, row: int, err: int, more: str = "") -> Exception: ...
    # the arrays engines point into (views of mapped files among them are stamped by the engine)
    def mapped_arrays(self) -> tuple: ...

class MappedRows(RowSource):
    """A table in memory or mapped from its file: pointers straight into it."""

    paged: bool  # a view of a mapped file: prefetch() asks the kernel for the rows' pages
    def __init__(self, data: np.ndarray, scale: Optional[np.ndarray] = None,
                 record_format: Optional[str] = None) -> None: ...
    def mapped_arrays(self) -> tuple: ...

class PartedRows(RowSource):
    """A table kept as consecutive parts (a GGUF's per-head tensors): pointers into each part;
    rows past the parts, up to nrows, read as zero bytes."""

    paged: bool  # views of a mapped file: prefetch() asks the kernel for the rows' pages
    def __init__(self, parts: Sequence[np.ndarray], record_format: Optional[str] = None,
                 nrows: Optional[int] = None) -> None: ...
    def mapped_arrays(self) -> tuple: ...

class CachedRows(RowSource):
    """A layer's shared RAM row cache in front of any other RowSource (its misses are that
    source's own submit/resolve)."""

    source: RowSource
    def __init__(self, cache: RowCache, source: RowSource) -> None: ...
    @property
    def reading(self) -> bool: ...
    def mapped_arrays(self) -> tuple: ...
    def read_error(self, code: int, row: int, err: int, more: str = "") -> Exception: ...

class DirectRows(RowSource):
    """Rows read from files (a DirectReader) with no cache."""

    def __init__(self, reader: DirectReader, record_format: Optional[str] = None) -> None: ...
    @property
    def reading(self) -> bool: ...
    def read_error(self, code: int, row: int, err: int, more: str = "") -> Exception: ...

class RecordSource(RowSource):
    """Records fetched in one batch a call by Python code: subclass with start(rows) and finish()."""

    def __init__(self, nrows: int, rowbytes: int, scalebytes: int = 0,
                 record_format: Optional[str] = None) -> None: ...
    @property
    def reading(self) -> bool: ...
    def start(self, rows: npt.NDArray[np.int64]) -> None: ...  # sorted, distinct, in range
    def finish(self) -> npt.NDArray[np.uint8]: ...  # [>= n, >= record bytes], record k of rows[k]
