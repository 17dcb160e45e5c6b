"""Which engram_stream this repository's tests and scripts import: the checkout itself when it
holds a complete in-place build (`python setup.py build_ext --inplace`), else the installed
package (`pip install .`). Never the unbuilt source tree: it has no compiled extensions, so
importing it fails (`No module named engram_stream._hash`), and Python puts it first on
sys.path whenever it runs from the repository root (`python -m pytest`) or a script adds it.

    sys.path.insert(0, os.path.join(ROOT, "tools")); import checkout
    checkout.use(ROOT)        # before the first `import engram_stream`

tests/helpers/repo.py loads this file by its path (it does not import engram_stream).
"""
from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import sys

INSTALL = "pip install '.[test]' (about 3.5 min on 2 cores), or for development an in-place build: " \
          "python setup.py build_ext --inplace -j 2"


def missing_builds(root) -> list:
    """The extension sources (.pyx) of the checkout at `root` that have no compiled module beside them."""
    out = []
    for pyx in sorted(glob.glob(os.path.join(root, "engram_stream", "**", "*.pyx"), recursive=True)):
        stem = pyx[:-len(".pyx")]
        if not any(os.path.exists(stem + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES):
            out.append(os.path.relpath(pyx, root))
    return out


def stale_builds(root) -> list:
    """The extension sources newer than their compiled module (edited since the last in-place build)."""
    out = []
    for pyx in sorted(glob.glob(os.path.join(root, "engram_stream", "**", "*.pyx"), recursive=True)):
        stem = pyx[:-len(".pyx")]
        built = [stem + s for s in importlib.machinery.EXTENSION_SUFFIXES if os.path.exists(stem + s)]
        if built and os.path.getmtime(pyx) > max(map(os.path.getmtime, built)):
            out.append(os.path.relpath(pyx, root))
    return out


def _is(entry, root) -> bool:
    """Whether a sys.path / PYTHONPATH entry names `root` ('' is the current folder)."""
    try:
        return os.path.samefile(entry or os.curdir, root)
    except OSError:
        return False


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use(root=ROOT, environ=os.environ) -> str:
    """Make `import engram_stream` take the checkout at `root` when its in-place build is complete
    (first on sys.path), else the installed package (the checkout taken off sys.path). environ:
    its PYTHONPATH is changed the same way, so subprocesses import the same package (None: not).
    Returns where engram_stream comes from; raises SystemExit with what to do when there is none,
    or when the unbuilt tree was already imported."""
    root = os.path.abspath(root)
    inplace = not missing_builds(root)
    sys.path[:] = [p for p in sys.path if not _is(p, root)]
    if environ is not None:
        parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and not _is(p, root)]
        environ["PYTHONPATH"] = os.pathsep.join(([root] if inplace else []) + parts)
    if inplace:
        sys.path.insert(0, root)
        return f"{root} (in-place build)"
    loaded = sys.modules.get("engram_stream")
    if loaded is not None and _is(os.path.dirname(os.path.dirname(loaded.__file__)), root):
        raise SystemExit(f"engram_stream was imported from the unbuilt checkout {root}: run {INSTALL}")
    spec = importlib.util.find_spec("engram_stream")
    if spec is None:
        raise SystemExit(f"engram_stream is not installed and the checkout {root} is not built: run {INSTALL}")
    return f"{os.path.dirname(spec.origin)} (installed; the checkout {root} has no in-place build)"
