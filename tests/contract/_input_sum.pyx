# cython: language_level=3
# A test-only input-layer engine (tests/contract/test_input_layer.py builds it against the
# installed package's .pxd files and headers, as a third-party variant's engine is built): the
# output of a token is the plain sum of its H table rows, float32[D] (head_dim == hidden_size),
# no hidden. It has no state of its own: the base's hash window is all a stream keeps.
from libc.stdint cimport int64_t, uint16_t
from libc.string cimport memcpy

from engram_stream.engine._base cimport EngineBase

cdef extern from "engram_step.h" nogil:
    uint16_t es_float_to_bf16(float f) noexcept


cdef class InputSumEngine(EngineBase):
    """out[t] = sum over heads h of table[row_h(t)] (float32 rows of D values)."""

    input_layer = True

    def __cinit__(self, model, layer, int n_streams=1, rows=None):
        self._setup(model, layer, n_streams, 64, rows)

    cdef int _init_variant(self, w) except -1:
        if self.hd != self.D or self.src.rowbytes != self.D * 4 or self.src.scalebytes:
            raise ValueError(f"InputSumEngine sums float32 rows of hidden_size values: head_dim {self.hd}, "
                             f"hidden_size {self.D}, row records {self.src.rowbytes}+{self.src.scalebytes} bytes")
        return 0

    cdef void _chunk(self, int64_t t0, int64_t nb, const void *hid, void *out, int threads) noexcept nogil:
        cdef int64_t i, d
        cdef int j
        cdef const float *r
        cdef float acc
        if hid != NULL:   # the base hands an input layer no hidden
            return
        for i in range(nb):
            for d in range(self.D):
                acc = 0
                for j in range(self.H):
                    r = <const float *> self.dp[i * self.H + j]
                    acc += r[d]
                if self.obf:  # out= bfloat16: the float32 sum, rounded
                    (<uint16_t *> out)[i * self.D + d] = es_float_to_bf16(acc)
                else:
                    (<float *> out)[i * self.D + d] = acc

    cdef void _gather_rows(self, int64_t nb, float *dst, int64_t ld, int threads) noexcept nogil:
        cdef int64_t i
        cdef int j
        for i in range(nb):
            for j in range(self.H):
                memcpy(dst + i * ld + j * self.hd, self.dp[i * self.H + j], self.hd * sizeof(float))
