"""What the serving integrations (vllm.py, sglang.py) share: their settings, the process's
models that serve them, the check of the framework's version, the patching of a framework's
module as it is imported (PatchOnImport), the re-classing of its embedding method objects
(stream_method) and whether CUDA is there (cuda_available).

The settings are one JSON object (the vLLM plugin's ENGRAM_STREAM_VLLM or
additional_config["engram_stream"], SGLang's install() argument or ENGRAM_STREAM_SGLANG), its
keys SETTINGS, each described in integrations/vllm.py's docstring.

The row conversion both engines' kernels make (records to bf16) is the native _records module.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading

import numpy as np

from .. import variants
from ..errors import shown

SETTINGS = ("checkpoint", "tables", "row_cache_mb", "mooncake", "host_cache")
MOONCAKE_KEYS = ("master", "metadata", "local_host")
# The least "row_cache_mb" of a "host_cache" (MiB). The budget is split over the layers by their
# table bytes, and a layer whose share holds no row is refused at the model's build (every process
# would read all its rows); the model is not known when the settings are read (at the plugin's
# start), so this is the floor that leaves every layer of the served checkpoints its rows (a 264-byte
# V4.1 record's cache of one row is 832 bytes: 1 MiB gives 1,260 equal layers one each).
HOST_CACHE_MIN_MB = 1

_lock = threading.Lock()
_models = {}            # settings key -> the EngramModel serving this process's lookups


def parse_settings(value, where):
    """The settings dict of a JSON object (a str) or a dict. Every bad value is a ValueError that
    names `where` (the variable or config entry it came from), the setting, the value and what
    it may be."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:   # the parser recurses once per level of nesting
            raise ValueError(f"{where}: JSON nested too deeply to parse ({len(value)} characters); give an "
                             f'object such as {{"tables": "direct", "row_cache_mb": 1024}}') from None
        except ValueError as e:
            raise ValueError(f"{where}: not JSON ({e}); give an object such as "
                             f'{{"tables": "direct", "row_cache_mb": 1024}}') from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a JSON object with keys {SETTINGS}, got {shown(value)}")
    unknown = [k for k in value if k not in SETTINGS]
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))}; the keys are {SETTINGS}")
    s = {"checkpoint": value.get("checkpoint"), "tables": value.get("tables", "mapped"),
         "row_cache_mb": value.get("row_cache_mb", 0), "mooncake": value.get("mooncake"),
         "host_cache": value.get("host_cache")}
    t = s["tables"]
    if isinstance(t, dict) and list(t) == ["gguf"]:
        s["tables"] = check_gguf(t, where)
    elif not (isinstance(t, str) and t in ("mapped", "direct")):
        raise ValueError(f'{where}: "tables" must be "mapped", "direct" or {{"gguf": {{"path": "model.gguf", '
                         f'"read": "mapped" or "direct"}}}}, got {shown(t)}')
    from ..rows.tiers import HOST_CACHE_NAME, check_row_cache_mb
    s["row_cache_mb"] = check_row_cache_mb(s["row_cache_mb"], f'{where}: "row_cache_mb"')
    mc = s["mooncake"]
    if mc is not None and not (isinstance(mc, dict) and "master" in mc and "metadata" in mc
                               and all(k in MOONCAKE_KEYS and isinstance(v, str) and v for k, v in mc.items())):
        raise ValueError(f'{where}: "mooncake" must be an object with "master" and "metadata" (and optionally '
                         f'"local_host"), each a non-empty string, got {shown(mc)}')
    hc = s["host_cache"]
    if hc is not None and not (isinstance(hc, str) and HOST_CACHE_NAME.fullmatch(hc) and s["row_cache_mb"]):
        raise ValueError(f'{where}: "host_cache" must be a name of 1 to 64 letters, digits, "_", "." or "-" '
                         f'and needs "row_cache_mb" > 0 (the host\'s budget), got {shown(hc)}')
    if hc is not None and s["row_cache_mb"] < HOST_CACHE_MIN_MB:
        raise ValueError(f'{where}: "row_cache_mb" of a "host_cache" must be at least {HOST_CACHE_MIN_MB} (MiB), '
                         f'got {s["row_cache_mb"]:g}: the budget is split over the layers, and a share too small '
                         f'for one row leaves a layer no host cache; give "row_cache_mb" >= {HOST_CACHE_MIN_MB}')
    ck = s["checkpoint"]
    if ck is not None and not (isinstance(ck, str) and ck and "\0" not in ck and os.path.isdir(ck)):
        raise ValueError(f'{where}: "checkpoint" must be the path of a V4.1 checkpoint folder (a string), got '
                         f'{shown(ck)}' + (": it is not a folder" if isinstance(ck, str) else ""))
    return s


def check_gguf(spec, where):
    """The "tables" setting {"gguf": {GGUFTier's arguments}} checked when the settings are read: its
    arguments, the file's header (its layout, its tables' types). A V4.1 embedding consumes the
    checkpoint's 264-byte e4m3+e8m0 records, which only a GGUF of those raw rows holds byte for byte:
    any other type is refused here, naming it. Qwen4Exp's and LongCat's tables are served as bf16
    rows (each GGUF row decoded and rounded in the lookup: _records.gguf_to_bf16)."""
    from ..errors import CheckpointError
    from ..rows import parse_tier
    from ..rows.gguf import SERVED_TEXT, layouts, open_gguf, record_format_of, table_layout
    kw = spec["gguf"]
    try:
        tier = parse_tier(spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f'{where}: "tables" {shown(spec)}: {e}') from None
    try:
        model = open_gguf(tier.path)
        tables = table_layout(model)[1]
    except (CheckpointError, OSError) as e:
        raise ValueError(f'{where}: "tables" names the GGUF {tier.path!r}: {e}') from None
    variant = variants.get(layouts()[model.architecture][1])
    keep = variant.framework_records
    bad = [t for _, t in tables if keep and record_format_of(t) not in keep]
    if bad:
        raise ValueError(f'{where}: "tables" names the GGUF {tier.path!r}, whose {variant.name} table {bad[0].name} '
                         f"is {bad[0].type_name} ([{bad[0].rows}, {bad[0].ne[0]}]): the {variant.name} embeddings of "
                         f"vLLM and SGLang consume the records {', '.join(keep)}, served from a GGUF only as they "
                         f"are (for 264-byte e4m3 rows: an I8 tensor of the raw rows, ds4's); give such a GGUF or the "
                         f'checkpoint ("tables": "mapped" or "direct"). The engines of engram_stream itself read '
                         f"{SERVED_TEXT}")
    return {"gguf": dict(kw)}


def open_model(s, default_checkpoint, where, variant=None):
    """The process's EngramModel of settings s (one per distinct settings: the layers share it
    and its row cache), opened through EngramModel.load, which knows every registered variant's
    folder. default_checkpoint: the framework's model folder, used when s has no "checkpoint";
    where: the settings' name in errors; variant: the variant the caller serves (a folder of
    another is refused, naming both), or None for any."""
    ckpt = s["checkpoint"] or default_checkpoint
    if not ckpt or not os.path.isdir(ckpt):
        raise ValueError(f"{where}: the served model {default_checkpoint!r} is not a local folder: give "
                         f'"checkpoint" (the folder of the checkpoint the framework serves, e.g. the V4.1 '
                         f'folder holding layers.L.engram.* and tokenizer.json)')
    key = (os.path.realpath(ckpt), json.dumps(s["tables"], sort_keys=True), s["row_cache_mb"], json.dumps(s["mooncake"], sort_keys=True),
           s["host_cache"])
    with _lock:
        if key not in _models:
            from ..model import EngramModel
            from ..rows import parse_tier
            spec = s["tables"]
            if s["mooncake"] is not None:   # a GGUF's rows published to the store: read and decoded as the GGUF's
                spec = {"mooncake": {**s["mooncake"], **({"gguf": spec["gguf"]["path"]} if isinstance(spec, dict)
                                                          else {})}}
            tables = parse_tier(spec)
            _models[key] = EngramModel.load(ckpt, tables=tables, row_cache_mb=s["row_cache_mb"] or None,
                                            host_cache=s["host_cache"])
        model = _models[key]
    if variant is not None and model.cfg.variant != variant:
        raise ValueError(f'{where}: "checkpoint" {ckpt!r} is a {model.cfg.variant} checkpoint; this integration '
                         f"serves {variant}: give a {variant} folder")
    return model


def stats():
    """Row cache and read counters of every model this process serves from ({checkpoint: ...})."""
    with _lock:
        return {k[0]: m.row_cache_stats() for k, m in _models.items()}


def check_version(framework, module, supported):
    """A RuntimeError unless `module` (the imported framework) is version `supported`: the
    integrations build the framework's own objects through its constructors and hook its
    methods by name, which only the version they were written against is known to have."""
    v = getattr(module, "__version__", None)
    if v is None or not (v == supported or v.startswith(supported + "+")):
        raise RuntimeError(f"engram_stream serves {framework} {supported} (its Engram classes and seams), "
                           f"this is {framework} {v}: install {framework.lower()}=={supported}")


def ple_layer(model, index, where, framework):
    """The checkpoint's layer that a framework's PLE layer `index` names: both frameworks index
    the sorted ple_layer_ids (the Qwen config's layer_ids). Out of range: a ValueError."""
    ids = model.cfg.layer_ids
    if not 0 <= index < len(ids):
        raise ValueError(f"{where}: {framework}'s PLE layer {index} is not one of the checkpoint "
                         f"{model.source!r}'s {len(ids)} PLE layers")
    return ids[index]


class StreamRows:
    """What every served table module (a framework's embedding class, its table dropped) holds:
    the model and layer its rows come from, their reader and record size, the cache counters.
    A mixin before the framework's class: plain methods, no torch."""

    def stream_from(self, model, layer):
        from ..rows.gguf import record_type
        self.model, self.layer = model, layer
        self.source = model.row_source(layer)
        self.recbytes = self.source.rowbytes + self.source.scalebytes
        # GGUF rows (tables={"gguf": ...}): the decoders' type number, else -1 (the checkpoint's records)
        self.gguf_type = record_type(self.source.record_format)
        self._gguf_scratch = threading.local()
        keep = variants.get(model.cfg.variant).framework_records
        if keep and self.gguf_type >= 0 and self.source.record_format not in keep:
            raise ValueError(f"layer {layer}: {self.source.record_format} rows; a {model.cfg.variant} embedding "
                             f"consumes the records {', '.join(keep)}")

    def row_cache_stats(self):
        return self.model.row_cache_stats()

    def rows_repr(self, span):
        """extra_repr's text: the layer, `span` (the rows or heads this rank serves), the reader."""
        return f"layer={self.layer}, {span}, rows from engram_stream ({type(self.source).__name__})"


class StreamVocabRows(StreamRows):
    """A vocabulary-parallel table (the Qwen PLE tables of vLLM and SGLang): this rank's shard."""

    def check_gguf_table(self, fmt, where, framework):
        """A GGUF table is served as bf16 rows: the framework's table must be one of values (its
        embedding method the unquantized one), not the checkpoint's FP8 or NVFP4 (`fmt`)."""
        if self.gguf_type >= 0 and fmt in ("fp8", "nvfp4"):
            raise ValueError(f"{where}: the GGUF's {self.source.record_format} rows are served as bf16 values, "
                             f"{framework}'s table of the checkpoint {self.model.source!r} layer {self.layer} is "
                             f"{fmt}: give the bf16 checkpoint the GGUF was made from")

    def gguf_rows(self, ids, torch):
        """bf16 [n, embedding_dim] (torch) of the GGUF rows `ids` (int64, this table's rows): each
        record decoded and rounded to bf16 in C (_records.gguf_to_bf16, without the GIL)."""
        from ._records import gguf_to_bf16
        scratch = self._gguf_scratch.__dict__   # the records: a buffer a thread, kept, grown to the largest call
        rec = scratch.get("rec")
        if rec is None or rec.shape[0] < ids.shape[0]:
            rec = scratch["rec"] = np.empty((ids.shape[0], self.recbytes), np.uint8)
        rec = rec[:ids.shape[0]]
        self.source.read_into(ids, rec)
        out = np.empty((ids.shape[0], self.embedding_dim), np.uint16)
        gguf_to_bf16(self.gguf_type, rec, out)
        return torch.from_numpy(out).view(torch.bfloat16)

    def extra_repr(self):
        s = self.shard_indices
        return self.rows_repr(f"rows {s.org_vocab_start_index}..{s.org_vocab_end_index} of "
                              f"{self.org_vocab_size}, {self.table_format}")


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patches[name](module) right after the module `name` is imported: a plugin loads
    before the framework's modules, and importing them itself would import models the process
    never serves. One finder a patches dict (install_patches)."""

    def __init__(self, patches):
        self.patches = patches   # {module name: patch(module)}

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module, patch = spec.loader.exec_module, self.patches[name]

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install_patches(patches):
    """Patch each module of `patches` that is imported already, the others as they are imported (a
    PatchOnImport first on sys.meta_path, once however often this is called)."""
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, PatchOnImport) and f.patches is patches for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport(patches))


def remove_patches(patches):
    """Stop patching the modules of `patches` as they are imported (what is patched stays)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, PatchOnImport) and f.patches is patches)]


def stream_method(method, classes, **methods):
    """A framework's embedding method object re-classed to a subclass whose embedding() reads
    the layer's rows from engram_stream (layer.stream_rows), with `methods` besides; everything
    else is the framework's. classes: {base class: its subclass}, the caller's cache."""
    base = type(method)
    cls = classes.get(base)
    if cls is None:
        def embedding(self, layer, input_):
            return layer.stream_rows(input_)
        cls = classes[base] = type(f"Stream{base.__name__}", (base,), {"embedding": embedding, **methods})
    method.__class__ = cls
    return method


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch imported here: the frameworks bring it)."""
    import torch
    return torch.cuda.is_available()
