"""Memory tiers of a demo-size Engram layer: tables in RAM vs mmap'd from a checkpoint.

    python bench/bench_memory.py            # demo size: one layer, 2.6 GB float32 table (minutes)
    python bench/bench_memory.py --quick    # ~260 MB table
    options: --steps N (2000)  --reps R (3)  --compute-ms MS (1)  --dir DIR (/work)
             --keep  --reuse DIR  --json FILE  --only 13 (sections)

Builds EngramModel.init(EngramConfig(layer_ids=[1])) once, saves it as float32 and float16
checkpoints in a temp dir, then measures, each case in a fresh process:
  1. memory after load + N decode steps: peak heap (memray, the file mapping excluded),
     RssAnon / RssFile / VmHWM (/proc/self/status), resident table bytes (mincore);
     mmap cases start cold (the file evicted with posix_fadvise DONTNEED);
  2. cold-cache decode with ~1 ms of simulated earlier-layer compute (a numpy matmul loop)
     between hashing and the layer step, without and with row prefetch (madvise WILLNEED of
     the token's rows as soon as they are known, before the simulated compute);
  3. warm decode: in-RAM table vs mmap with the file in the page cache (goal: within 3%);
  4. three processes serving one mmap'd file: PSS from /proc/PID/smaps_rollup.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

LAYER = 1
HERE = os.path.abspath(__file__)


def config(quick):
    from engram_stream import EngramConfig
    if quick:  # same geometry, 1/10 of the rows
        return EngramConfig(engram_vocab_size=[64640, 64640], layer_ids=[LAYER])
    return EngramConfig(layer_ids=[LAYER])


def smaps_rollup(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Pss_Anon", "Pss_File"):
                out[k] = int(v.split()[0]) * 1024
    return out


# ------------------------------------------------------------------------------------------------
# worker: one measurement in a fresh process
# ------------------------------------------------------------------------------------------------
def make_sim(ms):
    """A callable that burns ~ms of CPU in numpy matmuls (the simulated earlier layers)."""
    if ms <= 0:
        return None
    a = np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)
    for _ in range(20):
        a @ a
    t0 = time.perf_counter()
    for _ in range(200):
        a @ a
    per = (time.perf_counter() - t0) / 200
    reps = max(1, round(ms / 1e3 / per))

    def sim():
        for _ in range(reps):
            a @ a
    return sim


def decode(model, tokens, hiddens, sim, prefetch, track=None):
    """feed -> [prefetch] -> [simulated compute] -> compute, per token. Returns per-token times:
    layer (feed + prefetch + compute: the layer's own work, page-fault stalls included),
    prefetch, compute, total (with the simulated compute)."""
    from engram_stream.io import memory
    eng = model.stream(LAYER)
    if track is not None:
        track.append(memory.track_rows(eng))
    out = np.empty(hiddens.shape[1:], np.float32)
    t = {k: np.zeros(len(tokens)) for k in ("layer", "prefetch", "compute", "total")}
    for i, tok in enumerate(tokens.tolist()):
        t0 = time.perf_counter()
        eng.feed(tok)
        ta = time.perf_counter()
        if prefetch == "engine":
            eng.prefetch()
        t1 = time.perf_counter()
        if sim is not None:
            sim()
        t2 = time.perf_counter()
        eng.compute(hiddens[i % len(hiddens)], out=out)
        t3 = time.perf_counter()
        t["layer"][i] = (t1 - t0) + (t3 - t2)
        t["prefetch"][i] = t1 - ta
        t["compute"][i] = t3 - t2
        t["total"][i] = t3 - t0
    return t


def stats(t):
    return {"mean_us": float(t.mean() * 1e6), "p50_us": float(np.median(t) * 1e6),
            "p10_us": float(np.percentile(t, 10) * 1e6), "p99_us": float(np.percentile(t, 99) * 1e6)}


def ab_worker(spec):
    """Warm A/B in one process: the same tokens through an in-RAM and an mmap engine, in
    alternating blocks, so background noise hits both alike. Pass 1 is the first touch of each
    page by this process (minor faults: the file is in the page cache), pass 2 repeats it."""
    from engram_stream import EngramModel
    rng = np.random.default_rng(spec.get("seed", 0))
    tokens = rng.integers(0, spec["vocab"], spec["steps"]).tolist()
    hiddens = rng.standard_normal((64,) + tuple(spec["hidden_shape"])).astype(np.float32)
    models = {"ram": EngramModel.load(spec["path"], mmap=False), "mmap": EngramModel.load(spec["path"], mmap=True)}
    engines = {k: m.stream(LAYER) for k, m in models.items()}
    out, block, res = np.empty(hiddens.shape[1:], np.float32), spec.get("block", 50), []
    for _ in range(2):
        t = {k: [] for k in engines}
        ratios = []  # per block: mmap / RAM mean time over the same tokens, run back to back
        for e in engines.values():
            e.reset()
        for b0 in range(0, len(tokens), block):
            names = list(engines) if (b0 // block) % 2 == 0 else list(engines)[::-1]
            for k in names:
                e = engines[k]
                for i in range(b0, min(b0 + block, len(tokens))):
                    t0 = time.perf_counter()
                    e.feed(tokens[i])
                    e.compute(hiddens[i % len(hiddens)], out=out)
                    t[k].append(time.perf_counter() - t0)
            ratios.append(np.mean(t["mmap"][b0:]) / np.mean(t["ram"][b0:]))
        res.append({**{k: stats(np.array(v)) for k, v in t.items()}, "block_ratios": ratios})
    print(json.dumps({"passes": res}), flush=True)


def worker(spec):
    if spec.get("ab"):
        return ab_worker(spec)
    from engram_stream import EngramModel
    from engram_stream.io import memory
    path = spec["path"]
    if spec.get("cold"):
        memory.evict_file(path)
    rng = np.random.default_rng(spec.get("seed", 0))
    tokens = rng.integers(0, spec["vocab"], spec["steps"])
    hiddens = rng.standard_normal((64,) + tuple(spec["hidden_shape"])).astype(np.float32)
    sim = make_sim(spec.get("compute_ms", 0))
    res = {"before": memory.proc_status()}
    tracker = None
    if spec.get("trace"):
        import memray
        tracker = memray.Tracker(spec["trace"])
        tracker.__enter__()
    t0 = time.perf_counter()
    model = EngramModel.load(path, mmap=spec["mmap"])
    res["load_s"] = time.perf_counter() - t0
    w = model.layers[LAYER]
    res["table_bytes"] = int(w.table.nbytes)
    res["resident_after_load"] = memory.resident_bytes(w.table)
    res["after_load"] = memory.proc_status()
    res["passes"], track = [], []
    for _ in range(spec.get("passes", 1)):
        t = decode(model, tokens, hiddens, sim, spec.get("prefetch"), track if not res["passes"] else None)
        res["passes"].append({k: stats(v) for k, v in t.items()})
    rep = memory.residency(model, touched={LAYER: track[0]})[LAYER]
    res["resident_after_decode"] = rep["resident_bytes"]
    res["rows_touched"] = rep["rows_touched"]
    res["after_decode"] = memory.proc_status()
    if tracker is not None:
        tracker.__exit__(None, None, None)
        import memray
        recs = list(memray.FileReader(spec["trace"]).get_high_watermark_allocation_records(merge_threads=True))
        mmapped = sum(r.size for r in recs if r.allocator == memray.AllocatorType.MMAP)
        res["heap_peak"] = sum(r.size for r in recs) - mmapped
        res["mapped_at_peak"] = mmapped
        os.unlink(spec["trace"])
    if spec.get("touch_all"):  # the whole table resident (sequential advice: big reads, not page faults)
        memory.advise(w.table, "sequential")
        memory.touch(w.table)
        res["resident_full"] = memory.resident_bytes(w.table)
        res["after_touch"] = memory.proc_status()
    if spec.get("hold"):  # stay alive (mapped) until the parent has read our smaps
        print(json.dumps(res), flush=True)
        sys.stdin.readline()
        return
    print(json.dumps(res), flush=True)


# One BLAS thread: the simulated compute should cost ~the same in every case, not fight the engine.
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_worker(spec, hold=False):
    cmd = [sys.executable, HERE, "--worker", json.dumps(spec)]
    if hold:
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode:
        raise RuntimeError(f"worker failed: {spec}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------------
def build(cfg, d):
    from engram_stream import EngramModel
    from engram_stream.demo import checkpoint
    f32, f16 = os.path.join(d, "engram_f32.safetensors"), os.path.join(d, "engram_f16.safetensors")
    if os.path.exists(f32) and os.path.exists(f16):
        print(f"reusing {f32}, {f16}")
        return f32, f16
    t0 = time.perf_counter()
    model = EngramModel.init(cfg, seed=0)
    print(f"init: {time.perf_counter() - t0:.1f} s ({model.layers[LAYER].table.nbytes / 1e9:.2f} GB table)")
    for path, dt in ((f32, None), (f16, "float16")):
        t0 = time.perf_counter()
        model.save(path, table_dtype=dt)
        print(f"save {os.path.basename(path)}: {time.perf_counter() - t0:.1f} s, "
              f"{os.path.getsize(path) / 1e9:.2f} GB")
    return f32, f16


def warm_page_cache(path):
    buf = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def repeated(cases, reps):
    """Run every case `reps` times, interleaved (background noise hits all cases alike).
    Per case and pass: best p50 over repeats, median of means and of p99s."""
    runs = {name: [] for name, _ in cases}
    for _ in range(reps):
        for name, spec in cases:
            runs[name].append(run_worker(spec))
    out = {}
    for name, rs in runs.items():
        agg = []
        for i in range(len(rs[0]["passes"])):
            agg.append({k: {"p50_us": min(r["passes"][i][k]["p50_us"] for r in rs),
                            "mean_us": float(np.median([r["passes"][i][k]["mean_us"] for r in rs])),
                            "p99_us": float(np.median([r["passes"][i][k]["p99_us"] for r in rs]))}
                        for k in ("layer", "prefetch", "compute", "total")})
        out[name] = {"passes": agg, "runs": rs}
    return out


def gb(x):
    return f"{x / 1e9:6.2f} GB" if x >= 1e8 else f"{x / 1e6:6.1f} MB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~260 MB table instead of 2.6 GB")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--compute-ms", type=float, default=1.0, help="simulated earlier-layer compute per token")
    ap.add_argument("--reps", type=int, default=3, help="repeats of every timed case (interleaved)")
    ap.add_argument("--dir", default="/work", help="where the temp dir with the checkpoints goes")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--reuse", help="a dir holding checkpoints from an earlier --keep run")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--only", default="12345", help="sections to run, e.g. 13 (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))

    cfg = config(args.quick)
    d = args.reuse or tempfile.mkdtemp(prefix="engram-bench-", dir=args.dir)
    print(f"bench_memory: {' '.join(sys.argv)}\nconfig: {cfg.to_json()}\ndir: {d}")
    try:
        f32, f16 = build(cfg, d)
        results = measure(cfg, args, d, f32, f16)
    finally:
        if not (args.keep or args.reuse):
            shutil.rmtree(d, ignore_errors=True)
        else:
            print(f"kept {d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def measure(cfg, args, d, f32, f16):
    base = {"vocab": cfg.vocab_size, "hidden_shape": [cfg.hc_mult, cfg.hidden_size], "steps": args.steps}
    R = {}
    trace = lambda name: os.path.join(d, f"trace-{name}-{time.monotonic_ns()}.bin")  # noqa: E731

    # 1. memory ------------------------------------------------------------------------------------
    if "1" in args.only:
        print(f"\n[1] memory after load + {args.steps} decode steps (fresh process each; mmap cases cold)")
        warm_page_cache(f32)  # the RAM load reads from the page cache, as a warm server would
        cases = [("RAM  f32", dict(path=f32, mmap=False)), ("mmap f32 cold", dict(path=f32, mmap=True, cold=True)),
                 ("mmap f16 cold", dict(path=f16, mmap=True, cold=True))]
        print(f"{'case':15s} {'load':>7s} {'heap peak':>10s} {'RssAnon':>10s} {'RssFile':>10s} {'VmHWM':>10s} "
              f"{'table':>10s} {'resident':>10s} {'rows read':>9s} {'us/token':>9s}")
        for name, spec in cases:
            r = run_worker({**base, **spec, "trace": trace(name.split()[0])})
            R["memory " + name] = r
            a = r["after_decode"]
            print(f"{name:15s} {r['load_s']:6.2f}s {gb(r['heap_peak']):>10s} {gb(a['RssAnon']):>10s} "
                  f"{gb(a['RssFile']):>10s} {gb(a['VmHWM']):>10s} {gb(r['table_bytes']):>10s} "
                  f"{gb(r['resident_after_decode']):>10s} {r['rows_touched']:9d} "
                  f"{r['passes'][0]['layer']['mean_us']:9.0f}")
        print("  heap peak: memray high-water mark without the file mapping (memray counts mmap() too);"
              "\n  resident: the table's pages in RAM (mincore); RssFile includes the engine's small weights")

    # 2. cold decode, simulated compute, with/without prefetch --------------------------------------
    if "2" in args.only:
        print(f"\n[2] cold-cache decode, {args.compute_ms} ms simulated compute between hashing and the layer "
              f"(us/token; layer = feed+prefetch+compute, stalls included; best p50 / median mean of {args.reps})")
        cold = {**base, "mmap": True, "cold": True, "compute_ms": args.compute_ms, "seed": 1}
        cases = [("mmap f32 cold, no prefetch", {**cold, "path": f32}),
                 ("mmap f32 cold, engine.prefetch()", {**cold, "path": f32, "prefetch": "engine"}),
                 ("mmap f16 cold, no prefetch", {**cold, "path": f16}),
                 ("mmap f16 cold, engine.prefetch()", {**cold, "path": f16, "prefetch": "engine"}),
                 ("RAM  f32 (reference)", {**cold, "path": f32, "mmap": False, "cold": False})]
        warm_page_cache(f32)  # for the RAM case's load; the mmap cases evict first
        print(f"{'case':34s} {'layer p50':>9s} {'mean':>7s} {'p99':>7s} {'prefetch':>8s} {'compute':>8s} "
              f"{'token p50':>9s} {'mean':>7s}")
        for name, r in repeated(cases, args.reps).items():
            R["cold " + name] = r
            p = r["passes"][0]
            print(f"{name:34s} {p['layer']['p50_us']:9.0f} {p['layer']['mean_us']:7.0f} {p['layer']['p99_us']:7.0f} "
                  f"{p['prefetch']['mean_us']:8.0f} {p['compute']['mean_us']:8.0f} "
                  f"{p['total']['p50_us']:9.0f} {p['total']['mean_us']:7.0f}")
        print("  prefetch, compute: mean us of that part alone; token: layer + simulated compute")

    # 3. warm: RAM vs mmap with the file in the page cache -------------------------------------------
    if "3" in args.only:
        reps = args.reps + 2
        print(f"\n[3] warm decode, RAM vs mmap (file in the page cache) in one process, alternating blocks of "
              f"50 tokens (us/token; median over {reps} processes)\n    pass 1: first touch of each page (minor "
              f"faults); pass 2: the same tokens again")
        warm_page_cache(f32)
        runs = [run_worker({**base, "path": f32, "seed": 2 + i, "ab": True}) for i in range(reps)]
        R["warm"] = runs
        for i in range(2):
            qs = ("p10_us", "p50_us", "mean_us")
            med = {k: {q: float(np.median([r["passes"][i][k][q] for r in runs])) for q in qs} for k in ("ram", "mmap")}
            ratios = np.concatenate([r["passes"][i]["block_ratios"] for r in runs])
            q1, q2, q3 = np.percentile(ratios, [25, 50, 75])
            print(f"pass {i + 1}: " + "   ".join(
                f"{q[:-3]} RAM {med['ram'][q]:5.0f} mmap {med['mmap'][q]:5.0f} ({med['mmap'][q] / med['ram'][q]:.3f})"
                for q in qs) + f"   paired blocks mmap/RAM {q2:.3f} [IQR {q1:.3f}-{q3:.3f}]")

    # 4. float16: full residency ----------------------------------------------------------------------
    if "4" in args.only:
        print("\n[4] whole table resident (every page touched), float32 vs float16 file")
        for name, path in (("f32", f32), ("f16", f16)):
            r = run_worker({**base, "path": path, "mmap": True, "steps": 10, "touch_all": True})
            R["full " + name] = r
            print(f"mmap {name}: file {gb(os.path.getsize(path))}, resident table {gb(r['resident_full'])}, "
                  f"RssFile {gb(r['after_touch']['RssFile'])}, RssAnon {gb(r['after_touch']['RssAnon'])}")

    # 5. sharing: N processes, one file ----------------------------------------------------------------
    if "5" in args.only:
        n = 3
        print(f"\n[5] {n} processes decoding from one mmap'd f32 file (whole table touched by each; "
              f"{os.cpu_count()} cores, so they also share the CPU)")
        warm_page_cache(f32)
        procs = [run_worker({**base, "path": f32, "mmap": True, "touch_all": True, "seed": 10 + i, "hold": True},
                            hold=True) for i in range(n)]
        try:
            outs = [json.loads(p.stdout.readline()) for p in procs]
            roll = [smaps_rollup(p.pid) for p in procs]
        finally:
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait()
        for i, (o, s) in enumerate(zip(outs, roll)):
            print(f"proc {i}: Rss {gb(s['Rss'])}  Pss {gb(s['Pss'])}  (Pss_File {gb(s['Pss_File'])}, "
                  f"Pss_Anon {gb(s['Pss_Anon'])})  decode {o['passes'][0]['layer']['mean_us']:.0f} us/token")
        tot = sum(s["Pss"] for s in roll)
        ram_anon = R["memory RAM  f32"]["after_decode"]["RssAnon"] if "memory RAM  f32" in R else \
            outs[0]["table_bytes"] + outs[0]["after_touch"]["RssAnon"]
        print(f"total PSS {gb(tot)} for {n} processes; {n} in-RAM copies would hold {gb(n * ram_anon)} anonymous")
        R["share"] = {"smaps": roll, "total_pss": tot, "ram_anon_each": ram_anon}
    return R


if __name__ == "__main__":
    main()
