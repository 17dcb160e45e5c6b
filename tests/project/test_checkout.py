"""Which engram_stream the tests and scripts import (tools/checkout.py): a checkout's complete
in-place build, else the installed package, never the unbuilt source tree. A new user's
`pip install . && python -m pytest` from the repository root failed with `No module named
engram_stream._hash` (the unbuilt tree first on sys.path), and so did bench/bench_v41.py."""
import os
import shutil
import subprocess
import sys

import pytest

import engram_stream
from helpers.repo import ROOT, checkout

# the package under test, as "installed" for a copy of the checkout that has no build
PACKAGE_DIR = os.path.dirname(os.path.dirname(engram_stream.__file__))
SKIP = shutil.ignore_patterns(".git", ".ci-venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                              ".pytest_cache", "*.so", "*.c", "*.bin", "out", "data")

PROBE = '''
import os
import engram_stream


def test_probe():
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert not engram_stream.__file__.startswith(here + os.sep), engram_stream.__file__
    assert engram_stream.EngramConfig().hidden_size == 1024
'''


@pytest.fixture(scope="module")
def unbuilt(tmp_path_factory):
    """A copy of this checkout without any build product (a fresh clone after `pip install .`)."""
    dst = tmp_path_factory.mktemp("clone") / "engram_stream-src"
    shutil.copytree(ROOT, dst, ignore=SKIP)
    (dst / "tests" / "project" / "test_probe.py").write_text(PROBE)
    return dst


def _env():
    """PYTHONPATH: the tested package only (the installed one, as a fresh clone's user has)."""
    return {**os.environ, "PYTHONPATH": PACKAGE_DIR}


def test_python_m_pytest_from_the_root_of_an_unbuilt_checkout(unbuilt):
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/project/test_probe.py"],
                       cwd=unbuilt, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"engram_stream: {PACKAGE_DIR}" in r.stdout   # the report header names the package used


@pytest.mark.parametrize("script", ["bench/bench_v41.py", "bench/bench_qwen.py", "bench/bench_longcat.py",
                                    "bench/bench_gguf.py", "bench/bench_goals.py",
                                    "bench/bench_step.py",
                                    "bench/bench_transformers.py", "bench/bench_serving.py", "bench/bench_cpu_time.py",
                                    "tools/make_v41_checkpoint.py"])
def test_scripts_of_an_unbuilt_checkout_use_the_installed_package(unbuilt, script):
    r = subprocess.run([sys.executable, script, "--help"], cwd=unbuilt, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _fake_checkout(tmp_path, built):
    import importlib.machinery
    for rel in ("engram_stream/_hash.pyx", "engram_stream/rows/_cache.pyx"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
        if built:
            (tmp_path / rel.replace(".pyx", importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    return str(tmp_path)


def test_a_complete_in_place_build_comes_first(tmp_path, monkeypatch):
    root = _fake_checkout(tmp_path, built=True)
    monkeypatch.setattr(sys, "path", ["/somewhere", root, ""])
    env = {"PYTHONPATH": f"/x{os.pathsep}{root}"}
    assert checkout.use(root, env).endswith("(in-place build)")
    assert sys.path == [root, "/somewhere", ""] and env["PYTHONPATH"] == f"{root}{os.pathsep}/x"


def test_an_unbuilt_checkout_is_taken_off_the_path(tmp_path, monkeypatch):
    root = _fake_checkout(tmp_path, built=False)
    assert checkout.missing_builds(root) == ["engram_stream/_hash.pyx", "engram_stream/rows/_cache.pyx"]
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", ["", root] + [p for p in sys.path if p not in ("", root)])
    env = {"PYTHONPATH": root}
    assert "(installed" in checkout.use(root, env)
    assert "" not in sys.path and root not in sys.path and env["PYTHONPATH"] == ""


def test_neither_built_nor_installed_says_what_to_do(tmp_path, monkeypatch):
    import importlib.util
    root = _fake_checkout(tmp_path, built=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install '.\\[test\\]'.*build_ext --inplace"):
        checkout.use(root, None)
