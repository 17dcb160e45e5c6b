"""engram-stream pack-rows: the packed row file beside a checkpoint (a missed row is one read), or
--verify of one."""
from __future__ import annotations

import os
import shutil
import time

from .common import CliError, counted, load_checkpoint
from .progress import progress_bar, size
from .sigterm import cleanup_on_sigterm


def register(command):
    s = command("pack-rows", run, "write the packed row file beside a checkpoint (one read per missed row)")
    s.add_argument("checkpoint", help="a model's Hugging Face folder (writes FOLDER/engram_rows.bin; a table whose "
                                      "parts lie in several files too) or a checkpoint file (writes FILE.rows)")
    s.add_argument("--force", action="store_true", help="write it again if it exists")
    s.add_argument("--verify", action="store_true", help="read an existing row file whole and compare it with the "
                                                        "checkpoint instead")
    s.add_argument("--quiet", action="store_true", help="print only the final line")


def run(args):
    """Write (or --verify) the packed row file beside a checkpoint: each row's bytes and scale
    adjacent, whole records per 4 KiB page, so a missed row is one read."""
    from ..rows import packed
    model = load_checkpoint(args.checkpoint)
    path = packed.rows_path(args.checkpoint)
    if args.verify:
        if not os.path.exists(path):
            raise CliError(f"{path}: no row file to verify (engram-stream pack-rows {args.checkpoint})")
        res = packed.verify_rows(model, path)
        for L, ok in res.items():
            print(f"layer {L}: {'OK' if ok else 'DIFFERS from the checkpoint'}")
        return 0 if all(res.values()) else 1
    if os.path.lexists(path) and not args.force:
        raise CliError(f"{path}: exists; pass --force to write it again (or --verify to check it)")
    bar = progress_bar(args.quiet)

    def before_write(total):
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        if total > free:
            raise CliError(f"{path}: needs {size(total)}, only {size(free)} free on its file system")
        if not args.quiet:
            print(f"writing {path}: {size(total)}", flush=True)

    t0 = time.perf_counter()
    with cleanup_on_sigterm():
        try:
            head = packed.pack_rows(model, path, progress=bar, before_write=before_write)
        finally:
            if bar is not None:
                bar.end()
    lay = next(iter(head["layers"].values()))
    print(f"wrote {path} ({size(head['size'])}, {counted(len(head['layers']), 'layer')}, {lay['rowbytes'] + lay['scalebytes']}"
          f"-byte records, {lay['per_group']} per page, verified) in {time.perf_counter() - t0:.1f} s")
    return 0
