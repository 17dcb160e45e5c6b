"""The packed row file (rows/packed.py, `engram-stream pack-rows`): records equal the checkpoint's
rows and scales, none straddles a page, the file is verified and atomic, a foreign or damaged
file is refused."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.cli import main
from engram_stream.rows import packed
from engram_stream.rows.packed import RowsFileError
from engram_stream.rows.records import record_arrays
from engram_stream.v41 import hf as hf_v41

PAGE = 4096
# V4.1 with the real record: head_dim 256 -> 256 e4m3 bytes + 8 e8m0 bytes
V41 = dict(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=512,
           n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
           image_token_id=299)
DEMO = dict(hidden_size=32, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
            engram_vocab_size=[211, 223], layer_ids=[1, 3], vocab_size=500, kernel_size=3)


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41") / "ckpt"
    hf_v41.make_synthetic(d, EngramConfig(**V41), seed=1, n_shards=3)
    return str(d)


def records_in_file(path, head, L):
    """Every record of layer L read from the file with numpy (independent of the packer)."""
    lay = head["layers"][str(L)]
    rec = lay["rowbytes"] + lay["scalebytes"]
    data = np.fromfile(path, np.uint8, count=lay["pages"] * PAGE, offset=lay["offset"])
    groups = data.reshape(-1, lay["group_bytes"])[:, :lay["per_group"] * rec]
    return groups.reshape(-1, rec)[:lay["rows"]]


M64 = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                      0x27D4EB2F165667C5)


def xxh64(data: bytes, seed: int) -> int:
    """XXH64 written from its specification in plain Python (the test's own: not the C under test)."""
    rotl = lambda x, r: ((x << r) | (x >> (64 - r))) & M64  # noqa: E731
    rnd = lambda acc, v: rotl((acc + v * P2) & M64, 31) * P1 & M64  # noqa: E731
    word = lambda i, n=8: int.from_bytes(data[i:i + n], "little")  # noqa: E731
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + P1 + P2) & M64, (seed + P2) & M64, seed, (seed - P1) & M64]
        while n - i >= 32:
            v = [rnd(v[j], word(i + 8 * j)) for j in range(4)]
            i += 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M64
        for x in v:
            h = ((h ^ rnd(0, x)) * P1 + P4) & M64
    else:
        h = (seed + P5) & M64
    h = (h + n) & M64
    while n - i >= 8:
        h = (rotl(h ^ rnd(0, word(i)), 27) * P1 + P4) & M64
        i += 8
    if n - i >= 4:
        h = (rotl(h ^ (word(i, 4) * P1 & M64), 23) * P2 + P3) & M64
        i += 4
    while i < n:
        h = rotl(h ^ (data[i] * P5 & M64), 11) * P1 & M64
        i += 1
    for s, m in ((33, P2), (29, P3)):
        h = (h ^ (h >> s)) * m & M64
    return h ^ (h >> 32)


def test_the_record_checksum_is_xxh64():
    """The C checksum (rows._direct.record_sums) is XXH64: its published values for "" and "abc"
    (seed 0), and the test's own Python XXH64 on records of every length class, seeded by row."""
    from engram_stream.rows._direct import record_sums
    assert xxh64(b"", 0) == 0xEF46DB3751D8E999 and xxh64(b"abc", 0) == 0x44BC2CF5AD770999
    assert int(record_sums(np.frombuffer(b"abc", np.uint8).reshape(1, 3), 0, 0)[0]) == 0x44BC2CF5AD770999
    rng = np.random.default_rng(3)
    for nb in (1, 4, 7, 8, 31, 32, 33, 64, 264, 4100):
        recs = rng.integers(0, 256, (3, nb), dtype=np.uint8)
        got = record_sums(recs, 5 << 40, 9)
        assert [int(x) for x in got] == [xxh64(recs[i].tobytes(), (5 << 40) + 9 + i) for i in range(3)]


def sums_in_file(path, head, L):
    """Every record's stored checksum of layer L (little-endian u64 after its group's records)."""
    lay = head["layers"][str(L)]
    data = np.fromfile(path, np.uint8, count=lay["pages"] * PAGE, offset=lay["offset"])
    groups = data.reshape(-1, lay["group_bytes"])[:, lay["sums"]:lay["sums"] + 8 * lay["per_group"]]
    return np.ascontiguousarray(groups).view("<u8").reshape(-1)[:lay["rows"]]


def test_v41_row_file_holds_weight_then_scale_15_a_page(v41_dir):
    model = EngramModel.from_deepseek_v41(v41_dir)
    path = packed.rows_path(v41_dir)
    assert path == os.path.join(v41_dir, "engram_rows.bin")
    head = packed.pack_rows(model, path)
    assert head["size"] == os.path.getsize(path)
    for L in V41["layer_ids"]:
        lay = head["layers"][str(L)]
        assert (lay["rowbytes"], lay["scalebytes"], lay["per_group"], lay["group_bytes"]) == (256, 8, 15, PAGE)
        assert lay["offset"] % PAGE == 0
        w = model.layer(L)
        want = np.concatenate([w.embed_weight, w.embed_scale], axis=1)
        np.testing.assert_array_equal(records_in_file(path, head, L), want)
        # no record straddles a page: record k of a page ends within it, its checksum too
        assert 15 * (264 + 8) <= PAGE and lay["pages"] == -(-want.shape[0] // 15) and lay["sums"] == 15 * 264
        sums = sums_in_file(path, head, L)
        for r in (0, 1, 14, 15, want.shape[0] - 1):
            assert int(sums[r]) == xxh64(want[r].tobytes(), (L << 40) + r)
    assert packed.open_rows(model, path) == {L: (head["layers"][str(L)]["offset"], 15, PAGE, 15 * 264, L << 40)
                                             for L in V41["layer_ids"]}
    assert packed.verify_rows(model, path) == {L: True for L in V41["layer_ids"]}


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_demo_row_file(tmp_path, dtype):
    m = EngramModel.init(EngramConfig(**DEMO), seed=2)
    ck = str(tmp_path / "m.safetensors")
    m.save(ck, table_dtype=dtype)
    model = EngramModel.load(ck)
    assert packed.rows_path(ck) == ck + ".rows"
    head = packed.pack_rows(model, packed.rows_path(ck))
    for L in DEMO["layer_ids"]:
        w = model.layer(L)
        rb = w.table.shape[1] * w.table.dtype.itemsize
        lay = head["layers"][str(L)]
        assert lay["rowbytes"] == rb and lay["scalebytes"] == (4 if dtype == "int8" else 0)
        want = np.ascontiguousarray(w.table).view(np.uint8).reshape(w.table.shape[0], -1)
        if dtype == "int8":
            want = np.concatenate([want, np.ascontiguousarray(w.table_scale, np.float32).view(np.uint8)
                                   .reshape(-1, 4)], axis=1)
        np.testing.assert_array_equal(records_in_file(ck + ".rows", head, L), want)


def test_a_row_file_of_other_weights_is_refused(v41_dir, tmp_path):
    """Same config, other weights: refused (their files are not the ones packed, and the
    sampled rows differ)."""
    other = tmp_path / "other"
    hf_v41.make_synthetic(other, EngramConfig(**V41), seed=9, n_shards=2)
    theirs = EngramModel.from_deepseek_v41(other)
    packed.pack_rows(theirs, packed.rows_path(other))
    ours = EngramModel.from_deepseek_v41(v41_dir)
    with pytest.raises(RowsFileError, match="differs from the checkpoint|changed since"):
        packed.open_rows(ours, packed.rows_path(other))
    other_cfg = EngramModel.init(EngramConfig(**dict(V41, layer_ids=[1, 5])), seed=1)
    with pytest.raises(RowsFileError, match="layers"):
        packed.open_rows(other_cfg, packed.rows_path(other))


def test_damaged_files_are_refused(v41_dir, tmp_path):
    model = EngramModel.from_deepseek_v41(v41_dir)
    path = str(tmp_path / "rows.bin")
    head = packed.pack_rows(model, path)
    data = open(path, "rb").read()
    for name, blob, msg in [("short", data[:-PAGE], "header says"), ("magic", b"X" + data[1:], "magic"),
                            ("empty", b"", "magic"), ("json", data[:16] + b"x" + data[17:], "header")]:
        bad = tmp_path / name
        bad.write_bytes(blob)
        with pytest.raises(RowsFileError, match=msg):
            packed.open_rows(model, bad)
    # one flipped byte inside a record: whole verification finds it (a sample may not)
    lay = head["layers"]["4"]
    flip = bytearray(data)
    flip[lay["offset"] + PAGE + 100] ^= 0xFF
    bad = tmp_path / "flip"
    bad.write_bytes(bytes(flip))
    assert packed.verify_rows(model, bad) == {1: True, 4: False}


def test_a_row_file_of_a_checkpoint_saved_again_is_refused(v41_dir, tmp_path):
    """The row file records its checkpoint files' size and mtime: after one of them is written
    again (same bytes even: what sampling cannot see) the row file is refused, naming the file
    and pack-rows --force; packed again it is used."""
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(v41_dir, d)
    packed.pack_rows(EngramModel.from_deepseek_v41(d), packed.rows_path(d))
    EngramModel.from_deepseek_v41(d, tables="direct")  # unchanged: used
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[0]
    st = os.stat(d / shard)
    os.utime(d / shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(RowsFileError, match=f"{shard}.*pack-rows --force"):
        EngramModel.from_deepseek_v41(d, tables="direct")
    packed.pack_rows(EngramModel.from_deepseek_v41(d), packed.rows_path(d))
    assert EngramModel.from_deepseek_v41(d, tables="direct").tables.inner.rows_path == packed.rows_path(d)


def test_a_row_file_rewritten_under_a_running_model_is_noticed(v41_dir, tmp_path):
    """The row file is checked before every read like the shards: rewritten in place, the
    next read raises FileChangedError (nothing read from it is served)."""
    import shutil
    from engram_stream.errors import FileChangedError
    d = tmp_path / "ck"
    shutil.copytree(v41_dir, d)
    packed.pack_rows(EngramModel.from_deepseek_v41(d), packed.rows_path(d))
    model = EngramModel.from_deepseek_v41(d, tables="direct")
    L = V41["layer_ids"][0]
    eng = model.stream(L)
    G, D = V41["hc_mult"], V41["hidden_size"]
    eng.step(5, np.ones((G, D), np.float32))
    with open(packed.rows_path(d), "r+b") as f:
        f.seek(2 * PAGE)
        f.write(b"\xff" * 64)
    with pytest.raises(FileChangedError, match="engram_rows.bin"):
        eng.step(7, np.ones((G, D), np.float32))


def test_a_24_layer_checkpoint_packs(tmp_path):
    """24 layers: the header takes two pages; it is written, read and used."""
    cfg = EngramConfig(**dict(V41, layer_ids=list(range(1, 25)), engram_vocab_size=[31] * 3))
    d = tmp_path / "ck"
    hf_v41.make_synthetic(d, cfg, seed=2, n_shards=2)
    model = EngramModel.from_deepseek_v41(d)
    head = packed.pack_rows(model, packed.rows_path(d))
    assert min(lay["offset"] for lay in head["layers"].values()) == 2 * PAGE
    assert packed.read_header(packed.rows_path(d)) == head
    assert all(packed.verify_rows(model, packed.rows_path(d)).values())
    direct = EngramModel.from_deepseek_v41(d, tables="direct")
    for L in (1, 24):
        np.testing.assert_array_equal(records_in_file(packed.rows_path(d), head, L)[:5],
                                      np.concatenate([model.layer(L).embed_weight[:5].view(np.uint8),
                                                      model.layer(L).embed_scale[:5].view(np.uint8)], axis=1))
    assert direct.tables.inner.rows_path == packed.rows_path(d)


def test_a_header_of_wrong_types_is_a_rows_file_error(v41_dir, tmp_path):
    """A header that parses but whose fields have other types is refused as RowsFileError."""
    import json
    import struct
    model = EngramModel.from_deepseek_v41(v41_dir)
    path = str(tmp_path / "rows.bin")
    head = packed.pack_rows(model, path)
    data = open(path, "rb").read()
    lay1 = head["layers"]["1"]
    for bad in (dict(head, layers={"1": 7, "4": head["layers"]["4"]}), dict(head, layers=[1, 4]),
                dict(head, layers=dict(head["layers"], **{"1": dict(lay1, rows="3")})),
                dict(head, layers=dict(head["layers"], **{"1": dict(lay1, per_group=0)})),
                dict(head, variant=None), dict(head, size="x"), dict(head, source=[1])):
        text = json.dumps(bad).encode()
        blob = packed.MAGIC + struct.pack("<Q", len(text)) + text
        p = tmp_path / "bad.bin"
        p.write_bytes(blob + data[len(blob):])
        with pytest.raises(RowsFileError, match="header"):
            packed.open_rows(model, p)


def test_rows_packed_from_tables_in_ram_record_their_digest(tmp_path):
    """A model of EngramModel.init (tables in RAM, no file to stamp): its row file records the
    tables' digest (the tables_id a host cache gives it), the same tables open it and read its
    rows, other tables (a shape alike, another seed) are refused naming both digests."""
    from engram_stream.rows.records import tables_digest
    from engram_stream.rows.identity import tables_id
    cfg = EngramConfig(**V41)
    model = EngramModel.init(cfg, seed=4)
    path = str(tmp_path / "ram.rows")
    head = packed.pack_rows(model, path)
    assert head["source"] is None and head["tables"] == tables_digest(model) == tables_id(model)
    assert packed.read_header(path)["tables"] == head["tables"]
    at = packed.open_rows(model, path)
    L = cfg.layer_ids[0]
    want = np.concatenate(record_arrays(model.layer(L)), axis=1)
    np.testing.assert_array_equal(records_in_file(path, head, L)[:7], want[:7])
    assert at[L][0] == head["layers"][str(L)]["offset"]
    other = EngramModel.init(cfg, seed=5)
    with pytest.raises(RowsFileError, match=f"digest is {head['tables']}.*{tables_digest(other)}.*pack-rows --force"):
        packed.open_rows(other, path)
    text = json.dumps(dict(head, tables="not hex")).encode()
    blob = packed.MAGIC + struct.pack("<Q", len(text)) + text
    data = open(path, "rb").read()
    bad = tmp_path / "bad.rows"
    bad.write_bytes(blob + data[len(blob):])
    with pytest.raises(RowsFileError, match="header"):
        packed.open_rows(model, bad)


def test_pack_is_atomic(v41_dir, tmp_path, monkeypatch):
    """A pack that fails (here: its read-back check) leaves neither the file nor a temp file;
    an existing file stays as it was."""
    model = EngramModel.from_deepseek_v41(v41_dir)
    path = tmp_path / "rows.bin"
    path.write_bytes(b"old")
    real = packed._layer_digest
    monkeypatch.setattr(packed, "_layer_digest", lambda fd, lay, drop_cache=False: "0" * 64)
    with pytest.raises(RowsFileError, match="read back differently"):
        packed.pack_rows(model, path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["rows.bin"]
    monkeypatch.setattr(packed, "_layer_digest", real)
    packed.pack_rows(model, path)
    assert packed.read_header(path)["size"] == os.path.getsize(path)


def test_cli_pack_rows(v41_dir, tmp_path, capsys):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(v41_dir, d)
    rows = d / "engram_rows.bin"
    if rows.exists():
        rows.unlink()
    assert main(["pack-rows", str(d), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "264-byte records, 15 per page, verified" in out and rows.exists()
    assert main(["pack-rows", str(d)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["pack-rows", str(d), "--verify"]) == 0
    assert capsys.readouterr().out.count(": OK") == 2
    assert main(["pack-rows", str(d), "--force", "--quiet"]) == 0
    lay = packed.read_header(rows)["layers"]["4"]
    r = next(r for r in range(lay["rows"] // 2, lay["rows"]) if r not in packed._sample_rows(lay["rows"], 4))
    b = bytearray(rows.read_bytes())
    b[lay["offset"] + r // 15 * PAGE + r % 15 * 264 + 3] ^= 1
    rows.write_bytes(bytes(b))
    assert main(["pack-rows", str(d), "--verify"]) == 1
    assert "DIFFERS" in capsys.readouterr().out


def _copy_packed(v41_dir, tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(v41_dir, d)
    packed.pack_rows(EngramModel.from_deepseek_v41(d), packed.rows_path(d))
    return d


def _unsampled_row(lay, L):
    return next(r for r in range(lay["rows"] // 2, lay["rows"]) if r not in packed._sample_rows(lay["rows"], L))


def _poke(path, at, data):
    """Write data at byte `at` of the file in place, then put its mtime (and atime) back."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_a_record_changed_outside_the_samples_with_its_mtime_put_back_is_never_served(v41_dir, tmp_path):
    """A record changed after packing, away from the rows open_rows samples, the file's mtime put
    back: the model loads (header, stamps and samples agree), and the read of that row raises
    RowChecksumError naming the file, layer and row; its neighbours on the same page are served
    as packed."""
    from engram_stream.errors import RowChecksumError
    d = _copy_packed(v41_dir, tmp_path)
    path = packed.rows_path(d)
    head = packed.read_header(path)
    L = 4
    lay = head["layers"][str(L)]
    r = _unsampled_row(lay, L)
    _poke(path, lay["offset"] + r // 15 * PAGE + r % 15 * 264 + 7, b"\x7e")   # an e4m3 byte: 448.0
    model = EngramModel.from_deepseek_v41(d, tables="direct")
    assert model.tables.inner.rows_path == path
    src = model.row_source(L)
    w = EngramModel.from_deepseek_v41(d).layer(L)
    want = np.concatenate([w.embed_weight, w.embed_scale], axis=1)
    nb = r + 1 if (r + 1) // 15 == r // 15 else r - 1   # a row of the same page
    np.testing.assert_array_equal(src.read([nb]), want[[nb]])
    with pytest.raises(RowChecksumError, match=f"engram_rows.bin: layer {L} row {r}: .*pack-rows --force"):
        src.read([nb, r])
    np.testing.assert_array_equal(src.read([0, nb]), want[[0, nb]])   # the reader goes on after the refusal


def test_a_record_rewritten_in_place_after_load_with_its_mtime_put_back_is_refused(v41_dir, tmp_path):
    """A record rewritten in place while a model reads the file, with a checksum that matches the
    new bytes (as a packer of other weights writes it) and the mtime put back: the stat check sees
    the file's new ctime and raises FileChangedError before anything is read."""
    from engram_stream.errors import FileChangedError
    from engram_stream.rows._direct import record_sums
    d = _copy_packed(v41_dir, tmp_path)
    path = packed.rows_path(d)
    lay = packed.read_header(path)["layers"]["1"]
    model = EngramModel.from_deepseek_v41(d, tables="direct")
    src = model.row_source(1)
    r = _unsampled_row(lay, 1)
    rec = src.read([r])
    rec[0, :8] ^= 0x11
    at = lay["offset"] + r // 15 * PAGE
    _poke(path, at + r % 15 * 264, rec.tobytes())
    _poke(path, at + lay["sums"] + r % 15 * 8, record_sums(rec, 1 << 40, r).astype("<u8").tobytes())
    with pytest.raises(FileChangedError, match="ctime"):
        src.read([r])


def test_a_row_file_of_format_1_is_refused_naming_the_command_that_writes_it_again(v41_dir, tmp_path):
    """A format 1 row file (no checksums): refused at load with the pack-rows --force command of
    its checkpoint."""
    d = _copy_packed(v41_dir, tmp_path)
    path = packed.rows_path(d)
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[8:16])[0]
    head = json.loads(data[16:16 + n])
    head["format"] = 1
    del head["checksum"]
    text = json.dumps(head).encode()
    blob = packed.MAGIC + struct.pack("<Q", len(text)) + text
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(blob + b"\0" * (n + 16 - len(blob)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    want = rf"format 1; this engram_stream reads format {packed.FORMAT} .*`engram-stream pack-rows --force {d}`"
    with pytest.raises(RowsFileError, match=want):
        EngramModel.from_deepseek_v41(d, tables="direct")
