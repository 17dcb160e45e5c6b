# Type stubs of the compiled file stamps (engram_stream/rows/_stamps.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from typing import Any, Iterable

MAX_FILES: int  # mapped files one engine checks before its reads


class FileStamps:
    """The mapped files under a layer's arrays, fstat'ed before every read of an engine."""

    def __init__(self, arrays: Iterable[Any], what: str) -> None: ...
    def __len__(self) -> int: ...
