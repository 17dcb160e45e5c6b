"""Step time vs the 64-byte alignment of the packed projection panels (model.aligned_zeros).

    python bench/bench_alignment.py            # D=256, G=4 (weights in L2: the loads weigh most)
    options: --steps N (4000)  --rounds R (16)  --hidden D (256)

Four engines of one model whose packed panels start 0, 16, 32 and 48 bytes past a 64-byte
boundary (copies placed on purpose; LayerWeights.packed() now always gives 0). Rounds rotate
the engines' order; medians and minimums of microseconds per step are printed, with each
offset's median over the aligned one's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    import engram_stream
    from engram_stream import EngramConfig, EngramModel
    cfg = EngramConfig(engram_vocab_size=[20011, 20011], n_embed_per_ngram=128, n_head_per_ngram=4,
                       layer_ids=[1], hidden_size=args.hidden, hc_mult=4, vocab_size=32000)
    base = EngramModel.init(cfg, seed=0)
    w0 = base.layer(1)
    wp, bp, cw = w0.packed()
    keep = []

    def placed(off):  # a copy of the panels starting `off` bytes past a 64-byte boundary
        buf = np.zeros(wp.nbytes + 128, np.uint8)
        start = -buf.ctypes.data % 64 + off
        a = buf[start:start + wp.nbytes].view(np.float32).reshape(wp.shape)
        a[...] = wp
        a.flags.writeable = False
        keep.append(buf)
        return a

    engines = {}
    for off in (0, 16, 32, 48):
        w = w0.replace(cfg)
        w._packed = (placed(off), bp, cw)
        engines[off] = EngramModel(cfg, base.plan, {1: w}).stream(1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.steps).tolist()
    h = np.ones((cfg.hc_mult, cfg.hidden_size), np.float32)
    out = np.empty_like(h)
    times = {off: [] for off in engines}
    names = list(engines)
    for r in range(args.rounds):
        for off in names[r % 4:] + names[:r % 4]:
            t0 = time.perf_counter()
            for t in ids:
                engines[off].step(t, h, out=out)
            times[off].append((time.perf_counter() - t0) / len(ids) * 1e6)
    med = {off: statistics.median(v) for off, v in times.items()}
    print(f"kernel {engram_stream.kernel_isa()}, D={cfg.hidden_size} G={cfg.hc_mult} E={cfg.engram_dim}, "
          f"{args.steps} steps x {args.rounds} rounds")
    for off, v in times.items():
        print(f"  panels at +{off:2d} bytes: median {med[off]:7.2f} us/step (min {min(v):.2f}), "
              f"{med[off] / med[0]:.2f}x the aligned")


if __name__ == "__main__":
    main()
