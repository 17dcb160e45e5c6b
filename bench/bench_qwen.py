#!/usr/bin/env python
"""The qwen3.8-flash-next engine (Qwen4-Exp's PLE layer) at the released config's dims: hidden
2560, hc 4, ple_embed_dim 2560 = 16 heads x 160, ngram_size 3, heads_per_ngram 8, conv 4 taps;
one PLE layer, the table scaled down (ngram_vocab_size_base 20000: the table's size does not
change a step's compute). The checkpoint is written once in the model's HF layout with bfloat16
tables and bfloat16 projections, as released; the step, 16-stream and prefill sections measure
the engine with those bf16 projection weights and again with them widened to float32.

    flock /tmp/bench.lock python bench/bench_qwen.py              # all sections
    flock /tmp/bench.lock python bench/bench_qwen.py --quick      # fewer repetitions / rounds
    flock /tmp/bench.lock python bench/bench_qwen.py --sections step,prefill --paths avx2

Ratios of medians, the contenders and their floors side by side in one run (rounds
interleaved, the order rotating; bench_v41.py's method, bench/NOTES.md; helpers: bench/_lib):
  step      one-stream step (step_threads 1 and 2) vs one read of the projection weights it
            reads (proj_w: key_proj + value_proj, [12800, 2560]; k.read_bytes, one core)
                                                                   goal <= 1.2x
            16 streams per token vs the one-stream step (best of 1 and 2 threads)
                                                                   goal <= 1/8
  prefill   eng.prefill of 512 tokens on all cores vs the register-only FMA floor of all cores
            (2*T*12800*2560 FLOPs at the peak of the GEMM's multiply-add: vfmadd, es_fma_chains;
            bf16 projections on the bf16 path vdpbf16ps, es8_mac_chains; measured with every
            core at once in the same rounds)                       goal <= 1.3x
  direct    tables="direct" (O_DIRECT, qd 32, a row cache of a small fraction of the table):
            the engine's read path (feed + fetch, 16 streams of random ids, every row a miss),
            cold (the shard's pages dropped with posix_fadvise DONTNEED before each round) vs
            fio's 4 KiB random reads on the same file at the same qd  goal >= 0.7x
"""
import argparse
import json
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from _lib.common import add_busy_args, busy_loops, finish, machine  # noqa: E402
from _lib.disk import device, fio  # noqa: E402
from _lib.kernels import fma_runner, on_path, parse_paths  # noqa: E402
from _lib.timing import median, rounds, timed  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.demo import _engine as demo_k  # noqa: E402
from engram_stream.engine import isa as _isa  # noqa: E402
from engram_stream.v41 import _engine as k  # noqa: E402

LAYER = 1
# the released Qwen3.8-Flash-Next text config's PLE keys, one PLE layer, a small table
RELEASED = {"model_type": "qwen4_exp_text", "vocab_size": 248320, "hidden_size": 2560, "hc_count": 4,
            "rms_norm_eps": 1e-6, "eos_token_id": 248044, "ple_layer_ids": [LAYER], "ple_embed_dim": 2560,
            "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
            "make_ngram_vocab_size_divisible_by": 128, "seed": 1234, "split_ngram_parts": 512}


def ensure_checkpoint(d, base):
    if not os.path.isfile(os.path.join(d, "config.json")):
        cfg = EngramConfig.from_hf_config({**RELEASED, "ngram_vocab_size_base": base})
        t0 = time.perf_counter()
        EngramModel.init(cfg, seed=0).with_weight_dtype("bfloat16").save(d, table_dtype="bfloat16")
        print(f"wrote {d} in {time.perf_counter() - t0:.0f} s", flush=True)
    return d


def section_step(models, reps, paths, hidden_dtype):
    """Per weight dtype and path: the one-stream step (1, 2 threads) and 16 streams (1, 2) beside
    one read of the projection weights of that dtype, and the unforced engines (no path forced, no
    thread count set: the tuned choice, what a user gets), all in the same interleaved rounds.
    Hidden states and outputs of `hidden_dtype` (bfloat16: what the serving frameworks hand over)."""
    rng = np.random.default_rng(0)
    runs, res = {}, {}
    for dt, model in models.items():
        w = model.layer(LAYER)
        G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
        wb = np.ascontiguousarray(w.proj_w).reshape(-1).view(np.uint8)
        k.read_bytes(np.asarray(w.table).reshape(-1).view(np.uint8))  # the table's pages: rows, not disk reads
        res[dt] = {"proj_bytes": int(wb.nbytes)}
        runs[f"{dt}.read"] = (lambda wb: lambda: k.read_bytes(wb))(wb)
        h1 = rng.standard_normal((G, D)).astype(hidden_dtype)
        h16 = rng.standard_normal((16, G, D)).astype(hidden_dtype)
        o1, o16 = np.empty_like(h1), np.empty_like(h16)
        c1, c16 = model.stream(LAYER), model.stream(LAYER, n_streams=16)  # nothing forced or set
        res[dt]["chosen_config"] = {"step": list(c1.kernel_choice()["step"]),
                                    "batch": list(c16.kernel_choice()["batch"])}
        runs[f"{dt}.chosen.step1"] = (lambda e, h, o: lambda: e.step(int(rng.integers(V)), h, out=o))(c1, h1, o1)
        runs[f"{dt}.chosen.step16"] = (lambda e, h, o: lambda: e.step(rng.integers(0, V, 16), h, out=o))(c16, h16, o16)
        for isa in paths:
            for th in (1, 2):
                e1, e16 = model.stream(LAYER), model.stream(LAYER, n_streams=16)
                e1.step_threads = e16.step_threads = th
                runs[f"{dt}.{isa}.step1_t{th}"] = (lambda e, isa, h, o: lambda: on_path(
                    isa, lambda: e.step(int(rng.integers(V)), h, out=o)))(e1, isa, h1, o1)
                runs[f"{dt}.{isa}.step16_t{th}"] = (lambda e, isa, h, o: lambda: on_path(
                    isa, lambda: e.step(rng.integers(0, V, 16), h, out=o)))(e16, isa, h16, o16)
    times = rounds(runs, reps)
    med = {n: median(t) for n, t in times.items()}
    for dt in models:
        rd = med[f"{dt}.read"]
        res[dt].update(read_ms=rd * 1e3, read_GBps=res[dt]["proj_bytes"] / rd / 1e9)
        one, s16 = med[f"{dt}.chosen.step1"], med[f"{dt}.chosen.step16"]
        res[dt]["chosen"] = {"step1_ms": one * 1e3, "step16_ms": s16 * 1e3, "step1_over_read": one / rd,
                             "step1_over_read_paired": median([a / b for a, b in zip(
                                 times[f"{dt}.chosen.step1"], times[f"{dt}.read"])]),
                             "per_token16_over_step1": s16 / 16 / one}
        for isa in paths:
            one = {th: med[f"{dt}.{isa}.step1_t{th}"] for th in (1, 2)}
            s16 = {th: med[f"{dt}.{isa}.step16_t{th}"] for th in (1, 2)}
            r = res[dt][isa] = {}
            for th in (1, 2):
                r[f"step1_t{th}_ms"] = one[th] * 1e3
                r[f"step1_t{th}_over_read"] = one[th] / rd
                r[f"step16_t{th}_ms"] = s16[th] * 1e3
                r[f"per_token16_t{th}_over_step1_t1"] = s16[th] / 16 / one[1]
            r["step1_over_read_paired"] = median([a / b for a, b in zip(times[f"{dt}.{isa}.step1_t1"],
                                                                          times[f"{dt}.read"])])
    return res


def section_prefill(models, T, reps, paths, hidden_dtype):
    """eng.prefill of T tokens on all cores per weight dtype and path, vs the register-only FMA
    floor of all cores (the path's vfmadd peak, every core at once), timed in the same rounds;
    hidden states and outputs of `hidden_dtype`."""
    cores = os.cpu_count() or 1
    res = {"T": T, "threads": cores, "reps": reps, "hidden": np.dtype(hidden_dtype).name}
    # the floor of the GEMM's own multiply-add: bf16 projections and table on the bf16 path run vdpbf16ps
    # (v41's _mac_chains: vdpbf16ps there, else the FMA chains), float32 ones vfmadd
    floor_of = {dt: (None if dt == "bfloat16" else demo_k._fma_chains) for dt in models}
    fma = {(dt, isa): fma_runner(isa, cores, 40_000_000, chains=floor_of[dt]) for dt in models for isa in paths}
    t_fma = {key: [] for key in fma}
    t_ours, engs = {}, {}
    for dt, model in models.items():
        G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
        rng = np.random.default_rng(1)
        ids, hidden = rng.integers(0, V, T), rng.standard_normal((T, G, D)).astype(hidden_dtype)
        eng = model.stream(LAYER)
        eng.prefill_threads = cores
        engs[dt] = (eng, ids, hidden, np.empty_like(hidden))
        for isa in paths:
            t_ours[(dt, isa)] = []
            on_path(isa, lambda: eng.prefill(ids, hidden, out=engs[dt][3]))  # warm
            eng.reset()
    M, E = models[next(iter(models))].layer(LAYER).proj_w.shape
    for _ in range(reps):  # every contender and floor once a round
        for isa in paths:
            for dt, (eng, ids, hidden, out) in engs.items():
                eng.reset()
                t_ours[(dt, isa)].append(timed(lambda: on_path(isa, lambda: eng.prefill(ids, hidden, out=out))))
                t_fma[(dt, isa)].append(timed(lambda: fma[(dt, isa)](1)))
    for isa in paths:
        res[isa] = {}
        for dt in models:
            peaks = fma[(dt, isa)].gflops(t_fma[(dt, isa)])
            floors = [2 * M * E * T / (g * 1e9) for g in peaks]
            t = t_ours[(dt, isa)]
            res[isa][dt] = {"register_fma_all_cores_GFLOPs": median(peaks), "fma_floor_s": median(floors),
                            "s": median(t), "spread_s": [min(t), max(t)],
                            "over_fma_floor": median(t) / median(floors),
                            "over_fma_floor_paired": median([a / b for a, b in zip(t, floors)])}
    return res


def section_direct(d, n_rounds, seconds, qd, cache_mb, streams=16):
    """The engine's read path from disk, cold, vs fio on the same file at the same qd."""
    from engram_stream.rows import DirectTier
    from engram_stream.io import memory
    shards = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    rng = np.random.default_rng(1)
    out = []
    for r in range(n_rounds):
        model = EngramModel.load(d, tables=DirectTier(qd=qd, rows_file=False), row_cache_mb=cache_mb)
        rf = model.tables.inner.files[LAYER]
        path = rf.describe()
        for s in shards:  # (O_DIRECT reads bypass it anyway: no page of the table starts warm)
            memory.evict_file(s)
        eng = model.stream(LAYER, streams)
        V = model.cfg.vocab_size
        st0 = model.row_cache_stats()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            eng.feed(rng.integers(0, V, streams))
            eng.fetch()
        dt = time.perf_counter() - t0
        st = model.row_cache_stats()
        reads, rows = st["reads"] - st0["reads"], st["rows_read"] - st0["rows_read"]
        table = model.plan.table_rows[LAYER] * model.layer(LAYER).table.strides[0]
        del eng, model
        f = fio(shards[0], qd, seconds)
        e = {"fio_iops": f, "reads_per_s": reads / dt, "rows_read_per_s": rows / dt,
             "reads_per_row_read": reads / max(1, rows), "ratio": reads / dt / f, "file": path,
             "direct": bool(rf.direct), "table_over_cache": table / (cache_mb * 2**20)}
        out.append(e)
        print(f"  round {r}: engine read path {e['reads_per_s']:,.0f} reads/s ({e['reads_per_row_read']:.3f} per "
              f"row read) | fio {f:,.0f} IOPS | {e['ratio']:.2f}x", flush=True)
    return {"rounds": out, "qd": qd, "streams": streams, "seconds": seconds, "file": shards[0],
            "fio_iops": median([x["fio_iops"] for x in out]),
            "reads_per_s": median([x["reads_per_s"] for x in out]),
            "over_fio": median([x["reads_per_s"] for x in out]) / median([x["fio_iops"] for x in out]),
            "over_fio_paired": median([x["ratio"] for x in out]),
            "reads_per_row_read": median([x["reads_per_row_read"] for x in out]),
            "device": device(d)}


def table(res, paths):
    """The figures with their goals, one line each."""
    lines = []
    st, pf, di = res.get("step"), res.get("prefill"), res.get("direct")
    for isa in paths:
        for dt in ("bfloat16", "float32"):
            if st and dt in st and isa == paths[0]:
                c, cfg = st[dt]["chosen"], st[dt]["chosen_config"]
                lines.append(f"chosen ({cfg['step'][0]}/{cfg['step'][1]}; 16: {cfg['batch'][0]}/{cfg['batch'][1]}) "
                             f"{dt}: step / read of proj_w: {c['step1_over_read']:.2f}x (paired "
                             f"{c['step1_over_read_paired']:.2f}x); 16 streams per token / one stream: "
                             f"{c['per_token16_over_step1']:.3f}")
            if st and dt in st:
                r = st[dt][isa]
                mib = st[dt]["proj_bytes"] / 2**20
                lines.append(f"{isa} {dt}: step / read of proj_w ({mib:.0f} MiB), 1 / 2 threads: "
                             f"{r['step1_t1_over_read']:.2f}x / {r['step1_t2_over_read']:.2f}x (goal <= 1.2x)")
                lines.append(f"{isa} {dt}: 16 streams per token / one stream, 1 / 2 threads: "
                             f"{r['per_token16_t1_over_step1_t1']:.3f} / {r['per_token16_t2_over_step1_t1']:.3f} "
                             f"(goal <= 0.125)")
            if pf and dt in pf.get(isa, {}):
                p = pf[isa][dt]
                lines.append(f"{isa} {dt}: prefill {pf['T']} / FMA floor of {pf['threads']} cores: "
                             f"{p['over_fma_floor']:.2f}x (paired {p['over_fma_floor_paired']:.2f}x; goal <= 1.3x)")
    if di:
        lines.append(f"direct, cold, {di['streams']} streams, qd {di['qd']}: engine read path / fio 4 KiB randread: "
                     f"{di['over_fio']:.2f}x (paired {di['over_fio_paired']:.2f}x; goal >= 0.7x), "
                     f"{di['reads_per_row_read']:.3f} reads per row")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/engram_qwen_flash_next")
    ap.add_argument("--ngram-vocab-size-base", type=int, default=20000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="step,prefill,direct")
    ap.add_argument("--paths", default=_isa.kernel_isa(),
                    help=f"kernel paths to measure (default: the best, {_isa.kernel_isa()}; this CPU runs "
                         f"{','.join(_isa.supported_isas())})")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--cache-mb", type=int, default=8)
    ap.add_argument("--hidden", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the hidden states and outputs (bfloat16: what vLLM, SGLang and transformers hand over)")
    ap.add_argument("--json")
    add_busy_args(ap)
    a = ap.parse_args()
    hidden_dtype = np.float32 if a.hidden == "float32" else ml_dtypes.bfloat16
    paths = parse_paths(ap, a.paths)
    d = ensure_checkpoint(a.dir, a.ngram_vocab_size_base)
    with busy_loops(a.busy, a.busy_cpu) as busy:
        res = {"machine": machine(), "hidden": a.hidden, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "paths": paths, "loadavg_start": os.getloadavg(), **busy}
        print(json.dumps(res["machine"]), flush=True)
        sections = a.sections.split(",")
        if "direct" in sections:  # first: nothing of the file is mapped by this process yet
            res["direct"] = section_direct(d, 1 if a.quick else 3, 3 if a.quick else 5, a.qd, a.cache_mb)
            print("direct", json.dumps(res["direct"]), flush=True)
        bf16 = EngramModel.load(d, mmap=True)
        models = {"bfloat16": bf16.with_weight_dtype("bfloat16"), "float32": bf16.with_weight_dtype("float32")}
        if "step" in sections:
            res["step"] = section_step(models, 5 if a.quick else 15, paths, hidden_dtype)
            print("step", json.dumps(res["step"]), flush=True)
        if "prefill" in sections:
            res["prefill"] = section_prefill(models, 256 if a.quick else 512, 1 if a.quick else 9, paths, hidden_dtype)
            print("prefill", json.dumps(res["prefill"]), flush=True)
        res["loadavg_end"] = os.getloadavg()
    finish(res, table(res, paths), a.json, f", path(s) {','.join(paths)}, {a.hidden} hidden")


if __name__ == "__main__":
    main()
