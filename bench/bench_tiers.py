"""Row tiers: the RAM row cache (10% of a table's bytes) and the Mooncake Store tier.

    flock /tmp/bench.lock python bench/bench_tiers.py            # ~410 MB table (a few minutes)
    options: --tokens N (40000)  --remote-tokens N (3000)  --sim-tokens N (400000)  --cache-frac F (0.10)  --dir DIR
             --only 1234  --json FILE  --keep

One layer at the demo's dims (D=1024, hc_mult 4, 2 orders x 8 heads x 64 floats: 256-byte
rows), engram_vocab_size [100003, 100003] (1.6 M rows, 410 MB float32), token ids drawn
from Zipf(1.0) over the 129280-token vocab (p(k) ~ 1/k, ranks shuffled onto ids). Sections:
  1. hit rate of the row cache at 10% of the table's bytes (whole run, and its second half);
  2. warm decode: row cache (mmap file behind it) vs the table in RAM, same tokens, blocks
     of 500 steps interleaved, ratio of the medians (goal: within 1.2x);
  3. rows served from RAM at the same RAM budget, each case in a fresh process inside its own
     cgroup v1 memory cgroup (memory.limit_in_bytes charges page cache) whose limit is the
     process's footprint after setup + the budget, starting from a cold file: the page cache
     (a row is served from RAM when its page is resident as the step reads it: mincore) vs the
     row cache (hits); goal >= 2x; then (3b) both replayed over a longer stream's rows without
     the floats: the RowCache itself vs an LRU of 4 KiB pages of the same RAM;
  4. remote: a local mooncake_master + store server (TCP over loopback), the table published,
     decode through MooncakeTier with the row cache and without: misses per token, batched
     reads per token, latency of one read, step time vs the local row cache.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
# tests/: the local Mooncake servers (mooncake_servers.LocalMooncake), a test helper the bench shares
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

LAYER = 1
HERE = os.path.abspath(__file__)
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "GLOG_minloglevel": "3"}


def config():
    from engram_stream import EngramConfig
    return EngramConfig(engram_vocab_size=[100003, 100003], layer_ids=[LAYER])


def zipf_tokens(n, vocab, seed=0, a=1.0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** a
    return rng.permutation(vocab)[rng.choice(vocab, n, p=p / p.sum())].astype(np.int64)


def table_bytes(model):
    return model.layer(LAYER).table.nbytes


def budget_mb(model, frac):
    return table_bytes(model) * frac / 2**20


def decode(eng, toks, h, out):
    for t in toks:
        eng.step(int(t), h, out=out)


# ---- 1 + 2: hit rate, warm decode vs RAM -------------------------------------------------------
def sec_warm(path, toks, frac, res):
    from engram_stream import EngramModel
    ram = EngramModel.load(path, mmap=False)
    cached = EngramModel.load(path, row_cache_mb=budget_mb(ram, frac))
    G, D = ram.cfg.hc_mult, ram.cfg.hidden_size
    h = np.random.default_rng(1).standard_normal((G, D), dtype=np.float32)
    out = np.empty_like(h)
    e_ram, e_cache = ram.stream(LAYER), cached.stream(LAYER)
    half = len(toks) // 2
    decode(e_cache, toks[:half], h, out)                 # warm the row cache ...
    decode(e_ram, toks[:half], h, out)                   # ... and the CPU caches alike
    s0 = cached.row_cache_stats()
    t_ram, t_cache, B = [], [], 500
    for i in range(half, len(toks), B):
        blk = toks[i:i + B]
        t0 = time.perf_counter(); decode(e_ram, blk, h, out); t_ram.append((time.perf_counter() - t0) / len(blk))
        t0 = time.perf_counter(); decode(e_cache, blk, h, out); t_cache.append((time.perf_counter() - t0) / len(blk))
    s1 = cached.row_cache_stats()
    warm_hits = s1["hits"] - s0["hits"]
    warm_reads = warm_hits + s1["misses"] - s0["misses"]
    res["hit_rate_whole"] = s1["hits"] / (s1["hits"] + s1["misses"])
    res["hit_rate_second_half"] = warm_hits / warm_reads
    # What any cache could do on this stream, over the second half: an unlimited one hits only
    # rows read before (the rest are first reads); a fixed set of as many rows as ours, the
    # first half's most-read rows (LFU with the history known), hits this often.
    rows = cached.plan.hash(toks[None, :])[LAYER][0] + cached.layer(LAYER).offsets
    seen, counts = np.unique(rows[:half], return_counts=True)
    top = seen[np.argsort(counts)[::-1][:s1["capacity_rows"]]]
    res["hit_rate_unlimited"] = float(np.isin(rows[half:], seen).mean())
    res["hit_rate_lfu_first_half"] = float(np.isin(rows[half:], top).mean())
    res["cache_bytes"] = s1["cache_bytes"]
    res["cache_rows"] = s1["capacity_rows"]
    res["table_bytes"] = table_bytes(ram)
    res["step_us_ram"] = float(np.median(t_ram) * 1e6)
    res["step_us_rowcache"] = float(np.median(t_cache) * 1e6)
    res["warm_ratio"] = res["step_us_rowcache"] / res["step_us_ram"]
    print(f"1. row cache {res['cache_bytes'] / 2**20:.1f} MiB = {res['cache_bytes'] / res['table_bytes']:.1%} of "
          f"the {res['table_bytes'] / 2**20:.0f} MiB table ({res['cache_rows']} rows): hit rate "
          f"{res['hit_rate_whole']:.1%} over {len(toks)} tokens, {res['hit_rate_second_half']:.1%} in the second half "
          f"(bounds: an unlimited cache {res['hit_rate_unlimited']:.1%}, the first half's most-read rows "
          f"{res['hit_rate_lfu_first_half']:.1%})")
    print(f"2. warm decode: row cache {res['step_us_rowcache']:.1f} us/step vs table in RAM "
          f"{res['step_us_ram']:.1f} us/step: {res['warm_ratio']:.3f}x")


# ---- 3: same RAM budget, memory cgroup ---------------------------------------------------------
def own_memory_cgroup():
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrl, path = line.strip().split(":", 2)
            if "memory" in ctrl.split(","):
                return "/sys/fs/cgroup/memory" + path
    return None


def cgroup_worker(path, mode, toks_path, frac, cg):
    """In a fresh process: join cgroup `cg`, set up, cap the cgroup at footprint + budget, go."""
    from engram_stream import EngramModel
    from engram_stream.io import memory
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    toks = np.load(toks_path)
    probe = EngramModel.load(path)
    budget = int(budget_mb(probe, frac) * 2**20)
    del probe
    model = EngramModel.load(path, row_cache_mb=budget / 2**20 if mode == "rowcache" else None)
    eng = model.stream(LAYER)
    G, D = model.cfg.hc_mult, model.cfg.hidden_size
    h = np.zeros((G, D), np.float32)
    out = np.empty_like(h)
    table = model.layer(LAYER).table
    memory.release(model)
    memory.evict_file(path)
    usage = int(open(os.path.join(cg, "memory.usage_in_bytes")).read())
    with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
        f.write(str(usage + budget))
    served = reads = hits0 = 0
    warm = len(toks) // 2  # the first half fills RAM; rows are counted over the second half
    t0 = time.perf_counter()
    for i, t in enumerate(toks):
        if i == warm:
            hits0 = model.row_cache_stats()["hits"]
        eng.feed(int(t))
        if i >= warm:
            if mode == "pagecache":
                for r in eng.rows.ravel().tolist():
                    served += memory.resident_bytes(table[r:r + 1]) == table.itemsize * table.shape[1]
            reads += eng.rows.size
        eng.compute(h, out=out)
    dt = time.perf_counter() - t0
    if mode == "rowcache":
        served = model.row_cache_stats()["hits"] - hits0
    peak = int(open(os.path.join(cg, "memory.max_usage_in_bytes")).read())
    print(json.dumps({"mode": mode, "served": served, "reads": reads, "budget": budget, "limit": usage + budget,
                      "footprint": usage, "peak": peak, "seconds": dt}))


def sec_cgroup(path, toks, frac, res, tmp):
    parent = own_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        print("3. skipped: no writable cgroup v1 memory controller")
        return
    toks_path = os.path.join(tmp, "tokens.npy")
    np.save(toks_path, toks)
    got = {}
    for mode in ("pagecache", "rowcache"):
        cg = os.path.join(parent, f"engram_bench_tiers_{os.getpid()}_{mode}")
        os.mkdir(cg)
        try:
            r = subprocess.run([sys.executable, HERE, "--worker", mode, "--path", path, "--toks", toks_path,
                                "--cache-frac", str(frac), "--cg", cg], env=ENV, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{mode} worker failed:\n{r.stderr[-3000:]}")
            got[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            os.rmdir(cg)
    pc, rc = got["pagecache"], got["rowcache"]
    res["cgroup"] = got
    res["served_ratio"] = rc["served"] / max(pc["served"], 1)
    print(f"3. same RAM budget ({pc['budget'] / 2**20:.1f} MiB over a {pc['footprint'] / 2**20:.0f} MiB footprint, "
          f"cold file, {len(toks)} tokens, counted over the second half): rows served from RAM: page cache {pc['served']}/{pc['reads']} "
          f"({pc['served'] / pc['reads']:.1%}), row cache {rc['served']}/{rc['reads']} ({rc['served'] / rc['reads']:.1%}): "
          f"{res['served_ratio']:.2f}x")


# ---- 3b: the same comparison at steady state, simulated ----------------------------------------
def sec_simulated(path, n_tokens, frac, res):
    """Both caches replayed over a long stream's rows (no floats): the RowCache itself (its C
    code, 1-byte records) vs an LRU of 4 KiB pages with the same RAM, the page cache's policy
    to a first approximation (section 3 measures the real one on a shorter stream)."""
    from collections import OrderedDict

    from engram_stream import EngramModel
    from engram_stream.rows._cache import RowCache, slots_for
    model = EngramModel.load(path)
    t = model.layer(LAYER).table
    budget = int(budget_mb(model, frac) * 2**20)
    nslots = slots_for(budget, t.shape[1] * t.itemsize)
    toks = zipf_tokens(n_tokens, model.cfg.vocab_size)
    rows = (model.plan.hash(toks[None, :])[LAYER][0] + model.layer(LAYER).offsets).ravel()
    half = rows.size // 2
    cache = RowCache(nslots, 1)
    cache.read(rows[:half], np.zeros((t.shape[0], 1), np.uint8))
    h0 = cache.stats()["hits"]
    cache.read(rows[half:], np.zeros((t.shape[0], 1), np.uint8))
    row_rate = (cache.stats()["hits"] - h0) / (rows.size - half)
    pages = (rows * (t.shape[1] * t.itemsize)) // 4096
    cap, lru, hits = budget // 4096, OrderedDict(), 0
    for i, p in enumerate(pages.tolist()):
        if p in lru:
            lru.move_to_end(p)
            hits += i >= half
        else:
            lru[p] = None
            if len(lru) > cap:
                lru.popitem(last=False)
    page_rate = hits / (rows.size - half)
    res["sim_tokens"] = n_tokens
    res["sim_rowcache_rate"], res["sim_pagelru_rate"] = row_rate, page_rate
    print(f"3b. simulated over {n_tokens} tokens (second half): row cache {row_rate:.1%} of rows from RAM, "
          f"an LRU of pages with the same RAM {page_rate:.1%}: {row_rate / page_rate:.2f}x")


# ---- 4: Mooncake -----------------------------------------------------------------------------
def sec_remote(path, toks, frac, res):
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        print("4. skipped: the mooncake extra is not installed")
        return
    from engram_stream import EngramModel
    from mooncake_servers import LocalMooncake, wait_until_writable
    from engram_stream.rows import MooncakeTier
    local = EngramModel.load(path)
    seg_mb = int(table_bytes(local) * 1.3 / 2**20) + 64
    with LocalMooncake(segment_mb=seg_mb) as mc:
        tier = MooncakeTier(master=mc.master, metadata=mc.metadata)
        wait_until_writable(tier)
        t0 = time.perf_counter()
        n = tier.publish(local)
        res["publish_MBps"] = n / 2**20 / (time.perf_counter() - t0)
        G, D = local.cfg.hc_mult, local.cfg.hidden_size
        h = np.zeros((G, D), np.float32)
        out = np.empty_like(h)
        for mb, name in ((budget_mb(local, frac), "remote_rowcache"), (0, "remote_nocache"),
                         (budget_mb(local, frac), "local_rowcache")):
            m = EngramModel.load(path, tables="mapped" if name.startswith("local") else tier, row_cache_mb=mb)
            eng = m.stream(LAYER)
            t0 = time.perf_counter()
            decode(eng, toks, h, out)
            dt = time.perf_counter() - t0
            s = m.row_cache_stats()
            r = {"step_us": dt / len(toks) * 1e6, "misses_per_token": s["misses"] / len(toks),
                 "hit_rate": s["hits"] / max(s["hits"] + s["misses"], 1)}
            if "fetches" in s:
                r["reads_per_token"] = s["fetches"] / len(toks)
                r["read_us"] = s["fetch_seconds"] / max(s["fetches"], 1) * 1e6
                r["rows_per_read"] = s["bytes_fetched"] / (m.layer(LAYER).table.itemsize * m.cfg.head_dim) / max(s["fetches"], 1)
            res[name] = r
            del eng, m
        tier.close()
    for name in ("remote_rowcache", "remote_nocache", "local_rowcache"):
        r = res[name]
        extra = (f", {r['reads_per_token']:.2f} batched reads/token of {r['rows_per_read']:.1f} rows, "
                 f"{r['read_us']:.0f} us each") if "read_us" in r else ""
        print(f"4. {name}: {r['step_us']:.0f} us/step, hit rate {r['hit_rate']:.1%}, "
              f"{r['misses_per_token']:.2f} misses/token{extra}")
    print(f"   publish: {res['publish_MBps']:.0f} MiB/s over loopback TCP")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--remote-tokens", type=int, default=3000)
    ap.add_argument("--sim-tokens", type=int, default=400000)
    ap.add_argument("--cache-frac", type=float, default=0.10)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--only", default="1234")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--toks", help=argparse.SUPPRESS)
    ap.add_argument("--cg", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return cgroup_worker(a.path, a.worker, a.toks, a.cache_frac, a.cg)
    from engram_stream import EngramModel
    tmp = a.dir or tempfile.mkdtemp(prefix="engram_bench_tiers_", dir="/tmp")
    os.makedirs(tmp, exist_ok=True)
    path = os.path.join(tmp, "tiers.safetensors")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        EngramModel.init(config(), seed=0).save(path)
        print(f"model written in {time.perf_counter() - t0:.1f} s: {path}")
    cfg = config()
    toks = zipf_tokens(a.tokens, cfg.vocab_size)
    res = {"tokens": a.tokens, "cache_frac": a.cache_frac}
    if "1" in a.only or "2" in a.only:
        sec_warm(path, toks, a.cache_frac, res)
    if "3" in a.only:
        sec_cgroup(path, toks, a.cache_frac, res, tmp)
    if "3" in a.only:
        for n in (a.tokens, a.sim_tokens):
            sec_simulated(path, n, a.cache_frac, res)
    if "4" in a.only:
        sec_remote(path, toks[:a.remote_tokens], a.cache_frac, res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if not a.keep and a.dir is None:
        os.remove(path)
        for f in os.listdir(tmp):
            os.remove(os.path.join(tmp, f))
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
