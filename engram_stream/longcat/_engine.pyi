# Type stubs of the compiled LongCat engine (engram_stream/longcat/_engine.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from engram_stream.engine._base import EngineBase
from engram_stream.engine._window import HashWindow

BEFORE_START: int


class LongcatWindow(HashWindow):
    """LongCat's hash windows: raw ids, the look-back stopping at the start and at an EOS."""


class LongcatEngine(EngineBase):
    """The longcat-flash-lite streaming engine (an input layer): `model.stream(0, n_streams)`."""

    input_layer: bool
