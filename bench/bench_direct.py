#!/usr/bin/env python
"""DeepSeek-V4.1 tables from disk: direct row reads against fio, one read per missed row, and
the engine through them (cold, warm, memory, a long prompt). Every ratio from one run.

    flock /tmp/bench.lock python bench/bench_direct.py               # all sections (~2 GB on disk)
    options: --dir DIR (/tmp/engram_bench_direct)  --evs N (50000: ~1.2M rows, 317 MB a layer)
             --hidden 256  --qd 32  --streams 16  --cache-mb 64  --only raw,cold,...  --json FILE

A synthetic checkpoint with Flash-dim rows (24 heads x 256 e4m3 + 8 e8m0 bytes) in the HF
layout (hidden size --hidden), its packed row file beside it (engram-stream pack-rows), on the
machine's own disk.
Sections:
  device   the block device and file system the files are on (lsblk, df -T, queue settings)
  raw      fio's 4 KiB random reads (io_uring, O_DIRECT, iodepth = qd) over the packed row file
           vs the engine's reader (rows/_direct.pyx: pread over qd - 1 threads + the caller,
           O_DIRECT) on the same file, batches of 768 random rows (a 16-stream step, 2 layers),
           rounds interleaved: reads per second, goal >= 0.7x; preads per row read: from the row
           file 1, from the shards 2 (weight and scale apart)
  cold     the engine decoding 16 streams of uniform random ids (nearly every row a miss) with
           tables=DirectTier(qd) and a cache of --cache-mb (the table >= 4x it), against fio at
           the same qd on the same row file, rounds interleaved: reads per second (goal >= 0.7x),
           preads per row read (goal 1)
  warm     every row cached vs every table in RAM (mmap=False): step time (goal <= 1.1x)
  memory   RssAnon growth over --mem-tokens tokens of cold decode (goal <= cache budget + 64 MB)
  prompt   a --prompt token prompt from cold vs tables in RAM: time to first token
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from _lib.disk import device, ensure_checkpoint, fio  # noqa: E402

LAYERS = [1, 14]


def reader_rate(reader, nrows, seconds, batch=768, seed=0):
    """Reads per second of a DirectReader on batches of `batch` random rows."""
    rng = np.random.default_rng(seed)
    st0 = reader.stats()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        reader.read(rng.integers(0, nrows, batch))
    dt = time.perf_counter() - t0
    st = reader.stats()
    return {"reads_per_s": (st["reads"] - st0["reads"]) / dt,
            "reads_per_row": (st["reads"] - st0["reads"]) / max(1, st["rows_read"] - st0["rows_read"]),
            "rows_per_s": (st["rows_read"] - st0["rows_read"]) / dt}


def section_raw(a, d, res):
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    from engram_stream.rows._direct import DirectReader, FilePart, IOPool, RecordFile
    model = EngramModel.from_deepseek_v41(d)
    rows_file = packed.rows_path(d)
    head = packed.read_header(rows_file)
    L = LAYERS[0]
    lay = head["layers"][str(L)]
    N = lay["rows"]
    pf = RecordFile(N, [FilePart(rows_file, lay["offset"], 264, 15, 4096)], rowbytes=256)
    w = model.layer(L)
    from engram_stream.io.files import mapping_of
    parts = []
    for arr in (w.embed_weight, w.embed_scale):
        mm = mapping_of(arr)
        base = np.frombuffer(mm, np.uint8, 1).ctypes.data
        parts.append(FilePart(mm.path, arr.ctypes.data - base, arr.shape[1]))
    sf = RecordFile(N, parts, rowbytes=256)
    io = IOPool(a.qd)
    rp, rs = DirectReader(pf, io), DirectReader(sf, io)
    rounds = []
    for r in range(a.rounds):
        f = fio(rows_file, a.qd, a.seconds)
        p = reader_rate(rp, N, a.seconds, seed=r)
        s = reader_rate(rs, N, a.seconds, seed=100 + r)
        rounds.append({"fio": f, "packed": p, "shards": s})
        print(f"  round {r}: fio {f:,.0f} IOPS | reader, row file {p['reads_per_s']:,.0f} reads/s "
              f"({p['reads_per_row']:.3f} per row) | reader, shards {s['reads_per_s']:,.0f} reads/s "
              f"({s['reads_per_row']:.3f} per row, {s['rows_per_s']:,.0f} rows/s)", flush=True)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    f = med([x["fio"] for x in rounds])
    p = med([x["packed"]["reads_per_s"] for x in rounds])
    res["raw"] = {"qd": a.qd, "rounds": rounds, "fio_iops": f, "reader_reads_per_s": p, "ratio": p / f,
                  "direct": [pf.direct, sf.direct],
                  "reads_per_row_packed": med([x["packed"]["reads_per_row"] for x in rounds]),
                  "reads_per_row_shards": med([x["shards"]["reads_per_row"] for x in rounds])}
    print(f"raw, qd {a.qd}: reader / fio = {p:,.0f} / {f:,.0f} = {p / f:.2f}x (goal >= 0.7x); preads per row: "
          f"row file {res['raw']['reads_per_row_packed']:.3f}, shards {res['raw']['reads_per_row_shards']:.3f}",
          flush=True)


def rss_anon():
    """RssAnon of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def load(d, **kw):
    from engram_stream import EngramModel
    return EngramModel.from_deepseek_v41(d, **kw)


def decode_steps(model, dec, ids, hid, reset=False):
    """Every step of ids [T, S] through the decoder (hidden [S, G, D] for all): seconds a step.
    reset: every stream from its start first (the same ids then read the same rows)."""
    if reset:
        dec.reset()
    t0 = time.perf_counter()
    for t in range(ids.shape[0]):
        dec.begin(ids[t])
        for L in model.cfg.layer_ids:
            dec.layer(L, hid)
    return (time.perf_counter() - t0) / ids.shape[0]


def section_cold(a, d, res):
    """16 streams of uniform random ids (nearly every row a miss), tables="direct" (O_DIRECT,
    packed row file, qd) with a cache of a small fraction of the table, against fio at the same
    qd on the same file; rounds interleaved."""
    from engram_stream.rows import DirectTier, packed
    S, rng = a.streams, np.random.default_rng(1)
    rounds = []
    for r in range(a.rounds):
        f = fio(packed.rows_path(d), a.qd, a.seconds)
        model = load(d, tables=DirectTier(qd=a.qd), row_cache_mb=a.cache_mb)
        cfg = model.cfg
        # the engine's read path alone (hash, submit, plan, the pool, admit; no projection): every
        # layer fed, then every layer's rows fetched, as Decoder.begin + layer() order them
        engines = [model.stream(L, S) for L in cfg.layer_ids]
        st0 = model.row_cache_stats()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            ids = rng.integers(0, cfg.vocab_size, S)
            for e in engines:
                e.feed(ids)
            for e in engines:
                e.fetch()
        dt = time.perf_counter() - t0
        st = model.row_cache_stats()
        only = {"reads_per_s": (st["reads"] - st0["reads"]) / dt,
                "reads_per_row_read": (st["reads"] - st0["reads"]) / max(1, st["rows_read"] - st0["rows_read"])}
        del engines
        # full decode steps (the projection included) through the same model
        hid = rng.standard_normal((S, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
        dec = model.decoder(n_streams=S)
        decode_steps(model, dec, rng.integers(0, cfg.vocab_size, (5, S)), hid)  # threads up
        st0 = model.row_cache_stats()
        t0, steps = time.perf_counter(), 0
        while time.perf_counter() - t0 < a.seconds:
            decode_steps(model, dec, rng.integers(0, cfg.vocab_size, (10, S)), hid)
            steps += 10
        dt = time.perf_counter() - t0
        st = model.row_cache_stats()
        reads, rows = st["reads"] - st0["reads"], st["rows_read"] - st0["rows_read"]
        misses = st["misses"] - st0["misses"]
        e = {"fio_iops": f, "read_path_reads_per_s": only["reads_per_s"],
             "read_path_reads_per_row_read": only["reads_per_row_read"], "reads_per_s": reads / dt, "rows_read_per_s": rows / dt, "step_ms": 1e3 * dt / steps,
             "reads_per_row_read": reads / max(1, rows), "hit_rate": 1 - misses / max(1, st["hits"] + st["misses"]
                                                                                       - st0["hits"] - st0["misses"]),
             "read_wait_p50_ms": 1e3 * st["read_wait_p50"], "read_wait_p99_ms": 1e3 * st["read_wait_p99"],
             "direct": [rf.direct for rf in model.tier.inner.files.values()],
             "rows_file": model.tier.inner.rows_path, "table_over_cache": None}
        table = sum(model.plan.table_rows[L] * 264 for L in cfg.layer_ids)
        e["table_over_cache"] = table / max(1, st["budget_bytes"])
        rounds.append(e)
        print(f"  round {r}: fio {f:,.0f} IOPS | engine read path {only['reads_per_s']:,.0f} reads/s "
              f"({only['reads_per_row_read']:.3f} per row read) | decode {e['reads_per_s']:,.0f} reads/s, "
              f"{e['reads_per_row_read']:.3f} reads per row read, step {e['step_ms']:.1f} ms, hits "
              f"{100 * e['hit_rate']:.1f}%, wait p50/p99 {e['read_wait_p50_ms']:.2f}/{e['read_wait_p99_ms']:.2f} ms",
              flush=True)
        del dec, model
    med = lambda k: float(np.median([x[k] for x in rounds]))  # noqa: E731
    ratios = [x["read_path_reads_per_s"] / x["fio_iops"] for x in rounds]
    res["cold"] = {"rounds": rounds, "qd": a.qd, "streams": S, "fio_iops": med("fio_iops"),
                   "read_path_reads_per_s": med("read_path_reads_per_s"), "reads_per_s": med("reads_per_s"),
                   "step_ms": med("step_ms"), "ratio_median": float(np.median(ratios)),
                   "reads_per_row_read": med("reads_per_row_read"), "table_over_cache": rounds[0]["table_over_cache"]}
    c = res["cold"]
    print(f"cold, {S} streams, qd {a.qd}: engine read path / fio = {c['read_path_reads_per_s']:,.0f} / "
          f"{c['fio_iops']:,.0f} reads/s, median of per-round ratios {c['ratio_median']:.2f}x (goal >= 0.7x); "
          f"decode with the projection {c['reads_per_s']:,.0f} reads/s at {c['step_ms']:.1f} ms a step; reads per "
          f"row read {c['reads_per_row_read']:.3f} (goal 1); table {c['table_over_cache']:.1f}x the cache", flush=True)


def section_warm(a, d, res):
    """Every row cached (the tokens cycle over a small set; the cache holds all their rows) vs
    every table in RAM (mmap=False): seconds a 16-stream step, rounds interleaved."""
    from engram_stream.rows import DirectTier
    S, rng = a.streams, np.random.default_rng(2)
    ram = load(d, mmap=False)
    cfg = ram.cfg
    pool = rng.integers(0, cfg.vocab_size, 8)      # 8 ids: at most 8^3 windows per n-gram order
    ids = pool[rng.integers(0, pool.size, (a.warm_steps, S))]
    hid = rng.standard_normal((S, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    cached = load(d, tables=DirectTier(qd=a.qd), row_cache_mb=a.cache_mb)
    dc, dr = cached.decoder(n_streams=S), ram.decoder(n_streams=S)
    decode_steps(cached, dc, ids, hid, reset=True)  # brings every row in
    decode_steps(ram, dr, ids, hid, reset=True)
    st0 = cached.row_cache_stats()
    rounds = []
    for r in range(a.rounds * 3):
        tc = decode_steps(cached, dc, ids, hid, reset=True)
        tr = decode_steps(ram, dr, ids, hid, reset=True)
        rounds.append({"cached_ms": 1e3 * tc, "ram_ms": 1e3 * tr, "ratio": tc / tr})
    st = cached.row_cache_stats()
    assert st["misses"] == st0["misses"], "warm rounds missed"
    res["warm"] = {"rounds": rounds, "ratio_median": float(np.median([x["ratio"] for x in rounds])),
                   "cached_ms": float(np.median([x["cached_ms"] for x in rounds])),
                   "ram_ms": float(np.median([x["ram_ms"] for x in rounds])), "rows_cached": st["rows_cached"]}
    w = res["warm"]
    print(f"warm, {S} streams: cached {w['cached_ms']:.2f} ms vs tables in RAM {w['ram_ms']:.2f} ms a step, median "
          f"ratio {w['ratio_median']:.3f}x (goal <= 1.1x); {st['rows_cached']} rows cached, no miss", flush=True)


def section_memory(a, d, res):
    """RssAnon before the decoder exists vs after a.mem_tokens tokens (16 streams, uniform random
    ids: the cache fills and evicts all along), tables="direct" with a.cache_mb."""
    from engram_stream.rows import DirectTier
    S, rng = a.streams, np.random.default_rng(3)
    model = load(d, tables=DirectTier(qd=a.qd), row_cache_mb=a.cache_mb)
    cfg = model.cfg
    hid = rng.standard_normal((S, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    r0 = rss_anon()
    dec = model.decoder(n_streams=S)
    steps = a.mem_tokens // S
    t0 = time.perf_counter()
    samples = []
    for k in range(0, steps, 500):
        decode_steps(model, dec, rng.integers(0, cfg.vocab_size, (min(500, steps - k), S)), hid)
        samples.append((k + 500) * S)
    grow = rss_anon() - r0
    st = model.row_cache_stats()
    res["memory"] = {"tokens": steps * S, "rss_anon_growth": grow, "budget_bytes": st["budget_bytes"],
                     "limit": st["budget_bytes"] + (64 << 20), "seconds": time.perf_counter() - t0,
                     "evictions": st["evictions"]}
    m = res["memory"]
    print(f"memory: {m['tokens']} tokens, RssAnon +{grow / 2**20:.1f} MiB vs cache budget "
          f"{m['budget_bytes'] / 2**20:.1f} MiB + 64 MiB = {m['limit'] / 2**20:.1f} MiB (goal: at most); "
          f"{st['evictions']} evictions, {m['seconds']:.0f} s", flush=True)


def section_prompt(a, d, res):
    """A prompt of a.prompt uniform random ids (every row a miss) on one stream, from cold
    (tables="direct", O_DIRECT, a fresh model) vs the tables in RAM: time to the first token's
    Engram outputs (Decoder.prefill of every layer)."""
    from engram_stream.rows import DirectTier
    rng = np.random.default_rng(4)
    ram = load(d, mmap=False)
    cfg = ram.cfg
    ids = rng.integers(0, cfg.vocab_size, a.prompt)
    hid = rng.standard_normal((a.prompt, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    hs = {L: hid for L in cfg.layer_ids}
    rounds = []
    for r in range(a.prompt_rounds):
        t0 = time.perf_counter()
        ram.decoder().prefill(ids, hs)
        tr = time.perf_counter() - t0
        cold = load(d, tables=DirectTier(qd=a.qd), row_cache_mb=a.cache_mb)
        r0 = rss_anon()
        t0 = time.perf_counter()
        cold.decoder().prefill(ids, hs)
        tc = time.perf_counter() - t0
        st = cold.row_cache_stats()
        rounds.append({"ram_s": tr, "cold_s": tc, "ratio": tc / tr, "reads": st["reads"],
                       "reads_per_s": st["reads"] / tc, "rss_anon_growth": rss_anon() - r0})
        print(f"  round {r}: RAM {tr:.2f} s | cold {tc:.2f} s ({st['reads']:,} reads, "
              f"{st['reads'] / tc:,.0f} reads/s) | {tc / tr:.1f}x", flush=True)
        del cold
    res["prompt"] = {"tokens": a.prompt, "rounds": rounds,
                     "ram_s": float(np.median([x["ram_s"] for x in rounds])),
                     "cold_s": float(np.median([x["cold_s"] for x in rounds]))}
    p = res["prompt"]
    print(f"prompt of {a.prompt} tokens: time to first token from cold {p['cold_s']:.2f} s vs tables in RAM "
          f"{p['ram_s']:.2f} s", flush=True)


SECTIONS = {"raw": section_raw, "cold": section_cold, "warm": section_warm, "memory": section_memory,
            "prompt": section_prompt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/engram_bench_direct")
    ap.add_argument("--evs", type=int, default=50000, help="engram_vocab_size: ~24x this many rows a layer")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--cache-mb", dest="cache_mb", type=float, default=64)
    ap.add_argument("--warm-steps", dest="warm_steps", type=int, default=50)
    ap.add_argument("--mem-tokens", dest="mem_tokens", type=int, default=100_000)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--prompt-rounds", dest="prompt_rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if shutil.which("fio") is None:
        sys.exit("fio is needed (Debian: apt-get install fio)")
    d = os.path.join(a.dir, f"flash-rows-{a.evs}-d{a.hidden}")
    os.makedirs(a.dir, exist_ok=True)
    ensure_checkpoint(d, a.evs, a.hidden)
    res = {"device": device(d), "args": vars(a)}
    print(json.dumps(res["device"], indent=1), flush=True)
    for name in a.only.split(","):
        SECTIONS[name](a, d, res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
