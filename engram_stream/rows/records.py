"""Row records: a row travels and is cached as its bytes in the table's dtype, followed for
int8 tables by its scale's bytes (demo: a float32; V4.1: 8 e8m0 bytes), so every source gives
the gather the bytes the table holds."""
from __future__ import annotations

import hashlib
import json
import os
import stat

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
    GB): what rows.tiers.tables_id gives a model whose tables are all in RAM, wherever they are."""
    d = hashlib.blake2b(digest_size=8)
    for L, a in table_arrays(model):
        digest_array(d, L, a)
    return d.hexdigest()


# ---- a digest of every byte of a layer's tables (what names and checks a published table) --------
DIGEST_FORMAT = 1          # of the digest and of its cache entries
DIGEST_CHUNK = 16 << 20    # bytes read and hashed at a time


def _layer_arrays(model, L):
    w = model.layer(L)
    return [a for a in (w.table, getattr(w, "table_scale", None)) if a is not None]


def _digest_key(L, arrays):
    """What identifies layer L's table bytes without reading them, or None (a table in RAM): each
    array's dtype, shape, file stamp as mapped (device, inode, size, mtime), the file's ctime
    (no one can set it: a file written again, or an inode used again, has another) and its offset
    in the file. The processes and runs of one host that map one file agree on it."""
    from ..io.memory import file_extent
    parts = []
    for a in arrays:
        ext = file_extent(a)
        if ext is None:
            return None
        mm, off = ext
        mm.check()   # a file changed since it was mapped: refused, as every read of it is
        parts.append(f"{a.dtype.str} {tuple(a.shape)} file {tuple(mm.stamp)} ctime {os.fstat(mm.fd).st_ctime_ns} "
                     f"at {off}")
    return f"engram tables digest {DIGEST_FORMAT} layer {L}: " + "; ".join(parts)


def digest_cache_path(key) -> str:
    """The cache entry of a digest key: <cache_dir()>/tables/<BLAKE2b of the key>.json."""
    from ..io.files import cache_dir
    return os.path.join(cache_dir(), "tables", hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + ".json")


def _cached_digest(key):
    """The cached digest of `key`, or None: an entry is trusted only when it is a regular file of
    this user that no one else may write, holding this very key and a digest of 64 hex digits.
    Anything else (no folder, a folder that cannot be read, a damaged entry) is a miss."""
    path = digest_cache_path(key)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        entry = json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    d = entry.get("digest") if isinstance(entry, dict) and entry.get("key") == key else None
    return d if isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d) else None


def _cache_digest(key, digest):
    """Keep a digest for the next load (folder made 0700); a cache that cannot be written (a
    read-only home, a file where the folder goes) costs the next load the reading, nothing more."""
    from ..io.files import atomic_output
    path = digest_cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with atomic_output(path) as f:
            f.write(json.dumps({"key": key, "digest": digest}).encode())
    except (OSError, ValueError):   # ValueError: something not a file sits at the entry's path
        pass


def layer_digests(model, layers=None, progress=None) -> dict:
    """{layer: 64 hex digits}: the BLAKE2b-256 of each layer's table and table scale (each one's
    dtype and shape, then every byte). What names a model's keys in a Mooncake Store and what the
    store keeps beside its rows (rows.mooncake).

    Reading every byte costs about 1 s a GB, so a layer whose tables are views of mapped files
    is read once a host: its digest is cached under the user's cache folder
    (<cache_dir()>/tables/, $XDG_CACHE_HOME respected), keyed by what identifies the bytes
    (_digest_key: the files' stamps and ctime, the arrays' offsets), and a file saved again is
    read again. The files are read by pread, their pages left out of the page cache
    (io.memory.byte_chunks); a table in RAM is read every call. progress(done, total): bytes."""
    from ..io.memory import byte_chunks
    layers = model.cfg.layer_ids if layers is None else layers
    arrays = {L: _layer_arrays(model, L) for L in layers}
    total, done, out = sum(a.nbytes for L in layers for a in arrays[L]), 0, {}
    for L in layers:
        key = _digest_key(L, arrays[L])
        out[L] = None if key is None else _cached_digest(key)
        if out[L] is None:
            d = hashlib.blake2b(digest_size=32)
            for a in arrays[L]:
                d.update(f"{L} {a.dtype.str} {tuple(a.shape)};".encode())
                for chunk in byte_chunks(a, DIGEST_CHUNK):
                    d.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
            out[L] = d.hexdigest()
            if key is not None and key == _digest_key(L, arrays[L]):   # not changed while it was read
                _cache_digest(key, out[L])
        else:
            done += sum(a.nbytes for a in arrays[L])
            if progress is not None:
                progress(done, total)
    return out
