# Type stubs of the compiled GGUF row decoders (engram_stream/rows/_gguf.pyx). Keep in step with
# the .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Tuple

import numpy as np
import numpy.typing as npt

E4M3_ROW: int

def block(qtype: int) -> Tuple[int, int]: ...
def row_bytes(qtype: int, row_length: int) -> int: ...
def decode_rows(qtype: int, raw: npt.NDArray[np.uint8], row_length: int) -> npt.NDArray[np.float32]: ...
def gather(qtype: int, table: npt.NDArray[np.uint8], ids: npt.NDArray[np.int64],
           row_length: int) -> npt.NDArray[np.float32]: ...
