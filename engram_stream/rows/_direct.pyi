# Type stubs of the compiled direct row reader (engram_stream/rows/_direct.pyx). Keep in step with
# the .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union
import os

import numpy as np
import numpy.typing as npt

PAGE: int
MAX_QD: int
MAX_PART_BYTES: int
WAIT_BUCKETS: int
TOTALS: int

class FilePart:
    path: str
    offset: int
    nbytes: int
    per_group: int
    group_bytes: int
    sums: Optional[int]   # offset in a group of its records' 8-byte checksums (None: none)
    seed: int
    def __init__(self, path: Union[str, os.PathLike], offset: int, nbytes: int, per_group: int = 1,
                 group_bytes: Optional[int] = None, sums: Optional[int] = None, seed: int = 0) -> None: ...
    def extent(self) -> int: ...
    def end(self, nrows: int) -> int: ...

# uint64[n]: the checksums the reader checks (XXH64 of each record, seeded seed + first + i)
def record_sums(records: npt.NDArray[np.uint8], seed: int, first: int) -> npt.NDArray[np.uint64]: ...
def checksum_error(path: str, layer: Any, row: int) -> Exception: ...

class MemPart:
    array: npt.NDArray[np.uint8]
    nbytes: int
    def __init__(self, array: npt.ArrayLike) -> None: ...

class IOPool:
    """Threads that keep up to qd reads of a batch in flight."""
    qd: int
    def __init__(self, qd: int = 16) -> None: ...
    @property
    def threads(self) -> int: ...

class RecordFile:
    """A table's row records in files (FilePart) or memory (MemPart)."""
    nparts: int
    nrows: int
    recbytes: int
    rowbytes: int
    scalebytes: int
    paths: Tuple[Optional[str], ...]
    direct: Tuple[bool, ...]
    layer: Any
    def __init__(self, nrows: int, parts: Iterable[Union[FilePart, MemPart]], rowbytes: Optional[int] = None,
                 direct: bool = True, layer: Any = None) -> None: ...
    def check(self) -> None: ...
    def _restamp(self, now: bool = True) -> None: ...
    def fileno(self, path: Union[str, os.PathLike]) -> int: ...
    def describe(self) -> List[Dict[str, Any]]: ...

class DirectReader:
    """One caller's batched reads of a RecordFile through an IOPool."""
    file: RecordFile
    io: IOPool
    reads: int
    bytes_read: int
    rows_read: int
    calls: int
    wait_seconds: float
    def __init__(self, file: RecordFile, io: IOPool, stride: Optional[int] = None,
                 totals: Optional[npt.NDArray[np.int64]] = None) -> None: ...
    def read(self, rows: npt.ArrayLike) -> npt.NDArray[np.uint8]: ...
    def stats(self) -> Dict[str, Any]: ...

def wait_percentile(hist: npt.ArrayLike, q: float) -> float: ...
def new_totals() -> npt.NDArray[np.int64]: ...
def add_read(totals: npt.NDArray[np.int64], reads: int, nbytes: int, rows: int, wait_seconds: float) -> None: ...
def totals_summary(totals: npt.ArrayLike) -> Dict[str, Any]: ...
