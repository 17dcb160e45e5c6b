# Type stubs of the compiled deepseek-v4.1 engine (engram_stream/v41/_engine.pyx). Keep in step
# with the .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from engram_stream.engine._base import EngineBase
from engram_stream.engine._window import HashWindow

_Ids = Union[int, np.integer, Sequence[int], npt.NDArray[np.integer]]
_F32 = npt.NDArray[np.float32]
_U8 = npt.NDArray[np.uint8]

PREFILL_CHUNK: int  # prompt tokens per projection in prefill()

def decode_e4m3(raw: _U8) -> _F32: ...
def decode_e8m0(raw: _U8) -> _F32: ...
def gather_rows(weight: _U8, scale: _U8, rows: npt.NDArray[np.int64]) -> _F32: ...
def act_quant(x: _F32) -> Tuple[_F32, _F32]: ...
def fp8_linear(x: _F32, weight: _U8, scale: _U8, threads: int = 1, plain: bool = False) -> _F32: ...
def dpbf16(acc: Any, a: Any, b: Any, emulate: bool = False) -> _F32: ...
def _mac_chains(rounds: int) -> int: ...
def read_bytes(a: _U8) -> int: ...


class DeadWindow(HashWindow):
    """V4.1's hash windows: the DEAD rule (the image token id and negative ids are DEAD)."""


class V41StreamEngine(EngineBase):
    """The deepseek-v4.1 streaming engine of one layer: `model.stream(layer, n_streams)`."""

    def __init__(self, model: Any, layer: int, n_streams: int = 1, rows: Any = None) -> None: ...

def _isa_set(level: int) -> bool: ...
def _isa_get() -> int: ...
