"""The long soak: 200k batched steps at small dims, RssAnon sampled, exact afterwards.

    python bench/soak.py [--steps 200000] [--streams 8]
"""
import argparse
import time

from engram_stream.soak import soak

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
