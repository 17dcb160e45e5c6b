#!/usr/bin/env python
"""Serving batches: step_packed over 16 slots against one prefill of as many tokens, against the
same batch as separate per-stream calls, and a draft's commit against its call.

    flock /tmp/bench.lock python bench/bench_serving.py            # demo dims and V4.1 Flash dims
    flock /tmp/bench.lock python bench/bench_serving.py --quick    # fewer repetitions

The batch (the issue's): 16 slots, 4 prompt chunks of 64 tokens and 12 decode steps, 268 tokens.
Beside it, a batch of decode steps alone (16 slots x 1 token) packed vs as 16 per-slot calls: the
mixed batch's time is mostly its prompt chunks' FLOPs, which separate calls do not repeat.
Every ratio is measured side by side in one run, rounds interleaved (the order rotating), ratios
of medians with the median of the per-round ratios ("paired") beside; the machine is shared, so
absolute times are indicative only. Goals:
  packed per token         <= 1.1x one prefill of the same number of tokens in one stream
  separate calls           >= 3x the packed call
  commit of a 16 x 5 draft <= 5% of its call
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from _lib.common import machine  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.v41.hf import flash_config  # noqa: E402

LAYER = 1


def models(quick):
    demo = EngramConfig(engram_vocab_size=[200003, 200003], max_ngram_size=3, n_embed_per_ngram=512,
                        n_head_per_ngram=8, layer_ids=[LAYER], hidden_size=1024, hc_mult=4, vocab_size=129280)
    yield "demo (D=1024, hc 4, E=1024)", EngramModel.init(demo, seed=0)
    v41 = flash_config(engram_vocab_size=20000, engram_layer_ids=[LAYER])
    yield "V4.1 Flash (D=5120, hc 4, wkv 25600x6144 float8)", EngramModel.init(v41, seed=0)


def timed(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_model(name, model, reps):
    cfg = model.cfg
    G, D, V = cfg.hc_mult, cfg.hidden_size, cfg.vocab_size
    rng = np.random.default_rng(0)
    lengths = np.array([64] * 4 + [1] * 12, np.int64)
    streams = np.arange(16, dtype=np.int64)
    N = int(lengths.sum())
    ids = rng.integers(0, V, N).astype(np.int64)
    hid = rng.standard_normal((N, G, D)).astype(np.float32)
    out = np.empty_like(hid)
    eng = model.stream(LAYER, 16)
    one = model.stream(LAYER, 1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    def packed():
        eng.step_packed(ids, hid, streams, lengths, out=out)

    def prefill():
        one.prefill(ids, hid, out=out)
        one.reset()

    def separate():
        for s, a, n in zip(streams, starts, lengths):
            eng.prefill(ids[a:a + n], hid[a:a + n], stream=int(s), out=out[a:a + n])

    ones = np.ones(16, np.int64)

    def decode_packed():
        eng.step_packed(ids[:16], hid[:16], streams, ones, out=out[:16])

    def decode_separate():
        for s in range(16):
            eng.prefill(ids[s:s + 1], hid[s:s + 1], stream=s, out=out[s:s + 1])

    dl = np.full(16, 5, np.int64)
    dids, dhid = ids[:80], hid[:80]
    dout = out[:80]
    acc = rng.integers(0, 6, 16).astype(np.int64)
    t_draft, t_commit = [], []

    def draft():
        t0 = time.perf_counter()
        eng.step_packed(dids, dhid, streams, dl, out=dout, draft=True)
        t1 = time.perf_counter()
        eng.commit(acc)
        t_draft.append(t1 - t0)
        t_commit.append(time.perf_counter() - t1)

    runs = {"packed": packed, "prefill": prefill, "separate": separate, "decode_packed": decode_packed,
            "decode_separate": decode_separate, "draft": draft}
    for f in runs.values():   # warm-up: scratch, pages
        f()
    t_draft.clear(), t_commit.clear()
    t = {k: [] for k in runs if k != "draft"}
    names = list(runs)
    for r in range(reps):  # interleaved rounds, the order rotating
        for j in range(len(names)):
            k = names[(r + j) % len(names)]
            if k == "draft":
                draft()  # times its two halves itself
            else:
                t[k] += timed(runs[k], 1)
    med = {k: float(np.median(v)) for k, v in t.items()}

    def paired(a, b):
        return float(np.median(np.asarray(a) / np.asarray(b)))
    res = {
        "model": name, "tokens": N, "reps": reps,
        "packed_ms": med["packed"] * 1e3, "prefill_ms": med["prefill"] * 1e3, "separate_ms": med["separate"] * 1e3,
        "packed_vs_prefill": med["packed"] / med["prefill"],
        "packed_vs_prefill_paired": paired(t["packed"], t["prefill"]),
        "separate_vs_packed": med["separate"] / med["packed"],
        "separate_vs_packed_paired": paired(t["separate"], t["packed"]),
        "decode_packed_ms": med["decode_packed"] * 1e3, "decode_separate_ms": med["decode_separate"] * 1e3,
        "decode_separate_vs_packed": med["decode_separate"] / med["decode_packed"],
        "decode_separate_vs_packed_paired": paired(t["decode_separate"], t["decode_packed"]),
        "draft_ms": float(np.median(t_draft)) * 1e3, "commit_ms": float(np.median(t_commit)) * 1e3,
        "commit_vs_draft": float(np.median(t_commit) / np.median(t_draft)),
        "commit_vs_draft_paired": paired(t_commit, t_draft),
        "prefill_threads": eng.prefill_threads, "samples_s": t,
    }
    print(f"\n{name}: a batch of 16 slots (4 chunks of 64 + 12 decode steps, {N} tokens), "
          f"prefill_threads={eng.prefill_threads}, median of {reps}")
    print(f"  step_packed                 {res['packed_ms']:9.2f} ms")
    print(f"  one prefill of {N} tokens   {res['prefill_ms']:9.2f} ms   packed/prefill per token "
          f"{res['packed_vs_prefill']:.3f}x (paired {res['packed_vs_prefill_paired']:.3f}x)   (goal <= 1.1x)")
    print(f"  16 separate per-stream calls{res['separate_ms']:9.2f} ms   separate/packed "
          f"{res['separate_vs_packed']:.2f}x (paired {res['separate_vs_packed_paired']:.2f}x)   (goal >= 3x)")
    print(f"  16 decode steps: packed     {res['decode_packed_ms']:9.2f} ms   16 per-slot calls "
          f"{res['decode_separate_ms']:.2f} ms = {res['decode_separate_vs_packed']:.2f}x "
          f"(paired {res['decode_separate_vs_packed_paired']:.2f}x)")
    print(f"  draft call 16 x 5 tokens    {res['draft_ms']:9.2f} ms   commit {res['commit_ms'] * 1e3:.1f} us = "
          f"{100 * res['commit_vs_draft']:.2f}% of the call (paired {100 * res['commit_vs_draft_paired']:.2f}%)"
          f"   (goal <= 5%)", flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 15, quick 3)")
    a = ap.parse_args(argv)
    info = machine()
    load0 = os.getloadavg()
    print(f"machine: {info}; load average {load0[0]:.2f}")
    out = {"machine": info, "load_start": load0[0], "results": []}
    for name, model in models(a.quick):
        out["results"].append(bench_model(name, model, a.reps or (3 if a.quick else 15)))
        del model
    out["load_end"] = os.getloadavg()[0]
    print(f"load average {load0[0]:.2f} at start, {out['load_end']:.2f} at end ({os.cpu_count()} CPUs)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
