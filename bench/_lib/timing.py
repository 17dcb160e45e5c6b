"""Timing of contenders side by side: blocks sized to a target time, rounds whose order rotates
(a shared machine's load moves every contender alike)."""
import time

import numpy as np


def calibrate(run, target):
    """Calls per block so one block takes about `target` seconds."""
    run(1)
    n = 1
    while True:
        t = time.perf_counter()
        run(n)
        dt = time.perf_counter() - t
        if dt >= target / 4 or n >= 1 << 16:
            return max(1, int(n * target / max(dt, 1e-9)))
        n *= 4


def interleaved(contenders, reps, target):
    """contenders: {name: run(n)} -> {name: [seconds per call, one per repetition]}.
    Blocks of the contenders alternate; the order rotates every repetition."""
    names = list(contenders)
    for k in names:  # every contender warm before any is calibrated: the first calibrated is not
        contenders[k](1)  # sized on a cold machine (smaller blocks: each block's cold start weighs more)
    ns = {k: calibrate(contenders[k], target) for k in names}
    times = {k: [] for k in names}
    for r in range(reps):
        for j in range(len(names)):
            k = names[(r + j) % len(names)]
            t = time.perf_counter()
            contenders[k](ns[k])
            times[k].append((time.perf_counter() - t) / ns[k])
    return times


def median(xs):
    return float(np.median(np.asarray(xs)))


def timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def rounds(runs, reps):
    """{name: [seconds]}: every contender once a round, the order rotating (after one warm call each)."""
    for f in runs.values():
        f()
    times = {n: [] for n in runs}
    names = list(runs)
    for r in range(reps):
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            times[n].append(timed(runs[n]))
    return times
