#!/usr/bin/env python
"""Step latency vs hidden size and vs number of streams -> bench/step_latency.png

    python bench/plot.py            # ~1-2 min
    python bench/plot.py --quick    # fewer repetitions
    python bench/plot.py --json bench_plot.json --out somewhere.png

Left:   one step (1 stream) vs hidden size D in 128, 256, 512, 1024 with proportional engram
        dims (hc_mult 4, 2 orders x 8 heads, n_embed_per_ngram = D/2, so E = D, M = 5D).
Middle: one step of S streams (S = 1..32) at D = 1024 (the demo's dims).
Right:  the same per token (step time / S).
Contenders: the engine (eng.step), the careful torch incremental step (bench/torch_peer.py,
one thread), and the floor: the fused projection alone as one numpy GEMV/GEMM (the faster of
W @ e and e @ W^T-contiguous). Tables are small ([20011, 20011] rows per order): the table
size barely matters for the step latency; the weights do. Medians of interleaved repetitions.
"""
import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from _lib import step_runners as runners  # noqa: E402
from _lib.timing import interleaved  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def model_for(D):
    cfg = EngramConfig(engram_vocab_size=[20011, 20011], max_ngram_size=3, n_embed_per_ngram=D // 2,
                       n_head_per_ngram=8, layer_ids=[runners.LAYER], kernel_size=4, hidden_size=D, hc_mult=4)
    return EngramModel.init(cfg, seed=0)


def measure(model, S, reps, target):
    runs = {"engine": runners.engine_runner(model, S=S, threads=1)}  # (one thread, as torch and the floor)
    if runners.HAVE_TORCH:
        runs["torch"] = runners.torch_runner(model, S=S)
    fa, fb = runners.floor_runners(model, S=S)
    runs["floor_a"], runs["floor_b"] = fa, fb
    t = interleaved(runs, reps, target)
    m = {k: float(np.median(v)) for k, v in t.items()}
    m["floor"] = min(m.pop("floor_a"), m.pop("floor_b"))
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "step_latency.png"))
    ap.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = ap.parse_args(argv)
    reps, target = (5, 0.01) if args.quick else (11, 0.02)
    if runners.HAVE_TORCH:
        runners.torch.set_num_threads(1)

    Ds = [128, 256, 512, 1024]
    Ss = [1, 2, 4, 8, 16, 32]
    vs_d, vs_s = {}, {}
    for D in Ds:
        vs_d[D] = measure(model_for(D), 1, reps, target)
        print(f"D={D:5d} S=1  " + "  ".join(f"{k} {v * 1e6:8.1f} us" for k, v in vs_d[D].items()), flush=True)
    model = model_for(1024)
    for S in Ss:
        vs_s[S] = measure(model, S, reps, target)
        print(f"D= 1024 S={S:<2d} " + "  ".join(f"{k} {v * 1e6:8.1f} us" for k, v in vs_s[S].items()), flush=True)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    style = {"engine": dict(color="tab:blue", marker="o", label="engine (eng.step)"),
             "torch": dict(color="tab:red", marker="s", label="torch incremental step (1 thread)"),
             "floor": dict(color="k", marker="^", linestyle="--", label="floor: one numpy GEMV/GEMM")}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    ax = axes[0]
    for k, st in style.items():
        if k in vs_d[Ds[0]]:
            ax.plot(Ds, [vs_d[D][k] * 1e6 for D in Ds], **st)
    ax.set(xscale="log", yscale="log", xlabel="hidden size D (fused projection weight)  [hc 4, E = D, 2 orders x 8 heads]",
           ylabel="step latency (us)", title="one stream: step latency vs hidden size")
    ax.set_xticks(Ds, [f"{D}\n({5 * D * D * 4 / 2**20:.1f} MB)" for D in Ds])  # fused weight [5D, D] f32
    ax = axes[1]
    for k, st in style.items():
        if k in vs_s[1]:
            ax.plot(Ss, [vs_s[S][k] * 1e6 for S in Ss], **st)
    ax.set(xscale="log", yscale="log", xlabel="streams S per step", ylabel="step latency (us)",
           title="D = 1024: one step of S streams")
    ax.set_xticks(Ss, [str(S) for S in Ss])
    ax = axes[2]
    for k, st in style.items():
        if k in vs_s[1]:
            ax.plot(Ss, [vs_s[S][k] / S * 1e6 for S in Ss], **st)
    ax.set(xscale="log", yscale="log", xlabel="streams S per step", ylabel="latency per token (us)",
           title="D = 1024: per token (step / S)")
    ax.set_xticks(Ss, [str(S) for S in Ss])
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    some = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "235" else "")  # minor: 2s, 3s, 5s only
    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(some)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=9)
    load = os.getloadavg()
    fig.suptitle(f"Engram step latency, single thread, medians of {reps} interleaved repetitions "
                 f"({os.cpu_count()} shared CPUs, load {load[0]:.1f}: absolute times indicative)", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vs_D": {str(k): v for k, v in vs_d.items()}, "vs_S": {str(k): v for k, v in vs_s.items()},
                       "reps": reps, "loadavg": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
