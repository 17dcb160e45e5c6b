"""The packed row file: every layer's row records in one file beside the checkpoint, so a missed
row costs one read.

A V4.1 checkpoint keeps a layer's `embed.weight` [N, 256] and `embed.scale` [N, 8] as separate
extents of its shards: reading a row from them is two reads, and a 256-byte row at the shard's
odd offset straddles a page one time in sixteen. The row file holds each row's *record* (its
bytes, then its scale's: 264 bytes for V4.1) and the record's 8-byte checksum, with as many
records and their checksums per 4 KiB page as fit whole (15 for V4.1, their 15 checksums after
them; 1 record per run of pages when a record and its checksum are larger than a page), so one
aligned read of one page serves a row and its checksum, with O_DIRECT or not.

The checksum of row r of layer L is XXH64 of the record's bytes seeded (L << 40) + r
(rows._direct.record_sums, engram_io.h's es_io_sum: the same value on every CPU). The direct
reader checks it in C at every read of the record: a record changed after packing (outside
the rows open_rows samples, its mtime put back; or in place while a model reads it) raises
RowChecksumError naming the layer and row, and is never served.

    engram-stream pack-rows DIR            # writes DIR/engram_rows.bin (a demo file F: F.rows)
    pack_rows(model, rows_path(DIR))       # the same from Python

Layout: the header's pages come first (8 magic bytes, the JSON length as a little-endian u64,
the JSON; as many pages as it needs: one for a few layers, more for many); each layer's pages
follow, starting on a page boundary:

    {"format": 2, "page": 4096, "checksum": "xxh64", "variant": ..., "layers": {"L": {"offset",
     "rows", "rowbytes", "scalebytes", "per_group", "group_bytes", "sums", "pages", "digest"}},
     "source": {"FILE": [size, mtime_ns], ...}, "tables": null}

`sums`: the byte of a group where its records' checksums start (right after its records). A row
file of format 1 (no checksums) is refused, naming the command that writes it again.

`source`: the checkpoint files the rows were packed from (names relative to the checkpoint's
folder) as they stood then: a checkpoint saved again since (its files' size or mtime differ)
has its row file refused at open (RowsFileError: pack-rows --force), whatever rows sampling
would catch; the shards' own FileChangedError check compares the same stamps. Rows packed from
tables in RAM (a model of EngramModel.init, or loaded with mmap=False) have no files to stamp:
`source` is null and `tables` the digest of the tables' bytes (records.tables_digest, the
tables_id a host cache gives such a model), which a model opening the file must match.

`digest` is the BLAKE2b of the layer's pages as written. pack_rows computes it from the
checkpoint's own bytes while it writes, reads the file back from disk (the written pages dropped
from the page cache first) and compares digests before the file takes its name (atomic_output:
a temp file, fsynced, renamed); a failed check leaves no row file. Loading with direct reads
uses the file when it is there: open_rows checks the header against the model (variant,
layers, rows, record layout) and a sample of rows per layer against the checkpoint's bytes,
and refuses a file that disagrees (RowsFileError: pack again, or delete it).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np

from ..errors import CheckpointError
from ..io.files import atomic_output, open_regular
from ._direct import record_sums
from .records import record_arrays, tables_digest

PAGE = 4096
MAGIC = b"ENGRROWS"
FORMAT = 2                   # 2: a checksum beside every record (1: none, refused)
CHECKSUM = "xxh64"
SUM_BYTES = 8
NAME = "engram_rows.bin"     # beside a V4.1 folder's shards
SUFFIX = ".rows"             # beside a demo checkpoint file
SAMPLES = 16                 # rows per layer compared with the checkpoint at open
CHUNK_PAGES = 4096           # pages packed per write (16 MiB)


class RowsFileError(CheckpointError):
    """A packed row file that is not this checkpoint's (or not a row file at all)."""


def rows_path(ckpt) -> str:
    """Where a checkpoint's row file lives: DIR/engram_rows.bin for a folder, FILE.rows for a file."""
    ckpt = os.fspath(ckpt)
    return os.path.join(ckpt, NAME) if os.path.isdir(ckpt) else ckpt + SUFFIX


def group_layout(recbytes):
    """(records per group, group bytes, where its checksums start): whole records and their
    checksums per page, or one record and its checksum per run of pages."""
    slot = recbytes + SUM_BYTES
    if slot <= PAGE:
        per = PAGE // slot
        return per, PAGE, per * recbytes
    return 1, -(-slot // PAGE) * PAGE, recbytes


def sum_seed(L) -> int:
    """The checksum seed of layer L's records (row r: seed + r): a record written at another row
    or of another layer fails its check."""
    return int(L) << 40


def source_stamps(model) -> dict | None:
    """{file name: [size, mtime_ns]} of the mapped checkpoint files holding model's rows (names
    relative to the checkpoint's folder), as they were mapped; None when a table is in RAM."""
    from ..io.files import mapping_of
    out = {}
    for L in model.cfg.layer_ids:
        w = model.layer(L)
        for a in (w.table, getattr(w, "table_scale", None)):
            if a is None:
                continue
            mm = mapping_of(a)
            if mm is None or not hasattr(mm, "stamp"):
                return None
            out[os.path.basename(mm.path)] = [int(mm.stamp[2]), int(mm.stamp[3])]
    return out


def plan(model) -> dict:
    """The header of model's row file (digests not yet known): offsets, sizes, layouts, and what
    identifies the rows' origin (the source files' stamps, else the tables' digest)."""
    source = source_stamps(model)
    return _plan(model, source, tables_digest(model) if source is None else None)


def _plan(model, source, tables) -> dict:
    """plan() with its source and tables given. The header takes as many pages as its JSON needs
    (the layers start after it)."""
    hpages = 1
    while True:
        head = _plan_from(model, hpages * PAGE, source, tables)
        need = -(-len(_header_text(head, digests=True)) // PAGE)
        if need <= hpages:
            return head
        hpages = need


def _plan_from(model, first, source, tables) -> dict:
    layers, off = {}, first
    for L in model.cfg.layer_ids:
        rows, scales = record_arrays(model.layer(L))
        rb, sb = rows.shape[1], 0 if scales is None else scales.shape[1]
        per, gb, sums = group_layout(rb + sb)
        n = rows.shape[0]
        pages = -(-n // per) * (gb // PAGE)
        layers[str(L)] = {"offset": off, "rows": n, "rowbytes": rb, "scalebytes": sb, "per_group": per,
                          "group_bytes": gb, "sums": sums, "pages": pages, "digest": None}
        off += pages * PAGE
    return {"format": FORMAT, "page": PAGE, "checksum": CHECKSUM, "variant": model.cfg.variant, "layers": layers,
            "size": off, "source": source, "tables": tables}


def _header_pages(head) -> int:
    """Pages before the first layer (the header's)."""
    return min((lay["offset"] for lay in head["layers"].values()), default=head["size"]) // PAGE


def _groups(rows, scales, lay, g0, g1, seed):
    """Groups [g0, g1) of a layer as bytes: uint8 [(g1 - g0) * group_bytes]: each group's records,
    then their checksums (little-endian u64; a slot past the last row: 0), padding zero."""
    per, gb, rb, sums = lay["per_group"], lay["group_bytes"], lay["rowbytes"], lay["sums"]
    rec = rb + lay["scalebytes"]
    r0, r1 = g0 * per, min(g1 * per, lay["rows"])
    recs = np.zeros(((g1 - g0) * per, rec), np.uint8)
    recs[:r1 - r0, :rb] = rows[r0:r1]
    if scales is not None:
        recs[:r1 - r0, rb:] = scales[r0:r1]
    sum_of = np.zeros((g1 - g0) * per, "<u8")
    sum_of[:r1 - r0] = record_sums(recs[:r1 - r0], seed, r0)
    out = np.zeros((g1 - g0, gb), np.uint8)
    out[:, :per * rec] = recs.reshape(g1 - g0, per * rec)
    out[:, sums:sums + per * SUM_BYTES] = sum_of.view(np.uint8).reshape(g1 - g0, per * SUM_BYTES)
    return out.reshape(-1)


def _layer_chunks(model, L, lay):
    """Layer L's part of the row file as the checkpoint's bytes make it, CHUNK_PAGES at a time
    (what pack_rows writes and verify_rows digests)."""
    rows, scales = record_arrays(model.layer(L))
    groups = lay["pages"] * PAGE // lay["group_bytes"]
    step = max(1, CHUNK_PAGES * PAGE // lay["group_bytes"])
    for g in range(0, groups, step):
        yield _groups(rows, scales, lay, g, min(groups, g + step), sum_seed(L))


def pack_rows(model, path=None, progress=None, before_write=None) -> dict:
    """Write model's row file at `path` (default: rows_path of the file the model was loaded
    from, see model.source), verified, atomically; returns its header. progress(done, total)
    is called with bytes; before_write(total bytes) before anything is written (e.g. to refuse
    a disk that is too small)."""
    if path is None:
        src = getattr(model, "source", None)
        if src is None:
            raise ValueError("pack_rows: give path= (this model was not loaded from a checkpoint)")
        path = rows_path(src)
    path = os.fspath(path)
    head = plan(model)
    total = head["size"]
    if before_write is not None:
        before_write(total)
    done = 0
    with atomic_output(path) as f:
        f.write(b"\0" * (_header_pages(head) * PAGE))  # the header goes in last, once the digests are known
        for L in model.cfg.layer_ids:
            lay = head["layers"][str(L)]
            h = hashlib.blake2b(digest_size=32)
            for chunk in _layer_chunks(model, L, lay):
                h.update(chunk)
                chunk.tofile(f)
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
            lay["digest"] = h.hexdigest()
        f.seek(0)
        f.write(_header_bytes(head))
        f.flush()
        os.fsync(f.fileno())
        _verify_written(f.fileno(), head)
    return head


def _header_text(head, digests=False) -> bytes:
    """MAGIC, the length, the JSON (digests=True: as long as it will be once the digests are in)."""
    if digests:
        head = dict(head, layers={L: dict(lay, digest="0" * 64) for L, lay in head["layers"].items()})
    text = json.dumps(head, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(text)) + text


def _header_bytes(head) -> bytes:
    b = _header_text(head)
    room = _header_pages(head) * PAGE
    if len(b) > room:  # plan() sized it: a digest of another length would be a bug here
        raise ValueError(f"row file header of {len(b)} bytes does not fit its {room}")
    return b + b"\0" * (room - len(b))


def _layer_digest(fd, lay, drop_cache=False) -> str:
    """BLAKE2b of a layer's pages as they are in the file (from disk with drop_cache)."""
    h = hashlib.blake2b(digest_size=32)
    off, end = lay["offset"], lay["offset"] + lay["pages"] * PAGE
    step = CHUNK_PAGES * PAGE
    while off < end:
        n = min(step, end - off)
        if drop_cache:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)  # read what the disk holds
        b = os.pread(fd, n, off)
        if len(b) != n:
            raise RowsFileError(f"row file ends at {off + len(b)} bytes, its header says {end}")
        h.update(b)
        off += n
    return h.hexdigest()


def _verify_written(wfd, head):
    """Read the just-written file back (page cache dropped: from disk) and compare digests."""
    fd = os.open(f"/proc/self/fd/{wfd}", os.O_RDONLY)  # the temp file, for reading
    try:
        for L, lay in head["layers"].items():
            got = _layer_digest(fd, lay, drop_cache=True)
            if got != lay["digest"]:
                raise RowsFileError(f"layer {L}: the written rows read back differently (digest {got[:16]} != "
                                    f"{lay['digest'][:16]}): the disk lost writes; nothing was kept")
    finally:
        os.close(fd)


def read_header(path) -> dict:
    """The header of a row file (RowsFileError when it is not one)."""
    path = os.fspath(path)
    with open_regular(path, lambda m: RowsFileError(f"{path}: {m}")) as f:
        b = f.read(16)
        size = os.fstat(f.fileno()).st_size
        if len(b) < 16 or b[:8] != MAGIC:
            raise RowsFileError(f"{path}: not a packed row file (no {MAGIC!r} magic)")
        n = struct.unpack("<Q", b[8:16])[0]
        text = f.read(n) if n <= size - 16 else b""
    try:
        head = json.loads(text) if len(text) == n else None
    except (UnicodeDecodeError, ValueError):
        head = None
    fmt = head.get("format") if isinstance(head, dict) else None
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt != FORMAT:
        ckpt = os.path.dirname(path) if os.path.basename(path) == NAME else path.removesuffix(SUFFIX)
        raise RowsFileError(f"{path}: a row file of format {fmt}; this engram_stream reads format {FORMAT} (a "
                            f"checksum beside every record, checked at each read): write it again with "
                            f"`engram-stream pack-rows --force {ckpt}` (or delete it: direct reads then come "
                            f"from the checkpoint's own files)")
    if not _header_ok(head):
        raise RowsFileError(f"{path}: unreadable row file header (format {FORMAT} expected): "
                            f"pack it again (engram-stream pack-rows --force)")
    if head.get("size") != size:
        raise RowsFileError(f"{path}: {size} bytes, its header says {head.get('size')}: pack it again")
    return head


_LAYER_INTS = ("offset", "rows", "rowbytes", "scalebytes", "per_group", "group_bytes", "sums", "pages")


def _header_ok(head) -> bool:
    """A header of this format whose every field has its type (so a damaged one is a
    RowsFileError, never an AttributeError or TypeError further on)."""
    def uint(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not (isinstance(head, dict) and head.get("format") == FORMAT and head.get("page") == PAGE
            and head.get("checksum") == CHECKSUM and isinstance(head.get("variant"), str) and uint(head.get("size"))
            and isinstance(head.get("layers"), dict)):
        return False
    src = head.get("source")
    if src is not None and not (isinstance(src, dict) and all(
            isinstance(v, list) and len(v) == 2 and all(uint(x) for x in v) for v in src.values())):
        return False
    tab = head.get("tables")
    if tab is not None and not (isinstance(tab, str) and len(tab) == 16 and all(c in "0123456789abcdef" for c in tab)):
        return False
    return all(isinstance(lay, dict) and all(uint(lay.get(k)) for k in _LAYER_INTS)
               and lay["per_group"] > 0 and lay["group_bytes"] > 0 and isinstance(lay.get("digest"), str)
               for lay in head["layers"].values())


def _sample_rows(n, L):
    """SAMPLES rows of a table of n, spread over it and fixed per layer (first and last included)."""
    if n == 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(0x5EED + int(L))
    r = np.concatenate([[0, n - 1], rng.integers(0, n, SAMPLES - 2)])
    return np.unique(r).astype(np.int64)


def open_rows(model, path) -> dict:
    """{layer: (offset, per_group, group_bytes, sums, seed)} of a row file that is model's: the
    header's layers, rows and record layout must match, and sampled records must equal the
    checkpoint's bytes (RowsFileError names what differs and the fix). The rest of the records
    are checked as they are read (their checksums)."""
    path = os.fspath(path)
    head = read_header(path)
    fix = f"run `engram-stream pack-rows --force` on the checkpoint again, or delete {path}"
    have, was = source_stamps(model), head.get("source")
    if have is not None and was is not None and have != was:
        what = next((f"{k}: {was.get(k)} -> {have.get(k)} (size, mtime_ns)" for k in sorted(set(have) | set(was))
                     if have.get(k) != was.get(k)), "")
        raise RowsFileError(f"{path}: packed from checkpoint files that have changed since ({what}): its rows "
                            f"may be stale: {fix}")
    if head.get("variant") != model.cfg.variant or sorted(head["layers"]) != sorted(map(str, model.cfg.layer_ids)):
        raise RowsFileError(f"{path}: holds {head.get('variant')} layers {sorted(head['layers'])}, the model has "
                            f"{model.cfg.variant} layers {model.cfg.layer_ids}: {fix}")
    if head.get("tables") is not None:   # packed from tables in RAM: their bytes must be these tables'
        tables = tables_digest(model)
        if tables != head["tables"]:
            raise RowsFileError(f"{path}: packed from tables in RAM whose digest is {head['tables']}, this model's "
                                f"tables digest to {tables} (other weights): {fix}")
    want = _plan(model, have, head.get("tables") if have is None else None)["layers"]
    out = {}
    with open_regular(path, lambda m: RowsFileError(f"{path}: {m}")) as f:
        fd = f.fileno()
        for L in model.cfg.layer_ids:
            lay, w = head["layers"][str(L)], want[str(L)]
            for k in _LAYER_INTS:
                if lay.get(k) != w[k]:
                    raise RowsFileError(f"{path}: layer {L} {k} is {lay.get(k)}, the model's is {w[k]}: {fix}")
            rows, scales = record_arrays(model.layer(L))
            rec = lay["rowbytes"] + lay["scalebytes"]
            for r in _sample_rows(lay["rows"], L).tolist():
                off = lay["offset"] + (r // lay["per_group"]) * lay["group_bytes"] + (r % lay["per_group"]) * rec
                got = os.pread(fd, rec, off)
                exp = rows[r].tobytes() + (b"" if scales is None else scales[r].tobytes())
                if got != exp:
                    raise RowsFileError(f"{path}: row {r} of layer {L} differs from the checkpoint's (a row file of "
                                        f"other weights?): {fix}")
            out[L] = (lay["offset"], lay["per_group"], lay["group_bytes"], lay["sums"], sum_seed(L))
    return out


def verify_rows(model, path) -> dict:
    """Read the whole row file and compare every layer with the checkpoint's rows: {layer: ok}."""
    head = read_header(path)
    open_rows(model, path)
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        res = {}
        for L in model.cfg.layer_ids:
            lay = head["layers"][str(L)]
            h = hashlib.blake2b(digest_size=32)
            for chunk in _layer_chunks(model, L, lay):
                h.update(chunk)
            want = h.hexdigest()
            res[L] = want == lay["digest"] == _layer_digest(fd, lay)
    finally:
        os.close(fd)
    return res
