"""The fastest kernel configuration by measurement, per operation and model shape.

Which path (engine/isa.py) and how many threads run an operation fastest differs from CPU to
CPU and from operation to operation: a one-stream step is a GEMV bound by memory bandwidth
that one core cannot draw, a prefill is a GEMM bound by multiply-add throughput, and which
instruction wins (vdpbf16ps or vfmadd) is the CPU's affair. So no CPU list decides it: on
the first engine of a model's shapes on a CPU (Model.stream), each path this CPU runs and each
thread count up to the cores this process may use is timed on the three operations

    step     one stream, one token
    batch    BATCH_STREAMS streams, one token each
    prefill  one stream, PREFILL_TOKENS tokens, or up to PREFILL_MAX where they take under
             PREFILL_RUN (a small model's prefill is then timed as a GEMM of many rows: which
             path wins can differ between 32 and 2048 tokens)

(each candidate a few runs of one call, the slowest dropped early), the fastest is kept, and
the table is cached as JSON in the user's cache folder, keyed by the CPU's identity and the
build (tune_<cpu>.json: a change of either measures again). `engram-stream tune` measures
again and prints the table.

The first stream() of a model waits for that measurement, so it is kept short (TIME_BUDGET):
the likeliest winner is timed first, so the DROP_SLOWER cut-off works from the first
candidate on; a path whose one-thread warm-up step is more than cores x DROP_SLOWER times the
best step so far is dropped for every thread count and operation (threads divide a time by
the cores at best); batch and prefill try the paths in the order of their step times; a run
longer than LONG_RUN is timed once; the budget counts from the call, the scratch engines'
making included, and no run starts that would end past it (an operation's first guessed from
the step's best); the batch and the prefill time two paths where their share of it is spent and
the whole is not. Then each operation keeps the best so far (none timed: the step's path on the
most threads) and its table entry says "partial". `engram-stream tune` has no budget and times
every candidate.

A measurement taken while the machine was busy is not this CPU's: an operation whose runs got
less than LOADED_SHARE of their wall time as CPU time of the calling thread (which takes a part
of every call: the engine's workers join it) says "loaded". A table with a partial or loaded
entry is used by the process that measured it, cached, and measured again by the next process
(final() is False); a final table is re-checked at each process's first stream() of its shapes
(each operation's choice, its runner-up and the best on another thread count, a warm-up and
one timed run each, within the same budget), and measured again where a quiet re-check finds the choice RECHECK_SLOWER times
either (a busy re-check cannot tell, and keeps it). A measurement past NOTE_AFTER prints one line on stderr, so a first call
does not block without a word.

What wins over the measurement: a caller's step_threads / prefill_threads (the count), and a
forced path (ENGRAM_STREAM_ISA, use_isa: every kernel runs it). ENGRAM_STREAM_TUNE=0 turns
measuring off (the process's path and the default thread counts run; the test suite sets it,
so which path runs there is decided by the tests alone).

The measurement runs on scratch engines of the model's shapes whose rows are private to it:
zero records of the table's layout in anonymous memory (no page of it is touched until read,
and none is written), so it reads nothing from the model's files, row cache or store, and
counts nothing in row_cache_stats(). (Zero is a valid record of every table dtype, and no
kernel's time depends on the values.)

The cache folder is the user's own: created 0700, each file 0600 and replaced atomically under
a lock (tune_<cpu>.json.lock), merged with what other processes wrote meanwhile; a folder or
file owned by another user, writable by group or others, or that cannot be reached (a HOME
this user cannot enter, a file where the folder belongs), is neither read nor written: the
table is then measured for this process only, and one line on stderr says why. A broken file
(not JSON, too deep, another format, CPU or build) is measured again and replaced; an entry
naming a path this CPU does not run (a file of another machine) is ignored, as one line on
stderr says.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import platform
import stat
import sys
import time

import numpy as np

from ..io.files import cache_dir
from . import isa as _isa
from ._base import OPS
from .cpu import CPUINFO, cpuinfo_blocks


ENV = "ENGRAM_STREAM_TUNE"
FORMAT = 1
BATCH_STREAMS = 16
PREFILL_TOKENS = 32
PREFILL_MAX = 256   # a prefill's tokens at most: as many as take PREFILL_RUN on its first candidate
PREFILL_RUN = 10e-3
REPEATS = 3        # timed runs of a candidate at least (its best counts), after one untimed warm-up run
MIN_SECONDS = 2e-3  # and more, up to MAX_REPEATS, until its runs took this long: a 20 us step's best of 3 is noise
MAX_REPEATS = 50
TIE = 0.02         # candidates within 2% of the fastest count as equal: the fewest threads wins (the cores spared)
DROP_SLOWER = 3.0  # a candidate whose warm-up run is this many times the best so far is not timed further
LONG_RUN = 20e-3   # a candidate's timed runs stop once they took this long: its noise is small beside the gaps
LONG_SLOWER = 1.5  # between paths; and a warm-up this long and this many times the best is not timed further (a
                   # warm-up's extra cost, page faults and the team's start, is a small part of so long a run)
TIME_BUDGET = 1.0  # seconds of measuring on a first stream(), its scratch engines included; then the best so far
                   # is kept, marked partial
LOADED_SHARE = 0.8  # a measurement whose calling thread ran less than this share of its wall time is loaded
RECHECK_SLOWER = 1.5  # a cached choice this many times slower than another in a quiet re-check is measured again
NOTE_AFTER = 0.5   # a measurement past this many seconds says so on stderr, once

# /proc/cpuinfo fields that name the CPU (x86, aarch64); per-core fields (MHz, ids) are left out
_IDENTITY_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags",
                    "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision",
                    "Features")


class TuneCacheError(Exception):
    """The cache folder or file is not safe to trust (another owner, or writable by others), or
    cannot be reached."""


class MeasureError(RuntimeError):
    """The measurement cannot run here (its private rows cannot be mapped)."""


def enabled() -> bool:
    """Whether engines measure (ENGRAM_STREAM_TUNE unset or not "0")."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "off", "false", "no")


def cpu_identity(cpuinfo: str = CPUINFO) -> tuple:
    """(key, name): a digest of the first processor's identifying /proc/cpuinfo fields, the machine
    and the cores this process may use; name is the CPU's model name (or the machine)."""
    first = (cpuinfo_blocks(cpuinfo) or [{}])[0]
    fields = {k: v for k, v in first.items() if k in _IDENTITY_FIELDS}
    text = json.dumps([platform.machine(), cores(), sorted(fields.items())])
    name = fields.get("model name") or fields.get("CPU part") or platform.machine() or "unknown CPU"
    return hashlib.sha256(text.encode()).hexdigest()[:16], name


def build_identity() -> str:
    """A digest of the extension modules this process runs (size and mtime of each file): the
    hash and base modules and every registered variant's engine module (the registry names
    them), so a rebuild measures again."""
    from .. import _hash, variants
    from . import _base
    mods = {_hash.__name__: _hash, _base.__name__: _base}
    for v in variants.variants():
        name = getattr(v.engine, "__module__", None)
        if name and name not in mods:
            mods[name] = sys.modules.get(name)
    parts = []
    for name in sorted(mods):
        try:
            st = os.stat(mods[name].__file__)
            parts.append((os.path.basename(mods[name].__file__), st.st_size, st.st_mtime_ns))
        except (AttributeError, TypeError, OSError):  # an engine defined in Python (no file of its own)
            parts.append((name, None, None))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_counts(n: int) -> list:
    """The thread counts timed on n cores: 1, the powers of two below n, and n (at most MAX_THREADS)."""
    from ._base import MAX_THREADS
    n = max(1, min(n, MAX_THREADS))
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def shape_key(model) -> str:
    """What an operation's speed depends on in a model: its variant, weight dtype and layer dims."""
    c = model.cfg
    dims = (c.hc_mult, c.hidden_size, c.engram_dim, c.n_heads, c.head_dim, c.max_ngram_size)
    return f"{model.variant.name}/{model.weight_dtype}/" + "x".join(str(int(d)) for d in dims)


# ---- the choice ----------------------------------------------------------------------------------
def fastest(times: dict) -> tuple:
    """The (path, threads) of the smallest time in {(path, threads): seconds}; candidates within
    TIE of it count as equal: the fewest threads, then the fastest of those."""
    if not times:
        raise ValueError("no candidate was timed")
    low = min(times.values())
    near = [c for c in times if times[c] <= low * (1 + TIE)]
    return min(near, key=lambda c: (c[1], times[c], _isa.ISA_NAMES.index(c[0])))


def measure(run, candidates, timer=time.perf_counter, repeats=REPEATS, deadline=None, cores=1,
            dropped=None, tick=None, least=1, end=None, guess=None, cpu=None, usage=None) -> tuple:
    """({candidate: best seconds}, partial) of run(candidate) (one call of the operation on that
    path and thread count), the candidates in their order: one warm-up run, then `repeats` timed
    ones (more until MIN_SECONDS; fewer once they took LONG_RUN, or past the deadline; one at
    least); its time is the best of them all, the warm-up's included.

    Dropped early: a candidate whose warm-up is DROP_SLOWER times the best time so far (LONG_SLOWER
    times, when the warm-up took LONG_RUN or more) keeps its warm-up time and is not run again; a
    path whose one-thread warm-up, its first candidate, is cores x DROP_SLOWER times the best is
    added to `dropped` (a set; its paths are not run), since no thread count can bring it within
    DROP_SLOWER (cores None: no path is dropped).
    No candidate starts, once `least` were timed, that would end past `deadline` (a timer() value)
    at two runs of the best time so far; partial is then True. `end` (a timer() value, the whole
    budget's): no candidate starts that would end past it, the first `least` included, at two runs
    of the best so far, or of `guess` (seconds, an estimate of one run) before any was timed; and
    no timed run starts past it. tick(): called before each candidate. usage: a dict given the
    "wall" and "cpu" (cpu(): the calling thread's CPU clock) seconds of every run, summed."""
    times = {}
    dropped = set() if dropped is None else dropped
    partial = False
    def timed(c):
        t0, c0 = timer(), cpu() if cpu is not None else 0.0
        run(c)
        took = timer() - t0
        if usage is not None and cpu is not None:
            usage["wall"] = usage.get("wall", 0.0) + took
            usage["cpu"] = usage.get("cpu", 0.0) + cpu() - c0
        return took

    for c in candidates:
        if c[0] in dropped:
            continue
        if end is not None:  # the whole budget: no candidate, however needed, starts that would end past it
            est = min(times.values(), default=guess)
            if timer() + 2 * (est or 0.0) > end or (est is None and timer() >= end):
                partial = True
                break
        # a candidate costs two runs at least (a warm-up, a timed one): one that would end past the deadline
        # does not start
        if len(times) >= least and deadline is not None and timer() + 2 * min(times.values()) > deadline:
            partial = True
            break
        if tick is not None:
            tick()
        first = timed(c)
        best_so_far = min(times.values(), default=None)
        if best_so_far is not None and (first > DROP_SLOWER * best_so_far
                                        or (first >= LONG_RUN and first > LONG_SLOWER * best_so_far)):
            if (cores is not None and c[1] == 1 and first > max(1, cores) * DROP_SLOWER * best_so_far
                    and not any(o[0] == c[0] for o in times)):  # a path already timed keeps its other counts
                dropped.add(c[0])
            times[c] = first
            continue
        best, spent, k = None, 0.0, 0
        while k < MAX_REPEATS:
            if k >= 1 and (spent >= LONG_RUN or (deadline is not None and timer() >= deadline)
                           or (k >= repeats and spent >= MIN_SECONDS)):
                break
            if end is not None and timer() + first > end:  # its warm-up time stands for it
                break
            took = timed(c)
            best = took if best is None else min(best, took)
            spent, k = spent + took, k + 1
        times[c] = first if best is None else min(best, first)  # a warm-up as fast counts: one more sample of a long run, at no cost
    return times, partial


def order(paths, counts, ascending=True) -> list:
    """The candidates of `paths` (likeliest fastest first) x thread counts, the first path on the
    most threads first: a good time to cut the others against. ascending (the step): then each
    path from one thread up, so its one-thread warm-up can drop the path before its other counts
    run. Else (the batch and the prefill, whose work the threads divide best): the two likeliest
    paths on each count from the most threads down (the first two are timed however late:
    a budget cut still compares two paths, as a noisy step may have ordered them wrongly), then
    the others, each from the most threads down."""
    paths = list(paths)
    if not paths:
        return []
    if ascending:
        counts = sorted(set(counts))
        head = (paths[0], counts[-1])
        return [head] + [(p, t) for p in paths for t in counts if (p, t) != head]
    counts = sorted(set(counts), reverse=True)
    return [(p, t) for t in counts for p in paths[:2]] + [(p, t) for p in paths[2:] for t in counts]


def tune_runs(runs: dict, paths, counts, timer=time.perf_counter, budget=TIME_BUDGET, cores=1,
              tick=None, start=None, cpu=None) -> dict:
    """Time `runs` ({op: run((path, threads))}, the operations in OPS order, the step first) on
    `paths` (likeliest fastest first) x `counts`: {op: {"isa", "threads", "times", "partial",
    "loaded"}}. budget: seconds for all of it from `start` (a timer() value; None: this call's start), shared out
    between the operations still to measure, and never passed by a candidate's start (None: every
    candidate timed, no path dropped); the step's times order the candidates of the others and
    the paths it drops are not run again. An operation the budget leaves untimed runs the step's
    path on the most threads, its times empty, partial. cpu: the calling thread's CPU clock
    (None: time.thread_time where timer is time.perf_counter, else not read); an operation whose
    runs got less than LOADED_SHARE of their wall time as CPU time was measured on a loaded
    machine ("loaded": its times are not this CPU's)."""
    start = timer() if start is None else start
    if cpu is None and timer is time.perf_counter:
        cpu = time.thread_time
    end = None if budget is None else start + budget
    dropped = set()
    paths = list(paths)
    table = {}
    step_time = None
    for i, (op, run) in enumerate(runs.items()):
        deadline = None
        if budget is not None:
            left = end - timer()
            deadline = timer() + max(0.0, left) / (len(runs) - i)
        # one run of the op's first candidate, guessed from the step's best (no weight read twice: an upper
        # bound; the prefill's first candidate runs a sizing prefill too: half a run more), so that a budget
        # nearly spent does not start a run it cannot hold
        guess = None if step_time is None else step_time * (BATCH_STREAMS if op == "batch" else 1.5 * PREFILL_TOKENS)
        cands = order([p for p in paths if p not in dropped], counts, ascending=i == 0)
        usage = {}
        times, partial = measure(run, cands, timer=timer, deadline=deadline,
                                 cores=None if budget is None else cores,
                                 dropped=dropped if i == 0 else set(), tick=tick, least=1 if i == 0 else 2,
                                 end=end, guess=guess, cpu=cpu, usage=usage)
        loaded = cpu is not None and usage.get("wall", 0.0) > 0 and usage["cpu"] < LOADED_SHARE * usage["wall"]
        if i == 0 and times:  # the others try the paths by their best step
            step_best = {}
            for (p, _), s in times.items():
                step_best[p] = min(s, step_best.get(p, s))
            step_time = min(step_best.values())
            paths = sorted((p for p in paths if p in step_best and p not in dropped), key=lambda p: step_best[p]) \
                + [p for p in paths if p not in step_best and p not in dropped]
        if times:
            best = fastest(times)
        else:  # not one run fit the budget: the step's path (or the likeliest) on the most threads, unmeasured
            best = (table["step"]["isa"] if table else paths[0], max(counts))
        table[op] = {"isa": best[0], "threads": best[1], "partial": partial or not times, "loaded": bool(loaded),
                     "times": {f"{p}/{t}": float(s) for (p, t), s in times.items()}}
    return table


def final(table) -> bool:
    """Whether a table is this CPU's for good: no operation cut by the budget (partial) or measured
    on a loaded machine. A table that is not is used by the process that measured it, and
    measured again by the next."""
    return not any(table[op].get("partial") or table[op].get("loaded") for op in OPS)


def recheck_runs(runs: dict, table: dict, timer=time.perf_counter, cpu=None, end=None, paths=None) -> dict:
    """A cheap check of a cached table: per operation, its choice, its runner-up (the fastest
    other candidate of its times) and, where the runner-up runs the choice's thread count, the
    fastest candidate on another count (a measurement whose other count was slowed by load
    named a runner-up of the same count: the count itself is re-checked), one warm-up and one
    timed run each (up to REPEATS, the best counting, while they took under MIN_SECONDS), at
    most until `end` (a timer() value): {op: (choice seconds, the fastest other's seconds)}, and
    "loaded": whether those runs got less than LOADED_SHARE of their wall time as CPU time (cpu:
    as tune_runs). An operation with no runner-up (among `paths`, None: those this CPU runs), or
    past `end`, is left out."""
    paths = _isa.supported_isas() if paths is None else paths
    if cpu is None and timer is time.perf_counter:
        cpu = time.thread_time
    out, usage = {}, {"wall": 0.0, "cpu": 0.0}
    for op in OPS:
        e = table[op]
        mine = f"{e['isa']}/{e['threads']}"
        others = sorted((s, k) for k, s in e["times"].items() if k != mine and k.rpartition("/")[0] in paths)
        if not others or op not in runs:
            continue
        keys = [mine, others[0][1]]
        count = next((k for _, k in others if int(k.rpartition("/")[2]) != e["threads"]), None)
        if count is not None and count not in keys:
            keys.append(count)
        got = []
        for key in keys:
            path, _, threads = key.rpartition("/")
            c = (path, int(threads))
            if end is not None and timer() >= end:
                break
            runs[op](c)  # warm-up: a thread count's team starts, a path's code is paged in
            best, spent, k = None, 0.0, 0
            while k < REPEATS and (k == 0 or spent < MIN_SECONDS):  # a run under MIN_SECONDS: its best of a few
                t0, c0 = timer(), cpu() if cpu is not None else 0.0
                runs[op](c)
                took = timer() - t0
                best, spent, k = took if best is None else min(best, took), spent + took, k + 1
                if cpu is not None:
                    usage["wall"] += took
                    usage["cpu"] += cpu() - c0
            got.append(best)
        if len(got) >= 2:
            out[op] = (got[0], min(got[1:]))
    out["loaded"] = cpu is not None and usage["wall"] > 0 and usage["cpu"] < LOADED_SHARE * usage["wall"]
    return out


def stale(check: dict) -> list:
    """The operations of a quiet recheck_runs result whose choice took more than RECHECK_SLOWER times
    the fastest other it timed ([] where the re-check was loaded: it cannot tell)."""
    if check.get("loaded"):
        return []
    return [op for op in OPS if op in check and check[op][0] > RECHECK_SLOWER * check[op][1]]


# Linux's MAP_NORESERVE (Python names it from 3.13): 0x4000 but on powerpc, sparc (0x40) and mips (0x400)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", None)
if _NORESERVE is None:
    _NORESERVE = 0 if not sys.platform.startswith("linux") else next(
        (v for arch, v in (("ppc", 0x40), ("powerpc", 0x40), ("sparc", 0x40), ("mips", 0x400))
         if platform.machine().lower().startswith(arch)), 0x4000)


def _zero_records(n, per, what):
    """uint8 [n, per] of zeros in anonymous memory: reserved, not committed (MAP_NORESERVE: a
    table larger than RAM is mapped), so a table of any size costs only the pages read, each the
    kernel's shared zero page."""
    size = n * per
    try:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
        buf = mmap.mmap(-1, max(size, 1), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, OverflowError, ValueError) as e:
        raise MeasureError(f"the kernel measurement cannot map {size} bytes of private {what} records "
                           f"({getattr(e, 'strerror', None) or e})") from None
    a = np.frombuffer(buf, np.uint8, size).reshape(n, per)
    a.flags.writeable = False
    return a


def private_rows(model, layer):
    """A MappedRows of `layer`'s row count and record layout over zero records private to the
    measurement: the model's tables, row cache and store are not read (MeasureError where the
    memory cannot be mapped)."""
    from ..rows._source import MappedRows
    w = model.layer(layer)
    n = int(model.plan.table_rows[layer])

    def per_row(a):  # a row's bytes of a per-row array [rows, ...], as rows.records.record_layout, no copy
        return int(a.dtype.itemsize * np.prod(a.shape[1:], dtype=np.int64))

    scale = getattr(w, "table_scale", None)
    return MappedRows(_zero_records(n, per_row(w.table), "table"),
                      None if scale is None else _zero_records(n, per_row(scale), "scale"))


def _hidden(rng, engine, n):
    """A random hidden of `engine`'s call of n tokens (None: one token), or None for an input
    layer, which takes none (the engine's hidden_shape)."""
    shape = engine.hidden_shape(n)
    return None if shape is None else rng.standard_normal(shape, dtype=np.float32)


def _runners(model, layer):
    """{op: run(engine_level, threads)} over scratch engines of `layer` (not tuned themselves),
    reading private_rows: the model's own rows stay unread."""
    rng = np.random.default_rng(0)
    cfg = model.cfg
    rows = private_rows(model, layer)  # a MappedRows: both engines may read it
    one = model.variant.engine(model, layer, 1, rows=rows)
    many = model.variant.engine(model, layer, BATCH_STREAMS, rows=rows)
    ids1 = rng.integers(0, cfg.vocab_size, 1, dtype=np.int64)
    idsS = rng.integers(0, cfg.vocab_size, BATCH_STREAMS, dtype=np.int64)
    idsT = rng.integers(0, cfg.vocab_size, PREFILL_MAX, dtype=np.int64)
    h1 = _hidden(rng, one, None)
    hS = _hidden(rng, many, BATCH_STREAMS)
    hT = _hidden(rng, one, PREFILL_TOKENS)
    oS = np.empty(many.out_shape(BATCH_STREAMS), np.float32)

    def step(c):
        one._use_choice(0, _isa.ISA_NAMES.index(c[0]), c[1], "tuning")
        one.step(int(ids1[0]), h1)

    def batch(c):
        many._use_choice(1, _isa.ISA_NAMES.index(c[0]), c[1], "tuning")
        many.step(idsS, hS, out=oS)

    sized = []  # (ids, hidden) of the prefill's runs, sized by its first

    def prefill(c):
        one._use_choice(2, _isa.ISA_NAMES.index(c[0]), c[1], "tuning")
        if not sized:  # PREFILL_TOKENS, or as many more as take PREFILL_RUN at this first candidate's rate
            t0 = time.perf_counter()
            one.prefill(idsT[:PREFILL_TOKENS], hT)
            took = max(time.perf_counter() - t0, 1e-9)
            n = int(min(PREFILL_MAX, max(PREFILL_TOKENS, PREFILL_TOKENS * PREFILL_RUN / took)))
            sized.append((idsT[:n], hT if n == PREFILL_TOKENS else _hidden(rng, one, n)))
        one.prefill(*sized[0])

    return {"step": step, "batch": batch, "prefill": prefill}


def tune_model(model, layer=None, timer=time.perf_counter, paths=None, threads=None, budget=TIME_BUDGET,
               note=None, start=None, cpu=None) -> dict:
    """Measure every operation on the paths this CPU runs (paths: these instead, likeliest fastest
    first) and thread counts (threads: these instead of thread_counts(cores())), within `budget`
    seconds (None: every candidate): {op: {"isa": path, "threads": n, "partial": bool, "times":
    {"path/threads": seconds}}}. A forced path (ENGRAM_STREAM_ISA, use_isa) is the only one
    measured: the others would not run. note: a text printed on stderr once the measuring has
    taken NOTE_AFTER seconds. start: the timer() value the budget counts from (None: this call's start, before
    the scratch engines are made: their making is part of the budget); cpu: as tune_runs."""
    start = timer() if start is None else start
    layer = model.cfg.layer_ids[0] if layer is None else layer
    if paths is None:
        # the widest path first: on the CPUs measured so far it wins, or comes close, every operation
        paths = (_isa.kernel_isa(),) if _isa.forced() else tuple(reversed(_isa.supported_isas()))
    counts = thread_counts(cores()) if threads is None else list(threads)
    said = []

    def tick():
        if note and not said and timer() - start >= NOTE_AFTER:
            said.append(True)
            print(note, file=sys.stderr, flush=True)

    return tune_runs(_runners(model, layer), paths, counts, timer=timer, budget=budget, cores=max(counts),
                     tick=tick, start=start, cpu=cpu)


# ---- the cache ----------------------------------------------------------------------------------
def cache_path(folder=None) -> str:
    """The table of this CPU: <cache_dir()>/tune_<cpu key>.json."""
    return os.path.join(cache_dir() if folder is None else os.fspath(folder), f"tune_{cpu_identity()[0]}.json")


def _check_owned(path, st, what):
    if st.st_uid != os.getuid():
        raise TuneCacheError(f"{path}: the tuning cache {what} is owned by uid {st.st_uid}, not this user "
                             f"({os.getuid()}): not trusted (remove it, or set XDG_CACHE_HOME to a folder of your own)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TuneCacheError(f"{path}: the tuning cache {what} is writable by group or others "
                             f"({stat.filemode(st.st_mode)}): not trusted (chmod go-w it, or remove it)")


def _check_folder(folder, create):
    """The cache folder, checked (TuneCacheError); created 0700 when `create` and missing."""
    try:
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            if not create:
                return False
            os.makedirs(folder, mode=0o700, exist_ok=True)
            st = os.lstat(folder)
    except OSError as e:  # a HOME this user cannot enter, a file where a folder belongs, a read-only disk
        where = f" at {e.filename}" if e.filename and os.fspath(e.filename) != folder else ""
        raise TuneCacheError(f"{folder}: the tuning cache folder cannot be used ({e.strerror}{where}): set "
                             f"XDG_CACHE_HOME to a folder of your own") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TuneCacheError(f"{folder}: the tuning cache folder is not a folder ({stat.filemode(st.st_mode)})")
    _check_owned(folder, st, "folder")
    return True


def _valid_entry(entry) -> bool:
    if not isinstance(entry, dict) or set(entry) != set(OPS):
        return False
    from ._base import MAX_THREADS
    for op in OPS:
        e = entry[op]
        if not (isinstance(e, dict) and e.get("isa") in _isa.ISA_NAMES and type(e.get("threads")) is int
                and 1 <= e["threads"] <= MAX_THREADS and isinstance(e.get("times"), dict)
                and isinstance(e.get("partial", False), bool) and isinstance(e.get("loaded", False), bool)):
            return False
    return True


def read_cache(path=None) -> dict:
    """{shape key: table} of this CPU and build from the cache file; {} when there is none, or it
    is of another CPU, build or format, or broken. An entry naming a path this CPU does not run
    is left out, and one line on stderr says so. TuneCacheError: not safe to read."""
    path = cache_path() if path is None else os.fspath(path)
    if not _check_folder(os.path.dirname(path), create=False):
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as e:  # a symlink (ELOOP) or unreadable
        raise TuneCacheError(f"{path}: the tuning cache file cannot be read safely ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TuneCacheError(f"{path}: the tuning cache file is not a regular file")
        _check_owned(path, st, "file")
        raw = f.read(1 << 20)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past the parser's depth
        return {}
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("cpu") == cpu_identity()[0]
            and doc.get("build") == build_identity() and isinstance(doc.get("tables"), dict)):
        return {}
    tables = {k: v for k, v in doc["tables"].items() if isinstance(k, str) and _valid_entry(v)}
    runs = _isa.supported_isas()
    for k in sorted(tables):
        alien = sorted({tables[k][op]["isa"] for op in OPS} - set(runs))
        if alien:  # the file of another machine: its choice would stop every stream()
            del tables[k]
            _say(f"{path}: entry {k!r} chooses the kernel path {', '.join(alien)}, which this CPU does not run "
                 f"(it runs {', '.join(runs)}): ignored, and measured again (a cache file copied from another "
                 f"machine? remove it)")
    return tables


def write_cache(tables: dict, path=None) -> str:
    """Write {shape key: table} as this CPU's and build's cache file (0600, atomically, the folder
    0700); TuneCacheError where the folder is not the user's own or cannot be used."""
    from ..io.files import atomic_output
    path = cache_path() if path is None else os.fspath(path)
    _check_folder(os.path.dirname(path), create=True)
    key, name = cpu_identity()
    doc = {"format": FORMAT, "cpu": key, "cpu_name": name, "build": build_identity(), "tables": tables}
    try:
        with atomic_output(path) as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(json.dumps(doc, indent=1, sort_keys=True).encode())
    except OSError as e:
        raise TuneCacheError(f"{path}: the tuning cache file cannot be written ({e.strerror})") from None
    return path


def update_cache(key: str, table: dict, path=None) -> str:
    """Add `table` as the entry `key` of the cache file: under an exclusive lock on <file>.lock
    (0600, beside it), the file is read again, the entry merged in and the file replaced, so
    processes tuning at once keep every entry (the lock is held for the merge alone, not the
    measuring). TuneCacheError where the folder or file is not safe or cannot be used."""
    path = cache_path() if path is None else os.fspath(path)
    _check_folder(os.path.dirname(path), create=True)
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise TuneCacheError(f"{lock}: the tuning cache lock cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TuneCacheError(f"{lock}: the tuning cache lock is not a regular file")
        _check_owned(lock, st, "lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            raise TuneCacheError(f"{lock}: the tuning cache lock cannot be taken ({e.strerror})") from None
        tables = read_cache(path)
        tables[key] = table
        return write_cache(tables, path)
    finally:
        os.close(fd)  # releases the lock


# ---- engines ------------------------------------------------------------------------------------
# this process's tables (measured or read): shape key -> the CPU's table; (shape key, path) -> the
# table measured with that path forced (one path timed: for this process and that path alone)
_memo = {}
_said = set()    # the lines said on stderr (each once a process)
_clock = time.perf_counter  # the first stream()'s clocks (the tests give made-up ones)
_cpu = time.thread_time


def _say(text):
    if text not in _said:
        _said.add(text)
        print(f"engram_stream: {text}", file=sys.stderr, flush=True)


def table_for(model, layer=None, retune=False):
    """The measured table of the model's shapes: this process's, else the cache's, else measured
    by this call within TIME_BUDGET (and cached). A cached table that is not final (partial or
    loaded) is measured again; a final one is re-checked first (recheck_runs: its choice and
    the others it names timed once per operation) and measured again where a quiet re-check finds
    its choice RECHECK_SLOWER times one of them; the re-check and the measuring share the one TIME_BUDGET.
    retune: every candidate measured whatever is known (engram-stream tune, which says so itself).
    None where the measurement cannot run (MeasureError, said on stderr; retune raises it)."""
    key = shape_key(model)
    forced = _isa.kernel_isa() if _isa.forced() else None
    if not retune:
        for k in (key, (key, forced)):  # forced: the CPU's table serves too (its thread counts; the path is forced)
            if k in _memo:
                return _memo[k]
    start = _clock()
    usable, tables = True, {}
    try:
        tables = read_cache()
    except TuneCacheError as e:
        usable = False
        _say(f"{e}; the kernel choice is measured for this process only")
    cached = None if retune else tables.get(key)
    try:
        if cached is not None and forced is not None:  # no other path runs to re-check it against
            _memo[key] = cached
            return cached
        if cached is not None and final(cached):
            try:
                check = recheck_runs(_runners(model, model.cfg.layer_ids[0] if layer is None else layer), cached,
                                     timer=_clock, cpu=_cpu, end=start + TIME_BUDGET)
            except MeasureError:  # no re-check can run here: the cached choice stands
                check = {}
            slow = stale(check)
            if not slow:
                _memo[key] = cached
                return cached
            _say(f"the cached kernel choice of {key} for {', '.join(slow)} took over {RECHECK_SLOWER}x another candidate "
                 f"in a quiet re-check: measured again")
        if retune:
            table = tune_model(model, layer, budget=None)
        else:
            table = tune_model(model, layer, timer=_clock, cpu=_cpu, start=start,
                               note=f"engram_stream: measuring the kernel paths for this CPU and these "
                               f"shapes (once; cached in {cache_dir()}; {ENV}=0 skips)")
    except MeasureError as e:
        if retune:
            raise
        _say(f"{e}: the engines of {key} run the default path and threads ({ENV}=0 skips measuring)")
        _memo[key if forced is None else (key, forced)] = None
        return None
    if forced is not None:  # one path measured: this process's table for that path, not this CPU's
        _memo[(key, forced)] = table
        return table
    _memo[key] = table
    if usable:
        try:
            update_cache(key, table)
        except TuneCacheError as e:
            _say(f"{e}; the kernel choice is measured for this process only")
    return table


def apply(model, engine, layer=None) -> None:
    """Give `engine` the measured choice of its model's shapes (measured first when unknown);
    nothing when ENGRAM_STREAM_TUNE=0 or where the measurement cannot run."""
    if not enabled():
        return
    table = table_for(model, layer)
    if table is None:
        return
    for op, name in enumerate(OPS):
        e = table[name]
        engine._use_choice(op, _isa.ISA_NAMES.index(e["isa"]), e["threads"], "tuned")


def format_table(table: dict) -> str:
    """The table as text: per operation the chosen path and threads, then every candidate's time."""
    lines = []
    for op in OPS:
        e = table[op]
        times = sorted(e["times"].items(), key=lambda kv: kv[1])
        best = e["times"].get(f"{e['isa']}/{e['threads']}") or min(e["times"].values(), default=1.0)
        cells = ", ".join(f"{c} {s * 1e3:.3f} ms ({s / best:.2f}x)" for c, s in times) or "not timed"
        cut = " (partial: the time budget ran out; engram-stream tune times them all)" if e.get("partial") else ""
        cut += " (loaded: measured while the machine was busy; the next process measures again)" if e.get("loaded") else ""
        lines.append(f"{op:8s} {e['isa']}/{e['threads']}: {cells}{cut}")
    return "\n".join(lines)
