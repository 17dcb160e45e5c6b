"""The contract suites run in a pytest process of their own, with a test file loaded as a plugin
(a toy variant or source registered there)."""
import os
import re
import subprocess
import sys


def _suite_pytest(plugin, env_var, files, extra):
    """pytest over contract suites (files of tests/contract) in a process of its own, with a test
    file loaded as a plugin (`-p plugin`, env_var=1: it registers its toy there). cwd is
    tests/contract, not the repository root, whose unbuilt engram_stream/ would shadow the
    installed package."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract")
    env = {**os.environ, env_var: "1", "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)] + sys.path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-p", plugin] + extra + [os.path.join(here, f) for f in files],
                          cwd=here, env=env, capture_output=True, text=True, timeout=600)


def collect_suite_with_plugin(plugin, env_var, files, keyword=None):
    """The node ids of the suites' cases as a run with the plugin collects them (those named by
    `keyword` when given)."""
    r = _suite_pytest(plugin, env_var, files, ["--collect-only"] + (["-k", keyword] if keyword else []))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return [line.strip() for line in r.stdout.splitlines() if "::" in line]


def run_suite_counts(plugin, env_var, files, keyword):
    """Run the suites' cases named by `keyword` with the plugin; asserts the run was green and
    returns its outcome counts ({"passed": n, "skipped": n, ...} as pytest's summary gives them)."""
    r = _suite_pytest(plugin, env_var, files, ["-k", keyword])
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "failed" not in tail and "error" not in tail, tail
    return {what: int(n) for n, what in re.findall(r"(\d+) (\w+)", tail.rsplit(" in ", 1)[0])}


def run_suite_with_plugin(plugin, env_var, files, keyword):
    """run_suite_counts' passed count."""
    return run_suite_counts(plugin, env_var, files, keyword).get("passed", 0)
