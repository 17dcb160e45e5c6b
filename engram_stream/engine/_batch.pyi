# Type stubs of the compiled batch (engram_stream/engine/_batch.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Optional, Tuple

import numpy as np
import numpy.typing as npt


class Batch:
    """The segments and per-token buffers of an engine's calls."""

    def segments(self, streams: Any, lengths: Any, N: int) -> Tuple[np.ndarray, np.ndarray]: ...
    @staticmethod
    def masked(ids: np.ndarray, st: np.ndarray, ln: np.ndarray,
               masked: Optional[npt.NDArray[np.bool_]]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, Any]: ...
    def accepted(self, accepted: Any) -> np.ndarray: ...
