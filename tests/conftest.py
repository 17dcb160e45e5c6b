"""The tests' fixtures and pytest hooks (the helpers they use: tests/helpers/).

Which engram_stream the tests exercise (tools/checkout.py, before anything imports it): this
checkout when it holds a complete in-place build, else the installed package; never the unbuilt
source tree, which `python -m pytest` from the repository root would otherwise put first. The
choice is made for subprocesses too (PYTHONPATH), and they run with their working directory
outside the checkout. The report header names it.
"""
import os
import sys

import pytest

# The helpers' asserts report their values as a test's own do.
pytest.register_assert_rewrite("helpers")

from helpers.repo import ROOT, checkout  # noqa: E402

# Which kernel path runs is the tests' choice (each_isa, use_isa), never a measurement of this
# machine's moment (engine/tune.py): subprocesses inherit it. Tests of tuning turn it on themselves.
os.environ.setdefault("ENGRAM_STREAM_TUNE", "0")
try:
    PACKAGE = checkout.use(ROOT, os.environ)
except SystemExit as e:
    pytest.exit(f"engram_stream: {e}", returncode=pytest.ExitCode.USAGE_ERROR)


def _package_header():
    """Which engram_stream the session tests (and a warning when its in-place build is stale)."""
    stale = checkout.stale_builds(ROOT) if PACKAGE.endswith("(in-place build)") else []
    return [f"engram_stream: {PACKAGE}"] + [f"engram_stream: WARNING {', '.join(stale)} changed since the "
                                            f"in-place build: rebuild (python setup.py build_ext --inplace)"
                                            for _ in stale[:1]]


# CI runs hypothesis derandomized: the same examples every run, so a red CI is reproducible and
# never a fresh random draw landing on a float edge (ENGRAM_HYPOTHESIS_EXAMPLES=1000 without CI
# set searches randomly, as a developer should).
try:
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; the tests that use it import it themselves
    pass


# Before any thread starts: the session (and every process it starts) sees loopback only.
import helpers.network  # noqa: E402,F401

from helpers.isa import kernel_isas  # noqa: E402
from helpers.mooncake import mooncake_or_skip  # noqa: E402
from helpers.models import make_v41_model  # noqa: E402
from helpers.row_sources import ROW_MODELS  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _private_user_cache(tmp_path_factory):
    """Tests never write the user's cache folder (engram_stream.v41.hf.cached_compression): the
    session, and every subprocess it starts, caches under a temp folder."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def row_checkpoints(tmp_path_factory):
    """{name: path}: each of ROW_MODELS saved (a file for the demo, an HF folder for V4.1)."""
    d = tmp_path_factory.mktemp("row-models")
    out = {}
    for name, make in ROW_MODELS.items():
        path = str(d / (name + (".safetensors" if name.startswith("demo") else "")))
        make().save(path)
        out[name] = path
    return out


@pytest.fixture(scope="session")
def plugin_checkpoints(tmp_path_factory):
    """A V4.1 folder: 3 heads per order (9 columns: a TP shard of 2 ranks has a padded head),
    head_dim 256 (the 264-byte record), and its copy with the packed row file:
    {"plain": folder, "rows": its copy}."""
    import shutil
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    d = tmp_path_factory.mktemp("plugins")
    path = str(d / "v41")
    make_v41_model(seed=11, nh=3, hd=256, D=32).save(path)
    with_rows = str(d / "v41-rows")
    shutil.copytree(path, with_rows)
    packed.pack_rows(EngramModel.from_deepseek_v41(with_rows), packed.rows_path(with_rows))
    return {"plain": path, "rows": with_rows}


def pytest_report_header(config):
    """Which engram_stream is tested, which kernel paths the each_isa tests run here, and why the others cannot."""
    from engram_stream.engine.isa import ISA_NAMES, cpu_isas, supported_isas
    run = kernel_isas()
    why = {n: ("ENGRAM_STREAM_ISA or ENGRAM_TEST_ISAS leaves it out" if n in supported_isas() else
               "this build lacks it" if n in cpu_isas() else "this CPU lacks it") for n in ISA_NAMES if n not in run}
    return _package_header() + [f"kernel paths tested (each_isa): {', '.join(run)}"
                                + "".join(f"; {n} not run: {w}" for n, w in why.items())]


@pytest.fixture(scope="module", params=kernel_isas())
def each_isa(request):
    """Run a module's tests once per kernel path (`pytestmark = pytest.mark.usefixtures("each_isa")`):
    every path is held to the numpy oracle."""
    from engram_stream.engine import isa as _isa
    before = _isa.kernel_isa()
    _isa.use_isa(request.param)
    yield request.param
    _isa.use_isa(before)


# ---- a Mooncake Store for the session (tests marked `mooncake`) ---------------------------------
@pytest.fixture(scope="session")
def mooncake():
    """A mooncake_master and one store server on free loopback ports, for the session."""
    mooncake_or_skip()
    from mooncake_servers import LocalMooncake
    mc = LocalMooncake(segment_mb=64)
    mc.start()
    yield mc
    mc.stop()


@pytest.fixture(scope="session")
def tier(mooncake):
    from mooncake_servers import wait_until_writable
    from engram_stream.rows import MooncakeTier
    t = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, local_host="127.0.0.1", timeout=5)
    wait_until_writable(t)
    yield t
    t.close()


@pytest.fixture(scope="session")
def bare_tier(mooncake):
    """A tier on the session's servers under EngramStore's own keys (name="": engram:l{L}:h{h})."""
    from mooncake_servers import wait_until_writable
    from engram_stream.rows import MooncakeTier
    t = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, local_host="127.0.0.1", timeout=5,
                     name="")
    wait_until_writable(t)
    yield t
    t.close()


@pytest.fixture
def own_store():
    """(LocalMooncake, MooncakeTier) of a test's own servers (a test that kills or stops them)."""
    mooncake_or_skip()
    from mooncake_servers import LocalMooncake, wait_until_writable
    from engram_stream.rows import MooncakeTier
    mc = LocalMooncake(segment_mb=32).start()
    try:
        t = MooncakeTier(master=mc.master, metadata=mc.metadata, timeout=4)
        wait_until_writable(t)
        yield mc, t
        t.close()
    finally:
        mc.stop()


# ---- what a run skipped, for the run that has the extras (.ci/run) ---------------------------------
SKIPPED_FILE = os.environ.get("ENGRAM_STREAM_SKIPPED_FILE")  # a path: every skipped test's id, one a line


def _record_skip(report):
    if SKIPPED_FILE and report.skipped:
        with open(SKIPPED_FILE, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)   # a module skipped whole (importorskip at its top)


# ---- exit after Mooncake tests --------------------------------------------------------------------
def pytest_sessionfinish(session, exitstatus):
    session.config._engram_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A session that ran a Mooncake client ends with os._exit(its status), after every other
    plugin has finished. A user's process exits with its own status after a fault (closed
    clients, running calls waited for: engram_stream.rows.mooncake.calls._close_at_exit, tested in
    subprocesses by tests/rows/test_mooncake.py), but this session leaves calls that outlive
    their bound by minutes: the stop_master tests' calls, stuck until the master is resumed and
    killed, return whenever the client's retries end, and one that returns while the interpreter
    finalizes aborts it ("terminate called without an active exception": 2 of 2 sessions here).
    The tests' verdict is the session's status, not that race."""
    status = getattr(config, "_engram_exitstatus", None)
    if status is not None and "mooncake.store" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
