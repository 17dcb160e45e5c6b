"""Step time vs the 64-byte alignment of the packed projection panels (demo.weights.aligned_zeros).

    python bench/bench_alignment.py            # D=256, G=4 (weights in L2: the loads weigh most)
    options: --steps N (4000)  --rounds R (16)  --hidden D (256)

Four engines of one model whose packed panels start 0, 16, 32 and 48 bytes past a 64-byte
boundary (copies placed on purpose; LayerWeights.packed() now always gives 0). Rounds rotate
the engines' order; medians and minimums of microseconds per step are printed, with each
offset's median over the aligned one's.
"""
from __future__ import annotations

import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from _lib.small_step import rotating_rounds, setup  # noqa: E402


def main():
    args, cfg, ids, h, out = setup(__doc__, 4000, 16)
    import engram_stream
    from engram_stream import EngramModel
    from engram_stream.demo.weights import aligned_zeros
    base = EngramModel.init(cfg, seed=0)
    w0 = base.layer(1)
    wp, bp, cw = w0.packed()
    keep = []

    def placed(off):  # a copy of the panels starting `off` bytes past a 64-byte boundary
        buf = aligned_zeros(wp.nbytes + 64, np.uint8)
        a = buf[off:off + wp.nbytes].view(np.float32).reshape(wp.shape)
        a[...] = wp
        a.flags.writeable = False
        keep.append(buf)
        return a

    engines = {}
    for off in (0, 16, 32, 48):
        w = w0.replace(cfg)
        w._packed = (placed(off), bp, cw)
        engines[off] = EngramModel(cfg, base.plan, {1: w}).stream(1)
    times = rotating_rounds(engines, ids, h, out, args.rounds)
    med = {off: statistics.median(v) for off, v in times.items()}
    print(f"kernel {engram_stream.kernel_isa()}, D={cfg.hidden_size} G={cfg.hc_mult} E={cfg.engram_dim}, "
          f"{args.steps} steps x {args.rounds} rounds")
    for off, v in times.items():
        print(f"  panels at +{off:2d} bytes: median {med[off]:7.2f} us/step (min {min(v):.2f}), "
              f"{med[off] / med[0]:.2f}x the aligned")


if __name__ == "__main__":
    main()
