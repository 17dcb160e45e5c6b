# cython: language_level=3
"""V4.1 row records -> bf16 rows exactly as the serving engines' Engram lookup kernels make them
(vLLM 0.33.0's _engram_lookup_kernel; SGLang 0.5.23's _engram_gather_kernel).

Both kernels widen each e4m3 value to float32 and multiply it by the float32 whose bits are the
e8m0 byte shifted into the exponent field (byte << 23), then round to bf16 (nearest, ties to
even). That differs from the checkpoint's value 2^(byte - 127) at two scale bytes: 255 gives
+inf (+-inf, NaN for a zero value; not NaN), and 0 gives vLLM a zero scale (+-0, not 2^-127),
while SGLang's kernel maps 0 to 2^-127 (zero_scale). The e4m3 codes 0x7f / 0xff are NaN
(float8_e4m3fn, as on the GPU; Triton's CPU interpreter reads them as +-480)."""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

from engram_stream._hash cimport es_runtime_bind, es_runtime_of_process

cnp.import_array()

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

cdef extern from "engram_fp8.h" nogil:
    float es8_e4m3(uint8_t b)


cdef inline uint16_t _bf16(float v) noexcept nogil:
    cdef uint32_t u
    memcpy(&u, &v, 4)
    if (u & 0x7fffffff) > 0x7f800000:  # NaN: stays a (quiet) NaN of the same sign
        return <uint16_t> ((u >> 16) | 0x40)
    return <uint16_t> ((u + 0x7fff + ((u >> 16) & 1)) >> 16)


cdef void bf16_lut(float *lut) noexcept nogil:
    """lut[b] = the e4m3 byte b widened to float32 (NaN codes as on the GPU)."""
    cdef int i
    for i in range(256):
        lut[i] = es8_e4m3(<uint8_t> i)


cdef inline void _record_bf16(const uint8_t *r, uint16_t *o, int64_t D, const float *lut,
                              float zero_scale) noexcept nogil:
    cdef int64_t b, i, nb = D // 32
    cdef uint32_t bits
    cdef float f
    for b in range(nb):
        bits = (<uint32_t> r[D + b]) << 23
        memcpy(&f, &bits, 4)
        if bits == 0:
            f = zero_scale
        for i in range(b * 32, b * 32 + 32):
            o[i] = _bf16(lut[r[i]] * f)


cdef void records_bf16(const uint8_t *records, uint16_t *out, int64_t n, int64_t D,
                       float zero_scale) noexcept nogil:
    """n contiguous records (D + D/32 bytes) -> n contiguous bf16 rows of D (the C path of
    records_to_bf16: the capturable lookup's host function converts with it)."""
    cdef float lut[256]
    cdef int64_t j
    bf16_lut(lut)
    for j in range(n):
        _record_bf16(records + j * (D + D // 32), out + j * D, D, lut, zero_scale)


def records_to_bf16(const uint8_t[:, :, :] records, uint16_t[:, :, :] out, float zero_scale=0.0):
    """out[t, h, :] (bf16 bits) = the kernels' dequantization of records[t, h] (head_dim e4m3
    bytes, then head_dim / 32 e8m0 bytes); the e8m0 byte 0 scales by zero_scale (vLLM: 0,
    SGLang: 2^-127). Either array may have any strides (out[::2], out[:, 1:4], a column slice
    of a wider array): every byte is addressed through its array's own strides, within the
    shapes checked here."""
    cdef int64_t T = records.shape[0], k = records.shape[1], D = out.shape[2], nb = D // 32
    if out.shape[0] != T or out.shape[1] != k or D % 32 or records.shape[2] != D + nb:
        raise ValueError(f"records_to_bf16: records {tuple(records.shape)[:3]} do not match out "
                         f"{tuple(out.shape)[:3]} (records of head_dim + head_dim/32 bytes)")
    if T == 0 or k == 0 or D == 0:
        return
    cdef float lut[256]
    cdef int64_t t, h, b, i
    cdef uint32_t bits
    cdef uint16_t v
    cdef float f
    # byte strides: out and records need not be contiguous in any axis (a view's strides may
    # even be odd multiples of a byte: such stores go through memcpy); a record and its bf16 row
    # each contiguous, and the row aligned, take the host function's own routine
    cdef Py_ssize_t rs0 = records.strides[0], rs1 = records.strides[1], rs2 = records.strides[2]
    cdef Py_ssize_t os0 = out.strides[0], os1 = out.strides[1], os2 = out.strides[2]
    cdef const char *rbase = <const char *> &records[0, 0, 0]
    cdef char *obase = <char *> &out[0, 0, 0]
    cdef const char *r
    cdef char *o
    with nogil:
        bf16_lut(lut)
        for t in range(T):
            for h in range(k):
                r = rbase + t * rs0 + h * rs1
                o = obase + t * os0 + h * os1
                if rs2 == 1 and os2 == 2 and not (<size_t> o) & 1:
                    _record_bf16(<const uint8_t *> r, <uint16_t *> o, D, lut, zero_scale)
                    continue
                for b in range(nb):
                    bits = (<uint32_t> (<const uint8_t *> (r + (D + b) * rs2))[0]) << 23
                    memcpy(&f, &bits, 4)
                    if bits == 0:
                        f = zero_scale
                    for i in range(b * 32, b * 32 + 32):
                        v = _bf16(lut[(<const uint8_t *> (r + i * rs2))[0]] * f)
                        memcpy(o + i * os2, &v, 2)
