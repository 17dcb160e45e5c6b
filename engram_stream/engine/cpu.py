"""The CPU as the kernel describes it: /proc/cpuinfo read in one place. isa.cpu_isas reads the
flags (which kernel paths this CPU runs), tune.cpu_identity the identifying fields (the key of
measured choices), the commands the model name they print beside every figure."""
from __future__ import annotations

CPUINFO = "/proc/cpuinfo"


def cpuinfo_blocks(path: str = CPUINFO) -> list:
    """The file's blocks, blank-line separated, as dicts {field: value with its whitespace
    collapsed}: one a processor, the first first; some aarch64 kernels end with a block naming
    the board ("Hardware", "Model"). [] when the file cannot be read (not Linux, no /proc)."""
    blocks, block = [], {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if block:
                        blocks.append(block)
                    block = {}
                    continue
                k, _, v = line.partition(":")
                block.setdefault(k.strip(), " ".join(v.split()))
    except OSError:
        return []
    if block:
        blocks.append(block)
    return blocks


def cpu_model(blocks) -> str | None:
    """The CPU's model name from cpuinfo_blocks: "model name" (x86) or "Model" (some aarch64
    boards, in the board's block), the first given; None when no block names it."""
    return next((b[k] for b in blocks for k in ("model name", "Model") if b.get(k)), None)
