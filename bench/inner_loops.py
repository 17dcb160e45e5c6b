"""Instructions per weight byte of the kernels' inner loops, from the disassembly, per path.

Where no timing can be trusted (qemu-user, or an aarch64 build on an x86 machine), the
instruction count of a hot loop per byte of weights it streams is the figure that compares
paths: the GEMVs are memory-bound on real hardware only if they issue few enough instructions
per byte. Each kernel of the headers' templates (include/engram_step_kern.h, engram_gemm_kern.h,
engram_fp8_kern.h, and the avx512 float8 code) is compiled into a wrapper of its own, for x86-64
with the host gcc and for aarch64 with aarch64-linux-gnu-gcc (when installed), with the flags of
setup.py (-O3); the loop taken is the wrapper's innermost loop with the most multiply-add lanes,
and the weight bytes one iteration consumes follow from those lanes (table KERNELS: bytes of
weight per lane). Nothing here runs the kernels.

    python bench/inner_loops.py            # both architectures (aarch64 when the cross gcc is there)
    python bench/inner_loops.py --arch x86_64
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHES = {"x86_64": ("gcc", "objdump", ("baseline", "avx2", "avx512", "bf16")),
          "aarch64": ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-objdump", ("baseline", "neon"))}
TARGET = {"baseline": "", "avx2": "ES_TARGET_AVX2", "avx512": "ES_TARGET_AVX512", "bf16": "ES_TARGET_BF16",
          "neon": "ES_TARGET_NEON"}

# kernel: (what it is, C body of the wrapper for path {S} (avx512 float8: its own code), weight
# bytes per multiply-add lane). The one-token GEMVs use each weight once (one lane a weight); the
# tiles broadcast a widened or float32 weight over many tokens or rows.
KERNELS = {
    "fp8 gemv (1 token)": (
        "es8_gemv_{S}(w, {GR}, q, E, y);", "1"),
    "fp8 widen rows (>8 tokens)": (
        "es8_widen_block_{S}(w, 32, E, 0, 256, q, y, 272);", None),
    "fp8 tile (>8 tokens)": (
        "es8_xtile_{S}(q, 272, {XR}, y, E * {VW}, {XV}, 256, y, 64, 1);", "1/tokens"),
    "demo f32 gemv (1 token)": (
        "es_gemv_f32_{S}(q, E, q, 16 * E, q, y);", "4"),
    "demo bf16 gemv (1 token)": (
        "es_gemv_bf16_{S}(q, E, (const uint16_t *)w, 16 * E, q, y);", "2"),
    "demo f32 tile (rows)": (
        "es_tile_f32_{S}(q, 1, {MR}, q, 16 * E, E, q, y, 64, 16 * {TP}, {MR}, {TP}, 0, 0, 1);", "4/rows"),
}
AVX512 = {"fp8 gemv (1 token)": "es8_gemv512(w, 4, q, E, y);",
          "fp8 widen rows (>8 tokens)": "es8_widen_rows(w, 32, E, q, y);",
          "fp8 tile (>8 tokens)": "es8_xtile_avx512(q, 12, y, E * 16, 2, 256, y, 64, 1, 0, 0, 0, 0);"}
# the bf16 path: its own one-token float8 GEMV (vdpbf16ps on the e4m3 bytes widened by vpermt2b);
# its other kernels are the avx512 path's
BF16 = {"fp8 gemv (1 token)": "__m512i t[4]; es8_bf16_tables(t); "
                              "es8_gemv_bf16(w, ES8_GR_BF16, (const uint16_t *)q, E, y, t);"}
# per path: (ES8_GR, ES8_XR, ES8_XV, ES_VW, ES_MR, ES_TP) as engram_fp8.h and engram_step.h set them
PARAMS = {"baseline": dict(GR=2, XR=6, XV=2, VW=4, MR=3, TP=1), "avx2": dict(GR=4, XR=6, XV=2, VW=8, MR=6, TP=1),
          "avx512": dict(GR=4, XR=12, XV=2, VW=16, MR=8, TP=2),
          "bf16": dict(GR=8, XR=12, XV=2, VW=16, MR=8, TP=2), "neon": dict(GR=2, XR=8, XV=2, VW=4, MR=6, TP=1)}

FMA = re.compile(r"^(vfmadd\d+ps|vdpbf16ps|fmla)$")


def source(arch: str) -> tuple:
    lines = ['#include "engram_fp8.h"', "#include <stdint.h>"]
    names = []
    for path in ARCHES[arch][2]:
        for i, (kernel, (body, _)) in enumerate(KERNELS.items()):
            if path == "bf16" and kernel not in BF16:
                continue
            if path == "bf16":
                body = BF16[kernel]
                attr = TARGET[path]
            elif path == "avx512" and kernel.startswith("fp8"):
                body = AVX512[kernel]
                attr = "ES_TARGET_AVX512"
            else:
                attr = TARGET[path]
            name = f"k{i}_{path}"
            names.append((kernel, path, name))
            lines.append(f"__attribute__((noinline)) {attr} void {name}(const uint8_t *w, const float *q, int E, float *y)"
                         f" {{ {body.format(S=path, **PARAMS[path])} }}")
    return "\n".join(lines) + "\n", names


def loops(dis: str, func: str) -> list:
    """The innermost loops of func: (instructions, mnemonic counts, multiply-add lanes)."""
    ins, inside = [], False
    for line in dis.splitlines():
        if line.endswith(">:"):
            inside = line.split("<", 1)[1][:-2] == func
            continue
        m = re.match(r"\s*([0-9a-f]+):\s+(\S+)\s*(.*)", line) if inside else None
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    at = {a: i for i, (a, _, _) in enumerate(ins)}
    back = []
    for i, (a, op, args) in enumerate(ins):
        m = re.search(r"\b([0-9a-f]+) <", args)
        if m and (op.startswith(("b", "j", "cb", "tb"))) and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            back.append((at[int(m.group(1), 16)], i))
    out = []
    for s, e in back:
        if any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in back):
            continue  # not innermost
        body = ins[s:e + 1]
        fma = sum(lane_count(op, args) for _, op, args in body if FMA.match(op) and "mul" not in op)
        mul = sum(lane_count(op, args) for _, op, args in body if op in ("mulps", "vmulps"))
        lanes = fma or mul  # SSE2 (the x86 baseline) multiplies, then adds
        out.append((len(body), collections.Counter(op for _, op, _ in body), lanes, body))
    return out


def lane_count(op: str, args: str) -> int:
    if op == "fmla":
        m = re.search(r"\.(\d+)s", args)
        return int(m.group(1)) if m else 1
    if "%zmm" in args:
        return 32 if op == "vdpbf16ps" else 16  # a pair of bf16 products a float32 lane
    if "%ymm" in args:
        return 8
    if "%xmm" in args:
        return 1 if op.endswith("ss") else 4
    return 1


def analyse(arch: str, tmp: str) -> list:
    cc, objdump, _ = ARCHES[arch]
    src, names = source(arch)
    c, o = os.path.join(tmp, f"k_{arch}.c"), os.path.join(tmp, f"k_{arch}.o")
    with open(c, "w") as f:
        f.write(src)
    subprocess.run([cc, "-O3", "-Wno-psabi", "-c", "-I", os.path.join(ROOT, "include"), c, "-o", o], check=True)
    dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", o], check=True, capture_output=True, text=True).stdout
    rows = []
    for kernel, path, name in names:
        found = loops(dis, name)
        per, p = KERNELS[kernel][1], PARAMS[path]
        if per is None:  # the widening: no multiply-add; the loop storing the most, 4 bytes a weight
            n, cnt, lanes, body = max(found, key=lambda lp: stored_bytes(lp[3], arch))
            wbytes, lanes = stored_bytes(body, arch) / 4, 0
        else:
            n, cnt, lanes, body = max(found, key=lambda lp: lp[2])
            if per == "1/tokens":  # a widened weight broadcast over the tile's tokens
                wbytes = lanes / (32 if path == "avx512" else p["VW"] * p["XV"])
            elif per == "4/rows":  # a float32 weight vector over the tile's rows
                wbytes = lanes * 4 / p["MR"]
            else:
                wbytes = lanes * int(per)
        rows.append((arch, path, kernel, n, lanes or "-", f"{wbytes:g}", f"{n / wbytes:.2f}",
                     f"{n / lanes:.2f}" if lanes else "-", spills(body, arch)))
    return rows


def stored_bytes(body, arch) -> int:
    """Bytes of vector registers stored by a loop body (not to the stack)."""
    total = 0
    for _, op, args in body:
        if "sp" in args.split(",")[-1] if arch == "aarch64" else "%rsp" in args:
            continue
        if arch == "aarch64" and op in ("str", "stp", "stur", "st1") and re.search(r"\bq\d+", args):
            total += 32 if op == "stp" else 16
        elif arch == "x86_64" and op.startswith(("vmovups", "vmovaps", "movups", "movaps")) and re.match(r"%[xyz]mm", args):
            total += {"x": 16, "y": 32, "z": 64}[args[1]]
    return total


def spills(body, arch) -> int:
    """Stores to the stack inside the loop: registers spilled."""
    if arch == "aarch64":
        return sum(op.startswith("st") and "[sp" in args for _, op, args in body)
    return sum(op.startswith(("vmov", "mov")) and re.search(r",\s*-?(0x[0-9a-f]+)?\(%rsp", args) is not None
               for _, op, args in body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHES), action="append", help="default: every one with a compiler")
    args = ap.parse_args(argv)
    arches = args.arch or [a for a in ARCHES if shutil.which(ARCHES[a][0]) and shutil.which(ARCHES[a][1])]
    print("| arch | path | loop | instructions / iteration | multiply-add lanes | weight bytes | instructions / weight byte"
          " | instructions / lane | stack stores |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in arches:
            for r in analyse(arch, tmp):
                print("| " + " | ".join(map(str, r)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
