#!/usr/bin/env python
"""The deepseek-v4.1 engine at Flash dims (one layer: hidden 5120, hc 4, 24 x 256 rows,
wkv [25600, 6144] float8), table rows scaled down, from a synthetic checkpoint in the HF layout.

    flock /tmp/bench.lock python bench/bench_v41.py                # ~1.3 GB table, all sections
    flock /tmp/bench.lock python bench/bench_v41.py --quick        # fewer repetitions / tokens
    flock /tmp/bench.lock python bench/bench_v41.py --paths avx2   # only these kernel paths
    flock /tmp/bench.lock python bench/bench_v41.py --busy 1       # beside a busy loop (--busy-cpu C: pinned)

Every kernel path this CPU runs is measured (--paths: a subset), each ratio side by side in
one run (rounds interleaved; the machine is shared, so absolute times are indicative only):
  step      one-stream step (step_threads 1 and 2) vs reading the 157 MB of wkv once on one
            core; 16 streams per token (step_threads 1 and 2) vs the one-stream step
                                      goals <= 1.2x, <= 1/8 (the chosen path, best of 1 and 2)
  plain     the float8 projection (fp8_linear, one thread) on each path vs plain scalar C
            (fp8_linear(plain=True)), 1 and 16 tokens on 2048 rows of wkv: not slower
  kernel    fp8_linear, one thread, at 16 and 256 tokens: GFLOP/s against the path's
            register-only peak of its own multiply-add on one core (es_fma_chains: vfmadd, or
            vdpbf16ps on the bf16 path; bench_step.register_fma_gflops)
  prefill   eng.prefill on 512 tokens (1 thread and all cores) vs the register-only FMA floor
            of all cores (2*T*25600*6144 FLOPs at the path's peak, measured with every core at
            once)                                                  goal <= 1.3x
            and vs a torch CPU implementation of the reference module with dequantized weights
  bound     per path: the one-token GEMV's cached rate (plain, 1 token) against one core's read
            of wkv: what bounds the one-stream step on 1 and 2 threads
  side by side  every row above, each path beside the others; a wider path that is slower
            than a narrower one (by more than 2%) is flagged (goal: none)
  choice    the engine's own choice of path and threads per operation (engine/tune.py; res
            "chosen"), held to the fastest: in every row, the chosen path's time vs the fastest
            path's at the row's thread count (an fp8_linear row, a one-thread kernel call, is
            held to the choice of the operation of its token count: 1 the step, 16 the batch,
            256 the prefill); and per engine operation (one-stream step, 16 streams, prefill)
            the unforced engine (no path forced, no thread count set: what a user gets, a
            contender in the same rotation) vs the fastest forced contender of every path and
            thread count                                           goal <= 1.05x (MET / MISSED)
  cold      a fresh process maps the checkpoint (its pages evicted first), 2000 decode steps:
            private memory growth (RssAnon) and table pages mapped vs rows touched x 4 KiB
                                                                   goals <= 64 MB, <= 2x
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()

from engram_stream import EngramModel  # noqa: E402
from engram_stream.v41 import hf as hf_v41  # noqa: E402
from engram_stream.v41 import _engine as k  # noqa: E402
from engram_stream.engine import isa as _isa  # noqa: E402
from _lib.common import add_busy_args, busy_loops, machine  # noqa: E402
from _lib.kernels import fma_runner, on_path, parse_paths  # noqa: E402
from _lib.timing import median, timed  # noqa: E402

LAYER = 1


def ensure_checkpoint(d, evs):
    if not os.path.isfile(os.path.join(d, "config.json")):
        cfg = hf_v41.flash_config(engram_vocab_size=evs, engram_layer_ids=[LAYER])
        t0 = time.perf_counter()
        hf_v41.make_synthetic(d, cfg, seed=0, n_shards=2, tokenizer=False, decoys=False)
        print(f"wrote {d} in {time.perf_counter() - t0:.0f} s")
    return d


def section_step(model, reps, paths):
    """Per path: the one-stream step (step_threads 1, 2) and 16 streams (1, 2) beside reading
    wkv once, and the unforced engines (no path forced, no thread count set: the tuned choice,
    what a user gets), all in interleaved rounds."""
    w = model.layer(LAYER)
    wkv = w.wkv_weight.reshape(-1)
    G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
    rng = np.random.default_rng(0)
    k.read_bytes(wkv)  # map every page of wkv before timing
    for a in (w.embed_weight, w.embed_scale):  # and of the table: random rows, not disk reads
        k.read_bytes(np.asarray(a).reshape(-1))  # (the cold section evicted the shards first)
    h1 = rng.standard_normal((G, D)).astype(np.float32)
    h16 = rng.standard_normal((16, G, D)).astype(np.float32)
    o1, o16 = np.empty_like(h1), np.empty_like(h16)
    runs = {"read": lambda: k.read_bytes(wkv)}
    for isa in paths:
        for th in (1, 2):
            e1, e16 = model.stream(LAYER), model.stream(LAYER, n_streams=16)
            e1.step_threads = e16.step_threads = th
            runs[f"{isa}.step1_t{th}"] = (lambda e, isa: lambda: on_path(isa, lambda: e.step(int(rng.integers(V)), h1, out=o1)))(e1, isa)
            runs[f"{isa}.step16_t{th}"] = (lambda e, isa: lambda: on_path(isa, lambda: e.step(rng.integers(0, V, 16), h16, out=o16)))(e16, isa)
    c1, c16 = model.stream(LAYER), model.stream(LAYER, n_streams=16)  # the chosen: nothing forced or set
    runs["chosen.step1"] = lambda: c1.step(int(rng.integers(V)), h1, out=o1)
    runs["chosen.step16"] = lambda: c16.step(rng.integers(0, V, 16), h16, out=o16)
    for f in runs.values():  # warm: scratch, pages
        f()
    times = {n: [] for n in runs}
    names = list(runs)
    for r in range(reps):  # interleaved rounds, the order rotating: all see the same machine state
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            t0 = time.perf_counter()
            runs[n]()
            times[n].append(time.perf_counter() - t0)
    rd = median(times["read"])
    res = {"wkv_bytes": int(wkv.nbytes), "read_ms": rd * 1e3, "read_GBps": wkv.nbytes / rd / 1e9, "reps": reps,
           "read_spread_ms": [min(times["read"]) * 1e3, max(times["read"]) * 1e3]}
    for isa in paths:
        one = {th: median(times[f"{isa}.step1_t{th}"]) for th in (1, 2)}
        s16 = {th: median(times[f"{isa}.step16_t{th}"]) for th in (1, 2)}
        res[isa] = {f"step1_t{th}_ms": one[th] * 1e3 for th in (1, 2)}
        res[isa].update({f"step1_t{th}_over_read": one[th] / rd for th in (1, 2)})
        res[isa].update({f"step16_t{th}_ms": s16[th] * 1e3 for th in (1, 2)})
        res[isa].update({f"per_token16_t{th}_over_step1_t1": s16[th] / 16 / one[1] for th in (1, 2)})
        res[isa]["spread_ms"] = {n.split(".", 1)[1]: [min(times[n]) * 1e3, max(times[n]) * 1e3]
                                 for n in times if n.startswith(isa + ".")}
    res["chosen"] = {"step1_ms": median(times["chosen.step1"]) * 1e3, "step16_ms": median(times["chosen.step16"]) * 1e3,
                     "config": {"step": list(c1.kernel_choice()["step"]), "batch": list(c16.kernel_choice()["batch"])}}
    res["samples_ms"] = {n: [x * 1e3 for x in v] for n, v in times.items()}  # one a round: paired ratios
    return res


def section_plain(model, paths, reps):
    """fp8_linear on each path vs the plain scalar C loop, one thread, 2048 rows of wkv."""
    w = model.layer(LAYER)
    W, WS = np.asarray(w.wkv_weight)[:2048], np.asarray(w.wkv_scale)[:64]
    rng = np.random.default_rng(4)
    res = {}
    for S in (1, 16):
        x = rng.standard_normal((S, W.shape[1])).astype(np.float32)
        runs = {"plain": lambda: k.fp8_linear(x, W, WS, plain=True)}
        for isa in paths:
            runs[isa] = (lambda isa: lambda: on_path(isa, lambda: k.fp8_linear(x, W, WS)))(isa)
        times = {n: [] for n in runs}
        names = list(runs)
        for f in runs.values():  # warm
            f()
        for r in range(reps):  # the order rotating: no path always runs first after the scalar loop
            for j in range(len(names)):  # (measured on Zen 5: a path's first calls after it up to 8x slower)
                n = names[(r + j) % len(names)]
                t0 = time.perf_counter()
                runs[n]()
                times[n].append(time.perf_counter() - t0)
        res[f"S{S}_plain_ms"] = median(times["plain"]) * 1e3
        for isa in paths:
            res[f"S{S}_{isa}_ms"] = median(times[isa]) * 1e3
            res[f"S{S}_{isa}_over_plain"] = median(times[isa]) / median(times["plain"])
    return res


def section_kernel(model, paths, reps):
    """fp8_linear (activation quantization + the projection), one thread, on the layer's wkv,
    against each path's register-only FMA peak of one core."""
    w = model.layer(LAYER)
    W, WS = np.asarray(w.wkv_weight), np.asarray(w.wkv_scale)
    M, E = W.shape
    rng = np.random.default_rng(3)
    res = {}
    for isa in paths:
        fma = fma_runner(isa, 1, 20_000_000)
        res[isa] = {}
        for S in (16, 256):
            x = rng.standard_normal((S, E)).astype(np.float32)
            on_path(isa, lambda: k.fp8_linear(x, W, WS, threads=1))
            ts, tf = [], []
            for _ in range(reps):  # the kernel and the peak side by side, round by round
                ts.append(timed(lambda: on_path(isa, lambda: k.fp8_linear(x, W, WS, threads=1))))
                tf.append(timed(lambda: fma(1)))
            g = [2 * M * E * S / t / 1e9 for t in ts]
            peaks = fma.gflops(tf)
            res[isa][f"S{S}_GFLOPs"] = median(g)
            res[isa][f"S{S}_register_fma_peak_GFLOPs"] = median(peaks)
            res[isa][f"S{S}_over_peak"] = median([a / b for a, b in zip(g, peaks)])  # paired, by round
    return res


def torch_reference(model, rows, hidden, threads):
    """The reference module in torch, float32, with dequantized weights: rows gathered and
    dequantized, act_quant per 32 (the kernel's bit rule), one matmul with the dequantized wkv,
    the gate. Returns (delta, seconds of the timed part; the wkv dequantization is set-up)."""
    import torch
    torch.set_num_threads(threads)
    w = model.layer(LAYER)
    G, D, E = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.engram_dim
    f8, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    wsc = torch.from_numpy(np.asarray(w.wkv_scale)).view(e8).float()
    Wd = (torch.from_numpy(np.asarray(w.wkv_weight)).view(f8).float()
          * wsc.repeat_interleave(32, 0)[:w.wkv_weight.shape[0]].repeat_interleave(32, 1))
    qw, kw = torch.from_numpy(np.asarray(w.q_weight)), torch.from_numpy(np.asarray(w.k_weight))
    tw, ts = np.asarray(w.embed_weight), np.asarray(w.embed_scale)
    h = torch.from_numpy(hidden)
    eps = model.cfg.norm_eps
    t0 = time.perf_counter()
    r = rows.reshape(-1)
    e = (torch.from_numpy(tw[r]).view(f8).float() * torch.from_numpy(ts[r]).view(e8).float().repeat_interleave(32, 1))
    x = e.reshape(-1, E // 32, 32)
    amax = x.abs().amax(-1).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    bits = amax.view(torch.int32)
    s = ((((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).int() + 127) << 23).view(torch.float32)
    q = (x / s[..., None]).clamp(-448, 448).to(f8).float() * s[..., None]
    kv = q.reshape(-1, E) @ Wd.T
    key, value = kv[:, :G * D].reshape(-1, G, D), kv[:, G * D:]
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (qw * kw) * key).sum(-1) * rstd / D ** 0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    out = gate[..., None] * value[:, None, :]
    return out.numpy(), time.perf_counter() - t0


def section_prefill(model, T, reps, paths):
    """eng.prefill of T tokens per path on 1 thread and on all cores, and the unforced engine (the
    tuned path and threads), in rotating rounds; each path's all-cores time vs the register-only
    FMA floor of all cores (the path's peak measured with every core at once) and vs torch."""
    G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, T)
    hidden = rng.standard_normal((T, G, D)).astype(np.float32)
    rows = model.plan.hash(ids[None], layers=[LAYER])[LAYER][0] + model.layer(LAYER).offsets
    dead = model.plan.dead_mask(ids)
    cores = os.cpu_count() or 1
    counts = sorted({1, 2, cores})
    M, E = model.layer(LAYER).wkv_weight.shape
    engs = {}
    for th in counts:
        engs[th] = model.stream(LAYER)
        engs[th].prefill_threads = th
    chosen = model.stream(LAYER)  # nothing forced or set: the tuned path and threads
    out = np.empty_like(hidden)
    res = {"T": T, "threads": cores, "counts": counts, "reps": reps}

    def prefill(e, isa):
        e.reset()
        if isa is None:
            return timed(lambda: e.prefill(ids, hidden, out=out))
        return timed(lambda: on_path(isa, lambda: e.prefill(ids, hidden, out=out)))
    runs = {"chosen": lambda: prefill(chosen, None)}
    for isa in paths:
        for th in counts:
            runs[f"{isa}.t{th}"] = (lambda e, isa: lambda: prefill(e, isa))(engs[th], isa)
    fma = {isa: fma_runner(isa, cores, 40_000_000) for isa in paths}
    for isa in paths:  # every floor in the same rotation as what it floors
        runs[f"fma.{isa}"] = (lambda f: lambda: timed(lambda: f(1)))(fma[isa])
    for e in [chosen] + list(engs.values()):  # warm: scratch, the rows' pages
        prefill(e, None)
    t = {n: [] for n in runs}
    t_torch, want = [], None
    names = list(runs)
    for r in range(reps):  # every contender and floor once a round, the order rotating
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            t[n].append(runs[n]())
        try:
            want, s = torch_reference(model, rows, hidden, cores)
            t_torch.append(s)
        except ImportError:
            pass
    res["chosen"] = {"s": median(t["chosen"]), "config": list(chosen.kernel_choice()["prefill"])}
    res["samples_ms"] = {n: [x * 1e3 for x in v] for n, v in t.items()}  # one a round: paired ratios
    for isa in paths:
        peaks = fma[isa].gflops(t[f"fma.{isa}"])
        floors = [2 * M * E * T / (g * 1e9) for g in peaks]
        ours = t[f"{isa}.t{cores}"]
        res[isa] = {"s": median(ours), "spread_s": [min(ours), max(ours)],
                    **{f"t{th}_s": median(t[f"{isa}.t{th}"]) for th in counts},
                    "register_fma_all_cores_GFLOPs": median(peaks), "fma_floor_s": median(floors),
                    "over_fma_floor": median([a / b for a, b in zip(ours, floors)])}  # paired, by round
        if t_torch:
            res[isa]["torch_over_ours"] = median(t_torch) / median(ours)
    if t_torch:
        chosen.reset()
        chosen.prefill(ids, hidden, out=out)
        want[dead] = 0
        err = np.abs(out - want) - (2e-5 + 2e-4 * np.abs(want))
        res.update(torch_s=median(t_torch), agree=bool(err.max() <= 0), max_abs_diff=float(np.abs(out - want).max()))
    return res


def path_rows(res, paths):
    """[(row, op, threads, {path: ms})]: every measured row, each path's figure of it (times: lower
    is better); op: the engine operation whose choice the row's path is held to (the fp8_linear
    rows, one-thread kernel calls: by token count, 1 the step, 16 the batch, 256 the prefill);
    threads: the engine's thread count (None: a kernel call, one thread)."""
    order = sorted(paths, key=_isa.ISA_NAMES.index)
    rows = []
    st, pl, kn, pf = (res.get(n, {}) for n in ("step", "plain", "kernel", "prefill"))
    for th in (1, 2):
        if st:
            rows.append((f"step, one stream, {th} thread(s), ms", "step", th,
                         {p: st[p][f"step1_t{th}_ms"] for p in order}))
            rows.append((f"step, 16 streams, {th} thread(s), ms", "batch", th,
                         {p: st[p][f"step16_t{th}_ms"] for p in order}))
    for S in (1, 16):
        if pl:
            rows.append((f"fp8_linear {S} token(s), 2048 rows, 1 thread, ms", KERNEL_OP[S], None,
                         {p: pl[f"S{S}_{p}_ms"] for p in order}))
    for S in (16, 256):
        if kn:
            rows.append((f"fp8_linear {S} tokens, wkv, 1 thread, ms", KERNEL_OP[S], None,
                         {p: 2 * res["wkv_rows_x_e"] * S / kn[p][f"S{S}_GFLOPs"] / 1e6 for p in order}))
    if pf:
        for th in pf["counts"]:
            rows.append((f"prefill {pf['T']}, {th} thread(s), ms", "prefill", th,
                         {p: pf[p][f"t{th}_s"] * 1e3 for p in order}))
    return rows


KERNEL_OP = {1: "step", 16: "batch", 256: "prefill"}  # fp8_linear's token count -> the operation of that shape
GOAL = 1.05  # the chosen within 5% of the fastest


def side_by_side(res, paths):
    """Every path's figure of each row beside the others' (times: lower is better), and the rows
    where a wider path (later in engine.isa.ISA_NAMES) is slower than a narrower one by more than
    2%: returns those as "row: wide x.xx of narrow"."""
    order = sorted(paths, key=_isa.ISA_NAMES.index)
    rows = path_rows(res, paths)
    losses = []
    width = max(len(r[0]) for r in rows) if rows else 0
    print("side by side (" + ", ".join(order) + "): a wider path slower than a narrower one is flagged")
    for name, _, _, v in rows:
        flags = [f"{w} {v[w] / v[n]:.2f}x of {n}" for i, n in enumerate(order) for w in order[i + 1:]
                 if v[w] > 1.02 * v[n]]
        losses += [f"{name}: {f}" for f in flags]
        print(f"  {name:<{width}}  " + "  ".join(f"{p} {v[p]:9.3f}" for p in order)
              + ("   LOSES: " + "; ".join(flags) if flags else ""))
    return losses


def step_bound(res, paths, E):
    """What bounds the one-stream step, per path: the GEMV's own rate on one core with its weights
    in cache (the plain section's one token on 2048 rows of wkv, 12.6 MB) against one core's read
    of wkv from DRAM. One thread at best overlaps the two (the larger time), at worst runs them in
    turn (the sum); two threads halve the kernel's part, and the read is then the floor."""
    st, pl = res.get("step"), res.get("plain")
    if not st or not pl:
        return {}
    wkv, rd = st["wkv_bytes"], st["read_ms"]
    out = {}
    print(f"step bound: wkv {wkv / 1e6:.0f} MB read on one core in {rd:.2f} ms ({st['read_GBps']:.1f} GB/s)")
    for p in sorted(paths, key=_isa.ISA_NAMES.index):
        gbps = 2048 * E / pl[f"S1_{p}_ms"] / 1e6
        kern = wkv / gbps / 1e6  # ms: the kernel's own time over wkv at its cached rate
        t1, t2 = st[p]["step1_t1_ms"], st[p]["step1_t2_ms"]
        out[p] = {"kernel_cached_GBps": gbps, "kernel_ms": kern, "overlap_ms": max(kern, rd), "serial_ms": kern + rd,
                  "t1_ms": t1, "t2_ms": t2, "t2_floor_ms": max(kern / 2, rd), "t2_over_read": t2 / rd}
        print(f"  {p:<8} kernel {gbps:5.1f} GB/s cached ({kern:6.2f} ms over wkv); 1 thread {t1:6.2f} ms "
              f"(overlapped {max(kern, rd):6.2f}, in turn {kern + rd:6.2f}); 2 threads {t2:6.2f} ms = "
              f"{t2 / rd:.2f}x the read (floor {max(kern / 2, rd):.2f} ms: "
              f"{'the read' if rd >= kern / 2 else 'the kernel'})")
    return out


def choice_check(res, paths):
    """Whether the engine's choice (res["chosen"]: {op: (path, threads, why)}) is the fastest: per
    row, the chosen path's forced time vs the fastest path's (at the row's thread count); per
    engine operation, the unforced engine's time (the "chosen" contender) vs the fastest forced
    contender of every path and thread count. Each within GOAL: MET. Prints one line a check;
    returns them as dicts."""
    checks = []

    def check(row, op, chosen, t, best, tb, pr=None):
        r = t / tb
        c = {"row": row, "op": op, "chosen": chosen, "chosen_ms": t, "fastest": best, "fastest_ms": tb,
             "ratio": r, "paired_ratio": pr, "goal": f"<= {GOAL}x", "met": bool(r <= GOAL)}
        checks.append(c)
        print(f"  {row:<62s} chosen {chosen:<8s} {t:9.3f}  fastest {best:<8s} {tb:9.3f}  {r:5.2f}x "
              + (f"(paired {pr:5.2f}x)" if pr is not None else " " * 16)
              + f"  goal <= {GOAL}x  {'MET' if c['met'] else 'MISSED'}")

    def paired(sec, a, b):
        """The median of the per-round ratios of contenders a and b of section `sec` (None: not kept)."""
        sm = res.get(sec, {}).get("samples_ms", {})
        if a not in sm or b not in sm:
            return None
        return median([x / y for x, y in zip(sm[a], sm[b])])
    print(f"the choice (engine/tune.py) vs the fastest: within {GOAL}x; ratios of medians (paired: the median "
          f"of the per-round ratios), ms; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    rows = path_rows(res, paths)
    for name, op, th, v in rows:
        path = res["chosen"][op][0]
        if path not in v:
            print(f"  {name:<52s} chosen {path}: not measured (--paths)")
            continue
        best = min(v, key=v.get)
        sec, key = (("step", f"{'step1' if op == 'step' else 'step16'}_t{th}") if name.startswith("step") else
                    ("prefill", f"t{th}") if name.startswith("prefill") else (None, None))
        pr = paired(sec, f"{path}.{key}", f"{best}.{key}") if sec else None
        check(f"{name.rsplit(', ms', 1)[0]}: path", op, path, v[path], best, v[best], pr)
    st, pf = res.get("step"), res.get("prefill")
    engine_ops = []
    if st:
        engine_ops += [("step, one stream", "step", st["chosen"]["step1_ms"], "step1"),
                       ("step, 16 streams", "batch", st["chosen"]["step16_ms"], "step16")]
    if pf:
        engine_ops.append((f"prefill {pf['T']}", "prefill", pf["chosen"]["s"] * 1e3, None))
    for name, op, t, key in engine_ops:
        forced = {}
        for p in paths:
            for th in ((1, 2) if key else pf["counts"]):
                forced[f"{p}/{th}"] = st[p][f"{key}_t{th}_ms"] if key else pf[p][f"t{th}_s"] * 1e3
        best = min(forced, key=forced.get)
        path, threads, _ = res["chosen"][op]
        bp, bt = best.split("/")
        pr = (paired("step", f"chosen.{key}", f"{bp}.{key}_t{bt}") if key else
              paired("prefill", "chosen", f"{bp}.t{bt}"))
        check(f"{name}: unforced vs every path and count", op, f"{path}/{threads}", t, best, forced[best], pr)
    n_missed = sum(not c["met"] for c in checks)
    print(f"  {len(checks) - n_missed} of {len(checks)} MET" + (f", {n_missed} MISSED" if n_missed else ""))
    return checks


COLD = r"""
import json, sys, time
import numpy as np
from engram_stream import EngramModel
from engram_stream.io import memory  # (PYTHONPATH: the package checkout.use() chose)
d, steps = {d!r}, {steps}
for f in __import__("os").listdir(d):
    if f.endswith(".safetensors"):
        memory.evict_file(__import__("os").path.join(d, f))
model = EngramModel.from_deepseek_v41(d, mmap=True)
w = model.layer({L})
eng = model.stream({L})
bitmap = memory.track_rows(eng)
G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
rng = np.random.default_rng(2)
ids = rng.integers(0, V, steps)
hs = rng.standard_normal((8, G, D)).astype(np.float32)
out = np.empty((G, D), np.float32)
before = memory.proc_status()
t0 = time.perf_counter()
for t in range(steps):
    eng.step(int(ids[t]), hs[t % 8], out=out)
dt = time.perf_counter() - t0
after = memory.proc_status()
rows = int(np.unpackbits(bitmap).sum())
table = memory.resident_bytes(w.embed_weight) + memory.resident_bytes(w.embed_scale)
print(json.dumps({{"steps": steps, "ms_per_step": dt / steps * 1e3,
                  "rss_anon_growth_MB": (after["RssAnon"] - before["RssAnon"]) / 2**20,
                  "rss_file_growth_MB": (after["RssFile"] - before["RssFile"]) / 2**20,
                  "rows_touched": rows, "table_resident_MB": table / 2**20,
                  "table_pages_over_rows_x_4KiB": table / (rows * 4096)}}))
"""


def section_cold(d, steps):
    code = COLD.format(d=d, steps=steps, L=LAYER)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    if r.returncode:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/engram_v41_flash")
    ap.add_argument("--engram-vocab-size", type=int, default=200000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="step,plain,kernel,prefill,cold")
    ap.add_argument("--paths", default=",".join(reversed(_isa.supported_isas())),
                    help="kernel paths to measure (default: every one this CPU runs)")
    ap.add_argument("--json")
    add_busy_args(ap)
    a = ap.parse_args()
    paths = parse_paths(ap, a.paths)
    d = ensure_checkpoint(a.dir, a.engram_vocab_size)
    with busy_loops(a.busy, a.busy_cpu) as busy:  # (the checkpoint written without them)
        bench(a, paths, d, busy)


def bench(a, paths, d, busy):
    res = {"machine": machine(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "paths": paths,
           "loadavg_start": os.getloadavg(), **busy}
    print(json.dumps(res["machine"]))
    sections = a.sections.split(",")
    if "cold" in sections:  # first: nothing of the file is mapped by this process yet
        res["cold"] = section_cold(d, 300 if a.quick else 2000)
        print("cold", json.dumps(res["cold"]))
    model = EngramModel.from_deepseek_v41(d, mmap=True)
    # what an engine runs unforced: each operation's path and threads, and why (engine/tune.py)
    res["chosen"] = {op: list(v) for op, v in model.stream(LAYER).kernel_choice().items()}
    print("chosen", json.dumps(res["chosen"]))
    if "step" in sections:
        res["step"] = section_step(model, 9 if a.quick else 15, paths)
        print("step", json.dumps(res["step"]))
    if "plain" in sections:
        res["plain"] = section_plain(model, paths, 3 if a.quick else 7)
        print("plain", json.dumps(res["plain"]))
    if "kernel" in sections:
        res["kernel"] = section_kernel(model, paths, 3 if a.quick else 5)
        print("kernel", json.dumps(res["kernel"]))
    if "prefill" in sections:
        res["prefill"] = section_prefill(model, 256 if a.quick else 512, 3, paths)
        print("prefill", json.dumps(res["prefill"]))
    M, E = model.layer(LAYER).wkv_weight.shape
    res["wkv_rows_x_e"] = int(M) * int(E)
    res["step_bound"] = step_bound(res, paths, int(E))
    res["wider_path_loses"] = side_by_side(res, paths)
    res["choice_check"] = choice_check(res, paths)
    res["loadavg_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
