# cython: language_level=3
"""QwenStreamEngine: the qwen3.8-flash-next variant's streaming engine (DESIGN.md 4b).

Qwen's PLE layer is the demo module's computation (the weights carry Qwen's eps), so the engine
is the demo's StreamEngine with Qwen's history rule: SeparatorWindow, where the pad id (Qwen's
EOS) ends a document. Oracle: engram_stream.qwen.reference.
"""
from libc.stdint cimport int64_t

from engram_stream._hash cimport separator_window, es_runtime_bind, es_runtime_of_process

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)
from engram_stream.demo._engine cimport StreamEngine
from engram_stream.engine._window cimport HashWindow


cdef class SeparatorWindow(HashWindow):
    """Qwen's hash windows (HashPlan.history "separator"): entries are the raw ids, pad (EOS)
    before the start; a pad entry older than the token turns every entry older than itself
    into pad (separator_window). The token's own entry cuts nothing: an EOS keeps the history
    of the document it ends."""

    def __cinit__(self, *args, **kwargs):
        self.history = "separator"

    cdef void rule(self, const int64_t *full, int64_t *win) noexcept nogil:
        separator_window(full, self.n, self.pad, win)


cdef class QwenStreamEngine(StreamEngine):
    """The qwen3.8-flash-next streaming engine of one layer: `model.stream(layer, n_streams)`.
    Calls: see EngineBase; the step is StreamEngine's, the windows SeparatorWindow's."""

    _window_class = SeparatorWindow
