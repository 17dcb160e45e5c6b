"""The engram-stream command and the examples, run as a user would."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from engram_stream.cli import main
from helpers.processes import run_python, run_python_on_a_terminal
from helpers.repo import ROOT

SMALL = dict(engram_vocab_size=[101, 211], max_ngram_size=3, n_embed_per_ngram=32, n_head_per_ngram=4,
             layer_ids=[1, 4], pad_id=2, seed=0, kernel_size=4, hidden_size=24, hc_mult=4, vocab_size=500)


def test_demo_checks_against_batch_path(capsys):
    assert main(["demo", "--tokens", "60"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and ": OK" in out
    from engram_stream import kernel_isa
    assert f"kernels: {kernel_isa()} (" in out  # the path that ran


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
    from engram_stream import kernel_isa
    assert f"kernels: {kernel_isa()} (" in out
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
    pytest.importorskip("tokenizers")
    path = _tokenizer(tmp_path)
    tok = __import__("tokenizers").Tokenizer.from_file(str(path))
    out = tmp_path / "lookup.npy"
    assert main(["build-compression", str(path), "-o", str(out)]) == 0
    lookup = np.load(out)
    assert lookup.dtype == np.int64 and lookup.shape == (tok.get_vocab_size(),)
    v = tok.get_vocab()
    assert lookup[v["Hello"]] == lookup[v["hello"]] == lookup[v["HELLO"]]
    assert lookup[v["café"]] == lookup[v["cafe"]] != lookup[v["hello"]]


def _console_script(args, **kw):
    """The engram-stream console script as pip writes it: pyproject.toml's entry point, called."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        module, func = re.search(r'^engram-stream = "([\w.]+):(\w+)"', f.read(), re.M).groups()
    return run_python(["-c", f"import sys; from {module} import {func}; sys.exit({func}())", *args], **kw)


def test_console_script_entry_point():
    r = _console_script(["demo", "--tokens", "20"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert ": OK" in r.stdout


@pytest.mark.parametrize("script, needle", [
    ("decode_loop.py", "generated:"),
    ("graft.py", "bit-identical"),
    ("speculative.py", "rollback replay identical: True"),
    ("mmap_serving.py", "of tables resident"),
])
def test_examples_run(script, needle, tmp_path):
    args = [sys.executable, script] + ([str(tmp_path / "e.safetensors")] if script == "mmap_serving.py" else [])
    r = subprocess.run(args, cwd=os.path.join(ROOT, "examples"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py")
                                          and f not in ("tiny_lm.py", "transformers_generate.py")))
def test_examples_help_writes_nothing(script, tmp_path):
    """`--help` answers with a usage and writes no file (an example once took it for its output path)."""
    import shutil
    work = tmp_path / "examples"
    shutil.copytree(os.path.join(ROOT, "examples"), work)
    before = set(os.listdir(work))
    r = subprocess.run([sys.executable, script, "--help"], cwd=work, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower() or "python examples/" in r.stdout
    assert set(os.listdir(work)) - before <= {"__pycache__"}


# ---- init: paths first, flat memory, size first, progress on a terminal, SIGTERM, stale temps ------------
# 2 layers x 8 heads x ~100k rows of 64 floats: ~0.4 GB of float32 tables, a few seconds to write.
BIG_INIT = dict(SMALL, engram_vocab_size=[100003, 100003], n_embed_per_ngram=256, hidden_size=32)


def _cfg_file(tmp_path, cfg=SMALL, name="cfg.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def _table_bytes(cfg):
    from engram_stream import EngramConfig, HashPlan
    c = EngramConfig(**cfg)
    plan = HashPlan(c)
    return sum(plan.table_rows[L] for L in c.layer_ids) * c.head_dim * 4


def _cli(args, **kw):
    return run_python(["-m", "engram_stream.cli", *args], timeout=300, **kw)


def test_init_writes_exactly_what_the_model_saves(tmp_path):
    from engram_stream import EngramConfig, EngramModel
    cfg = _cfg_file(tmp_path)
    for dtype in ("float32", "int8"):
        ours, theirs = tmp_path / f"cli-{dtype}", tmp_path / f"model-{dtype}"
        assert main(["init", str(cfg), "-o", str(ours), "--weight-seed", "7", "--table-dtype", dtype,
                     "--quiet"]) == 0
        EngramModel.init(EngramConfig(**SMALL), seed=7).save(theirs, table_dtype=dtype)
        assert ours.read_bytes() == theirs.read_bytes()


VMHWM = r"""
import sys
from engram_stream.cli import main
rc = main(sys.argv[1:])
peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print("peak", int(peak) * 1024, rc)
"""


def test_init_memory_stays_flat_whatever_the_table_size(tmp_path):
    """Peak RSS of a fresh process writing ~0.4 GB of tables stays far below the tables' size
    (the tables are drawn and written in pieces, never built whole in RAM)."""
    tables = _table_bytes(BIG_INIT)
    out = tmp_path / "big.safetensors"
    r = run_python(["-c", VMHWM, "init", str(_cfg_file(tmp_path, BIG_INIT)), "-o", str(out), "--quiet"],
                   timeout=300)
    assert r.returncode == 0, r.stderr
    peak, rc = map(int, r.stdout.split()[-2:])
    assert rc == 0 and os.path.getsize(out) > tables > 300 << 20
    assert peak < 200 << 20, (peak, tables)


@pytest.mark.limit_memory("64 MB")
def test_init_heap_limit(tmp_path):
    """Under `pytest --memray`: the heap of init writing ~0.4 GB of tables stays under 64 MB."""
    out = tmp_path / "big.safetensors"
    assert main(["init", str(_cfg_file(tmp_path, BIG_INIT)), "-o", str(out), "--quiet"]) == 0
    assert os.path.getsize(out) > _table_bytes(BIG_INIT)


def test_init_refuses_an_existing_output_without_force(tmp_path, capsys):
    cfg, out = _cfg_file(tmp_path), tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    assert main(["init", str(cfg), "-o", str(out), "--quiet"]) == 1
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    assert main(["init", str(cfg), "-o", str(out), "--quiet", "--force"]) == 0
    assert out.stat().st_size > 1000


def test_init_never_overwrites_its_own_config(tmp_path, capsys):
    cfg = _cfg_file(tmp_path)
    before = cfg.read_bytes()
    for extra in ([], ["--force"]):
        assert main(["init", str(cfg), "-o", str(cfg), "--quiet", *extra]) == 1
        assert "input" in capsys.readouterr().err
    assert cfg.read_bytes() == before


def test_init_checks_the_output_folder_before_any_work(tmp_path, capsys):
    huge = dict(SMALL, engram_vocab_size=[10**9, 10**9])  # would be ~TBs: refused for the path first
    t0 = time.perf_counter()
    assert main(["init", str(_cfg_file(tmp_path, huge)), "-o", str(tmp_path / "no" / "m.st")]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "no") in err and "does not exist" in err and err.count("\n") == 1
    assert time.perf_counter() - t0 < 5


def test_init_refuses_a_size_beyond_free_disk(tmp_path, capsys, monkeypatch):
    import engram_stream.cli as cli
    usage = shutil.disk_usage
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage(p)._replace(free=100_000))
    out = tmp_path / "m.safetensors"
    assert main(["init", str(_cfg_file(tmp_path)), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "free" in err and str(out) in err
    assert os.listdir(tmp_path) == ["cfg.json"]  # neither the file nor a temp file


def test_init_errors_name_the_users_path_not_the_temp_file(tmp_path, capsys, monkeypatch):
    import errno
    from engram_stream.demo import checkpoint

    def replace(src, dst):  # the final rename fails, as on a file system that refuses it
        raise OSError(errno.EIO, os.strerror(errno.EIO), src, None, dst)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    out = tmp_path / "m.safetensors"
    assert main(["init", str(_cfg_file(tmp_path)), "-o", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"engram-stream: error: {out}: ") and ".tmp-" not in err, err
    assert os.listdir(tmp_path) == ["cfg.json"]  # and the temp file is gone


def _start_init(tmp_path, out):
    """An init subprocess, returned once its temp file has data (it is writing the tables)."""
    p = subprocess.Popen([sys.executable, "-m", "engram_stream.cli", "init", str(_cfg_file(tmp_path, BIG_INIT)),
                          "-o", str(out)], cwd=tempfile.gettempdir(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120

    def writing():
        temps = [tmp_path / f for f in os.listdir(tmp_path) if ".tmp-" in f]
        return any(os.path.getsize(t) > 1 << 20 for t in temps if t.exists())
    while not writing():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.01)
    return p


def test_init_removes_its_temp_file_on_sigterm(tmp_path):
    out = tmp_path / "m.safetensors"
    p = _start_init(tmp_path, out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM and "terminated" in err
    assert sorted(os.listdir(tmp_path)) == ["cfg.json"], os.listdir(tmp_path)


def test_init_removes_stale_temp_files_of_dead_processes(tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    p = _start_init(tmp_path, out)
    p.kill()  # SIGKILL: no cleanup possible, the temp file stays
    p.communicate(timeout=60)
    (stale,) = [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    alive = tmp_path / "m.safetensors.tmp-1"  # pid 1 runs: its temp file is not ours to remove
    alive.write_bytes(b"")
    assert main(["init", str(_cfg_file(tmp_path)), "-o", str(out), "--quiet"]) == 0
    assert "removed" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["cfg.json", "m.safetensors", alive.name]


def test_init_prints_the_size_first_and_progress_only_on_a_terminal(tmp_path):
    cfg, out = _cfg_file(tmp_path), tmp_path / "m.safetensors"
    r = _cli(["init", str(cfg), "-o", str(out)])  # stderr is a pipe: no bar
    assert r.returncode == 0, r.stderr
    config, first = r.stdout.splitlines()[:2]   # the config it derived, then the size it makes
    assert config == f"config (demo-v1, from {cfg}): {json.dumps(SMALL)}"
    assert first.startswith(f"writing {out}: ") and "MiB" in first
    assert "%" not in r.stderr and "\r" not in r.stderr
    r = run_python_on_a_terminal(["-m", "engram_stream.cli", "init", str(cfg), "-o", str(out), "--force"],
                                 timeout=120)
    assert r.returncode == 0, r.stderr[-500:]  # stderr is a terminal: a bar from 0% to 100%
    assert "  0% of" in r.stderr and "100% of" in r.stderr


# ---- argument checking, help, --version, --debug anywhere -------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["demo", "--tokens", "0"], ["demo", "--tokens", "-3"], ["demo", "--seed", "-1"], ["demo", "--tokens", "x"],
    ["bench", "--steps", "0"], ["bench", "--streams", "1"], ["bench", "--repeat", "0"],
    ["profile", "--steps", "0"], ["init", "c.json", "-o", "x", "--seed", "-1"],
])
def test_numbers_are_checked_with_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: engram-stream") and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"engram-stream {argv[0]}: error: argument ")  # one line


def test_compression_given_json_says_what_to_do(tmp_path, capsys):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {}}')
    assert main(["init", str(_cfg_file(tmp_path)), "-o", str(tmp_path / "m"), "--compression", str(tok)]) == 1
    err = capsys.readouterr().err
    assert "build-compression" in err and "pickle" not in err and err.count("\n") == 1


def test_debug_works_after_the_subcommand_too():
    with pytest.raises(FileNotFoundError):
        main(["inspect", "/nonexistent/x.safetensors", "--debug"])


def test_version(capsys):
    import engram_stream
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"engram-stream {engram_stream.__version__}"


def _unsupported_isa():
    from engram_stream.engine.isa import ISA_NAMES, supported_isas
    return next(n for n in ISA_NAMES if n not in supported_isas())  # neon on x86, the x86 paths on aarch64


@pytest.mark.parametrize("bad", ["sse9", "unsupported"])
@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["inspect", "--help"], ["demo", "--tokens", "3"]])
def test_a_bad_engram_stream_isa_is_one_line_and_status_2(argv, bad):
    """`import engram_stream` refuses an ENGRAM_STREAM_ISA this CPU does not run; the command says
    so in one line naming the value, the paths this CPU runs and the fix, for every command."""
    from engram_stream.engine.isa import default_isa, supported_isas
    bad = _unsupported_isa() if bad == "unsupported" else bad
    r = _console_script(argv, env=dict(os.environ, ENGRAM_STREAM_ISA=bad), timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"engram-stream: error: ENGRAM_STREAM_ISA={bad!r}: ") and "Traceback" not in line
    assert line.endswith(f"unset ENGRAM_STREAM_ISA (then {default_isa()} runs, the best here) or set it to one "
                         f"this CPU runs: {', '.join(supported_isas())}"), line


def test_a_bad_engram_stream_isa_with_debug_shows_the_traceback():
    r = _console_script(["--version", "--debug"], env=dict(os.environ, ENGRAM_STREAM_ISA=_unsupported_isa()),
                        timeout=120)
    assert r.returncode == 1 and "Traceback" in r.stderr and "IsaEnvironmentError: ENGRAM_STREAM_ISA=" in r.stderr


def test_every_option_has_help_and_shows_its_default(capsys):
    import argparse
    from engram_stream.cli import build_parser
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        for a in p._actions:
            assert a.help, (name, a.option_strings or a.dest)
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(default: 300)" in capsys.readouterr().out


def test_init_help_documents_the_config_file_and_both_seeds(capsys):
    import dataclasses
    from engram_stream import EngramConfig
    with pytest.raises(SystemExit):
        main(["init", "--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(EngramConfig):
        assert f"\n  {f.name} " in out, f.name
    assert "--weight-seed" in out and "seeds the HASH" in out


def test_build_compression_writes_exactly_the_path_it_reports(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    tok = _tokenizer(tmp_path)
    out = tmp_path / "lookup"  # no .npy suffix: np.save(name) would write lookup.npy
    assert main(["build-compression", str(tok), "-o", str(out)]) == 0
    assert f"wrote {out}:" in capsys.readouterr().out
    assert out.exists() and not (tmp_path / "lookup.npy").exists()
    assert np.load(out).dtype == np.int64
    assert main(["build-compression", str(tok), "-o", str(out)]) == 1  # exists: --force to overwrite


# ---- profile and bench ------------------------------------------------------------------------------------
def test_profile_keeps_its_capture_explains_and_starts_cold(tmp_path):
    memray = pytest.importorskip("memray")
    ckpt, capture = tmp_path / "m.safetensors", tmp_path / "decode.bin"
    assert main(["init", str(_cfg_file(tmp_path)), "-o", str(ckpt), "--quiet"]) == 0
    r = _cli(["profile", str(ckpt), "--steps", "30", "--cold", "-o", str(capture)])
    assert r.returncode == 0, r.stderr
    assert memray.FileReader(str(capture)).metadata.total_allocations >= 0  # a readable capture, kept
    assert "allocated per token" in r.stdout and "cold start" in r.stdout and str(capture) in r.stdout
    assert " resident 0.0 -> " in r.stdout  # evicted before the decode: nothing of the table in RAM


def test_profile_heap_line_says_what_it_counted(tmp_path):
    """The heap line said "peak 0.7 KiB, 1 allocations ... so 0 is the expected result": it
    gives the count memray recorded, per token, the most held at once, and where they were made,
    and claims no expected value."""
    memray = pytest.importorskip("memray")
    capture = tmp_path / "decode.bin"
    r = _cli(["profile", "--steps", "40", "-o", str(capture)])
    assert r.returncode == 0, r.stderr
    meta = memray.FileReader(str(capture)).metadata
    heap = next(ln for ln in r.stdout.splitlines() if ln.startswith("heap: "))
    n = meta.total_allocations
    assert heap.startswith(f"heap: {n} allocation{'s' * (n != 1)} during the decode loop (120 calls: "), heap
    assert f"{n / 40:.3g} a token" in heap and "held at once" in heap
    assert "expected" not in r.stdout
    sites = re.findall(r"^  (\d+) allocations?, .+: (\S+):(\d+) (\w+)$", r.stdout, re.M)
    assert sum(int(c) for c, *_ in sites) <= n and (sites or n == 0), r.stdout
    for _, path, line, func in sites:
        assert os.path.exists(path) and int(line) > 0 and func, (path, line, func)


def test_demo_and_bench_show_progress_on_stderr_name_the_cpu_and_warm_up():
    """`demo --checkpoint` of a V4.1 folder was silent for 15 s and its first figure ran cold:
    each long step says so on stderr as it starts (stdout keeps the results), the CPU model is
    printed beside the kernel path, and untimed tokens run before the timed decode."""
    from engram_stream.cli import WARMUP_TOKENS, _cpu
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.split(":", 1)[0].strip() == "model name"]
    cpu = _cpu()
    if names:
        assert cpu.startswith(names[0] + " ("), cpu
    assert f"{len(os.sched_getaffinity(0))} CPU" in cpu
    r = _cli(["demo", "--tokens", "20"])
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    kernels = next(k for k, ln in enumerate(out) if ln.startswith("kernels: "))
    assert out[kernels + 1] == f"cpu: {cpu}"
    assert not any(ln.endswith("...") for ln in out)               # progress stays off stdout
    steps = [ln for ln in r.stderr.splitlines() if ln.endswith(" ...")]
    assert [s.split()[0].rstrip(":") for s in steps] == ["building", "warming", "decoding", "checking", "checking"], steps
    assert steps[1].startswith(f"warming up: {min(20, WARMUP_TOKENS)} tokens") and WARMUP_TOKENS > 0
    assert _cli(["demo", "--tokens", "20", "--quiet"]).stderr == ""
    r = _cli(["bench", "--steps", "5", "--repeat", "1", "--streams", "2"])
    assert r.returncode == 0, r.stderr
    assert f"cpu: {cpu}" in r.stdout.splitlines()
    steps = [ln.split()[0].rstrip(":") for ln in r.stderr.splitlines() if ln.endswith(" ...")]
    assert steps == ["building", "warming", "measuring"], r.stderr
    assert _cli(["bench", "--steps", "5", "--repeat", "1", "--streams", "2", "--quiet"]).stderr == ""


def test_inspect_names_the_row_file_apart_from_the_checkpoint(tmp_path):
    """inspect counted the packed row file in the checkpoint's size without naming it: the row
    file has a line of its own, with its path, and the checkpoint's size is the rest."""
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    folder = _tiny_v41_folder(tmp_path / "v41")
    rows = packed.rows_path(str(folder))
    r = _cli(["inspect", str(folder)])
    assert r.returncode == 0, r.stderr
    assert f"row file: none ({rows} once engram-stream pack-rows {folder} writes it)" in r.stdout
    before = re.search(r"^checkpoint: .* \(([\d,.]+) MiB\)$", r.stdout, re.M)[1]
    packed.pack_rows(EngramModel.load(str(folder)), rows)
    r = _cli(["inspect", str(folder)])
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^checkpoint: {re.escape(str(folder))} \({re.escape(before)} MiB, without the row file\)$",
                     r.stdout, re.M), r.stdout
    size = os.path.getsize(rows) / 2**20
    assert f"row file: {rows} ({size:,.1f} MiB, " in r.stdout, r.stdout


def _tiny_v41_folder(path, tokenizer=False):
    from engram_stream.v41 import hf
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_v41_checkpoint import TINY
    from engram_stream import EngramConfig
    hf.make_synthetic(str(path), EngramConfig(**TINY), n_shards=3, tokenizer=tokenizer)
    return path


def _read_all(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


def test_evict_drops_every_file_a_v41_model_maps(tmp_path):
    from engram_stream import EngramModel
    from engram_stream.io import memory
    from engram_stream.rows import packed
    folder = _tiny_v41_folder(tmp_path / "v41")
    model = EngramModel.load(str(folder))
    shards = sorted(str(folder / f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert sorted(memory.mapped_files(model)) == shards and len(shards) == 3
    packed.pack_rows(model, packed.rows_path(str(folder)))
    arrays = [a for w in model.layers.values() for a in w.file_arrays() if memory.is_file_backed(a)]
    _read_all(shards + [packed.rows_path(str(folder))])
    for a in arrays:
        memory.touch(a)
    assert sum(memory.resident_bytes(a) for a in arrays) == sum(a.nbytes for a in arrays)
    evicted = memory.evict(model)
    assert sorted(evicted) == sorted(shards + [packed.rows_path(str(folder))])
    assert sum(memory.resident_bytes(a) for a in arrays) == 0  # mincore: no page of any shard cached
    with open(packed.rows_path(str(folder)), "rb") as f:  # the row file too (a fresh mapping's mincore)
        import mmap
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert memory.resident_bytes(np.frombuffer(mm, np.uint8)) == 0
        del mm


def test_profile_cold_evicts_a_v41_folder(tmp_path):
    pytest.importorskip("memray")
    folder = _tiny_v41_folder(tmp_path / "v41")
    _read_all(str(folder / f) for f in os.listdir(folder))  # all of it in the page cache
    r = _cli(["profile", str(folder), "--steps", "5", "--cold"])
    assert r.returncode == 0, r.stderr
    assert "3 files evicted" in r.stdout, r.stdout
    tables = re.findall(r"table [\d.]+ MiB, resident ([\d.]+) -> ", r.stdout)
    assert tables == ["0.0", "0.0"], r.stdout  # before the decode, after the eviction


def test_bench_repeats_and_shows_the_spread(capsys):
    assert main(["bench", "--steps", "20", "--streams", "2", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "median of 3 repeats" in out and out.count(" .. ") == 1 + 3
    from engram_stream import kernel_isa
    assert f"kernels: {kernel_isa()} (" in out


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["Hello hello HELLO café cafe"] * 3, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_mmap_serving_example_reads_a_fraction_of_its_tables_and_cleans_up():
    r = subprocess.run([sys.executable, "mmap_serving.py"], cwd=os.path.join(ROOT, "examples"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"after \d+ tokens: ([\d.]+) MiB of ([\d.]+) MiB of tables resident", r.stdout)
    resident, table = float(m[1]), float(m[2])
    assert table > 64 and 0 < resident < table / 4, m[0]  # a decode touches a small part of the tables
    folder = re.search(r"temp folder (\S+) removed", r.stdout)[1]
    assert not os.path.exists(folder)


# ---- docs ----------------------------------------------------------------------------------------------
def test_public_methods_have_real_docstrings():
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.demo import checkpoint
    for f, words in ((EngramModel.save, ["table_dtype", "atomic"]), (EngramModel.load, ["mmap=True", "default"]),
                     (EngramModel.layer, ["KeyError", "read-only"]), (EngramConfig.to_dict, ["fields"]),
                     (checkpoint.save_init, ["flat memory"])):
        doc = f.__doc__ or ""
        assert all(w in doc for w in words), (f.__qualname__, doc)


def test_readme_shows_the_commands_and_examples():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    from engram_stream.cli import build_parser
    import argparse
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name in sub.choices:
        assert f"engram-stream {name}" in readme, name
    for script in os.listdir(os.path.join(ROOT, "examples")):
        if script != "tiny_lm.py" and script.endswith(".py"):
            assert f"python examples/{script}" in readme, script
    for needle in ("n_streams=", "snapshot()", "restore(", "--force", "config file"):
        assert needle in readme, needle


def test_readme_says_which_defaults_it_means_and_what_the_build_costs():
    """A newcomer read "the demo's defaults" as D=1024 with a 2.6 GB table in one place and
    `engram-stream demo`'s D=256 in another, and was not told the build's time: each claim is held
    to the code it describes."""
    from engram_stream import EngramConfig, HashPlan
    from engram_stream.cli import BUILTIN_CONFIG
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "demo's default" not in readme           # which demo: the two meanings are named apart
    quick = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert re.search(r"about [\d.]+ min on \d cores", quick), quick   # the build's time, where it is paid
    assert len(re.findall(r"pip install", quick)) == 1, quick          # one build, not two
    demo_d = re.search(r"engram-stream demo .*\(D=(\d+)\)", quick)
    assert demo_d and int(demo_d[1]) == BUILTIN_CONFIG["hidden_size"], quick
    # the snippet marked "EngramConfig's defaults" is EngramConfig(); the prose's D and table size too
    call = re.search(r"cfg  = (EngramConfig\([^)]*\))\s*# EngramConfig's defaults", readme)
    assert call and eval(call[1], {"EngramConfig": EngramConfig}) == EngramConfig()
    d, gb = re.search(r"defaults: the demo module's, D=(\d+), ([\d.]+) GB\s+float32 tables a layer", readme).groups()
    cfg = EngramConfig()
    plan = HashPlan(cfg)
    assert int(d) == cfg.hidden_size
    assert all(round(plan.table_rows[L] * cfg.head_dim * 4 / 1e9, 1) == float(gb) for L in cfg.layer_ids)


def test_bench_readme_has_no_machine_specific_paths():
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        text = f.read()
    for path in ("/work/", "/home/", "/root/", "/Users/", "/opt/"):
        assert path not in text, path


def test_bench_readme_says_what_else_ran_in_one_wording():
    """The Zen 4 paragraph said "while other sessions ran" where the rest says "from other jobs":
    what else ran on a machine is "other jobs", next to the load that measures it."""
    with open(os.path.join(ROOT, "bench", "README.md")) as f:
        text = " ".join(f.read().split())
    said = re.findall(r"\bother (\w+)(?: ran)? \(load|load [\d.-]+ from other (\w+)", text)
    assert said and {w for pair in said for w in pair if w} == {"jobs"}, said
    assert not re.search(r"other (sessions|processes|helpers|users) ran", text)
    assert "other jobs (load 3.9" in text


# ---- a deepseek-v4.1 model on the command line ------------------------------------------------------------
V41_SMALL = dict(variant="deepseek-v4.1", engram_vocab_size=[211, 211, 211], max_ngram_size=4, n_embed_per_ngram=64,
                 n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
                 image_token_id=299)


def _v41_cfg_file(tmp_path):
    path = tmp_path / "v41.json"
    path.write_text(json.dumps(V41_SMALL))
    return path


def test_init_v41_writes_a_folder_and_says_so(tmp_path, capsys):
    out = tmp_path / "engram-v41"
    assert main(["init", str(_v41_cfg_file(tmp_path)), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "folder" in printed and "float8" in printed and "float32" not in printed, printed
    assert os.path.isdir(out) and "config.json" in os.listdir(out)
    m = re.search(r"wrote \S+ \(([\d.]+) MiB", printed)
    size = sum(os.path.getsize(out / f) for f in os.listdir(out))
    assert m and abs(float(m[1]) - size / 2 ** 20) < 0.1, printed   # the folder's size, not a dir inode's
    from engram_stream import EngramModel
    assert EngramModel.load(str(out)).cfg.num_embeddings is not None


@pytest.mark.parametrize("argv, needle", [
    (["-o", "{tmp}/x.safetensors"], "folder"),
    (["-o", "{tmp}/x", "--table-dtype", "float16"], "--table-dtype"),
])
def test_init_v41_refuses_what_it_cannot_do(tmp_path, capsys, argv, needle):
    """A V4.1 checkpoint is a folder (not x.safetensors) of float8 tables (no --table-dtype)."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["init", str(_v41_cfg_file(tmp_path))] + argv) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["v41.json"]


def test_init_help_describes_every_field(capsys):
    """The V4.1 fields too (variant, norm_eps, image_token_id, num_embeddings, compressed_vocab_size)."""
    import dataclasses
    from engram_stream import EngramConfig
    with pytest.raises(SystemExit):
        main(["init", "--help"])
    out = capsys.readouterr().out
    from engram_stream import variants
    names = [f.name for f in dataclasses.fields(EngramConfig)]
    names += [f.name for v in variants.variants() if v.config_class for f in dataclasses.fields(v.config_class)
              if f.name not in names]
    assert "image_token_id" in names and "table_parts" in names
    for name in names:
        line = next(ln for ln in out.splitlines() if ln.startswith(f"  {name} "))
        assert len(line.split(None, 2)) == 3 and len(line.split(None, 2)[2]) > 8, line
    assert "deepseek-v4.1" in out


@pytest.mark.parametrize("which", ["config.json", "index", "shard"])
def test_inspect_a_file_of_a_v41_folder_says_pass_the_folder(tmp_path, capsys, which):
    from engram_stream import EngramConfig, EngramModel
    folder = tmp_path / "ckpt"
    EngramModel.init(EngramConfig(**V41_SMALL), seed=0).save(folder)
    name = {"config.json": "config.json", "index": "model.safetensors.index.json",
            "shard": "model-00001-of-00002.safetensors"}[which]
    assert main(["inspect", str(folder / name)]) == 1
    err = capsys.readouterr().err
    assert "pass the folder" in err and str(folder) in err and "absurd" not in err and "dtype" not in err, err


@pytest.mark.parametrize("variant", ["demo", "v41"])
def test_bench_takes_a_checkpoint(tmp_path, capsys, variant):
    from engram_stream import EngramConfig, EngramModel
    if variant == "demo":
        path = tmp_path / "m.safetensors"
        EngramModel.init(EngramConfig(**SMALL), seed=0).save(path)
    else:
        path = tmp_path / "ckpt"
        EngramModel.init(EngramConfig(**V41_SMALL), seed=0).save(path)
    assert main(["bench", "--checkpoint", str(path), "--layer", "4", "--steps", "10", "--streams", "2",
                 "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "layer 4" in out and out.count(" .. ") == 1 + 3, out


def test_a_bad_layer_is_a_clean_message(tmp_path, capsys):
    """The message, not a quoted KeyError repr ("'layer 7 is not ...'")."""
    from engram_stream import EngramConfig, EngramModel
    path = tmp_path / "m.safetensors"
    model = EngramModel.init(EngramConfig(**SMALL), seed=0)
    model.save(path)
    with pytest.raises(KeyError) as e:
        model.stream(7)
    assert str(e.value).startswith("layer 7 is not an Engram layer")
    assert main(["bench", "--checkpoint", str(path), "--layer", "7"]) == 1
    err = capsys.readouterr().err.splitlines()   # the progress lines (loading ...), then the error
    assert [ln for ln in err if ln.startswith("engram-stream: error:")] == err[-1:]
    err = err[-1]
    assert err.startswith("engram-stream: error: layer 7 is not an Engram layer") and "'" not in err.split(":", 2)[2][:3]


# ---- README claims held to the code -------------------------------------------------------------------
def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_imports_exist_under_one_package_name():
    """The README named the row sources both engram_stream.rows and engram_stream.tiers: one name,
    and every `from engram_stream... import ...` it shows imports."""
    import importlib
    readme = _readme()
    assert "engram_stream.tiers" not in readme and "engram_stream.mooncake_servers" not in readme
    for mod, names in re.findall(r"^from (engram_stream[\w.]*) import ([\w, ]+)$", readme, re.M):
        try:
            m = importlib.import_module(mod)
        except ImportError as e:   # an integration whose framework is not installed says which extra
            assert "pip install '.[" in str(e), (mod, e)
            continue
        for name in names.split(","):
            assert hasattr(m, name.strip()), (mod, name)
    for dotted in re.findall(r"`(engram_stream(?:\.\w+)+)`", readme):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break


def test_readme_says_plan_hash_rows_are_head_local():
    from engram_stream import EngramConfig, HashPlan
    readme = _readme()
    line = next(ln for ln in readme.splitlines() if ln.startswith("plan.hash(ids[B, T])"))
    assert "head-local" in line and "plan.offsets[L][h] + r" in line, line
    plan = HashPlan(EngramConfig(**SMALL))
    ids = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (3, 50))
    for L, rows in plan.hash(ids).items():
        primes = np.asarray(plan.head_primes[L])
        assert (rows >= 0).all() and (rows < primes).all()          # within each head's own table
        assert (plan.offsets[L] + rows < plan.table_rows[L]).all()
        assert (rows.max(axis=(0, 1)) >= primes // 2).all() and plan.offsets[L][1] > 0  # not absolute


def test_readme_warns_that_the_transformers_extra_pulls_cuda_torch():
    """The transformers section warns of PyPI's CUDA torch and points to the CPU install above it,
    which installs the torch CI runs (tests/project/test_readme.py holds that line itself)."""
    readme = _readme()
    head, rest = readme.split("## DeepSeek-V4.1 in transformers", 1)
    section = rest.split("```", 1)[0]
    assert "CUDA" in section and "CPU torch first" in section, section
    with open(os.path.join(ROOT, ".ci", "constraints.txt")) as f:
        pin = re.search(r"^torch==([\w.+]+)$", f.read(), re.M)[1]
    assert f"torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in head   # the version CI runs


def test_a_demo_file_given_to_from_deepseek_v41_says_what_it_is(tmp_path):
    from engram_stream import EngramModel
    from engram_stream.errors import CheckpointError
    ckpt = tmp_path / "m.safetensors"
    assert main(["init", str(_cfg_file(tmp_path)), "-o", str(ckpt), "--quiet"]) == 0
    with pytest.raises(CheckpointError, match=r"single-file checkpoint .*EngramModel\.load\("):
        EngramModel.from_deepseek_v41(str(ckpt))
    folder = _tiny_v41_folder(tmp_path / "v41")
    shard = next(folder.glob("*.safetensors"))
    with pytest.raises(CheckpointError, match="pass the folder"):
        EngramModel.from_deepseek_v41(str(shard))
    with pytest.raises(CheckpointError, match="no config.json: not a deepseek-v4.1 folder"):
        EngramModel.from_deepseek_v41(str(tmp_path))


def test_readme_says_how_models_share_a_mooncake_store():
    import inspect
    from engram_stream.rows import MooncakeTier, store_key
    readme = " ".join(_readme().split())
    assert "`engram:{name}:l{L}:h{h}`" in readme and "models and revisions share one store" in readme
    assert inspect.signature(MooncakeTier).parameters["name"].default is None   # "defaults to the fingerprint"
    assert store_key(14, 3, "m0") == "engram:m0:l14:h3" and store_key(14, 3, "") == "engram:l14:h3"
    assert "--name" in _cli(["publish", "--help"]).stdout


def test_long_commands_share_one_progress_bar_and_say_how_long_they_take(monkeypatch):
    """bench --checkpoint took 5 min at Flash dims under a help that said "quick"; make_v41_checkpoint,
    bench and publish printed nothing meanwhile: one bar (stderr, a terminal only, not --quiet)."""
    from engram_stream import cli
    helps = {name: _cli([name, "--help"]).stdout for name in ("bench", "publish", "init", "pack-rows")}
    assert "quick" not in helps["bench"] and "minutes at Flash dims" in " ".join(helps["bench"].split())
    assert all("--quiet" in h for h in helps.values())
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.progress_bar() is not None and cli.progress_bar(quiet=True) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert cli.progress_bar() is None
    with open(os.path.join(ROOT, "tools", "make_v41_checkpoint.py")) as f:
        assert "progress_bar(" in f.read()   # the tool's bar is the commands' own


def test_bench_shows_its_progress_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["bench", "--steps", "5", "--streams", "2", "--repeat", "2"]) == 0
    err = capsys.readouterr().err
    assert "100% of 6 measurements" in err, err


def test_readme_reads_in_five_minutes():
    """At most 1,500 words (about five minutes); the detail is DESIGN.md's (section 14)."""
    words = len(_readme().split())
    assert words <= 1500, words


# ---- what a config file says, and a config file given where a checkpoint or a tokenizer belongs ----------
QWEN_HF = {"model_type": "qwen4_exp_text", "ple_layer_ids": [3], "eos_token_id": 1, "vocab_size": 300,
           "hidden_size": 64, "heads_per_ngram": 2, "ngram_vocab_base": 1000}   # ngram_vocab_size_base misspelled


def test_init_names_a_misspelled_key_and_prints_the_config_it_derived(tmp_path, capsys, monkeypatch):
    """ngram_vocab_base for ngram_vocab_size_base: the 20,000,000 default made tables of GiBs, and
    neither the key nor the sizes it came from were said."""
    import engram_stream.cli as cli
    usage = shutil.disk_usage
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage(p)._replace(free=100_000))
    cfg, out = _cfg_file(tmp_path, QWEN_HF, "config.json"), tmp_path / "qwen"
    assert main(["init", str(cfg), "-o", str(out)]) == 1
    got = capsys.readouterr()
    assert got.err.splitlines()[0] == (
        f"engram-stream: warning: {cfg}: key 'ngram_vocab_base' is not read by qwen3.8-flash-next: did you mean "
        f"'ngram_vocab_size_base'? ('ngram_vocab_size_base' is absent: its default 20000000 is used)")
    assert "GiB, only" in got.err.splitlines()[1]
    line = got.out.splitlines()[0]
    assert line.startswith(f"config (qwen3.8-flash-next, from {cfg}): {{")
    derived = json.loads(line.split(": ", 1)[1])
    assert derived["engram_vocab_size"] == [20_000_000, 20_000_000] and derived["layer_ids"] == [3]
    assert not out.exists()


def test_init_quiet_prints_no_config_but_still_warns(tmp_path, capsys):
    cfg = _cfg_file(tmp_path, dict(QWEN_HF, ngram_vocab_base=None, ngram_vocab_size_base=50, split_ngram_part=2,
                                   split_ngram_parts=2))
    assert main(["init", str(cfg), "-o", str(tmp_path / "q"), "--quiet"]) == 0
    got = capsys.readouterr()
    assert got.out.startswith("wrote ") and "config (" not in got.out
    assert "key 'split_ngram_part' is not read by qwen3.8-flash-next: did you mean 'split_ngram_parts'?" in got.err


def test_one_layer_is_one_layer(tmp_path, capsys):
    assert main(["init", str(_cfg_file(tmp_path, dict(SMALL, layer_ids=[1]))), "-o", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "(1 layer, " in out and "1 layers" not in out


@pytest.mark.parametrize("what", ["engram fields", "qwen config.json", "v41 config.json"])
def test_inspect_a_config_says_it_is_no_checkpoint(tmp_path, capsys, what):
    """A config file is neither a corrupted checkpoint nor a file of a checkpoint folder (its
    folder holds no weights): inspect says what it is and how to make a checkpoint of it."""
    from engram_stream import EngramConfig, EngramModel
    d = {"engram fields": SMALL, "qwen config.json": QWEN_HF,
         "v41 config.json": EngramConfig(**V41_SMALL).to_hf_config()}[what]
    cfg = _cfg_file(tmp_path, d, "config.json" if "config.json" in what else "cfg.json")
    assert main(["inspect", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert err == (f"engram-stream: error: {cfg}: a config (JSON), not a checkpoint (a checkpoint file written by "
                   f"init or save(), or a model's folder holding config.json and its safetensors): write a "
                   f"checkpoint from it first: engram-stream init {cfg} -o CHECKPOINT\n")
    if what != "engram fields":   # the API: no "pass the folder" for a folder without weights
        with pytest.raises(ValueError) as e:
            EngramModel.load(str(cfg))
        assert "pass the folder" not in str(e.value), e.value


def test_inspect_another_json_file_says_it_is_no_checkpoint(tmp_path, capsys):
    path = _cfg_file(tmp_path, {"hello": 1}, "other.json")
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"engram-stream: error: {path}: a JSON file, not a checkpoint (") and "engram-stream init" not in err


def test_a_broken_config_json_in_a_folder_gives_its_line(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{\n  "engram_n_heads": 2,\n  "engram_layer_ids": [1,\n}\n')
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert f"{folder / 'config.json'}: not JSON (Expecting value: line 4 column 1" in err, err


def test_build_compression_given_a_config_says_it_wants_a_tokenizer_json(tmp_path, capsys):
    cfg = _cfg_file(tmp_path)
    assert main(["build-compression", str(cfg), "-o", str(tmp_path / "l.npy")]) == 1
    err = capsys.readouterr().err
    assert err == (f"engram-stream: error: {str(cfg)!r} is not a valid tokenizer.json: valid JSON without \"model\" "
                   f"and \"added_tokens\" (a config file?): pass the model's tokenizer.json, which holds its vocab\n")
    (tmp_path / "bad.json").write_text('{"model": {"vocab": }')
    assert main(["build-compression", str(tmp_path / "bad.json"), "-o", str(tmp_path / "l.npy")]) == 1
    assert "not valid JSON (Expecting value: line 1 column 21" in capsys.readouterr().err
