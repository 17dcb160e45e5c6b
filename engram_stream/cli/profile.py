"""engram-stream profile: memray's count of a decode's heap allocations and where they were made, RSS and
table residency."""
from __future__ import annotations

import os
import time

import numpy as np

from .common import CliError, add_gguf, at_least, builtin_model, check_output, counted, load_checkpoint
from .progress import size


def register(command):
    s = command("profile", run, "memray heap, RSS and table residency of a decode")
    s.add_argument("checkpoint", nargs="?", help="checkpoint to decode from (default: the built-in demo model)")
    s.add_argument("--steps", type=at_least(1), default=500, help="tokens to decode")
    s.add_argument("--seed", type=at_least(0), default=0, help="seed of the ids (and of the demo model)")
    s.add_argument("--cold", action="store_true",
                   help="evict the checkpoint from the page cache first: a cold start, rows read from disk")
    s.add_argument("-o", "--output", metavar="CAPTURE.bin", help="keep the memray capture in this file")
    s.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    add_gguf(s)


def run(args):
    """memray the heap of a decode, and report RSS and table residency."""
    try:
        import memray
    except ImportError:
        raise CliError("profile needs memray: pip install memray") from None
    import tempfile

    from ..io import memory
    if args.cold and not args.checkpoint:
        raise CliError("--cold needs a checkpoint (the built-in model lives in RAM)")
    capture = check_output(args.output, args.force, inputs=[args.checkpoint]) if args.output else None
    if args.gguf and not args.checkpoint:
        raise CliError(f"--gguf {args.gguf}: give the checkpoint whose tables it holds")
    model = load_checkpoint(args.checkpoint, args.gguf) if args.checkpoint else builtin_model(args)
    evicted = memory.evict(model) if args.cold else []  # every file it maps: a folder's shards, the row file
    cfg = model.cfg
    G, D = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(args.seed)
    dec = model.decoder()
    e0 = dec.engines[cfg.layer_ids[0]]
    h = None if e0.input_layer else rng.standard_normal((G, D), dtype=np.float32)
    out = np.empty(e0.out_shape(), np.float32)
    ids = rng.integers(0, cfg.vocab_size, size=args.steps)
    resident = {L: memory.resident_bytes(model.layer(L).table) for L in cfg.layer_ids}
    before = memory.proc_status()
    with tempfile.TemporaryDirectory() as tmp:
        path = capture or os.path.join(tmp, "decode.bin")
        if capture and os.path.lexists(capture):
            os.unlink(capture)  # --force given (checked above); memray refuses to overwrite
        t0 = time.perf_counter()
        with memray.Tracker(path):
            for t in range(args.steps):
                dec.begin(int(ids[t]))
                for L in cfg.layer_ids:
                    dec.layer(L, h, out=out)
        dt = time.perf_counter() - t0
        reader = memray.FileReader(path)
        peak, total = reader.metadata.peak_memory, reader.metadata.total_allocations
        sites = _allocation_sites(reader)
    after = memory.proc_status()
    print(f"decoded {counted(args.steps, 'token')} x {counted(len(cfg.layer_ids), 'layer')} in {dt:.2f} s (under memray)"
          + (f", cold start: {len(evicted)} file{'s' * (len(evicted) != 1)} evicted from the page cache first"
             if args.cold else ""))
    n_calls = args.steps * (1 + len(cfg.layer_ids))
    print(f"heap: {total} allocation{'s' * (total != 1)} during the decode loop ({n_calls} calls: begin and "
          f"{len(cfg.layer_ids)} layer calls a token), {total / args.steps:.3g} a token; at most "
          f"{_bytes(peak)} held at once")
    print("  (memray: the process's native allocations between the loop's start and end, the engines built "
          "before it; Python's small-object allocator is not traced. A count that grows with --steps is "
          "allocated per token; one that stays the same is not)")
    for where, (count, nbytes) in sites[:3]:
        print(f"  {count} allocation{'s' * (count != 1)}, {_bytes(nbytes)}: {where}")
    for k, what in (("RssAnon", "anonymous memory: heap and arrays"),
                    ("RssFile", "mapped file pages: an mmap table's rows as they come in")):
        print(f"{k}: {before.get(k, 0) / 2**20:,.1f} -> {after.get(k, 0) / 2**20:,.1f} MiB ({what})")
    for L in cfg.layer_ids:
        t = model.layer(L).table
        print(f"layer {L}: table {t.nbytes / 2**20:,.1f} MiB, resident {resident[L] / 2**20:,.1f} -> "
              f"{memory.resident_bytes(t) / 2**20:,.1f} MiB (in RAM or the page cache; mincore)")
    if capture:
        print(f"memray capture: {capture} (memray stats / memray flamegraph {capture})")
    return 0


def _bytes(n) -> str:
    return f"{n} bytes" if n < 2**10 else f"{n / 2**10:,.1f} KiB" if n < 2**20 else size(n)


def _allocation_sites(reader, limit=100_000):
    """[(where, (allocations, bytes))] of a memray capture, most allocations first: where is the
    innermost Python frame ("file:line function"), so the profile names what allocated."""
    import memray
    freeing = {memray.AllocatorType.FREE, memray.AllocatorType.PYMALLOC_FREE, memray.AllocatorType.MUNMAP}
    sites = {}
    for k, rec in enumerate(reader.get_allocation_records()):
        if k >= limit:
            break
        if rec.allocator in freeing:
            continue
        frames = rec.stack_trace(max_stacks=1)
        where = f"{frames[0][1]}:{frames[0][2]} {frames[0][0]}" if frames else "no Python frame (a native thread)"
        count, nbytes = sites.get(where, (0, 0))
        sites[where] = (count + rec.n_allocations, nbytes + rec.size)
    return sorted(sites.items(), key=lambda kv: -kv[1][0])
