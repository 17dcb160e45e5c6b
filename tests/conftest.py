"""Shared test helpers.

Tests exercise the installed package: a subprocess runs with its working directory
outside the checkout, so `python -c` / `python -m` cannot import the unbuilt source tree
at the repository root (an in-place development build, or PYTHONPATH, still applies).
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(args, cwd=None, **kw):
    """subprocess.run([sys.executable, *args]) from a folder outside the checkout."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run([sys.executable, *args], cwd=cwd or tempfile.gettempdir(), **kw)
