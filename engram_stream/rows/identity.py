"""A model's identity: what names its tables and tells them from another model's.

    layer_digests(model)  {layer: SHA-256 of every byte of its tables}: what a Mooncake Store
                          keeps beside a layer's rows and checks at load (cached a host for
                          mapped files)
    model_name(model)     the name a model's keys get in a store: its config and those digests
    tables_id(model)      which rows, on this host, without reading a mapped file's bytes
    host_model_id(model)  what names a model's host cache files: its config and tables_id
"""
from __future__ import annotations

import hashlib
import json
import os
import stat

from ..io.files import atomic_output, cache_dir, mapping_of
from ..io.memory import byte_chunks, file_extent
from .records import digest_array, table_arrays


# ---- a digest of every byte of a layer's tables (what names and checks a published table) --------
DIGEST_FORMAT = 1          # of the digest (SHA-256) and of its cache entries
DIGEST_CHUNK = 16 << 20    # bytes read and hashed at a time


def _layer_arrays(model, L, tables=None):
    if tables is not None:   # a tier's own records (a GGUF's tensors, mapped): their bytes
        return tables.arrays(L)
    w = model.layer(L)
    return [a for a in (w.table, getattr(w, "table_scale", None)) if a is not None]


def _digest_key(L, arrays):
    """What identifies layer L's table bytes without reading them, or None (a table in RAM): each
    array's dtype, shape, file stamp as mapped (device, inode, size, mtime), the file's ctime
    (no one can set it: a file written again, or an inode used again, has another) and its offset
    in the file. The processes and runs of one host that map one file agree on it."""
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
    path = digest_cache_path(key)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with atomic_output(path) as f:
            f.write(json.dumps({"key": key, "digest": digest}).encode())
    except (OSError, ValueError):   # ValueError: something not a file sits at the entry's path
        pass


def layer_digests(model, layers=None, progress=None, tables=None) -> dict:
    """{layer: 64 hex digits}: the SHA-256 of each layer's table and table scale (each one's
    dtype and shape, then every byte). What names a model's keys in a Mooncake Store and what the
    store keeps beside its rows (rows/mooncake/).

    Reading every byte costs about 1 s a GB, so a layer whose tables are views of mapped files
    is read once a host: its digest is cached under the user's cache folder
    (<cache_dir()>/tables/, $XDG_CACHE_HOME respected), keyed by what identifies the bytes
    (_digest_key: the files' stamps and ctime, the arrays' offsets), and a file saved again is
    read again. The files are read by pread, their pages left out of the page cache
    (io.memory.byte_chunks); a table in RAM is read every call. progress(done, total): bytes.
    tables: an opened tier whose records are its own (a GGUF's: its table tensors' bytes are
    digested, cached as mapped files are), or None (the model's weights)."""
    layers = model.cfg.layer_ids if layers is None else layers
    arrays = {L: _layer_arrays(model, L, tables) for L in layers}
    total, done, out = sum(a.nbytes for L in layers for a in arrays[L]), 0, {}
    for L in layers:
        key = _digest_key(L, arrays[L])
        out[L] = None if key is None else _cached_digest(key)
        if out[L] is None:
            d = hashlib.sha256()   # SHA-NI: about twice BLAKE2b's speed on x86
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


def model_name(model, digests=None) -> str:
    """The name a model's keys get by default: "m" and 32 hex digits of a digest of its config
    and every layer's tables digest (layer_digests: every byte of every table).
    digests: {layer: digest} already taken, or None (taken here: cached for mapped tables)."""
    digests = digests or layer_digests(model)
    d = hashlib.blake2b(digest_size=16)
    d.update(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    for L in model.cfg.layer_ids:
        d.update(f";{L} {digests[L]}".encode())
    return "m" + d.hexdigest()


def tables_id(model) -> str:
    """16 hex digits that tell this model's table rows from any other's on this host, without
    reading them (model_name digests every byte: about 1 s a GB the first time). A
    fine-tune may leave any sample of rows alone, so no sample tells two tables apart. A table
    mapped from a file counts as that file's stamp as it was mapped (device,
    inode, size, mtime: io.files.MappedFile) and its ctime, which no one can set (an inode used
    again, with a forged mtime, still differs): two files of a host differ, one file saved again
    differs, and the processes mapping one file agree without reading it. A table in RAM counts
    as a digest of its bytes (read once, at the first host cache: about 1 s a GB)."""
    d = hashlib.blake2b(digest_size=8)
    for L, a in table_arrays(model):
        mm = mapping_of(a)
        stamp = (f"{tuple(mm.stamp)} {os.fstat(mm.fd).st_ctime_ns}"
                 if mm is not None and hasattr(mm, "stamp") else None)
        digest_array(d, L, a, stamp)
    return d.hexdigest()


def host_model_id(model) -> str:
    """What names a model's host cache files and heads: "c" and 16 hex digits of a digest of its
    config, and its tables_id (which rows, exactly)."""
    config = hashlib.blake2b(json.dumps(model.cfg.to_dict(), sort_keys=True).encode(), digest_size=8)
    return f"c{config.hexdigest()}-t{tables_id(model)}"
