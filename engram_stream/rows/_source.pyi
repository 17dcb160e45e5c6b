# Type stubs of the compiled row sources (engram_stream/rows/_source.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Callable, Optional

import numpy as np
import numpy.typing as npt

from engram_stream.rows._cache import RowCache

class RowSource:
    """Where an engine's rows come from (the seam: submit, resolve, release, prefetch in C)."""

    nrows: int
    rowbytes: int    # bytes of a row's data
    scalebytes: int  # bytes of its scale (0: none)
    fallible: bool   # reads can fail (remote, disk)
    def read(self, rows: npt.ArrayLike) -> npt.NDArray[np.uint8]: ...  # [n, rowbytes + scalebytes]

class MappedRows(RowSource):
    """A table in memory or mapped from its file: pointers straight into it."""

    def __init__(self, data: np.ndarray, scale: Optional[np.ndarray] = None) -> None: ...

class CachedRows(RowSource):
    """The RAM row cache in front of a MappedRows or of a remote reader."""

    def __init__(self, cache: RowCache, local: Optional[MappedRows] = None,
                 fetch: Optional[Callable[[np.ndarray], np.ndarray]] = None, rowbytes: Optional[int] = None,
                 scalebytes: int = 0, nrows: Optional[int] = None) -> None: ...
