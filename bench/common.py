"""What every benchmark records beside its figures: the machine and the kernel path it ran on
(not part of the package; import after tools/checkout.py has chosen the engram_stream)."""
from __future__ import annotations

import os
import platform


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
