"""tables=GGUFTier(path): a model's Engram tables from a GGUF (written by gguf.GGUFWriter in the
converters' layouts), the rest from its folder. The exactness contract: with a GGUF table the
model is the quantized model, so every engine gathers exactly gguf.quants.dequantize's rows
(bit for bit), steps and prefills as the numpy oracle (model.forward of a model opened with the
GGUF: it reads the dequantized table), and every
row source (mapped, direct, a row cache in front of either) gives the same bits."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # the test extra; the runtime never imports it

from engram_stream.errors import CheckpointError  # noqa: E402
from engram_stream.rows import GGUFTier, parse_tier  # noqa: E402
from engram_stream.rows.gguf_tier import GGUFTables  # noqa: E402
from helpers.inputs import variant_inputs  # noqa: E402
from helpers.models import checkpoint_path, make_v41_model  # noqa: E402
from helpers.numeric import close  # noqa: E402
from helpers.row_sources import load_checkpoint  # noqa: E402
from helpers.gguf_files import (U32, longcat_model, qwen_model, quantized_table, same_bits, v41_kv, write_gguf,  # noqa: E402
                                write_table_gguf)

pytestmark = pytest.mark.native  # the engines' gathers decode the GGUF rows in C

SOURCES = {  # the load arguments of every way a GGUF's rows reach an engine
    "mapped": lambda p: dict(tables=GGUFTier(p)),
    "mapped+cache": lambda p: dict(tables=GGUFTier(p), row_cache_mb=0.01),
    "direct": lambda p: dict(tables=GGUFTier(p, read="direct")),
    "direct+cache": lambda p: dict(tables={"gguf": {"path": str(p), "read": "direct"}}, row_cache_mb=0.01),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-folders")
    out = {}
    for key, make in {"qwen": qwen_model, "v41": lambda: make_v41_model(seed=8, hd=256, D=32),
                      "longcat": longcat_model}.items():
        m = make()
        out[key] = str(checkpoint_path(m, d, key))
        m.save(out[key])
    return out


CASES = ([("qwen", n) for n in ("Q4_0", "Q8_0", "IQ4_NL", "BF16")] + [("qwen-split", "Q5_1")]
         + [("v41", n) for n in ("Q8_0", "Q4_K", "Q2_K", "E4M3")] + [("longcat", n) for n in ("Q4_1", "Q8_0")])


@pytest.mark.parametrize("key,name", CASES)
def test_engines_are_the_oracle_on_the_dequantized_table(folders, tmp_path, key, name):
    split = key.endswith("-split") or key == "longcat"   # tables in parts: read mapped only
    folder = folders[key.removesuffix("-split")]
    ref = load_checkpoint(folder)
    path = tmp_path / "t.gguf"
    deq = write_table_gguf(path, ref, name, split=split)
    oracle = load_checkpoint(folder, tables=GGUFTier(path))   # its forward reads the GGUF's table, decoded
    for L in ref.cfg.layer_ids:   # the oracle's table: gguf.quants.dequantize's, bit for bit
        rows = np.random.default_rng(L).integers(0, ref.plan.table_rows[L], (3, 50))
        same_bits(oracle.tables.inner.table_f32(L, rows), deq[L][rows])
    outs = {}
    if split:
        with pytest.raises(CheckpointError, match=r"split into \d+ tensors .*read=\"direct\" reads one tensor"):
            load_checkpoint(folder, tables=GGUFTier(path, read="direct"))
    for what, kw in SOURCES.items():
        if split and "direct" in what:
            continue
        model = load_checkpoint(folder, **kw(path))
        got = {}
        for L in model.cfg.layer_ids:
            ids, hid = variant_inputs(model, 5, (2, 40))
            # the rows: bit for bit gguf.quants.dequantize's
            rows = model.plan.hash_numpy(ids[:1], layers=[L])[L][0]
            want_rows = deq[L][rows + model.layer(L).offsets].reshape(40, -1)
            same_bits(model.stream(L, 1).lookup_packed(ids[0], [0], [40]), want_rows)
            # a prefill across chunks then steps, against the oracle on the dequantized table
            eng = model.stream(L, 2)
            pre = eng.prefill(ids[1, :30], hid[1, :30], stream=1)
            close(pre, oracle.forward(L, ids[1:, :30], hid[1:, :30])[0])
            steps = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(30, 40)], 1)
            want = oracle.forward(L, ids, hid[...])[:, 30:]
            close(steps[1], want[1])
            got[L] = (pre, steps)
        outs[what] = got
        if "cache" in what:
            st = model.row_cache_stats()
            assert st["misses"] > 0 and st["bytes_fetched"] == st["misses"] * model.tables.inner.record_layout(
                model.cfg.layer_ids[0])[0]
        if "direct" in what:
            assert model.row_cache_stats()["reads"] > 0
    for what, got in outs.items():   # every source: the same bits
        for L in got:
            for a, b in zip(got[L], outs["mapped"][L]):
                np.testing.assert_array_equal(a, b, err_msg=f"{what} layer {L}")


def test_a_row_cache_holds_quantized_records(folders, tmp_path):
    """A Q4_K row of 256 values is its 144 bytes in the cache: more rows a MB than 264-byte records."""
    folder = folders["v41"]
    path = tmp_path / "t.gguf"
    write_table_gguf(path, load_checkpoint(folder), "Q4_K")
    q = load_checkpoint(folder, tables=GGUFTier(path), row_cache_mb=1)
    e = load_checkpoint(folder, row_cache_mb=1)
    L = q.cfg.layer_ids[0]
    assert q.row_source(L).rowbytes == 144 and q.row_source(L).record_format == "gguf:Q4_K"
    assert q.row_cache_stats()["capacity_rows"] > 1.5 * e.row_cache_stats()["capacity_rows"]


def test_parse_tier_and_the_file_checks(folders, tmp_path):
    folder = folders["v41"]
    ref = load_checkpoint(folder)
    path = tmp_path / "t.gguf"
    write_table_gguf(path, ref, "Q8_0")
    assert isinstance(parse_tier({"gguf": {"path": str(path)}}), GGUFTier)
    with pytest.raises(TypeError, match=r"tables=\{'gguf': \{'file': 'x'\}\}: .* the arguments are \('path', 'read'"):
        parse_tier({"gguf": {"file": "x"}})
    with pytest.raises(ValueError, match="read= must be one of"):
        GGUFTier(path, read="lazy")
    m = load_checkpoint(folder, tables=GGUFTier(path))
    assert isinstance(m.tables.inner, GGUFTables)
    assert "deepseek41.engram.primes" in m.tables.inner.missing   # taken from the folder
    # a hash constant that is not the folder's: refused at load, both values named
    cfg = ref.cfg
    kv = v41_kv(ref)
    kv["deepseek41.engram.head_count"] = (cfg.n_head_per_ngram + 1, U32, None)
    rng = np.random.default_rng(0)
    tensors = {f"blk.{L}.engram_embd.weight": quantized_table("Q8_0", ref.plan.table_rows[L], cfg.head_dim, rng)[0]
               for L in cfg.layer_ids}
    write_gguf(path, "deepseek41", tensors, kv)
    with pytest.raises(CheckpointError, match=rf"head_count is {cfg.n_head_per_ngram + 1} in the GGUF, "
                                              rf"{cfg.n_head_per_ngram} in the model folder's config"):
        load_checkpoint(folder, tables=GGUFTier(path))
    # another model's GGUF (a qwen4exp file for a V4.1 folder)
    with pytest.raises(CheckpointError, match="architecture is 'qwen4exp'"):
        write_gguf(path, "qwen4exp", tensors)
        load_checkpoint(folder, tables=GGUFTier(path))


@pytest.mark.mooncake
@pytest.mark.parametrize("key,name,read", [("v41", "Q4_K", "direct"), ("qwen-split", "Q5_1", "mapped"),
                                           ("longcat", "Q8_0", "mapped")])
def test_a_gguf_published_to_mooncake_serves_its_quantized_rows(folders, tmp_path, mooncake, tier, key, name, read,
                                                               monkeypatch):
    """MooncakeTier.publish of a model loaded with a GGUFTier writes the GGUF's records as they are
    (quantized, "gguf:TYPE" in the fingerprint); a model loading with MooncakeTier(gguf=path) reads
    and decodes them: every engine's rows and outputs bit-identical to the mapped GGUF's. A model
    without the GGUF finds no rows of its own tables under its name."""
    from engram_stream.errors import TierError
    from engram_stream.rows import MooncakeTier
    split = key.endswith("-split") or key == "longcat"
    folder = folders[key.removesuffix("-split")]
    path = tmp_path / "t.gguf"
    write_table_gguf(path, load_checkpoint(folder), name, seed=6, split=split)
    src = load_checkpoint(folder, tables=GGUFTier(path, read=read))
    L0 = src.cfg.layer_ids[0]
    rb = src.row_source(L0).rowbytes
    written = tier.publish(src)
    assert written == sum(int(p) for L in src.cfg.layer_ids for p in src.plan.head_primes[L]) * rb   # GGUF bytes
    assert tier.published(L0, tier.name_of(src))["record_format"] == f"gguf:{name}"
    mapped = load_checkpoint(folder, tables=GGUFTier(path))
    reader = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, timeout=5, gguf=path)
    try:
        remote = load_checkpoint(folder, tables=reader, row_cache_mb=0.01)
        for L in remote.cfg.layer_ids:
            s = remote.row_source(L)
            assert (s.record_format, s.rowbytes, s.scalebytes) == (f"gguf:{name}", rb, 0)
            ids, hid = variant_inputs(remote, 7, (2, 24))
            same_bits(remote.stream(L, 1).lookup_packed(ids[0], [0], [24]),
                      mapped.stream(L, 1).lookup_packed(ids[0], [0], [24]))
            a, b = remote.stream(L, 2), mapped.stream(L, 2)
            np.testing.assert_array_equal(a.prefill(ids[1], hid[1], stream=1), b.prefill(ids[1], hid[1], stream=1))
            rows = np.arange(0, remote.plan.table_rows[L], 97)
            got, want = np.empty((rows.size, rb), np.uint8), np.empty((rows.size, rb), np.uint8)
            s.read_into(rows, got)
            mapped.row_source(L).read_into(rows, want)
            np.testing.assert_array_equal(got, want)
        assert remote.row_cache_stats()["fetches"] > 0
    finally:
        reader.close()
    # the serving plugins' settings: the GGUF and the store together read the published GGUF rows
    from engram_stream.integrations import serving
    monkeypatch.setattr(serving, "_models", {})
    settings = {"checkpoint": folder, "tables": {"gguf": {"path": str(path)}},
                "mooncake": {"master": mooncake.master, "metadata": mooncake.metadata}}
    if key == "v41":   # V4.1's serving embeddings take 264-byte records only
        with pytest.raises(ValueError, match=f"is {name} .*264-byte e4m3"):
            serving.parse_settings(settings, "ENV")
    else:
        served = serving.open_model(serving.parse_settings(settings, "ENV"), None, "ENV")
        assert type(served.tables.inner).__name__ == "StoreTables"
        assert served.row_source(L0).record_format == f"gguf:{name}"
    with pytest.raises(TierError):   # the folder's own tables were not published
        load_checkpoint(folder, tables=tier)


@pytest.mark.parametrize("key,what", [("v41", "mapped"), ("v41", "direct"), ("v41", "direct+cache"),
                                      ("qwen-split", "mapped+cache"), ("longcat", "mapped")])
def test_a_gguf_changed_after_opening_is_refused_not_served(folders, tmp_path, key, what):
    """The GGUF's stamp (device, inode, size, mtime, ctime) is taken when it is opened, as for the
    checkpoint's files: after the file changed, an engine's call (its FileStamps cover the mapped
    GGUF its source points into), a direct read and the oracle raise FileChangedError naming the
    file; nothing read from it is served."""
    import os
    from engram_stream.errors import FileChangedError
    split = key.endswith("-split") or key == "longcat"
    folder = folders[key.removesuffix("-split")]
    path = tmp_path / "t.gguf"
    write_table_gguf(path, load_checkpoint(folder), "Q8_0", split=split)
    model = load_checkpoint(folder, **SOURCES[what](path))
    L = model.cfg.layer_ids[0]
    ids, hid = variant_inputs(model, 3, (2, 8))
    eng = model.stream(L, 1)
    eng.lookup_packed(ids[0], [0], [8])   # read before the change: served
    with open(path, "ab") as f:   # the file rewritten in place (grown: its mapped pages stay readable)
        f.write(b"\0" * 4096)
    for run in (lambda: eng.lookup_packed(ids[1], [0], [8]), lambda: model.stream(L, 1).lookup_packed(ids[1], [0], [8]),
                lambda: model.forward(L, ids, None if model.variant.input_layer else hid)):
        with pytest.raises(FileChangedError, match=r"t\.gguf"):
            run()
    if "direct" in what:   # a direct source's own reads check the stamp too
        fresh = np.arange(model.plan.table_rows[L] - 5, model.plan.table_rows[L])   # rows no cache holds
        src = model.row_source(L)
        with pytest.raises(FileChangedError, match=r"t\.gguf"):
            src.read_into(fresh, np.empty((5, src.rowbytes), np.uint8))
    os.truncate(path, os.path.getsize(path) - 4096)   # the size back, the ctime not: still refused
    with pytest.raises(FileChangedError, match=r"t\.gguf"):
        eng.lookup_packed(ids[1], [0], [8])


def test_the_cli_decodes_and_checks_a_model_with_a_gguf_table(folders, tmp_path, capsys):
    """engram-stream demo --checkpoint FOLDER --gguf FILE decodes with the GGUF's rows and checks
    them against the oracle on the GGUF's table; --gguf without a checkpoint is refused, naming it."""
    from engram_stream.cli import main
    path = tmp_path / "t.gguf"
    write_table_gguf(path, load_checkpoint(folders["qwen"]), "Q4_0", seed=2)
    capsys.readouterr()
    assert main(["demo", "--checkpoint", folders["qwen"], "--gguf", str(path), "--tokens", "20", "--quiet"]) == 0
    assert "check against the batch path (atol 2e-5 + rtol 2e-4): OK" in capsys.readouterr().out
    assert main(["demo", "--gguf", str(path), "--tokens", "3", "--quiet"]) == 1
    assert f"--gguf {path}: give the checkpoint whose tables it holds" in capsys.readouterr().err


@pytest.mark.mooncake
def test_the_cli_publishes_a_ggufs_rows(folders, tmp_path, mooncake):
    """engram-stream publish FOLDER --gguf FILE: the GGUF's quantized records in the store, which a
    model loading with MooncakeTier(gguf=FILE) reads bit-identically to the mapped GGUF."""
    import os
    import subprocess
    import sys
    from engram_stream.rows import MooncakeTier
    folder, path = folders["longcat"], tmp_path / "t.gguf"
    write_table_gguf(path, load_checkpoint(folder), "Q8_0", seed=5)
    r = subprocess.run([sys.executable, "-m", "engram_stream.cli", "publish", folder, "--gguf", str(path),
                        "--master", mooncake.master, "--metadata", mooncake.metadata, "--name", "cli-gguf"],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0 and "published 1 layer" in r.stdout and "'cli-gguf'" in r.stdout, r.stderr
    mapped = load_checkpoint(folder, tables=GGUFTier(path))
    reader = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, timeout=5, gguf=path, name="cli-gguf")
    try:
        remote = load_checkpoint(folder, tables=reader, row_cache_mb=0.01)
        L = remote.cfg.layer_ids[0]
        assert remote.row_source(L).record_format == "gguf:Q8_0"
        ids, _ = variant_inputs(remote, 3, (1, 24))
        same_bits(remote.stream(L, 1).lookup_packed(ids[0], [0], [24]), mapped.stream(L, 1).lookup_packed(ids[0], [0], [24]))
    finally:
        reader.close()
