#!/usr/bin/env python
"""DeepSeek-V4.1 tables from disk: direct row reads against fio, one read per missed row, and
the engine through them (cold, warm, memory, a long prompt). Every ratio from one run.

    flock /tmp/bench.lock python bench/bench_direct.py               # all sections (a few GB on disk)
    options: --dir DIR (/tmp/engram_bench_direct)  --evs N (333337: ~8M rows, 2.1 GB a layer)
             --qd 32  --only raw,cold,...  --json FILE  --quick

A synthetic checkpoint with Flash-dim rows (24 heads x 256 e4m3 + 8 e8m0 bytes) in the HF
layout, its packed row file beside it (engram-stream pack-rows), on the machine's own disk.
Sections:
  device   the block device and file system the files are on (lsblk, df -T, queue settings)
  raw      fio's 4 KiB random reads (io_uring, O_DIRECT, iodepth = qd) over the packed row file
           vs the engine's reader (rows/_direct.pyx: pread over qd - 1 threads + the caller,
           O_DIRECT) on the same file, batches of 768 random rows (a 16-stream step, 2 layers),
           rounds interleaved: reads per second, goal >= 0.7x; preads per row read: from the row
           file 1, from the shards 2 (weight and scale apart)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout (in-place build)

LAYERS = [1, 14]


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({e})"


def device(path):
    """What the files sit on: file system, block device, its queue."""
    src = sh(f"df --output=source {path} | tail -1")
    dev = os.path.basename(src)
    q = f"/sys/block/{dev}/queue"
    info = {"df": sh(f"df -T -h {path} | tail -1"), "lsblk": sh(f"lsblk -o NAME,SIZE,TYPE,ROTA,MODEL,SCHED {src}"),
            "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(), "cores": os.cpu_count(),
            "kernel": platform.release()}
    for k in ("logical_block_size", "max_sectors_kb", "nr_requests", "rotational", "scheduler"):
        info[k] = sh(f"cat {q}/{k} 2>/dev/null")
    info["virtio"] = os.path.exists(f"/sys/block/{dev}/device/driver") and "virtio" in os.path.realpath(
        f"/sys/block/{dev}/device/driver")
    return info


def ensure_checkpoint(d, evs, hidden):
    from engram_stream.v41 import hf
    if not os.path.isfile(os.path.join(d, "config.json")):
        cfg = hf.flash_config(engram_vocab_size=evs, dim=hidden)
        t0 = time.perf_counter()
        hf.make_synthetic(d, cfg, seed=0, n_shards=2, tokenizer=False, decoys=False)
        print(f"wrote {d} in {time.perf_counter() - t0:.0f} s", flush=True)
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    rows = packed.rows_path(d)
    if not os.path.exists(rows):
        t0 = time.perf_counter()
        packed.pack_rows(EngramModel.from_deepseek_v41(d), rows)
        print(f"packed {rows} in {time.perf_counter() - t0:.0f} s", flush=True)
    return d


def fio(path, qd, seconds, size=None):
    """fio random 4 KiB reads, O_DIRECT, io_uring at iodepth qd: IOPS."""
    cmd = ["fio", "--name=r", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
           "--ioengine=io_uring", f"--iodepth={qd}", f"--runtime={seconds}", "--time_based",
           "--output-format=json", "--randrepeat=0"]
    if size:
        cmd.append(f"--size={size}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return job["iops"]


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
    from engram_stream.rows.tiers import record_arrays
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


SECTIONS = {"raw": section_raw}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/engram_bench_direct")
    ap.add_argument("--evs", type=int, default=333337, help="engram_vocab_size: ~24x this many rows a layer")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
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
