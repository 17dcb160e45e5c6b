"""deepseek-v4.1 files: the HF folder layout (config.json, index, shards, tokenizer.json),
save/load, tables mapped in place, the synthetic checkpoint writer, build_compression(decode=)."""
from __future__ import annotations

import json
import mmap
import os
import shutil

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, build_compression
from engram_stream.errors import FileChangedError, HFCheckpointError
from engram_stream.io.safetensors import Tensor
from engram_stream.v41 import hf as hf_v41
from helpers.processes import run_python

SMALL = dict(variant="deepseek-v4.1", engram_vocab_size=[211, 211, 211], max_ngram_size=4,
             n_embed_per_ngram=64, n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64,
             hc_mult=2, vocab_size=300, image_token_id=299)


def is_file_view(a):
    """True when the array's memory is a mapping of a file (np.memmap / mmap in the .base chain)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return False


def inputs(seed=0, T=11):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 300, (2, T))
    ids[0, 4] = 299
    return ids, rng.standard_normal((2, T, 2, 64)).astype(np.float32)


@pytest.mark.parametrize("mmap_", [True, False])
def test_save_load_round_trip(tmp_path, mmap_):
    lookup = np.random.default_rng(1).permutation(300) % 260
    m = EngramModel.init(EngramConfig(**SMALL), seed=4, compression=lookup)
    m.save(tmp_path / "ckpt")
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert "config.json" in files and hf_v41.INDEX in files and hf_v41.COMPRESSION in files
    assert sum(f.endswith(".safetensors") for f in files) == 2
    back = EngramModel.load(str(tmp_path / "ckpt"), mmap=mmap_)
    assert back.cfg.num_embeddings == [back.plan.table_rows[1], back.plan.table_rows[4]]
    assert back.cfg.compressed_vocab_size == 260
    assert np.array_equal(back.plan.lookup, lookup)
    for L in (1, 4):
        for name in ("embed_weight", "embed_scale", "wkv_weight", "wkv_scale", "q_weight", "k_weight"):
            a, b = getattr(m.layer(L), name), getattr(back.layer(L), name)
            assert np.array_equal(a, b) and not b.flags.writeable and b.flags.c_contiguous, name
        assert is_file_view(back.layer(L).embed_weight) == mmap_
    ids, h = inputs()
    assert np.array_equal(back.forward(4, ids, h), m.forward(4, ids, h))


def test_synthetic_checkpoint_with_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    cfg = hf_v41.make_synthetic(tmp_path, EngramConfig(**SMALL), seed=3, n_shards=3)
    with open(tmp_path / hf_v41.INDEX) as f:
        wm = json.load(f)["weight_map"]
    assert len(set(wm.values())) == 3 and "embed.weight" in wm and "layers.1.attn_norm.weight" in wm
    assert {n for n in wm if ".engram." in n} == {f"layers.{L}.engram.{s}" for L in (1, 4) for s in hf_v41.NAMES}
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    # make_tokenizer: "wN", "WN", " wN" share a key; the pad and image tokens have their own
    assert hf["engram_compressed_vocab_size"] == cfg.compressed_vocab_size == 2 + len({i // 3 for i in range(300)
                                                                                    if i not in (2, 299)})
    m = EngramModel.from_deepseek_v41(tmp_path)
    assert m.cfg == cfg == EngramConfig.from_hf_config(tmp_path)
    assert m.plan.lookup[3] == m.plan.lookup[4] == m.plan.lookup[5]   # w1, W1, " w1"
    assert all(is_file_view(m.layer(L).embed_weight) for L in (1, 4))
    ids, h = inputs(2)
    y = m.forward(1, ids, h)
    assert np.isfinite(y).all() and not y[0, 4].any() and np.abs(y).max() > 0


def test_loader_accepts_model_prefix_f32_qk_and_single_file(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=5)
    tensors = []
    for L in (1, 4):
        for short in hf_v41.NAMES:
            a = getattr(m.layer(L), short.replace(".", "_"))
            tensors.append(Tensor.of(f"model.layers.{L}.engram.{short}", a,
                                            code=hf_v41.RAW_CODE.get(short, "F32")))
    hf_v41.write(tmp_path, hf_v41.declared(m.cfg, m.plan), tensors, n_shards=1)
    os.rename(tmp_path / "model-00001-of-00001.safetensors", tmp_path / "model.safetensors")
    os.remove(tmp_path / hf_v41.INDEX)
    back = EngramModel.from_deepseek_v41(tmp_path)
    ids, h = inputs(3)
    assert np.array_equal(back.forward(1, ids, h), m.forward(1, ids, h))


def test_safetensors_reads_our_shards(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    m = EngramModel.init(EngramConfig(**SMALL), seed=6)
    m.save(tmp_path)
    with open(tmp_path / hf_v41.INDEX) as f:
        wm = json.load(f)["weight_map"]
    for L in (1, 4):
        name = f"layers.{L}.engram.embed.scale"
        t = st.load_file(str(tmp_path / wm[name]))[name]
        assert t.dtype == torch.float8_e8m0fnu
        assert np.array_equal(t.view(torch.uint8).numpy(), m.layer(L).embed_scale)


def test_mismatched_declared_sizes_refuse_to_load(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    rows = hf["engram_num_embeddings"][1]
    hf["engram_num_embeddings"][1] = rows + 1
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"{rows}.*{rows + 1}"):
        EngramModel.from_deepseek_v41(tmp_path)


def test_truncated_or_missing_shards_are_refused(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    shard = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))[0]
    with open(tmp_path / shard, "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / shard) - 100)
    with pytest.raises(HFCheckpointError, match="past the end of the file"):
        EngramModel.from_deepseek_v41(tmp_path)
    os.remove(tmp_path / shard)
    with pytest.raises(HFCheckpointError, match="missing"):
        EngramModel.from_deepseek_v41(tmp_path)
    with pytest.raises(HFCheckpointError, match="no config.json"):
        EngramModel.from_deepseek_v41(tmp_path / "nothing")



def test_hostile_shards_are_refused_cleanly(tmp_path):
    """A shard that is a FIFO (opening it would block), a header nested 1e5 deep, and an index
    that is not JSON: each a HFCheckpointError naming the file, never a hang or RecursionError."""
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    saved = (tmp_path / shards[0]).read_bytes()
    os.remove(tmp_path / shards[0])
    os.mkfifo(tmp_path / shards[0])
    with pytest.raises(HFCheckpointError, match="not a regular file"):
        EngramModel.from_deepseek_v41(tmp_path)
    os.remove(tmp_path / shards[0])
    deep = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / shards[0]).write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(HFCheckpointError, match="not valid JSON"):
        EngramModel.from_deepseek_v41(tmp_path)
    (tmp_path / shards[0]).write_bytes(saved)
    (tmp_path / hf_v41.INDEX).write_text("{" * 100_000)
    with pytest.raises(HFCheckpointError, match="not a JSON index"):
        EngramModel.from_deepseek_v41(tmp_path)


def test_folder_writes_never_follow_a_planted_link_and_leave_the_old_folder(tmp_path, monkeypatch):
    """The new folder is made beside the old one under a name of its own: a symlink planted at
    that name is neither followed nor removed; a failing write leaves the old folder whole and
    no temp behind."""
    from engram_stream.io import files
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    folder = tmp_path / "ckpt"
    m.save(folder)
    before = {p: (folder / p).read_bytes() for p in os.listdir(folder)}
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(b"keep me")
    planted = str(tmp_path / "planted.tmp")
    os.symlink(victim, planted)
    monkeypatch.setattr(files, "_temp_name", lambda path: planted)
    with pytest.raises(FileExistsError):
        m.save(folder)
    assert os.listdir(victim) == ["keep"] and os.path.islink(planted)
    os.remove(planted)
    monkeypatch.undo()
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        m.save(folder)
    monkeypatch.undo()
    assert {p: (folder / p).read_bytes() for p in os.listdir(folder)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "victim"]   # no temp folder left


# --- build_compression(decode=) ------------------------------------------------------------------

def test_build_compression_decode_modes():
    pytest.importorskip("tokenizers")
    tok = hf_v41.make_tokenizer(30, 2, 29)
    backend = build_compression(tok, decode="backend")
    assert np.array_equal(backend, build_compression(tok))  # a tokenizers.Tokenizer: no Python layer

    class TransformersLike:  # a Python decode with a clean-up step of its own (upper-cases "w")
        backend_tokenizer = tok

        def decode(self, ids, skip_special_tokens=False):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens).replace("w", "X")

        def convert_ids_to_tokens(self, i):
            return tok.id_to_token(i)

    obj = TransformersLike()
    assert np.array_equal(build_compression(obj, decode="backend"), backend)
    python = build_compression(obj, decode="python")   # "X1" lower-cases to "x1", apart from "W1"
    assert backend[3] == backend[4] == backend[5]       # w1, W1, " w1"
    assert python[3] == python[5] != python[4]          # X1, W1, " X1"
    with pytest.raises(ValueError, match="decode must be one of"):
        build_compression(tok, decode="rust")


# --- the command line ----------------------------------------------------------------------------

def test_cli_inspect_v41_folder(tmp_path, capsys):
    from engram_stream.cli import main
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    primes = m.plan.primes[4][2]
    assert "DEAD token 299" in out and "gate eps 1e-20" in out and f"order 4: primes {primes}" in out
    assert f"table [{m.plan.table_rows[4]}, 32] float8_e4m3fn" in out


def test_cli_demo_v41_folder(tmp_path, capsys):
    pytest.importorskip("engram_stream.v41._engine")  # the V4.1 streaming engine (its own branch)
    from engram_stream.cli import main
    EngramModel.init(EngramConfig(**SMALL), seed=0).save(tmp_path / "ckpt")
    assert main(["demo", "--checkpoint", str(tmp_path / "ckpt"), "--tokens", "40"]) == 0
    assert ": OK" in capsys.readouterr().out


def test_readme_v41_snippet_runs(tmp_path):
    """The README's V4.1 decode, run on a tiny synthetic folder in place of the real one."""
    pytest.importorskip("engram_stream.v41._engine")
    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "README.md")).read()
    block = readme.split("## DeepSeek-V4.1", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    EngramModel.init(EngramConfig(**{**SMALL, "layer_ids": [1, 14]}), seed=0).save(tmp_path)
    scope = {}
    exec(block.replace('"DeepSeek-V4.1-Flash"', repr(str(tmp_path))), scope)
    assert scope["delta"].shape == (2, 64) and np.abs(scope["delta"]).max() > 0


def test_forward_refuses_a_shard_rewritten_after_mapping(tmp_path):
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    back = EngramModel.from_deepseek_v41(tmp_path)
    ids, h = inputs()
    back.forward(1, ids, h)
    with open(tmp_path / "model.safetensors.index.json") as f:
        shard = json.load(f)["weight_map"]["layers.1.engram.embed.weight"]
    with open(tmp_path / shard, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(FileChangedError):
        back.forward(1, ids, h)


def test_tokenizer_shorter_than_vocab_maps_the_rest_to_pad(tmp_path):
    """Real checkpoints pad the embedding past the tokenizer's last id (vocab_size 129280)."""
    pytest.importorskip("tokenizers")
    cfg = EngramConfig(**SMALL)
    tok = hf_v41.make_tokenizer(300, 2, 299)
    lookup = build_compression(tok, decode="backend")
    short = hf_v41.make_tokenizer(250, 2, 299)   # ids 250.. have no token (the image id 299 too)
    m = EngramModel.init(cfg, seed=0, compression=np.concatenate([build_compression(short, decode="backend"),
                                                                   np.full(50, lookup[2])]))
    m.save(tmp_path)
    os.remove(tmp_path / hf_v41.COMPRESSION)
    short.save(str(tmp_path / "tokenizer.json"))
    back = EngramModel.from_deepseek_v41(tmp_path)
    assert len(back.plan.lookup) == 300 and (back.plan.lookup[250:] == back.plan.lookup[2]).all()
    assert np.array_equal(back.plan.lookup, m.plan.lookup)


# --- hostile folders: every refusal a HFCheckpointError naming the file (and tensor) -------------

def _saved_small(tmp_path, seed=0):
    m = EngramModel.init(EngramConfig(**SMALL), seed=seed)
    m.save(tmp_path / "ckpt")
    return m, tmp_path / "ckpt"


def _weight_map(folder):
    with open(folder / hf_v41.INDEX) as f:
        return json.load(f)["weight_map"]


def _edit_index(folder, edit):
    with open(folder / hf_v41.INDEX) as f:
        index = json.load(f)
    edit(index["weight_map"])
    (folder / hf_v41.INDEX).write_text(json.dumps(index))


def _edit_header(shard, edit):
    """Rewrite one shard's JSON header through edit(header dict), keeping its data bytes."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    edit(hdr)
    js = json.dumps(hdr).encode()
    js += b" " * (-len(js) % 8)
    shard.write_bytes(len(js).to_bytes(8, "little") + js + raw[8 + n:])


def _set_entry(name, field, value):
    def edit(hdr):
        hdr[name][field] = value
    return edit


HF_HOSTILE = {  # tensor: (edit of its entry, what the message says)
    "float offsets": ("layers.1.engram.q_weight", lambda e: e.update(data_offsets=[float(x) for x in e["data_offsets"]]),
                      "data_offsets"),
    "shape product past 2**64": ("layers.4.engram.k_weight",
                                 lambda e: e.update(shape=[2 ** 32, 2 ** 32], data_offsets=[e["data_offsets"][0]] * 2),
                                 "needs"),
    "shape of floats": ("layers.1.engram.embed.scale", lambda e: e.update(shape=[float(s) for s in e["shape"]]), "shape"),
    "offsets reversed": ("layers.4.engram.wkv.scale", lambda e: e.update(data_offsets=e["data_offsets"][::-1]),
                         "data_offsets"),
    "entry not an object": ("layers.1.engram.wkv.weight", None, "entry"),
}


@pytest.mark.parametrize("case", list(HF_HOSTILE))
def test_hf_reader_errors_name_the_file_and_the_tensor(tmp_path, case):
    name, edit, match = HF_HOSTILE[case]
    _, folder = _saved_small(tmp_path)
    shard = folder / _weight_map(folder)[name]

    def change(hdr):
        if edit is None:
            hdr[name] = [1, 2, 3]
        else:
            edit(hdr[name])
    _edit_header(shard, change)
    with pytest.raises(HFCheckpointError, match=match) as e:
        EngramModel.from_deepseek_v41(folder)
    assert str(shard) in str(e.value) and name in str(e.value)


def test_a_missing_shard_names_the_file_and_a_tensor_it_holds(tmp_path):
    _, folder = _saved_small(tmp_path)
    wm = _weight_map(folder)
    os.remove(folder / wm["layers.1.engram.embed.weight"])
    with pytest.raises(HFCheckpointError, match="missing") as e:
        EngramModel.from_deepseek_v41(folder)
    shard = wm["layers.1.engram.embed.weight"]
    assert str(folder / shard) in str(e.value)
    assert any(n in str(e.value) for n, s in wm.items() if s == shard)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors", 7, None, ""])
def test_index_names_must_stay_inside_the_folder(tmp_path, bad):
    """A weight_map entry naming a file outside the folder (.., absolute) is refused even though
    the file exists and is a valid shard; a name that is not a string is refused the same way."""
    _, folder = _saved_small(tmp_path)
    wm = _weight_map(folder)
    shard = wm["layers.4.engram.wkv.weight"]
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((folder / shard).read_bytes())
    bad = str(outside) if bad == "ABS" else bad

    def edit(w):
        for n, s in w.items():
            if s == shard:
                w[n] = bad
    _edit_index(folder, edit)
    with pytest.raises(HFCheckpointError, match="weight_map") as e:
        EngramModel.from_deepseek_v41(folder)
    assert hf_v41.INDEX in str(e.value) and repr(bad) in str(e.value)


def test_symlinked_shards_as_hf_caches_build_them_load(tmp_path):
    """A Hugging Face cache's snapshot folder holds symlinks into ../../blobs: allowed."""
    m, folder = _saved_small(tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snap = tmp_path / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in os.listdir(folder):
        os.rename(folder / name, blobs / f"blob-{name}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob-{name}"), snap / name)
    back = EngramModel.from_deepseek_v41(snap)
    ids, h = inputs(5)
    assert np.array_equal(back.forward(4, ids, h), m.forward(4, ids, h))


@pytest.mark.parametrize("where", ["index only", "shards hold both"])
def test_an_index_naming_both_prefixes_for_a_layer_is_refused(tmp_path, where):
    """layers.L.engram.* and model.layers.L.engram.* in one index: which is the model's? Refused,
    naming both, instead of silently picking one ("shards hold both": every tensor of layer 4 is
    in the folder under both names, in shards of their own; the `model.` ones were loaded
    without a word)."""
    _, folder = _saved_small(tmp_path)
    wm = _weight_map(folder)
    renamed = {}   # model.layers.4.engram.* -> the copy of its shard that holds it under that name
    if where == "shards hold both":
        for i, shard in enumerate(sorted({s for n, s in wm.items() if n.startswith("layers.4.")})):
            copy = f"model-extra-{i}.safetensors"
            shutil.copyfile(folder / shard, folder / copy)
            _edit_header(folder / copy, lambda hdr: hdr.update({f"model.{n}": hdr.pop(n) for n in list(hdr)
                                                                if n.startswith("layers.4.")}))
            renamed.update({f"model.{n}": copy for n, s in wm.items() if s == shard and n.startswith("layers.4.")})
    else:
        renamed["model.layers.4.engram.q_weight"] = wm["layers.4.engram.q_weight"]
    _edit_index(folder, lambda w: w.update(renamed))
    with pytest.raises(HFCheckpointError, match=r"'layers\.4\.engram\.([\w.]+)' and 'model\.layers\.4\.engram\.\1'"):
        EngramModel.from_deepseek_v41(folder)


EDITED_CONFIG = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # a 16 GiB lookup fails loudly, never swaps
from engram_stream import EngramModel
from engram_stream.errors import HFCheckpointError
folder, change, drop = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with open(folder + "/config.json") as f:
    hf = json.load(f)
hf.update(change)
for key in drop:
    hf.pop(key, None)
with open(folder + "/config.json", "w") as f:
    json.dump(hf, f)
t0 = time.monotonic()
try:
    EngramModel.from_deepseek_v41(folder)
except HFCheckpointError as e:
    print(json.dumps({"error": str(e), "seconds": time.monotonic() - t0}))
else:
    sys.exit("loaded")
"""


def _refused_after_config_edit(folder, change, drop=()):
    """config.json of the checkpoint in `folder` updated with `change` (and the keys `drop`
    removed), then loaded in a subprocess (a hang fails the test, not the run; an address-space
    limit turns a huge allocation into an error): {"error": the HFCheckpointError's message,
    "seconds": the load's}."""
    r = run_python(["-c", EDITED_CONFIG, str(folder), json.dumps(change), json.dumps(list(drop))], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("change", [
    {"engram_max_ngram_size": 64, "engram_n_heads": 10 ** 6},     # hours of prime search over tiny shards
    {"engram_vocab_size": 2 ** 61, "engram_n_heads": 20000},      # minutes near 2**61
])
def test_hostile_config_json_is_refused_before_the_prime_search(tmp_path, change):
    """Cheap invariants first (the tensors' shapes, the least rows the prime chain can need), as the
    demo loader does: the search never starts."""
    _, folder = _saved_small(tmp_path)
    res = _refused_after_config_edit(folder, change, drop=["engram_num_embeddings"])
    assert "config.json" in res["error"] and res["seconds"] < 10, res


def test_vocab_size_far_past_the_tokenizer_is_refused_naming_both(tmp_path):
    """config.json's vocab_size 2**31 with a 300-token tokenizer: refused before the lookup is
    padded to 2**31 entries (16 GiB), naming both numbers."""
    pytest.importorskip("tokenizers")
    hf_v41.make_synthetic(tmp_path, EngramConfig(**SMALL), seed=0, n_shards=2)
    err = _refused_after_config_edit(tmp_path, {"vocab_size": 2 ** 31})["error"]
    assert str(2 ** 31) in err and "300" in err and "tokenizer.json" in err


def test_a_tokenizer_longer_than_vocab_size_is_refused_naming_both(tmp_path):
    pytest.importorskip("tokenizers")
    hf_v41.make_synthetic(tmp_path, EngramConfig(**SMALL), seed=0, n_shards=2)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["vocab_size"] = 299
    hf["image_token_id"] = 298
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(HFCheckpointError, match="299.*300|300.*299"):
        EngramModel.from_deepseek_v41(tmp_path)


# --- saves: all of the old folder or all of the new one; temps of killed writers swept -----------

KILLED_SAVE = r"""
import json, os, signal, sys
from engram_stream import EngramConfig, EngramModel
cfg, path, kill_at, seed = EngramConfig(**json.loads(sys.argv[1])), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = EngramModel.init(cfg, seed=seed)
calls, real = [0], os.fsync


def fsync(fd):  # SIGKILL at the kill_at-th fsync of the save: no cleanup of any kind runs
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd)


os.fsync = fsync
model.save(path)
print(calls[0])
"""


def killed_save(cfg_fields, path, kill_at, seed):
    """Run model(seed).save(path) in a child SIGKILLed at its kill_at-th fsync; True if killed."""
    r = run_python(["-c", KILLED_SAVE, json.dumps(cfg_fields), str(path), str(kill_at), str(seed)], timeout=120)
    assert r.returncode in (0, -9), r.stderr[-2000:]
    return r.returncode == -9


def _same_weights(a, b):
    return all(np.array_equal(getattr(a.layer(L), n), getattr(b.layer(L), n))
               for L in a.cfg.layer_ids for n in ("embed_weight", "embed_scale", "wkv_weight", "wkv_scale",
                                                 "q_weight", "k_weight"))


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4, 5, 6, 1000])
def test_a_save_killed_anywhere_leaves_all_of_a_or_all_of_b(tmp_path, kill_at):
    """B.save(folder of A), SIGKILLed at any of its fsyncs (after the first shard, between the
    shards and the index, ...): the folder loads as A whole or B whole, never a mix (1000: not
    killed, B whole); the next save sweeps the dead writer's temps."""
    fields = {**SMALL, "layer_ids": [1, 4, 6]}   # three layers: shards of several tensors each
    cfg = EngramConfig(**fields)
    a, b = EngramModel.init(cfg, seed=1), EngramModel.init(cfg, seed=2)
    folder = tmp_path / "ckpt"
    a.save(folder)
    killed = killed_save(fields, folder, kill_at, seed=2)
    assert killed == (kill_at <= 6)   # this save fsyncs 4 files, the new folder, then its parent
    back = EngramModel.from_deepseek_v41(folder)
    assert _same_weights(back, a) or _same_weights(back, b)
    assert _same_weights(back, b) or killed
    del back
    a.save(folder)   # sweeps what the killed writer left
    leftovers = [p for p in os.listdir(tmp_path) + os.listdir(folder) if ".tmp-" in p]
    assert not leftovers, leftovers
    assert _same_weights(EngramModel.from_deepseek_v41(folder), a)


def test_save_refuses_a_folder_holding_other_files(tmp_path):
    """Replacing a folder deletes what was in it: only a folder of the files a save writes is
    replaced (a full model's folder, with its other shards and files, is refused, unchanged)."""
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    folder = tmp_path / "full-model"
    m.save(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    before = {p: (folder / p).read_bytes() for p in os.listdir(folder)}
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        EngramModel.init(EngramConfig(**SMALL), seed=1).save(folder)
    assert {p: (folder / p).read_bytes() for p in os.listdir(folder)} == before
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a folder"):
        m.save(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_bytes() == b"x"
