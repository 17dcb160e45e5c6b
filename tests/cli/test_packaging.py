"""Packaging: the sdist can test itself, plain pytest works without pytest-memray, typing stubs."""
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import pytest

from helpers.repo import ROOT

# Folders the sdist must carry whole (so an unpacked sdist builds, tests and benchmarks itself).
CARRIED = ("include", "tests", "tools", "examples", "bench", ".ci")
SKIP = shutil.ignore_patterns(".git", ".ci-venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                              ".pytest_cache", "*.so", "*.bin", "out")


def _source_files():
    for folder in CARRIED:
        for d, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "out", ".hypothesis")]
            for f in files:
                if not f.endswith((".pyc", ".bin")):
                    yield os.path.relpath(os.path.join(d, f), ROOT)


def test_sdist_carries_tests_data_tools_and_no_build_products(tmp_path):
    pytest.importorskip("Cython")  # setup.py needs it (the test extra installs it, with setuptools>=77)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (archive,) = os.listdir(tmp_path / "dist")
    with tarfile.open(tmp_path / "dist" / archive) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    need = {"LICENSE", "MANIFEST.in", "README.md", "pyproject.toml", "setup.py", "_engram_stream_launcher.py",
            "engram_stream/py.typed",
            "engram_stream/demo/_engine.pyi", "engram_stream/_hash.pyi", "engram_stream/v41/_engine.pyi",
            "engram_stream/rows/_cache.pyi", "engram_stream/rows/_direct.pyi", *_source_files()}
    assert not need - names, sorted(need - names)
    built = sorted(n for n in names if n.endswith((".so", ".c", ".pyc")))
    assert not built, built


def test_a_variant_folder_ships_in_the_wheel_with_no_edit_of_the_build_files(tmp_path):
    """The wheel's packages are found, not listed: a variant folder added to a copy of the
    checkout (an __init__.py, its variant.py, a compiled engine's .pyx, .pxd and stub) lands
    in what the wheel holds (build_py: the packages and their package data) beside every
    existing package's sources and stubs and the C headers, with pyproject.toml and setup.py
    unchanged."""
    pytest.importorskip("Cython")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    extra = src / "engram_stream" / "extra_v"
    extra.mkdir()
    files = {"__init__.py": "", "variant.py": "", "_engine.pyx": "def answer():\n    return 42\n",
             "_engine.pxd": "", "_engine.pyi": "def answer() -> int: ...\n"}
    for name, text in files.items():
        (extra / name).write_text(text)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "lib")], cwd=src,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    lib = tmp_path / "lib"
    shipped = {os.path.relpath(os.path.join(d, f), lib) for d, _, fs in os.walk(lib) for f in fs}
    assert {f"engram_stream/extra_v/{name}" for name in files} <= shipped, sorted(shipped)
    package_dirs = {os.path.relpath(d, src) for d, _, fs in os.walk(src / "engram_stream") if "__init__.py" in fs}
    sources = {os.path.join(d, f) for d in package_dirs for f in os.listdir(src / d)
               if f.endswith((".py", ".pyx", ".pxd", ".pyi")) or f == "py.typed"}
    headers = {f"engram_stream/include/{f}" for f in os.listdir(src / "include") if f.endswith(".h")}
    assert headers and "engram_stream/qwen/_engine.pyi" in sources
    assert not (sources | headers) - shipped, sorted((sources | headers) - shipped)


def test_license_file_is_mit():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert f.readline().strip() == "MIT License"


def test_plain_pytest_runs_without_pytest_memray():
    """`pytest` must work where pytest-memray is missing: no --memray in the default options,
    and the limit_memory marker is registered by the project itself (no unknown-mark warning)."""
    # Run from outside the checkout (`python -m` would put an unbuilt source tree first on sys.path).
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:memray", "-p", "no:cacheprovider",
                        "-c", os.path.join(ROOT, "pyproject.toml"), "--rootdir", ROOT,
                        "-W", "error::pytest.PytestUnknownMarkWarning", "--collect-only", "-q",
                        os.path.join(ROOT, "tests", "demo", "test_engine.py")], cwd=tempfile.gettempdir(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_torch_pin_lives_in_the_constraints_file():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["optional-dependencies"]["torch"] == ["torch"]
    with open(os.path.join(ROOT, ".ci", "constraints.txt")) as f:
        assert any(line.startswith("torch==") for line in f)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "-c .ci/constraints.txt" in f.read()


def _stub_names(module_name):
    """{class or "": names declared} from the module's .pyi, found beside the imported module."""
    import ast
    import importlib
    mod = importlib.import_module(module_name)
    stub = os.path.join(os.path.dirname(mod.__file__), module_name.rsplit(".", 1)[1] + ".pyi")
    with open(stub) as f:
        tree = ast.parse(f.read())

    def names(body, attributes=True):
        out = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if attributes:
            out |= {n.target.id for n in body if isinstance(n, ast.AnnAssign)}
        return {n for n in out if not n.startswith("_")}
    classes = [c for c in tree.body if isinstance(c, ast.ClassDef)]
    return mod, names(tree.body), {c.name: (names(c.body), names(c.body, False)) for c in classes}


@pytest.mark.parametrize("module_name", ["engram_stream.engine._base", "engram_stream.engine._window",
                                         "engram_stream.engine._batch", "engram_stream.demo._engine",
                                         "engram_stream._hash", "engram_stream.v41._engine",
                                         "engram_stream.qwen._engine", "engram_stream.longcat._engine",
                                         "engram_stream.rows._cache",
                                         "engram_stream.rows._source", "engram_stream.rows._stamps",
                                         "engram_stream.rows._direct", "engram_stream.integrations._records"])
def test_stubs_declare_every_public_name(module_name):
    """The .pyi (shipped with py.typed) must list exactly the compiled module's public names,
    and those of its classes: a method added to the .pyx without its stub fails here."""
    import importlib
    import inspect
    import types
    mod, stub, stub_classes = _stub_names(module_name)
    public = {n for n, v in vars(mod).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
              and (isinstance(v, (int, float, str)) or getattr(v, "__module__", None) == module_name)}
    assert public == stub, (sorted(public - stub), sorted(stub - public))
    for cls in (n for n in public if inspect.isclass(getattr(mod, n))):
        runtime = {n for n in vars(getattr(mod, cls)) if not n.startswith("_")}  # its own (a base: its stub)
        declared, methods = stub_classes[cls]  # instance attributes are not in dir(class)
        assert runtime <= declared and methods <= runtime, (cls, sorted(runtime - declared), sorted(methods - runtime))
    assert os.path.exists(os.path.join(os.path.dirname(importlib.import_module("engram_stream").__file__), "py.typed"))
