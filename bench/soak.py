"""Soak: many batched steps hold constant private memory and stay exact.

Run as `python bench/soak.py [--steps 200000] [--streams 8]` (the long soak); tests/demo/test_soak.py
runs a short one through soak(). The engine's output at token t depends only on tokens
t-W..t (W = conv_len + max_ngram - 1), so after any number of steps the last outputs must
equal a batch forward over a window, whose first W positions are warm-up.
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

from engram_stream import EngramConfig, EngramModel  # noqa: E402

SMALL = EngramConfig(engram_vocab_size=[1009, 1013], max_ngram_size=3, n_embed_per_ngram=32,
                     n_head_per_ngram=4, layer_ids=[3], pad_id=1, kernel_size=4, hidden_size=32,
                     hc_mult=2, vocab_size=2000)


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return -1


def soak(steps: int, n_streams: int = 8, check_every: int = 0, seed: int = 0, cfg=SMALL, report=None):
    """Run `steps` batched steps with out= reused; returns (rss_kib samples, worst error ratio)."""
    model = EngramModel.init(cfg, seed=seed)
    L = cfg.layer_ids[0]
    eng = model.stream(L, n_streams=n_streams)
    G, D = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(seed)
    W = cfg.conv_len + cfg.max_ngram_size - 1
    tail = 16
    # a fixed pool of inputs, cycled: no per-step allocation in the loop
    pool = 4096
    ids = rng.integers(0, cfg.vocab_size, size=(pool, n_streams))
    hid = rng.standard_normal((pool, n_streams, G, D), dtype=np.float32)
    out = np.empty((n_streams, G, D), np.float32)
    samples = []
    for t in range(steps):
        k = t % pool
        eng.step(ids[k], hid[k], out=out)
        if check_every and t % check_every == 0:
            samples.append(rss_anon_kib())
            if report:
                report(t, samples[-1])
    samples.append(rss_anon_kib())
    # exactness after the soak: tail more steps, compared with a windowed batch forward
    outs = np.empty((tail, n_streams, G, D), np.float32)
    ks = rng.integers(0, pool, size=tail)
    for i, k in enumerate(ks):
        eng.step(ids[k], hid[k], out=outs[i])
    if steps < W:
        raise ValueError(f"soak needs at least {W} steps")
    win = np.concatenate([np.arange(steps - W, steps) % pool, ks])   # step t used pool row t % pool
    seq_ids = ids[win].transpose(1, 0)                       # [S, W + tail]
    seq_hid = hid[win].transpose(1, 0, 2, 3)                 # [S, W + tail, G, D]
    ref = model.forward(L, seq_ids, seq_hid)[:, W:]          # drop the warm-up positions
    got = outs.transpose(1, 0, 2, 3)
    worst = float(np.max(np.abs(got - ref) / (2e-5 + 2e-4 * np.abs(ref))))
    return samples, worst


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--streams", type=int, default=8)
    a = p.parse_args()
    t0 = time.perf_counter()
    samples, worst = soak(a.steps, n_streams=a.streams, check_every=a.steps // 10,
                          report=lambda t, kib: print(f"step {t:>8}: RssAnon {kib / 1024:8.1f} MiB", flush=True))
    dt = time.perf_counter() - t0
    print(f"{a.steps} steps x {a.streams} streams in {dt:.1f} s ({a.steps * a.streams / dt:,.0f} tokens/s)")
    print(f"RssAnon growth after warm-up: {(max(samples[1:]) - samples[1])} KiB")
    print(f"after the soak, worst error vs the batch path: {worst:.3f} of tolerance (<= 1 is exact)")


if __name__ == "__main__":
    main()
