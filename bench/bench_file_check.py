"""What the changed-file check (one fstat before every call reads a mapped table) costs a decode step.

    python bench/bench_file_check.py            # small dims (D=256: the check weighs most)
    options: --steps N (20000)  --rounds R (7)  --hidden D (256)

A model loaded with mmap=True checks its file (one fstat: size, inode, mtime) before every
step. Three engines over warm tables, rounds rotating their order, medians compared:
  mmap (checked)     the loaded model;
  mmap (unchecked)   the same mapped pages through a view the engine cannot trace to the
                     file (a ctypes buffer), so no check: checked/unchecked is the check's cost;
  RAM                the model loaded with mmap=False (anonymous pages, no file).
The fstat alone is timed too (os.fstat from Python, an upper bound of the C call's cost).
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import checkout  # noqa: E402  (this checkout when built in place, else the installed package)
checkout.use()
from _lib.small_step import rotating_rounds, setup, step_us  # noqa: E402


def main():
    args, cfg, ids, h, out = setup(__doc__, 20000, 7)
    from engram_stream import EngramModel
    from engram_stream.io import files
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.safetensors")
        EngramModel.init(cfg, seed=0).save(path)
        mapped, ram = EngramModel.load(path, mmap=True), EngramModel.load(path, mmap=False)
        assert files.file_check(mapped.layer(1).table) is not None
        assert files.file_check(ram.layer(1).table) is None
        t = mapped.layer(1).table
        pages = np.frombuffer((ctypes.c_char * t.nbytes).from_address(t.ctypes.data), t.dtype).reshape(t.shape)
        blind = EngramModel(cfg, mapped.plan, {1: mapped.layer(1).replace(cfg, table=pages)})
        assert files.file_check(blind.layer(1).table) is None
        # One packed copy of the weights for all three: its 64-byte alignment, which numpy's
        # allocator leaves to chance (0/16/32/48), changed step times more than the check.
        for m in (blind, ram):
            m.layer(1)._packed = mapped.layer(1).packed()
        engines = {"mmap (checked)": mapped.stream(1), "mmap (unchecked)": blind.stream(1),
                   "RAM (no file)": ram.stream(1)}
        for e in engines.values():  # warm: every row the run reads is in the page cache
            step_us(e, ids, h, out)
        times = rotating_rounds(engines, ids, h, out, args.rounds)
        fd = os.open(path, os.O_RDONLY)
        n = 200000
        t0 = time.perf_counter()
        for _ in range(n):
            os.fstat(fd)
        fstat_us = (time.perf_counter() - t0) / n * 1e6
        os.close(fd)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"D={cfg.hidden_size} G={cfg.hc_mult} H={cfg.n_heads}x{cfg.head_dim}, {args.steps} steps x {args.rounds} rounds")
    for k, v in times.items():
        print(f"  {k:17s} median {med[k]:7.2f} us/step  (min {min(v):.2f}, max {max(v):.2f})")
    print(f"  ratio checked/unchecked {med['mmap (checked)'] / med['mmap (unchecked)']:.3f}, "
          f"checked/RAM {med['mmap (checked)'] / med['RAM (no file)']:.3f}")
    print(f"  os.fstat from Python: {fstat_us:.2f} us")


if __name__ == "__main__":
    main()
