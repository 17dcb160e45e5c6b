#!/usr/bin/env python
"""The packed row file's record checksums: what checking them costs a read (goal <= 5% of a cold read).

    flock /tmp/bench.lock python bench/bench_row_sums.py     # ~1 min, ~110 MB on disk
    options: --dir DIR (/tmp/engram_bench_sums)  --rows N (400000)  --batch 768  --rounds 30  --qd 1,16

A file laid out as the packed row file lays out V4.1's 264-byte records (15 a 4 KiB page, their
15 checksums after them: rows.packed.group_layout), read by the engine's direct reader
(rows/_direct.pyx over include/engram_io.h) through two RecordFiles of the same file: one whose
part has the checksums (every record copied out is checked first, es_io_sum) and one that reads
the same pages and ignores them. Batches of --batch random distinct rows (a 16-stream step over
2 layers of 24 heads), rounds alternating between the two, each file opened with O_DIRECT where
the file system takes it (then every read is cold: from the device, not the page cache; the
"cold" line says whether it was) and again buffered after a first pass (warm: the page cache,
where a read costs least and the check's share is largest). Prints per batch the median time of
each, their ratio, and the checksum's own time per record (record_sums, one thread); the CPU
is named.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

REC = 264   # a V4.1 record: 256 e4m3 bytes + 8 e8m0 bytes


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def write_file(path, nrows, seed):
    """The records of nrows random rows in the packed layout (one layer at offset 0)."""
    from engram_stream.rows._direct import record_sums
    from engram_stream.rows.packed import PAGE, group_layout
    per, gb, sums = group_layout(REC)
    rng = np.random.default_rng(0)
    groups = -(-nrows // per)
    with open(path, "wb") as f:
        for g0 in range(0, groups, 4096):
            g1 = min(groups, g0 + 4096)
            n = (g1 - g0) * per
            recs = rng.integers(0, 256, (n, REC), dtype=np.uint8)
            out = np.zeros((g1 - g0, gb), np.uint8)
            out[:, :per * REC] = recs.reshape(g1 - g0, -1)
            out[:, sums:sums + 8 * per] = record_sums(recs, seed, g0 * per).astype("<u8").view(np.uint8).reshape(
                g1 - g0, -1)
            out.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    assert os.path.getsize(path) == groups * PAGE
    return per, gb, sums


def bench(path, nrows, layout, seed, qd, batch, rounds, direct):
    from engram_stream.rows._direct import DirectReader, FilePart, IOPool, RecordFile
    per, gb, sums = layout
    io = IOPool(qd)
    checked = DirectReader(RecordFile(nrows, [FilePart(path, 0, REC, per, gb, sums=sums, seed=seed)], direct=direct,
                                      layer=1), io)
    plain = DirectReader(RecordFile(nrows, [FilePart(path, 0, REC, per, gb)], direct=direct, layer=1), io)
    rng = np.random.default_rng(qd)
    if not direct:  # warm: the whole file in the page cache first
        plain.read(np.arange(nrows))
    t = {"checked": [], "plain": []}
    for i in range(2 * rounds):
        rows = rng.choice(nrows, batch, replace=False)
        name = ("checked", "plain")[(i + i // 2) % 2]   # alternating, each first half the time
        r = checked if name == "checked" else plain
        t0 = time.perf_counter()
        got = r.read(rows)
        t[name].append(time.perf_counter() - t0)
        assert got.shape == (batch, REC)
    med = {k: float(np.median(v)) for k, v in t.items()}
    return med, checked.file.direct[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/engram_bench_sums")
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--qd", default="1,16")
    a = ap.parse_args()
    from engram_stream.rows._direct import record_sums
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "rows.bin")
    seed = 1 << 40
    layout = write_file(path, a.rows, seed)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); file: {path}, {a.rows} records of {REC} bytes, "
          f"{os.path.getsize(path) >> 20} MiB; batches of {a.batch} random rows, {a.rounds} rounds each")
    recs = np.random.default_rng(1).integers(0, 256, (a.batch, REC), dtype=np.uint8)
    best = min((lambda t0: (record_sums(recs, seed, 0), time.perf_counter() - t0)[1])(time.perf_counter())
               for _ in range(50))
    print(f"checksum alone: {best / a.batch * 1e9:.1f} ns a {REC}-byte record ({REC * a.batch / best / 1e9:.2f} GB/s, "
          f"one thread)")
    for qd in (int(q) for q in a.qd.split(",")):
        for direct in (True, False):
            med, odirect = bench(path, a.rows, layout, seed, qd, a.batch, a.rounds, direct)
            kind = ("cold (O_DIRECT)" if odirect else "cold asked, O_DIRECT refused: buffered") if direct else \
                "warm (page cache)"
            ratio = med["checked"] / med["plain"]
            print(f"qd {qd:3d} {kind:24s} checked {med['checked'] * 1e3:8.3f} ms  plain {med['plain'] * 1e3:8.3f} ms "
                  f" a batch; checked / plain {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)"
                  + (f"  goal <= 1.05: {'ok' if ratio <= 1.05 else 'MISSED'}" if direct else ""))
    os.remove(path)


if __name__ == "__main__":
    main()
