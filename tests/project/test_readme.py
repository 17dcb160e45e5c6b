"""The README's install and V4.1 commands, held to what they install and run: the V4.1 commands
are run as written (in a temporary folder), the install lines are checked against
pyproject.toml's extras, .ci/constraints.txt and tools/ci_vllm.sh, which CI runs."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib

import numpy as np
import pytest

from helpers.repo import ROOT


def _read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def _section(title):
    readme = _read("README.md")
    assert f"\n## {title}\n" in readme, title
    return readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _bash_lines(text):
    """The command lines of a section's ```bash blocks, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(words)
    return lines


def _extras():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _console_script():
    """engram-stream as pip writes it: pyproject.toml's entry point, called."""
    module, func = re.search(r'^engram-stream = "([\w.]+):(\w+)"', _read("pyproject.toml"), re.M).groups()
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


# ---- everything on a CPU machine, one build ----------------------------------------------------------------
def test_the_cpu_install_names_every_extra_in_one_build_after_cpu_torch():
    """A newcomer rebuilt the checkout for each extra and pulled torch's CUDA build: the README
    gives one line that names every extra, after torch's CPU build at the version CI pins, with
    what the build and the tests cost."""
    head = _read("README.md").split("\n## ", 1)[0]   # the quick start, before the first section
    lines = _bash_lines(head)
    every = [w for w in lines if w[:2] == ["pip", "install"] and len(w) == 3 and w[2].startswith(".[")
             and "," in w[2]]
    assert len(every) == 1, lines
    named = set(every[0][2][2:-1].split(","))
    assert named == set(_extras()), (named, set(_extras()))
    torch = [w for w in lines if w[:2] == ["pip", "install"] and w[2].startswith("torch==")]
    assert len(torch) == 1 and lines.index(torch[0]) < lines.index(every[0]), lines
    pin = re.search(r"^torch==([\w.]+)$", _read(".ci", "constraints.txt"), re.M)[1]
    assert torch[0][2] == f"torch=={pin}" and torch[0][3:] == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    build = next(ln for ln in head.splitlines() if every[0][2] in ln)
    assert re.search(r"one build: [\d.]+-[\d.]+ min on \d cores", build), build
    tests = next(ln for ln in head.splitlines() if ln.startswith("python -m pytest"))
    assert re.search(r"about [\d.]+ min on \d cores", tests), tests


def test_no_install_hint_names_the_package_on_an_index():
    """engram_stream installs from its checkout (pip install '.[extra]'), not an index: no hint
    in the package, the README, DESIGN.md or the tools says `pip install engram_stream...`."""
    bad = re.compile(r"pip install '?engram[_-]stream")
    found = []
    for top in ("engram_stream", "tools", "bench", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".pyx", ".pyi", ".sh", ".md")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        for k, line in enumerate(f, 1):
                            if bad.search(line):
                                found.append(f"{os.path.relpath(path, ROOT)}:{k}: {line.strip()}")
    for doc in ("README.md", "DESIGN.md"):
        found += [f"{doc}: {ln.strip()}" for ln in _read(doc).splitlines() if bad.search(ln)]
    assert not found, found


def test_the_mooncake_hint_is_the_checkout_form():
    import mooncake_servers
    with pytest.raises(FileNotFoundError, match=re.escape("pip install '.[mooncake]'")):
        mooncake_servers._binary("no-such-mooncake-binary-here")
    src = _read("engram_stream", "rows", "mooncake", "tier.py")
    assert "pip install '.[mooncake]' from the engram_stream checkout" in src


# ---- DeepSeek-V4.1: the commands, run -------------------------------------------------------------------------
def _home(words, home):
    """The words as the shell gives them: a leading ~/ is the home folder."""
    return [os.path.join(home, w[2:]) if w.startswith("~/") else w for w in words]


@pytest.mark.slow
def test_readme_v41_commands_run_as_written(tmp_path):
    """`python tools/make_v41_checkpoint.py DIR --tokenizer` failed (the flag takes a path): every
    command of the README's V4.1 section runs, as written, from the checkout's root (here an empty
    stand-in), and writes nothing there: its 1.1 GB went into the checkout, untracked and not ignored."""
    pytest.importorskip("tokenizers")
    lines = _bash_lines(_section("DeepSeek-V4.1"))
    assert lines and lines[0][:2] == ["python", "tools/make_v41_checkpoint.py"], lines
    assert any(w[:2] == ["engram-stream", "init"] for w in lines), lines
    checkout, home = tmp_path / "checkout", tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(tmp_path / "cache"))   # the compression cache: cold
    for words in lines:
        if words[0] == "python":
            argv = [sys.executable, os.path.join(ROOT, words[1]), *_home(words[2:], home)]
        else:
            assert words[0] == "engram-stream", words
            argv = [*_console_script(), *_home(words[1:], home)]
        r = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (words, r.stderr[-2000:])
        if words[1] == "demo":
            assert ": OK" in r.stdout, r.stdout
    assert os.listdir(checkout) == []   # nothing written into the checkout
    from engram_stream import EngramModel
    made = [w[w.index("-o") + 1] for w in lines if "-o" in w and w[1] == "init"]
    for folder in _home([lines[0][2], *made], home):
        model = EngramModel.from_deepseek_v41(folder)
        assert model.cfg.hidden_size == 5120 and model.cfg.hc_mult == 4   # Flash dims, as the README says
        del model
        shutil.rmtree(folder)   # about 0.5 GB each: not left in pytest's kept temp folders


def test_readme_v41_commands_write_outside_the_checkout():
    """Every path the V4.1 commands write (the tool's folder, each -o) is outside the folder they
    run from, the checkout's root: in the home folder, or absolute."""
    lines = _bash_lines(_section("DeepSeek-V4.1"))
    written = [lines[0][2]] + [w[w.index("-o") + 1] for w in lines if "-o" in w]
    assert len(written) >= 3, lines
    assert all(w.startswith(("~/", "/")) for w in written), written


def test_readme_qwen_snippet_runs(tmp_path):
    """The README's Qwen section had no Python example and never said what PLE stands for: its
    snippet runs on a folder that `init` writes, and PLE is spelled out."""
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.qwen.config import EXAMPLE
    section = _section("Qwen3.8-Flash-Next")
    assert "PLE (Per-Layer Embedding" in section
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "EngramModel.load(" in block
    EngramModel.init(EngramConfig(**EXAMPLE), seed=0).save(tmp_path)
    scope = {}
    exec("import numpy as np\nfrom engram_stream import EngramModel\n"
         + block.replace('"Qwen3.8-Flash-Next"', repr(str(tmp_path))), scope)
    assert scope["model"].cfg.variant == "qwen3.8-flash-next"
    assert scope["delta"].shape == (EXAMPLE["hc_mult"], EXAMPLE["hidden_size"]) and np.abs(scope["delta"]).max() > 0


def test_readme_says_what_its_letters_and_words_are_before_using_them():
    """The README used G, D, "floor", DEAD and `wkv` before saying what they are, and its first
    block did not say that pytest takes minutes."""
    readme = _read("README.md")
    flat = " ".join(readme.split())
    defined = {"G": "`[G, D]` (G hyper-connection streams of width D)",
               "D": "`[G, D]` (G hyper-connection streams of width D)",
               "floor": "floor (one pass over its weights)", "DEAD": "DEAD: gate 0",
               "wkv": "key/value projection `wkv`"}
    uses = {"G": r"\bG\b", "D": r"\bD\b", "floor": r"\bfloor\b", "DEAD": r"\bDEAD\b", "wkv": r"\bwkv\b"}
    for term, definition in defined.items():
        at = flat.find(definition)
        assert at >= 0, (term, definition)
        first = re.search(uses[term], flat).start()
        assert first >= at, (term, flat[first - 60:first + 60])
    head = readme.split("\n## ", 1)[0]
    quick = re.search(r"```bash\n(.*?)```", head, re.S)[1]
    test_line = next(ln for ln in quick.splitlines() if ln.startswith("pytest"))
    assert re.search(r"minutes", test_line.split("#", 1)[1]), test_line


def test_make_v41_checkpoint_help_matches_the_readme_flags():
    """The flags the README's V4.1 commands pass are the tool's and the command's own."""
    lines = _bash_lines(_section("DeepSeek-V4.1"))
    assert len(lines) >= 2, lines
    for words in lines:
        if words[0] == "python":
            argv = [sys.executable, os.path.join(ROOT, words[1]), "--help"]
        else:
            argv = [*_console_script(), words[1], "--help"]
        # from outside the checkout, as a user runs them: the installed package, not the source tree
        r = subprocess.run(argv, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        for w in words:
            if w.startswith("-"):
                assert re.search(rf"(^|[\s,\[]){re.escape(w)}([\s,\]=]|$)", r.stdout, re.M), (w, words)


# ---- vLLM: the README's commands against what CI runs --------------------------------------------------------
def _vllm_pin(text):
    pins = set(re.findall(r"vllm==([\d.]+)", text))
    assert len(pins) == 1, pins
    return pins.pop()


def test_readme_vllm_install_is_the_checkout_and_ci_s_vllm():
    """`pip install engram_stream vllm==0.33.0` failed (the package is not on an index): the
    README installs the checkout beside the vLLM that tools/ci_vllm.sh (CI) tests, and the
    plugin's own docstring says the same."""
    section = _section("Serving V4.1 with vLLM")
    installs = [w for w in _bash_lines(section) if w[:2] == ["pip", "install"]]
    assert len(installs) == 1, installs
    args = installs[0][2:]
    assert "." in args or any(re.fullmatch(r"\.\[[\w,]+\]", a) for a in args), args   # the checkout
    for a in args:
        m = re.fullmatch(r"\.\[([\w,]+)\]", a)
        if m:
            assert set(m[1].split(",")) <= set(_extras()), a
    script = _read("tools", "ci_vllm.sh")
    assert f"vllm=={_vllm_pin(script)}" in args, (args, _vllm_pin(script))
    assert "setup.py -q build_ext --inplace" in script   # CI tests the checkout itself, built in place
    assert f"vLLM {_vllm_pin(script)}" in section
    import engram_stream.integrations.vllm as plugin
    doc_install = next(ln.split("#")[0].split() for ln in plugin.__doc__.splitlines() if "pip install" in ln)
    assert doc_install == installs[0], (doc_install, installs[0])
    # the plugin's entry point, as the README names it
    assert 'engram_stream = "engram_stream.integrations.vllm:register"' in _read("pyproject.toml")
    assert "vllm.general_plugins: engram_stream" in section


def test_readme_vllm_says_what_it_needs_and_what_has_run():
    section = _section("Serving V4.1 with vLLM")
    flat = " ".join(section.split())
    assert "cpu_offload" in flat and "CUDA" in flat                 # what the plugin requires
    assert "nothing has run on a gpu yet" in flat.lower() and "tools/ci_vllm.sh" in flat
    assert "Triton's interpreter" in flat
    src = _read("engram_stream", "integrations", "vllm.py")
    assert "cpu_offload=true" in src   # the refusal the README describes is the plugin's


def test_readme_vllm_settings_parse():
    """The JSON the README passes (the environment variable and --additional-config) is what
    the plugin accepts."""
    from engram_stream.integrations import serving, vllm as plugin
    section = _section("Serving V4.1 with vLLM")
    env = re.search(r"ENGRAM_STREAM_VLLM='(\{.*?\})'", section)[1]
    assert serving.parse_settings(env, "README")["tables"] == "direct"
    extra = json.loads(re.search(r"--additional-config '(\{.*\})'", section)[1])
    assert serving.parse_settings(extra[plugin.KEY], "README")["row_cache_mb"] == 4096


# ---- row_cache_stats: its units -----------------------------------------------------------------------------
def test_readme_gives_row_cache_stats_units_and_where_each_field_is():
    """The README listed "hits, misses, reads, bytes, read waits" with no unit: it names the units
    the fields come in, each the unit of some field, and points to the docstring that gives
    every field its own."""
    from engram_stream import EngramModel
    from engram_stream.rows.tiers import STATS_FIELDS
    line = next(ln for ln in _read("README.md").splitlines() if ln.startswith("model.row_cache_stats()"))
    comment = line.split("#", 1)[1]
    named = re.findall(r"\b(counts|bytes|seconds)\b", comment)
    used = {m.split(":")[0].split("(")[0].split(",")[-1].strip() for f, m in STATS_FIELDS.items() if f != "layers"}
    assert {n.rstrip("s") if n == "counts" else n for n in named} == used, (named, used)
    assert "help()" in comment and "per layer" in comment
    doc = EngramModel.row_cache_stats.__doc__
    for field in STATS_FIELDS:
        assert field in doc, field
