"""The engram-stream command: demo, inspect, init, build-compression, bench, profile, publish, pack-rows.

Errors print one line (`engram-stream: error: ...`) and exit 1 (bad arguments: argparse's
usage line and exit 2; an ENGRAM_STREAM_ISA that `import engram_stream` refuses: one line and exit
2 too, from the console script, _engram_stream_launcher.py); --debug, anywhere on the line, shows
the traceback instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
import warnings

import numpy as np

from . import __version__
from . import variants
from .config import EngramConfig, known_fields, variant_fields
from .errors import ConfigKeyWarning

BUILTIN_CONFIG = dict(engram_vocab_size=[20011, 20011], max_ngram_size=3, n_embed_per_ngram=128,
                   n_head_per_ngram=4, layer_ids=[1, 15], pad_id=2, seed=0, kernel_size=4,
                   hidden_size=256, hc_mult=4, vocab_size=32000)


WARMUP_TOKENS = 32   # demo: untimed tokens before the timed decode


class CliError(Exception):
    """A user-facing error: printed as one line."""


def _n(count, word) -> str:
    """"1 layer", "2 layers": a count and its word."""
    return f"{count} {word}{'s' * (count != 1)}"


def _builtin_model(args):
    from .model import EngramModel
    cfg = EngramConfig(**BUILTIN_CONFIG)
    return EngramModel.init(cfg, seed=args.seed)


def _kernels():
    """The kernel path that runs, what else this build and CPU offer (engram_stream.engine.isa)."""
    from .engine import isa
    (run, why), built, cpu = isa.choice(), isa.supported_isas(), isa.cpu_isas()
    note = [why, f"{', '.join(built)} in this build on this CPU"]
    missing = [n for n in cpu if n not in built]
    if missing:
        note.append(f"the CPU also has {', '.join(missing)}, which this build lacks")
    return f"{run} ({'; '.join(note)}; {isa.ENV} forces one)"


def _engine_choice(engine) -> str:
    """Each operation's kernel path and threads in `engine`, and why (EngineBase.kernel_choice)."""
    return "; ".join(f"{op} {p}/{n} thread{'s' * (n != 1)} ({why})" for op, (p, n, why) in engine.kernel_choice().items())


def _cpu() -> str:
    """The CPU model ("model name" in /proc/cpuinfo, else what the platform module knows) and the
    CPUs this process may run on: every figure the commands print depends on both."""
    import platform
    from .engine.cpu import cpu_model, cpuinfo_blocks
    name = cpu_model(cpuinfo_blocks())
    name = name or platform.processor() or "unknown model"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({platform.machine()}, {usable} CPU{'s' * (usable != 1)} usable)"


class _Steps:
    """One stderr line as each long step starts (loading, warming up, decoding, checking), so a
    command that runs for seconds says what it waits for; stdout keeps the results only."""

    def __init__(self, quiet=False):
        self.quiet = quiet

    def __call__(self, what):
        if not self.quiet:
            print(f"{what} ...", file=sys.stderr, flush=True)


def _load_for(args, steps):
    """The model a demo or bench runs: --checkpoint (mapped), else the built-in one."""
    from .model import EngramModel
    if args.checkpoint:
        _not_a_config(args.checkpoint)
        variant = next((v for v in variants.variants() if v.is_checkpoint(args.checkpoint)), None)
        note = variant.load_note if variant is not None else ""  # what its load does besides mapping
        steps(f"loading {args.checkpoint} (tables mapped" + (f"; {note})" if note else ")"))
        return EngramModel.load(args.checkpoint, mmap=True)
    steps("building the built-in model (random weights)")
    return _builtin_model(args)


def cmd_demo(args):
    """Decode tokens through every layer's streaming engine and check them against the batch path
    (the built-in model, or --checkpoint: a checkpoint file or a model's Hugging Face folder)."""
    steps = _Steps(args.quiet)
    model = _load_for(args, steps)
    cfg = model.cfg
    rng = np.random.default_rng(args.seed)
    T, G, D = args.tokens, cfg.hc_mult, cfg.hidden_size
    ids = model.variant.sample_ids(cfg, rng, T)   # the variant's special ids among them (V4.1's DEAD tokens)
    inp = model.variant.input_layer   # an input layer's engines take no hidden and return [D] per token
    hidden = {L: None if inp else rng.standard_normal((T, G, D), dtype=np.float32) for L in cfg.layer_ids}
    print(f"model: {model}")
    print(f"kernels: {_kernels()}")
    print(f"cpu: {_cpu()}")
    outs = {L: np.empty((T, D) if inp else (T, G, D), np.float32) for L in cfg.layer_ids}
    dec = model.decoder()
    # Untimed tokens first: the first steps fault in the mapped weights and rows and fill the
    # caches; timed, they would measure that (several times a warm step), not the decode.
    warm = min(T, WARMUP_TOKENS)
    steps(f"warming up: {_n(warm, 'token')} x {_n(len(cfg.layer_ids), 'layer')}, not timed")
    for tok in rng.integers(0, cfg.vocab_size, size=warm):
        dec.begin(int(tok))
        for L in cfg.layer_ids:
            dec.layer(L, None if inp else hidden[L][0], out=outs[L][0])
    dec.reset()
    steps(f"decoding {_n(T, 'token')} x {_n(len(cfg.layer_ids), 'layer')}")
    t0 = time.perf_counter()
    for t in range(T):
        dec.begin(int(ids[t]))
        for L in cfg.layer_ids:
            dec.layer(L, None if inp else hidden[L][t], out=outs[L][t])
    dt = time.perf_counter() - t0
    print(f"decoded {_n(T, 'token')} x {_n(len(cfg.layer_ids), 'layer')} in {dt * 1e3:.1f} ms: "
          f"{T / dt:,.0f} tokens/s ({dt / T / len(cfg.layer_ids) * 1e6:.1f} us per layer step)", flush=True)
    worst = 0.0
    for L in cfg.layer_ids:
        steps(f"checking layer {L} against the batch path (the numpy oracle: slower than the decode)")
        ref = model.forward(L, ids[None], None if inp else hidden[L][None])[0]
        err = np.abs(outs[L] - ref) / (2e-5 + 2e-4 * np.abs(ref))
        worst = max(worst, float(err.max()))
    ok = worst <= 1.0
    print(f"check against the batch path (atol 2e-5 + rtol 2e-4): {'OK' if ok else 'FAILED'} "
          f"(worst error {worst:.3f} of tolerance)")
    return 0 if ok else 1


def _config_file(path):
    """The parsed JSON object at `path` when it is a file of JSON (a config, not a checkpoint: a
    checkpoint file is binary), else None. Files past 16 MiB are not read to look."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > 1 << 24:
            return None
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def _not_a_config(path):
    """Refuse a JSON file given where a checkpoint belongs (a checkpoint loader calls it a corrupted
    file), saying what it is: a config gets the init line that makes a checkpoint of it. A JSON
    file of a checkpoint folder (its config.json, its index) is left to the loader, which says to
    pass the folder."""
    d = _config_file(path)
    if d is None or any(v.folder_of(path) is not None for v in variants.variants()):
        return
    what = ("a checkpoint file written by init or save(), or a model's folder holding config.json and its "
            "safetensors")
    if any(v.reads_hf_config(d) for v in variants.variants()) or set(d) <= known_fields():
        raise CliError(f"{path}: a config (JSON), not a checkpoint ({what}): write a checkpoint from it first: "
                       f"engram-stream init {path} -o CHECKPOINT")
    raise CliError(f"{path}: a JSON file, not a checkpoint ({what})")


def cmd_inspect(args):
    if os.fspath(args.checkpoint).endswith(".gguf"):  # a llama.cpp file: its Engram tables, no model to load
        from .rows import gguf
        print("\n".join(gguf.describe(args.checkpoint)))
        return 0
    from .io import memory
    from .model import EngramModel
    _not_a_config(args.checkpoint)
    model = EngramModel.load(args.checkpoint, mmap=True)
    cfg, plan = model.cfg, model.plan
    from .rows import packed
    path = args.checkpoint
    rows = packed.rows_path(path)   # the packed row file: its own line, not in the checkpoint's size
    files = ([os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path])
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f) and f != rows)
    print(f"checkpoint: {path} ({size / 2**20:,.1f} MiB{', without the row file' if os.path.exists(rows) else ''})")
    if os.path.exists(rows):
        print(f"row file: {rows} ({os.path.getsize(rows) / 2**20:,.1f} MiB, packed rows: one read a missed row "
              f"with tables=\"direct\")")
    else:
        print(f"row file: none ({rows} once engram-stream pack-rows {path} writes it)")
    print(f"kernels: {_kernels()}")
    print("config: " + json.dumps(cfg.to_dict()))
    tail = model.variant.describe(cfg)
    print(f"geometry: orders 2..{cfg.max_ngram_size}, {cfg.n_head_per_ngram} heads/order, H={cfg.n_heads}, "
          f"head_dim={cfg.head_dim}, E={cfg.engram_dim}, D={cfg.hidden_size}, G={cfg.hc_mult}, {tail}")
    print(f"compression: {'identity' if plan.lookup is None else 'table'} "
          f"(vocab {cfg.vocab_size} -> {plan.compressed_vocab}), compressed pad {plan.pad_id}")
    for L in cfg.layer_ids:
        w = model.layer(L)
        res = memory.resident_bytes(w.table)
        print(f"layer {L}: multipliers {plan.multipliers[L].tolist()}")
        for n, primes in enumerate(plan.primes[L], start=2):
            print(f"  order {n}: primes {primes}")
        print(f"  offsets {plan.offsets[L].tolist()}")
        print(f"  table [{plan.table_rows[L]}, {cfg.head_dim}] {w.table_dtype}: "
              f"{w.table.nbytes / 2**20:,.1f} MiB, resident {res / 2**20:,.1f} MiB")
    return 0


def _read_config(path) -> EngramConfig:
    """EngramConfig fields as JSON, or a model's own Hugging Face config.json (deepseek-v4.1's
    engram_* keys: a variant that reads config.json recognizes it). Its warnings (a key that
    looks like an Engram key and that no variant reads) are printed on stderr, naming the file."""
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise CliError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CliError(f"{path}: expected one JSON object of EngramConfig fields (or a model's config.json), "
                       f"got a JSON {type(d).__name__}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigKeyWarning)
        try:
            if any(v.reads_hf_config(d) for v in variants.variants()):
                return EngramConfig.from_hf_config(d)
            return EngramConfig.from_dict(d)
        finally:   # also before an error the misspelling may explain
            for w in caught:
                where = f"{path}: " if issubclass(w.category, ConfigKeyWarning) else ""
                print(f"engram-stream: warning: {where}{str(w.message).removeprefix('config.json: ')}",
                      file=sys.stderr)


def cmd_init(args):
    """Write a checkpoint of random weights; tables are drawn and written in pieces (flat memory)."""
    from .io.files import remove_stale_temps
    cfg = _read_config(args.config)  # the inputs (cheap), then the output path: all before any real work
    variant = variants.variant_of(cfg)
    folder = variant.folder_checkpoint
    if args.table_dtype is not None and args.table_dtype not in variant.table_dtypes:
        takers = [v.name for v in variants.variants() if args.table_dtype in v.table_dtypes]
        raise CliError(f"--table-dtype {args.table_dtype} is for {' and '.join(takers)} checkpoints: a {cfg.variant} "
                       f"checkpoint keeps its tables as they are" if not variant.table_dtypes else
                       f"--table-dtype {args.table_dtype}: a {cfg.variant} checkpoint takes {variant.table_dtypes}")
    if folder and args.output.endswith(".safetensors"):
        raise CliError(f"{args.output}: a {cfg.variant} checkpoint is a folder (config.json, index, shards): "
                       f"give a folder name, not a .safetensors file")
    compression = _load_lookup(args.compression) if args.compression else None
    output = _check_output(args.output, args.force, inputs=[args.config, args.compression], folder=folder)
    for stale in remove_stale_temps(output):
        print(f"removed {stale} (left by a process that no longer runs)", file=sys.stderr)
    if not args.quiet:   # what the file gave and what it left to defaults, before the size they make
        print(f"config ({cfg.variant}, from {args.config}): {json.dumps(cfg.to_dict())}", flush=True)
    tables = f"{args.table_dtype or variant.init_table_dtype} tables"
    what = f"folder ({cfg.variant} Hugging Face layout: config.json, index, shards), {tables}" if folder else tables
    bar = progress_bar(args.quiet)

    def before_write(total):  # the size is known, nothing is written yet
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(output))).free
        if total > free:
            raise CliError(f"{output}: needs {_size(total)}, only {_size(free)} free on its file system")
        if not args.quiet:
            print(f"writing {output}: {_size(total)} ({_n(len(cfg.layer_ids), 'layer')}, {what})", flush=True)
        if bar is not None:
            bar(0, total)

    with _cleanup_on_sigterm():
        try:
            variant.save_init(cfg, output, seed=args.weight_seed, graft_zero_init=args.graft_zero,
                              compression=compression, table_dtype=args.table_dtype, progress=bar,
                              before_write=before_write)
        except OSError as e:  # name the user's path, not the temp file the error happened in
            raise CliError(f"{output}: {e.strerror or e}") from None
        finally:
            if bar is not None:
                bar.end()
    size = (sum(os.path.getsize(os.path.join(output, f)) for f in os.listdir(output)) if folder
            else os.path.getsize(output))
    print(f"wrote {output} ({_size(size)}, {what}, weights seed {args.weight_seed})")
    return 0


def _size(nbytes) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _check_output(output, force, inputs=(), folder=False):
    """Refuse an output path before any work: a folder that does not exist or is not
    writable, an existing file without --force, or one of the command's own inputs.
    folder: the output is a folder (a deepseek-v4.1 checkpoint), not a file."""
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise CliError(f"{output}: folder {parent} does not exist")
    if os.path.isdir(output) and not folder:
        raise CliError(f"{output}: is a folder (give a file name)")
    if folder and os.path.lexists(output) and not os.path.isdir(output):
        raise CliError(f"{output}: exists and is not a folder")
    for path in inputs:
        if path and os.path.exists(output) and os.path.exists(path) and os.path.samefile(output, path):
            raise CliError(f"{output}: is also an input of this command; choose another output")
    if os.path.lexists(output) and not force:
        raise CliError(f"{output}: exists; pass --force to overwrite it")
    if not os.access(parent, os.W_OK):
        raise CliError(f"{output}: folder {parent} is not writable")
    return output


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so writers' cleanup (temp files) runs."""


class _cleanup_on_sigterm:
    """Within: SIGTERM raises _Terminated (the default action would kill the process before
    save() removes its temp file). The previous handler comes back on exit."""

    def __enter__(self):
        def handler(signum, frame):
            raise _Terminated()
        self.previous = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.previous)


def _load_lookup(path):
    """A compression lookup saved by build-compression (.npy, int64); anything else is refused
    with what to do (a tokenizer.json given here is the common mistake)."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        hint = " (a tokenizer.json? make the lookup with `engram-stream build-compression` first)" \
            if magic.lstrip()[:1] in (b"{", b"[") else ""
        raise CliError(f"{path}: not a .npy lookup from build-compression{hint}")
    try:
        lookup = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise CliError(f"{path}: not a readable .npy lookup ({e})") from None
    if lookup.ndim != 1 or not np.issubdtype(lookup.dtype, np.integer):
        raise CliError(f"{path}: expected a 1-D integer lookup, got {lookup.dtype} {lookup.shape}")
    return lookup


class _Progress:
    """stderr bar, one update per percent (only created when stderr is a terminal).
    unit: "bytes" (the total shown as a size) or a word counted ("repeats")."""

    def __init__(self, unit="bytes"):
        self.last, self.unit = -1, unit

    def __call__(self, done, total):
        pct = int(100 * done / total) if total else 100
        if pct != self.last:
            self.last = pct
            bar = "#" * (40 * pct // 100)
            of = _size(total) if self.unit == "bytes" else f"{total} {self.unit}"
            print(f"\r[{bar:<40}] {pct:3d}% of {of}", end="", file=sys.stderr, flush=True)

    def end(self):
        print(file=sys.stderr, flush=True)


def progress_bar(quiet=False, unit="bytes"):
    """The progress of a long step, for every command and tool that has one: a stderr bar
    (progress(done, total); .end() closes the line) when stderr is a terminal and not quiet,
    else None (pipes and logs get the final lines only)."""
    return _Progress(unit) if not quiet and sys.stderr.isatty() else None


def cmd_build_compression(args):
    from .compression import build_compression
    output = _check_output(args.output, args.force, inputs=[args.tokenizer])
    lookup = build_compression(args.tokenizer)
    with open(output, "wb") as f:  # np.save(name) would append ".npy" to a name without it
        np.save(f, lookup)
    print(f"wrote {output}: vocab {lookup.shape[0]} -> {int(lookup.max()) + 1} compressed ids "
          f"({(int(lookup.max()) + 1) / lookup.shape[0]:.1%})")
    return 0


def cmd_bench(args):
    """A short in-process comparison, repeated: engine step vs a floor, 1 vs N streams (the built-in
    model, or --checkpoint: a checkpoint file or a model's Hugging Face folder, mapped)."""
    steps = _Steps(args.quiet)
    model = _load_for(args, steps)
    cfg = model.cfg
    L = cfg.layer_ids[0] if args.layer is None else model.plan.check_layer(args.layer)
    G, D = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(args.seed)
    n = args.steps

    def stepper(S):
        eng = model.stream(L, n_streams=S)
        h = None if eng.input_layer else rng.standard_normal((S, G, D), dtype=np.float32)
        out = np.empty(eng.out_shape(S), np.float32)
        ids = rng.integers(0, cfg.vocab_size, size=(n, S))
        for t in range(min(n, 20)):  # warm up
            eng.step(ids[t], h, out=out)

        def run():
            t0 = time.perf_counter()
            for t in range(n):
                eng.step(ids[t], h, out=out)
            return (time.perf_counter() - t0) / n
        return run

    W = model.variant.step_weights(model.layer(L))
    if W.dtype == np.float32:  # the projection alone as one GEMV, the faster of both layouts
        label = "fused-GEMV floor"
        WT = np.ascontiguousarray(W.T)
        e = rng.standard_normal(W.shape[1], dtype=np.float32)

        def touch():
            W @ e
            e @ WT

        def floor():
            t0 = time.perf_counter()
            for _ in range(n):
                W @ e
            t1 = time.perf_counter()
            for _ in range(n):
                e @ WT
            return min(t1 - t0, time.perf_counter() - t1) / n
    else:  # float8 / bf16 weights: numpy cannot multiply them fast; one read of their bytes instead
        label = f"read of its {W.nbytes / 2**20:,.1f} MiB of weights"
        words = W.reshape(-1).view(np.uint8)[:W.nbytes // 8 * 8].view(np.uint64)

        def touch():
            np.bitwise_or.reduce(words)

        def floor():
            t0 = time.perf_counter()
            for _ in range(n):
                np.bitwise_or.reduce(words)
            return (time.perf_counter() - t0) / n

    steps(f"warming up: the floor's pass once, then 1 and {args.streams} streams {min(n, 20)} steps each, "
          f"not timed")
    touch()   # the first pass over the weights faults in a mapped checkpoint's pages: not a measurement
    one, many = stepper(1), stepper(args.streams)
    steps(f"measuring: {args.repeat} repeat{'s' * (args.repeat != 1)} of the floor, 1 and {args.streams} "
          f"streams, {n} steps each")
    runs = {"floor": [], "one": [], "many": []}
    bar = progress_bar(args.quiet, unit="measurements")
    todo = 3 * args.repeat
    for r in range(args.repeat):  # interleaved, so a load change hits all three alike
        for k, (name, f) in enumerate((("floor", floor), ("one", one), ("many", many))):
            if bar is not None:
                bar(3 * r + k, todo)
            runs[name].append(f())
    if bar is not None:
        bar(todo, todo)
        bar.end()
    t = {k: np.array(v) for k, v in runs.items()}
    med = {k: float(np.median(v)) for k, v in t.items()}

    def spread(k, scale=1e6):
        return f"{med[k] * scale:8.1f} us  [{t[k].min() * scale:.1f} .. {t[k].max() * scale:.1f}]"
    what = f"{args.checkpoint}, layer {L}" if args.checkpoint else "the built-in model; bench/ has the full suite"
    print(f"config: D={D} G={G} H={cfg.n_heads}x{cfg.head_dim} ({what})")
    print(f"kernels: {_kernels()}")
    print(f"chosen: {_engine_choice(model.stream(L, n_streams=args.streams))}")
    print(f"cpu: {_cpu()}")
    print(f"median of {args.repeat} repeats of {n} steps each, [min .. max] over the repeats; "
          f"ratios are medians of per-repeat ratios")
    rows = [(label, "floor", ""),
            ("engine step (1 stream)", "one", f"{np.median(t['one'] / t['floor']):.2f}x the floor"),
            (f"engine step ({args.streams} streams)", "many",
             f"{np.median(t['many'] / args.streams / t['one']):.2f}x one stream, per token")]
    for label, k, ratio in rows:
        print(f"{label + ':':<28} {spread(k)}   {ratio}".rstrip())
    return 0


def cmd_tune(args):
    """Measure every kernel path this CPU runs and every thread count on the model's shapes (the
    step, the batched step, the prefill), keep the fastest in the user's tuning cache, print the table."""
    from .engine import isa, tune
    steps = _Steps(args.quiet)
    model = _load_for(args, steps)
    L = model.cfg.layer_ids[0] if args.layer is None else model.plan.check_layer(args.layer)
    steps(f"measuring {', '.join(isa.supported_isas()) if not isa.forced() else isa.kernel_isa()} x threads "
          f"{', '.join(map(str, tune.thread_counts(tune.cores())))} on layer {L}")
    table = tune.table_for(model, L, retune=True)
    print(f"model: {tune.shape_key(model)} ({args.checkpoint or 'the built-in model'}, layer {L})")
    print(f"cpu: {_cpu()}")
    print(f"kernels: {_kernels()}")
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


def cmd_profile(args):
    """memray the heap of a decode, and report RSS and table residency."""
    try:
        import memray
    except ImportError:
        raise CliError("profile needs memray: pip install memray") from None
    import tempfile

    from .io import memory
    from .model import EngramModel
    if args.cold and not args.checkpoint:
        raise CliError("--cold needs a checkpoint (the built-in model lives in RAM)")
    capture = _check_output(args.output, args.force, inputs=[args.checkpoint]) if args.output else None
    if args.checkpoint:
        _not_a_config(args.checkpoint)
    model = EngramModel.load(args.checkpoint, mmap=True) if args.checkpoint else _builtin_model(args)
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
    print(f"decoded {_n(args.steps, 'token')} x {_n(len(cfg.layer_ids), 'layer')} in {dt:.2f} s (under memray)"
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
    return f"{n} bytes" if n < 2**10 else f"{n / 2**10:,.1f} KiB" if n < 2**20 else _size(n)


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


def _count(lo):
    """argparse type: an int >= lo, refused in argparse's own one-line style."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    parse.__name__ = f"int >= {lo}"
    return parse


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Epilogs keep their layout; every option shows its default (unless None/False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


# What each EngramConfig field means, for `init --help` (fields without an entry still list).
CONFIG_FIELDS = {
    "engram_vocab_size": "list, one per order 2..max_ngram_size: where each order's prime search starts",
    "max_ngram_size": "longest n-gram hashed (orders 2..max_ngram_size)",
    "n_embed_per_ngram": "width of one order's retrieved embedding (split over its heads)",
    "n_head_per_ngram": "hash heads per order (each its own prime, its own table rows)",
    "layer_ids": "backbone layers that get an Engram module",
    "pad_id": "token id read before the start of a sequence",
    "seed": "seeds the HASH multipliers (not the weights: see --weight-seed)",
    "kernel_size": "taps of the causal ShortConv",
    "hidden_size": "backbone width D",
    "hc_mult": "hyper-connection streams G (1: a plain residual stream)",
    "vocab_size": "tokenizer vocab (length of a compression lookup)",
}  # the variants' own fields: their Variant's field_help


def _config_help() -> str:
    readers = [v.name for v in variants.variants() if v.hf_config]
    lines = ["config file: one JSON object of EngramConfig fields; a missing field takes its default",
             "(EngramConfig's, the public demo module's: D=1024 and a 2.6 GB float32 table per layer), or a",
             f"model's own Hugging Face config.json ({', '.join(readers)}: each read from its own keys). Fields:"]
    helps = dict(CONFIG_FIELDS, variant=" or ".join(json.dumps(v.name) + (" (written as a folder)" if v.folder_checkpoint
                                                                              else "") for v in variants.variants()))
    for f in dataclasses.fields(EngramConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name:<21} {json.dumps(default):<18} {helps.get(f.name, '')}")
    for v in variants.variants():   # a variant's own fields (its config class), under its name
        own = variant_fields(v)
        if own:
            lines.append(f"{v.name}'s own fields:")
        for name in own:
            f = v.config_class.__dataclass_fields__[name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {name:<21} {json.dumps(default):<18} {v.field_help.get(name, '')}")
    for v in variants.variants():
        lines.append(f"{v.name}: {json.dumps(v.example_config)}" + ("  (-o names a folder)" if v.folder_checkpoint
                                                                     else ""))
    return "\n".join(lines)


def cmd_publish(args):
    """Every layer's table rows into a Mooncake Store (EngramStore layout under a name: engram:{name}:l{L}:h{h})."""
    from .model import EngramModel
    from .rows import parse_tier, record_layout
    _not_a_config(args.checkpoint)
    model = EngramModel.load(args.checkpoint, mmap=True)
    tier = parse_tier({"mooncake": dict(master=args.master, metadata=args.metadata, local_host=args.local_host,
                                        connect_timeout=args.connect_timeout, name=args.name)})
    total = sum(model.plan.table_rows[L] * sum(record_layout(model.layer(L))) for L in model.cfg.layer_ids)
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
    print(f"published {_n(len(model.cfg.layer_ids), 'layer')} x {_n(model.cfg.n_heads, 'head')}, {n / 2**20:,.1f} MiB "
          f"in {dt:.2f} s to {args.master} under the name {tier.name_of(model)!r}")
    return 0


def cmd_pack_rows(args):
    """Write (or --verify) the packed row file beside a checkpoint: each row's bytes and scale
    adjacent, whole records per 4 KiB page, so a missed row is one read."""
    from .model import EngramModel
    from .rows import packed
    _not_a_config(args.checkpoint)
    model = EngramModel.load(args.checkpoint, mmap=True)
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
            raise CliError(f"{path}: needs {_size(total)}, only {_size(free)} free on its file system")
        if not args.quiet:
            print(f"writing {path}: {_size(total)}", flush=True)

    t0 = time.perf_counter()
    with _cleanup_on_sigterm():
        try:
            head = packed.pack_rows(model, path, progress=bar, before_write=before_write)
        finally:
            if bar is not None:
                bar.end()
    lay = next(iter(head["layers"].values()))
    print(f"wrote {path} ({_size(head['size'])}, {_n(len(head['layers']), 'layer')}, {lay['rowbytes'] + lay['scalebytes']}"
          f"-byte records, {lay['per_group']} per page, verified) in {time.perf_counter() - t0:.1f} s")
    return 0


def build_parser():
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the subcommand too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    p = argparse.ArgumentParser(prog="engram-stream", description="Streaming inference engine for Engram.",
                                formatter_class=_Help)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, func, help, **kw):
        s = sub.add_parser(name, help=help, description=help, parents=[debug], formatter_class=_Help, **kw)
        s.set_defaults(func=func)
        return s

    s = command("demo", cmd_demo, "decode on a built-in model and check it against the batch path")
    s.add_argument("--checkpoint", default=None,
                   help="decode this model instead: a checkpoint file or a model's Hugging Face folder "
                        "(config.json, shards)")
    s.add_argument("--tokens", type=_count(1), default=300, help="tokens to decode")
    s.add_argument("--seed", type=_count(0), default=0, help="seed of the weights, ids and hidden states")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr (the results only)")

    s = command("inspect", cmd_inspect, "config, geometry, tables and residency of a checkpoint")
    s.add_argument("checkpoint", help="a checkpoint of any variant (as init or EngramModel.save writes it): "
                                      + "; ".join(f"{v.name}: {variants.describe_checkpoint(v)}"
                                                  for v in variants.variants()))

    s = command("init", cmd_init, "write a checkpoint of random (or graft-zero) weights from a config JSON",
                epilog=_config_help())
    s.add_argument("config", help="JSON file of EngramConfig fields (format below)")
    s.add_argument("-o", "--output", required=True,
                   help="checkpoint to write: " + ", ".join(
                       f"a {'folder' if v.folder_checkpoint else 'file'} ({v.name})" for v in variants.variants()))
    s.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    s.add_argument("--graft-zero", action="store_true", help="zero value projection: output exactly 0")
    takes = [v for v in variants.variants() if v.table_dtypes]
    s.add_argument("--table-dtype", choices=sorted({d for v in takes for d in v.table_dtypes}), default=None,
                   help="dtype of the tables written (int8: with a float32 scale per row): "
                        + "; ".join(f"{v.name} {', '.join(v.table_dtypes)}" for v in takes) + " (default: float32)")
    s.add_argument("--compression", metavar="LOOKUP.npy",
                   help="a compression lookup written by build-compression (default: identity)")
    s.add_argument("--weight-seed", "--seed", dest="weight_seed", type=_count(0), default=0,
                   help="seed of the random WEIGHTS (the config's \"seed\" field seeds the hash)")
    s.add_argument("--quiet", action="store_true", help="print only the final line")

    s = command("build-compression", cmd_build_compression, "tokenizer.json -> compression lookup .npy")
    s.add_argument("tokenizer", help="a Hugging Face tokenizer.json")
    s.add_argument("-o", "--output", required=True, help="file to write, exactly this name (.npy format)")
    s.add_argument("--force", action="store_true", help="overwrite --output if it exists")

    s = command("bench", cmd_bench, "engine step vs its floor, 1 vs N streams (seconds on the built-in model; "
                                    "minutes at Flash dims: fewer --steps / --repeat to shorten; bench/ has the suite)")
    s.add_argument("--checkpoint", default=None,
                   help="bench this model instead of the built-in one: a checkpoint file or a model's Hugging Face "
                        "folder")
    s.add_argument("--layer", type=int, default=None, help="the Engram layer to bench (default: the first)")
    s.add_argument("--steps", type=_count(1), default=500, help="steps per measurement")
    s.add_argument("--streams", type=_count(2), default=16, help="streams of the multi-stream engine")
    s.add_argument("--repeat", type=_count(1), default=5, help="measurements of each, to show the spread")
    s.add_argument("--seed", type=_count(0), default=0, help="seed of the weights and inputs")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr, no progress bar on a terminal")

    s = command("tune", cmd_tune, "time every kernel path and thread count this CPU runs on a model's shapes "
                                  "and keep the fastest (cached per CPU and build)")
    s.add_argument("checkpoint", nargs="?", help="tune for this model: a checkpoint file or a model's Hugging Face "
                                                 "folder (default: the built-in demo model)")
    s.add_argument("--layer", type=int, default=None, help="the Engram layer to time (default: the first)")
    s.add_argument("--seed", type=_count(0), default=0, help="seed of the built-in model's weights")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    s = command("profile", cmd_profile, "memray heap, RSS and table residency of a decode")
    s.add_argument("checkpoint", nargs="?", help="checkpoint to decode from (default: the built-in demo model)")
    s.add_argument("--steps", type=_count(1), default=500, help="tokens to decode")
    s.add_argument("--seed", type=_count(0), default=0, help="seed of the ids (and of the demo model)")
    s.add_argument("--cold", action="store_true",
                   help="evict the checkpoint from the page cache first: a cold start, rows read from disk")
    s.add_argument("-o", "--output", metavar="CAPTURE.bin", help="keep the memray capture in this file")
    s.add_argument("--force", action="store_true", help="overwrite --output if it exists")

    s = command("publish", cmd_publish, "a checkpoint's table rows into a Mooncake Store (EngramStore layout)")
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

    s = command("pack-rows", cmd_pack_rows, "write the packed row file beside a checkpoint (one read per missed row)")
    s.add_argument("checkpoint", help="a model's Hugging Face folder (writes FOLDER/engram_rows.bin; a table whose "
                                      "parts lie in several files too) or a checkpoint file (writes FILE.rows)")
    s.add_argument("--force", action="store_true", help="write it again if it exists")
    s.add_argument("--verify", action="store_true", help="read an existing row file whole and compare it with the "
                                                        "checkpoint instead")
    s.add_argument("--quiet", action="store_true", help="print only the final line")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("engram-stream: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("engram-stream: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as e:  # one clear line unless --debug
        if getattr(args, "debug", False):
            raise
        msg = str(e) if isinstance(e, (CliError, OSError, ValueError, TypeError, KeyError, ImportError)) \
            else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.filename:
            msg = f"{e.filename}: {e.strerror or e}"
        print(f"engram-stream: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
