"""Which kernel path runs: "bf16", "avx512", "avx2", "neon" (aarch64) or "baseline" (include/engram_isa.h).

Every extension module carries each kernel compiled per instruction set and a selector
of its own; this module keeps them all on one path. At import the path is the best the
CPU runs (bf16 only on the CPUs of BF16_FASTER, where it measured faster than avx512), or
the one ENGRAM_STREAM_ISA names (refused if the CPU lacks it). use_isa() switches at run
time: the tests run the kernels on every path the machine supports.
"""
from __future__ import annotations

import os
import platform
import warnings

from .. import _hash
from ..errors import IsaEnvironmentError

ISA_NAMES = ("baseline", "avx2", "avx512", "bf16", "neon")  # index = the C level (ES_ISA_*)
ENV = "ENGRAM_STREAM_ISA"
_modules = [_hash]  # every extension with dispatched kernels: each engine module calls register() at import


def supported_isas() -> tuple:
    """The paths this CPU and build run, slowest first."""
    return tuple(n for i, n in enumerate(ISA_NAMES) if _hash._isa_runs(i))


def kernel_isa() -> str:
    """The path the kernels run now: "bf16", "avx512", "avx2", "neon" or "baseline"."""
    return ISA_NAMES[_hash._isa_get()]


def use_isa(name: str) -> None:
    """Run every extension's kernels on `name` (ValueError: unknown; RuntimeError: the CPU lacks it)."""
    if name not in ISA_NAMES:
        raise ValueError(f"unknown kernel ISA {name!r}: expected one of {', '.join(ISA_NAMES)}")
    if name not in supported_isas():
        raise RuntimeError(f"kernel ISA {name!r} is not supported by this CPU (or build): "
                           f"it runs {', '.join(supported_isas())}")
    level = ISA_NAMES.index(name)
    for m in _modules:
        if not m._isa_set(level):
            raise RuntimeError(f"{m.__name__} cannot run kernel ISA {name!r}")


def register(module) -> None:
    """Keep another extension (with _isa_set(level) -> bool) on the same path from now on."""
    if module not in _modules:
        _modules.append(module)
    if not module._isa_set(ISA_NAMES.index(kernel_isa())):
        raise RuntimeError(f"{module.__name__} cannot run kernel ISA {kernel_isa()!r}")


# /proc/cpuinfo flags each path needs (as engram_isa.h's es_isa_cpu_best: AVX-512 F/BW/VL/DQ)
_CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                           "avx512vl", "avx512dq")}
_CPU_FLAGS["bf16"] = _CPU_FLAGS["avx512"] + ("avx512vbmi", "avx512_bf16")

# (vendor_id, cpu family) of /proc/cpuinfo where the bf16 path measured faster than avx512
# (bench/bench_v41.py, its rows side by side), so it is the default there; elsewhere avx512
# stays the default and ENGRAM_STREAM_ISA=bf16 asks for it.
BF16_FASTER = {
    # Zen 5 (EPYC, 2 vCPUs, bench_v41.py, three runs, load 0.2-5.9): bf16 / avx512 time, step
    # 0.56-1.03x, 16 streams 0.45-0.59x, prefill 512 0.56-0.59x; its vdpbf16ps peak ~1.9x vfmadd zmm's
    ("AuthenticAMD", 26): "AMD Zen 5",
}


def cpu_isas(cpuinfo: str = "/proc/cpuinfo", machine: str | None = None) -> tuple:
    """The paths this CPU has, whatever this build carries (a build without the x86 paths, e.g.
    by a compiler without target attributes, runs baseline on any CPU), from the kernel's CPU
    flags; ("baseline",) where they cannot be read. Every aarch64 CPU has neon (ASIMD), and
    under qemu-user /proc/cpuinfo describes the host, so aarch64 does not read it. machine:
    platform.machine() when None."""
    if (machine or platform.machine()).lower() in ("aarch64", "arm64"):
        return ("baseline", "neon")
    try:
        with open(cpuinfo) as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        flags = set()
    return ("baseline",) + tuple(n for n in ("avx2", "avx512", "bf16") if set(_CPU_FLAGS[n]) <= flags)


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> tuple:
    """(vendor_id, cpu family) of the first processor in /proc/cpuinfo; ("", -1) where unread."""
    vendor, family = "", -1
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "cpu family" and family < 0:
                    family = int(value.strip()) if value.strip().isdigit() else -1
                elif not line.strip() and vendor:
                    break
    except OSError:
        pass
    return vendor, family


def default_isa() -> str:
    """The path chosen when ENGRAM_STREAM_ISA is unset: the best this CPU and build run, but
    bf16 only on a CPU of BF16_FASTER (else avx512)."""
    best = supported_isas()[-1]
    if best == "bf16" and cpu_model() not in BF16_FASTER:
        return "avx512"
    return best


_warned = False


def warn_if_slower_than_cpu(what: str) -> bool:
    """Warn once per process (warnings.warn) when `what` runs the baseline path on a CPU that has
    a faster one this build lacks. Returns whether it warned now."""
    global _warned
    faster = [n for n in cpu_isas() if n != "baseline" and n not in supported_isas()]
    if _warned or kernel_isa() != "baseline" or not faster:
        return False
    _warned = True
    warnings.warn(f"{what} runs its portable baseline kernels: this CPU has {faster[-1]}, which this build of "
                  f"engram_stream lacks (built without the vector paths: GCC or clang on x86-64 or aarch64 "
                  f"builds them)",
                  RuntimeWarning, stacklevel=2)
    return True


def _from_environment() -> None:
    name = os.environ.get(ENV, "").strip().lower()
    if not name:
        use_isa(default_isa())
        return
    try:
        use_isa(name)
    except (ValueError, RuntimeError) as e:
        raise IsaEnvironmentError(f"{ENV}={os.environ[ENV]!r}: {e}; unset {ENV} (then {default_isa()} runs, the "
                                  f"best here) or set it to one this CPU runs: {', '.join(supported_isas())}") from None


_from_environment()
