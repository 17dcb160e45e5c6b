"""The measured kernel choice (engine/tune.py): the choice from timings, the cache file's key
and checks, what an engine runs with it, and one real measurement (its table's shape only).

Every test but the last feeds made-up timings: none depends on this machine's speed."""
import json
import os
import stat
import sys

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.engine import isa as _isa
from engram_stream.engine import tune

from helpers.row_sources import ROW_MODELS, load_checkpoint, row_source_model

CFG = dict(engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=64, n_head_per_ngram=4,
           layer_ids=[1], kernel_size=3, hidden_size=48, hc_mult=2, vocab_size=60)


@pytest.fixture(scope="module")
def model():
    return EngramModel.init(EngramConfig(**CFG), seed=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tune, "_memo", {})
    monkeypatch.setattr(tune, "_said", set(), raising=False)  # each test's lines on stderr said afresh
    return tmp_path / "xdg" / "engram_stream"


@pytest.fixture
def unforced():
    """No path forced for the test (the session's forced path, if any, back after)."""
    before = _isa.kernel_isa() if _isa.forced() else None
    _isa.use_isa(None)
    yield
    _isa.use_isa(before)


def _in_child(fn, uid=None, wait=True):
    """Run fn() in a forked child (as `uid` when given): (its return value, its stderr text), or
    the pid (wait=False; collect with _collect). The child's stderr goes to a pipe of its own."""
    rd, wr = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(rd), os.close(res_r)
            sys.stderr = os.fdopen(wr, "w")
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            out = fn()
            os.write(res_w, json.dumps({"ok": out}).encode())
            code = 0
        except BaseException as e:
            os.write(res_w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(wr), os.close(res_w)
    child = (pid, rd, res_r)
    return _collect(child) if wait else child


def _collect(child):
    pid, rd, res_r = child
    with os.fdopen(rd) as f:
        err = f.read()
    with os.fdopen(res_r) as f:
        res = json.loads(f.read() or "{}")
    os.waitpid(pid, 0)
    assert "ok" in res, (res, err)
    return res["ok"], err


def _table(step=("avx2", 2), batch=("baseline", 1), prefill=("avx2", 1)):
    return {op: {"isa": p, "threads": t, "times": {f"{p}/{t}": 1e-3}}
            for op, (p, t) in zip(tune.OPS, (step, batch, prefill))}


# ---- the choice ------------------------------------------------------------------------------------
def test_fastest_takes_the_smallest_time_and_breaks_ties_to_fewer_threads():
    assert tune.fastest({("avx512", 1): 3.0, ("bf16", 2): 1.0, ("avx2", 2): 2.0}) == ("bf16", 2)
    assert tune.fastest({("avx512", 2): 1.0, ("avx512", 1): 1.0}) == ("avx512", 1)
    assert tune.fastest({("avx512", 2): 1.0, ("bf16", 1): 1.01}) == ("bf16", 1)  # within TIE: the cores spared
    assert tune.fastest({("avx512", 2): 1.0, ("bf16", 1): 1.1}) == ("avx512", 2)
    assert tune.fastest({("bf16", 1): 1.0, ("avx2", 1): 1.0}) == ("avx2", 1)
    with pytest.raises(ValueError, match="no candidate"):
        tune.fastest({})


def test_measure_times_each_candidate_by_its_best_run_and_drops_the_slow_early():
    clock = [0.0]
    cost = {("bf16", 2): 1e-3, ("bf16", 1): 1.5e-3, ("baseline", 1): 10e-3}
    runs = []

    def run(c):
        runs.append(c)
        clock[0] += cost[c] + (0.5e-3 if runs.count(c) == 1 else 0.0) * (c != ("baseline", 1))  # a slower first run

    times, partial = tune.measure(run, list(cost), timer=lambda: clock[0], repeats=2)
    assert runs.count(("bf16", 2)) == 3  # a warm-up, then 2 runs (past MIN_SECONDS)
    assert times[("bf16", 2)] == pytest.approx(1e-3) and times[("bf16", 1)] == pytest.approx(1.5e-3)  # no warm-up
    assert runs.count(("baseline", 1)) == 1 and times[("baseline", 1)] == pytest.approx(10e-3)  # > 3x the best
    assert tune.fastest(times) == ("bf16", 2) and not partial
    # a run of LONG_RUN or more is timed once after its warm-up; a long warm-up LONG_SLOWER x the best, not at all
    cost.update({("avx2", 2): 30e-3, ("avx2", 1): 50e-3})
    runs.clear()
    times, _ = tune.measure(run, [("avx2", 2), ("avx2", 1)], timer=lambda: clock[0], repeats=3)
    assert runs == [("avx2", 2)] * 2 + [("avx2", 1)] and times[("avx2", 2)] == pytest.approx(30e-3)


class FakeOps:
    """Operations whose every call advances a fake clock by a made-up time per (op, path, threads)
    (a first call of a candidate `cold` times its time more), recording each call."""

    def __init__(self, cost, cold=0.0, share=1.0):
        self.cost, self.cold, self.clock, self.calls = cost, cold, 0.0, []
        self.share, self.cpu_clock = share, 0.0  # share: the part of each call the calling thread got its core

    def timer(self):
        return self.clock

    def cpu(self):
        return self.cpu_clock

    def runs(self):
        def make(op):
            def run(c):
                self.calls.append((op, c))
                took = self.cost[op][c] * (1 + (self.cold if self.calls.count((op, c)) == 1 else 0.0))
                self.clock += took
                self.cpu_clock += took * self.share
            return run
        return {op: make(op) for op in tune.OPS}

    def count(self, path=None, op=None):
        return sum(1 for o, c in self.calls if (path is None or c[0] == path) and (op is None or o == op))


def _costs(step, batch, prefill):
    return {"step": step, "batch": batch, "prefill": prefill}


PATHS = ("bf16", "avx512", "avx2", "baseline")  # likeliest fastest first


def test_a_hopeless_path_is_dropped_after_one_run_for_every_thread_count_and_operation():
    # at Flash dims on 2 cores: the baseline path's one-thread step is ~10x the best, beyond 2 x DROP_SLOWER
    step = {("bf16", 2): 6e-3, ("bf16", 1): 10e-3, ("avx512", 2): 8e-3, ("avx512", 1): 14e-3,
            ("avx2", 2): 8e-3, ("avx2", 1): 15e-3, ("baseline", 2): 45e-3, ("baseline", 1): 87e-3}
    ops = FakeOps(_costs(step, {c: 10 * t for c, t in step.items()}, {c: 20 * t for c, t in step.items()}))
    table = tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=100.0, cores=2)
    assert ops.calls.count(("step", ("baseline", 1))) == 1  # its warm-up, then never again
    assert ops.count("baseline") == 1
    assert "baseline/1" in table["step"]["times"] and "baseline/2" not in table["step"]["times"]
    assert all(not any(k.startswith("baseline") for k in table[op]["times"]) for op in ("batch", "prefill"))
    assert [(table[op]["isa"], table[op]["threads"]) for op in tune.OPS] == [("bf16", 2)] * 3
    assert not any(table[op]["partial"] for op in tune.OPS)
    # within cores x DROP_SLOWER the path stays: more threads might bring it within reach
    step[("baseline", 1)] = 30e-3
    ops = FakeOps(_costs(step, {c: 10 * t for c, t in step.items()}, {c: 20 * t for c, t in step.items()}))
    tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=100.0, cores=2)
    assert ops.calls.count(("step", ("baseline", 2))) >= 1
    # with no budget (engram-stream tune) every candidate of every operation runs
    ops = FakeOps(_costs(step, {c: 10 * t for c, t in step.items()}, {c: 20 * t for c, t in step.items()}))
    step[("baseline", 1)] = 87e-3
    table = tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=None, cores=2)
    assert all(set(table[op]["times"]) == {f"{p}/{t}" for p in PATHS for t in (1, 2)} for op in tune.OPS)


def test_the_likeliest_winner_runs_first_and_the_step_orders_the_other_operations():
    assert tune.order(["bf16", "avx512", "avx2"], [1, 2, 4]) == [
        ("bf16", 4), ("bf16", 1), ("bf16", 2), ("avx512", 1), ("avx512", 2), ("avx512", 4),
        ("avx2", 1), ("avx2", 2), ("avx2", 4)]  # each path's one-thread run first: it can drop the path
    assert tune.order(["bf16", "avx512", "avx2"], [1, 2], ascending=False) == [
        ("bf16", 2), ("avx512", 2), ("bf16", 1), ("avx512", 1), ("avx2", 2), ("avx2", 1)]
    speed = {"avx2": 1e-3, "bf16": 2e-3, "avx512": 3e-3, "baseline": 5e-3}
    step = {(p, t): speed[p] / t for p in PATHS for t in (1, 2)}
    ops = FakeOps(_costs(step, step, step))
    tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=100.0, cores=2)
    assert ops.calls[0] == ("step", ("bf16", 2))
    first = {op: next(c for o, c in ops.calls if o == op) for op in ("batch", "prefill")}
    assert first == {"batch": ("avx2", 2), "prefill": ("avx2", 2)}  # the step's fastest path


def test_the_budget_stops_measuring_and_marks_the_table_partial():
    step = {(p, t): (1e-3 if p == "bf16" else 1.2e-3) * (1.5 if t == 1 else 1.0) for p in PATHS for t in (1, 2)}
    costs = _costs(step, {c: 20 * t for c, t in step.items()}, {c: 100 * t for c, t in step.items()})
    ops = FakeOps(costs)
    table = tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=0.05, cores=2)
    # past the budget at most the first candidate's two runs (the step), the first two's (batch, prefill)
    assert ops.clock < 0.05 + 2 * 1.2e-3 * 1.5 + 2 * 2 * (0.02 + 0.1) * 1.2 * 1.5
    assert table["prefill"]["partial"] and len(table["prefill"]["times"]) < 8
    assert table["prefill"]["isa"] == "bf16" and table["prefill"]["threads"] == 2  # the step's best path, timed first
    assert "partial" in tune.format_table(table)
    full = tune.tune_runs(FakeOps(costs).runs(), PATHS, [1, 2], timer=FakeOps(costs).timer, budget=None, cores=2)
    assert not any(full[op]["partial"] for op in tune.OPS)
    # a budget spent before the first run times nothing: every operation runs the likeliest path on the most
    # threads, untimed, partial (not final: the next process measures again)
    ops = FakeOps(costs)
    table = tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=0.0, cores=2)
    assert ops.calls == [] and all(table[op]["partial"] and table[op]["times"] == {} for op in tune.OPS)
    assert {(table[op]["isa"], table[op]["threads"]) for op in tune.OPS} == {("bf16", 2)} and not tune.final(table)
    assert "not timed" in tune.format_table(table)


def test_a_late_budget_cut_still_finds_the_batch_path_a_noisy_step_ranked_second():
    # the step ranks avx512 over bf16 (close, noisy), the batch runs 1.6x faster on bf16: with the budget
    # spent (its share, not the whole budget), the batch still times both paths on the most threads and keeps bf16
    step = {(p, t): {"avx512": 1.0e-3, "bf16": 1.05e-3}.get(p, 3e-3) / t for p in PATHS for t in (1, 2)}
    batch = {(p, t): {"avx512": 34e-3, "bf16": 21e-3}.get(p, 60e-3) / t for p in PATHS for t in (1, 2)}
    ops = FakeOps(_costs(step, batch, batch))
    table = tune.tune_runs(ops.runs(), PATHS, [1, 2], timer=ops.timer, budget=0.15, cores=2)
    assert ops.clock <= 0.15
    assert {"bf16/2", "avx512/2"} <= set(table["step"]["times"])
    assert [c for o, c in ops.calls if o == "batch"][:1] == [("avx512", 2)]  # the step's order
    assert (table["batch"]["isa"], table["batch"]["threads"]) == ("bf16", 2) and table["batch"]["partial"]


def test_the_choice_is_the_fastest_of_made_up_times_whatever_order_they_are_tried_in():
    rng = np.random.default_rng(5)
    for trial in range(200):
        costs = {op: {(p, t): float(rng.uniform(1e-4, 3e-2)) for p in PATHS for t in (1, 2, 4)} for op in tune.OPS}
        paths = tuple(rng.permutation(PATHS))
        ops = FakeOps(costs, cold=float(rng.uniform(0, 0.4)))  # a warm-up up to 40% slower
        table = tune.tune_runs(ops.runs(), paths, [1, 2, 4], timer=ops.timer, budget=100.0, cores=4)
        for op in tune.OPS:
            assert not table[op]["partial"]
            e, true = table[op], costs[op]
            got = true[(e["isa"], e["threads"])]
            # a path dropped as hopeless (one-thread step > 4 x DROP_SLOWER x the best) can hide only a time
            # no thread count brings within reach when the times scale like the step's; these made-up times
            # do not, so the choice is checked against the candidates that ran
            ran = {c for o, c in ops.calls if o == op}
            assert got <= min(true[c] for c in ran) * (1 + tune.TIE), (trial, op, e)


def test_a_long_measurement_says_so_once_on_stderr(model, cache, monkeypatch, capsys):
    clock = [0.0]

    def slow_runners(m, layer):
        def run(c):
            clock[0] += 0.2
        return {op: run for op in tune.OPS}

    monkeypatch.setattr(tune, "_runners", slow_runners)
    tune.tune_model(model, 1, timer=lambda: clock[0], paths=("avx2", "baseline"), threads=[1], note="NOTE",
                    budget=None)
    assert capsys.readouterr().err == "NOTE\n"  # once, though the measuring took ~2.4 s of the fake clock
    clock[0] = 0.0

    def fast_runners(m, layer):
        def run(c):
            clock[0] += 1e-3
        return {op: run for op in tune.OPS}

    monkeypatch.setattr(tune, "_runners", fast_runners)
    tune.tune_model(model, 1, timer=lambda: clock[0], paths=("avx2", "baseline"), threads=[1], note="NOTE")
    assert capsys.readouterr().err == ""


def test_thread_counts_up_to_the_cores():
    assert tune.thread_counts(1) == [1]
    assert tune.thread_counts(2) == [1, 2]
    assert tune.thread_counts(6) == [1, 2, 4, 6]
    from engram_stream.engine._base import MAX_THREADS
    assert tune.thread_counts(1000)[-1] == MAX_THREADS


# ---- the key ---------------------------------------------------------------------------------------
def test_cpu_identity_names_the_cpu_not_its_clock(tmp_path):
    f = tmp_path / "cpuinfo"
    base = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: EPYC X\n"
    f.write_text(base + "cpu MHz\t\t: 2400.0\nflags\t\t: avx2 fma\n\nprocessor\t: 1\nvendor_id\t: Other\n")
    key, name = tune.cpu_identity(str(f))
    assert name == "EPYC X" and len(key) == 16
    f.write_text(base + "cpu MHz\t\t: 3100.5\nflags\t\t: avx2 fma\n")  # another clock, another core listed
    assert tune.cpu_identity(str(f))[0] == key
    f.write_text(base.replace("model\t\t: 17", "model\t\t: 18") + "flags\t\t: avx2 fma\n")
    assert tune.cpu_identity(str(f))[0] != key
    f.write_text(base + "flags\t\t: avx2 fma avx512f\n")
    assert tune.cpu_identity(str(f))[0] != key


def test_shape_key_names_the_variant_and_dims(model):
    k = tune.shape_key(model)
    assert k.startswith(f"{model.variant.name}/{model.weight_dtype}/") and "x48x" in k


# ---- the cache file --------------------------------------------------------------------------------
def test_cache_round_trip_private_and_keyed(cache, monkeypatch):
    path = tune.write_cache({"m": _table()})
    assert os.path.dirname(path) == str(cache)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert tune.read_cache() == {"m": _table()}
    doc = json.loads(open(path).read())
    assert doc["format"] == tune.FORMAT and doc["cpu"] == tune.cpu_identity()[0]
    monkeypatch.setattr(tune, "build_identity", lambda: "another build")
    assert tune.read_cache() == {}  # a rebuild measures again
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache.parent))
    monkeypatch.setattr(tune, "cpu_identity", lambda: ("0123456789abcdef", "another CPU"))
    assert tune.read_cache() == {}  # another CPU's name: no file of its own yet


def test_a_rebuild_of_any_registered_variants_engine_measures_again(monkeypatch):
    """The build identity covers the engine module of every variant the registry holds (each
    found through its entry, none named in tune.py): a rebuilt Qwen engine, or a variant
    registered later, gives another identity."""
    from engram_stream import variants
    names = {v.engine.__module__ for v in variants.variants()}
    assert {"engram_stream.demo._engine", "engram_stream.v41._engine", "engram_stream.qwen._engine"} <= names
    before = tune.build_identity()
    qwen_file = __import__("engram_stream.qwen._engine", fromlist=["_"]).__file__
    real_stat = os.stat

    def rebuilt(path, *a, **kw):   # the Qwen engine's file as a rebuild leaves it: another mtime
        st = real_stat(path, *a, **kw)
        if path == qwen_file:
            return os.stat_result(tuple(st[:10]), {"st_mtime_ns": st.st_mtime_ns + 1})
        return st
    monkeypatch.setattr(tune.os, "stat", rebuilt)
    assert tune.build_identity() != before
    monkeypatch.undo()
    assert tune.build_identity() == before

    class Later(type(variants.get("demo-v1"))):
        name = "later-v0"
    Later.engine = type("LaterEngine", (variants.get("demo-v1").engine,), {"__module__": __name__})
    variants.register(Later())
    try:
        assert tune.build_identity() != before
    finally:
        variants.unregister("later-v0")


def test_cache_refuses_what_others_can_write(cache):
    path = tune.write_cache({"m": _table()})
    os.chmod(path, 0o620)
    with pytest.raises(tune.TuneCacheError, match="writable by group or others.*chmod go-w"):
        tune.read_cache()
    os.chmod(path, 0o600)
    os.chmod(cache, 0o777)
    with pytest.raises(tune.TuneCacheError, match="folder is writable by group or others"):
        tune.read_cache()
    with pytest.raises(tune.TuneCacheError):
        tune.write_cache({})
    os.chmod(cache, 0o700)
    os.replace(path, path + ".real")
    os.symlink(path + ".real", path)
    with pytest.raises(tune.TuneCacheError, match="cannot be read safely"):
        tune.read_cache()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_cache_refuses_another_users_file(cache):
    path = tune.write_cache({"m": _table()})
    os.chown(path, 12345, -1)
    with pytest.raises(tune.TuneCacheError, match="owned by uid 12345"):
        tune.read_cache()


def test_cache_drops_broken_entries(cache):
    path = tune.write_cache({"good": _table(), "bad": _table(step=("avx2", 0)), "bool": _table(step=("avx2", True))})
    assert set(tune.read_cache()) == {"good"}
    doc = json.loads(open(path).read())
    doc["tables"]["good"]["prefill"]["isa"] = "sse9"
    with open(path, "w") as f:
        json.dump(doc, f)
    assert tune.read_cache() == {}
    with open(path, "w") as f:
        f.write("{not json")
    assert tune.read_cache() == {}


# ---- engines ---------------------------------------------------------------------------------------
def test_an_engine_runs_the_measured_choice_unless_the_caller_or_a_forced_path_decides(model, cache, monkeypatch):
    runs = _isa.supported_isas()
    table = _table(step=(runs[-1], 2), batch=(runs[0], 1), prefill=(runs[0], 2))
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "tune_model", lambda m, layer=None, **kw: table)  # made-up measurement
    before = _isa.kernel_isa() if _isa.forced() else None
    try:
        _isa.use_isa(None)
        eng = model.stream(1, n_streams=1)
        assert eng.kernel_choice() == {"step": (runs[-1], 2, "tuned"), "batch": (runs[0], 1, "tuned"),
                                       "prefill": (runs[0], 2, "tuned")}
        assert eng.step_threads == 2 and eng.prefill_threads == 2 and eng.isa == runs[-1]
        assert tune.read_cache() == {tune.shape_key(model): table}  # measured once, kept
        eng.step_threads = 1
        eng.prefill_threads = 3
        ch = eng.kernel_choice()
        assert ch["step"] == (runs[-1], 1, "tuned, threads set") and ch["prefill"] == (runs[0], 3, "tuned, threads set")
        rng = np.random.default_rng(0)
        ids, h = rng.integers(0, 60, 20), rng.standard_normal((20, 2, 48)).astype(np.float32)
        want = model.forward(1, ids[None], h[None])[0]
        np.testing.assert_allclose(eng.prefill(ids, h), want, rtol=2e-4, atol=2e-5)  # on the measured path
        _isa.use_isa(runs[0])
        assert all(why.startswith("forced") and p == runs[0] for p, _, why in eng.kernel_choice().values())
        _isa.use_isa(None)
        monkeypatch.setenv(tune.ENV, "0")
        assert model.stream(1).kernel_choice() == {"step": (runs[-1], 1, "default"), "batch": (runs[-1], 1, "default"),
                                                   "prefill": (runs[-1], min(os.cpu_count() or 1, 8), "default")}
    finally:
        _isa.use_isa(before)


def test_a_real_measurement_has_every_operation_path_and_thread_count(model, cache):
    before = _isa.kernel_isa() if _isa.forced() else None
    try:
        _isa.use_isa(None)
        table = tune.tune_model(model, 1, threads=[1, 2], budget=None)
    finally:
        _isa.use_isa(before)
    assert set(table) == set(tune.OPS)
    for op in tune.OPS:
        e = table[op]
        assert e["isa"] in _isa.supported_isas() and e["threads"] in (1, 2)
        assert set(e["times"]) == {f"{p}/{t}" for p in _isa.supported_isas() for t in (1, 2)}
        assert e["times"][f"{e['isa']}/{e['threads']}"] <= min(e["times"].values()) * (1 + tune.TIE)
    assert "ms" in tune.format_table(table)


# ---- a cache that cannot be used or trusted: the model runs, measured for this process ---------------
def _best_table():
    runs = _isa.supported_isas()
    return _table(step=(runs[-1], 2), batch=(runs[0], 1), prefill=(runs[-1], 1))


def _tuned(choice, table):
    return choice == {op: (table[op]["isa"], table[op]["threads"], "tuned") for op in tune.OPS}


@pytest.mark.parametrize("where", ["HOME", "XDG_CACHE_HOME"])
def test_a_cache_folder_under_a_file_measures_for_this_process_and_says_why(model, cache, monkeypatch, capsys,
                                                                             unforced, where, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv(where, str(a_file))
    monkeypatch.setenv(tune.ENV, "1")
    measured = []
    monkeypatch.setattr(tune, "tune_model", lambda m, layer=None, **kw: measured.append(1) or _best_table())
    assert _tuned(model.stream(1).kernel_choice(), _best_table())
    assert _tuned(model.stream(1).kernel_choice(), _best_table()) and measured == [1]  # once a process
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert str(a_file) in err[0] and "Not a directory" in err[0] and "XDG_CACHE_HOME" in err[0]
    assert "measured for this process only" in err[0]
    assert a_file.read_text() == "not a folder\n"


def test_a_home_this_user_cannot_enter_measures_for_this_process_and_says_why(model, cache, monkeypatch,
                                                                              unforced, tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "tune_model", lambda m, layer=None, **kw: _best_table())

    def first_stream():
        return model.stream(1).kernel_choice()["step"]

    if os.getuid() == 0:  # root enters any folder: the user the usual container runs, nobody (a child process)
        import pwd
        choice, err = _in_child(first_stream, uid=pwd.getpwnam("nobody").pw_uid)
    else:  # a folder of one's own without search permission
        os.chmod(home, 0)
        try:
            choice, err = _in_child(first_stream)
        finally:
            os.chmod(home, 0o700)
    assert tuple(choice) == (_best_table()["step"]["isa"], 2, "tuned")
    err = err.splitlines()
    assert len(err) == 1 and str(home / ".cache" / "engram_stream") in err[0], err
    assert "Permission denied" in err[0] and "measured for this process only" in err[0]
    assert os.listdir(home) == []


# ---- the measurement reads no row of the model --------------------------------------------------------
@pytest.mark.parametrize("source", ["direct, 1 MB cache", "direct+host cache", "packed row file+cache"])
@pytest.mark.parametrize("name", sorted(ROW_MODELS))
def test_the_first_stream_measures_on_private_rows_the_models_row_cache_and_files_untouched(
        row_checkpoints, name, source, cache, monkeypatch, unforced, tmp_path, request):
    if source == "direct, 1 MB cache":  # the issue's own case
        model = load_checkpoint(row_checkpoints[name], tables="direct", row_cache_mb=1)
    else:
        model = row_source_model(row_checkpoints[name], source, tmp_path, request)
    L = model.cfg.layer_ids[0]
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "TIME_BUDGET", 0.05)
    before = model.row_cache_stats()
    eng = model.stream(L)
    assert all(why == "tuned" for _, _, why in eng.kernel_choice().values())  # measured, by this call
    assert tune.shape_key(model) in tune.read_cache()
    after = model.row_cache_stats()
    for k in ("reads", "rows_read", "bytes_read", "misses", "hits", "rows_cached", "bytes_fetched"):
        assert after[k] == before[k] == 0, (k, before[k], after[k])


def test_the_measurement_never_asks_the_model_for_its_rows(model, cache, monkeypatch, unforced):
    def no(layer):
        raise AssertionError("the measurement read the model's rows")

    monkeypatch.setattr(model, "row_source", no)
    table = tune.tune_model(model, 1, threads=[1], budget=0.05)
    assert set(table) == set(tune.OPS)
    src = tune.private_rows(model, 1)
    assert (src.nrows, src.rowbytes, src.scalebytes) == (model.plan.table_rows[1], 64 // 4 * 4, 0)
    assert not src.read(np.arange(src.nrows)).any()  # zero records, every row of the table's count


def _overcommit():
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip()
    except OSError:
        return None


@pytest.mark.skipif(_overcommit() in (None, "2"), reason="needs Linux without strict overcommit (vm.overcommit_memory "
                    "2 commits every mapping: there a table larger than RAM is refused, and the defaults run)")
def test_private_rows_of_a_table_larger_than_ram_cost_only_the_rows_read():
    import resource
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    n = 2 * ram // 264 + 1  # the Flash record (256 + 8 bytes), twice the RAM
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    a = tune._zero_records(n, 264, "table")
    assert a.shape == (n, 264) and not a[np.random.default_rng(0).integers(0, n, 1000)].any()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: the pages read, no more


def test_private_rows_that_cannot_be_mapped_leave_the_defaults_and_say_why(model, cache, monkeypatch, capsys,
                                                                        unforced):
    def refused(*a, **kw):
        raise OSError(12, "Cannot allocate memory")

    import mmap
    import types
    monkeypatch.setattr(tune, "mmap", types.SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap) if k.isupper()},
                                                           mmap=refused))  # tune's mmap alone
    monkeypatch.setenv(tune.ENV, "1")
    for _ in range(2):
        assert {why for _, _, why in model.stream(1).kernel_choice().values()} == {"default"}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "Cannot allocate memory" in err[0] and "default path" in err[0], err
    with pytest.raises(tune.MeasureError, match="cannot map"):
        tune.table_for(model, 1, retune=True)  # engram-stream tune says it as its error


# ---- a forced path's table is that path's -------------------------------------------------------------
def test_a_forced_paths_table_does_not_outlive_the_forcing(model, cache, monkeypatch, unforced):
    monkeypatch.setenv(tune.ENV, "1")

    def measure(m, layer=None, **kw):  # a forced path is the only one that runs
        return _table(*[(_isa.kernel_isa(), 1)] * 3) if _isa.forced() else _best_table()

    monkeypatch.setattr(tune, "tune_model", measure)
    _isa.use_isa("baseline")
    assert {(p, why) for p, _, why in model.stream(1).kernel_choice().values()} == {("baseline", "forced")}
    assert tune.read_cache() == {}  # one path measured: not this CPU's table
    _isa.use_isa(None)
    assert _tuned(model.stream(1).kernel_choice(), _best_table())
    assert tune.read_cache() == {tune.shape_key(model): _best_table()}


# ---- processes tuning at once ----------------------------------------------------------------------------
def test_processes_tuning_at_once_keep_every_entry(cache, monkeypatch, unforced):
    import multiprocessing
    models = [EngramModel.init(EngramConfig(**{**CFG, "hidden_size": 48 + 16 * i}), seed=1) for i in range(3)]
    barrier = multiprocessing.get_context("fork").Barrier(3)

    def measure(m, layer=None, **kw):  # all three read the cache before any writes it
        barrier.wait(60)
        return _table()

    monkeypatch.setattr(tune, "tune_model", measure)
    children = [_in_child(lambda m=m: tune.table_for(m) is not None, wait=False) for m in models]
    assert [_collect(c)[0] for c in children] == [True] * 3
    assert set(tune.read_cache()) == {tune.shape_key(m) for m in models}
    assert stat.S_IMODE(os.stat(str(cache / os.path.basename(tune.cache_path())) + ".lock").st_mode) == 0o600


# ---- a cache file of another machine, or too deep ---------------------------------------------------------
def test_an_entry_naming_a_path_this_cpu_does_not_run_is_ignored_and_said(model, cache, monkeypatch, capsys,
                                                                         unforced):
    alien = next(p for p in reversed(_isa.ISA_NAMES) if p not in _isa.supported_isas())
    key = tune.shape_key(model)
    path = tune.write_cache({key: _table(step=(alien, 1)), "other": _table(step=(_isa.supported_isas()[0], 1))})
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "tune_model", lambda m, layer=None, **kw: _best_table())
    assert _tuned(model.stream(1).kernel_choice(), _best_table())
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and path in err[0] and repr(key) in err[0] and alien in err[0], err
    assert "does not run" in err[0] and "remove it" in err[0]
    assert tune.read_cache() == {key: _best_table(), "other": _table(step=(_isa.supported_isas()[0], 1))}


def test_a_deeply_nested_cache_file_is_broken_not_a_crash(model, cache, monkeypatch, unforced):
    path = tune.write_cache({})
    with open(path, "w") as f:
        f.write('{"format": 1, "tables": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert tune.read_cache() == {}
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "tune_model", lambda m, layer=None, **kw: _best_table())
    assert _tuned(model.stream(1).kernel_choice(), _best_table())
    assert tune.read_cache() == {tune.shape_key(model): _best_table()}  # measured again, the file replaced


# ---- a choice measured under load, re-checked; the first stream() within its budget ------------------------
def _candidates():
    """Every (path, threads) the first stream() times here (2 cores, the paths this CPU runs)."""
    return [(p, t) for p in _isa.supported_isas() for t in (1, 2)]


class Process:
    """The first stream() of one process over made-up timings: each call a fresh process (this
    process's tables forgotten, the cache file kept), its runs FakeOps of `cost(op, candidate)`."""

    def __init__(self, model, monkeypatch, setup=0.0):
        self.model, self.mp, self.setup = model, monkeypatch, setup
        monkeypatch.setattr(tune, "cores", lambda: 2)
        monkeypatch.setenv(tune.ENV, "1")

    def run(self, cost, share=1.0):
        ops = FakeOps({op: {c: cost(op, c) for c in _candidates()} for op in tune.OPS}, share=share)

        def runners(m, layer):
            ops.clock += self.setup  # the scratch engines' making: part of the budget
            return ops.runs()

        self.mp.setattr(tune, "_memo", {})
        self.mp.setattr(tune, "_runners", runners)
        self.mp.setattr(tune, "_clock", ops.timer)
        self.mp.setattr(tune, "_cpu", ops.cpu)
        choice = self.model.stream(1).kernel_choice()
        return {op: (p, t) for op, (p, t, _) in choice.items()}, ops


def _fast(winner, slower=2.5e-3):
    """Made-up times: `winner` (op -> candidate, or one candidate for all) 1 ms, the rest `slower`."""
    return lambda op, c: 1e-3 if c == (winner[op] if isinstance(winner, dict) else winner) else slower


def test_a_loaded_measurement_is_cached_not_final_and_the_next_process_measures_again(model, cache, monkeypatch,
                                                                                       unforced):
    A, B = _candidates()[0], _candidates()[-1]
    proc = Process(model, monkeypatch)
    # busy: the calling thread got half its wall time, and A only looked fastest
    got, ops = proc.run(_fast(A), share=0.5)
    assert got == {op: A for op in tune.OPS}
    entry = tune.read_cache()[tune.shape_key(model)]
    assert all(entry[op]["loaded"] for op in tune.OPS) and not tune.final(entry)
    assert "loaded" in tune.format_table(entry)
    # the next process measures again (every candidate of the step, not a re-check's two) and keeps the quiet
    # measurement, final
    got, ops = proc.run(_fast(B))
    assert got == {op: B for op in tune.OPS} and ops.count(op="step") >= len(_candidates())
    entry = tune.read_cache()[tune.shape_key(model)]
    assert tune.final(entry) and not any(entry[op]["loaded"] for op in tune.OPS)


def test_a_quiet_recheck_that_finds_the_cached_choice_slow_replaces_it(model, cache, monkeypatch, unforced):
    A, B = _candidates()[0], _candidates()[-1]
    proc = Process(model, monkeypatch)
    # load the measurement did not see (its thread kept its core): A cached as final, B the runner-up
    first = proc.run(lambda op, c: {A: 2e-3, B: 2.4e-3}.get(c, 5e-3))[0]
    assert first == {op: A for op in tune.OPS} and tune.final(tune.read_cache()[tune.shape_key(model)])
    # a later process, quiet, finds A within 1.5x of B: kept, after the re-check's runs alone (a warm-up and one
    # timed run of each of the two, per operation: runs of
    # MIN_SECONDS or more are timed once)
    got, ops = proc.run(lambda op, c: {A: 2.8e-3, B: 2e-3}.get(c, 5e-3))
    assert got == first and len(ops.calls) == 4 * len(tune.OPS)
    assert {c for _, c in ops.calls} == {A, B}
    # a busy re-check cannot tell: A kept, though it ran 2x B
    got, ops = proc.run(lambda op, c: {A: 4e-3, B: 2e-3}.get(c, 5e-3), share=0.5)
    assert got == first and len(ops.calls) == 4 * len(tune.OPS)
    # a quiet re-check finding A 2x B: measured again, the fastest kept and cached
    got, ops = proc.run(lambda op, c: {A: 4e-3, B: 2e-3}.get(c, 5e-3))
    assert got == {op: B for op in tune.OPS} and len(ops.calls) > 4 * len(tune.OPS)
    entry = tune.read_cache()[tune.shape_key(model)]
    assert tune.final(entry) and all((entry[op]["isa"], entry[op]["threads"]) == B for op in tune.OPS)
    assert ops.clock <= tune.TIME_BUDGET  # the re-check and the measuring share the one budget


def test_stale_compares_a_quiet_rechecks_choice_with_its_runner_up():
    assert tune.stale({"step": (1.6e-3, 1e-3), "batch": (1.4e-3, 1e-3), "loaded": False}) == ["step"]
    assert tune.stale({"step": (1.6e-3, 1e-3), "loaded": True}) == []
    table = _table(step=("avx2", 2))
    table["step"]["times"].update({"avx2/1": 2e-3, "baseline/2": 1.5e-3})
    ops = FakeOps({op: {("avx2", 2): 6e-3, ("avx2", 1): 2e-3, ("baseline", 2): 2e-3, ("baseline", 1): 1e-3}
                   for op in tune.OPS})
    check = tune.recheck_runs(ops.runs(), table, timer=ops.timer, cpu=ops.cpu, paths=("avx2", "baseline"))
    # the runner-up (the choice's count), then the best on another count
    assert [c for o, c in ops.calls if o == "step"] == [("avx2", 2)] * 2 + [("baseline", 2)] * 2 + [("avx2", 1)] * 2
    assert "batch" not in check and check["step"] == (6e-3, 2e-3) and tune.stale(check) == ["step"]
    # runs under MIN_SECONDS: the best of up to REPEATS timed runs after the warm-up
    ops = FakeOps({op: {("avx2", 2): 0.3e-3, ("baseline", 2): 0.1e-3, ("avx2", 1): 1, ("baseline", 1): 1}
                   for op in tune.OPS})
    check = tune.recheck_runs(ops.runs(), table, timer=ops.timer, cpu=ops.cpu, paths=("avx2", "baseline"))
    assert [c for o, c in ops.calls if o == "step"] == [("avx2", 2)] * (1 + tune.REPEATS) + [("baseline", 2)] * (
        1 + tune.REPEATS) + [("avx2", 1)] * 2
    assert check["step"] == pytest.approx((0.3e-3, 0.1e-3))
    # a runner-up on another count: the two alone
    table["step"]["times"]["baseline/1"] = 1.2e-3
    ops = FakeOps({op: {("avx2", 2): 6e-3, ("avx2", 1): 2e-3, ("baseline", 2): 2e-3, ("baseline", 1): 3e-3}
                   for op in tune.OPS})
    check = tune.recheck_runs(ops.runs(), table, timer=ops.timer, cpu=ops.cpu, paths=("avx2", "baseline"))
    assert [c for o, c in ops.calls if o == "step"] == [("avx2", 2)] * 2 + [("baseline", 1)] * 2
    assert check["step"] == pytest.approx((6e-3, 3e-3))


def test_a_thread_count_slowed_by_load_is_rechecked_though_the_runner_up_runs_the_choices(model, cache,
                                                                                          monkeypatch, unforced):
    """Seen on a 2-core VM: the measurement's second core busy, a prefill cached on one thread
    (the runner-up another path, on one thread too), 2x slower than on two: a quiet re-check times
    the best two-thread candidate too, and measures again."""
    paths = _isa.supported_isas()
    if len(paths) < 2:
        pytest.skip("one path on this CPU: no runner-up of the same thread count")
    one, other, two = (paths[0], 1), (paths[1], 1), (paths[0], 2)
    proc = Process(model, monkeypatch)
    busy = {one: 2e-3, other: 2.2e-3}   # two threads: slowed by the load the calling thread did not see
    first = proc.run(lambda op, c: busy.get(c, 6e-3 if c[1] == 2 else 4e-3))[0]
    assert first == {op: one for op in tune.OPS} and tune.final(tune.read_cache()[tune.shape_key(model)])
    quiet = {one: 2e-3, other: 2.2e-3, two: 1e-3}
    got, ops = proc.run(lambda op, c: quiet.get(c, 1.2e-3 if c[1] == 2 else 4e-3))
    assert {c for _, c in ops.calls if c[1] == 2}   # the re-check ran a two-thread candidate
    assert got == {op: two for op in tune.OPS}
    entry = tune.read_cache()[tune.shape_key(model)]
    assert tune.final(entry) and all((entry[op]["isa"], entry[op]["threads"]) == two for op in tune.OPS)


def test_a_partial_table_serves_its_process_and_the_next_process_measures_again(model, cache, monkeypatch,
                                                                                unforced):
    proc = Process(model, monkeypatch)
    slow = lambda op, c: {"step": 5e-3, "batch": 13e-3, "prefill": 0.3}[op] * (1 + 0.1 * c[1])  # noqa: E731
    got, ops = proc.run(slow)
    entry = tune.read_cache()[tune.shape_key(model)]
    assert entry["prefill"]["partial"] and not tune.final(entry)
    assert ops.clock <= tune.TIME_BUDGET
    calls = len(ops.calls)
    assert {op: (p, t) for op, (p, t, _) in model.stream(1).kernel_choice().items()} == got  # this process: kept
    assert len(ops.calls) == calls
    got, ops = proc.run(_fast(_candidates()[-1]))  # the next process: measured again, quickly, in full
    entry = tune.read_cache()[tune.shape_key(model)]
    assert tune.final(entry) and got == {op: _candidates()[-1] for op in tune.OPS}


def test_the_first_stream_on_an_empty_cache_finishes_within_the_budget(model, cache, monkeypatch, unforced):
    # the Qwen layer as measured on a 2-core VM: a 5 ms step, a 13 ms 16-stream step, a 0.2-0.34 s prefill,
    # the slower paths up to 2.3x; the scratch engines take 0.1 s to make
    rank = {p: 1 + 0.4 * i for i, p in enumerate(reversed(_isa.supported_isas()))}
    base = {"step": 5e-3, "batch": 13e-3, "prefill": 0.2}
    proc = Process(model, monkeypatch, setup=0.1)
    got, ops = proc.run(lambda op, c: base[op] * rank[c[0]] * (1.7 if c[1] == 1 and op == "prefill" else 1.0))
    assert ops.clock <= tune.TIME_BUDGET, ops.clock
    entry = tune.read_cache()[tune.shape_key(model)]
    assert entry["step"]["times"] and not tune.final(entry)  # cut by the budget: measured again by the next process
    for op in tune.OPS:  # what was timed is chosen from; an operation left untimed runs the step's path
        e = entry[op]
        if e["times"]:
            assert e["times"][f"{e['isa']}/{e['threads']}"] == min(e["times"].values())
        else:
            assert e["partial"] and e["isa"] == entry["step"]["isa"]


def test_a_real_recheck_times_each_operations_choice_and_runner_up(model, cache, unforced):
    paths = _isa.supported_isas()
    table = _table(*[(paths[-1], 1)] * 3)
    for op in tune.OPS:
        table[op]["times"][f"{paths[0]}/2"] = 2e-3  # the runner-up: another path (or count) on 2 threads
    check = tune.recheck_runs(tune._runners(model, 1), table)
    assert set(check) == set(tune.OPS) | {"loaded"} and isinstance(check["loaded"], bool)
    assert all(len(check[op]) == 2 and min(check[op]) > 0 for op in tune.OPS)
