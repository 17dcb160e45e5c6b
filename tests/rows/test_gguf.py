"""GGUF tables: the C row decoders (include/engram_gguf.h, rows/_gguf.pyx) against gguf-py's
gguf.quants.dequantize (ggml's CPU dequantizers in numpy) bit for bit, the 264-byte e4m3 rows
against ml_dtypes, and rows/gguf.py's reader on files written by gguf.GGUFWriter in the
qwen4exp and deepseek41 layouts, split ones included; malformed files are refused with a
CheckpointError naming the file and the fault, never a crash or a read past the file."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")  # the test extra; the runtime never imports it
from gguf import GGMLQuantizationType as T  # noqa: E402

from engram_stream.errors import CheckpointError  # noqa: E402
from engram_stream.rows import _gguf  # noqa: E402
from engram_stream.rows import gguf as rg  # noqa: E402
from helpers.gguf_files import (ARR, I64, QUANTIZABLE, RANDOM_BLOCKS, U32, U64, e4m3_oracle, e4m3_rows,  # noqa: E402
                                quantized, random_blocks, same_bits, table_bytes, write_gguf)
from helpers.numeric import hypothesis_settings  # noqa: E402

pytestmark = pytest.mark.native  # every test here drives the C decoders or reads what they decode

# ---- the decoders ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZABLE + RANDOM_BLOCKS)
@pytest.mark.parametrize("row_length", [256, 512])
def test_decoders_bit_equal_to_gguf_dequantize(name, row_length):
    rng = np.random.default_rng(row_length + len(name))
    raw = table_bytes(name, 9, row_length, rng)
    want = gguf.quants.dequantize(raw, T[name]).reshape(9, row_length)
    same_bits(_gguf.decode_rows(int(T[name]), raw, row_length), want)
    ids = np.array([8, 0, 3, 3, 5], np.int64)
    same_bits(_gguf.gather(int(T[name]), raw, ids, row_length), want[ids])


@pytest.mark.parametrize("name", QUANTIZABLE + RANDOM_BLOCKS)
def test_decoders_bit_equal_on_any_bytes(name):
    """Blocks of arbitrary bytes (NaN and infinite scales too) decode as the reference does."""
    bv, bb = gguf.GGML_QUANT_SIZES[T[name]]
    raw = np.random.default_rng(7).integers(0, 256, (64, 256 // bv * bb), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(raw, T[name]).reshape(64, 256)
    same_bits(_gguf.decode_rows(int(T[name]), raw, 256), want)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "F16", "BF16"])
def test_qwen_row_of_160_values(name):
    """qwen4exp's rows: 160 values, 5 blocks of 32 (no 256-value type fits)."""
    rng = np.random.default_rng(3)
    raw = quantized(name, 6, 160, rng) if name in QUANTIZABLE else random_blocks(name, 6, 160, rng)
    same_bits(_gguf.decode_rows(int(T[name]), raw, 160), gguf.quants.dequantize(raw, T[name]).reshape(6, 160))


def test_every_f16_and_bf16_code():
    codes = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    same_bits(_gguf.decode_rows(int(T.F16), codes, 256), codes.view(np.float16).astype(np.float32))
    same_bits(_gguf.decode_rows(int(T.BF16), codes, 256), gguf.quants.dequantize(codes, T.BF16).reshape(256, 256))


def test_e4m3_rows_bit_equal_to_ml_dtypes():
    raw = e4m3_rows(40, np.random.default_rng(5))
    raw[0, :256] = np.arange(256)  # every code once, scale bytes 0 (2^-127) to 0xff (NaN)
    raw[0, 256:] = [0, 1, 126, 127, 128, 200, 254, 255]
    same_bits(_gguf.decode_rows(_gguf.E4M3_ROW, raw, 256), e4m3_oracle(raw))


def test_e4m3_rows_bit_equal_to_the_v41_gather():
    """The 264-byte rows decode to the bits the V4.1 engine's gather (es8_gather) gives the
    checkpoint's records (a NaN as a NaN: its vector paths pick their own payload): a GGUF of
    them is the checkpoint."""
    from engram_stream.v41._engine import gather_rows
    raw = e4m3_rows(300, np.random.default_rng(6))
    raw[0, :256] = np.arange(256)
    want = gather_rows(np.ascontiguousarray(raw[:, :256]), np.ascontiguousarray(raw[:, 256:]), np.arange(300))
    same_bits(_gguf.decode_rows(_gguf.E4M3_ROW, raw, 256), want)


def test_decoder_argument_checks():
    raw = np.zeros((2, 18), np.uint8)
    with pytest.raises(ValueError, match="not one the decoders serve"):
        _gguf.decode_rows(int(T.IQ4_XS), raw, 32)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        _gguf.decode_rows(int(T.Q4_0), raw, 48)
    with pytest.raises(ValueError, match="is 36 bytes"):
        _gguf.decode_rows(int(T.Q4_0), raw, 64)
    with pytest.raises(IndexError, match="row 2 of a table of 2 rows"):
        _gguf.gather(int(T.Q4_0), raw, np.array([0, 2], np.int64), 32)
    with pytest.raises(IndexError, match="row -1"):
        _gguf.gather(int(T.Q4_0), raw, np.array([-1], np.int64), 32)


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"
                         and "fma" in open("/proc/cpuinfo").read()), reason="needs an x86-64 CPU with FMA")
def test_decoders_stay_exact_when_built_to_fuse(tmp_path):
    """Built with -march=haswell -ffp-contract=fast (FMA, and contraction asked for), the decoders
    give the reference's values: every product an addition follows is exact (engram_gguf.h)."""
    cc = shutil.which(os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0]) or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    include = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "include")
    src = tmp_path / "dec.c"
    src.write_text('#include "engram_gguf.h"\n'
                   "int dec(int t, const uint8_t *s, long n, float *d) { return es_gg_decode(t, s, n, d); }\n")
    lib = tmp_path / "dec.so"
    subprocess.run([cc, "-O3", "-march=haswell", "-ffp-contract=fast", "-shared", "-fPIC", f"-I{include}",
                    str(src), "-o", str(lib), "-lm"], check=True, capture_output=True)
    import ctypes
    dec = ctypes.CDLL(str(lib)).dec
    rng = np.random.default_rng(11)
    for name in ["Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]:
        raw = np.ascontiguousarray(random_blocks(name, 64, 256, rng))
        out = np.empty((64, 256), np.float32)
        assert dec(int(T[name]), raw.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(out.size),
                   out.ctypes.data_as(ctypes.c_void_p)) == 0
        same_bits(out, gguf.quants.dequantize(raw, T[name]).reshape(64, 256))


# ---- GGUF files in the converters' layouts ------------------------------------------------------

def qwen_kv(rows):
    return {
        "qwen4exp.ple.head_offsets": ([0, rows // 2], ARR, U64),
        "qwen4exp.ple.head_vocab_sizes": ([rows // 2, rows - rows // 2], ARR, U64),
        "qwen4exp.ple.layer_multipliers": ([23703573157769, 20109073645365, 8052911324071], ARR, U64),
        "qwen4exp.ple.ngram_size": (3, U32, None),
        "qwen4exp.ple.heads_per_ngram": (1, U32, None),
        "qwen4exp.ple.eos_token_id": (5, U32, None),
        "qwen4exp.embedding_length_per_layer_input": (160, U32, None),
    }


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "F16", "BF16", "F32"])
def test_read_rows_qwen4exp_layout(tmp_path, name):
    rng = np.random.default_rng(1)
    rows = 101
    if name == "F32":
        data = rng.standard_normal((rows, 160)).astype(np.float32)
        want = data
    else:
        data = table_bytes(name, rows, 160, rng)
        want = gguf.quants.dequantize(data, T[name]).reshape(rows, 160)
    # a small tensor first, so the table's data starts 32-aligned and not page aligned
    path = tmp_path / "qwen.gguf"
    write_gguf(path, "qwen4exp", {"output_norm.weight": (np.ones(3, np.float32), "F32"),
                                  "per_layer_token_embd.weight": (data, name)}, qwen_kv(rows))
    model = rg.open_gguf(path)
    t = model.tensor("per_layer_token_embd.weight")
    assert (t.ne, t.type_name, t.rows, t.row_length) == ((160, rows), name, rows, 160)
    assert t.offset % 32 == 0 and t.offset % 4096 != 0
    ids = [100, 0, 50, 50, 7]
    same_bits(rg.read_rows(path, "per_layer_token_embd.weight", ids), want[ids])
    assert model.architecture == "qwen4exp" and list(model.kv["qwen4exp.ple.head_offsets"]) == [0, 50]
    # cross-check the header reading against gguf-py's reader
    ref = gguf.GGUFReader(str(path)).get_tensor(1)
    assert ref.name == t.name and ref.data_offset == t.offset and ref.n_bytes == t.nbytes


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q3_K", "Q2_K", "E4M3"])
def test_read_rows_deepseek41_layout(tmp_path, name):
    rng = np.random.default_rng(2)
    rows = {1: 37, 14: 21}
    tensors, want = {}, {}
    for L, n in rows.items():
        if name == "E4M3":  # ds4's I8 tensor of the checkpoint's 264-byte rows
            raw = e4m3_rows(n, rng)
            tensors[f"blk.{L}.engram_embd.weight"] = (raw.view(np.int8), "I8")
            want[L] = e4m3_oracle(raw)
        else:
            raw = table_bytes(name, n, 256, rng)
            tensors[f"blk.{L}.engram_embd.weight"] = (raw, name)
            want[L] = gguf.quants.dequantize(raw, T[name]).reshape(n, 256)
    kv = {"deepseek41.engram.layer_ids": ([1, 14], ARR, U32), "deepseek41.engram.head_count": (8, U32, None),
          "deepseek41.engram.key_length": (32, U32, None), "deepseek41.engram.max_ngram_size": (3, U32, None)}
    path = tmp_path / "ds.gguf"
    write_gguf(path, "deepseek41", tensors, kv)
    for L, n in rows.items():
        t = rg.open_gguf(path).tensor(f"blk.{L}.engram_embd.weight")
        assert (t.rows, t.row_length) == (n, 256)
        ids = np.arange(n)[::-3]
        same_bits(rg.read_rows(path, t.name, ids), want[L][ids])


def test_split_gguf_read_from_any_shard(tmp_path):
    rng = np.random.default_rng(4)
    a, b = table_bytes("Q4_K", 9, 256, rng), table_bytes("Q8_0", 11, 256, rng)
    write_gguf(tmp_path / "m.gguf", "deepseek41", {"blk.1.engram_embd.weight": (a, "Q4_K"),
                                                   "blk.14.engram_embd.weight": (b, "Q8_0")},
               {"deepseek41.engram.head_count": (8, U32, None)}, split_max_tensors=1)
    shards = sorted(os.listdir(tmp_path))
    assert shards == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    for s in shards:
        model = rg.open_gguf(tmp_path / s)
        assert model.files == [str(tmp_path / x) for x in shards]
        assert model.kv["deepseek41.engram.head_count"] == 8
        same_bits(rg.read_rows(tmp_path / s, "blk.14.engram_embd.weight", [10, 0]),
                  gguf.quants.dequantize(b, T.Q8_0).reshape(11, 256)[[10, 0]])
        same_bits(rg.read_rows(tmp_path / s, "blk.1.engram_embd.weight", [3]),
                  gguf.quants.dequantize(a, T.Q4_K).reshape(9, 256)[[3]])
    os.remove(tmp_path / shards[1])
    with pytest.raises(CheckpointError, match="m-00002-of-00002.gguf: missing, shard 2 of the 2"):
        rg.open_gguf(tmp_path / shards[0])


def test_type_not_served_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    raw = np.zeros((4, 136), np.uint8)
    write_gguf(path, "deepseek41", {"blk.1.engram_embd.weight": (raw, "IQ4_XS"),
                                    "blk.2.engram_embd.weight": (np.zeros((4, 100), np.int8), "I8"),
                                    "blk.3.engram_embd.weight": (np.zeros((4, 34), np.uint8), "Q8_0")})
    with pytest.raises(CheckpointError, match=r"x.gguf: tensor blk.1.engram_embd.weight is IQ4_XS .*serve F32, F16"):
        rg.read_rows(path, "blk.1.engram_embd.weight", [0])
    with pytest.raises(CheckpointError, match=r"blk.2.engram_embd.weight is I8 \(ne \[100, 4\]\)"):
        rg.read_rows(path, "blk.2.engram_embd.weight", [0])
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        rg.read_rows(path, "nope", [0])
    with pytest.raises(IndexError, match="row 4 of tensor blk.3.engram_embd.weight, which has 4 rows"):
        rg.read_rows(path, "blk.3.engram_embd.weight", [4])
    with pytest.raises(TypeError, match="integers"):
        rg.read_rows(path, "blk.3.engram_embd.weight", [0.5])
    assert rg.read_rows(path, "blk.3.engram_embd.weight", []).shape == (0, 32)


# ---- malformed files ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("g") / "s.gguf"
    rng = np.random.default_rng(9)
    write_gguf(path, "qwen4exp", {"a.weight": (np.ones(5, np.float32), "F32"),
                                  "per_layer_token_embd.weight": (table_bytes("Q5_1", 6, 160, rng), "Q5_1")},
               {**qwen_kv(6), "tokenizer.ggml.tokens": (["a", "bc", "\u00e9"], ARR, gguf.GGUFValueType.STRING)})
    return path.read_bytes()


def refused(tmp_path, data, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=match) as e:
        rg.read_rows(p, "per_layer_token_embd.weight", [0])
    assert str(p) in str(e.value)



def test_a_string_array_across_header_chunks_reads_and_a_bad_item_is_named(tmp_path):
    """A tokenizer's string array longer than one header read (1 MiB): every item as written,
    the chunk boundaries included; an item that is not UTF-8 is named by its index."""
    tokens = [f"tok{i:06d}-" + "\u00e9" * (i % 7) for i in range(100000)]
    path = tmp_path / "t.gguf"
    rng = np.random.default_rng(2)
    write_gguf(path, "qwen4exp", {"per_layer_token_embd.weight": (table_bytes("Q5_1", 6, 160, rng), "Q5_1")},
               {**qwen_kv(6), "tokenizer.ggml.tokens": (tokens, ARR, gguf.GGUFValueType.STRING)})
    assert path.stat().st_size > 2 << 20
    assert rg.open_gguf(path).kv["tokenizer.ggml.tokens"] == tokens
    data = bytearray(path.read_bytes())
    at = data.index(b"tok041234-")
    data[at] = 0xff
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"tokenizer\.ggml\.tokens\[41234\] at byte {at} is not UTF-8"):
        rg.open_gguf(bad)


def test_every_truncation_is_refused(tmp_path, small_gguf):
    p = tmp_path / "whole.gguf"
    p.write_bytes(small_gguf)
    end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(str(p)).tensors)  # then the padding
    for n in list(range(0, end, 7)) + [end - 1]:
        refused(tmp_path, small_gguf[:n], "truncated|ends past the end")


def test_wrong_magic_and_version(tmp_path, small_gguf):
    refused(tmp_path, b"GGML" + small_gguf[4:], "magic b'GGML'")
    refused(tmp_path, small_gguf[:4] + struct.pack("<I", 1 << 24) + small_gguf[8:], "version 16777216")


def test_huge_counts_are_refused_before_any_allocation(tmp_path, small_gguf):
    huge = struct.pack("<Q", 1 << 62)
    refused(tmp_path, small_gguf[:8] + huge + small_gguf[16:], "tensor count is 4611686018427387904")
    refused(tmp_path, small_gguf[:16] + huge + small_gguf[24:], "key count is 4611686018427387904")
    # the first key's name length
    refused(tmp_path, small_gguf[:24] + huge + small_gguf[32:], "needs 4611686018427387904 bytes")
    # an array's length: tokenizer.ggml.tokens' (string array) and head_offsets' (u64 array)
    for key in (b"tokenizer.ggml.tokens", b"qwen4exp.ple.head_offsets"):
        at = small_gguf.index(key) + len(key) + 4 + 4
        refused(tmp_path, small_gguf[:at] + huge + small_gguf[at + 8:], "length of key")


def test_offset_past_the_end_and_misaligned(tmp_path, small_gguf):
    name = b"per_layer_token_embd.weight"
    at = small_gguf.index(name) + len(name) + 4 + 16 + 4  # the offset field
    off = struct.unpack_from("<Q", small_gguf, at)[0]
    refused(tmp_path, small_gguf[:at] + struct.pack("<Q", off + 1024) + small_gguf[at + 8:], "ends past the end")
    refused(tmp_path, small_gguf[:at] + struct.pack("<Q", 2**64 - 32) + small_gguf[at + 8:], "ends past the end")
    refused(tmp_path, small_gguf[:at] + struct.pack("<Q", off + 8) + small_gguf[at + 8:], "not a multiple of")
    nd = small_gguf.index(name) + len(name)
    refused(tmp_path, small_gguf[:nd] + struct.pack("<I", 9) + small_gguf[nd + 4:], "9 dimensions")
    ty = nd + 4 + 16
    refused(tmp_path, small_gguf[:ty] + struct.pack("<I", 77) + small_gguf[ty + 4:], "type 77")
    ne = nd + 4
    refused(tmp_path, small_gguf[:ne] + struct.pack("<Q", 2**63) + small_gguf[ne + 8:], "ends past the end")


@given(st.data())
@hypothesis_settings(60)
def test_any_corruption_is_a_checkpoint_error_or_reads(tmp_path_factory, small_gguf, data):
    """Bytes of the header overwritten at random: the reader refuses (CheckpointError) or reads
    a well-formed file; never another exception, never a crash."""
    b = bytearray(small_gguf)
    header_end = small_gguf.index(b"per_layer_token_embd.weight") + 60
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header_end - 1))
        b[at] = data.draw(st.integers(0, 255))
    p = tmp_path_factory.mktemp("c") / "c.gguf"
    p.write_bytes(bytes(b))
    try:
        rg.read_rows(p, "per_layer_token_embd.weight", [0])
    except CheckpointError as e:
        assert str(p) in str(e)
    except (IndexError, TypeError) as e:  # the corrupted shape left no row 0
        assert "row 0" in str(e)


# ---- engram-stream inspect model.gguf -----------------------------------------------------------

def test_inspect_qwen4exp(tmp_path, capsys):
    from engram_stream.cli import main
    rows = 40
    data = table_bytes("Q5_0", rows, 160, np.random.default_rng(6))
    kv = qwen_kv(rows)
    del kv["qwen4exp.ple.eos_token_id"]
    path = tmp_path / "qwen-Q5_0.gguf"
    write_gguf(path, "qwen4exp", {"per_layer_token_embd.weight": (data, "Q5_0")}, kv)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layout: qwen4exp (as llama.cpp writes it), 1 table" in out
    assert f"per_layer_token_embd.weight Q5_0, [{rows}, 160], 110 bytes a row" in out and ": served" in out
    assert "constant qwen4exp.ple.head_offsets = [0, 20] (2 values)" in out
    assert "constant qwen4exp.ple.layer_multipliers = [23703573157769, 20109073645365, 8052911324071] (3 values)" in out
    missing = out.split("missing (taken from the model's folder): ")[1].split("\n")[0].split(", ")
    assert missing == ["qwen4exp.ple.layers", "qwen4exp.ple.conv_kernel", "qwen4exp.ple.eos_token_id"]


def test_inspect_deepseek41_split_and_per_head_qwen(tmp_path, capsys):
    from engram_stream.cli import main
    rng = np.random.default_rng(8)
    tensors = {"blk.1.engram_embd.weight": (e4m3_rows(5, rng).view(np.int8), "I8"),
               "blk.14.engram_embd.weight": (np.zeros((3, 136), np.uint8), "IQ4_XS")}
    write_gguf(tmp_path / "ds.gguf", "deepseek41", tensors,
               {"deepseek41.engram.layer_ids": ([1, 14], ARR, U32), "deepseek41.engram.head_count": (8, U32, None)},
               split_max_tensors=1)
    assert main(["inspect", str(tmp_path / "ds-00002-of-00002.gguf")]) == 0
    out = capsys.readouterr().out
    assert "2 shards" in out and "layout: deepseek41 (as ik_llama.cpp, llama.cpp's port writes it), 2 tables" in out
    assert "layer 1: blk.1.engram_embd.weight I8 rows of 256 e4m3 values and 8 e8m0 scales, [5, 256], 264 bytes a row" in out
    assert "layer 14: blk.14.engram_embd.weight IQ4_XS, [3, 256], 136 bytes a row" in out
    assert "NOT served (types served: F32, F16" in out
    assert "missing (taken from the model's folder): deepseek41.engram.key_length, deepseek41.engram.max_ngram_size, " in out

    heads = {f"ple_ngram_embd.{h}.weight": (table_bytes("Q8_0", 4, 160, rng), "Q8_0") for h in range(3)}
    write_gguf(tmp_path / "q.gguf", "qwen4exp", heads)
    assert main(["inspect", str(tmp_path / "q.gguf")]) == 0
    out = capsys.readouterr().out
    assert "3 tables" in out and "head 2: ple_ngram_embd.2.weight Q8_0, [4, 160], 170 bytes a row" in out


def test_inspect_refuses_other_architectures_and_bad_files(tmp_path, capsys):
    from engram_stream.cli import main
    write_gguf(tmp_path / "llama.gguf", "llama", {"token_embd.weight": (np.ones((2, 4), np.float32), "F32")})
    assert main(["inspect", str(tmp_path / "llama.gguf")]) == 1
    err = capsys.readouterr().err
    assert "llama.gguf: general.architecture is 'llama', not one whose Engram tables" in err and err.count("\n") == 1
    write_gguf(tmp_path / "empty.gguf", "qwen4exp", {"x.weight": (np.ones(4, np.float32), "F32")})
    assert main(["inspect", str(tmp_path / "empty.gguf")]) == 1
    assert "a qwen4exp GGUF without its Engram table" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["inspect", str(tmp_path / "bad.gguf")]) == 1
    assert "bad.gguf: not a valid GGUF file: the tensor count at byte 8 needs 8 bytes" in capsys.readouterr().err


# ---- the checks at open against a model folder's config ------------------------------------------

def qwen_one_layer():
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.qwen.config import EXAMPLE
    return EngramModel.init(EngramConfig(**{**EXAMPLE, "layer_ids": [2]}), seed=0)


def qwen_gguf_kv(m, **over):
    cfg, plan, L = m.cfg, m.plan, m.cfg.layer_ids[0]
    kv = {"qwen4exp.ple.layers": ([L], ARR, U32), "qwen4exp.ple.ngram_size": (cfg.max_ngram_size, U32, None),
          "qwen4exp.ple.heads_per_ngram": (cfg.n_head_per_ngram, U32, None),
          "qwen4exp.ple.eos_token_id": (cfg.pad_id, U32, None),
          "qwen4exp.embedding_length_per_layer_input": (cfg.head_dim, U32, None),
          "qwen4exp.ple.layer_multipliers": ([int(x) % 2**64 for x in plan.multipliers[L]], ARR, U64),
          "qwen4exp.ple.head_offsets": ([int(x) for x in plan.offsets[L]], ARR, U64),
          "qwen4exp.ple.head_vocab_sizes": ([int(x) for x in plan.head_primes[L]], ARR, U64)}
    kv.update(over)
    return kv


def test_check_config_qwen(tmp_path):
    m = qwen_one_layer()
    L, rows, hd = 2, m.plan.table_rows[2], m.cfg.head_dim
    table = table_bytes("F16", rows, hd, np.random.default_rng(0))  # head_dim 16: no 32-value block fits
    path = tmp_path / "q.gguf"
    write_gguf(path, "qwen4exp", {"per_layer_token_embd.weight": (table, "F16")}, qwen_gguf_kv(m))
    layers, missing = rg.check_config(rg.open_gguf(path), m.cfg, m.plan)
    assert list(layers) == [L] and [t.name for t in layers[L]] == ["per_layer_token_embd.weight"]
    assert missing == ["qwen4exp.ple.conv_kernel"]

    primes = [int(p) for p in m.plan.head_primes[L]]
    bad = qwen_gguf_kv(m, **{"qwen4exp.ple.head_vocab_sizes": (primes[:3] + [primes[3] + 2], ARR, U64)})
    write_gguf(path, "qwen4exp", {"per_layer_token_embd.weight": (table, "F16")}, bad)
    got = ", ".join(map(str, primes[:3] + [primes[3] + 2]))
    with pytest.raises(CheckpointError, match=rf"q.gguf: qwen4exp.ple.head_vocab_sizes is \[{got}\] "
                                              rf"\(4 values\) in the GGUF, \[{', '.join(map(str, primes))}\] \(4 values\) in the "
                                              rf"model folder's config"):
        rg.check_config(rg.open_gguf(path), m.cfg, m.plan)

    write_gguf(path, "qwen4exp", {"per_layer_token_embd.weight": (table[:-1], "F16")}, qwen_gguf_kv(m))
    with pytest.raises(CheckpointError, match=rf"per_layer_token_embd.weight is \[{rows - 1}, {hd}\], layer 2 of "
                                              rf"the folder's config is \[{rows}, {hd}\]"):
        rg.check_config(rg.open_gguf(path), m.cfg, m.plan)

    two = make_qwen_two_layers()
    write_gguf(path, "qwen4exp", {"per_layer_token_embd.weight": (table, "F16")}, qwen_gguf_kv(m))
    with pytest.raises(CheckpointError, match=r"one PLE table, the folder's config has PLE layers \[2, 5\]"):
        rg.check_config(rg.open_gguf(path), two.cfg, two.plan)


def make_qwen_two_layers():
    from helpers.models import make_qwen_model
    return make_qwen_model()


def test_check_config_deepseek41(tmp_path):
    from helpers.models import make_v41_model
    m = make_v41_model()
    cfg, plan = m.cfg, m.plan
    rng = np.random.default_rng(1)
    tensors = {f"blk.{L}.engram_embd.weight": (table_bytes("Q8_0", plan.table_rows[L], cfg.head_dim, rng), "Q8_0")
               for L in cfg.layer_ids}
    primes = np.concatenate([plan.head_primes[L] for L in cfg.layer_ids])
    kv = {"deepseek41.engram.layer_ids": (list(cfg.layer_ids), ARR, U32),
          "deepseek41.engram.head_count": (cfg.n_head_per_ngram, U32, None),
          "deepseek41.engram.primes": ([int(p) for p in primes], ARR, U64),
          "deepseek41.engram.multipliers": ([int(x) for L in cfg.layer_ids for x in plan.multipliers[L]], ARR, I64)}
    path = tmp_path / "ds.gguf"
    write_gguf(path, "deepseek41", tensors, kv)
    layers, missing = rg.check_config(rg.open_gguf(path), cfg, plan)
    assert {L: [t.name for t in ts] for L, ts in layers.items()} == {L: [f"blk.{L}.engram_embd.weight"]
                                                                    for L in cfg.layer_ids}
    assert missing == ["deepseek41.engram.key_length", "deepseek41.engram.max_ngram_size", "deepseek41.engram.pad_id",
                       "deepseek41.engram.offsets", "deepseek41.engram.token_map"]

    kv["deepseek41.engram.head_count"] = (cfg.n_head_per_ngram + 1, U32, None)
    write_gguf(path, "deepseek41", tensors, kv)
    with pytest.raises(CheckpointError, match=rf"deepseek41.engram.head_count is {cfg.n_head_per_ngram + 1} in the "
                                              rf"GGUF, {cfg.n_head_per_ngram} in the model folder's config"):
        rg.check_config(rg.open_gguf(path), cfg, plan)

    write_gguf(path, "qwen4exp", tensors)
    with pytest.raises(CheckpointError, match=r"architecture is 'qwen4exp', the folder's config is a deepseek-v4.1 "
                                              r"model \(its GGUFs are deepseek41 or deepseek4\)"):
        rg.check_config(rg.open_gguf(path), cfg, plan)

    L0 = cfg.layer_ids[0]
    served = {**tensors, f"blk.{L0}.engram_embd.weight": (np.zeros((plan.table_rows[L0], 136), np.uint8), "IQ4_XS")}
    write_gguf(path, "deepseek41", served, {"deepseek41.engram.layer_ids": (list(cfg.layer_ids), ARR, U32)})
    with pytest.raises(CheckpointError, match=rf"blk.{L0}.engram_embd.weight is IQ4_XS"):
        rg.check_config(rg.open_gguf(path), cfg, plan)
