"""Row records: a row travels and is cached as its bytes in the table's dtype, followed for
int8 tables by its scale's bytes (demo: a float32; V4.1: 8 e8m0 bytes), so every source gives
the gather the bytes the table holds."""
from __future__ import annotations

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


def record_layout(w):
    """(row bytes, scale bytes) of one row record of layer weights `w`."""
    rows, scales = record_arrays(w)
    return rows.shape[1], (0 if scales is None else scales.shape[1])
