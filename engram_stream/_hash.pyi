# Type stubs of the compiled hash kernels (engram_stream/_hash.pyx); private: HashPlan is the API.
# tests/cli/test_packaging.py checks that every public function of the module is declared here.
from typing import Optional

import numpy as np
import numpy.typing as npt

_I64 = npt.NDArray[np.int64]

FP_PRIME_MAX: int
# the shared constants (include/engram_consts.h, their one source)
MAX_NGRAM: int
MAX_KERNEL_SIZE: int
EPS_KEY: float
EPS_CONV: float
GATE_CLAMP: float
PREFILL_CHUNK: int
# history rules of a hash window (HashPlan.history): hash_compressed's latch
HIST_PLAIN: int
HIST_DEAD: int
HIST_SEP: int

def compress(ids: _I64, lookup: Optional[_I64], vocab_size: int, dead_id: Optional[int] = None) -> _I64: ...
def fp_moduli(primes: npt.ArrayLike) -> Optional[npt.NDArray[np.float64]]: ...
def hash_compressed(cids: _I64, mult: _I64, primes: _I64, max_ngram: int, n_head: int, pad: int,
                    out: Optional[_I64] = None, fp: Optional[npt.NDArray[np.float64]] = None,
                    latch: int = 0) -> _I64: ...
def floormod(x: _I64, primes: _I64, reciprocal: bool = False) -> _I64: ...
def _isa_set(level: int) -> bool: ...
def _isa_get() -> int: ...
def _isa_cpu_best() -> int: ...
def _isa_runs(level: int) -> bool: ...
def _isa_best_of(feats: int) -> int: ...
