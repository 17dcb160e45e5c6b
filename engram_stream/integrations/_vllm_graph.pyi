# Type stubs of engram_stream/integrations/_vllm_graph.pyx (keep in step with it).
import numpy as np
import numpy.typing as npt

from engram_stream.rows import RowSource

HF_OK: int
HF_BAD_ROW: int
HF_IO: int
HF_FILE_CHANGED: int
HF_BAD_SUM: int

# the host function hf_run's address (a CUhostFn: void (*)(void *))
def host_fn_address() -> int: ...
# (True, "") when a host function can read the source without the GIL, else (False, why)
def graph_capable(source: RowSource) -> tuple[bool, str]: ...

class HostLookup:
    # ids int32/int64 [T, k] -> staging uint8 [T, k, rec] records or uint16 [T, k, head_dim] bf16 bits
    def __init__(self, source: RowSource, ids: npt.NDArray[np.integer], staging: npt.NDArray[np.uint8] | npt.NDArray[np.uint16],
                 lo: int, hi: int, zero_scale: float = 0.0) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def calls(self) -> int: ...
    @property
    def errors(self) -> int: ...
    def run(self) -> None: ...
    def error(self) -> tuple[int, int, int] | None: ...
    def check(self) -> None: ...
