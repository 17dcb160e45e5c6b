#!/usr/bin/env python
"""Streaming step, streams, threads and prefill: the engine beside torch and the BLAS floor.

    python bench/bench_step.py                 # full run (builds one 2.6 GB demo table, ~15 s)
    python bench/bench_step.py --quick         # demo geometry with a small table, fewer repetitions
    python bench/bench_step.py --json out.json # also save every number
    python bench/bench_step.py --busy 1        # beside a busy loop (--busy-cpu 1: pinned to CPU 1)

Every comparison is measured side by side in one run: the contenders of a group take
turns (the order rotates every repetition), each turn a block of calls sized to ~30 ms;
the table shows the median per-call time over the repetitions and the ratios of medians.
The machine is shared and noisy: ratios are the result, absolute times only indicative.

Sections
  check     the torch peers and the engine == model.forward, token by token (small configs)
  small     one step at hidden 256, hc 4, 2 orders x 4 heads x 32, K 4, tables [100003]*2
  demo      one step at the demo dims (EngramConfig() with layer_ids=[1]: 2.6 GB table)
            and 16 streams per step; floor = one numpy GEMV/GEMM of the fused weight
  threads   two engines on two threads vs one engine (same model), N steps each; the CPUs
            the threads got, and (diagnostic) the same with two forked processes
  prefill   eng.prefill on 2048 tokens vs the torch batch forward of the reference module
            (goal >= 2x, all cores) and vs the register-only FMA floor of all cores (goal <= 1.25x);
            the one-thread prefill vs one core's floor beside it
  16 streams per token are also held to the register-only FMA floor of the step's cores
            (es_fma_chains of the path: goal <= 1.3x); the sgemm floor is printed beside

The main rows ("engine", and every goal) run the unforced engine: no path forced, no thread
count set, so each operation runs the path and threads engine/tune.py measured fastest (what
a user gets; the header names each choice). Rows marked [path]: the same engines forced onto
every other path this CPU runs, on 1 and 2 threads (1, 2, 4, .. the cores), in the same
rotation. The demo's bf16 path runs its avx512 kernels (only V4.1's projection has a bf16 copy,
bench_v41.py): the same code, so it is shown once, as avx512. Choice check, in every row with
[path] rows: the chosen path vs the fastest path at each thread count, and the unforced engine
vs the fastest forced path and count: goal <= 1.05x (in the summary).
"""
import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: the floor is a single-thread GEMV

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from _lib.common import add_busy_args, busy_loops  # noqa: E402
from _lib.kernels import FmaRunner, forced_now  # noqa: E402
from _lib.step_runners import (HAVE_TORCH, LAYER, engine_runner, floor_runners, torch, torch_peer,  # noqa: E402
                               torch_runner)
from _lib.timing import interleaved  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.engine import isa as _isa  # noqa: E402
from engram_stream.engine import tune  # noqa: E402

SMALL = dict(engram_vocab_size=[100003, 100003], max_ngram_size=3, n_embed_per_ngram=128, n_head_per_ngram=4,
             layer_ids=[1], kernel_size=4, hidden_size=256, hc_mult=4)
DEMO = dict(layer_ids=[1])                                   # EngramConfig() defaults otherwise
DEMO_QUICK = dict(layer_ids=[1], engram_vocab_size=[20011, 20011])  # same geometry, small table


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------
def med(xs):
    return float(np.median(xs))


def paired(a, b):
    """Median over repetitions of a[r] / b[r]."""
    return float(np.median(np.asarray(a) / np.asarray(b)))


def fmt_t(s):
    if s < 1e-3:
        return f"{s * 1e6:8.1f} us"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.3f} s "


class Report:
    def __init__(self):
        self.rows, self.data = [], {}

    def section(self, title):
        self.rows.append(("section", title))
        print(f"\n== {title}", flush=True)

    def time(self, key, what, times, note=""):
        m = med(times)
        self.data[key] = {"median_s": m, "min_s": float(np.min(times)), "samples_s": [float(x) for x in times]}
        line = f"  {what:<52s} {fmt_t(m)}   (min {fmt_t(float(np.min(times))).strip()}, n={len(times)}) {note}"
        self.rows.append(("time", line))
        print(line, flush=True)
        return m

    def ratio(self, key, what, value, goal=None, ok=None, paired=None):
        """value: the ratio of the medians; paired: the median of the per-repetition ratios
        (blocks measured next to each other), a check that drifting load did not make it."""
        self.data[key] = {"ratio": value, "paired_ratio": paired, "goal": goal, "met": ok}
        verdict = "" if ok is None else ("  MET" if ok else "  NOT MET")
        pr = f"(paired {paired:5.2f}x)" if paired is not None else " " * 16
        line = f"  {what:<52s} {value:8.2f}x {pr}  " + (f"goal {goal}" if goal else "") + verdict
        self.rows.append(("ratio", line))
        print(line, flush=True)

    def note(self, text):
        self.rows.append(("note", text))
        print(f"  {text}", flush=True)


# ---------------------------------------------------------------------------------------
# contenders
# ---------------------------------------------------------------------------------------
# The thread counts of the [path] rows: those engine/tune.py times (1, 2, 4, .. the cores)
THREADS = tune.thread_counts(tune.cores())
FMA_RUNNERS = {}  # (isa, threads) -> FmaRunner
# The demo's kernels on the bf16 path are its avx512 ones (only V4.1's projection has a bf16
# copy, timed in bench_v41.py): the same code, so its rows are the avx512 rows, shown once.
SAME_CODE = {"bf16": "avx512"}
PATHS = [i for i in reversed(_isa.supported_isas()) if SAME_CODE.get(i, i) == i]  # widest first
GOAL = 1.05  # the chosen path and threads within 5% of the fastest


def shown(path):
    """The path whose rows time `path`'s code (SAME_CODE)."""
    return SAME_CODE.get(path, path)


def path_runners(runs, name, model, S=1, cpu=None, threads=THREADS):
    """runs[f"{name}[path,t<n>]"]: the engine of `model` (S streams) forced onto each path of PATHS
    on each thread count, for the rotation; cpu: {contender: [CPU s, wall s]} kept of each."""
    for isa in PATHS:
        for th in threads:
            k = f"{name}[{isa},t{th}]"
            r = engine_runner(model, S=S, threads=th)
            if cpu is not None:
                cpu[k] = [0.0, 0.0]
                r = cpus_got(r, cpu[k])
            runs[k] = on_isa(isa, r)


def choice_checks(rep, key, t, groups, threads=THREADS, label=None):
    """Whether the engine's choice (engine/tune.py) is the fastest. groups: [(what, op, engine,
    chosen, name)]: the unforced contender t[chosen], whose engine's kernel_choice()[op] names its
    path and threads, beside the forced contenders t[f"{name}[path,t<n>]"]. Per thread count: the
    chosen path's time vs the fastest path's; and the unforced contender vs the fastest of every
    path and count. Each within GOAL: MET. Returns [(what, ratio, paired, goal, met)] for the
    summary (label: its rows' prefix); rep.data[key] holds them."""
    out, data = [], []
    goal = f"<= {GOAL}x"
    for what, op, eng, chosen, name in groups:
        path, n, why = eng.kernel_choice()[op]
        p = shown(path)
        alias = f" (= {p})" if p != path else ""
        every = {}
        for th in threads:
            row = {i: t[f"{name}[{i},t{th}]"] for i in PATHS}
            every.update({(i, th): x for i, x in row.items()})
            best = min(row, key=lambda i: med(row[i]))
            r, pr = med(row[p]) / med(row[best]), paired(row[p], row[best])
            line = (f"{what}, {th} thread(s): chosen path {path}{alias} {fmt_t(med(row[p])).strip()} vs fastest "
                    f"{best} {fmt_t(med(row[best])).strip()}")
            data.append({"what": line, "op": op, "chosen": path, "fastest": best, "ratio": r, "paired": pr,
                         "goal": goal, "met": r <= GOAL})
            rep.ratio(f"{key}.{what}, {th} thread(s)", line, r, goal, r <= GOAL, pr)
            out.append((f"{label + ': ' if label else ''}{what}, {th}t: path {path} vs {best}", r, pr, goal,
                        r <= GOAL))
        best = min(every, key=lambda c: med(every[c]))
        r, pr = med(t[chosen]) / med(every[best]), paired(t[chosen], every[best])
        line = (f"{what}: unforced ({path}/{n}, {why}) {fmt_t(med(t[chosen])).strip()} vs fastest forced "
                f"{best[0]}/{best[1]} {fmt_t(med(every[best])).strip()}")
        data.append({"what": line, "op": op, "chosen": f"{path}/{n}", "fastest": f"{best[0]}/{best[1]}",
                     "ratio": r, "paired": pr, "goal": goal, "met": r <= GOAL})
        rep.ratio(f"{key}.{what}, unforced", line, r, goal, r <= GOAL, pr)
        out.append((f"{label + ': ' if label else ''}{what}: {path}/{n} vs {best[0]}/{best[1]}", r, pr, goal,
                    r <= GOAL))
    rep.data[key] = data
    return out


def side_by_side(rep, key, rows):
    """rows {what: {isa: times}}: each path's median beside the others' in one line, a wider
    path (later in ISA_NAMES) slower than a narrower one by more than 2% flagged LOSES; the
    flags go to rep.data[key]."""
    losses = []
    for what, by in rows.items():
        order = sorted(by, key=_isa.ISA_NAMES.index)
        m = {i: med(by[i]) for i in order}
        flags = [f"{w} {m[w] / m[n]:.2f}x of {n}" for j, n in enumerate(order) for w in order[j + 1:]
                 if m[w] > 1.02 * m[n]]
        losses += [f"{what}: {f}" for f in flags]
        rep.note(f"side by side  {what:<44s} " + "  ".join(f"{i} {fmt_t(m[i]).strip()}" for i in order)
                 + ("   LOSES: " + "; ".join(flags) if flags else ""))
    rep.data[key] = losses


def cpus_got(run, acc):
    """`run`, adding its process CPU time and wall time to acc [cpu, wall]: the CPUs a
    multi-threaded contender actually got (on a shared machine a thread may find no core)."""
    def r(n):
        c, w = time.process_time(), time.perf_counter()
        run(n)
        acc[0] += time.process_time() - c
        acc[1] += time.perf_counter() - w
    return r


def on_isa(isa, run):
    """`run` with the kernels on path `isa` (engram_stream.engine.isa), then as before (forced or
    not): paths compared in one run."""
    def r(n):
        before = forced_now()
        _isa.use_isa(isa)
        try:
            run(n)
        finally:
            _isa.use_isa(before)
    return r


NATIVE_PEAK = """
import os, time, numpy as np
a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32); b = a.copy()
best = 0.0
for _ in range(7):
    t = time.perf_counter(); a @ b; best = max(best, 2 * 2048**3 / (time.perf_counter() - t))
print(best)
"""


def native_sgemm_peak():
    """Single-core sgemm GFLOP/s of numpy's OpenBLAS with its native kernel: OPENBLAS_CORETYPE
    and OPENBLAS_L2_SIZE lifted in this subprocess only (the FMA floor of the goals)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", NATIVE_PEAK], env=env, capture_output=True, text=True, check=True)
    return float(r.stdout) / 1e9


# ---------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------
def check_engine_only():
    """Without torch: the engine == model.forward on one small config."""
    cfg = EngramConfig(engram_vocab_size=[211, 199], n_embed_per_ngram=32, n_head_per_ngram=4, layer_ids=[1],
                       kernel_size=4, hidden_size=40, hc_mult=4, vocab_size=600)
    model = EngramModel.init(cfg, seed=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(1, 40))
    hidden = rng.standard_normal((1, 40, 4, 40)).astype(np.float32)
    ref = model.forward(1, ids, hidden)
    eng = model.stream(1)
    for t in range(40):
        np.testing.assert_allclose(eng.step(int(ids[0, t]), hidden[0, t]), ref[0, t], rtol=2e-4, atol=2e-5)
    return 40


def step_section(rep, key, model, reps, target, streams16=False):
    """The unforced engine (the path and threads measured fastest: engine/tune.py) beside torch,
    the BLAS floors and the same engine forced onto every path (PATHS) on each thread count
    (THREADS); streams16: also bf16 weights, 16 streams, and the register-only FMA floors of the
    16-stream rows' chosen path. Returns {contender: seconds per call, one a repetition}, and
    under "checks" the choice checks' summary rows."""
    cfg = model.cfg
    M, E = (cfg.hc_mult + 1) * cfg.hidden_size, cfg.engram_dim
    runs = {"engine": engine_runner(model)}
    cpu = {}  # contender -> [process CPU s, wall s]
    engines = {"engine": runs["engine"].engine}
    path_runners(runs, "engine", model)
    if HAVE_TORCH:
        runs["torch"] = torch_runner(model)
    fw, fwt = floor_runners(model)
    runs["floor_W@e"], runs["floor_e@WT"] = fw, fwt
    models = {"": model}
    if streams16:
        models["_bf16"] = bf16 = model.with_weight_dtype("bfloat16")  # projection weights as bf16 (tables shared)
        runs["engine_bf16"] = engine_runner(bf16)
        engines["engine_bf16"] = runs["engine_bf16"].engine
        path_runners(runs, "engine_bf16", bf16)
        for wname, m in models.items():  # 16 streams: the chosen, and every path on each count
            k = f"engine16{wname}"
            cpu[k] = [0.0, 0.0]
            r = engine_runner(m, S=16)
            engines[k] = r.engine
            runs[k] = cpus_got(r, cpu[k])
            path_runners(runs, k, m, S=16, cpu=cpu)
        for wname in models:  # the FMA floors of the chosen 16-stream path, in the same rotation
            isa = shown(engines[f"engine16{wname}"].kernel_choice()["batch"][0])
            for th in THREADS:
                runs.setdefault(f"fma[{isa},t{th}]", FMA_RUNNERS.setdefault((isa, th), FmaRunner(isa, th)))
        if HAVE_TORCH:
            runs["torch16"] = torch_runner(model, S=16)
        fw16, fwt16 = floor_runners(model, S=16)
        runs["floor16_e@W.T"], runs["floor16_e@WT"] = fw16, fwt16
    t = interleaved(runs, reps, target)

    def choice(name):
        e = engines[name]
        path, n, why = e.kernel_choice()["step" if e.n_streams == 1 else "batch"]
        return f"{path}/{n}, {why}"
    rep.time(f"{key}.engine", f"engine step  eng.step(tok, hidden, out=out) [{choice('engine')}]", t["engine"])
    if HAVE_TORCH:
        rep.time(f"{key}.torch", "torch incremental step (1 thread, inference_mode)", t["torch"])
    a = rep.time(f"{key}.floor_W@e", f"floor: numpy W[{M},{E}] @ e", t["floor_W@e"])
    b = rep.time(f"{key}.floor_e@WT", f"floor: numpy e @ WT[{E},{M}] (W.T contiguous)", t["floor_e@WT"])
    t["floor"] = t["floor_W@e"] if a <= b else t["floor_e@WT"]   # the faster layout is the floor
    rep.data[f"{key}.floor"] = {"median_s": min(a, b), "layout": "W@e" if a <= b else "e@WT"}
    if streams16:
        rep.time(f"{key}.engine_bf16", f"engine step, bf16 projection weights [{choice('engine_bf16')}]",
                 t["engine_bf16"])
        for wname, wdesc in (("", "float32"), ("_bf16", "bf16")):
            k = f"engine16{wname}"
            got = cpu[k][0] / max(cpu[k][1], 1e-9)
            rep.data[f"{key}.{k}_cpus"] = got
            rep.time(f"{key}.{k}", f"engine, 16 streams, {wdesc}: one step of 16 tokens [{choice(k)}]", t[k],
                     f"[{got:.2f} CPUs]")
            rep.time(f"{key}.{k}_per_token", f"engine, 16 streams, {wdesc}: per token (step / 16)",
                     [x / 16 for x in t[k]])
    names = [("engine", "step", "float32")] + ([("engine_bf16", "step", "bf16"), ("engine16", "16 streams", "float32"),
                                                 ("engine16_bf16", "16 streams", "bf16")] if streams16 else [])
    for name, what, wdesc in names:
        for isa in PATHS:
            for th in THREADS:
                k = f"{name}[{isa},t{th}]"
                per = 16 if name.startswith("engine16") else 1
                note = f"[{cpu[k][0] / max(cpu[k][1], 1e-9):.2f} CPUs]" if k in cpu else ""
                rep.time(f"{key}.{k}", f"  {what}, {wdesc}, {isa}{' (= bf16)' if isa == 'avx512' and 'bf16' in _isa.supported_isas() else ''}, "
                         f"{th} thread(s)" + (" (per token)" if per > 1 else ""), [x / per for x in t[k]], note)
    if HAVE_TORCH and streams16:
        rep.time(f"{key}.torch16", "torch incremental, 16 streams: one step", t["torch16"])
    rows = {f"{what}, {wdesc} weights, {th} thread(s)": {isa: t[f"{name}[{isa},t{th}]"] for isa in PATHS}
            for name, what, wdesc in names for th in THREADS}
    side_by_side(rep, f"{key}.wider_path_loses", rows)
    t["checks"] = choice_checks(rep, f"{key}.choice", t, [
        (f"{what}, {wdesc} weights", "step" if what == "step" else "batch", engines[name], name, name)
        for name, what, wdesc in names], label=key)
    t["engines"] = engines
    if streams16:
        a = rep.time(f"{key}.floor16_e@W.T", f"floor: numpy e[16,{E}] @ W.T (view)", t["floor16_e@W.T"])
        b = rep.time(f"{key}.floor16_e@WT", f"floor: numpy e[16,{E}] @ WT (contiguous)", t["floor16_e@WT"])
        t["floor16"] = t["floor16_e@W.T"] if a <= b else t["floor16_e@WT"]
    return t


def released_together(workers, barrier):
    """Start the workers (threads or processes that wait at `barrier` first), pass the barrier with
    them; wall seconds from there until the last one has joined."""
    for w in workers:
        w.start()
    barrier.wait()
    t = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - t


def thread_section(rep, key, model, reps, n_steps):
    """One engine doing n steps (on a worker thread) vs two engines on two threads, n each.
    Also the CPUs the threads actually got (sum of thread CPU time / wall): on a shared
    machine a second thread may have no free core to run on."""
    engines = [engine_runner(model, threads=1), engine_runner(model, threads=1)]  # (the tuned path)
    for r in engines:
        r(n_steps // 10 + 1)  # warm

    def wall(k):
        barrier = threading.Barrier(k + 1)
        cpu = [0.0] * k

        def work(i):
            barrier.wait()
            c = time.thread_time()
            engines[i](n_steps)
            cpu[i] = time.thread_time() - c
        w = released_together([threading.Thread(target=work, args=(i,)) for i in range(k)], barrier)
        return w, sum(cpu) / w

    def wall_proc():
        """Diagnostic: the same with two forked processes (no GIL between them; the model's
        pages are shared copy-on-write)."""
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(3)

        def work(i):
            engines[i](n_steps // 10 + 1)  # absorb the copy-on-write faults before the clock
            barrier.wait()
            engines[i](n_steps)
        return released_together([ctx.Process(target=work, args=(i,)) for i in range(2)], barrier)

    one, two, c1, c2, procs = [], [], [], [], []
    for i in range(reps):
        for k in ((1, 2, 0) if i % 2 == 0 else (0, 2, 1)):
            if k == 0:
                procs.append(wall_proc())
                continue
            w, c = wall(k)
            (one if k == 1 else two).append(w)
            (c1 if k == 1 else c2).append(c)
    t1 = rep.time(f"{key}.one_thread_wall", f"1 engine x {n_steps} steps, wall", one,
                  f"[{med(c1):.2f} CPUs busy]")
    t2 = rep.time(f"{key}.two_threads_wall", f"2 engines on 2 threads x {n_steps} steps each, wall", two,
                  f"[{med(c2):.2f} CPUs busy]")
    t3 = rep.time(f"{key}.two_procs_wall", f"  diagnostic: 2 forked processes x {n_steps} steps each", procs)
    rep.data[f"{key}.cpus_busy"] = {"one": med(c1), "two": med(c2), "two_samples": c2}
    rep.ratio(f"{key}.procs_ratio", "  diagnostic: throughput 2 processes / 1 thread", 2 * t1 / t3, None, None,
              paired(2 * np.asarray(one), procs))
    return 2 * t1 / t2, paired(2 * np.asarray(one), two), med(c2)


def prefill_section(rep, key, model, reps, T):
    cfg = model.cfg
    rng = np.random.default_rng(7)
    ids = rng.integers(0, cfg.vocab_size, size=T).astype(np.int64)
    hidden = rng.standard_normal((T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    eng = model.stream(LAYER)
    out = np.empty_like(hidden)
    eng.prefill(ids, hidden, out=out)  # warm (scratch, page cache of the rows)
    runs = {}

    def engine_run(e):
        def run(n):
            for _ in range(n):
                e.reset()
                e.prefill(ids, hidden, out=out)
        return run
    cpu = [0.0, 0.0]
    runs["engine"] = cpus_got(engine_run(eng), cpu)  # the unforced engine: the tuned path and threads
    path, engine_threads, why = eng.kernel_choice()["prefill"]
    isa = shown(path)
    for th in THREADS:  # every path on each count
        e = model.stream(LAYER)
        e.prefill_threads = th
        e.prefill(ids, hidden, out=out)  # warm
        for i in PATHS:
            runs[f"engine[{i},t{th}]"] = on_isa(i, engine_run(e))
    # the floors of the chosen path, in the same rotation (~0.1-0.3 s a call): its threads' cores,
    # and one core's beside the one-thread prefill: the kernel's distance from its peak, which a
    # machine whose second core is busy leaves measurable
    for th in sorted({engine_threads, 1}):
        runs[f"fma[{isa},t{th}]"] = FMA_RUNNERS.setdefault((isa, th, "prefill"), FmaRunner(isa, th, rounds=20_000_000))
    default_threads = None
    if HAVE_TORCH:
        default_threads = DEFAULT_TORCH_THREADS
        tb = torch_peer.TorchBatch(model, LAYER)
        ids2, hid_t = ids[None], torch.from_numpy(hidden)[None]
        ref = tb.forward(ids2, hid_t).numpy()[0]
        np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5, err_msg="prefill: engine != torch batch")

        def torch_run(threads):
            def run(n):
                torch.set_num_threads(threads)
                try:
                    for _ in range(n):
                        tb.forward(ids2, hid_t)
                finally:
                    torch.set_num_threads(1)
            return run
        runs["torch_default"] = torch_run(default_threads)
        runs["torch_1"] = torch_run(1)
        # the numpy hash inside the torch forward, for reference
        runs["hash_numpy"] = lambda n: [model.plan.hash_numpy(ids2, layers=[LAYER]) for _ in range(n)]
    t = {k: [] for k in runs}
    for k in runs:  # warm-up
        runs[k](1)
    for r in range(reps):
        names = list(runs)
        for j in range(len(names)):
            k = names[(r + j) % len(names)]
            s = time.perf_counter()
            runs[k](1)
            t[k].append(time.perf_counter() - s)
    rep.data[f"{key}.engine_cpus"] = cpu[0] / max(cpu[1], 1e-9)
    rep.time(f"{key}.engine", f"engine prefill, {T} tokens [{path}/{engine_threads}, {why}]", t["engine"],
             f"[{cpu[0] / max(cpu[1], 1e-9):.2f} CPUs]")
    for th in THREADS:
        for i in PATHS:
            rep.time(f"{key}.engine[{i},t{th}]", f"  engine prefill, {T} tokens, {i}, {th} thread(s)",
                     t[f"engine[{i},t{th}]"])
    side_by_side(rep, f"{key}.wider_path_loses",
                 {f"prefill {T}, {th} thread(s)": {i: t[f"engine[{i},t{th}]"] for i in PATHS} for th in THREADS})
    t["checks"] = choice_checks(rep, f"{key}.choice", t, [(f"prefill {T}", "prefill", eng, "engine", "engine")])
    t["chosen"] = (isa, engine_threads)
    if HAVE_TORCH:
        rep.time(f"{key}.torch_default", f"torch batch forward, default threads ({default_threads})",
                 t["torch_default"])
        rep.time(f"{key}.torch_1", "torch batch forward, 1 thread", t["torch_1"])
        rep.time(f"{key}.hash_numpy", "  of which: numpy hash of the ids (reference expression)",
                 t["hash_numpy"])
    return t


DEFAULT_TORCH_THREADS = None


def fma_floor_per_token(cfg, meta):
    """One token's projections (2*M*E flops) at the native single-core sgemm peak, seconds."""
    if "native_sgemm_gflops" not in meta:
        meta["native_sgemm_gflops"] = native_sgemm_peak()
    M, E = (cfg.hc_mult + 1) * cfg.hidden_size, cfg.engram_dim
    return 2 * M * E / (meta["native_sgemm_gflops"] * 1e9)


def register_fma_gflops(isa, threads, rounds=20_000_000):
    """The register-only FMA rate of path `isa` (engram_stream.demo._engine._fma_chains: 12
    vector multiply-add chains, 16 on neon, no memory) on `threads` threads at once, GFLOP/s in all,
    best of 3. The sgemm floor above is a library's kernel; this is the FMA units' own."""
    from engram_stream.demo import _engine
    best = 0.0
    for _ in range(3):
        done = [0] * threads

        def work(i):
            done[i] = _engine._fma_chains(rounds)
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        before = forced_now()
        _isa.use_isa(isa)
        try:
            s = time.perf_counter()
            for th in pool:
                th.start()
            for th in pool:
                th.join()
            best = max(best, 2 * sum(done) / (time.perf_counter() - s) / 1e9)
        finally:
            _isa.use_isa(before)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small-table demo geometry, fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per group (default 15, quick 7)")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["small", "demo", "threads", "prefill"], help="skip a section (repeatable)")
    add_busy_args(ap)
    args = ap.parse_args(argv)
    with busy_loops(args.busy, args.busy_cpu) as busy:
        return bench(args, busy)


def bench(args, busy):
    global DEFAULT_TORCH_THREADS
    reps = args.reps or (7 if args.quick else 15)
    target = 0.01 if args.quick else 0.03
    rep = Report()
    if HAVE_TORCH:
        DEFAULT_TORCH_THREADS = torch.get_num_threads()
        torch.set_num_threads(1)  # single-thread comparisons; prefill switches to the default
    load0 = os.getloadavg()
    meta = {"argv": sys.argv, "quick": args.quick, "reps": reps, "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "numpy": np.__version__,
            "torch": torch.__version__ if HAVE_TORCH else None, "torch_default_threads": DEFAULT_TORCH_THREADS,
            "loadavg_start": load0, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
            "kernel_isa": _isa.choice(), "paths": PATHS, "same_code": SAME_CODE, "threads": THREADS, **busy}
    print(f"bench_step: the main rows run the unforced engine: the path and threads measured fastest "
          f"(engine/tune.py; {_isa.choice()[1]}); rows marked [path]: the same engines forced onto each path "
          f"({', '.join(PATHS)}) on {', '.join(map(str, THREADS))} thread(s)"
          + "".join(f"; {a} runs the demo's {b} kernels (the same code: shown once, as {b})"
                    for a, b in SAME_CODE.items() if a in _isa.supported_isas()))
    print(f"bench_step: {'quick' if args.quick else 'full'} run, {reps} interleaved repetitions per group; "
          f"{os.cpu_count()} CPUs, load average {load0[0]:.2f}; torch "
          f"{meta['torch'] or 'not installed'} (default threads {DEFAULT_TORCH_THREADS})"
          + (f"; {busy['busy']} busy loop(s) beside it (CPU {busy['busy_cpu']})" if busy["busy"] else ""))

    rep.section("check: peers and engine == model.forward, token by token (rtol 2e-4, atol 2e-5)")
    t0 = time.perf_counter()
    if HAVE_TORCH:
        if args.quick:
            saved = torch_peer.CHECK_CONFIGS
            torch_peer.CHECK_CONFIGS = saved[:1]
            n = torch_peer.check(verbose=False)
            torch_peer.CHECK_CONFIGS = saved
        else:
            n = torch_peer.check(verbose=False)
        rep.note(f"OK: {n} torch-peer tokens (S=1 and S=3, both hash modes), TorchBatch, engine step/prefill "
                 f"({time.perf_counter() - t0:.1f} s)")
    else:
        n = check_engine_only()
        rep.note(f"OK: engine, {n} tokens (torch not installed: torch rows skipped)")

    summary = []

    def ratio(key, what, a, b, goal=None, test=None, scale=1.0, summ=None):
        """ratio of medians of a/b (times scale), and the paired per-repetition ratio."""
        r = scale * med(a) / med(b)
        pr = scale * paired(a, b)
        ok = None if test is None else bool(test(r))
        rep.ratio(key, what, r, goal, ok, pr)
        if summ:
            summary.append((summ, r, pr, goal or "-", ok))
        return r

    if "small" not in args.skip:
        cfg = EngramConfig(**SMALL)
        model = EngramModel.init(cfg, seed=0)
        rep.section(f"small dims: D={cfg.hidden_size} G={cfg.hc_mult} E={cfg.engram_dim} "
                    f"({cfg.max_ngram_size - 1} orders x {cfg.n_head_per_ngram} heads x {cfg.head_dim}) "
                    f"K={cfg.kernel_size}, tables {cfg.engram_vocab_size}; single thread")
        t = step_section(rep, "small", model, reps, target)
        summary.extend(t["checks"])
        if HAVE_TORCH:
            ratio("small.torch_over_engine", "torch step / engine step", t["torch"], t["engine"],
                  ">= 10x", lambda r: r >= 10, summ="small: torch step / engine step")
        ratio("small.engine_over_floor", "engine step / GEMV floor", t["engine"], t["floor"],
              summ="small: engine step / GEMV floor")
        if "threads" not in args.skip:
            rep.section("threads at small dims: 1 vs 2 engines (own engine per thread, same model)")
            r, pr, cpus = thread_section(rep, "threads_small", model, max(5, reps // 2),
                                         2000 if not args.quick else 500)
            rep.ratio("threads_small.throughput_ratio", "throughput 2 threads / 1 thread", r, ">= 1.6x", r >= 1.6, pr)
            summary.append((f"small: 2-thread throughput ({cpus:.2f} CPUs got)", r, pr, ">= 1.6x", r >= 1.6))
        del model

    if not ({"demo", "threads", "prefill"} <= set(args.skip)):
        kw = DEMO_QUICK if args.quick else DEMO
        t0 = time.perf_counter()
        cfg = EngramConfig(**kw)
        model = EngramModel.init(cfg, seed=0)
        built = time.perf_counter() - t0
        tab_gb = model.layer(LAYER).table.nbytes / 1e9
        print(f"\n(built the demo-dims model: table {tab_gb:.2f} GB in {built:.1f} s)")
        if "demo" not in args.skip:
            rep.section(f"demo dims: D={cfg.hidden_size} G={cfg.hc_mult} E={cfg.engram_dim} "
                        f"({cfg.max_ngram_size - 1} orders x {cfg.n_head_per_ngram} heads x {cfg.head_dim}) "
                        f"K={cfg.kernel_size}, table {tab_gb:.2f} GB; single thread")
            t = step_section(rep, "demo", model, reps, target, streams16=True)
            summary.extend(t["checks"])
            ratio("demo.engine_over_floor", "engine step / GEMV floor", t["engine"], t["floor"],
                  "<= 1.15x", lambda r: r <= 1.15, summ="demo: engine step / GEMV floor")
            if HAVE_TORCH:
                ratio("demo.torch_over_engine", "torch step / engine step", t["torch"], t["engine"],
                      summ="demo: torch step / engine step")
            ratio("demo.per_token16_over_one", "16 streams per token / 1 stream step", t["engine16"], t["engine"],
                  "<= 0.333x", lambda r: r <= 1 / 3, scale=1 / 16, summ="demo: 16-stream per token / 1-stream")
            ratio("demo.engine16_over_floor16", "engine 16-stream step / GEMM[16] floor", t["engine16"],
                  t["floor16"], summ="demo: engine 16-stream / GEMM[16] floor")
            ratio("demo.bf16_over_f32", "bf16-weight step / float32 step", t["engine_bf16"], t["engine"],
                  "<= 0.6x", lambda r: r <= 0.6, summ="demo: bf16 step / float32 step")
            fma_floor = fma_floor_per_token(cfg, meta)
            rep.note(f"native single-core sgemm peak {meta['native_sgemm_gflops']:.0f} GFLOP/s: sgemm floor "
                     f"per token {fma_floor * 1e6:.1f} us (one core)")
            M, E = (cfg.hc_mult + 1) * cfg.hidden_size, cfg.engram_dim
            for wname, wdesc in (("", "f32"), ("_bf16", "bf16")):
                isa = shown(t["engines"][f"engine16{wname}"].kernel_choice()["batch"][0])  # the chosen path
                for th in THREADS:  # the floor: the path's register-only FMA peak of the step's cores
                    peaks = FMA_RUNNERS[(isa, th)].gflops(t[f"fma[{isa},t{th}]"])  # one a repetition
                    meta[f"register_fma_gflops_{th}t[{isa}]"] = peaks
                    rfloor = [2 * M * E / (g * 1e9) for g in peaks]
                    rep.note(f"register-only FMA peak ({isa}, {th} threads at once, in the rotation): median "
                             f"{med(peaks):.0f} GFLOP/s [{min(peaks):.0f} .. {max(peaks):.0f}]: floor per token "
                             f"{med(rfloor) * 1e6:.1f} us")
                    k16 = f"engine16{wname}[{isa},t{th}]"
                    what = f"16 streams per token / FMA floor ({isa}, {wdesc}, {th} thr)"
                    ratio(f"demo.per_token16_over_fma_floor[{isa},{wdesc},t{th}]", what,
                          t[k16], rfloor, "<= 1.3x", lambda r: r <= 1.3, scale=1 / 16,
                          summ=f"demo: 16-str/tok / FMA floor [{isa},{wdesc},{th}t]")
            if HAVE_TORCH:
                ratio("demo.torch16_over_engine16", "torch 16-stream step / engine 16-stream step",
                      t["torch16"], t["engine16"], summ="demo: torch 16-stream / engine 16-stream")
        if "threads" not in args.skip:
            rep.section("threads at demo dims: 1 vs 2 engines (own engine per thread, same model)")
            r, pr, cpus = thread_section(rep, "threads_demo", model, max(5, reps // 2), 300 if not args.quick else 60)
            rep.ratio("threads_demo.throughput_ratio", "throughput 2 threads / 1 thread", r, ">= 1.6x", r >= 1.6, pr)
            summary.append((f"demo: 2-thread throughput ({cpus:.2f} CPUs got)", r, pr, ">= 1.6x", r >= 1.6))
        if "prefill" not in args.skip:
            T = 2048
            rep.section(f"prefill of {T} tokens at demo dims (engine and torch: default threads, and 1)")
            t = prefill_section(rep, "prefill", model, max(5, reps // 2), T)
            summary.extend(t["checks"])
            isa, cores = t["chosen"]  # the chosen path (its code's name) and threads
            floor = T * fma_floor_per_token(cfg, meta) / cores
            rep.note(f"FMA floor of the prefill GEMM alone: {T} tokens x 2*M*E flops over {cores} cores at "
                     f"{meta['native_sgemm_gflops']:.0f} GFLOP/s each: {floor * 1e3:.1f} ms")
            ratio("prefill.engine_over_fma_floor", f"engine ({cores} threads) / FMA floor ({cores} cores)",
                  t["engine"], [floor] * len(t["engine"]), None, None,
                  summ=f"prefill {T}: engine / FMA floor [{isa}]")
            M, E = (cfg.hc_mult + 1) * cfg.hidden_size, cfg.engram_dim
            peaks = FMA_RUNNERS[(isa, cores, "prefill")].gflops(t[f"fma[{isa},t{cores}]"])  # one a repetition
            meta[f"register_fma_gflops_{cores}t[{isa}]"] = peaks
            rfloor = [T * 2 * M * E / (g * 1e9) for g in peaks]
            rep.note(f"register-only FMA peak ({isa}, {cores} threads at once, in the rotation): median "
                     f"{med(peaks):.0f} GFLOP/s [{min(peaks):.0f} .. {max(peaks):.0f}]; the prefill GEMM "
                     f"alone at that rate: {med(rfloor) * 1e3:.1f} ms")
            ratio(f"prefill.engine_over_register_fma_floor[{isa}]",
                  f"engine ({isa}, {cores} threads) / register-only FMA floor", t["engine"],
                  rfloor, "<= 1.25x", lambda r: r <= 1.25,
                  summ=f"prefill {T}: engine / register FMA floor [{isa}]")
            t["engine_1"] = t[f"engine[{isa},t1]"]  # the chosen path on one thread
            peaks = FMA_RUNNERS[(isa, 1, "prefill")].gflops(t[f"fma[{isa},t1]"])
            meta[f"register_fma_gflops_1t_prefill[{isa}]"] = peaks
            ratio(f"prefill.engine_1_over_register_fma_floor_1[{isa}]",
                  f"engine ({isa}, 1 thread) / register-only FMA floor of 1 core", t["engine_1"],
                  [T * 2 * M * E / (g * 1e9) for g in peaks], None, None,
                  summ=f"prefill {T}: engine 1 thread / FMA floor 1 core [{isa}]")
            if HAVE_TORCH:
                n = DEFAULT_TORCH_THREADS
                ratio("prefill.torch_default_over_engine", f"torch ({n} threads) / engine", t["torch_default"],
                      t["engine"], ">= 2x", lambda r: r >= 2, summ=f"prefill {T}: torch ({n} threads) / engine [{isa}]")
                ratio("prefill.torch_1_over_engine_1", "torch (1 thread) / engine (1 thread)", t["torch_1"],
                      t["engine_1"], None, None, summ=f"prefill {T}: torch 1 thread / engine 1 thread")
            ratio("prefill.engine_1_over_engine", "engine 1 thread / engine (the chosen threads)", t["engine_1"],
                  t["engine"], None, None)
        del model

    load1 = os.getloadavg()
    meta["loadavg_end"] = load1
    print("\n== summary (ratios of medians; the machine is shared: absolute times are indicative)")
    print(f"  {'comparison':<46s} {'ratio':>8s} {'paired':>8s}  {'goal':<10s} verdict")
    for what, r, pr, goal, ok in summary:
        v = "" if ok is None else ("met" if ok else "NOT MET")
        print(f"  {what:<46s} {r:7.2f}x {pr:7.2f}x  {goal:<10s} {v}")
    print(f"  load average: {load0[0]:.2f} at start, {load1[0]:.2f} at end ({os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rep.data,
                       "summary": [dict(what=w, ratio=r, paired_ratio=p, goal=g, met=o) for w, r, p, g, o in summary]}, f, indent=1)
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
