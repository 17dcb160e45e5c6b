"""The CLI on a qwen3.8-flash-next folder written by `engram-stream init` from the variant's small
example config: init says the tables it writes, demo's loading line says what is true of the
variant (raw ids, no compression, no tokenizer), bench and profile run."""
from __future__ import annotations

import json

import pytest

from engram_stream.cli import main
from engram_stream.qwen.config import EXAMPLE

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("qcli")
    (d / "cfg.json").write_text(json.dumps(EXAMPLE))
    assert main(["init", str(d / "cfg.json"), "-o", str(d / "q"), "--quiet"]) == 0
    return d / "q"


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_init_names_the_table_dtype_it_writes(tmp_path, capsys, dtype):
    from engram_stream import EngramModel
    (tmp_path / "cfg.json").write_text(json.dumps(EXAMPLE))
    extra = ["--table-dtype", dtype] if dtype else []
    assert main(["init", str(tmp_path / "cfg.json"), "-o", str(tmp_path / "q")] + extra) == 0
    out = capsys.readouterr().out
    want = dtype or "float32"
    assert f"{want} tables" in out and "float8" not in out
    model = EngramModel.load(tmp_path / "q")
    assert {str(model.layer(L).table.dtype) for L in model.cfg.layer_ids} == {want}


def test_demo_loading_line_says_raw_ids_not_a_tokenizer(folder, capsys):
    assert main(["demo", "--checkpoint", str(folder), "--tokens", "20"]) == 0
    cap = capsys.readouterr()
    loading = next(line for line in cap.err.splitlines() if line.startswith("loading"))
    assert "raw token ids" in loading and "tokenizer.json" not in loading and "compression: built" not in loading
    assert "OK" in cap.out


def test_bench_runs_on_a_qwen_folder(folder, capsys):
    assert main(["bench", "--checkpoint", str(folder), "--steps", "5", "--repeat", "1", "--streams", "2",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "engine step (1 stream)" in out and str(folder) in out


def test_profile_runs_on_a_qwen_folder(folder, capsys):
    pytest.importorskip("memray")
    assert main(["profile", str(folder), "--steps", "5"]) == 0
    assert "decoded 5 tokens" in capsys.readouterr().out
