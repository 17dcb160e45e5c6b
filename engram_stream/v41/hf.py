"""deepseek-v4.1 checkpoints in the model's own Hugging Face layout.

    ckpt_dir/config.json                       ModelArgs keys (EngramConfig.from_hf_config)
    ckpt_dir/model.safetensors.index.json      {"metadata": {...}, "weight_map": {tensor: shard}}
    ckpt_dir/model-0000i-of-0000n.safetensors  the shards (safetensors layout)
    ckpt_dir/tokenizer.json                    the compression is built from it (decode="backend")

load() reads only the `layers.{L}.engram.*` tensors (or all `model.layers.{L}.engram.*`) and
maps the float8 tables in place: a table is a numpy view of the shard file, never a copy.
Everything cheap is checked before anything costly: the config, the index (names inside the
folder), the shard headers (io.safetensors), every shape but the table rows, the least rows the
prime chain can need and the declared rows; then the tokenizer's length against vocab_size;
only then the prime search (HashPlan) and the exact rows.
write() is the one writer: model.save() and the synthetic checkpoints of the tests and
benchmarks (make_synthetic) both stream their tensors through it, chunk by chunk, into a new
folder swapped in whole (io.files.atomic_folder): a reader sees all of the old checkpoint or
all of the new one.
"""
from __future__ import annotations

import contextlib
import json
import os
import re

import numpy as np

from ..config import EngramConfig, min_chain_rows
from ..errors import HFCheckpointError
from ..io import safetensors
from ..io.hf_folder import INDEX, weight_map
from ..io.files import atomic_folder, atomic_output, cache_dir, open_regular
from ..io.safetensors import DTYPES, MAX_HEADER, SafetensorsFile, Tensor, write_folder_files
from ..plan import HashPlan
from .config import V41
from .weights import NAMES, RAW, V41LayerWeights, random_e4m3, shapes

COMPRESSION = "engram_compression.npy"
MODEL_TYPE = "deepseek_v4"   # config.json's model_type: transformers' DeepseekV4Config
TOKENIZER_CONFIG = "tokenizer_config.json"   # a tokenizer folder's special tokens, written beside tokenizer.json   # written when a model's lookup has no tokenizer.json
CHUNK_BYTES = 64 << 20
# A model's vocab_size may pass its tokenizer's ids (the embedding is padded, e.g. to a multiple
# of 128) by at most this many ids, or an eighth of them: more is a config.json or tokenizer.json
# of another model (and a lookup padded to 2**31 ids would take 16 GiB).
VOCAB_PAD = 1024
# the files a save writes: an existing folder is replaced only when it holds nothing else
OWN_FILES = re.compile(r"(config\.json|model\.safetensors\.index\.json|engram_compression\.npy|tokenizer\.json"
                       r"|model(-\d+-of-\d+)?\.safetensors)(\.tmp-\d+(\.[0-9a-f]+)?)?")
ENGRAM_NAME = re.compile(r"(model\.)?layers\.(\d+)\.engram\.(.+)")
RAW_CODE = {"embed.weight": "F8_E4M3", "embed.scale": "F8_E8M0", "wkv.weight": "F8_E4M3",
            "wkv.scale": "F8_E8M0"}
PREFIXES = ("layers.{L}.engram.", "model.layers.{L}.engram.")
# DeepSeek-V4.1-Flash inference/config.json: the keys the Engram layers read
FLASH = {"vocab_size": 129280, "dim": 5120, "hc_mult": 4, "norm_eps": 1e-20, "image_token_id": 129264,
         "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
         "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_pad_id": 2,
         "engram_compressed_vocab_size": 99092, "engram_n_heads": 8, "engram_head_dim": 256}


def flash_config(**overrides) -> EngramConfig:
    """The Flash config; overrides are HF keys (e.g. engram_vocab_size=200000 for small tables,
    which drops the declared sizes that no longer hold)."""
    declared_keys = ("engram_num_embeddings", "engram_compressed_vocab_size")
    hf = {**FLASH, **overrides}
    if set(overrides) - set(declared_keys):  # the declared sizes describe the real tables only
        for k in declared_keys:
            if k not in overrides:
                del hf[k]
    return EngramConfig.from_hf_config(hf)


# --- reading ------------------------------------------------------------------------------------
def _err(path, msg):
    return HFCheckpointError(f"{path}: {msg}")


def _engram_names(ckpt_dir, cfg, wm) -> dict:
    """{layer: {module name: (tensor name, shard)}}: one prefix per layer (layers.L. or
    model.layers.L.; both in one index is refused: which would be the model's?)."""
    by = {}
    for name, shard in wm.items():
        m = ENGRAM_NAME.fullmatch(name)
        if m and int(m.group(2)) in cfg.layer_ids and str(int(m.group(2))) == m.group(2):
            by.setdefault((int(m.group(2)), m.group(1) or ""), {})[m.group(3)] = (name, shard)
    out = {}
    for L in cfg.layer_ids:
        plain, model = by.get((L, ""), {}), by.get((L, "model."), {})
        if plain and model:
            short = sorted(set(plain) & set(model)) or [sorted(plain)[0]]
            a, b = plain.get(short[0], next(iter(plain.values())))[0], model.get(short[0], next(iter(model.values())))[0]
            raise HFCheckpointError(f"{ckpt_dir}: layer {L} is named both {a!r} and {b!r}: which is the model's? "
                                    f"(keep one prefix)")
        names = plain or model
        missing = sorted(set(NAMES) - set(names))
        if missing:
            raise HFCheckpointError(f"{ckpt_dir}: layer {L} has no engram tensors {missing}")
        out[L] = {short: names[short] for short in NAMES}
    return out


def _open_shards(ckpt_dir, names, mmap, stack) -> dict:
    """{shard: SafetensorsFile} of every shard an Engram tensor lives in (headers checked)."""
    files = {}
    for L, layer in names.items():
        for full, shard in layer.values():
            if shard in files:
                continue
            path = os.path.join(ckpt_dir, shard)
            try:
                # random access: a fault on a weight must not read ahead into the tables beside it
                # (rows from a store or by pread never need those pages)
                files[shard] = stack.enter_context(SafetensorsFile(path, HFCheckpointError, mmap=mmap,
                                                                   random_access=True))
            except FileNotFoundError:
                raise _err(path, f"missing (the index names it for {full!r})") from None
    return files


def _check_shapes(cfg, names, files):
    """Every Engram tensor's dtype and shape against the config, the table rows only against
    the least rows the prime chain can need and the declared rows: cheap, so before the prime
    search (which a hostile config.json could make run for hours). Returns {layer: rows}."""
    rows = {}
    for L, layer in names.items():
        for short, (full, shard) in layer.items():
            f = files[shard]
            t = f.tensors.get(full)
            if t is None:
                raise _err(f.path, f"the index names {full!r} but the shard lacks it")
            allowed = (RAW_CODE[short], "U8") if short in RAW else ("BF16", "F32")
            if t.code not in allowed:
                raise _err(f.path, f"tensor {full!r} has dtype {t.code}, expected {' or '.join(allowed)}")
        t = files[layer["embed.weight"][1]].tensors[layer["embed.weight"][0]]
        rows[L] = t.shape[0] if len(t.shape) == 2 else -1
        for short, want in shapes(cfg, rows[L]).items():
            full, shard = layer[short]
            got = files[shard].tensors[full].shape
            if got != want:
                raise _err(files[shard].path, f"tensor {full!r} has shape {list(got)}, but config.json needs "
                                              f"{list(want)}: wrong config.json or wrong shards")
    least = min_chain_rows(cfg)
    if min(rows.values()) < least or sum(rows.values()) < min_chain_rows(cfg, len(rows)):
        raise HFCheckpointError(f"config.json: tables of {list(rows.values())} rows cannot hold its prime chain "
                                f"(at least {least} rows a layer, more over all layers): wrong config.json or "
                                f"wrong shards")
    if cfg.num_embeddings is not None:
        for (L, r), want in zip(rows.items(), cfg.num_embeddings):
            if r != want:
                raise HFCheckpointError(f"layer {L}: the table has {r} rows but config.json declares "
                                        f"engram_num_embeddings {want}")
    return rows


def load_compression(ckpt_dir, cfg):
    """The folder's compression: engram_compression.npy, else built from tokenizer.json
    (decode="backend"; through the user's compression cache, see cached_compression), else
    None (identity). A tokenizer with fewer ids than the model's vocab_size (the embedding is
    padded past the last token) maps the ids it does not have, which no text produces, to the
    pad id's compressed id; one with more ids, or far fewer (VOCAB_PAD), is refused naming both
    numbers, before any allocation of vocab_size."""
    npy, tok = os.path.join(ckpt_dir, COMPRESSION), os.path.join(ckpt_dir, "tokenizer.json")
    if os.path.isfile(npy):
        return _read_lookup(npy, cfg)
    if not os.path.isfile(tok):
        return None
    return _pad_lookup(cached_compression(tok), cfg, tok)


def _read_lookup(npy, cfg):
    """engram_compression.npy, its length checked against vocab_size before its data is read."""
    with open_regular(npy, lambda m: _err(npy, m)) as f:
        fmt = np.lib.format
        try:
            read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(fmt.read_magic(f))
            shape = None if read is None else read(f)[0]  # (a version-3 header: np.load checks it below)
        except ValueError as e:
            raise _err(npy, f"not a .npy lookup ({e})") from None
        if shape is not None and shape != (cfg.vocab_size,):
            raise _err(npy, f"holds {list(shape)} ids but config.json vocab_size is {cfg.vocab_size}")
        f.seek(0)
        return np.load(f, allow_pickle=False)


def _pad_lookup(lookup, cfg, source, error=HFCheckpointError):
    """lookup extended to cfg.vocab_size with the pad id's compressed id (ids past the
    tokenizer's last one, which no text produces); refused naming both numbers when the
    tokenizer has more ids than vocab_size or far fewer (VOCAB_PAD)."""
    n, V = len(lookup), cfg.vocab_size
    if n > V:
        raise error(f"{source} has {n} token ids but config.json vocab_size is {V}: the tokenizer is not this "
                    f"model's (or vocab_size is wrong)")
    if V - n > max(VOCAB_PAD, n // 8):
        raise error(f"config.json vocab_size is {V} but {source} has {n} token ids: a model's vocab passes its "
                    f"tokenizer's by a little padding (at most {max(VOCAB_PAD, n // 8)} ids here), not by "
                    f"{V - n}: wrong config.json or tokenizer.json")
    if n < V and cfg.pad_id < n:
        lookup = np.concatenate([lookup, np.full(V - n, lookup[cfg.pad_id])])
    return lookup


# --- the compression cache ----------------------------------------------------------------------
# Building the lookup from DeepSeek-V4's tokenizer.json decodes and normalizes 129280 tokens (about
# 3 s); a load reads it from the user's cache instead, keyed by the tokenizer file's bytes.
CACHE_FORMAT = 1   # bump when build_compression's output for a given tokenizer changes


def _sha256(b) -> str:
    import hashlib
    return hashlib.sha256(b).hexdigest()


def _read_cached(path, tok_hash, decode):
    """The cached lookup when the entry is whole and is this tokenizer's, else None: every field
    is checked, the lookup against its own checksum (a truncated, corrupt, foreign or older
    entry is rebuilt, never trusted)."""
    import zipfile
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = {k: str(z[k]) for k in ("tokenizer_sha256", "decode", "lookup_sha256")}
            fmt, lookup = int(z["format"]), z["lookup"]
    except (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile):
        return None
    if (fmt != CACHE_FORMAT or meta["tokenizer_sha256"] != tok_hash or meta["decode"] != decode
            or lookup.dtype != np.int64 or lookup.ndim != 1 or not lookup.size
            or _sha256(lookup.tobytes()) != meta["lookup_sha256"]):
        return None
    return lookup


def cached_compression(tokenizer_json, decode="backend", cache=None):
    """build_compression(tokenizer_json, decode) through a cache of built lookups:
    <cache_dir()>/compression/<sha256 of the file>-<decode>.npz. The tokenizer is read once, its
    bytes are hashed and built from (so the entry can only hold what those bytes give). An entry
    that fails any check (_read_cached) is rebuilt and replaced; one that cannot be written
    (a read-only home) only costs the build. cache: another folder instead of cache_dir()."""
    from ..compression import _tokenizers, build_compression
    with open(tokenizer_json, "rb") as f:
        data = f.read()
    tok_hash = _sha256(data)
    folder = os.path.join(cache_dir() if cache is None else os.fspath(cache), "compression")
    path = os.path.join(folder, f"{tok_hash}-{decode}.npz")
    lookup = _read_cached(path, tok_hash, decode)
    if lookup is not None:
        return lookup
    tk = _tokenizers()
    try:
        tok = tk.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on bad content
        raise ValueError(f"{tokenizer_json!r} is not a valid tokenizer.json ({e})") from None
    lookup = build_compression(tok, decode=decode)
    try:
        os.makedirs(folder, exist_ok=True)
        with atomic_output(path) as f:
            np.savez(f, lookup=lookup, tokenizer_sha256=tok_hash, decode=decode, format=CACHE_FORMAT,
                     lookup_sha256=_sha256(lookup.tobytes()))
    except (OSError, ValueError):  # ValueError: something not a file sits at the entry's path
        pass  # no writable cache: the next load builds again
    return lookup


def _not_a_folder(path) -> str:
    """What a file given where a deepseek-v4.1 folder belongs is, and what takes it."""
    folder = folder_of(path)
    if folder is not None:
        return f"{path}: a file of the deepseek-v4.1 folder {folder}: pass the folder"
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and 0 < int.from_bytes(head, "little") < MAX_HEADER:
        return (f"{path}: a single-file checkpoint (safetensors; the demo-v1 variant's format), not a deepseek-v4.1 "
                f"folder: load it with EngramModel.load({path!r})")
    return f"{path}: a file, not a deepseek-v4.1 folder (config.json, {INDEX}, the shards, tokenizer.json)"


def read_config(ckpt_dir) -> EngramConfig:
    """The folder's config.json as an EngramConfig; any problem a HFCheckpointError naming it."""
    path = os.path.join(ckpt_dir, "config.json")
    if os.path.isfile(ckpt_dir):
        raise HFCheckpointError(_not_a_folder(ckpt_dir))
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{ckpt_dir}: no config.json: not a deepseek-v4.1 folder (config.json, "
                                f"{INDEX}, the shards, tokenizer.json)")
    with open_regular(path, lambda m: _err(path, m)) as f:
        try:
            hf = json.loads(f.read(MAX_HEADER + 1))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _err(path, f"not JSON ({e})") from None   # its line and column
    try:
        return EngramConfig.from_hf_config(hf)
    except (ValueError, TypeError) as e:
        raise _err(path, str(e)) from None


def load(ckpt_dir, mmap=True, compression=None):
    """(cfg, plan, {layer: V41LayerWeights}) of a deepseek-v4.1 folder; see the module doc for
    the order of the checks."""
    ckpt_dir = os.fspath(ckpt_dir)
    cfg = read_config(ckpt_dir)
    names = _engram_names(ckpt_dir, cfg, weight_map(ckpt_dir))
    with contextlib.ExitStack() as stack:
        files = _open_shards(ckpt_dir, names, mmap, stack)
        rows = _check_shapes(cfg, names, files)
        lookup = load_compression(ckpt_dir, cfg) if compression is None else compression
        try:
            plan = HashPlan(cfg, compression=lookup)  # the prime search; refuses a mismatched compressed vocab
        except (ValueError, TypeError) as e:
            raise HFCheckpointError(f"{ckpt_dir}: {e}") from None
        layers = {}
        for L, layer in names.items():
            if rows[L] != plan.table_rows[L]:
                path = files[layer["embed.weight"][1]].path
                raise _err(path, f"tensor {layer['embed.weight'][0]!r} has {rows[L]} rows, the prime chain of "
                                 f"config.json needs {plan.table_rows[L]}")
            t = {short: files[shard].array(full) for short, (full, shard) in layer.items()}
            if mmap:  # every engine reads wkv whole: one read of exactly its pages, not a fault a page
                from ..io.files import mapping_of
                from ..io.memory import advise
                for short in ("wkv.weight", "wkv.scale"):
                    if mapping_of(t[short]) is not None and t[short].nbytes:
                        advise(t[short], "willneed")
            layers[L] = V41LayerWeights(cfg, plan.offsets[L], t["embed.weight"], t["embed.scale"],
                                        t["wkv.weight"], t["wkv.scale"], np.asarray(t["q_weight"], np.float32),
                                        np.asarray(t["k_weight"], np.float32))
    return cfg, plan, layers


def folder_of(path):
    """The deepseek-v4.1 folder that file `path` belongs to (config.json, the index or a shard
    of one), or None: for the hint "pass the folder"."""
    folder = os.path.dirname(os.path.abspath(path))
    if OWN_FILES.fullmatch(os.path.basename(path)) and os.path.isfile(os.path.join(folder, "config.json")) and (
            os.path.isfile(os.path.join(folder, INDEX)) or os.path.isfile(os.path.join(folder, "model.safetensors"))):
        return folder
    return None


# --- writing ------------------------------------------------------------------------------------
def _replaceable(name) -> bool:
    """What an existing folder may hold for a save to replace it: the files a save writes (and
    temps of them). Anything else (a full model's other files) makes the save refuse."""
    return OWN_FILES.fullmatch(name) is not None


def _replaceable_synthetic(name) -> bool:
    """A synthetic folder replaces what a synthetic write wrote: a save's files and tokenizer_config.json."""
    return _replaceable(name) or name == TOKENIZER_CONFIG


def write(ckpt_dir, cfg, tensors, n_shards=2, tokenizer=None, compression=None, progress=None,
          before_write=None, replaceable=_replaceable):
    """Write a deepseek-v4.1 folder: config.json, tensors (io.safetensors.Tensor) over n_shards
    shards (largest first, each to the emptiest shard), the index, and tokenizer.json (a
    tokenizers.Tokenizer, or the path of a tokenizer.json to copy with the tokenizer_config.json
    beside it, as a Hugging Face tokenizer folder holds them) or the compression lookup as
    engram_compression.npy. The folder is written beside `ckpt_dir` and swapped in whole
    (io.files.atomic_folder): an existing checkpoint there stays whole until the new one
    replaces it; a folder holding other files is refused (ValueError) before anything is
    written. before_write(total_bytes) runs once the size is known; progress(done, total)."""
    n_shards = max(1, min(n_shards, len(tensors)))
    shards = [[] for _ in range(n_shards)]
    fill = [0] * n_shards
    for t in sorted(tensors, key=lambda t: -t.nbytes):
        i = fill.index(min(fill))
        shards[i].append(t)
        fill[i] += t.nbytes
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    layouts = [safetensors.Layout(ts, {"format": "pt"}) for ts in shards]
    index = json.dumps({"metadata": {"total_size": sum(lay.data_bytes for lay in layouts)},
                        "weight_map": {t.name: f for f, ts in zip(files, shards) for t in ts}},
                       indent=2, sort_keys=True).encode()
    # model_type as DeepSeek-V4's own config.json has it: transformers loads the folder as that model
    # (and, without it, takes the tokenizer for a Mistral one and warns about its regex)
    config = json.dumps({"model_type": MODEL_TYPE, **cfg.to_hf_config()}, indent=2).encode()
    total = sum(lay.nbytes for lay in layouts) + len(index) + len(config)
    if before_write is not None:
        before_write(total)
    with atomic_folder(ckpt_dir, replaceable) as tmp:
        write_folder_files(tmp, list(zip(files, layouts)), [(INDEX, index), ("config.json", config)], progress)
        if isinstance(tokenizer, (str, os.PathLike)):  # a tokenizer.json file: copied as it is
            import shutil
            shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.json"))
            beside = os.path.join(os.path.dirname(os.path.abspath(tokenizer)), TOKENIZER_CONFIG)
            if os.path.isfile(beside):  # its special tokens (pad, bos, eos): what transformers pads with
                shutil.copyfile(beside, os.path.join(tmp, TOKENIZER_CONFIG))
        elif tokenizer is not None:
            tokenizer.save(os.path.join(tmp, "tokenizer.json"))
            with open(os.path.join(tmp, TOKENIZER_CONFIG), "x") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<pad>",
                           "clean_up_tokenization_spaces": False}, f, indent=2)
        elif compression is not None:
            with open(os.path.join(tmp, COMPRESSION), "xb") as f:
                np.save(f, np.asarray(compression, np.int64), allow_pickle=False)
    return ckpt_dir


def declared(cfg, plan) -> EngramConfig:
    """cfg with the sizes a checkpoint declares (table rows per layer, compressed vocab) filled in."""
    return EngramConfig.from_dict({**cfg.to_dict(), "num_embeddings": [plan.table_rows[L] for L in cfg.layer_ids],
                                   "compressed_vocab_size": plan.compressed_vocab})


def save(cfg, plan, layers, path, n_shards=2, progress=None, before_write=None):
    """model.save() for deepseek-v4.1: the HF folder layout (see the module doc), swapped in whole."""
    tensors = [Tensor.of(f"layers.{L}.engram.{short}", getattr(layers[L], short.replace(".", "_")),
                         code=RAW_CODE.get(short, "F32"), chunk_bytes=CHUNK_BYTES)
               for L in cfg.layer_ids for short in NAMES]
    return write(os.fspath(path), declared(cfg, plan), tensors, n_shards=n_shards, compression=plan.lookup,
                 progress=progress, before_write=before_write)


# --- synthetic checkpoints (tests, benchmarks) ---------------------------------------------------
def make_tokenizer(vocab_size, pad_id, image_token_id):
    """A tokenizers.Tokenizer of vocab_size words where "wN" and "WN" (and " wN") share a
    compressed id: the compression is dense and about a third of the vocab."""
    from tokenizers import Tokenizer, models
    vocab = {}
    for i in range(vocab_size):
        if i == pad_id:
            tok = "<pad>"
        elif i == image_token_id:
            tok = "<image>"
        else:
            tok = ("w{}", "W{}", " w{}")[i % 3].format(i // 3)
        vocab[tok] = i
    return Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))


def _random_chunks(seed, shape, make):
    """Chunks of a random tensor drawn row block by row block (never the whole tensor in RAM)."""
    rows, per_row = shape[0], int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, CHUNK_BYTES // max(1, per_row))

    def chunks():
        rng = np.random.default_rng(seed)
        for r in range(0, rows, step):
            yield make(rng, (min(step, rows - r),) + tuple(shape[1:]))
    return chunks


def make_synthetic(ckpt_dir, cfg, seed=0, n_shards=3, tokenizer=True, qk_dtype="BF16", decoys=True, progress=None,
                   before_write=None):
    """A random deepseek-v4.1 checkpoint of config cfg in the HF layout, written chunk by chunk
    (full Flash dims with small tables fit any RAM). tokenizer=True writes a tokenizer.json
    (make_tokenizer; needs the tokenizers package) and declares its compressed vocab; a path
    copies that tokenizer.json instead (e.g. DeepSeek-V4's own: the checkpoint then takes real
    token ids; cfg.vocab_size must cover its ids); decoys adds non-Engram tensors the loader
    must skip; progress, before_write: as write(). Returns the config the folder declares."""
    if cfg.variant != V41:
        raise ValueError(f"make_synthetic writes {V41!r} checkpoints, got a {cfg.variant!r} config")
    tok, lookup = None, None
    if isinstance(tokenizer, (str, os.PathLike)):
        tok, lookup = os.fspath(tokenizer), cached_compression(tokenizer)
        if len(lookup) > cfg.vocab_size:
            raise ValueError(f"{tok}: the tokenizer has {len(lookup)} ids but vocab_size is {cfg.vocab_size}: "
                             f"use a vocab_size of at least {len(lookup)}")
        lookup = _pad_lookup(lookup, cfg, tok, ValueError)
    elif tokenizer:
        from ..compression import build_compression
        tok = make_tokenizer(cfg.vocab_size, cfg.pad_id, cfg.image_token_id)
        lookup = build_compression(tok, decode="backend")
    plan = HashPlan(EngramConfig.from_dict({**cfg.to_dict(), "num_embeddings": None,
                                            "compressed_vocab_size": None}), compression=lookup)
    out_cfg = declared(cfg, plan)
    G, D, E = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim
    e_shift = int(np.ceil(np.log2(np.sqrt(E))))
    makers = {
        "embed.weight": lambda rng, s: random_e4m3(rng, s),
        "embed.scale": lambda rng, s: rng.integers(127 - 4, 128, s, dtype=np.uint8),
        "wkv.weight": lambda rng, s: random_e4m3(rng, s),
        "wkv.scale": lambda rng, s: rng.integers(126 - e_shift, 128 - e_shift + 1, s, dtype=np.uint8),
        "q_weight": lambda rng, s: rng.uniform(0.5, 1.5, s).astype(DTYPES[qk_dtype]),
        "k_weight": lambda rng, s: rng.uniform(0.5, 1.5, s).astype(DTYPES[qk_dtype]),
    }
    tensors = []
    for i, L in enumerate(cfg.layer_ids):
        for j, (short, shape) in enumerate(shapes(cfg, plan.table_rows[L]).items()):
            code = RAW_CODE.get(short, qk_dtype)
            tensors.append(Tensor(f"layers.{L}.engram.{short}", code, shape,
                                  _random_chunks(seed * 1000 + i * 10 + j, shape, makers[short])))
        if decoys:  # other parts of a layer, never read by the loader
            tensors.append(Tensor.of(f"layers.{L}.attn_norm.weight", np.ones(D, DTYPES["BF16"])))
    if decoys:
        tensors.append(Tensor.of("embed.weight", np.zeros((8, D), DTYPES["BF16"])))
    write(ckpt_dir, out_cfg, tensors, n_shards=n_shards, tokenizer=tok, progress=progress, before_write=before_write,
          replaceable=_replaceable_synthetic)
    return out_cfg
