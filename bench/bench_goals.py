#!/usr/bin/env python
"""Every speed goal of the variants in one table, each figure MET or MISSED, the CPU named.

    flock /tmp/bench.lock python bench/bench_goals.py             # all (~15 minutes on 2 cores)
    flock /tmp/bench.lock python bench/bench_goals.py --quick     # fewer rounds, 2 demo runs
    flock /tmp/bench.lock python bench/bench_goals.py --only qwen,longcat --json goals.json

Each figure comes from the variant's own bench script, run here as a child process with --json
(its method: the contenders and their floors side by side in interleaved rounds, ratios of
medians; bench/NOTES.md). A script runs once, except the demo's prefill, whose goal holds in
every one of --demo-runs runs. Every figure is taken on the path and threads the tuner chose
(the unforced engine: what a user gets), except where the goal names a path:

  qwen     bench_qwen.py --hidden bfloat16 (bf16 projections and table, bf16 hidden in and out)
           one-stream step / one read of the bf16 projections        <= 1.1x
           16 streams per token / one stream                         <= 1/8
           prefill 512 on every core (the best path) / its vdpbf16ps floor of every core  <= 1.3x
  v41      bench_v41.py --sections step
           16 streams per token / one stream (the unforced engine)   <= 1/8
           avx2 path (stands in for AVX2-only CPUs; the faster of 1 and 2 threads)
           one-stream step / one read of wkv                         <= 1.2x
  demo     bench_step.py --skip small --skip demo --skip threads
           prefill 2048 / the register FMA floor of its cores        <= 1.2x in every run
  longcat  bench_longcat.py (released dims, bf16)
           one-stream step / one read of the projections             <= 1.2x
           16 streams per token / one stream                         <= 1/8
           prefill 512 / the floor of its path and cores             <= 1.3x

The children's output goes to --logs (one file a run); a child that fails marks its figures
ERROR, prints the tail of its log, and the script exits 1.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from _lib.common import machine  # noqa: E402
from engram_stream.engine import isa as _isa  # noqa: E402

SECTIONS = ("qwen", "v41", "demo", "longcat")


def run_child(name, argv, logs, k):
    """Runs bench/<argv> with --json into logs; returns (its JSON, the log's path) or (None, log)."""
    out = os.path.join(logs, f"{name}-{k}.json")
    log = os.path.join(logs, f"{name}-{k}.log")
    cmd = [sys.executable, os.path.join(HERE, argv[0]), *argv[1:], "--json", out]
    print(f"  {name}: {' '.join(['python', 'bench/' + argv[0], *argv[1:]])}  (log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.path.dirname(HERE))
    print(f"    {time.perf_counter() - t0:.0f} s, exit {rc}", flush=True)
    if rc != 0 or not os.path.exists(out):
        with open(log) as f:
            print("".join(f.readlines()[-20:]), flush=True)
        return None, log
    with open(out) as f:
        return json.load(f), log


def figure(issue, what, value, goal, command, detail=""):
    return {"issue": issue, "figure": what, "value": value, "goal": goal, "command": command, "detail": detail,
            "verdict": "ERROR" if value is None else ("MET" if value <= goal else "MISSED")}


def qwen(a, logs):
    best = _isa.kernel_isa()
    argv = ["bench_qwen.py", "--sections", "step,prefill", "--hidden", "bfloat16", "--paths", best] + \
        (["--quick"] if a.quick else [])
    r, _ = run_child("qwen", argv, logs, 0)
    cmd = " ".join(argv)
    st = r and r["step"]["bfloat16"]
    pf = r and r["prefill"][best]["bfloat16"]
    cfg = st and st["chosen_config"]
    how = cfg and f"{cfg['step'][0]}/{cfg['step'][1]}; 16: {cfg['batch'][0]}/{cfg['batch'][1]}"
    return [
        figure(49, "Qwen one-stream step / one read of its bf16 projections, bf16 hidden",
               st and st["chosen"]["step1_over_read"], 1.1, cmd,
               st and f"{how}; {st['proj_bytes'] / 2**20:.0f} MiB at {st['read_GBps']:.1f} GB/s"),
        figure(49, "Qwen 16 streams per token / one stream, bf16 hidden",
               st and st["chosen"]["per_token16_over_step1"], 1 / 8, cmd, how),
        figure(49, f"Qwen prefill {r and r['prefill']['T']} / vdpbf16ps floor of every core, bf16 hidden",
               pf and pf["over_fma_floor"], 1.3, cmd,
               pf and f"{best}/{r['prefill']['threads']}; floor {pf['register_fma_all_cores_GFLOPs']:.0f} GFLOP/s"),
    ]


def v41(a, logs):
    runs = _isa.supported_isas()
    paths = [p for p in dict.fromkeys([_isa.kernel_isa(), "avx2"]) if p in runs]
    argv = ["bench_v41.py", "--sections", "step", "--paths", ",".join(paths)] + (["--quick"] if a.quick else [])
    r, _ = run_child("v41", argv, logs, 0)
    cmd = " ".join(argv)
    st = r and r["step"]
    ch = st and st["chosen"]
    figs = [figure(49, "V4.1 16 streams per token / one-stream step (the tuner's paths and threads)",
                   ch and ch["step16_ms"] / 16 / ch["step1_ms"], 1 / 8, cmd,
                   ch and f"step {ch['config']['step'][0]}/{ch['config']['step'][1]}, 16: "
                   f"{ch['config']['batch'][0]}/{ch['config']['batch'][1]}")]
    if "avx2" in runs:
        a2 = st and st["avx2"]
        th = a2 and min((1, 2), key=lambda t: a2[f"step1_t{t}_ms"])
        figs.append(figure(49, "V4.1 step on the avx2 path / one read of wkv",
                           a2 and a2[f"step1_t{th}_ms"] / st["read_ms"], 1.2, cmd,
                           a2 and f"avx2/{th}; wkv {st['wkv_bytes'] / 1e6:.0f} MB at {st['read_GBps']:.1f} GB/s"))
    return figs


def demo(a, logs):
    argv = ["bench_step.py", "--skip", "small", "--skip", "demo", "--skip", "threads"] + (["--quick"] if a.quick else [])
    vals = []
    for k in range(a.demo_runs):
        r, _ = run_child("demo", argv, logs, k)
        s = r and [x for x in r["summary"] if x["what"].startswith("prefill 2048: engine / register FMA floor")]
        vals.append(s[0]["ratio"] if s else None)
    ok = [v for v in vals if v is not None]
    worst = max(ok) if len(ok) == len(vals) else None
    return [figure(49, f"demo prefill 2048 / the FMA floor of its cores, the worst of {a.demo_runs} runs", worst, 1.2,
                   " ".join(argv), "runs: " + ", ".join("ERROR" if v is None else f"{v:.2f}x" for v in vals))]


def longcat(a, logs):
    argv = ["bench_longcat.py"] + (["--quick"] if a.quick else [])
    r, _ = run_child("longcat", argv, logs, 0)
    cmd = " ".join(argv)
    st, pf = r and r["step"], r and r["prefill"]
    cfg = st and st["chosen_config"]
    how = cfg and f"{cfg['step'][0]}/{cfg['step'][1]}; 16: {cfg['batch'][0]}/{cfg['batch'][1]}"
    p = pf and pf["chosen"]
    return [
        figure(48, "LongCat one-stream step / one read of its projections", st and st["chosen"]["step1_over_read"],
               1.2, cmd, st and f"{how}; {st['proj_bytes'] / 2**20:.0f} MiB at {st['read_GBps']:.1f} GB/s"),
        figure(48, "LongCat 16 streams per token / one stream", st and st["chosen"]["per_token16_over_step1"],
               1 / 8, cmd, how),
        figure(48, f"LongCat prefill {pf and pf['T']} / the floor of its path and cores", p and p["over_fma_floor"],
               1.3, cmd, p and f"{p['path']}/{p['threads']}; floor {p['register_fma_GFLOPs']:.0f} GFLOP/s"),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="each script's --quick")
    ap.add_argument("--demo-runs", type=int, default=None, help="runs of the demo prefill (default 5, quick 2)")
    ap.add_argument("--logs", default=None, help="folder for the children's logs and JSON (default: a temp folder)")
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    only = [s for s in a.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"--only {','.join(bad)}: not a section; the sections are {','.join(SECTIONS)}")
    if a.demo_runs is None:
        a.demo_runs = 2 if a.quick else 5
    if a.demo_runs < 1:
        ap.error(f"--demo-runs {a.demo_runs}: give 1 or more")
    logs = a.logs or tempfile.mkdtemp(prefix="engram-goals-")
    os.makedirs(logs, exist_ok=True)
    m = machine()
    load0 = os.getloadavg()
    print(f"{m['cpu']}, {m['cores']} cores; paths this CPU runs: {','.join(m['paths_this_build_runs'])}", flush=True)
    figs = []
    for s in only:
        figs += {"qwen": qwen, "v41": v41, "demo": demo, "longcat": longcat}[s](a, logs)
    load1 = os.getloadavg()
    print(f"\n{m['cpu']}, {m['cores']} cores, load {load0[0]:.2f} -> {load1[0]:.2f}; medians of one run each")
    print(f"{'issue':<6}{'figure':<86}{'value':>8}  {'goal':<9}verdict  detail")
    for f in figs:
        v = "-" if f["value"] is None else f"{f['value']:.3f}"
        print(f"#{f['issue']:<5}{f['figure']:<86}{v:>8}  <= {f['goal']:<6.3g}{f['verdict']:<9}{f['detail'] or ''}")
    n_met = sum(f["verdict"] == "MET" for f in figs)
    print(f"{n_met} of {len(figs)} MET; the commands: bench/<command> (logs and JSON in {logs})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"machine": m, "loadavg": [load0, load1], "figures": figs, "logs": logs}, fh, indent=1)
    return 1 if any(f["verdict"] == "ERROR" for f in figs) else 0


if __name__ == "__main__":
    sys.exit(main())
