"""The safetensors codec every variant shares (engram_stream.io.safetensors): the header reader's
checks, dtypes it does not read, the writer's layout. Files are built by hand here (or by the
safetensors package), not by the code under test, wherever the writer is not what is tested."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from engram_stream.errors import CheckpointError, HFCheckpointError
from engram_stream.io import safetensors as st


def raw_file(path, header, data=b""):
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    path.write_bytes(struct.pack("<Q", len(js)) + js + data)
    return str(path)


def entry(code, shape, begin, end):
    return {"dtype": code, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": entry("F32", [2, 3], 0, 24), "b": entry("I64", [2], 24, 40)}
DATA = np.arange(6, dtype="<f4").tobytes() + np.array([7, -8], "<i8").tobytes()


def test_reads_a_file_of_the_safetensors_package(tmp_path):
    save_file = pytest.importorskip("safetensors.numpy").save_file
    a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, -2, 3], np.int64)
    save_file({"a": a, "b": b, "c": np.zeros((2, 0), np.float16)}, str(tmp_path / "x.st"), metadata={"k": "v"})
    for mmap in (False, True):
        with st.SafetensorsFile(tmp_path / "x.st", mmap=mmap) as f:
            assert f.header.metadata == {"k": "v"}
            assert np.array_equal(f.array("a"), a) and np.array_equal(f.read("b"), b)
            assert f.array("c").shape == (2, 0)


HOSTILE = {
    "float offsets": ({**GOOD, "b": entry("I64", [2], 24.0, 40.0)}, "tensor 'b': data_offsets"),
    "bool offsets": ({**GOOD, "b": entry("I64", [2], True, 40)}, "tensor 'b': data_offsets"),
    "shape product wraps int64": ({**GOOD, "b": entry("I64", [2 ** 32, 2 ** 32], 40, 40)}, "tensor 'b'.*needs"),
    "float shape": ({**GOOD, "a": entry("F32", [2.0, 3], 0, 24)}, "tensor 'a': shape"),
    "negative shape": ({**GOOD, "a": entry("F32", [-2, -3], 0, 24)}, "tensor 'a': shape"),
    "span vs shape": ({**GOOD, "a": entry("F32", [2, 4], 0, 24)}, "tensor 'a'.*needs 32"),
    "span of a dtype never read": ({**GOOD, "c": entry("I32", [3], 0, 8)}, "tensor 'c'.*I32 \\[3\\] needs 12"),
    "past the end": ({**GOOD, "b": entry("I64", [3], 24, 48)}, "tensor 'b'.*past the end"),
    "overlap": ({**GOOD, "b": entry("I64", [2], 16, 32)}, "'a' \\[0, 24\\) and 'b' \\[16, 32\\) overlap"),
    "extra field": ({**GOOD, "a": {**GOOD["a"], "x": 1}}, "tensor 'a': entry must have exactly"),
    "entry not an object": ({**GOOD, "a": [1, 2]}, "tensor 'a': entry"),
    "dtype not a string": ({**GOOD, "a": entry(4, [2, 3], 0, 24)}, "tensor 'a': dtype must be a string"),
    "metadata not str to str": ({**GOOD, "__metadata__": {"k": 1}}, "__metadata__"),
    "not an object": ([1, 2], "JSON object"),
}


@pytest.mark.parametrize("error", [CheckpointError, HFCheckpointError])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_headers_are_refused_naming_the_file_and_tensor(tmp_path, case, error):
    header, match = HOSTILE[case]
    path = raw_file(tmp_path / "x.st", header, DATA)
    with pytest.raises(error, match=match) as e:
        st.SafetensorsFile(path, error)
    assert str(e.value).startswith(path) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("body, match", [
    (b"\x01\x00", "too short"),
    (struct.pack("<Q", 1 << 40), "absurd"),
    (struct.pack("<Q", 64) + b"{}", "runs past the end"),
    (struct.pack("<Q", 16) + b'{"a":{},"a":{}} ', "duplicate key"),
    (struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    (struct.pack("<Q", 8) + b"\xff\xfe{}    ", "not valid JSON"),
])
def test_broken_headers(tmp_path, body, match):
    (tmp_path / "x.st").write_bytes(body)
    with pytest.raises(CheckpointError, match=match):
        st.SafetensorsFile(tmp_path / "x.st")


def test_a_dtype_it_does_not_read_is_allowed_until_read(tmp_path):
    """A V4.1 folder's shards hold tensors of dtypes engram_stream never reads (or ones newer
    than this reader): the header is accepted, reading that tensor is refused."""
    header = {**GOOD, "q": entry("Q4_K_FUTURE", [5], 40, 40), "f": entry("F4", [4], 40, 42)}
    path = raw_file(tmp_path / "x.st", header, DATA + b"\0\0")
    for mmap in (False, True):
        with st.SafetensorsFile(path, HFCheckpointError, mmap=mmap) as f:
            assert np.array_equal(f.array("b"), [7, -8])
            for name, code in (("q", "Q4_K_FUTURE"), ("f", "F4")):
                with pytest.raises(HFCheckpointError, match=f"{name}.*{code}.*does not read"):
                    f.array(name)


def test_v41_loads_past_decoys_of_dtypes_it_does_not_read(tmp_path):
    from engram_stream import EngramConfig, EngramModel
    from test_v41_files import SMALL, _edit_header, _weight_map, inputs
    m = EngramModel.init(EngramConfig(**SMALL), seed=0)
    m.save(tmp_path)
    shard = tmp_path / _weight_map(tmp_path)["layers.1.engram.q_weight"]
    _edit_header(shard, lambda h: h.update({"layers.1.ffn.experts.w1": entry("Q4_K_FUTURE", [64, 64], 0, 0)}))
    ids, h = inputs(1)
    assert np.array_equal(EngramModel.from_deepseek_v41(tmp_path).forward(1, ids, h), m.forward(1, ids, h))


def test_layout_orders_by_element_size_and_page_aligns_the_first_table(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"i8": rng.integers(-9, 9, (5, 7)).astype(np.int8), "f32": rng.standard_normal(4).astype(np.float32),
              "table": rng.standard_normal((9, 4)).astype(np.float16), "i64": np.arange(3)}
    tensors = [st.Tensor.of(n, a) for n, a in arrays.items() if n != "table"]
    tensors.append(st.Tensor("table", "F16", (9, 4), lambda: (arrays["table"][i:i + 2] for i in range(0, 9, 2)),
                             page_align=True))
    path = str(tmp_path / "x.st")
    total = st.write(path, tensors, {"format": "test"})
    assert os.path.getsize(path) == total
    with st.SafetensorsFile(path, mmap=True) as f:
        starts = {n: t.start for n, t in f.tensors.items()}
        assert starts["table"] % 4096 == 0
        assert sorted(starts, key=starts.get) == ["i64", "f32", "table", "i8"]
        for n, a in arrays.items():
            assert np.array_equal(f.array(n), a) and f.array(n).dtype == a.dtype
    safe_open = pytest.importorskip("safetensors").safe_open
    with safe_open(path, "np") as g:   # the reference reader agrees
        assert all(np.array_equal(g.get_tensor(n), a) for n, a in arrays.items())


def test_the_writer_refuses_a_chunk_stream_that_disagrees_with_the_header(tmp_path):
    bad = st.Tensor("x", "F32", (4,), lambda: iter((np.zeros(3, np.float32),)))
    with pytest.raises(RuntimeError, match="wrote 12 bytes, the header says 16"):
        st.write(str(tmp_path / "x.st"), [bad])
    assert os.listdir(tmp_path) == []   # no file, no temp
    with pytest.raises(ValueError, match="cannot be written"):
        st.Tensor("y", "Q4_K", (1,), lambda: iter(()))
