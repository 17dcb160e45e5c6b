# Type stubs of the compiled engine base (engram_stream/engine/_base.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

from engram_stream.engine.snapshot import EngineSnapshot

_Ids = Union[int, np.integer, Sequence[int], npt.NDArray[np.integer]]
_Out = Any  # float32 or bfloat16 (an ml_dtypes array, or a torch tensor): numpy has no bfloat16 type
_Hidden = Optional[npt.ArrayLike]  # None (or left out) for an input layer, which takes no hidden

MAX_THREADS: int  # ES_MAX_THREADS: the most threads a call splits over
SUBMIT_ROWS: int  # rows one submit() hands a row source (a long call goes in windows of whole chunks)

class EngineBase:
    """The orchestrator every variant's streaming engine shares (a subclass per variant)."""

    model: Any  # the EngramModel (read-only)
    layer: int
    n_streams: int
    prefill_threads: int  # threads of a batch with prompt chunks (default: the cores, at most 8)
    step_threads: int     # threads of a batch of decode steps (default 1); both clamped to [1, 16]
    input_layer: bool     # the class's shape: True, a token in and [.., D] out, no hidden
    def out_shape(self, n: Optional[int] = None) -> tuple[int, ...]: ...  # [n, G, D] ([n, D]); n None: one token
    def hidden_shape(self, n: Optional[int] = None) -> Optional[tuple[int, ...]]: ...  # None: an input layer
    def step(self, token_ids: _Ids, hidden: _Hidden = None, out: Optional[_Out] = None) -> _Out: ...
    def step_packed(self, token_ids: _Ids, hidden: _Hidden, streams: _Ids, lengths: _Ids,
                    out: Optional[_Out] = None, draft: bool = False,
                    masked: Optional[npt.NDArray[np.bool_]] = None) -> _Out: ...
    def commit(self, accepted: _Ids) -> None: ...
    def lookup_packed(self, token_ids: _Ids, streams: _Ids, lengths: _Ids, out: Optional[_Out] = None,
                      dtype: Optional[str] = None, draft: bool = False,
                      masked: Optional[npt.NDArray[np.bool_]] = None) -> np.ndarray: ...
    def feed(self, token_ids: _Ids) -> None: ...
    def feed_packed(self, token_ids: _Ids, streams: _Ids, lengths: _Ids, draft: bool = False,
                    masked: Optional[npt.NDArray[np.bool_]] = None) -> None: ...
    def compute(self, hidden: _Hidden = None, out: Optional[_Out] = None) -> _Out: ...
    def fetch(self) -> None: ...  # after feed: the rows read (a row cache keeps them), nothing computed
    def prefill(self, ids: _Ids, hidden: _Hidden = None, stream: int = 0, out: Optional[_Out] = None) -> _Out: ...
    def reset(self, stream: Optional[int] = None) -> None: ...
    @property
    def rows(self) -> npt.NDArray[np.int64]: ...          # [S, H]; -1 for a stream with no token yet
    @property
    def pending_rows(self) -> npt.NDArray[np.int64]: ...  # [N, H] of a fed batch
    @property
    def row_source(self) -> Any: ...                       # rows._source.RowSource
    def prefetch(self) -> int: ...
    def track_rows(self, bitmap: Optional[npt.NDArray[np.uint8]]) -> None: ...
    @property
    def isa(self) -> str: ...  # the one-stream step's kernel path (kernel_choice()["step"][0])
    def kernel_choice(self) -> dict[str, tuple[str, int, str]]: ...  # {op: (path, threads, why)}
    @property
    def pending_compute(self) -> bool: ...
    @property
    def tokens_seen(self) -> npt.NDArray[np.int64]: ...
    @property
    def state_nbytes(self) -> int: ...
    def snapshot(self) -> EngineSnapshot: ...
    def restore(self, snapshot: EngineSnapshot) -> None: ...

