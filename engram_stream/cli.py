"""The engram-stream command: demo, inspect, init, build-compression, bench, profile.

Errors print one line (`engram-stream: error: ...`) and exit 1; --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .config import EngramConfig

DEMO_CONFIG = dict(engram_vocab_size=[20011, 20011], max_ngram_size=3, n_embed_per_ngram=128,
                   n_head_per_ngram=4, layer_ids=[1, 15], pad_id=2, seed=0, kernel_size=4,
                   hidden_size=256, hc_mult=4, vocab_size=32000)


class CliError(Exception):
    """A user-facing error: printed as one line."""


def _model_for_demo(args):
    from .model import EngramModel
    cfg = EngramConfig(**DEMO_CONFIG)
    return EngramModel.init(cfg, seed=args.seed)


def cmd_demo(args):
    """Decode tokens through every layer's streaming engine and check them against the batch path."""
    model = _model_for_demo(args)
    cfg = model.cfg
    rng = np.random.default_rng(args.seed)
    T, G, D = args.tokens, cfg.hc_mult, cfg.hidden_size
    ids = rng.integers(0, cfg.vocab_size, size=T)
    hidden = {L: rng.standard_normal((T, G, D), dtype=np.float32) for L in cfg.layer_ids}
    print(f"model: {model}")
    dec = model.decoder()
    outs = {L: np.empty((T, G, D), np.float32) for L in cfg.layer_ids}
    t0 = time.perf_counter()
    for t in range(T):
        dec.begin(int(ids[t]))
        for L in cfg.layer_ids:
            dec.layer(L, hidden[L][t], out=outs[L][t])
    dt = time.perf_counter() - t0
    worst = 0.0
    for L in cfg.layer_ids:
        ref = model.forward(L, ids[None], hidden[L][None])[0]
        err = np.abs(outs[L] - ref) / (2e-5 + 2e-4 * np.abs(ref))
        worst = max(worst, float(err.max()))
    ok = worst <= 1.0
    print(f"decoded {T} tokens x {len(cfg.layer_ids)} layers in {dt * 1e3:.1f} ms: "
          f"{T / dt:,.0f} tokens/s ({dt / T / len(cfg.layer_ids) * 1e6:.1f} us per layer step)")
    print(f"check against the batch path (atol 2e-5 + rtol 2e-4): {'OK' if ok else 'FAILED'} "
          f"(worst error {worst:.3f} of tolerance)")
    return 0 if ok else 1


def cmd_inspect(args):
    from . import store
    from .model import EngramModel
    model = EngramModel.load(args.checkpoint, mmap=True)
    cfg, plan = model.cfg, model.plan
    print(f"checkpoint: {args.checkpoint} ({os.path.getsize(args.checkpoint) / 2**20:,.1f} MiB)")
    print("config: " + json.dumps(cfg.to_dict()))
    print(f"geometry: orders 2..{cfg.max_ngram_size}, {cfg.n_head_per_ngram} heads/order, H={cfg.n_heads}, "
          f"head_dim={cfg.head_dim}, E={cfg.engram_dim}, D={cfg.hidden_size}, G={cfg.hc_mult}, "
          f"conv {cfg.kernel_size} taps x dilation {cfg.max_ngram_size}")
    print(f"compression: {'identity' if plan.lookup is None else 'table'} "
          f"(vocab {cfg.vocab_size} -> {plan.compressed_vocab}), compressed pad {plan.pad_id}")
    for L in cfg.layer_ids:
        w = model.layer(L)
        res = store.resident_bytes(w.table)
        print(f"layer {L}: multipliers {plan.multipliers[L].tolist()}")
        for n, primes in enumerate(plan.primes[L], start=2):
            print(f"  order {n}: primes {primes}")
        print(f"  offsets {plan.offsets[L].tolist()}")
        print(f"  table [{plan.table_rows[L]}, {cfg.head_dim}] {w.table_dtype}: "
              f"{w.table.nbytes / 2**20:,.1f} MiB, resident {res / 2**20:,.1f} MiB")
    return 0


def cmd_init(args):
    from .model import EngramModel
    try:
        with open(args.config) as f:
            cfg = EngramConfig.from_dict(json.load(f))
    except json.JSONDecodeError as e:
        raise CliError(f"{args.config}: not valid JSON ({e})") from None
    compression = None
    if args.compression:
        compression = np.load(args.compression)
    model = EngramModel.init(cfg, seed=args.seed, graft_zero_init=args.graft_zero, compression=compression)
    progress = None if args.quiet else _progress_bar
    model.save(args.output, table_dtype=args.table_dtype, progress=progress)
    if not args.quiet:
        print(file=sys.stderr)
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 2**20:,.1f} MiB, "
          f"{args.table_dtype or 'float32'} tables): {model!r}".replace(
              "table_dtype=float32", f"table_dtype={args.table_dtype or 'float32'}"))
    return 0


def _progress_bar(done, total, _last=[-1]):
    pct = int(100 * done / total) if total else 100
    if pct == _last[0]:  # one update per percent
        return
    _last[0] = pct
    bar = "#" * (40 * pct // 100)
    print(f"\r[{bar:<40}] {pct:3d}% of {total / 2**20:,.0f} MiB", end="", file=sys.stderr, flush=True)


def cmd_build_compression(args):
    from .compression import build_compression
    lookup = build_compression(args.tokenizer)
    np.save(args.output, lookup)
    print(f"wrote {args.output}: vocab {lookup.shape[0]} -> {int(lookup.max()) + 1} compressed ids "
          f"({(int(lookup.max()) + 1) / lookup.shape[0]:.1%})")
    return 0


def cmd_bench(args):
    """A short in-process comparison: engine step vs the fused-GEMV floor, 1 vs N streams."""
    model = _model_for_demo(args)
    cfg = model.cfg
    L = cfg.layer_ids[0]
    G, D = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(0)
    n = args.steps

    def per_step(S):
        eng = model.stream(L, n_streams=S)
        h = rng.standard_normal((S, G, D), dtype=np.float32)
        out = np.empty_like(h)
        ids = rng.integers(0, cfg.vocab_size, size=(n, S))
        for t in range(min(n, 20)):
            eng.step(ids[t], h, out=out)
        t0 = time.perf_counter()
        for t in range(n):
            eng.step(ids[t], h, out=out)
        return (time.perf_counter() - t0) / n

    W = model.layer(L).proj_w
    WT = np.ascontiguousarray(W.T)
    e = rng.standard_normal(W.shape[1], dtype=np.float32)
    t0 = time.perf_counter()
    for _ in range(n):
        W @ e
    t1 = time.perf_counter()
    for _ in range(n):
        e @ WT
    floor = min(t1 - t0, time.perf_counter() - t1) / n
    one, many = per_step(1), per_step(args.streams)
    print(f"config: D={D} G={G} H={cfg.n_heads}x{cfg.head_dim} (the demo model; bench/ has the full suite)")
    print(f"engine step (1 stream):      {one * 1e6:8.1f} us   ({one / floor:.2f}x the fused-GEMV floor "
          f"{floor * 1e6:.1f} us)")
    print(f"engine step ({args.streams} streams):    {many * 1e6:8.1f} us   ({many / args.streams * 1e6:.1f} us "
          f"per token, {many / args.streams / one:.2f}x one stream)")
    return 0


def cmd_profile(args):
    """memray the heap of a decode, and report RSS and table residency."""
    try:
        import memray
    except ImportError:
        raise CliError("profile needs memray: pip install memray") from None
    import tempfile

    from . import store
    from .model import EngramModel
    model = EngramModel.load(args.checkpoint, mmap=True) if args.checkpoint else _model_for_demo(args)
    cfg = model.cfg
    G, D = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(0)
    dec = model.decoder()
    h = rng.standard_normal((G, D), dtype=np.float32)
    out = np.empty_like(h)
    ids = rng.integers(0, cfg.vocab_size, size=args.steps)
    before = store.proc_status()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decode.bin")
        t0 = time.perf_counter()
        with memray.Tracker(path):
            for t in range(args.steps):
                dec.begin(int(ids[t]))
                for L in cfg.layer_ids:
                    dec.layer(L, h, out=out)
        dt = time.perf_counter() - t0
        reader = memray.FileReader(path)
        peak, total = reader.metadata.peak_memory, reader.metadata.total_allocations
    after = store.proc_status()
    print(f"decoded {args.steps} tokens x {len(cfg.layer_ids)} layers in {dt:.2f} s (under memray)")
    print(f"heap: peak {peak / 2**10:,.1f} KiB over the decode, {total} allocations")
    for k in ("RssAnon", "RssFile"):
        print(f"{k}: {before.get(k, 0) / 2**20:,.1f} -> {after.get(k, 0) / 2**20:,.1f} MiB")
    for L in cfg.layer_ids:
        t = model.layer(L).table
        print(f"layer {L}: table {t.nbytes / 2**20:,.1f} MiB, resident {store.resident_bytes(t) / 2**20:,.1f} MiB")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="engram-stream", description="Streaming inference engine for Engram.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo", help="decode on a built-in model and check against the batch path")
    s.add_argument("--tokens", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("inspect", help="config, geometry, tables and residency of a checkpoint")
    s.add_argument("checkpoint")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("init", help="write a random (or graft-zero) checkpoint from a config JSON")
    s.add_argument("config", help="JSON with EngramConfig fields")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--graft-zero", action="store_true", help="zero value projection: output exactly 0")
    s.add_argument("--table-dtype", choices=["float32", "float16", "int8"], default=None)
    s.add_argument("--compression", help="a lookup .npy from build-compression")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("build-compression", help="tokenizer.json -> compression lookup .npy")
    s.add_argument("tokenizer")
    s.add_argument("-o", "--output", required=True)
    s.set_defaults(func=cmd_build_compression)

    s = sub.add_parser("bench", help="engine step vs the GEMV floor, 1 vs N streams (quick)")
    s.add_argument("--steps", type=int, default=500)
    s.add_argument("--streams", type=int, default=16)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("profile", help="memray heap + RSS + residency of a decode")
    s.add_argument("checkpoint", nargs="?", help="checkpoint to decode from (default: the demo model)")
    s.add_argument("--steps", type=int, default=500)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_profile)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("engram-stream: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line unless --debug
        if args.debug:
            raise
        msg = str(e) if isinstance(e, (CliError, OSError, ValueError, TypeError, KeyError, ImportError)) \
            else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.filename:
            msg = f"{e.filename}: {e.strerror or e}"
        print(f"engram-stream: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
