"""Which kernel path runs: "bf16", "avx512", "avx2", "neon_bf16", "neon" (aarch64) or "baseline"
(include/engram_isa.h).

Every extension module carries each kernel compiled per instruction set; the path is one state
of the process, owned by engram_stream._hash (the kernel runtime every other extension binds at
import). At import the process's path is the best this CPU runs, or the one ENGRAM_STREAM_ISA
names (forced: refused if the CPU lacks it). Unless forced, each engine runs each operation on
the path and thread count measured fastest for it on this CPU (engine/tune.py; the process's
path is what runs untuned). use_isa() forces a path at run time: the tests run the kernels on
every path the machine supports.
"""
from __future__ import annotations

import os
import platform
import warnings

from .. import _hash
from ..errors import IsaEnvironmentError
from .cpu import CPUINFO, cpuinfo_blocks

ISA_NAMES = ("baseline", "avx2", "avx512", "bf16", "neon", "neon_bf16")  # index = the C level (ES_ISA_*)
ENV = "ENGRAM_STREAM_ISA"
_why = "the best this CPU runs"  # what chose the process's path (choice())


def supported_isas() -> tuple:
    """The paths this CPU and build run, slowest first."""
    return tuple(n for i, n in enumerate(ISA_NAMES) if _hash._isa_runs(i))


def runs_level(level: int) -> bool:
    """Whether this CPU and build run the C level `level` (an index of ISA_NAMES)."""
    return 0 <= level < len(ISA_NAMES) and _hash._isa_runs(level)


def process_level() -> int:
    """The C level of the process's path (what runs where no measured choice applies)."""
    return _hash._isa_get()


def kernel_isa() -> str:
    """The process's kernel path: one of ISA_NAMES (forced, or what
    an operation without a measured choice runs; choice() says why, and an engine's
    kernel_choice() names each operation's)."""
    return ISA_NAMES[_hash._isa_get()]


def forced() -> bool:
    """Whether one path is forced on every kernel (ENGRAM_STREAM_ISA, use_isa)."""
    return _hash._isa_forced()


def choice() -> tuple:
    """(kernel_isa(), why): why it is the process's path and whether the engines' measured
    choices apply."""
    if forced():
        return kernel_isa(), f"{_why}: every operation runs it"
    return kernel_isa(), f"{_why}; each engine operation runs the path measured fastest for it (engram-stream tune)"


def use_isa(name: str | None) -> None:
    """Force every kernel onto `name` (ValueError: unknown; RuntimeError: the CPU lacks it); None:
    no path forced, the best this CPU runs and the engines' measured choices apply again."""
    global _why
    if name is None:
        _hash._isa_set(_hash._isa_cpu_best(), False)
        _why = "the best this CPU runs"
        return
    if name not in ISA_NAMES:
        raise ValueError(f"unknown kernel ISA {name!r}: expected one of {', '.join(ISA_NAMES)}")
    if name not in supported_isas():
        raise RuntimeError(f"kernel ISA {name!r} is not supported by this CPU (or build): "
                           f"it runs {', '.join(supported_isas())}")
    if not _hash._isa_set(ISA_NAMES.index(name), True):
        raise RuntimeError(f"the kernel runtime cannot run kernel ISA {name!r}")
    _why = "forced by use_isa()"


# /proc/cpuinfo flags each path needs (as engram_isa.h's es_isa_cpu_best: AVX-512 F/BW/VL/DQ)
_CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                           "avx512vl", "avx512dq")}
_CPU_FLAGS["bf16"] = _CPU_FLAGS["avx512"] + ("avx512vbmi", "avx512_bf16")

_AT_HWCAP2, _HWCAP2_BF16 = 26, 1 << 14  # linux/auxvec.h, arm64's asm/hwcap.h


def aarch64_bf16(auxv: str = "/proc/self/auxv") -> bool:
    """Whether the kernel's AT_HWCAP2 for this process has HWCAP2_BF16 (ARMv8.6 BFDOT), as
    engram_isa.h's getauxval reads it (qemu-user answers for the CPU it emulates); False where
    the vector cannot be read."""
    try:
        with open(auxv, "rb") as f:
            raw = f.read()
    except OSError:
        return False
    words = memoryview(raw)[: len(raw) // 16 * 16].cast("Q")
    return any(words[i] == _AT_HWCAP2 and words[i + 1] & _HWCAP2_BF16 for i in range(0, len(words), 2))


def cpu_isas(cpuinfo: str = CPUINFO, machine: str | None = None, auxv: str = "/proc/self/auxv") -> tuple:
    """The paths this CPU has, whatever this build carries (a build without the x86 paths, e.g.
    by a compiler without target attributes, runs baseline on any CPU), from the kernel's CPU
    flags; ("baseline",) where they cannot be read. Every aarch64 CPU has neon (ASIMD), and
    under qemu-user /proc/cpuinfo describes the host, so aarch64 reads the auxiliary vector
    (`auxv`) for neon_bf16. machine: platform.machine() when None."""
    if (machine or platform.machine()).lower() in ("aarch64", "arm64"):
        return ("baseline", "neon") + (("neon_bf16",) if aarch64_bf16(auxv) else ())
    blocks = cpuinfo_blocks(cpuinfo)
    flags = set(blocks[0].get("flags", "").split()) if blocks else set()
    return ("baseline",) + tuple(n for n in ("avx2", "avx512", "bf16") if set(_CPU_FLAGS[n]) <= flags)


def default_isa() -> str:
    """The path the process runs when ENGRAM_STREAM_ISA is unset: the best this CPU and build run
    (which path is fastest for an operation is measured, per engine: engine/tune.py)."""
    return supported_isas()[-1]


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
    global _why
    name = os.environ.get(ENV, "").strip().lower()
    if not name:
        use_isa(None)
        return
    try:
        use_isa(name)
    except (ValueError, RuntimeError) as e:
        raise IsaEnvironmentError(f"{ENV}={os.environ[ENV]!r}: {e}; unset {ENV} (then {default_isa()} runs, the "
                                  f"best here) or set it to one this CPU runs: {', '.join(supported_isas())}") from None
    _why = f"forced by {ENV}"


_from_environment()
