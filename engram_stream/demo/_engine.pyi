# Type stubs of the compiled demo engine (engram_stream/demo/_engine.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any

import numpy as np

from engram_stream.engine._base import EngineBase

PREFILL_CHUNK: int  # tokens per GEMM of a call


class StreamEngine(EngineBase):
    """The demo variant's streaming engine of one layer: `model.stream(layer, n_streams)`."""

    def __init__(self, model: Any, layer: int, n_streams: int = 1, rows: Any = None) -> None: ...

def _isa_set(level: int) -> bool: ...
def _isa_get() -> int: ...
def _fma_chains(rounds: int) -> int: ...
def _bfdot(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray: ...
def _gemm(X: np.ndarray, wp: np.ndarray, bias: np.ndarray, M: int, wbf16: int) -> np.ndarray: ...
