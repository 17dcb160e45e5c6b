"""GGUF tables in the serving plugins' settings ({"tables": {"gguf": {"path": ...}}}), without vLLM
or SGLang: the lookup layer both plugins' embeddings call. Qwen4Exp's and LongCat's rows are served
as the bf16 rounding (nearest, ties to even) of gguf.quants.dequantize, bit for bit, from every read
of the GGUF; a V4.1 GGUF is served only as its raw 264-byte rows (the checkpoint's records, byte for
byte, through the eager lookup's conversion and the CUDA-graph host function alike); any other V4.1
type is refused when the settings are read, naming the type."""
from __future__ import annotations


import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # the test extra
torch = pytest.importorskip("torch")

from helpers.gguf_files import longcat_model, qwen_model, write_table_gguf  # noqa: E402

from engram_stream.integrations import serving  # noqa: E402
from engram_stream.integrations._records import gguf_to_bf16, records_to_bf16  # noqa: E402
from engram_stream.rows.gguf import E4M3_ROW_RECORD, record_type  # noqa: E402
from helpers.models import checkpoint_path, make_v41_model  # noqa: E402

pytestmark = pytest.mark.native
ENV = "ENGRAM_STREAM_VLLM"
READS = {"mapped": {}, "direct": {"read": "direct"}}


def bf16_of(f32):
    """bf16 bits of float32 values: round to nearest, ties to even (no NaN in these tables)."""
    u = np.ascontiguousarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-serving")
    out = {}
    for key, make in {"qwen": qwen_model, "longcat": longcat_model,
                      "v41": lambda: make_v41_model(seed=8, hd=256, D=32)}.items():
        m = make()
        out[key] = str(checkpoint_path(m, d, key))
        m.save(out[key])
    return out


class Table(serving.StreamVocabRows):
    """The served-table side of the plugins' PLE / n-gram embeddings, without the framework's class."""

    def __init__(self, model, layer):
        self.embedding_dim = model.cfg.head_dim
        self.stream_from(model, layer)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "IQ4_NL", "BF16", "F16", "Q5_1"])
def test_vocab_rows_are_the_bf16_rounding_of_dequantize(folders, tmp_path, name, monkeypatch):
    from engram_stream import EngramModel
    key = "longcat" if name == "Q5_1" else "qwen"
    path = tmp_path / "t.gguf"
    deq = write_table_gguf(path, EngramModel.load(folders[key]), name, seed=3, split=key == "longcat")
    rng = np.random.default_rng(1)
    for read, kw in READS.items():
        if key == "longcat" and read == "direct":
            continue   # a table in parts is read mapped only
        for cache in (0, 0.05):
            monkeypatch.setattr(serving, "_models", {})
            s = serving.parse_settings({"checkpoint": folders[key], "row_cache_mb": cache,
                                        "tables": {"gguf": {"path": str(path), **kw}}}, ENV)
            model = serving.open_model(s, None, ENV)
            for L in model.cfg.layer_ids:
                t = Table(model, L)
                assert t.gguf_type == record_type(f"gguf:{name}") >= 0
                ids = rng.integers(0, model.plan.table_rows[L], 300)
                rec = None
                for sub in (ids, ids[:7], ids):   # cold, fewer rows, warm (a row cache)
                    got = t.gguf_rows(sub, torch)
                    assert got.dtype == torch.bfloat16 and got.shape == (len(sub), model.cfg.head_dim)
                    np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), bf16_of(deq[L][sub]))
                    rec = t._gguf_scratch.rec if rec is None else rec
                    assert t._gguf_scratch.rec is rec   # the records' buffer: the first call's, kept


def test_gguf_to_bf16_rounds_ties_to_even_and_checks_shapes():
    q = record_type("gguf:F32")
    vals = np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, np.inf, -0.0, 3e38, 1e-40]],
                    np.float32)
    out = np.empty((1, 8), np.uint16)
    gguf_to_bf16(q, vals.view(np.uint8), out)
    np.testing.assert_array_equal(out, bf16_of(vals))
    assert out[0, 0] == 0x3F80 and out[0, 1] == 0x3F82   # ties: to the even neighbour
    with pytest.raises(ValueError, match=r"records \(1, 32\) do not match out \(1, 7\)"):
        gguf_to_bf16(q, vals.view(np.uint8), np.empty((1, 7), np.uint16))
    with pytest.raises(ValueError, match="GGUF type 99 is not one the decoders serve"):
        gguf_to_bf16(99, vals.view(np.uint8), out)


def test_v41_is_served_from_raw_rows_byte_for_byte(folders, tmp_path, monkeypatch):
    from engram_stream import EngramModel
    from engram_stream.integrations._vllm_graph import HostLookup
    ref = EngramModel.load(folders["v41"])
    path = tmp_path / "e4m3.gguf"
    write_table_gguf(path, ref, "E4M3", seed=5)
    r = gguf.GGUFReader(str(path))
    raw = {int(t.name.split(".")[1]): np.asarray(t.data).view(np.uint8).reshape(-1, 264) for t in r.tensors
           if t.name.endswith("engram_embd.weight")}
    rng = np.random.default_rng(2)
    for read, kw in READS.items():
        monkeypatch.setattr(serving, "_models", {})
        s = serving.parse_settings({"checkpoint": folders["v41"], "tables": {"gguf": {"path": str(path), **kw}}}, ENV)
        model = serving.open_model(s, None, ENV, variant="deepseek-v4.1")
        for L in model.cfg.layer_ids:
            emb = serving.StreamRows()
            emb.stream_from(model, L)
            assert emb.recbytes == 264 and emb.source.record_format == E4M3_ROW_RECORD
            ids = rng.integers(-1, model.plan.table_rows[L], (6, 4)).astype(np.int64)
            rec = np.empty((6, 4, 264), np.uint8)
            emb.source.read_into(ids, rec)   # what the eager lookups read (uint8 out: these bytes)
            want = np.where((ids >= 0)[..., None], raw[L][np.maximum(ids, 0)], 0)
            np.testing.assert_array_equal(rec, want)
            bf = np.empty((6, 4, 256), np.uint16)
            records_to_bf16(rec, bf)
            # the CUDA-graph host function: the same records, the same bf16 rows
            staging = np.zeros((6, 4, 256), np.uint16)
            hl = HostLookup(model.row_source(L), ids, staging, 0, model.plan.table_rows[L])
            hl.run()
            hl.check()
            np.testing.assert_array_equal(staging, bf)
            staging8 = np.zeros((6, 4, 264), np.uint8)
            HostLookup(model.row_source(L), ids, staging8, 0, model.plan.table_rows[L]).run()
            np.testing.assert_array_equal(staging8, want)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_a_v41_gguf_of_another_type_is_refused_at_settings(folders, tmp_path, name, monkeypatch):
    from engram_stream import EngramModel
    path = tmp_path / "q.gguf"
    write_table_gguf(path, EngramModel.load(folders["v41"]), name)
    with pytest.raises(ValueError, match=rf'^{ENV}: "tables" names the GGUF .*q\.gguf\', whose deepseek-v4\.1 table '
                                         rf'blk\.\d+\.engram_embd\.weight is {name} .*consume the records '
                                         rf"e4m3\+e8m0, gguf:E4M3_ROW, served from a GGUF only as they are"):
        serving.parse_settings({"tables": {"gguf": {"path": str(path)}}}, ENV)
    # a model opened by other means: its V4.1 embedding refuses the rows too
    monkeypatch.setattr(serving, "_models", {})
    from engram_stream.rows import GGUFTier
    model = EngramModel.load(folders["v41"], tables=GGUFTier(path))
    with pytest.raises(ValueError, match=rf"gguf:{name} rows; a deepseek-v4\.1 embedding consumes the records e4m3\+e8m0, gguf:E4M3_ROW"):
        serving.StreamRows().stream_from(model, model.cfg.layer_ids[0])


def test_bad_gguf_settings_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match=rf'^{ENV}: "tables" .*read= must be one of'):
        serving.parse_settings({"tables": {"gguf": {"path": "x.gguf", "read": "lazy"}}}, ENV)
    with pytest.raises(ValueError, match=rf"^{ENV}: \"tables\" .*the arguments are \('path', 'read'"):
        serving.parse_settings({"tables": {"gguf": {"file": "x.gguf"}}}, ENV)
    with pytest.raises(ValueError, match=rf"^{ENV}: \"tables\" names the GGUF '.*nothing\.gguf'"):
        serving.parse_settings({"tables": {"gguf": {"path": str(tmp_path / "nothing.gguf")}}}, ENV)
    with pytest.raises(ValueError, match=r'"tables" must be "mapped", "direct" or \{"gguf"'):
        serving.parse_settings({"tables": {"gguf": {}, "x": 1}}, ENV)
