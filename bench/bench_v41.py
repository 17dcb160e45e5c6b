#!/usr/bin/env python
"""The deepseek-v4.1 engine at Flash dims (one layer: hidden 5120, hc 4, 24 x 256 rows,
wkv [25600, 6144] float8), table rows scaled down, from a synthetic checkpoint in the HF layout.

    flock /tmp/bench.lock python bench/bench_v41.py                # ~1.3 GB table, all sections
    flock /tmp/bench.lock python bench/bench_v41.py --quick        # fewer repetitions / tokens

Sections (every ratio is measured side by side in one run; the machine is shared, so absolute
times are indicative only):
  step      one-stream step vs reading the 157 MB of wkv once (same process, rounds interleaved);
            16 streams per token vs one stream, step_threads 1 and 2  goals <= 1.5x, <= 1/6
  kernel    the float8 projection alone (fp8_linear, one thread) at 16 and 256 tokens: GFLOP/s
            against the native single-core sgemm peak (bench_step.native_sgemm_peak: numpy's
            OpenBLAS with its own kernel, in a subprocess)
  prefill   eng.prefill on 2048 tokens vs a torch CPU implementation of the reference module
            with dequantized weights, all cores                    goal  >= 3x faster
            and vs the FMA floor: its projection FLOPs at cores x the native sgemm peak
  cold      a fresh process maps the checkpoint (its pages evicted first), 2000 decode steps:
            private memory growth (RssAnon) and table pages mapped vs rows touched x 4 KiB
                                                                   goals <= 64 MB, <= 2x
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout (in-place build)

from engram_stream import EngramModel, hf_v41, store  # noqa: E402
from engram_stream import _engine_v41 as k  # noqa: E402

LAYER = 1


def machine():
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from engram_stream import _isa
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel_isa": _isa.kernel_isa(), "paths_this_build_runs": _isa.supported_isas(),
            "paths_the_cpu_has": _isa.cpu_isas()}


def ensure_checkpoint(d, evs):
    if not os.path.isfile(os.path.join(d, "config.json")):
        cfg = hf_v41.flash_config(engram_vocab_size=evs, engram_layer_ids=[LAYER])
        t0 = time.perf_counter()
        hf_v41.make_synthetic(d, cfg, seed=0, n_shards=2, tokenizer=False, decoys=False)
        print(f"wrote {d} in {time.perf_counter() - t0:.0f} s")
    return d


def median(xs):
    return float(np.median(np.asarray(xs)))


def section_step(model, reps):
    w = model.layer(LAYER)
    wkv = w.wkv_weight.reshape(-1)
    G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
    rng = np.random.default_rng(0)
    e1 = model.stream(LAYER)
    e16 = {n: model.stream(LAYER, n_streams=16) for n in (1, 2)}  # by step_threads
    for n, e in e16.items():
        e.step_threads = n
    h1 = rng.standard_normal((G, D)).astype(np.float32)
    h16 = rng.standard_normal((16, G, D)).astype(np.float32)
    o1, o16 = np.empty_like(h1), np.empty_like(h16)
    k.read_bytes(wkv)  # map every page of wkv before timing
    for a in (w.embed_weight, w.embed_scale):  # and of the table: random rows, not disk reads
        k.read_bytes(np.asarray(a).reshape(-1))  # (the cold section evicted the shards)
    for _ in range(3):
        e1.step(int(rng.integers(V)), h1, out=o1)
        for e in e16.values():
            e.step(rng.integers(0, V, 16), h16, out=o16)
    t_read, t_one, t_16 = [], [], {n: [] for n in e16}
    for _ in range(reps):  # interleaved rounds: all see the same machine state
        t0 = time.perf_counter()
        k.read_bytes(wkv)
        t_read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        e1.step(int(rng.integers(V)), h1, out=o1)
        t_one.append(time.perf_counter() - t0)
        for n, e in e16.items():
            t0 = time.perf_counter()
            e.step(rng.integers(0, V, 16), h16, out=o16)
            t_16[n].append(time.perf_counter() - t0)
    r, one = median(t_read), median(t_one)
    res = {"wkv_bytes": int(wkv.nbytes), "read_ms": r * 1e3, "read_GBps": wkv.nbytes / r / 1e9,
           "step1_ms": one * 1e3, "step1_over_read": one / r, "reps": reps}
    for n in e16:
        s16 = median(t_16[n])
        res[f"step16_threads{n}_ms"] = s16 * 1e3
        res[f"per_token16_threads{n}_over_step1"] = s16 / 16 / one
    return res


def native_sgemm_peak():
    """bench_step.native_sgemm_peak (GFLOP/s of one core), imported without its side effect on
    this process's environment (it pins OPENBLAS_NUM_THREADS at import)."""
    env = dict(os.environ)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import bench_step
    finally:
        os.environ.clear()
        os.environ.update(env)
    return bench_step.native_sgemm_peak()


def section_kernel(model, peak, reps):
    """fp8_linear (activation quantization + the projection), one thread, on the layer's wkv."""
    w = model.layer(LAYER)
    W, WS = np.asarray(w.wkv_weight), np.asarray(w.wkv_scale)
    M, E = W.shape
    rng = np.random.default_rng(3)
    res = {"native_sgemm_peak_GFLOPs": peak}
    for S in (16, 256):
        x = rng.standard_normal((S, E)).astype(np.float32)
        k.fp8_linear(x, W, WS, threads=1)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            k.fp8_linear(x, W, WS, threads=1)
            ts.append(time.perf_counter() - t0)
        g = 2 * M * E * S / median(ts) / 1e9
        res[f"S{S}_GFLOPs"] = g
        res[f"S{S}_over_peak"] = g / peak
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


def section_prefill(model, T, reps, peak):
    G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, T)
    hidden = rng.standard_normal((T, G, D)).astype(np.float32)
    rows = model.plan.hash(ids[None], layers=[LAYER])[LAYER][0] + model.layer(LAYER).offsets
    dead = model.plan.dead_mask(ids)
    cores = os.cpu_count() or 1
    eng = model.stream(LAYER)
    eng.prefill_threads = cores
    out = np.empty_like(hidden)
    t_ours, t_torch, want = [], [], None
    for _ in range(reps):
        eng.reset()
        t0 = time.perf_counter()
        eng.prefill(ids, hidden, out=out)
        t_ours.append(time.perf_counter() - t0)
        try:
            want, t = torch_reference(model, rows, hidden, cores)
            t_torch.append(t)
        except ImportError:
            pass
    res = {"T": T, "threads": cores, "ours_s": median(t_ours), "reps": reps}
    M, E = model.layer(LAYER).wkv_weight.shape
    floor = 2 * M * E * T / (cores * peak * 1e9)  # the projection at every core's native sgemm peak
    res.update(fma_floor_s=floor, ours_over_floor=median(t_ours) / floor)
    if t_torch:
        want[dead] = 0
        err = np.abs(out - want) - (2e-5 + 2e-4 * np.abs(want))
        res.update(torch_s=median(t_torch), speedup=median(t_torch) / median(t_ours),
                   agree=bool(err.max() <= 0), max_abs_diff=float(np.abs(out - want).max()))
    return res


COLD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from engram_stream import EngramModel, store
d, steps = {d!r}, {steps}
for f in __import__("os").listdir(d):
    if f.endswith(".safetensors"):
        store.evict_file(__import__("os").path.join(d, f))
model = EngramModel.from_deepseek_v41(d, mmap=True)
w = model.layer({L})
eng = model.stream({L})
bitmap = store.track_rows(eng)
G, D, V = model.cfg.hc_mult, model.cfg.hidden_size, model.cfg.vocab_size
rng = np.random.default_rng(2)
ids = rng.integers(0, V, steps)
hs = rng.standard_normal((8, G, D)).astype(np.float32)
out = np.empty((G, D), np.float32)
before = store.proc_status()
t0 = time.perf_counter()
for t in range(steps):
    eng.step(int(ids[t]), hs[t % 8], out=out)
dt = time.perf_counter() - t0
after = store.proc_status()
rows = int(np.unpackbits(bitmap).sum())
table = store.resident_bytes(w.embed_weight) + store.resident_bytes(w.embed_scale)
print(json.dumps({{"steps": steps, "ms_per_step": dt / steps * 1e3,
                  "rss_anon_growth_MB": (after["RssAnon"] - before["RssAnon"]) / 2**20,
                  "rss_file_growth_MB": (after["RssFile"] - before["RssFile"]) / 2**20,
                  "rows_touched": rows, "table_resident_MB": table / 2**20,
                  "table_pages_over_rows_x_4KiB": table / (rows * 4096)}}))
"""


def section_cold(d, steps):
    code = COLD.format(root=ROOT, d=d, steps=steps, L=LAYER)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    if r.returncode:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/engram_v41_flash")
    ap.add_argument("--engram-vocab-size", type=int, default=200000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="step,kernel,prefill,cold")
    ap.add_argument("--json")
    a = ap.parse_args()
    d = ensure_checkpoint(a.dir, a.engram_vocab_size)
    res = {"machine": machine(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    print(json.dumps(res["machine"]))
    sections = a.sections.split(",")
    if "cold" in sections:  # first: nothing of the file is mapped by this process yet
        res["cold"] = section_cold(d, 300 if a.quick else 2000)
        print("cold", json.dumps(res["cold"]))
    model = EngramModel.from_deepseek_v41(d, mmap=True)
    peak = None
    if "kernel" in sections or "prefill" in sections:
        peak = native_sgemm_peak()
    if "step" in sections:
        res["step"] = section_step(model, 10 if a.quick else 30)
        print("step", json.dumps(res["step"]))
    if "kernel" in sections:
        res["kernel"] = section_kernel(model, peak, 3 if a.quick else 7)
        print("kernel", json.dumps(res["kernel"]))
    if "prefill" in sections:
        res["prefill"] = section_prefill(model, 256 if a.quick else 2048, 1 if a.quick else 2, peak)
        print("prefill", json.dumps(res["prefill"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
