"""What every variant whose checkpoint is a Hugging Face folder shares: the folder's files
(config.json, model.safetensors or the index and its shards), reading its config.json, the table
of parts joined, a table written as a tensor block by block, and the Variant hooks of such a
variant (HFFolderVariant: load, save, save_init, is_checkpoint, folder_of through the variant's
own `hf` module). The variant's hf module keeps what is its own: tensor names and the layout."""
from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np

from ..config import EngramConfig
from ..errors import HFCheckpointError
from ..plan import HashPlan
from .files import open_regular
from .safetensors import MAX_HEADER, SafetensorsFile, Tensor

INDEX = "model.safetensors.index.json"
BF16 = np.dtype(ml_dtypes.bfloat16)
# The files a folder's writer owns (and replaces whole): config.json, the index, the shards and their temps
OWN_FILES = re.compile(r"(config\.json|model\.safetensors\.index\.json|model(-\d+-of-\d+)?\.safetensors)"
                       r"(\.tmp-\d+(\.[0-9a-f]+)?)?")
CHUNK_ROWS = 1 << 16   # rows of a table converted and written at once (flat memory)


def err(path, msg) -> HFCheckpointError:
    return HFCheckpointError(f"{path}: {msg}")


def read_json(path):
    """The parsed JSON object at path, or None when it is absent or not JSON."""
    try:
        with open_regular(path, lambda m: err(path, m)) as f:
            d = json.loads(f.read(MAX_HEADER + 1))
    except (OSError, HFCheckpointError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def read_header(path):
    """The checked header (io.safetensors.Header) of one shard."""
    with SafetensorsFile(path, HFCheckpointError) as f:
        return f.header


def _shard_name(idx, tensor, shard):
    """A weight_map entry names a file inside the folder: a relative path that stays inside it
    lexically (symlinks are followed as the file system does: HF caches link shards into blobs)."""
    norm = os.path.normpath(shard) if isinstance(shard, str) and shard and "\0" not in shard else None
    if norm is None or os.path.isabs(norm) or norm == os.curdir or norm.split(os.sep)[0] == os.pardir:
        raise err(idx, f"weight_map names {shard!r} for {tensor!r}: a shard must be a file name inside the folder")
    return norm


def weight_map(ckpt_dir) -> dict:
    """{tensor name: shard file name}: from the index (every name checked), or the single
    model.safetensors."""
    idx = os.path.join(ckpt_dir, INDEX)
    if os.path.isfile(idx):
        with open_regular(idx, lambda m: err(idx, m)) as f:
            try:
                index = json.loads(f.read(MAX_HEADER + 1))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise err(idx, f"not a JSON index ({type(e).__name__})") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise err(idx, "no weight_map")
        return {name: _shard_name(idx, name, shard) for name, shard in wm.items()}
    single = os.path.join(ckpt_dir, "model.safetensors")
    if os.path.isfile(single):
        return {name: "model.safetensors" for name in read_header(single).tensors}
    raise HFCheckpointError(f"{ckpt_dir}: neither {INDEX} nor model.safetensors")


def is_checkpoint(path, reads_hf_config) -> bool:
    """A folder whose config.json reads_hf_config(d) takes (a variant's models)."""
    path = os.fspath(path)
    return os.path.isdir(path) and reads_hf_config(read_json(os.path.join(path, "config.json")))


def folder_of(path, reads_hf_config, weights_needed=True):
    """The checkpoint folder that file `path` belongs to (config.json, the index or a shard), or
    None. weights_needed: a folder whose config.json has no weights beside it (no index, no
    model.safetensors) is no checkpoint to pass instead."""
    folder = os.path.dirname(os.path.abspath(path))
    weights = not weights_needed or any(os.path.isfile(os.path.join(folder, f)) for f in (INDEX, "model.safetensors"))
    return (folder if OWN_FILES.fullmatch(os.path.basename(path)) and weights
            and is_checkpoint(folder, reads_hf_config) else None)


def read_config(folder, variant):
    """The EngramConfig of a folder's config.json (HFCheckpointError naming the file)."""
    path = os.path.join(folder, "config.json")
    d = read_json(path)
    if d is None:
        raise err(folder, f"no readable config.json: not a {variant} folder")
    try:
        return EngramConfig.from_hf_config(d)
    except (ValueError, TypeError) as e:
        raise err(path, str(e)) from None


def open_shards(stack, folder, names, mmap=True) -> dict:
    """{shard: SafetensorsFile} of every shard that the (tensor name, shard) pairs `names` read,
    each opened once and entered on the ExitStack `stack` (a missing one names its tensor)."""
    files = {}
    for name, shard in names:
        if shard not in files:
            path = os.path.join(folder, shard)
            try:
                files[shard] = stack.enter_context(SafetensorsFile(path, HFCheckpointError, mmap=mmap))
            except FileNotFoundError:
                raise err(path, f"missing (the index names it for {name!r})") from None
    return files


def joined(parts, infos, files, dtype, width):
    """The parts [(tensor name, shard)] as one [rows, width] array: a view of the mapping when they
    lie back to back in one file, else a concatenation in RAM. infos: [(SafetensorsFile, info)]."""
    rows = sum(t.shape[0] for _, t in infos)
    f0 = infos[0][0]
    adjacent = all(f is f0 for f, _ in infos) and all(
        a.start + a.nbytes == b.start for (_, a), (_, b) in zip(infos, infos[1:]))
    if adjacent and f0.mm is not None:
        return np.frombuffer(f0.mm, dtype, rows * width, infos[0][1].start).reshape(rows, width)
    out = np.empty((rows, width), dtype)
    r = 0
    for (full, shard), (_, t) in zip(parts, infos):
        out[r:r + t.shape[0]] = files[shard].array(full)
        r += t.shape[0]
    return out


def table_tensor(name, table, a, b, dtype):
    """Rows [a, b) of a table (an array or an InitTable) as a tensor of `dtype`, written block by block."""
    code = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", BF16: "BF16"}[dtype]

    def chunks():
        for r in range(a, b, CHUNK_ROWS):
            block = np.asarray(table[r:min(b, r + CHUNK_ROWS)])
            yield np.ascontiguousarray(block.astype(dtype, copy=False)).reshape(-1).view(np.uint8)
    return Tensor(name, code, (b - a, table.shape[1]), chunks)


class HFFolderVariant:
    """The Variant hooks of a variant whose checkpoint is a Hugging Face folder on raw token ids
    (no compression), mixed in before Variant: `hf` names the variant's module with load(folder,
    mmap), save(cfg, plan, layers, path, table_dtype, progress, before_write) and its
    config rules' reads_hf_config; weights_rules.init_layers takes hold_tables (save_init writes
    the tables in pieces)."""

    hf = None                  # the variant's hf module
    hf_config = True           # its config.json describes the model (Variant.hf_config)
    folder_checkpoint = True
    checkpoint_form = "a Hugging Face folder: config.json, model.safetensors or the index and shards (no tokenizer)"
    folder_weights_needed = True   # folder_of: a config.json with no weights beside it is no checkpoint

    def load(self, path, mmap=True, compression=None):
        if compression is not None:
            raise ValueError(f"{self.name} hashes raw token ids: load it without a compression")
        return self.hf.load(path, mmap=mmap)

    def save(self, cfg, plan, layers, path, table_dtype=None, progress=None):
        return self.hf.save(cfg, plan, layers, path, table_dtype=table_dtype, progress=progress)

    def save_init(self, cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
                  progress=None, before_write=None):
        if compression is not None:
            raise ValueError(f"{self.name} hashes raw token ids: it takes no compression")
        plan = HashPlan(cfg)
        layers = self.weights_rules.init_layers(cfg, plan, seed, graft_zero_init, hold_tables=False)
        return self.hf.save(cfg, plan, layers, path, table_dtype=table_dtype, progress=progress,
                            before_write=before_write)

    def is_checkpoint(self, path):
        return is_checkpoint(path, self.config_rules.reads_hf_config)

    def folder_of(self, path):
        return folder_of(path, self.config_rules.reads_hf_config, self.folder_weights_needed)
