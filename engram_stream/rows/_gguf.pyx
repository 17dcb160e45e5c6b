# cython: language_level=3
"""The GGUF row decoders (include/engram_gguf.h) for Python: whole rows of a served type,
decoded to float32 by the C code the engines use (rows/gguf.py reads the bytes from files)."""
import numpy as np

from libc.stdint cimport int64_t, uint8_t

cdef extern from "engram_gguf.h" nogil:
    int ES_GG_E4M3_ROW
    int es_gg_block(int type, int64_t *values, int64_t *nbytes)
    int es_gg_decode(int type, const uint8_t *src, int64_t n, float *dst)
    int es_gg_gather(int type, const uint8_t *base, int64_t nrows, int64_t row_bytes, int64_t n,
                     const int64_t *ids, int64_t nids, float *dst)

E4M3_ROW = ES_GG_E4M3_ROW  # the type number of the 264-byte e4m3 rows (not a ggml number)


def block(int qtype):
    """(values, bytes) of one block of `qtype`; ValueError for a type not served."""
    cdef int64_t v = 0, b = 0
    if es_gg_block(qtype, &v, &b) != 0:
        raise ValueError(f"GGUF type {qtype} is not one the decoders serve")
    return int(v), int(b)


def row_bytes(int qtype, int64_t row_length):
    """Bytes of a row of `row_length` values of `qtype` (whole blocks, else ValueError)."""
    v, b = block(qtype)
    if row_length <= 0 or row_length % v:
        raise ValueError(f"a row of {row_length} values is not whole blocks of {v} (GGUF type {qtype})")
    return row_length // v * b


def decode_rows(int qtype, const uint8_t[:, ::1] raw, int64_t row_length):
    """float32[n, row_length]: the n rows of `raw` (each row_bytes(qtype, row_length) bytes) decoded."""
    cdef int64_t rb = row_bytes(qtype, row_length), n = raw.shape[0], k
    if raw.shape[1] != rb:
        raise ValueError(f"rows of {raw.shape[1]} bytes, a row of {row_length} values of GGUF type {qtype} "
                         f"is {rb} bytes")
    out = np.empty((n, row_length), np.float32)
    cdef float[:, ::1] o = out
    with nogil:
        for k in range(n):
            es_gg_decode(qtype, &raw[k, 0], row_length, &o[k, 0])
    return out


def gather(int qtype, const uint8_t[:, ::1] table, const int64_t[::1] ids, int64_t row_length):
    """float32[len(ids), row_length]: rows `ids` of `table` [rows, row bytes] decoded (the engines'
    gather); IndexError for an id outside the table."""
    cdef int64_t rb = row_bytes(qtype, row_length), nrows = table.shape[0], k, n = ids.shape[0]
    if table.shape[1] != rb:
        raise ValueError(f"a table of {table.shape[1]}-byte rows, a row of {row_length} values of GGUF type "
                         f"{qtype} is {rb} bytes")
    for k in range(n):
        if ids[k] < 0 or ids[k] >= nrows:
            raise IndexError(f"row {ids[k]} of a table of {nrows} rows")
    out = np.empty((n, row_length), np.float32)
    cdef float[:, ::1] o = out
    if n == 0:
        return out
    cdef int rc
    with nogil:
        rc = es_gg_gather(qtype, &table[0, 0], nrows, rb, row_length, &ids[0], n, &o[0, 0])
    assert rc == 0  # every argument was checked above
    return out
