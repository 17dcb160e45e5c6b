"""Argument checks of the streaming engines' public calls, in one place.

Every check runs before an engine changes any state, so a refused call leaves it as it was.
Used by EngineBase, its parts (the hash window, the batch) and every variant's engine.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import id_out_of_range
from ..plan import as_ids

INT64_MIN = -(1 << 63)
BF16 = np.dtype(ml_dtypes.bfloat16)


def view(a, dtype, shape, what):
    """`a` as a read-only C-contiguous array of exactly this dtype and shape (no copy), for
    the engines' typed memoryviews and pointers: anything else is a broken model, refused here."""
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == tuple(shape)
            and a.flags.c_contiguous):
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype).name} array of shape "
                         f"{tuple(shape)}, got {getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
    return a


def token_ids(ids, n_streams: int, vocab: int, negative_ids: bool = True):
    """(int64[S] ids, False) from an [S] array, or (the id as an int, True) from a scalar
    (one stream only; range-checked here, so a step makes no array for it)."""
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, (bool, np.bool_)):
        if n_streams != 1:
            raise ValueError(f"this engine has {n_streams} streams: pass token_ids[{n_streams}]")
        if ids < INT64_MIN:
            raise ValueError(f"token id {ids} does not fit in int64")
        if ids >= vocab:
            raise id_out_of_range(ids, vocab, negative_ids)
        return int(ids), True
    a = as_ids(ids, 1, "token_ids")
    if a.shape[0] != n_streams:
        raise ValueError(f"expected {n_streams} token ids (one per stream), got {a.shape[0]}")
    return a, False


def bad_id(ids, i: int, vocab: int, negative_ids: bool = True) -> ValueError:
    """The error for ids[i] >= vocab (ids: an array, or the scalar id of a one-stream call)."""
    v = ids if isinstance(ids, int) else ids[i]
    return id_out_of_range(v, vocab, negative_ids)


IO_DTYPES = (np.dtype(np.float32), BF16)  # what the kernels read and write in place (DESIGN.md 14)


def as_array(a):
    """`a` as a numpy array: a torch bfloat16 tensor (which numpy cannot read: no buffer protocol,
    no DLPack bf16) as an ml_dtypes bfloat16 view of its memory (no copy; a CPU tensor, else
    ValueError naming its device); anything else through np.asarray (a CPU float32 tensor, or any
    array-like)."""
    if isinstance(a, np.ndarray):
        return a
    dt = getattr(a, "dtype", None)
    if dt is not None and type(a).__module__.startswith("torch") and str(dt) == "torch.bfloat16":
        import torch
        if a.device.type != "cpu":
            raise ValueError(f"a {a.device} bfloat16 tensor: the engine reads CPU memory, move it with .cpu() first")
        return a.detach().view(torch.int16).numpy().view(BF16)
    return np.asarray(a)


def hidden(h, shape):
    """C-contiguous `shape` float32 or bfloat16: the array itself when it is one (zero copy; a torch
    bf16 tensor through as_array), else converted (one copy, check_hidden)."""
    if not (type(h) is np.ndarray):
        h = as_array(h)
    if h.dtype in IO_DTYPES and h.flags.c_contiguous and h.shape == shape:
        return h
    return check_hidden(h, shape)


def out(o, shape, dtype=np.float32):
    """A fresh `dtype` array, or the caller's `out` (a numpy array or a torch tensor, as_array) when
    it is writeable C-contiguous `shape`, float32 or bfloat16."""
    if o is None:
        return np.empty(shape, dtype=dtype)
    a = as_array(o)
    if not (type(a) is np.ndarray and a.dtype in IO_DTYPES and a.flags.c_contiguous
            and a.flags.writeable and a.shape == shape):
        raise ValueError(f"out must be a writeable C-contiguous float32 or bfloat16 array of shape {shape}, got "
                         f"{type(o).__name__} {getattr(o, 'dtype', '')} {getattr(o, 'shape', '')}")
    return a


def stream_index(stream, n_streams: int) -> int:
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise TypeError(f"stream must be an int, got {type(stream).__name__}")
    if not 0 <= stream < n_streams:
        raise IndexError(f"stream {stream} out of range for an engine with {n_streams} streams")
    return int(stream)


def threads(n, most: int) -> int:
    """A thread count as the engines keep it (step_threads, prefill_threads): int(n) clamped
    to [1, most], the header's thread limit."""
    return max(1, min(int(n), most))


def rows_bitmap(bitmap, table_rows: int):
    """None, or a writeable C-contiguous uint8[ceil(table_rows/8)] (bit r = row r)."""
    need = (table_rows + 7) // 8
    if bitmap is not None and not (type(bitmap) is np.ndarray and bitmap.dtype == np.uint8
                                   and bitmap.flags.c_contiguous and bitmap.flags.writeable
                                   and bitmap.shape == (need,)):
        raise ValueError(f"bitmap must be a writeable C-contiguous uint8 array of shape ({need},)")
    return bitmap


def check_hidden(hidden, shape, what="hidden", keep_bf16=True) -> np.ndarray:
    """hidden as a C-contiguous array of exactly `shape`: bfloat16 (an ml_dtypes array, or a torch
    bf16 tensor: as_array) stays bfloat16 when keep_bf16 (a strided one is copied), and with
    keep_bf16=False is widened to float32 exactly; float64/float16 and strided arrays are converted
    to float32; integer or other dtypes are refused."""
    hidden = as_array(hidden)
    if not (np.issubdtype(hidden.dtype, np.floating) or hidden.dtype == BF16):
        raise TypeError(f"{what} must be a float array (float32, float64, float16 or bfloat16), "
                        f"got dtype {hidden.dtype}")
    if hidden.shape != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {hidden.shape}")
    return np.ascontiguousarray(hidden, dtype=BF16 if keep_bf16 and hidden.dtype == BF16 else np.float32)
