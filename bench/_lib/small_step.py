"""A small-dims step benchmark's inputs and its rotating rounds of engines."""
import argparse
import time

import numpy as np


def step_us(eng, ids, h, out):
    t0 = time.perf_counter()
    for t in ids:
        eng.step(t, h, out=out)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def setup(doc, steps, rounds):
    """(args, cfg, ids, hidden, out) of a small-dims step benchmark (bench_alignment.py too)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    from engram_stream import EngramConfig
    cfg = EngramConfig(engram_vocab_size=[20011, 20011], n_embed_per_ngram=128, n_head_per_ngram=4,
                       layer_ids=[1], hidden_size=args.hidden, hc_mult=4, vocab_size=32000)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.steps).tolist()
    h = np.ones((cfg.hc_mult, cfg.hidden_size), np.float32)
    return args, cfg, ids, h, np.empty_like(h)


def rotating_rounds(engines, ids, h, out, rounds):
    """{name: [us/step of each round]}: every engine once a round, the order rotated each
    round so that none always goes first."""
    names, times = list(engines), {k: [] for k in engines}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(step_us(engines[k], ids, h, out))
    return times
