"""The engram-stream command and the examples, run as a user would."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from engram_stream.cli import main
from conftest import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=32, n_head_per_ngram=4,
             layer_ids=[1, 4], pad_id=2, seed=0, kernel_size=4, hidden_size=24, hc_mult=4, vocab_size=500)


def test_demo_checks_against_batch_path(capsys):
    assert main(["demo", "--tokens", "60"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and ": OK" in out


def test_init_then_inspect(tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(SMALL))
    ckpt = tmp_path / "m.safetensors"
    assert main(["init", str(cfg), "-o", str(ckpt), "--quiet", "--table-dtype", "float16"]) == 0
    assert ckpt.exists()
    capsys.readouterr()
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "float16" in out and "order 2: primes [101, 103, 107, 109]" in out
    from engram_stream import EngramModel
    m = EngramModel.load(str(ckpt))
    assert m.cfg.to_dict() == SMALL


def test_init_graft_zero_gives_zero_output(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(SMALL))
    ckpt = tmp_path / "g.safetensors"
    assert main(["init", str(cfg), "-o", str(ckpt), "--quiet", "--graft-zero"]) == 0
    from engram_stream import EngramModel
    m = EngramModel.load(str(ckpt))
    rng = np.random.default_rng(0)
    out = m.forward(1, rng.integers(0, 500, (1, 9)), rng.standard_normal((1, 9, 4, 24)))
    assert np.array_equal(out, np.zeros_like(out))


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "/nonexistent/x.safetensors"], "/nonexistent/x.safetensors"),
    (["init", "/nonexistent/cfg.json", "-o", "/tmp/x"], "/nonexistent/cfg.json"),
    (["build-compression", "/nonexistent/tokenizer.json", "-o", "/tmp/x.npy"], "nonexistent"),
])
def test_errors_are_one_line_without_traceback(argv, needle, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("engram-stream: error:") and needle in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_bad_config_json_names_the_field(tmp_path, capsys):
    bad = dict(SMALL, n_head_per_ngram=5)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(bad))
    assert main(["init", str(cfg), "-o", str(tmp_path / "x")]) == 1
    assert "n_head_per_ngram" in capsys.readouterr().err


def test_debug_shows_the_exception():
    with pytest.raises(FileNotFoundError):
        main(["--debug", "inspect", "/nonexistent/x.safetensors"])


def test_build_compression_command(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["Hello hello HELLO café cafe"] * 3, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "lookup.npy"
    assert main(["build-compression", str(path), "-o", str(out)]) == 0
    lookup = np.load(out)
    assert lookup.dtype == np.int64 and lookup.shape == (tok.get_vocab_size(),)
    v = tok.get_vocab()
    assert lookup[v["Hello"]] == lookup[v["hello"]] == lookup[v["HELLO"]]
    assert lookup[v["café"]] == lookup[v["cafe"]] != lookup[v["hello"]]


def test_console_script_entry_point():
    r = run_python(["-m", "engram_stream.cli", "demo", "--tokens", "20"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert ": OK" in r.stdout


@pytest.mark.parametrize("script, needle", [
    ("decode_loop.py", "generated:"),
    ("graft.py", "bit-identical"),
    ("speculative.py", "rollback replay identical: True"),
    ("mmap_serving.py", "resident"),
])
def test_examples_run(script, needle, tmp_path):
    args = [sys.executable, script] + ([str(tmp_path / "e.safetensors")] if script == "mmap_serving.py" else [])
    r = subprocess.run(args, cwd=os.path.join(ROOT, "examples"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout
