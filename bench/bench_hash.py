#!/usr/bin/env python
"""Batch hashing: plan.hash (nogil Cython) vs plan.hash_numpy (the reference's numpy expression),
and what the divisions alone cost.

    python bench/bench_hash.py                  # ids [8, 4096], both layers of EngramConfig()
    python bench/bench_hash.py --quick --json out.json

All rows are measured side by side in one run (contenders alternate, order rotating every
repetition); the table shows medians per call (one call = both layers, or the same number of
modulo results) and ratios of medians, with the median of the per-repetition ratios beside.

Rows
  hash_numpy           plan.hash_numpy(ids): the oracle, numpy int64 arrays step by step
  hash                 plan.hash(ids): fresh output arrays every call (2 x 4 MB)
  hash out=            plan.hash(ids, out=prev): the same buffers refilled
  floormod (div)       engram_stream._hash.floormod(x, primes): hardware 64-bit division
  floormod (fastmod)   floormod(x, primes, reciprocal=True): 128-bit reciprocal, no division
  numpy %              x[:, None] % primes (fresh) and np.remainder(..., out=) (reused)
  fill fresh/reused    filling 2 x 4 MB in new pages (anonymous mmap) vs in the same arrays again:
                       the page-fault cost of a fresh output array
  v41 hash_numpy/hash  the same ids through a deepseek-v4.1 geometry (Flash's primes near 16M, past
                       the double-precision mod: Lemire's reciprocal; 4-grams; the dead-token rule,
                       2% image tokens)
For the mod rows x holds the real mix values of the ids (8*4096 per layer) and primes the
layer's 16 head primes; the row does both layers: 8*4096*16*2 = 1,048,576 results, as hash.
Minor page faults per call (getrusage) are shown for the rows that allocate.
"""
import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # single-thread comparison throughout

import argparse  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from engram_stream import EngramConfig, HashPlan  # noqa: E402
from engram_stream.v41.config import V41  # noqa: E402
from engram_stream import _hash, kernel_isa  # noqa: E402
from engram_stream.engine import isa as _isa  # noqa: E402


def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mixes(plan, ids, L):
    """The int64 mix values, per order, of every position (what the primes divide)."""
    c = plan.compress(ids)
    B, T = c.shape
    n = plan.cfg.max_ngram_size
    sh = [np.pad(c, ((0, 0), (k, 0)), constant_values=plan.pad_id)[:, :T] for k in range(n)]
    out = []
    with np.errstate(over="ignore"):
        mix = sh[0] * plan.multipliers[L][0]
        for k in range(1, n):
            mix = mix ^ (sh[k] * plan.multipliers[L][k])
            out.append(mix.ravel().copy())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 21, quick 7)")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    args = ap.parse_args(argv)
    reps = args.reps or (7 if args.quick else 21)

    cfg = EngramConfig()  # demo defaults: layers [1, 15], 2 orders x 8 heads, vocab 129280
    plan = HashPlan(cfg)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(args.B, args.T)).astype(np.int64)
    Ls = cfg.layer_ids
    nh = cfg.n_head_per_ngram

    # correctness first: fast path == oracle, out= path == fresh path, mods == numpy
    ref = plan.hash_numpy(ids)
    got = plan.hash(ids)
    prev = plan.hash(ids)
    again = plan.hash(ids, out=prev)
    for L in Ls:
        assert np.array_equal(got[L], ref[L]), f"plan.hash != hash_numpy (layer {L})"
        assert again[L] is prev[L] and np.array_equal(again[L], ref[L]), "hash(out=) broken"
    default_isa = kernel_isa()
    for isa in _isa.supported_isas():  # every kernel path is exact
        _isa.use_isa(isa)
        assert all(np.array_equal(v, ref[L]) for L, v in plan.hash(ids).items()), f"plan.hash [{isa}] != oracle"
    _isa.use_isa(default_isa)
    # mod inputs: per layer, per order, the mix values and that order's primes
    mod_in = []
    for L in Ls:
        for i, x in enumerate(mixes(plan, ids, L)):
            p = np.ascontiguousarray(plan.head_primes[L][i * nh:(i + 1) * nh])
            mod_in.append((x, p, L, i))
            r_div = _hash.floormod(x, p)
            r_fast = _hash.floormod(x, p, reciprocal=True)
            r_np = x[:, None] % p[None, :]
            want = ref[L][:, :, i * nh:(i + 1) * nh].reshape(-1, nh)
            assert np.array_equal(r_div, want) and np.array_equal(r_fast, want) and np.array_equal(r_np, want), \
                f"floormod disagrees (layer {L}, order {i + 2})"
    n_results = sum(x.size * p.size for x, p, _, _ in mod_in)
    # deepseek-v4.1-Flash's hash geometry (its engram_* keys; the other fields only make a valid config)
    cfg41 = EngramConfig(variant=V41, engram_vocab_size=[16000000] * 3, max_ngram_size=4, n_head_per_ngram=8,
                         n_embed_per_ngram=2048, layer_ids=[1, 14], pad_id=2, vocab_size=cfg.vocab_size,
                         hidden_size=64, hc_mult=1)
    plan41 = HashPlan(cfg41, compression=np.arange(cfg.vocab_size, dtype=np.int64) % 99092)
    ids41 = ids.copy()
    ids41[rng.random(ids.shape) < 0.02] = cfg41.image_token_id
    assert all(np.array_equal(plan41.hash(ids41)[L], v) for L, v in plan41.hash_numpy(ids41).items()), \
        "plan.hash != hash_numpy (deepseek-v4.1)"
    np_out = [np.empty((x.size, p.size), np.int64) for x, p, _, _ in mod_in]
    out_bytes = args.B * args.T * cfg.n_heads * 8
    touch_buf = [np.zeros(out_bytes // 8, np.int64) for _ in Ls]

    def r_hash_numpy():
        plan.hash_numpy(ids)

    def r_hash():
        plan.hash(ids)

    def r_hash_out():
        plan.hash(ids, out=prev)

    def r_div():
        for x, p, _, _ in mod_in:
            _hash.floormod(x, p)

    def r_fast():
        for x, p, _, _ in mod_in:
            _hash.floormod(x, p, reciprocal=True)

    def r_np():
        for x, p, _, _ in mod_in:
            x[:, None] % p[None, :]

    def r_np_out():
        for (x, p, _, _), o in zip(mod_in, np_out):
            np.remainder(x[:, None], p[None, :], out=o)

    def r_v41_numpy():
        plan41.hash_numpy(ids41)

    def r_v41():
        plan41.hash(ids41)

    def r_touch():  # anonymous mmap: fresh pages guaranteed (malloc may or may not reuse its heap)
        for _ in Ls:
            m = mmap.mmap(-1, out_bytes)
            a = np.frombuffer(m, np.int64)
            a.fill(0)
            del a
            m.close()

    def r_touch_reused():
        for o in touch_buf:
            o.fill(0)

    best = kernel_isa()
    other_isas = [i for i in reversed(_isa.supported_isas()) if i != best]

    def on_isa(isa, f):  # the same call with the kernels on another path, in the same rotation
        def r():
            _isa.use_isa(isa)
            try:
                f()
            finally:
                _isa.use_isa(best)
        return r

    runs = {
        "hash_numpy": (r_hash_numpy, "plan.hash_numpy(ids)  (the numpy oracle)"),
        "hash": (r_hash, "plan.hash(ids)  (fresh output arrays)"),
        "hash_out": (r_hash_out, "plan.hash(ids, out=prev)  (buffers reused)"),
        "floormod_div": (r_div, "floormod(x, primes)  hardware division"),
        "floormod_fast": (r_fast, "floormod(x, primes, reciprocal=True)  fastmod"),
        "numpy_mod": (r_np, "numpy x[:, None] % primes  (fresh)"),
        "numpy_mod_out": (r_np_out, "numpy np.remainder(..., out=)  (reused)"),
        "touch": (r_touch, f"fill {len(Ls)} fresh {out_bytes / 1e6:.1f} MB arrays (new pages: mmap)"),
        "touch_reused": (r_touch_reused, f"fill {len(Ls)} reused {out_bytes / 1e6:.1f} MB arrays"),
        "v41_numpy": (r_v41_numpy, "deepseek-v4.1 geometry: plan.hash_numpy(ids)"),
        "v41_hash": (r_v41, "deepseek-v4.1 geometry: plan.hash(ids)"),
    }
    for isa in other_isas:
        runs[f"hash[{isa}]"] = (on_isa(isa, r_hash), f"plan.hash(ids)  ({isa} kernels)")
    for f, _ in runs.values():  # warm
        f()
    t = {k: [] for k in runs}
    faults = {k: [] for k in runs}
    names = list(runs)
    for r in range(reps):
        for j in range(len(names)):
            k = names[(r + j) % len(names)]
            f0 = minflt()
            s = time.perf_counter()
            runs[k][0]()
            t[k].append(time.perf_counter() - s)
            faults[k].append(minflt() - f0)

    load = os.getloadavg()
    print(f"bench_hash: ids [{args.B}, {args.T}], layers {Ls} of EngramConfig() ({cfg.n_heads} heads each, "
          f"{n_results:,} results per call), {reps} interleaved repetitions; {os.cpu_count()} CPUs, "
          f"load average {load[0]:.2f}")
    print(f"  kernels: {best} (rows marked with a path: the same call on it; ENGRAM_STREAM_ISA picks the main one)")
    print("  checked: plan.hash == hash_numpy, hash(out=) == hash, floormod (both) == numpy %")
    med = {k: float(np.median(v)) for k, v in t.items()}
    print(f"\n  {'':<56s} {'median':>10s} {'ns/result':>10s} {'faults/call':>12s}")
    for k, (_, what) in runs.items():
        print(f"  {what:<56s} {med[k] * 1e3:8.2f} ms {med[k] / n_results * 1e9:10.2f} "
              f"{int(np.median(faults[k])):12d}")

    def ratio(a, b):
        return med[a] / med[b], float(np.median(np.asarray(t[a]) / np.asarray(t[b])))

    print()
    rows = [(f"hash_numpy / hash  [{best}]", "hash_numpy", "hash", ">= 8x", lambda r: r >= 8)]
    rows += [(f"hash_numpy / hash  [{isa}]", "hash_numpy", f"hash[{isa}]", ">= 8x", lambda r: r >= 8)
             for isa in other_isas]
    rows += [
            ("hash_numpy / hash(out=)", "hash_numpy", "hash_out", ">= 5x", lambda r: r >= 5),
            ("hash / hash(out=)  (the price of fresh arrays)", "hash", "hash_out", None, None),
            ("hash(out=) / floormod div  (how far from the mods alone)", "hash_out", "floormod_div", None, None),
            ("hash(out=) / floormod fastmod", "hash_out", "floormod_fast", None, None),
            ("floormod fastmod / floormod div", "floormod_fast", "floormod_div", None, None),
            ("numpy % / floormod div", "numpy_mod", "floormod_div", None, None),
            ("numpy %(out=) / floormod div", "numpy_mod_out", "floormod_div", None, None),
            (f"deepseek-v4.1: hash_numpy / hash  [{best}]", "v41_numpy", "v41_hash", None, None)]
    summary = []
    for what, a, b, goal, test in rows:
        r, pr = ratio(a, b)
        ok = None if test is None else bool(test(r))
        v = "" if ok is None else ("  MET" if ok else "  NOT MET")
        print(f"  {what:<58s} {r:7.2f}x (paired {pr:5.2f}x)  " + (f"goal {goal}" if goal else "") + v)
        summary.append(dict(what=what, ratio=r, paired_ratio=pr, goal=goal, met=ok))
    print(f"\n  plan.hash(out=) spends {med['hash_out'] * 1e3:.2f} ms ({med['hash_out'] / n_results * 1e9:.2f} ns/result, "
          f"everything included); the mods alone by hardware division take {med['floormod_div'] * 1e3:.2f} ms, "
          f"by fastmod {med['floormod_fast'] * 1e3:.2f} ms")
    print(f"  fresh outputs: plan.hash pays {(med['hash'] - med['hash_out']) * 1e3:.2f} ms more per call than with "
          f"out= ({int(np.median(faults['hash']))} minor page faults per call);\n  filling "
          f"{len(Ls)} x {out_bytes / 1e6:.1f} MB in new pages costs {med['touch'] * 1e3:.2f} ms vs "
          f"{med['touch_reused'] * 1e3:.2f} ms in reused ones ({int(np.median(faults['touch']))} faults: "
          f"{(med['touch'] - med['touch_reused']) / max(1, np.median(faults['touch'])) * 1e9:.0f} ns per fault "
          f"on this VM)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"argv": sys.argv, "B": args.B, "T": args.T, "layers": Ls, "reps": reps,
                                "results_per_call": n_results, "loadavg": load},
                       "median_s": med, "samples_s": t, "minor_faults": faults, "summary": summary}, f, indent=1)
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
