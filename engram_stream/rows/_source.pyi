# Type stubs of the compiled row sources (engram_stream/rows/_source.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Optional

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
    fallible: bool   # reads can fail (remote, disk)
    @property
    def reading(self) -> bool: ...  # reads submitted and not yet waited for
    def read(self, rows: npt.ArrayLike) -> npt.NDArray[np.uint8]: ...  # [n, rowbytes + scalebytes]
    # rows int [n] or [T, k] (negative: a zero record) -> out uint8 rows.shape + (record bytes,)
    def read_into(self, rows: npt.ArrayLike, out: npt.NDArray[np.uint8]) -> None: ...

class MappedRows(RowSource):
    """A table in memory or mapped from its file: pointers straight into it."""

    def __init__(self, data: np.ndarray, scale: Optional[np.ndarray] = None) -> None: ...

class CachedRows(RowSource):
    """A layer's shared RAM row cache in front of a MappedRows, a DirectReader or a remote reader
    (start(uniq) / finish() -> staging records)."""

    def __init__(self, cache: RowCache, local: Optional[MappedRows] = None, reader: Optional[DirectReader] = None,
                 remote: Any = None, rowbytes: Optional[int] = None, scalebytes: int = 0,
                 nrows: Optional[int] = None) -> None: ...
    @property
    def reading(self) -> bool: ...

class DirectRows(RowSource):
    """Rows read from files (a DirectReader) with no cache."""

    def __init__(self, reader: DirectReader) -> None: ...
    @property
    def reading(self) -> bool: ...
