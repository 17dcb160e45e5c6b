"""qwen3.8-flash-next checkpoints in the model's Hugging Face layout.

    folder/config.json                      qwen4_exp (a text_config inside) or flat qwen4_exp_text keys
    folder/model.safetensors                one file, or
    folder/model.safetensors.index.json     {"weight_map": {tensor: shard}} and its shards

load() reads only the PLE tensors of the layers in ple_layer_ids: `<prefix>layers.{L-1}.ple.<name>`
(decoder layers are numbered from 0 in the names, ple_layer_ids from 1; the prefix "",
"model." or "model.language_model."), the table as `ple_embedding.ngram_embedding.weight` or in
parts `ple_embedding.ngram_embedding.shard_{i}.weight`, i = 0..n-1, concatenated by rows in the
order of i (transformers' loader does the same). vLLM's quantized tables load too: FP8 (float8_e4m3fn
parts, a global `ngram_embedding.weight_scale`) and NVFP4 (packed E2M1 parts, `shard_{i}.weight_scale`
E4M3 block scales, a global `weight_scale_2`), kept as their codes, each code's value what vLLM 0.33.0's
dequantization gives for bfloat16 activations (fp8_lut, nvfp4_lut). Tables stay mapped when they can: one tensor,
or parts lying back to back in one file, of float32, float16 or bfloat16 (the engine gathers each);
parts spread over files are concatenated in RAM. key_proj / value_proj stay bfloat16 when stored so (the
engine's GEMM widens them); norms and taps are read as float32.
save() writes the flat layout: config.json, the tensors under "model.layers.{L-1}.ple." with the
table in table_parts parts of ceil(rows / table_parts) rows (vLLM's loader wants exactly these),
one shard a layer and the index, swapped in whole.
"""
from __future__ import annotations

import contextlib
import json
import os
import re

import ml_dtypes
import numpy as np

from ..errors import HFCheckpointError
from ..io import safetensors
from ..io.files import atomic_folder, mapping_of
from ..io.hf_folder import BF16, INDEX, OWN_FILES, err, joined, open_shards, read_config, table_tensor, weight_map
from ..io.safetensors import Tensor, write_folder_files
from ..plan import HashPlan
from .config import QWEN
from .weights import BUFFERS, NAMES, TABLE, PLEWeights

PLE_NAME = re.compile(r"(model\.language_model\.|model\.|)layers\.(\d+)\.ple\.(.+)")
EMB = TABLE[:-len(".weight")]  # ple_embedding.ngram_embedding
PART = re.compile(re.escape(EMB) + r"\.shard_(\d+)\.(weight|weight_scale)")


_err = err


def _ple_names(folder, cfg, wm) -> dict:
    """{L: {module name: (tensor name, shard)}}, one prefix per layer."""
    by = {}
    for name, shard in wm.items():
        m = PLE_NAME.fullmatch(name)
        if m and str(int(m.group(2))) == m.group(2) and int(m.group(2)) + 1 in cfg.layer_ids:
            by.setdefault(int(m.group(2)) + 1, {}).setdefault(m.group(1), {})[m.group(3)] = (name, shard)
    out = {}
    for L in cfg.layer_ids:
        found = by.get(L, {})
        if len(found) > 1:
            raise _err(folder, f"layer {L}'s PLE tensors come under several prefixes {sorted(found)}: "
                               f"which is the model's?")
        names = next(iter(found.values()), {})
        missing = sorted(set(NAMES) - {TABLE} - set(names))
        if missing:
            raise _err(folder, f"layer {L} (layers.{L - 1}.ple) has no tensors {missing}")
        out[L] = names
    return out


def _table_parts(folder, L, names, suffix="weight") -> list:
    """[(tensor name, shard)] of layer L's table (suffix "weight") or of its per-row NVFP4 block
    scales ("weight_scale"), in row order; [] when there are no scale parts."""
    parts = {int(m.group(1)): v for k, v in names.items() if (m := PART.fullmatch(k)) and m.group(2) == suffix}
    whole = f"{EMB}.{suffix}"
    if whole in names and suffix == "weight":
        if parts:
            raise _err(folder, f"layer {L}: both {whole} and its shard_* parts")
        return [names[whole]]
    if not parts:
        if suffix != "weight":
            return []
        raise _err(folder, f"layer {L} has no {TABLE} (nor its shard_* parts)")
    if sorted(parts) != list(range(len(parts))):
        raise _err(folder, f"layer {L}: table parts {sorted(parts)[:8]}... are not shard_0..shard_{len(parts) - 1}")
    return [parts[i] for i in range(len(parts))]


def _check_parts(folder, L, cfg, plan, infos, width, what):
    for f, t in infos:
        if len(t.shape) != 2 or t.shape[1] != width:
            raise _err(f.path, f"a part of layer {L}'s {what} has shape {t.shape}: rows of {width} expected")
    rows = sum(t.shape[0] for _, t in infos)
    if rows != plan.table_rows[L]:
        raise _err(folder, f"layer {L} table has {rows} rows, config.json's primes padded to "
                           f"x{cfg.table_rows_multiple} need {plan.table_rows[L]}")


def _table(folder, L, cfg, plan, parts, files, names):
    """(table, table_scale, table_lut) of layer L: values (float32, float16, bfloat16), or vLLM's
    FP8 / NVFP4 codes with the value of each code (_quantized)."""
    infos = [(files[shard], files[shard].info(full)) for full, shard in parts]
    codes = {t.code for _, t in infos}
    if codes == {"F8_E4M3"} or codes == {"U8"}:
        return _quantized(folder, L, cfg, plan, parts, infos, files, names)
    dtypes = {t.dtype for _, t in infos}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (np.float32, np.float16, BF16):
        raise _err(folder, f"layer {L} table: float32, float16 or bfloat16 parts of one dtype, got {sorted(map(str, dtypes))}")
    _check_parts(folder, L, cfg, plan, infos, cfg.head_dim, "table")
    return joined(parts, infos, files, next(iter(dtypes)), cfg.head_dim), None, None


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)  # an NVFP4 nibble: sign bit 3, magnitude bits 0-2
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
NVFP4_BLOCK = 16


# The dtypes a global scale is read from: vLLM copies the stored tensor into its float32 parameter
# (torch's copy_ decodes float8_e4m3fn to its value). io.safetensors holds F8_E4M3 as raw bytes:
# its value comes from viewing them as e4m3, never from the byte (0x38 is 1.0, not 56.0).
SCALE_CODES = ("F32", "F16", "BF16", "F8_E4M3")


def _global_scale(folder, L, names, files, short):
    if short not in names:
        raise _err(folder, f"layer {L}: a quantized table needs its global scale {short}")
    full, shard = names[short]
    code = files[shard].info(full).code
    if code not in SCALE_CODES:
        raise _err(files[shard].path, f"tensor {full!r}: a global scale of dtype {code}; a scale is stored as "
                                      f"{', '.join(SCALE_CODES)} (integers are not scale values): re-export it")
    a = files[shard].read(full).reshape(-1)
    a = (a.view(E4M3) if code == "F8_E4M3" else a).astype(np.float32)
    if a.size != 1:
        raise _err(files[shard].path, f"tensor {full!r}: one global scale, got {a.size} values")
    if not np.isfinite(a[0]):
        raise _err(files[shard].path, f"tensor {full!r}: the global scale is {a[0]}, not a finite number")
    return np.float32(a[0])


def fp8_lut(scale) -> np.ndarray:
    """float32[256]: the value vLLM 0.33.0 gives each FP8 byte of a table with this global scale
    (Qwen4ExpPLEFp8EmbeddingMethod.dequantize, bfloat16 activations): bf16(e4m3 * bf16(scale))."""
    s = np.float32(np.asarray(scale, np.float32).astype(BF16))
    v = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    return (v * s).astype(BF16).astype(np.float32)


def nvfp4_lut(global_scale) -> np.ndarray:
    """float32[256 * 16]: the value vLLM 0.33.0's NVFP4 lookup (_lookup_nvfp4_ple_embedding_kernel)
    gives a nibble under a block scale byte, at [scale byte * 16 + nibble]: e2m1 * e4m3 (exact in
    float32) * the global scale in float32, stored as bfloat16."""
    scales = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    v = scales[:, None] * E2M1[None, :]
    return (v * np.float32(global_scale)).astype(BF16).astype(np.float32).reshape(-1)


def _quantized(folder, L, cfg, plan, parts, infos, files, names):
    """vLLM's quantized tables, kept as their codes (mapped when the parts lie back to back in one
    file) with the value of every code: FP8, float8_e4m3fn parts and one global weight_scale;
    NVFP4, uint8 parts of packed E2M1, shard_i.weight_scale parts of E4M3 block scales, one global
    weight_scale_2. transformers has no quantized PLE tables: these are vLLM's formats."""
    hd, nvfp4 = cfg.head_dim, next(iter(infos))[1].code == "U8"
    if not nvfp4:
        _check_parts(folder, L, cfg, plan, infos, hd, "FP8 table")
        lut = fp8_lut(_global_scale(folder, L, names, files, f"{EMB}.weight_scale"))
        return joined(parts, infos, files, np.uint8, hd), None, lut
    if hd % NVFP4_BLOCK:
        raise _err(folder, f"layer {L}: an NVFP4 table needs rows of a multiple of {NVFP4_BLOCK} values, not {hd}")
    _check_parts(folder, L, cfg, plan, infos, hd // 2, "NVFP4 table")
    lut = nvfp4_lut(_global_scale(folder, L, names, files, f"{EMB}.weight_scale_2"))
    scales = _table_parts(folder, L, names, "weight_scale")
    if len(scales) != len(parts):
        raise _err(folder, f"layer {L}: {len(parts)} NVFP4 table parts but {len(scales)} weight_scale parts")
    sinfos = [(files[shard], files[shard].info(full)) for full, shard in scales]
    for (f, st), (_, t) in zip(sinfos, infos):
        if st.code != "F8_E4M3" or tuple(st.shape) != (t.shape[0], hd // NVFP4_BLOCK):
            raise _err(f.path, f"layer {L}: E4M3 block scales of shape {(t.shape[0], hd // NVFP4_BLOCK)} "
                               f"expected, got {st.code} {st.shape}")
    return (joined(parts, infos, files, np.uint8, hd // 2), joined(scales, sinfos, files, np.uint8, hd // 16),
            lut)


def load(folder, mmap=True):
    """(cfg, plan, {L: PLEWeights}) of a Qwen folder (see the module doc)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise HFCheckpointError(f"{folder}: not a folder ({QWEN} checkpoints are Hugging Face folders)")
    cfg = read_config(folder, QWEN)
    names = _ple_names(folder, cfg, weight_map(folder))
    plan = HashPlan(cfg)
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    want = {"key_proj.weight": (G * D, E), "value_proj.weight": (D, E), "norm_key.weight": (G * D,),
            "norm_query.weight": (G * D,), "norm_conv.weight": (G * D,), "conv1d.weight": (G * D, 1, K)}
    with contextlib.ExitStack() as stack:
        files = open_shards(stack, folder, [pair for layer in names.values() for pair in layer.values()], mmap)
        layers = {}
        for L, layer in names.items():
            arr = {}
            for short, shape in want.items():
                full, shard = layer[short]
                a = files[shard].array(full)
                if a.shape != shape:
                    raise _err(files[shard].path, f"tensor {full!r}: shape {a.shape}, expected {shape}")
                arr[short] = a if a.dtype == BF16 and short.endswith("proj.weight") else np.asarray(a, np.float32)
            planned = dict(zip(BUFFERS, (plan.multipliers[L], plan.head_primes[L], plan.offsets[L])))
            for short, mine in planned.items():  # transformers saves its buffers: they must be this plan's
                if short in layer:
                    full, shard = layer[short]
                    if not np.array_equal(files[shard].read(full), mine):
                        raise _err(files[shard].path, f"tensor {full!r} disagrees with config.json's hash plan "
                                                      f"({mine[:4].tolist()}...)")
            table, scale, lut = _table(folder, L, cfg, plan, _table_parts(folder, L, layer), files, layer)
            layers[L] = PLEWeights(cfg, plan.offsets[L], table, arr["key_proj.weight"], arr["value_proj.weight"],
                                   arr["norm_key.weight"], arr["norm_query.weight"], arr["norm_conv.weight"],
                                   arr["conv1d.weight"], table_scale=scale, table_lut=lut)
            if mmap and mapping_of(table) is None:
                layers[L].table_in_ram = ("its parts lie in several files of the folder, so the loader concatenated "
                                          "them in RAM")
    return cfg, plan, layers


class _Values:
    """A quantized table's values by row slices, for the writer."""

    def __init__(self, w, head_dim):
        self.w, self.shape = w, (w.table.shape[0], head_dim)

    def __getitem__(self, s):
        return self.w.table_f32(s)


def save(cfg, plan, layers, path, table_dtype=None, progress=None, before_write=None):
    """model.save() for qwen3.8-flash-next: the flat Hugging Face layout (see the module doc), one
    shard a layer, its table's parts back to back (so that a load maps the table as one array)."""
    if table_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"table_dtype={table_dtype!r}: a {QWEN} checkpoint writes float32 or bfloat16 tables")
    shards = []
    for L in cfg.layer_ids:
        tensors = []
        shards.append(tensors)
        w = layers[L]
        pre = f"model.layers.{L - 1}.ple."
        quantized = w.table_lut is not None  # written as its values (this writer has no quantized formats)
        dtype = (BF16 if table_dtype == "bfloat16" else np.dtype(np.float32) if table_dtype or quantized
                 else np.dtype(w.table.dtype))
        rows = plan.table_rows[L]
        size = -(-rows // cfg.table_parts)  # vLLM's shard size: ceil; the last parts may be short or empty
        bounds = [min(rows, size * i) for i in range(cfg.table_parts + 1)]
        for i in range(cfg.table_parts):
            tensors.append(table_tensor(f"{pre}{EMB}.shard_{i}.weight", _Values(w, cfg.head_dim) if quantized else w.table,
                                         bounds[i], bounds[i + 1], dtype))
        for short in ("key_proj.weight", "value_proj.weight"):
            a = w.key_proj if short.startswith("key") else w.value_proj
            tensors.append(Tensor.of(pre + short, a))
        for short, a in (("norm_key.weight", w.norm_key_w), ("norm_query.weight", w.norm_query_w),
                         ("norm_conv.weight", w.norm_conv_w), ("conv1d.weight", w.conv_w[:, None, :])):
            tensors.append(Tensor.of(pre + short, np.asarray(a, np.float32)))
    n_shards = len(shards)
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    layouts = [safetensors.Layout(ts, {"format": "pt"}) for ts in shards]
    index = json.dumps({"metadata": {"total_size": sum(lay.data_bytes for lay in layouts)},
                        "weight_map": {t.name: f for f, ts in zip(files, shards) for t in ts}},
                       indent=2, sort_keys=True).encode()
    config = json.dumps(cfg.to_hf_config(), indent=2).encode()
    total = sum(lay.nbytes for lay in layouts) + len(index) + len(config)
    if before_write is not None:
        before_write(total)
    path = os.fspath(path)
    with atomic_folder(path, lambda name: OWN_FILES.fullmatch(name) is not None) as tmp:
        write_folder_files(tmp, list(zip(files, layouts)), [(INDEX, index), ("config.json", config)], progress)
    return path
