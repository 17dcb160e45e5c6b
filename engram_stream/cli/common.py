"""What several commands share: the one-line error, the model a command runs (a checkpoint or the
built-in model), the lines naming the CPU and kernel path, output-path checks, argument types."""
from __future__ import annotations

import argparse
import json
import os

from .. import variants
from ..config import EngramConfig, known_fields


class CliError(Exception):
    """A user-facing error: printed as one line."""


def counted(count, word) -> str:
    """"1 layer", "2 layers": a count and its word."""
    return f"{count} {word}{'s' * (count != 1)}"


def builtin_config() -> EngramConfig:
    """The built-in model's config: the demo variant's example (EngramConfig's defaults elsewhere)."""
    return EngramConfig.from_dict(variants.get(variants.DEFAULT).example_config)


def builtin_model(args):
    from ..model import EngramModel
    return EngramModel.init(builtin_config(), seed=args.seed)


def kernels():
    """The kernel path that runs, what else this build and CPU offer (engram_stream.engine.isa)."""
    from ..engine import isa
    (run, why), built, has = isa.choice(), isa.supported_isas(), isa.cpu_isas()
    note = [why, f"{', '.join(built)} in this build on this CPU"]
    missing = [n for n in has if n not in built]
    if missing:
        note.append(f"the CPU also has {', '.join(missing)}, which this build lacks")
    return f"{run} ({'; '.join(note)}; {isa.ENV} forces one)"


def engine_choice(engine) -> str:
    """Each operation's kernel path and threads in `engine`, and why (EngineBase.kernel_choice)."""
    return "; ".join(f"{op} {p}/{n} thread{'s' * (n != 1)} ({why})" for op, (p, n, why) in engine.kernel_choice().items())


def cpu() -> str:
    """The CPU model ("model name" in /proc/cpuinfo, else what the platform module knows) and the
    CPUs this process may run on: every figure the commands print depends on both."""
    import platform
    from ..engine.cpu import cpu_model, cpuinfo_blocks
    name = cpu_model(cpuinfo_blocks())
    name = name or platform.processor() or "unknown model"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({platform.machine()}, {usable} CPU{'s' * (usable != 1)} usable)"


def add_gguf(s):
    """--gguf PATH: the tables of the checkpoint a command loads, from a llama.cpp GGUF."""
    s.add_argument("--gguf", metavar="MODEL.gguf", default=None,
                   help="the Engram tables from this llama.cpp GGUF (tables=GGUFTier(path): its quantized rows, "
                        "decoded as they are gathered), the rest of the weights from the checkpoint")


def load_model(args, steps):
    """The model a demo or bench runs: --checkpoint (mapped; --gguf: its tables from that GGUF),
    else the built-in one."""
    if args.checkpoint:
        variant = next((v for v in variants.variants() if v.is_checkpoint(args.checkpoint)), None)
        note = variant.load_note if variant is not None else ""  # what its load does besides mapping
        where = f"tables from {args.gguf}" if args.gguf else "tables mapped"
        steps(f"loading {args.checkpoint} ({where}" + (f"; {note})" if note else ")"))
        return load_checkpoint(args.checkpoint, args.gguf)
    if args.gguf:
        raise CliError(f"--gguf {args.gguf}: give the checkpoint whose tables it holds with --checkpoint "
                       "(the built-in model has no GGUF)")
    steps("building the built-in model (random weights)")
    return builtin_model(args)


def load_checkpoint(path, gguf=None):
    """The model of a checkpoint given on the command line, tables mapped (gguf: from that GGUF):
    every command loads one here (a JSON config given instead is refused, saying what it is)."""
    from ..model import EngramModel
    not_a_config(path)
    if gguf is None:
        return EngramModel.load(path, mmap=True)
    from ..rows import GGUFTier
    return EngramModel.load(path, mmap=True, tables=GGUFTier(gguf))


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


def not_a_config(path):
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


def check_output(output, force, inputs=(), folder=False):
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


def at_least(lo):
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
