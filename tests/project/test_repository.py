"""What the repository itself holds: source, small test data and figures, nothing built or generated."""
import os
import shutil
import subprocess

import pytest

from helpers.repo import ROOT

LIMIT = 1 << 20   # the largest tracked file is a 176 KiB figure; a checkpoint or a build output is far above


def _tracked():
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.fail("run from a git checkout: the size rule is about what the repository tracks")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_is_large():
    big = {p: os.path.getsize(os.path.join(ROOT, p)) for p in _tracked()
           if os.path.isfile(os.path.join(ROOT, p)) and os.path.getsize(os.path.join(ROOT, p)) > LIMIT}
    assert not big, f"tracked files over {LIMIT >> 20} MiB (a checkpoint or build output?): {big}"


def test_no_tracked_file_name_is_an_option():
    """A file named like a command-line option (`--help`) is what a tool writes when an option is
    taken for a path."""
    bad = [p for p in _tracked() if os.path.basename(p).startswith("-")]
    assert not bad, bad
