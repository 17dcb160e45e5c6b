#!/usr/bin/env python
"""Single-thread CPU time per engine call, for A/B of two builds on a shared machine.

    flock /tmp/bench.lock python bench/bench_cpu_time.py [--root CHECKOUT] [--what small,demo,v41]
                                                       [--reps 9] [--json out.json]

--root: the checkout whose in-place build is measured (default: this one), so one copy of this
script measures an older build too (the API it uses: model.stream, step, prefill, reset,
step_threads, prefill_threads). Every call runs on one thread (step_threads = prefill_threads
= 1) and is timed by time.thread_time: the CPU time of the calling thread, which another job
taking the core does not inflate (its cache pressure still does). Cases, each the median of
--reps blocks of ~0.3 s (V4.1: ~1 s), the blocks rotating over the cases:
  small  D 256, hc 4, 2 orders x 4 heads x 32, tables [100003]*2: step (1 stream), one step of
         16 streams, prefill of 256 tokens (where the per-call overhead shows)
  demo   EngramConfig(layer_ids=[1]) (2.6 GB table): the same, prefill of 2048 tokens
  v41    the Flash-dims checkpoint bench_v41.py writes (--v41-dir): the same, prefill of 64
Wall-clock ratios against floors are bench_step.py's and bench_v41.py's job.
"""
import argparse
import json
import os
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(engram_vocab_size=[100003, 100003], max_ngram_size=3, n_embed_per_ngram=128, n_head_per_ngram=4,
             layer_ids=[1], kernel_size=4, hidden_size=256, hc_mult=4)
LAYER = 1


def cpu_per_call(run, n):
    t = time.thread_time()
    run(n)
    return (time.thread_time() - t) / n


def cases(model, T, prefix, np):
    """{name: run(n)}: n one-stream steps, n 16-stream steps, n prefills of T tokens."""
    cfg = model.cfg
    G, D, V = cfg.hc_mult, cfg.hidden_size, cfg.vocab_size
    rng = np.random.default_rng(0)
    e1 = model.stream(LAYER)
    e1.step_threads = 1
    toks = rng.integers(0, V, 4096).tolist()
    h1 = rng.standard_normal((G, D)).astype(np.float32)
    o1 = np.empty_like(h1)
    e16 = model.stream(LAYER, n_streams=16)
    e16.step_threads = 1
    t16 = rng.integers(0, V, (256, 16)).astype(np.int64)
    h16 = rng.standard_normal((16, G, D)).astype(np.float32)
    o16 = np.empty_like(h16)
    ep = model.stream(LAYER)
    ep.prefill_threads = 1
    ids = rng.integers(0, V, T).astype(np.int64)
    hp = rng.standard_normal((T, G, D)).astype(np.float32)
    op = np.empty_like(hp)
    at = [0, 0]

    def step1(n):
        i = at[0]
        for j in range(i, i + n):
            e1.step(toks[j % 4096], h1, out=o1)
        at[0] = i + n

    def step16(n):
        i = at[1]
        for j in range(i, i + n):
            e16.step(t16[j % 256], h16, out=o16)
        at[1] = i + n

    def prefill(n):
        for _ in range(n):
            ep.reset()
            ep.prefill(ids, hp, out=op)
    return {f"{prefix}: step, 1 stream": step1, f"{prefix}: step, 16 streams": step16,
            f"{prefix}: prefill {T}": prefill}


def measure(runs, reps, target, np):
    ns = {}
    for k, run in runs.items():
        run(1)  # warm: scratch, pages
        ns[k] = max(1, int(target / max(cpu_per_call(run, 1), 1e-7)))
    times = {k: [] for k in runs}
    names = list(runs)
    for r in range(reps):
        for j in range(len(names)):
            k = names[(r + j) % len(names)]
            times[k].append(cpu_per_call(runs[k], ns[k]))
    out = {}
    for k in names:
        out[k] = float(np.median(times[k]))
        print(f"  {k:32s} {out[k] * 1e3:10.3f} ms CPU per call (min {min(times[k]) * 1e3:.3f}, "
              f"{ns[k]} calls a block)", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=HERE, help="the checkout whose in-place build is measured")
    ap.add_argument("--what", default="small,demo,v41")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--v41-dir", default="/tmp/engram_v41_flash", help="bench_v41.py's checkpoint")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    what = a.what.split(",")
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import checkout
    where = checkout.use(os.path.abspath(a.root))
    import numpy as np
    from _lib.common import machine
    from engram_stream import EngramConfig, EngramModel
    info = machine()
    print(f"bench_cpu_time: engram_stream from {where}, kernels {info['kernel_isa']}, load average "
          f"{info['loadavg'][0]:.2f}", flush=True)
    res = {"root": os.path.abspath(a.root), "machine": info}
    if "small" in what:
        m = EngramModel.init(EngramConfig(**SMALL), seed=0)
        res.update(measure(cases(m, 256, "small", np), a.reps, 0.3, np))
        del m
    if "demo" in what:
        m = EngramModel.init(EngramConfig(layer_ids=[LAYER]), seed=0)
        res.update(measure(cases(m, 2048, "demo", np), a.reps, 0.3, np))
        del m
    if "v41" in what:
        if not os.path.isfile(os.path.join(a.v41_dir, "config.json")):
            raise SystemExit(f"no V4.1 checkpoint at {a.v41_dir}: run bench/bench_v41.py once (it writes it)")
        m = EngramModel.from_deepseek_v41(a.v41_dir, mmap=True)
        res.update(measure(cases(m, 64, "v41", np), a.reps, 1.0, np))
        del m
    res["load_end"] = os.getloadavg()[0]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
