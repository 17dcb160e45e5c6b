"""engram-stream tune: every kernel path and thread count timed on a model's shapes, the fastest cached."""
from __future__ import annotations

from .common import add_gguf, at_least, cpu, kernels, load_model
from .progress import Steps


def register(command):
    s = command("tune", run, "time every kernel path and thread count this CPU runs on a model's shapes "
                                  "and keep the fastest (cached per CPU and build)")
    s.add_argument("checkpoint", nargs="?", help="tune for this model: a checkpoint file or a model's Hugging Face "
                                                 "folder (default: the built-in demo model)")
    s.add_argument("--layer", type=int, default=None, help="the Engram layer to time (default: the first)")
    s.add_argument("--seed", type=at_least(0), default=0, help="seed of the built-in model's weights")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_gguf(s)


def run(args):
    """Measure every kernel path this CPU runs and every thread count on the model's shapes (the
    step, the batched step, the prefill), keep the fastest in the user's tuning cache, print the table."""
    from ..engine import isa, tune
    steps = Steps(args.quiet)
    model = load_model(args, steps)
    L = model.cfg.layer_ids[0] if args.layer is None else model.plan.check_layer(args.layer)
    steps(f"measuring {', '.join(isa.supported_isas()) if not isa.forced() else isa.kernel_isa()} x threads "
          f"{', '.join(map(str, tune.thread_counts(tune.cores())))} on layer {L}")
    table = tune.table_for(model, L, retune=True)
    print(f"model: {tune.shape_key(model)} ({args.checkpoint or 'the built-in model'}, layer {L})")
    print(f"cpu: {cpu()}")
    print(f"kernels: {kernels()}")
    print(f"operations: step = 1 stream, batch = {tune.BATCH_STREAMS} streams, prefill = {tune.PREFILL_TOKENS}-"
          f"{tune.PREFILL_MAX} tokens (as many as take {tune.PREFILL_RUN * 1e3:g} ms); per path/threads the best of "
          f"{tune.REPEATS}+ runs ({tune.MIN_SECONDS * 1e3:g} ms at least; one when runs take "
          f"{tune.LONG_RUN * 1e3:g} ms), the fastest first; within {tune.TIE:.0%} of it the fewest "
          f"threads is chosen; a first stream() measures within {tune.TIME_BUDGET:g} s, this command all")
    print(tune.format_table(table))
    if isa.forced():
        print(f"(a forced path was measured alone: not cached; unset {isa.ENV} to measure them all)")
    else:
        print(f"cached: {tune.cache_path()}")
    return 0
