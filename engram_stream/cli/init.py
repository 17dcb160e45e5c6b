"""engram-stream init: a checkpoint of random (or graft-zero) weights from a config file; its help
lists every config field with the help its config class carries."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import warnings

import numpy as np

from .. import variants
from ..config import EngramConfig, field_help, variant_fields
from ..errors import ConfigKeyWarning
from .common import CliError, at_least, check_output, counted
from .progress import progress_bar, size
from .sigterm import cleanup_on_sigterm


def register(command):
    s = command("init", run, "write a checkpoint of random (or graft-zero) weights from a config JSON",
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
    s.add_argument("--weight-seed", "--seed", dest="weight_seed", type=at_least(0), default=0,
                   help="seed of the random WEIGHTS (the config's \"seed\" field seeds the hash)")
    s.add_argument("--quiet", action="store_true", help="print only the final line")


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


def run(args):
    """Write a checkpoint of random weights; tables are drawn and written in pieces (flat memory)."""
    from ..io.files import remove_stale_temps
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
    output = check_output(args.output, args.force, inputs=[args.config, args.compression], folder=folder)
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
            raise CliError(f"{output}: needs {size(total)}, only {size(free)} free on its file system")
        if not args.quiet:
            print(f"writing {output}: {size(total)} ({counted(len(cfg.layer_ids), 'layer')}, {what})", flush=True)
        if bar is not None:
            bar(0, total)

    with cleanup_on_sigterm():
        try:
            variant.save_init(cfg, output, seed=args.weight_seed, graft_zero_init=args.graft_zero,
                              compression=compression, table_dtype=args.table_dtype, progress=bar,
                              before_write=before_write)
        except OSError as e:  # name the user's path, not the temp file the error happened in
            raise CliError(f"{output}: {e.strerror or e}") from None
        finally:
            if bar is not None:
                bar.end()
    written = (sum(os.path.getsize(os.path.join(output, f)) for f in os.listdir(output)) if folder
               else os.path.getsize(output))
    print(f"wrote {output} ({size(written)}, {what}, weights seed {args.weight_seed})")
    return 0


def _default(f):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _config_help() -> str:
    readers = [v.name for v in variants.variants() if v.hf_config]
    lines = ["config file: one JSON object of EngramConfig fields; a missing field takes its default",
             "(EngramConfig's, the public demo module's: D=1024 and a 2.6 GB float32 table per layer), or a",
             f"model's own Hugging Face config.json ({', '.join(readers)}: each read from its own keys). Fields:"]
    helps = field_help(EngramConfig)   # each config class carries its fields' help (config.described)
    for f in dataclasses.fields(EngramConfig):
        lines.append(f"  {f.name:<21} {json.dumps(_default(f)):<18} {helps[f.name]}")
    for v in variants.variants():   # a variant's own fields (its config class), under its name
        own = variant_fields(v)
        if own:
            lines.append(f"{v.name}'s own fields:")
            helps = field_help(v.config_class)
        for name in own:
            f = v.config_class.__dataclass_fields__[name]
            lines.append(f"  {name:<21} {json.dumps(_default(f)):<18} {helps[name]}")
    for v in variants.variants():
        lines.append(f"{v.name}: {json.dumps(v.example_config)}" + ("  (-o names a folder)" if v.folder_checkpoint
                                                                     else ""))
    return "\n".join(lines)
