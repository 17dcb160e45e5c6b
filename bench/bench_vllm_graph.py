"""The vLLM plugin's capturable lookup's host function (integrations/_vllm_graph.pyx: hf_run)
against the eager row path of the plugin's inline lookup (its _fill: the rank's rows, then
RowSource.read_into, then records_to_bf16), on CPU, same rows, warm (the row cache or the
page cache holds them), bf16 out. No GPU: what is timed is the host work of one lookup, which
in a FULL CUDA graph runs as a host node between the ids' and the rows' copies.

    python bench/bench_vllm_graph.py [--tokens 1,16,128,1024] [--reps 30]

Contenders take turns in every repetition (order rotating); medians per call and the ratio."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,128,1024")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--evs", type=int, default=50021, help="rows per head (the table: 9 heads of this)")
    a = ap.parse_args()
    from helpers.models import make_v41_model
    from engram_stream import EngramModel
    from engram_stream.integrations._vllm_graph import HostLookup
    from engram_stream.integrations._records import records_to_bf16
    d = tempfile.mkdtemp()
    path = os.path.join(d, "v41")
    make_v41_model(seed=11, nh=3, hd=256, D=32, evs=a.evs).save(path)
    rng = np.random.default_rng(0)
    print(f"table: 9 heads x {a.evs} rows x 264 B per layer; load {os.getloadavg()[0]:.2f}")
    print(f"{'source':14s} {'tokens':>6s} {'eager us':>10s} {'hostfn us':>10s} {'ratio':>6s}")
    for tables in ("mapped", "direct"):
        model = EngramModel.from_deepseek_v41(path, tables=tables, row_cache_mb=256)
        L = model.cfg.layer_ids[0]
        src_e, src_h = model.row_source(L), model.row_source(L)
        n = src_e.nrows
        for T in [int(t) for t in a.tokens.split(",")]:
            k = 9
            ids = rng.integers(0, n, (T, k)).astype(np.int32)
            ids[rng.random(ids.shape) < 0.05] = -1
            rec = np.empty((T, k, 264), np.uint8)
            out_e = np.empty((T, k, 256), np.uint16)
            out_h = np.empty((T, k, 256), np.uint16)
            ctx = HostLookup(src_h, ids, out_h, 0, n)

            def eager():
                rows = np.where((ids >= 0) & (ids < n), ids, -1).astype(np.int64)
                src_e.read_into(rows, rec)
                records_to_bf16(rec, out_e)

            for _ in range(2):   # warm both (the cache holds the rows)
                eager()
                ctx.run()
            assert np.array_equal(out_e, out_h)
            times = {"eager": [], "hostfn": []}
            fns = {"eager": eager, "hostfn": ctx.run}
            for r in range(a.reps):
                order = ["eager", "hostfn"] if r % 2 == 0 else ["hostfn", "eager"]
                for name in order:
                    inner = max(1, 2000 // T)
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fns[name]()
                    times[name].append((time.perf_counter() - t0) / inner)
            me, mh = statistics.median(times["eager"]), statistics.median(times["hostfn"])
            print(f"{tables + '+cache':14s} {T:6d} {me * 1e6:10.1f} {mh * 1e6:10.1f} {mh / me:6.2f}")


if __name__ == "__main__":
    main()
