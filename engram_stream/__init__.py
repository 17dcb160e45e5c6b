"""engram_stream: a streaming inference engine for Engram (DeepSeek's conditional n-gram memory).

Where things are (DESIGN.md at the repository root explains why):
  config.py        EngramConfig                     plan.py       HashPlan (geometry + hash oracle)
  reference.py     the numpy batch forward (oracle) model.py      EngramModel (weights, paths)
  _hash.pyx        nogil batch hashing; the shared constants for Python
  _engine.pyx      StreamEngine: state as typed memoryviews, the ring rules, step/prefill
  _consts.pxd      the shared constants for Cython  engine_args.py  the engines' argument checks
  _isa.py          kernel_isa(): which kernel path runs
  decoder.py       Decoder (every layer per token)  checkpoint.py, store.py  files, mmap, prefetch
  compression.py   build_compression                cli.py        the engram-stream command
  v41.py, reference_v41.py, hf_v41.py, _engine_v41.pyx   the DeepSeek-V4.1 variant
  include/ (get_include())   the C kernels: engram_consts.h (shared constants), engram_hash.h
                   (integers), engram_step.h (floats), engram_isa.h (dispatch), engram_fp8.h (V4.1)
"""
import os as _os

from .compression import build_compression
from .config import EngramConfig
from .model import EngramModel
from .plan import HashPlan
from ._engine import EngineSnapshot, StreamEngine
from ._isa import kernel_isa

__all__ = ["EngramConfig", "HashPlan", "EngramModel", "StreamEngine", "EngineSnapshot",
           "build_compression", "get_include", "kernel_isa"]
__version__ = "0.1.0"


def get_include() -> str:
    """Folder of the C headers the extensions share (engram_hash.h, engram_step.h).

    Installed, the wheel carries them in engram_stream/include; in a development
    checkout (in-place build) they are the repository's top-level include/."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    installed = _os.path.join(here, "include")
    return installed if _os.path.isdir(installed) else _os.path.join(_os.path.dirname(here), "include")
