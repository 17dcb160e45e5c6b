#!/usr/bin/env python
"""The longcat-flash-lite engine (LongCat-Flash-Lite's n-gram embedding, an input layer) at the
released dims: hidden 3072, emb_neighbor_num 4, emb_split_num 4 (E = 12 embedders of 256),
bfloat16 tables and projections (proj_w [3072, 3072]: post_projs side by side, 18 MiB); the
tables scaled down (vocab 8192, ngram_vocab_size_ratio 2: a table's size does not change a
step's compute). The checkpoint is written once in the model's HF layout by the longcat folder's
own init and writer.

    flock /tmp/bench.lock python bench/bench_longcat.py            # all sections
    flock /tmp/bench.lock python bench/bench_longcat.py --quick    # fewer rounds: under 2 minutes
    flock /tmp/bench.lock python bench/bench_longcat.py --paths avx512,avx2   # forced paths beside

Ratios of medians, the contenders and their floors side by side in one run (rounds interleaved,
the order rotating; bench_v41.py's and bench_qwen.py's method, bench/NOTES.md). Every
goal is computed on the unforced engine: the path and threads engine/tune.py chose (what a user
gets); --paths adds the same engines forced onto each named path, as rows beside it.
  step      one-stream step vs one read of the projection bytes it reads (the packed proj_w,
            k.read_bytes, one core)                               goal <= 1.2x
            16 streams per token vs the one-stream step           goal <= 1/8
  prefill   eng.prefill of 512 tokens vs the register-only floor of the cores it runs on
            (2*T*3072*3072 FLOPs at the peak of the chosen path's GEMM multiply-add, es8_mac_chains:
            vdpbf16ps on the bf16 path, where bf16 projections meet a bf16 table; else vfmadd;
            every core at once, in the same rounds)               goal <= 1.3x
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

from _lib.common import add_busy_args, busy_loops, finish, machine  # noqa: E402
from _lib.kernels import fma_runner, on_path, parse_paths  # noqa: E402
from _lib.timing import median, rounds  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.engine import isa as _isa  # noqa: E402
from engram_stream.v41 import _engine as k  # noqa: E402

LAYER = 0
CALLS = 8   # step-section calls per timing
# LongCat-Flash-Lite's n-gram embedding keys at the released dims, a small vocab and table
RELEASED = {"model_type": "longcat_flash_ngram", "hidden_size": 3072, "emb_neighbor_num": 4, "emb_split_num": 4,
            "eos_token_id": 2}


def ensure_checkpoint(d, vocab, ratio):
    if not os.path.isfile(os.path.join(d, "config.json")):
        cfg = EngramConfig.from_hf_config({**RELEASED, "vocab_size": vocab, "ngram_vocab_size_ratio": ratio})
        t0 = time.perf_counter()
        EngramModel.init(cfg, seed=0).with_weight_dtype("bfloat16").save(d, table_dtype="bfloat16")
        print(f"wrote {d} in {time.perf_counter() - t0:.0f} s", flush=True)
    return d


def section_step(model, reps, paths):
    """The unforced one-stream step and 16-stream step (and each forced path's) beside one read of
    the packed projection bytes, all in the same interleaved rounds."""
    rng = np.random.default_rng(0)
    w = model.layer(LAYER)
    D, V = model.cfg.hidden_size, model.cfg.vocab_size
    wb = np.asarray(w.packed()[0]).reshape(-1).view(np.uint8)   # what the step's GEMV reads
    for a in (w.table, w.embed):  # their pages mapped: rows, not disk reads
        k.read_bytes(np.asarray(a).reshape(-1).view(np.uint8))
    runs = {"read": lambda: k.read_bytes(wb)}
    c1, c16 = model.stream(LAYER), model.stream(LAYER, n_streams=16)  # nothing forced or set: the tuned choice
    o1, o16 = np.empty(D, np.float32), np.empty((16, D), np.float32)
    runs["chosen.step1"] = lambda: c1.step(int(rng.integers(V)), out=o1)
    runs["chosen.step16"] = lambda: c16.step(rng.integers(0, V, 16), out=o16)
    for isa in paths:
        e1, e16 = model.stream(LAYER), model.stream(LAYER, n_streams=16)
        runs[f"{isa}.step1"] = (lambda e, isa: lambda: on_path(
            isa, lambda: e.step(int(rng.integers(V)), out=o1)))(e1, isa)
        runs[f"{isa}.step16"] = (lambda e, isa: lambda: on_path(
            isa, lambda: e.step(rng.integers(0, V, 16), out=o16)))(e16, isa)
    b_isa, b_threads = c16.kernel_choice()["batch"][:2]
    fma = fma_runner(b_isa, b_threads, 2_000_000)  # the GEMM's multiply-add: vdpbf16ps on bf16
    runs["fma"] = lambda: fma(1)
    # each timing CALLS calls back to back: blocks of a few ms, not one sub-ms call (bench/NOTES.md)
    times = rounds({n: (lambda f: lambda: [f() for _ in range(CALLS)])(f) for n, f in runs.items()}, reps)
    times = {n: [x / CALLS for x in t] for n, t in times.items()}
    med = {n: median(t) for n, t in times.items()}
    rd = med["read"]
    # what bounds 16 streams: their multiply-adds at the register-only FMA peak of the batch's path and threads
    M, E = w.proj_w.shape
    floor16 = [2 * 16 * M * E / (g * 1e9) for g in fma.gflops(times["fma"])]
    res = {"proj_bytes": int(wb.nbytes), "read_ms": rd * 1e3, "read_GBps": wb.nbytes / rd / 1e9, "reps": reps,
           "chosen_config": {"step": list(c1.kernel_choice()["step"]), "batch": list(c16.kernel_choice()["batch"])},
           "fma_GFLOPs": median(fma.gflops(times["fma"])), "step16_fma_floor_ms": median(floor16) * 1e3,
           "step16_over_fma_floor_paired": median([a / b for a, b in zip(times["chosen.step16"], floor16)])}
    for who in ["chosen"] + list(paths):
        one, s16 = med[f"{who}.step1"], med[f"{who}.step16"]
        res[who] = {"step1_ms": one * 1e3, "step16_ms": s16 * 1e3, "step1_over_read": one / rd,
                    "step1_over_read_paired": median([a / b for a, b in zip(times[f"{who}.step1"], times["read"])]),
                    "per_token16_over_step1": s16 / 16 / one,
                    "per_token16_over_step1_paired": median([a / 16 / b for a, b in zip(
                        times[f"{who}.step16"], times[f"{who}.step1"])])}
    return res


def section_prefill(model, T, reps, paths):
    """eng.prefill of T tokens, the unforced engine (and each forced path on all cores) vs the
    register-only FMA floor of the cores it runs on at its path, timed in the same rounds."""
    D, V = model.cfg.hidden_size, model.cfg.vocab_size
    cores = os.cpu_count() or 1
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, T)
    out = np.empty((T, D), np.float32)
    chosen = model.stream(LAYER)
    c_isa, c_threads, c_why = chosen.kernel_choice()["prefill"]
    engs = {"chosen": (chosen, None)}
    for isa in paths:
        e = model.stream(LAYER)
        e.prefill_threads = cores
        engs[isa] = (e, isa)

    def prefill(e, isa):
        e.reset()
        if isa is None:
            return e.prefill(ids, out=out)
        return on_path(isa, lambda: e.prefill(ids, out=out))
    runs = {n: (lambda e, isa: lambda: prefill(e, isa))(e, isa) for n, (e, isa) in engs.items()}
    floors_of = {"chosen": (c_isa, c_threads)}
    floors_of.update({isa: (isa, cores) for isa in paths})
    fma = {}
    for isa, th in set(floors_of.values()):
        fma[(isa, th)] = fma_runner(isa, th, 40_000_000)  # vdpbf16ps on bf16, else vfmadd
        runs[f"fma.{isa}.t{th}"] = (lambda f: lambda: f(1))(fma[(isa, th)])
    times = rounds(runs, reps)
    M, E = model.layer(LAYER).proj_w.shape
    res = {"T": T, "reps": reps, "chosen_config": [c_isa, c_threads, c_why]}
    for n, (isa, th) in floors_of.items():
        peaks = fma[(isa, th)].gflops(times[f"fma.{isa}.t{th}"])
        floors = [2 * M * E * T / (g * 1e9) for g in peaks]
        t = times[n]
        res[n] = {"path": isa, "threads": th, "s": median(t), "spread_s": [min(t), max(t)],
                  "register_fma_GFLOPs": median(peaks), "fma_floor_s": median(floors),
                  "over_fma_floor": median(t) / median(floors),
                  "over_fma_floor_paired": median([a / b for a, b in zip(t, floors)])}
    return res


def verdict(x, goal):
    return "MET" if x <= goal else "MISSED"


def table(res, paths):
    """The figures with their goals, one line each; the goals judged on the chosen engine."""
    lines = []
    st, pf = res.get("step"), res.get("prefill")
    if st:
        mib = st["proj_bytes"] / 2**20
        cfg = st["chosen_config"]
        for who in ["chosen"] + list(paths):
            r = st[who]
            tag = f"chosen ({cfg['step'][0]}/{cfg['step'][1]}; 16: {cfg['batch'][0]}/{cfg['batch'][1]})" \
                if who == "chosen" else f"[{who}]"
            g1, g16 = verdict(r["step1_over_read"], 1.2), verdict(r["per_token16_over_step1"], 1 / 8)
            lines.append(f"{tag}: step / one read of proj_w ({mib:.0f} MiB, {st['read_GBps']:.1f} GB/s): "
                         f"{r['step1_over_read']:.2f}x (paired {r['step1_over_read_paired']:.2f}x; goal <= 1.2x)"
                         + (f" {g1}" if who == "chosen" else ""))
            lines.append(f"{tag}: 16 streams per token / one stream: {r['per_token16_over_step1']:.3f} (paired "
                         f"{r['per_token16_over_step1_paired']:.3f}; goal <= 0.125)" + (f" {g16}" if who == "chosen" else ""))
        lines.append(f"bound: 16 streams at the register FMA peak of {cfg['batch'][0]}/{cfg['batch'][1]} "
                     f"({st['fma_GFLOPs']:.0f} GFLOP/s) take {st['step16_fma_floor_ms']:.2f} ms, per token "
                     f"{st['step16_fma_floor_ms'] / 16 / st['chosen']['step1_ms']:.3f} of the one-stream step; the "
                     f"16-stream step / that floor: {st['step16_over_fma_floor_paired']:.2f}x (paired)")
    if pf:
        for who in ["chosen"] + list(paths):
            p = pf[who]
            tag = f"chosen ({pf['chosen_config'][0]}/{pf['chosen_config'][1]})" if who == "chosen" else f"[{who}]"
            lines.append(f"{tag}: prefill {pf['T']} / FMA floor of {p['threads']} cores ({p['path']}, "
                         f"{p['register_fma_GFLOPs']:.0f} GFLOP/s): {p['over_fma_floor']:.2f}x (paired "
                         f"{p['over_fma_floor_paired']:.2f}x; goal <= 1.3x)"
                         + (f" {verdict(p['over_fma_floor'], 1.3)}" if who == "chosen" else ""))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/engram_longcat_flash_lite")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--ngram-vocab-size-ratio", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under 2 minutes)")
    ap.add_argument("--sections", default="step,prefill")
    ap.add_argument("--paths", default="",
                    help=f"kernel paths to measure forced, beside the chosen engine (default none; this CPU runs "
                         f"{','.join(_isa.supported_isas())})")
    ap.add_argument("--json")
    add_busy_args(ap)
    a = ap.parse_args()
    paths = parse_paths(ap, a.paths)
    d = ensure_checkpoint(a.dir, a.vocab_size, a.ngram_vocab_size_ratio)
    with busy_loops(a.busy, a.busy_cpu) as busy:
        res = {"machine": machine(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "paths": paths, "loadavg_start": os.getloadavg(), **busy}
        print(json.dumps(res["machine"]), flush=True)
        sections = a.sections.split(",")
        model = EngramModel.load(d, mmap=True)
        if "step" in sections:
            res["step"] = section_step(model, 15 if a.quick else 41, paths)
            print("step", json.dumps(res["step"]), flush=True)
        if "prefill" in sections:
            res["prefill"] = section_prefill(model, 512, 5 if a.quick else 15, paths)
            print("prefill", json.dumps(res["prefill"]), flush=True)
        res["loadavg_end"] = os.getloadavg()
    finish(res, table(res, paths), a.json)


if __name__ == "__main__":
    main()
