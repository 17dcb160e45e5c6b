"""engram-stream bench: the engine step against its floor, 1 vs N streams, repeated to show the spread."""
from __future__ import annotations

import time

import numpy as np

from .common import add_gguf, at_least, cpu, engine_choice, kernels, load_model
from .progress import Steps, progress_bar


def register(command):
    s = command("bench", run, "engine step vs its floor, 1 vs N streams (seconds on the built-in model; "
                                    "minutes at Flash dims: fewer --steps / --repeat to shorten; bench/ has the suite)")
    s.add_argument("--checkpoint", default=None,
                   help="bench this model instead of the built-in one: a checkpoint file or a model's Hugging Face "
                        "folder")
    s.add_argument("--layer", type=int, default=None, help="the Engram layer to bench (default: the first)")
    s.add_argument("--steps", type=at_least(1), default=500, help="steps per measurement")
    s.add_argument("--streams", type=at_least(2), default=16, help="streams of the multi-stream engine")
    s.add_argument("--repeat", type=at_least(1), default=5, help="measurements of each, to show the spread")
    s.add_argument("--seed", type=at_least(0), default=0, help="seed of the weights and inputs")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr, no progress bar on a terminal")
    add_gguf(s)


def run(args):
    """A short in-process comparison, repeated: engine step vs a floor, 1 vs N streams (the built-in
    model, or --checkpoint: a checkpoint file or a model's Hugging Face folder, mapped)."""
    steps = Steps(args.quiet)
    model = load_model(args, steps)
    cfg = model.cfg
    L = cfg.layer_ids[0] if args.layer is None else model.plan.check_layer(args.layer)
    G, D = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(args.seed)
    n = args.steps

    def stepper(S):
        eng = model.stream(L, n_streams=S)
        h = None if eng.input_layer else rng.standard_normal((S, G, D), dtype=np.float32)
        out = np.empty(eng.out_shape(S), np.float32)
        ids = rng.integers(0, cfg.vocab_size, size=(n, S))
        for t in range(min(n, 20)):  # warm up
            eng.step(ids[t], h, out=out)

        def run():
            t0 = time.perf_counter()
            for t in range(n):
                eng.step(ids[t], h, out=out)
            return (time.perf_counter() - t0) / n
        return run

    W = model.variant.step_weights(model.layer(L))
    if W.dtype == np.float32:  # the projection alone as one GEMV, the faster of both layouts
        label = "fused-GEMV floor"
        WT = np.ascontiguousarray(W.T)
        e = rng.standard_normal(W.shape[1], dtype=np.float32)

        def touch():
            W @ e
            e @ WT

        def floor():
            t0 = time.perf_counter()
            for _ in range(n):
                W @ e
            t1 = time.perf_counter()
            for _ in range(n):
                e @ WT
            return min(t1 - t0, time.perf_counter() - t1) / n
    else:  # float8 / bf16 weights: numpy cannot multiply them fast; one read of their bytes instead
        label = f"read of its {W.nbytes / 2**20:,.1f} MiB of weights"
        words = W.reshape(-1).view(np.uint8)[:W.nbytes // 8 * 8].view(np.uint64)

        def touch():
            np.bitwise_or.reduce(words)

        def floor():
            t0 = time.perf_counter()
            for _ in range(n):
                np.bitwise_or.reduce(words)
            return (time.perf_counter() - t0) / n

    steps(f"warming up: the floor's pass once, then 1 and {args.streams} streams {min(n, 20)} steps each, "
          f"not timed")
    touch()   # the first pass over the weights faults in a mapped checkpoint's pages: not a measurement
    one, many = stepper(1), stepper(args.streams)
    steps(f"measuring: {args.repeat} repeat{'s' * (args.repeat != 1)} of the floor, 1 and {args.streams} "
          f"streams, {n} steps each")
    runs = {"floor": [], "one": [], "many": []}
    bar = progress_bar(args.quiet, unit="measurements")
    todo = 3 * args.repeat
    for r in range(args.repeat):  # interleaved, so a load change hits all three alike
        for k, (name, f) in enumerate((("floor", floor), ("one", one), ("many", many))):
            if bar is not None:
                bar(3 * r + k, todo)
            runs[name].append(f())
    if bar is not None:
        bar(todo, todo)
        bar.end()
    t = {k: np.array(v) for k, v in runs.items()}
    med = {k: float(np.median(v)) for k, v in t.items()}

    def spread(k, scale=1e6):
        return f"{med[k] * scale:8.1f} us  [{t[k].min() * scale:.1f} .. {t[k].max() * scale:.1f}]"
    what = f"{args.checkpoint}, layer {L}" if args.checkpoint else "the built-in model; bench/ has the full suite"
    print(f"config: D={D} G={G} H={cfg.n_heads}x{cfg.head_dim} ({what})")
    print(f"kernels: {kernels()}")
    print(f"chosen: {engine_choice(model.stream(L, n_streams=args.streams))}")
    print(f"cpu: {cpu()}")
    print(f"median of {args.repeat} repeats of {n} steps each, [min .. max] over the repeats; "
          f"ratios are medians of per-repeat ratios")
    rows = [(label, "floor", ""),
            ("engine step (1 stream)", "one", f"{np.median(t['one'] / t['floor']):.2f}x the floor"),
            (f"engine step ({args.streams} streams)", "many",
             f"{np.median(t['many'] / args.streams / t['one']):.2f}x one stream, per token")]
    for label, k, ratio in rows:
        print(f"{label + ':':<28} {spread(k)}   {ratio}".rstrip())
    return 0
