"""The package's shape: imports go one way (no circle), every module imports on its own, and
the map of where things are (DESIGN.md 12) names every module and only files that exist."""
import ast
import os
import re
import subprocess
import sys

import pytest

from helpers.repo import ROOT

PKG = os.path.join(ROOT, "engram_stream")
FROM = re.compile(r"^\s*from\s+([.\w]+)\s+c?import\s+(.+)$")
IMPORT = re.compile(r"^\s*c?import\s+([.\w]+)")


def _modules():
    """{dotted name: path} of every .py and .pyx module of the package."""
    out = {}
    for d, dirs, files in os.walk(PKG):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "include")]
        for f in files:
            if f.endswith((".py", ".pyx")):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-len(os.path.splitext(f)[1])]
                name = rel.replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = os.path.join(d, f)
    return out


def _resolve(module, target, is_pkg):
    """The absolute dotted name of `target` (maybe relative) imported from `module`."""
    if not target.startswith("."):
        return target
    dots = len(target) - len(target.lstrip("."))
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (dots - 1)]
    rest = target[dots:]
    return ".".join(base + ([rest] if rest else []))


def _imports(path):
    """(module, names) of every import statement of a file: through ast for .py (docstrings and
    comments are not statements), by lines for .pyx (cimports too)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".py"):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                yield "." * node.level + (node.module or ""), [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    yield a.name, []
        return
    for line in text.splitlines():
        m = FROM.match(line)
        if m:
            yield m.group(1), [n.strip().split(" as ")[0].strip("() ") for n in m.group(2).split(",")]
        elif IMPORT.match(line):
            yield IMPORT.match(line).group(1), []


def _edges():
    """{module: set of package modules it imports}, at any depth of the file (function-level
    imports count: a circle through a lazy import is still a circle)."""
    mods = _modules()
    edges = {}
    for name, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        deps = set()
        pxd = path[:-len(".pyx")] + ".pxd" if path.endswith(".pyx") else None
        declared = _imports(pxd) if pxd and os.path.exists(pxd) else ()  # a .pyx's .pxd is part of it
        for target, names in list(_imports(path)) + list(declared):
            base = _resolve(name, target, is_pkg)
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods]
            deps.update(subs if len(subs) == len(names) and names else subs + [base])
        edges[name] = {d for d in deps if d in mods and d != name}
    return edges


def test_no_import_circle():
    """Every module imports in one direction. The top package's __init__ (which imports the
    public names and the old import paths) is imported by nothing inside but the command line."""
    edges = _edges()
    for name, deps in edges.items():
        assert "engram_stream" not in deps or name in ("engram_stream", "engram_stream.cli"), \
            f"{name} imports the top package"
    edges.pop("engram_stream")
    edges.pop("engram_stream.cli")  # the program on top: nothing imports it
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(edges.get(n, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = 2
    for n in sorted(edges):
        if n not in state:
            visit(n)


def test_the_static_check_sees_a_circle(tmp_path):
    """Sensitivity: the resolver finds relative imports (a circle would not be missed)."""
    edges = _edges()
    assert "engram_stream.plan" in edges["engram_stream.model"]
    assert "engram_stream.engine.args" in edges["engram_stream.engine._base"]
    assert "engram_stream.engine._base" in edges["engram_stream.demo._engine"]  # a cimport
    assert "engram_stream.rows._cache" in edges["engram_stream.rows.tiers"]


# Modules that import a framework of an optional extra: {module: (packages it needs, the extra)}.
NEEDS_EXTRA = {"engram_stream.integrations.transformers": (("torch", "transformers"), "transformers"),
               "engram_stream.integrations.transformers_qwen": (("torch", "transformers"), "transformers")}


def _absent(packages):
    import importlib.util
    return [p for p in packages if importlib.util.find_spec(p) is None]


# Imports each module named on the command line first, in a child forked from an interpreter that
# has imported only the core dependencies (numpy, ml_dtypes: ~1 s of ufunc registration a process
# with ml_dtypes 0.7): the package's own modules are fresh in every child, so a circle among them
# still fails. Prints one JSON line per module: [name, exit status, the error's last line].
_FORK_IMPORTS = r"""
import importlib, json, os, sys, traceback
import numpy, ml_dtypes
running = {}

def reap():
    pid, status = os.wait()
    name, r = running.pop(pid)
    with os.fdopen(r) as f:
        err = f.read().strip()
    print(json.dumps([name, os.waitstatus_to_exitcode(status), err]), flush=True)

for name in sys.argv[2:]:
    while len(running) >= int(sys.argv[1]):
        reap()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            os._exit(0)
        except BaseException as e:
            os.write(w, traceback.format_exception_only(type(e), e)[-1].encode())
            os._exit(1)
    os.close(w)
    running[pid] = (name, r)
while running:
    reap()
"""


def test_every_module_imports_alone():
    """Each module imported first (a child forked after numpy and ml_dtypes only): an
    order-dependent circle fails here. A module of an optional extra whose framework is absent
    fails with an ImportError that says which extra to install (as after `pip install '.[test]'`
    alone)."""
    import json
    r = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, str(os.cpu_count() or 1), *sorted(_modules())],
                       cwd="/", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted(n for n, _, _ in results) == sorted(_modules()), r.stdout
    bad = {}
    for name, rc, err in results:
        packages, extra = NEEDS_EXTRA.get(name, ((), None))
        if _absent(packages):
            if not (rc != 0 and err.startswith("ImportError") and f"'.[{extra}]'" in err):
                bad[name] = f"without {_absent(packages)}: {err or 'imported'}"
        elif rc != 0:
            bad[name] = err
    assert not bad, bad


def _layout_map():
    """The map of where things are: DESIGN.md's Layout section."""
    with open(os.path.join(ROOT, "DESIGN.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## 12. Layout", 1)[1].split("\n## ", 1)[0]
    return section, set(re.findall(r"`([\w./-]+\.(?:py|pyx|pxd|h|md|txt))`", section))


def test_layout_map_names_real_files():
    _, files = _layout_map()
    missing = sorted(f for f in files if not os.path.exists(os.path.join(ROOT, f)))
    assert not missing, missing


def test_layout_map_names_every_module():
    section, files = _layout_map()
    listed = {f[:-len(os.path.splitext(f)[1])] for f in files}
    want = {os.path.relpath(p, ROOT)[:-len(os.path.splitext(p)[1])] for p in _modules().values()}
    want = {w for w in want if not w.endswith("__init__")}
    assert not sorted(want - listed), sorted(want - listed)


@pytest.mark.parametrize("name", ["checkpoint", "reference", "_engine", "hf_v41", "reference_v41", "_engine_v41",
                                  "store", "tiers", "_rowcache", "mooncake_servers", "decoder", "engine_args", "_isa"])
def test_one_name_per_module(name):
    """A module has one import path: the top package holds no aliases of modules that live in
    its subpackages (engram_stream.demo.checkpoint is not also engram_stream.checkpoint)."""
    import importlib.util
    import engram_stream
    assert importlib.util.find_spec(f"engram_stream.{name}") is None
    assert f"engram_stream.{name}" not in sys.modules
    assert not hasattr(engram_stream, name)


def test_a_name_has_one_import_path():
    """Only a package's __init__ re-exports names: a module imports what it uses and keeps no
    unused imports for old import paths (no `noqa: F401` outside __init__.py)."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "engram_stream")):
        for name in files:
            if name.endswith((".py", ".pyx")) and name != "__init__.py":
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    found += [f"{os.path.relpath(path, ROOT)}:{k}" for k, ln in enumerate(f, 1) if "noqa: F401" in ln]
    assert not found, found


def test_the_package_docstring_is_a_quick_start_and_names_the_api():
    """help(engram_stream) showed two lines and a list of modules, private ones among them: the
    docstring is a quick start that runs and names every name of __all__, and __all__ is exactly
    the package's public names (its submodules aside)."""
    import pydoc
    import textwrap
    import types

    import engram_stream
    public = {n for n in dir(engram_stream)
              if not n.startswith("_") and not isinstance(getattr(engram_stream, n), types.ModuleType)}
    assert sorted(engram_stream.__all__) == sorted(public)
    assert {"Decoder", "DecoderSnapshot", "EngineSnapshot"} <= set(engram_stream.__all__)
    doc = engram_stream.__doc__
    api = doc.split("The API", 1)[1].split("\n\n", 1)[1].split("\n\n", 1)[0]
    listed = {ln.split()[0] for ln in api.splitlines() if ln.startswith("    ") and not ln.startswith("     ")}
    assert listed == set(engram_stream.__all__), (listed, engram_stream.__all__)
    for sub in ("engram_stream.rows", "engram_stream.integrations.transformers", "engram_stream.integrations.vllm",
                "engram_stream.cli"):
        assert sub in doc, sub
    quick = textwrap.dedent(doc.split("Quick start:\n", 1)[1].split("\nThe API", 1)[0])
    scope = {}
    exec(quick, scope)
    assert scope["y"][1].shape == (scope["cfg"].hc_mult, scope["cfg"].hidden_size)
    assert "Quick start" in pydoc.render_doc(engram_stream)
