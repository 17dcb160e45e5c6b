"""What every benchmark records beside its figures: the machine and the kernel path it ran on
(not part of the package; import after tools/checkout.py has chosen the engram_stream)."""
from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys


def machine(**extra) -> dict:
    """The CPU's model name, cores, Python, the kernel path running now, the paths this build and
    this CPU have, the load average; `extra` (e.g. library versions) added."""
    from engram_stream.engine import isa
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel_isa": isa.kernel_isa(), "paths_this_build_runs": isa.supported_isas(),
            "paths_the_cpu_has": isa.cpu_isas(), "loadavg": os.getloadavg(), **extra}


def add_busy_args(ap) -> None:
    """--busy N [--busy-cpu C]: the options of busy_loops()."""
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N busy loops (python -c 'while 1: pass') beside the benchmark: another process "
                         "taking some of a core (the thread splits must keep their gain)")
    ap.add_argument("--busy-cpu", type=int, default=None, metavar="C", help="pin the busy loops to CPU C")


@contextlib.contextmanager
def busy_loops(n: int, cpu: int | None = None):
    """n processes spinning in Python beside the benchmark (pinned to `cpu`, else where the
    scheduler puts them), started here and stopped by their PIDs when the block ends. Yields
    {"busy": n, "busy_cpu": cpu, "busy_pids": [...]} to record beside the figures."""
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"], preexec_fn=pin) for _ in range(n)]
    try:
        yield {"busy": n, "busy_cpu": cpu, "busy_pids": [p.pid for p in procs]}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def finish(res: dict, lines: list, json_path=None, note: str = "") -> None:
    """Prints a run's footer (the CPU, its cores, `note`, the load at the start and the end) and its
    table `lines`, kept in res["table"]; writes res as JSON to json_path when given."""
    import json
    res["table"] = lines
    print(f"\n{res['machine']['cpu']}, {res['machine']['cores']} cores{note}, load "
          f"{res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}")
    print("\n".join(lines))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
