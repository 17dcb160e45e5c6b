#!/usr/bin/env python
"""The vLLM plugin's host side: StreamEngramEmbedding.lookup filling vLLM's bf16 staging rows
[T, 24, 256]. Needs vLLM 0.33.0 (tools/ci_vllm.sh's venv); vLLM's own kernel is not run (no
GPU), only its module's classes.

    flock /tmp/bench.lock python bench/bench_vllm.py                  # every section
    flock /tmp/bench.lock python bench/bench_vllm.py --only warm --rows 50000

Sections (each a 16-request decode batch and a 4096-token prompt chunk; ratios of medians,
rounds interleaved; the machine is shared, absolute times indicative only):
  warm    every row in the row cache, against engram_stream's lookup_packed of the same rows
          (bf16) from tables in RAM. Flash dims, random rows: the hashes of random token ids
          (plan.hash), the same rows for both. Goal (issue): <= 1.1x.
  cold    tables="direct" (O_DIRECT, the packed row file of bench_direct.py's checkpoint; its
          files' pages dropped with posix_fadvise DONTNEED first) and a row cache far smaller
          than the table, both Engram layers looked up as vLLM's forward does (lookup(...,
          background=True) of every layer, then the waits), uniform random rows: preads per
          second against fio's 4 KiB random reads at the same queue depth on the same file.
          Goal: >= 0.7x.
  memory  (in cold's run) the serving process with a 1 GiB row cache (cut to what caching every
          row of the bench checkpoint costs): RssAnon before the plugin's sources, what the row
          cache adds when it is made, what 4096-token lookups add; beside the table bytes vLLM
          would pin in host RAM (the bench checkpoint's; DeepSeek-V4.1: 189 GiB).
"""
import argparse
import json
import os
import shutil
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from _lib.common import machine  # noqa: E402
from engram_stream import EngramModel  # noqa: E402
from engram_stream.v41.hf import flash_config  # noqa: E402

LAYER = 1


def stub_vllm():
    """vLLM's engram module on one CPU process (TP 1), as the tests run it."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch
    import vllm.models.deepseek_v41.common.engram as E
    E.get_tensor_model_parallel_world_size = lambda: 1
    E.get_tensor_model_parallel_rank = lambda: 0
    E.get_engram_dp_size = lambda: 1
    # the device queries of vLLM's embedding constructor (the plugin's embedding runs it whole)
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(multi_processor_count=4)
    torch.accelerator.current_device_index = lambda: 0
    return E


def section_warm(a, res):
    import torch
    from engram_stream.integrations import vllm as plugin
    cfg = flash_config(engram_vocab_size=a.rows, engram_layer_ids=[LAYER])
    ram = EngramModel.init(cfg, seed=0)                      # tables in RAM: lookup_packed's
    cached = EngramModel.init(cfg, seed=0)._with_tiers(None, 1 << 16, None)   # every row fits the row cache
    plan = ram.plan
    sizes = tuple(int(p) for p in plan.head_primes[LAYER])
    emb = plugin.embedding_class()(cached, LAYER, plan.table_rows[LAYER], cfg.head_dim, sizes)
    H = len(sizes)
    rng = np.random.default_rng(0)
    results = {}
    for name, S, T in (("decode: 16 requests x 1 token", 16, 1), ("prompt chunk: 4096 tokens", 1, 4096)):
        eng = ram.stream(LAYER, n_streams=S)
        N = S * T
        ids = rng.integers(0, cfg.vocab_size, N).astype(np.int64)
        streams = np.arange(S, dtype=np.int64)
        lengths = np.full(S, T, np.int64)
        # the rows lookup_packed reads: each stream's tokens hashed from a fresh window
        rows = plan.hash(ids.reshape(S, T))[LAYER].reshape(N, H) + plan.offsets[LAYER]
        idx = torch.from_numpy(rows.astype(np.int32))
        out = torch.empty(N, H, cfg.head_dim, dtype=torch.bfloat16)
        emb.lookup(idx, out)                                 # warm: every row now cached
        eng.reset()
        want = eng.lookup_packed(ids, streams, lengths, dtype="bfloat16")
        assert np.array_equal(out.view(torch.int16).numpy().reshape(N, -1), want.view(np.int16)), \
            "the plugin's rows differ from lookup_packed's"
        t_plugin, t_packed = [], []
        for r in range(a.reps):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                if which == 0:
                    t0 = time.perf_counter()
                    emb.lookup(idx, out)
                    t_plugin.append(time.perf_counter() - t0)
                else:
                    eng.reset()
                    t0 = time.perf_counter()
                    eng.lookup_packed(ids, streams, lengths, dtype="bfloat16")
                    t_packed.append(time.perf_counter() - t0)
        mp, mk = float(np.median(t_plugin)), float(np.median(t_packed))
        results[name] = {"plugin_warm_ms": mp * 1e3, "lookup_packed_ms": mk * 1e3, "ratio": mp / mk,
                         "rows": N * H}
        print(f"{name}: plugin warm {mp * 1e3:.3f} ms, lookup_packed {mk * 1e3:.3f} ms, ratio {mp / mk:.2f}")
    st = cached.row_cache_stats()
    res["warm"] = {"results": results, "cache_hits": st["hits"], "cache_misses": st["misses"]}


BATCHES = (("decode: 16 requests x 1 token", 16), ("prompt chunk: 4096 tokens", 4096))


def status():
    """VmRSS and RssAnon of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(line.split()[1]) * 1024
    return out


def section_cold(a, res):
    """Preads per second of the plugin's lookups from cold against fio at the same qd (rounds
    interleaved: fio, then the plugin, on a file whose pages were dropped)."""
    import torch
    from _lib import disk
    from engram_stream.integrations import vllm as plugin
    from engram_stream.rows import DirectTier, packed
    from engram_stream.io.memory import evict_file
    d = os.path.join(a.dir, f"flash-rows-{a.evs}-d256")
    os.makedirs(a.dir, exist_ok=True)
    disk.ensure_checkpoint(d, a.evs, 256)
    rows_file = packed.rows_path(d)
    files = [rows_file] + sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    rng = np.random.default_rng(5)
    rounds = {name: [] for name, _ in BATCHES}
    model = None
    for r in range(a.rounds):
        for name, T in BATCHES:
            for f in files:
                evict_file(f)
            fio = disk.fio(rows_file, a.qd, a.seconds)
            del model
            model = EngramModel.from_deepseek_v41(d, tables=DirectTier(qd=a.qd), row_cache_mb=a.cache_mb)
            plan = model.plan
            embs, heads = [], []
            for L in model.cfg.layer_ids:
                sizes = tuple(int(p) for p in plan.head_primes[L])
                embs.append(plugin.embedding_class()(model, L, plan.table_rows[L], 256, sizes))
                heads.append((np.asarray(plan.offsets[L], np.int64), np.asarray(sizes, np.int64)))
            outs = [torch.empty(T, len(h[1]), 256, dtype=torch.bfloat16) for h in heads]
            st0 = model.row_cache_stats()
            t0, calls = time.perf_counter(), 0
            while time.perf_counter() - t0 < a.seconds:
                ids = [torch.from_numpy((off + rng.integers(0, n, (T, len(n)))).astype(np.int32)) for off, n in heads]
                for e, i, o in zip(embs, ids, outs):   # every layer's reads in flight, then the waits
                    e.lookup(i, o, background=True)
                for e in embs:
                    e.wait()
                calls += 1
            dt = time.perf_counter() - t0
            st = model.row_cache_stats()
            reads = st["reads"] - st0["reads"]
            hits, misses = st["hits"] - st0["hits"], st["misses"] - st0["misses"]
            e = {"fio_iops": fio, "reads_per_s": reads / dt, "ratio": reads / dt / fio,
                 "ms_per_forward": 1e3 * dt / calls, "hit_rate": hits / max(1, hits + misses),
                 "reads_per_row_read": reads / max(1, st["rows_read"] - st0["rows_read"])}
            rounds[name].append(e)
            print(f"  round {r}, {name}: fio {fio:,.0f} IOPS | plugin {e['reads_per_s']:,.0f} reads/s "
                  f"({e['ratio']:.2f}x), {e['ms_per_forward']:.2f} ms a forward (both layers), hits "
                  f"{100 * e['hit_rate']:.1f}%, {e['reads_per_row_read']:.3f} reads per row", flush=True)
    table = sum(plan.table_rows[L] * 264 for L in model.cfg.layer_ids)
    out = {}
    for name, rs in rounds.items():
        out[name] = {"fio_iops": float(np.median([x["fio_iops"] for x in rs])),
                     "reads_per_s": float(np.median([x["reads_per_s"] for x in rs])),
                     "ratio_median": float(np.median([x["ratio"] for x in rs])), "rounds": rs}
        print(f"cold, {name}, qd {a.qd}: plugin / fio = {out[name]['reads_per_s']:,.0f} / "
              f"{out[name]['fio_iops']:,.0f} reads/s, median of per-round ratios {out[name]['ratio_median']:.2f}x "
              f"(goal >= 0.7x)", flush=True)
    res["cold"] = {"qd": a.qd, "cache_mb": a.cache_mb, "table_bytes": table, "batches": out,
                   "direct": [rf.direct for rf in model.tier.inner.files.values()]}
    del model
    # the serving process with a 1 GiB row cache: the cold lookups again through one model
    model = EngramModel.from_deepseek_v41(d, tables=DirectTier(qd=a.qd), row_cache_mb=1024)
    before = status()
    embs = []
    for L in model.cfg.layer_ids:
        sizes = tuple(int(p) for p in plan.head_primes[L])
        embs.append((plugin.embedding_class()(model, L, plan.table_rows[L], 256, sizes),
                     np.asarray(plan.offsets[L], np.int64), np.asarray(sizes, np.int64)))
    made = status()                       # the row cache is allocated (whole) with the first source
    out_rows = torch.zeros(4096, len(embs[0][2]), 256, dtype=torch.bfloat16)   # vLLM's staging, not ours
    base = status()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 4 * a.seconds:
        for e, off, n in embs:
            e.lookup(torch.from_numpy((off + rng.integers(0, n, (4096, len(n)))).astype(np.int32)), out_rows)
    st = model.row_cache_stats()
    after = status()
    res["memory"] = {"vm_rss": after["VmRSS"], "rss_anon_before_model": before["RssAnon"],
                     "rss_anon_cache": made["RssAnon"] - before["RssAnon"],
                     "rss_anon_lookups": after["RssAnon"] - base["RssAnon"],
                     "cache_budget_bytes": st["budget_bytes"], "rows_cached": st["rows_cached"],
                     "capacity_rows": st["capacity_rows"], "table_bytes_vllm_pins": table,
                     "v41_table_bytes_vllm_pins": 189 << 30}
    m = res["memory"]
    print(f"memory: VmRSS {after['VmRSS'] / 2**20:,.0f} MiB; RssAnon {before['RssAnon'] / 2**20:,.0f} MiB before "
          f"the model's sources (torch, vLLM), +{m['rss_anon_cache'] / 2**20:,.0f} MiB as the row cache of "
          f"{m['cache_budget_bytes'] / 2**20:,.0f} MiB is made (1 GiB asked, cut to every row), "
          f"+{m['rss_anon_lookups'] / 2**20:,.0f} MiB over the 4096-token lookups ({st['rows_cached']:,} of "
          f"{st['capacity_rows']:,} rows cached); vLLM would pin the table: {table / 2**20:,.0f} MiB "
          f"(V4.1: 189 GiB)", flush=True)


SECTIONS = {"warm": section_warm, "cold": section_cold}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000, help="warm: engram_vocab_size (rows per head ~ this)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dir", default="/tmp/engram_bench_direct", help="cold: bench_direct.py's checkpoints")
    ap.add_argument("--evs", type=int, default=50000, help="cold: engram_vocab_size of the checkpoint")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--cache-mb", dest="cache_mb", type=float, default=16)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(SECTIONS))
    a = ap.parse_args(argv)
    import torch
    stub_vllm()
    res = {"args": vars(a)}
    for name in a.only.split(","):
        if name == "cold" and shutil.which("fio") is None:
            sys.exit("fio is needed (Debian: apt-get install fio)")
        SECTIONS[name](a, res)
    res["machine"] = machine(torch=torch.__version__)
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
