# cython: language_level=3
"""QwenStreamEngine: the qwen3.8-flash-next variant's streaming engine (DESIGN.md 4b).

Qwen's PLE layer is the demo module's computation (the weights carry Qwen's eps), so the engine
is the demo's StreamEngine with Qwen's history rule: SeparatorWindow, where the pad id (Qwen's
EOS) ends a document. Oracle: engram_stream.qwen.reference.
"""
from libc.stdint cimport int64_t

from engram_stream._hash cimport es_runtime_bind, es_runtime_of_process

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)
from engram_stream.demo._engine cimport StreamEngine
from engram_stream.engine._window cimport HashWindow


cdef class SeparatorWindow(HashWindow):
    """Qwen's hash windows (HashPlan.history "separator", DESIGN.md 4b): entries are the raw ids,
    pad (EOS) before the start; a pad entry older than the token ends the document before it:
    every entry older than the pad reads pad (rule). The token's own entry cuts nothing: an EOS
    keeps the history of the document it ends. The hash is the default."""

    def __cinit__(self, *args, **kwargs):
        self.history = "separator"

    cdef void rule(self, const int64_t *full, int64_t *win) noexcept nogil:
        cdef bint blocked = False
        cdef int k
        win[0] = full[0]
        for k in range(1, self.n):
            win[k] = self.pad if blocked else full[k]
            blocked = blocked or full[k] == self.pad


cdef class QwenStreamEngine(StreamEngine):
    """The qwen3.8-flash-next streaming engine of one layer: `model.stream(layer, n_streams)`.
    Calls: see EngineBase; the step is StreamEngine's, the windows SeparatorWindow's."""

    _window_class = SeparatorWindow
