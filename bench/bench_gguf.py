"""GGUF tables (tables=GGUFTier): rows decoded a second, and the row cache's hit rate at equal MB.

    flock /tmp/bench.lock python bench/bench_gguf.py        # ~1 GB of temporary files (a minute or two)
    options: --rows N (400000)  --reads N (2000000)  --budget-mb M (64)  --zipf A (1.0)  --dir DIR  --json FILE

1. Rows decoded a second, one thread: V4.1-shaped rows of 256 values gathered by random id
   into float32, as an engine's gather does. From a mapped GGUF (warm in the page cache) in
   Q4_K (144 bytes a row), Q8_0 (272) and the 264-byte e4m3 rows (ds4's I8 tensor), each
   through include/engram_gguf.h (rows._gguf.gather); against the checkpoint's own table in RAM
   (e4m3 bytes + e8m0 scales, es8_gather: the V4.1 engine's gather, v41._engine.gather_rows).
2. The row cache's hit rate at equal MB: the engine's RowCache (the same index and CLOCK code,
   keys only: touch()) sized by slots_for(budget, record bytes) for 144-byte Q4_K records and
   264-byte e4m3 records, replaying one stream of row reads: ranks drawn from Zipf(a) over
   --rows rows (ranks shuffled onto rows). Prints both hit rates and the slots each holds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

HD = 256


def write_tables(d, n, rng):
    """{name: (path, tensor name)}: one GGUF a type, n rows of HD values, written by gguf.GGUFWriter."""
    import gguf
    from gguf import GGMLQuantizationType as T
    out = {}
    for name in ("Q4_K", "Q8_0", "E4M3"):
        path = os.path.join(d, f"bench-{name}.gguf")
        w = gguf.GGUFWriter(path, "deepseek41")
        if name == "E4M3":
            raw = rng.integers(0, 256, (n, 264), dtype=np.uint8)
            raw[:, :256] &= 0xF7
            w.add_tensor("blk.1.engram_embd.weight", raw.view(np.int8), raw_dtype=T.I8)
        elif name == "Q8_0":
            x = rng.standard_normal((n, HD)).astype(np.float32)
            w.add_tensor("blk.1.engram_embd.weight", gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
        else:   # random blocks with small finite fp16 super-scales (gguf-py cannot quantize to Q4_K)
            raw = rng.integers(0, 256, (n, 144), dtype=np.uint8)
            raw[:, 0:4] = rng.uniform(1e-3, 1e-2, (n, 2)).astype(np.float16).view(np.uint8)
            w.add_tensor("blk.1.engram_embd.weight", raw, raw_dtype=T.Q4_K)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out[name] = path
    return out


def rate(fn, ids, repeat=3):
    """Rows a second of fn(ids), the best of `repeat` runs after one warm-up."""
    fn(ids[:1000])
    best = min(_timed(fn, ids) for _ in range(repeat))
    return ids.size / best


def _timed(fn, ids):
    t = time.perf_counter()
    fn(ids)
    return time.perf_counter() - t


def decode_rates(paths, n, reads, rng):
    from engram_stream.rows import _gguf
    from engram_stream.rows.gguf import open_gguf
    from engram_stream.v41._engine import gather_rows
    ids = rng.integers(0, n, reads).astype(np.int64)
    out, keep = {}, []
    for name, path in paths.items():
        t = open_gguf(path).tensor("blk.1.engram_embd.weight")
        with open(path, "rb") as f:
            mm = np.memmap(f, np.uint8, "r", t.offset, (t.rows, t.row_bytes))
        keep.append(mm)
        np.asarray(mm).sum(dtype=np.uint64)   # into the page cache: rows "in cache"
        qtype = t.decoder_type()
        out[f"mapped GGUF {name} ({t.row_bytes} B a row)"] = rate(lambda r: _gguf.gather(qtype, mm, r, HD), ids)
    weight = rng.integers(0, 256, (n, HD), dtype=np.uint8) & 0xF7
    scale = rng.integers(118, 130, (n, HD // 32), dtype=np.uint8)
    out["checkpoint table in RAM (e4m3 + e8m0, es8_gather)"] = rate(lambda r: gather_rows(weight, scale, r), ids)
    return out


def hit_rates(n, reads, budget_mb, a, rng):
    from engram_stream.rows._cache import RowCache, slots_for
    cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** a)   # p(rank k) ~ 1 / k^a over the table's rows
    ranks = np.minimum(np.searchsorted(cdf, rng.random(reads) * cdf[-1]), n - 1)
    rows = rng.permutation(n)[ranks]
    out = {}
    for what, rec in (("Q4_K records (144 B)", 144), ("e4m3 records (264 B)", 264)):
        slots = slots_for(int(budget_mb * (1 << 20)), rec)
        cache = RowCache(slots, 0, 0)   # keys only: the same decisions a cache with bytes makes
        hits = cache.touch(rows)
        out[what] = {"slots": int(slots), "hit_rate": hits / rows.size}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="See the module docstring for what is measured.")
    ap.add_argument("--rows", type=int, default=400000, help="rows a table (default 400000)")
    ap.add_argument("--reads", type=int, default=2000000, help="row reads timed / replayed (default 2000000)")
    ap.add_argument("--budget-mb", type=float, default=64, help="the row cache's MiB in part 2 (default 64)")
    ap.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent of part 2's row popularity")
    ap.add_argument("--dir", default=None, help="where the GGUFs are written (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    try:
        import gguf  # noqa: F401
    except ImportError:
        sys.exit("bench_gguf.py writes its tables with gguf-py: pip install gguf")
    rng = np.random.default_rng(0)
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        paths = write_tables(d, args.rows, rng)
        results["rows_per_second"] = decode_rates(paths, args.rows, args.reads, rng)
    print("1. rows decoded a second (one thread, 256 values a row, random ids):")
    for k, v in results["rows_per_second"].items():
        print(f"   {k:55s} {v / 1e6:8.2f} M rows/s")
    results["hit_rate"] = hit_rates(args.rows, args.reads, args.budget_mb, args.zipf, rng)
    print(f"2. row cache hit rate at {args.budget_mb:g} MiB, Zipf({args.zipf:g}) over {args.rows} rows:")
    for k, v in results["hit_rate"].items():
        print(f"   {k:25s} {v['slots']:9d} slots  hit rate {v['hit_rate']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
