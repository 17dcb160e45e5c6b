"""deepseek-v4.1 checkpoints in the model's own Hugging Face layout.

    ckpt_dir/config.json                       ModelArgs keys (EngramConfig.from_hf_config)
    ckpt_dir/model.safetensors.index.json      {"metadata": {...}, "weight_map": {tensor: shard}}
    ckpt_dir/model-0000i-of-0000n.safetensors  the shards (safetensors layout)
    ckpt_dir/tokenizer.json                    the compression is built from it (decode="backend")

load() reads only the `layers.{L}.engram.*` tensors (a `model.` prefix is accepted too) and
maps the float8 tables in place: a table is a numpy view of the shard file, never a copy.
write() is the one writer: model.save() and the synthetic checkpoints of the tests and
benchmarks (make_synthetic) both stream their tensors through it, chunk by chunk.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from ..config import V41, EngramConfig
from ..errors import HFCheckpointError
from ..io.files import MappedFile, atomic_output, open_regular
from ..plan import HashPlan
from .weights import NAMES, RAW, V41LayerWeights, random_e4m3, shapes

INDEX = "model.safetensors.index.json"
COMPRESSION = "engram_compression.npy"   # written when a model's lookup has no tokenizer.json
MAX_HEADER = 100 << 20
CHUNK_BYTES = 64 << 20
# safetensors dtype codes -> the numpy dtype the bytes are read as (float8 stays raw uint8)
DTYPES = {"F8_E4M3": np.dtype(np.uint8), "F8_E8M0": np.dtype(np.uint8), "U8": np.dtype(np.uint8),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "I64": np.dtype("<i8")}
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
def read_header(path):
    """(tensors {name: (dtype code, shape, begin, end)}, data start) of one safetensors file,
    every offset checked against the file size."""
    with open_regular(path, lambda m: HFCheckpointError(f"{path}: {m}")) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise HFCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER, size - 8):
            raise HFCheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            hdr = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise HFCheckpointError(f"{path}: header is not JSON ({type(e).__name__})") from None
    if not isinstance(hdr, dict):
        raise HFCheckpointError(f"{path}: header is not a JSON object")
    start, out = 8 + n, {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (b, e) = t["dtype"], tuple(int(s) for s in t["shape"]), t["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise HFCheckpointError(f"{path}: tensor {name!r} has a malformed entry") from None
        if code in DTYPES and (not 0 <= b <= e <= size - start
                               or e - b != DTYPES[code].itemsize * int(np.prod(shape, dtype=np.int64))):
            raise HFCheckpointError(f"{path}: tensor {name!r} offsets [{b}, {e}) do not fit its shape "
                                    f"{shape} {code} or the file")
        out[name] = (code, shape, b, e)
    return out, start


def weight_map(ckpt_dir) -> dict:
    """{tensor name: shard file name}: from the index, or the single model.safetensors."""
    idx = os.path.join(ckpt_dir, INDEX)
    if os.path.isfile(idx):
        with open_regular(idx, lambda m: HFCheckpointError(f"{idx}: {m}")) as f:
            try:
                index = json.loads(f.read(MAX_HEADER + 1))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise HFCheckpointError(f"{idx}: not a JSON index ({type(e).__name__})") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise HFCheckpointError(f"{idx}: no weight_map")
        return wm
    single = os.path.join(ckpt_dir, "model.safetensors")
    if os.path.isfile(single):
        return {name: "model.safetensors" for name in read_header(single)[0]}
    raise HFCheckpointError(f"{ckpt_dir}: neither {INDEX} nor model.safetensors")


def _map(path):
    """The whole shard as a MappedFile: read-only, and forward() refuses it once the file
    is truncated or rewritten in place (instead of SIGBUS)."""
    with open_regular(path, lambda m: HFCheckpointError(f"{path}: {m}")) as f:
        return MappedFile(f.fileno(), os.fstat(f.fileno()), path)


def _tensor(path, entry, start, mapped):
    """One tensor's bytes as a numpy array: a view of the mapped shard, or a copy when mapped is None."""
    code, shape, b, e = entry
    if mapped is not None:
        a = np.frombuffer(mapped, dtype=np.uint8, count=e - b, offset=start + b)
    else:
        a = np.fromfile(path, dtype=np.uint8, count=e - b, offset=start + b)
    return a.view(DTYPES[code]).reshape(shape)


def engram_tensors(ckpt_dir, cfg, mmap=True) -> dict:
    """{layer: {module name: array}}: only the layers.{L}.engram.* tensors, shard by shard."""
    wm = weight_map(ckpt_dir)
    found = {L: {} for L in cfg.layer_ids}
    for L in cfg.layer_ids:
        for prefix in (p.format(L=L) for p in PREFIXES):
            for name in wm:
                if name.startswith(prefix):
                    found[L][name[len(prefix):]] = (name, wm[name])
    headers, maps, out = {}, {}, {}
    for L, names in found.items():
        missing = sorted(set(NAMES) - set(names))
        if missing:
            raise HFCheckpointError(f"{ckpt_dir}: layer {L} has no engram tensors {missing}")
        out[L] = {}
        for short in NAMES:
            full, shard = names[short]
            path = os.path.join(ckpt_dir, shard)
            if shard not in headers:
                headers[shard] = read_header(path)
            tensors, start = headers[shard]
            if full not in tensors:
                raise HFCheckpointError(f"{path}: the index names {full!r} but the shard lacks it")
            code = tensors[full][0]
            allowed = (RAW_CODE[short], "U8") if short in RAW else ("BF16", "F32")
            if code not in allowed:
                raise HFCheckpointError(f"{path}: {full} has dtype {code}, expected {' or '.join(allowed)}")
            if mmap and shard not in maps:
                maps[shard] = _map(path)
            out[L][short] = _tensor(path, tensors[full], start, maps.get(shard))
    return out


def load_compression(ckpt_dir, cfg):
    """The folder's compression: engram_compression.npy, else built from tokenizer.json
    (decode="backend"; through the user's compression cache, see cached_compression), else
    None (identity). A tokenizer with fewer ids than the model's vocab_size (the embedding is
    padded past the last token) maps the ids it does not have, which no text produces, to the
    pad id's compressed id."""
    npy, tok = os.path.join(ckpt_dir, COMPRESSION), os.path.join(ckpt_dir, "tokenizer.json")
    if os.path.isfile(npy):
        return np.load(npy, allow_pickle=False)
    if not os.path.isfile(tok):
        return None
    return _pad_lookup(cached_compression(tok), cfg)


def _pad_lookup(lookup, cfg):
    """lookup extended to cfg.vocab_size with the pad id's compressed id (ids past the
    tokenizer's last one, which no text produces)."""
    if len(lookup) < cfg.vocab_size and cfg.pad_id < len(lookup):
        lookup = np.concatenate([lookup, np.full(cfg.vocab_size - len(lookup), lookup[cfg.pad_id])])
    return lookup


# --- the compression cache ----------------------------------------------------------------------
# Building the lookup from DeepSeek-V4's tokenizer.json decodes and normalizes 129280 tokens (about
# 3 s); a load reads it from the user's cache instead, keyed by the tokenizer file's bytes.
CACHE_FORMAT = 1   # bump when build_compression's output for a given tokenizer changes


def cache_dir() -> str:
    """$XDG_CACHE_HOME/engram_stream, else ~/.cache/engram_stream."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "engram_stream")


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


def load(ckpt_dir, mmap=True, compression=None):
    """(cfg, plan, {layer: V41LayerWeights}) of a deepseek-v4.1 folder; see the module doc."""
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isfile(os.path.join(ckpt_dir, "config.json")):
        raise HFCheckpointError(f"{ckpt_dir}: no config.json")
    cfg = EngramConfig.from_hf_config(ckpt_dir)
    lookup = load_compression(ckpt_dir, cfg) if compression is None else compression
    plan = HashPlan(cfg, compression=lookup)  # refuses mismatched table rows / compressed vocab
    layers = {}
    for L, t in engram_tensors(ckpt_dir, cfg, mmap).items():
        want = shapes(cfg, plan.table_rows[L])
        for short, shape in want.items():
            if t[short].shape != shape:
                raise HFCheckpointError(f"{ckpt_dir}: layer {L} {short} has shape {t[short].shape}, "
                                        f"expected {shape}")
        layers[L] = V41LayerWeights(cfg, plan.offsets[L], t["embed.weight"], t["embed.scale"],
                                    t["wkv.weight"], t["wkv.scale"], np.asarray(t["q_weight"], np.float32),
                                    np.asarray(t["k_weight"], np.float32))
    return cfg, plan, layers


# --- writing ------------------------------------------------------------------------------------
class Tensor:
    """A tensor to write: name, safetensors dtype code, shape, and chunks(): its bytes in order."""

    def __init__(self, name, code, shape, chunks):
        self.name, self.code, self.shape, self.chunks = name, code, tuple(shape), chunks
        self.nbytes = DTYPES[code].itemsize * int(np.prod(self.shape, dtype=np.int64))


def _array_chunks(a):
    a = np.ascontiguousarray(a)
    flat = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
    return lambda: (flat[i:i + CHUNK_BYTES] for i in range(0, flat.size, CHUNK_BYTES))


def _write_shard(path, tensors):
    # element size order (4, 2, 1 bytes): every tensor aligned to its element size
    tensors = sorted(tensors, key=lambda t: -DTYPES[t.code].itemsize)
    hdr, pos = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        hdr[t.name] = {"dtype": t.code, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    head = json.dumps(hdr, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_output(path) as f:  # a temp file of its own, fsynced, renamed: never a half shard
        f.write(struct.pack("<Q", len(head)) + head)
        for t in tensors:
            written = 0
            for c in t.chunks():
                c = np.ascontiguousarray(c)
                c.tofile(f)
                written += c.nbytes
            if written != t.nbytes:
                raise RuntimeError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
    return pos


def write(ckpt_dir, cfg, tensors, n_shards=2, tokenizer=None, compression=None):
    """Write a deepseek-v4.1 folder: config.json, tensors over n_shards shards (largest first,
    each to the emptiest shard), the index, and tokenizer.json (a tokenizers.Tokenizer, or the
    path of a tokenizer.json to copy) or the compression lookup as engram_compression.npy."""
    os.makedirs(ckpt_dir, exist_ok=True)
    n_shards = max(1, min(n_shards, len(tensors)))
    shards = [[] for _ in range(n_shards)]
    fill = [0] * n_shards
    for t in sorted(tensors, key=lambda t: -t.nbytes):
        i = fill.index(min(fill))
        shards[i].append(t)
        fill[i] += t.nbytes
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    total = sum(_write_shard(os.path.join(ckpt_dir, f), ts) for f, ts in zip(files, shards))
    index = {"metadata": {"total_size": total},
             "weight_map": {t.name: f for f, ts in zip(files, shards) for t in ts}}
    with open(os.path.join(ckpt_dir, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(ckpt_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    if isinstance(tokenizer, (str, os.PathLike)):  # a tokenizer.json file: copied as it is
        import shutil
        shutil.copyfile(tokenizer, os.path.join(ckpt_dir, "tokenizer.json"))
    elif tokenizer is not None:
        tokenizer.save(os.path.join(ckpt_dir, "tokenizer.json"))
    elif compression is not None:
        np.save(os.path.join(ckpt_dir, COMPRESSION), np.asarray(compression, np.int64), allow_pickle=False)
    return ckpt_dir


def declared(cfg, plan) -> EngramConfig:
    """cfg with the sizes a checkpoint declares (table rows per layer, compressed vocab) filled in."""
    return EngramConfig.from_dict({**cfg.to_dict(), "num_embeddings": [plan.table_rows[L] for L in cfg.layer_ids],
                                   "compressed_vocab_size": plan.compressed_vocab})


def save(cfg, plan, layers, path, n_shards=2):
    """model.save() for deepseek-v4.1: the HF folder layout (see the module doc)."""
    tensors = []
    for L in cfg.layer_ids:
        w = layers[L]
        for short in NAMES:
            a = getattr(w, short.replace(".", "_"))
            code = RAW_CODE.get(short, "F32")
            tensors.append(Tensor(f"layers.{L}.engram.{short}", code, a.shape, _array_chunks(a)))
    return write(os.fspath(path), declared(cfg, plan), tensors, n_shards=n_shards, compression=plan.lookup)


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


def make_synthetic(ckpt_dir, cfg, seed=0, n_shards=3, tokenizer=True, qk_dtype="BF16", decoys=True):
    """A random deepseek-v4.1 checkpoint of config cfg in the HF layout, written chunk by chunk
    (full Flash dims with small tables fit any RAM). tokenizer=True writes a tokenizer.json
    (make_tokenizer; needs the tokenizers package) and declares its compressed vocab; a path
    copies that tokenizer.json instead (e.g. DeepSeek-V4's own: the checkpoint then takes real
    token ids; cfg.vocab_size must cover its ids); decoys adds non-Engram tensors the loader
    must skip. Returns the config the folder declares."""
    if cfg.variant != V41:
        raise ValueError(f"make_synthetic writes {V41!r} checkpoints, got a {cfg.variant!r} config")
    tok, lookup = None, None
    if isinstance(tokenizer, (str, os.PathLike)):
        tok, lookup = os.fspath(tokenizer), cached_compression(tokenizer)
        if len(lookup) > cfg.vocab_size:
            raise ValueError(f"{tok}: the tokenizer has {len(lookup)} ids but vocab_size is {cfg.vocab_size}: "
                             f"use a vocab_size of at least {len(lookup)}")
        lookup = _pad_lookup(lookup, cfg)
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
            tensors.append(Tensor(f"layers.{L}.attn_norm.weight", "BF16", (D,),
                                  _array_chunks(np.ones(D, DTYPES["BF16"]))))
    if decoys:
        tensors.append(Tensor("embed.weight", "BF16", (8, D), _array_chunks(np.zeros((8, D), DTYPES["BF16"]))))
    write(ckpt_dir, out_cfg, tensors, n_shards=n_shards, tokenizer=tok)
    return out_cfg
