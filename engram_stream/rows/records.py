"""Row records: a row travels and is cached as its bytes in the table's dtype, followed for
int8 tables by its scale's bytes (demo: a float32; V4.1: 8 e8m0 bytes), so every source gives
the gather the bytes the table holds."""
from __future__ import annotations

import hashlib

import numpy as np


def record_arrays(w):
    """(rows, scales) of layer weights `w` as byte views: uint8 [N, row bytes] and uint8 [N, scale
    bytes] (None without scales): demo int8 tables have a float32 scale per row, V4.1 tables
    8 e8m0 bytes. A record is a row's bytes followed by its scale's."""
    t = np.ascontiguousarray(w.table)
    rows = t.reshape(t.shape[0], -1).view(np.uint8)
    if w.table_scale is None:
        return rows, None
    s = np.ascontiguousarray(w.table_scale)
    return rows, s.reshape(s.shape[0], -1).view(np.uint8)


# A V4.1 record: head_dim float8_e4m3fn bytes, then one float8_e8m0fnu byte per 32 of them (the
# records vLLM's and SGLang's kernels widen to bf16: integrations._records)
E4M3_E8M0_RECORD = "e4m3+e8m0"


def record_format(w) -> str:
    """What a record of layer weights `w` holds: the weights class's own `record_format` (V4.1:
    E4M3_E8M0_RECORD), else the table's dtype name and its scale's ("int8+float32": a demo int8 row and
    its float32 scale; "bfloat16"). Readers that decode records check this, never a size: a
    demo int8 row of 128 values and its 4-byte scale are as long as a V4.1 row of 128 and its 4
    e8m0 bytes."""
    fmt = getattr(w, "record_format", None)
    if fmt is not None:
        return fmt
    return w.table.dtype.name + ("" if w.table_scale is None else "+" + w.table_scale.dtype.name)


def record_layout(w):
    """(row bytes, scale bytes) of one row record of layer weights `w`."""
    rows, scales = record_arrays(w)
    return rows.shape[1], (0 if scales is None else scales.shape[1])


def table_arrays(model):
    """(layer, array) of every table and table scale of `model`, in layer order."""
    for L in model.cfg.layer_ids:
        w = model.layer(L)
        for a in (w.table, getattr(w, "table_scale", None)):
            if a is not None:
                yield L, a


def digest_array(d, L, a, stamp=None):
    """Add layer L's table array `a` to BLAKE2b `d`: its layer, dtype and shape, then the file
    stamp given (a mapped table: what identifies its file) or else its bytes (read whole)."""
    d.update(f"{L} {a.dtype.str} {a.shape}".encode())
    if stamp is not None:
        d.update(f" file {stamp};".encode())
    else:
        d.update(b" bytes ")
        d.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def tables_digest(model) -> str:
    """16 hex digits of every table's bytes (layer, dtype, shape, bytes: read whole, about 1 s a
    GB): what rows.identity.tables_id gives a model whose tables are all in RAM, wherever they are."""
    d = hashlib.blake2b(digest_size=8)
    for L, a in table_arrays(model):
        digest_array(d, L, a)
    return d.hexdigest()
