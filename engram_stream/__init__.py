"""engram_stream: a streaming inference engine for Engram (DeepSeek's conditional n-gram memory).

The map of the package (which file holds what) and why it is laid out so: DESIGN.md at the
repository root (section 12, Layout).
"""
import os as _os

from .compression import build_compression
from .config import EngramConfig
from .demo import variant as _demo  # noqa: F401  the built-in variants register themselves (engram_stream.variants)
from .v41 import variant as _v41  # noqa: F401
from .qwen import variant as _qwen  # noqa: F401
from .model import EngramModel
from .plan import HashPlan
from .demo._engine import StreamEngine
from .engine.snapshot import EngineSnapshot
from .engine.isa import kernel_isa

__all__ = ["EngramConfig", "HashPlan", "EngramModel", "StreamEngine", "EngineSnapshot",
           "build_compression", "get_include", "kernel_isa"]
__version__ = "0.1.0"


def get_include() -> str:
    """Folder of the C headers the extensions share (engram_hash.h, engram_step.h, ...).

    Installed, the wheel carries them in engram_stream/include; in a development
    checkout (in-place build) they are the repository's top-level include/."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    installed = _os.path.join(here, "include")
    return installed if _os.path.isdir(installed) else _os.path.join(_os.path.dirname(here), "include")
