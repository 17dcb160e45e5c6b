# Type stubs of the compiled Qwen engine (engram_stream/qwen/_engine.pyx). Keep in step with the
# .pyx: tests/cli/test_packaging.py checks that every public name is declared here.
from engram_stream.demo._engine import StreamEngine
from engram_stream.engine._window import HashWindow


class SeparatorWindow(HashWindow):
    """Qwen's hash windows: the pad id (EOS) ends a document."""


class QwenStreamEngine(StreamEngine):
    """The qwen3.8-flash-next streaming engine of one layer: `model.stream(layer, n_streams)`."""
