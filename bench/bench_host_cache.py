"""Four processes on one host: one shared row cache (host_cache=) against a private cache each.

    flock /tmp/bench.lock python bench/bench_host_cache.py
    options: --procs 4  --budget-mb 16  --reads 400000  --batch 4096  --json FILE

A demo-variant checkpoint (two layers of ~400K rows, 64-byte records, 49 MB of tables) is
written once under the cache folder. Each process stands for a data-parallel rank: it reads its
own Zipf(1.1) stream of rows (the same popularity over rows for every rank, a different draw),
in calls of --batch rows per layer, through model.row_source(L) (the engines' reader), all the
processes at once. Three set-ups:

  shared       host_cache: one cache per layer for the host, --budget-mb in all
  private/N    a cache each of --budget-mb / procs (the same RAM as shared)
  private      a cache each of --budget-mb (procs times the RAM)

Printed: the hit rate (hits / lookups over every process), the cache's RAM (shared: the sum of
the processes' Pss of the /dev/shm mappings, each page counted once, and the largest Rss of
one process; private: the sum of the caches' bytes), and the rows per second of all processes
together (indicative: a shared 2-vCPU machine).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()  # in os.environ too: the spawned ranks import the same engram_stream
sys.path.insert(0, HERE)
from _lib.common import machine  # noqa: E402

CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engram_stream", "bench")
CFG = dict(hidden_size=64, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
           engram_vocab_size=[100003, 100019], layer_ids=[1, 3], vocab_size=500, kernel_size=3)


def checkpoint():
    from engram_stream import EngramConfig, EngramModel
    path = os.path.join(CACHE, "host_cache_demo.safetensors")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        EngramModel.init(EngramConfig(**CFG), seed=5).save(path)
    return path


def rank(k, path, mb, host, reads, batch, barrier, out):
    from engram_stream import EngramModel
    from engram_stream.rows.tiers import HOST_CACHE_DIR
    model = EngramModel.load(path, row_cache_mb=mb, host_cache=host)
    layers = model.cfg.layer_ids
    srcs = {L: model.row_source(L) for L in layers}
    streams = {}
    for L in layers:
        n = int(model.plan.table_rows[L])
        popular = np.random.default_rng([L]).permutation(n)  # the ranks' shared popularity order
        draw = np.random.default_rng([L, k]).zipf(1.1, reads) - 1
        streams[L] = popular[draw % n]
    barrier.wait()
    t0 = time.perf_counter()
    for i in range(0, reads, batch):
        for L in layers:
            srcs[L].read(streams[L][i:i + batch])
    dt = time.perf_counter() - t0
    barrier.wait()  # every rank done: the caches are as full as they get
    st = model.row_cache_stats()
    from engram_stream.io.memory import mapping_bytes
    m = mapping_bytes(os.path.join(HOST_CACHE_DIR, f"engram-rows-{host}-")) if host else {"rss": 0, "pss": 0}
    rss, pss = m["rss"] // 1024, m["pss"] // 1024
    out.put({"rank": k, "seconds": dt, "hits": st["hits"], "misses": st["misses"],
             "cache_bytes": st["cache_bytes"], "rss_kb": rss, "pss_kb": pss})
    barrier.wait()  # measured while every rank still maps the cache


def run(path, procs, mb, host, reads, batch):
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=rank, args=(k, path, mb, host, reads, batch, barrier, out)) for k in range(procs)]
    for p in ps:
        p.start()
    res = sorted((out.get(timeout=1800) for _ in ps), key=lambda r: r["rank"])
    for p in ps:
        p.join()
        if p.exitcode:
            sys.exit(f"a rank failed (exit {p.exitcode})")
    if host:  # host counters: every process reports the same sums
        hits, misses, ram = res[0]["hits"], res[0]["misses"], sum(r["pss_kb"] for r in res) * 1024
    else:
        hits, misses = sum(r["hits"] for r in res), sum(r["misses"] for r in res)
        ram = sum(r["cache_bytes"] for r in res)
    return {"hit_rate": hits / max(1, hits + misses), "lookups": hits + misses, "cache_ram_bytes": ram,
            "max_rss_bytes": max(r["rss_kb"] for r in res) * 1024,
            "cache_bytes": res[0]["cache_bytes"] * (1 if host else procs),
            "rows_per_s": procs * reads * len(CFG["layer_ids"]) / max(r["seconds"] for r in res)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--budget-mb", type=float, default=16)
    ap.add_argument("--reads", type=int, default=400_000, help="rows per process per layer")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    path = checkpoint()
    host = f"bench{os.getpid()}-{uuid.uuid4().hex[:6]}"
    rows = {
        "shared": run(path, a.procs, a.budget_mb, host, a.reads, a.batch),
        f"private/{a.procs}": run(path, a.procs, a.budget_mb / a.procs, None, a.reads, a.batch),
        "private": run(path, a.procs, a.budget_mb, None, a.reads, a.batch),
    }
    info = machine(procs=a.procs, budget_mb=a.budget_mb, reads=a.reads, batch=a.batch)
    print(f"{a.procs} processes, {a.reads} Zipf(1.1) rows each per layer (2 layers), budget {a.budget_mb} MiB; "
          f"{info['cpu']}, {info['cores']} cores, load {' '.join(f'{x:.2f}' for x in info['loadavg'])}")
    print(f"{'set-up':<12} {'hit rate':>9} {'cache RAM MiB':>14} {'max Rss MiB':>12} {'Mrows/s':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['hit_rate']:9.3f} {r['cache_ram_bytes'] / 2**20:14.2f} "
              f"{r['max_rss_bytes'] / 2**20:12.2f} {r['rows_per_s'] / 1e6:8.2f}")
    sh = rows["shared"]
    print(f"shared: the processes' Pss of the cache files sums to {sh['cache_ram_bytes'] / 2**20:.2f} MiB of a "
          f"{a.budget_mb} MiB budget ({sh['cache_bytes'] / 2**20:.2f} MiB mapped)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
