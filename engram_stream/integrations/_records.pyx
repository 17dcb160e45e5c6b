# cython: language_level=3
"""V4.1 row records -> bf16 rows exactly as the serving engines' Engram lookup kernels make them
(vLLM 0.33.0's _engram_lookup_kernel; SGLang 0.5.23's _engram_gather_kernel).

Both kernels widen each e4m3 value to float32 and multiply it by the float32 whose bits are the
e8m0 byte shifted into the exponent field (byte << 23), then round to bf16 (nearest, ties to
even). That differs from the checkpoint's value 2^(byte - 127) at two scale bytes: 255 gives
+inf (+-inf, NaN for a zero value; not NaN), and 0 gives vLLM a zero scale (+-0, not 2^-127),
while SGLang's kernel maps 0 to 2^-127 (zero_scale). The e4m3 codes 0x7f / 0xff are NaN
(float8_e4m3fn, as on the GPU; Triton's CPU interpreter reads them as +-480).

GGUF rows served where the framework's table is bf16 (Qwen4Exp's PLE tables, LongCat's n-gram
table): gguf_to_bf16 decodes each row with include/engram_gguf.h (bit-exact against
gguf.quants.dequantize) into one row of float32 scratch, then rounds it to bf16 as _bf16 does."""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from engram_stream._hash cimport es_runtime_bind, es_runtime_of_process

cnp.import_array()

es_runtime_bind(es_runtime_of_process())  # this module's kernels run the one runtime's path (_hash.pxd)

cdef extern from "engram_fp8.h" nogil:
    float es8_e4m3(uint8_t b)

cdef extern from "engram_gguf.h" nogil:
    int es_gg_block(int type, int64_t *values, int64_t *nbytes)
    int es_gg_decode(int type, const uint8_t *src, int64_t n, float *dst)


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


def gguf_to_bf16(int qtype, const uint8_t[:, ::1] records, uint16_t[:, ::1] out):
    """out[j] (bf16 bits) = row records[j] of GGUF type `qtype` (the decoders' number,
    rows.gguf.record_type) decoded to float32 as gguf.quants.dequantize does, rounded to bf16
    (nearest, ties to even; exact for BF16 rows). A row's float32 values go through one row of
    scratch: nothing table-sized, the GIL released."""
    cdef int64_t n = records.shape[0], D = out.shape[1], bv = 0, bb = 0, j, i
    if es_gg_block(qtype, &bv, &bb) != 0:
        raise ValueError(f"gguf_to_bf16: GGUF type {qtype} is not one the decoders serve")
    if out.shape[0] != n or D <= 0 or D % bv or records.shape[1] != D // bv * bb:
        raise ValueError(f"gguf_to_bf16: records {tuple(records.shape)[:2]} do not match out {tuple(out.shape)[:2]} "
                         f"(rows of {D} values of GGUF type {qtype} are {D // bv * bb if bv and D % bv == 0 else '?'} "
                         f"bytes)")
    if n == 0:
        return
    cdef float *row = <float *> malloc(D * sizeof(float))
    if row == NULL:
        raise MemoryError(f"gguf_to_bf16: a row of {D} float32 values")
    with nogil:
        for j in range(n):
            es_gg_decode(qtype, &records[j, 0], D, row)
            for i in range(D):
                out[j, i] = _bf16(row[i])
    free(row)
