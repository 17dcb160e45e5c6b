"""engram-stream publish: every layer's table rows into a Mooncake Store (EngramStore's layout)."""
from __future__ import annotations

import time

from .common import add_gguf, counted, load_checkpoint
from .progress import progress_bar


def register(command):
    s = command("publish", run, "a checkpoint's table rows into a Mooncake Store (EngramStore layout)")
    s.add_argument("checkpoint", help="a checkpoint written by save() or init")
    s.add_argument("--master", required=True, help="mooncake_master HOST:PORT")
    s.add_argument("--metadata", required=True, help="metadata server URL, e.g. http://HOST:8080/metadata")
    s.add_argument("--local-host", default="127.0.0.1", help="this client's address")
    s.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the store")
    s.add_argument("--quiet", action="store_true", help="no progress bar on a terminal")
    s.add_argument("--name", default=None,
                   help="the name in every key (default: a digest of the model's config and every table byte, so "
                        "models and revisions share a store; load with MooncakeTier(name=...) the same; \"\": "
                        "EngramStore's own engram:l{L}:h{h})")
    add_gguf(s)   # the GGUF's rows published as they are (quantized); readers take MooncakeTier(gguf=path)


def run(args):
    """Every layer's table rows into a Mooncake Store (EngramStore layout under a name: engram:{name}:l{L}:h{h})."""
    from ..rows import parse_tier, record_layout
    model = load_checkpoint(args.checkpoint, args.gguf)
    tier = parse_tier({"mooncake": dict(master=args.master, metadata=args.metadata, local_host=args.local_host,
                                        connect_timeout=args.connect_timeout, name=args.name)})
    inner = model.tables.inner   # a GGUF's records (its rows' own bytes), else the weights'
    layout = inner.record_layout if hasattr(inner, "record_layout") else lambda L: record_layout(model.layer(L))
    total = sum(model.plan.table_rows[L] * sum(layout(L)) for L in model.cfg.layer_ids)
    bar = progress_bar(args.quiet)   # one bar over both steps: the tables digested (read), then written
    t0 = time.perf_counter()
    try:
        n = tier.publish(model, digest_progress=None if bar is None else lambda done, _: bar(done, 2 * total),
                         progress=None if bar is None else lambda L, h, written: bar(total + written, 2 * total))
    finally:
        tier.close()
        if bar is not None:
            bar.end()
    dt = time.perf_counter() - t0
    # the name digests the tables: publish cached their digests (mapped tables), so this reads none
    print(f"published {counted(len(model.cfg.layer_ids), 'layer')} x {counted(model.cfg.n_heads, 'head')}, {n / 2**20:,.1f} MiB "
          f"in {dt:.2f} s to {args.master} under the name {tier.name_of(model)!r}")
    return 0
