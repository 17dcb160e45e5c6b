# The C row conversion of _records.pyx (cimported by _vllm_graph.pyx's host function).
from libc.stdint cimport int64_t, uint8_t, uint16_t

# n contiguous V4.1 records (D e4m3 bytes, then D/32 e8m0 bytes) -> n contiguous bf16 rows of D,
# as vLLM's lookup kernel rounds them (zero_scale: what the e8m0 byte 0 scales by)
cdef void records_bf16(const uint8_t *records, uint16_t *out, int64_t n, int64_t D,
                       float zero_scale) noexcept nogil
cdef void bf16_lut(float *lut) noexcept nogil
