"""Properties and a bounded fuzz run (issue: hardening).

- save -> load -> the same outputs, over random configs and table dtypes (hypothesis);
- mutated checkpoint files: every load either fails with a CheckpointError naming the
  problem, or yields a model whose engine decodes equal to its own batch path: never a
  crash, never another exception type.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_stream import EngramConfig, EngramModel
from engram_stream.errors import CheckpointError

pytest.importorskip("safetensors")


@st.composite
def configs(draw):
    n = draw(st.integers(2, 4))
    nh = draw(st.integers(1, 3))
    return EngramConfig(
        engram_vocab_size=draw(st.lists(st.integers(2, 60), min_size=n - 1, max_size=n - 1)),
        max_ngram_size=n, n_embed_per_ngram=nh * draw(st.integers(1, 4)), n_head_per_ngram=nh,
        layer_ids=draw(st.lists(st.integers(0, 9), min_size=1, max_size=2, unique=True)),
        pad_id=draw(st.integers(0, 29)), seed=draw(st.integers(0, 5)), kernel_size=draw(st.integers(1, 4)),
        hidden_size=draw(st.integers(1, 12)), hc_mult=draw(st.integers(1, 3)), vocab_size=30)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=configs(), dtype=st.sampled_from([None, "float16", "int8"]), mmap=st.booleans(),
       seed=st.integers(0, 2**16))
def test_save_load_same_outputs(tmp_path_factory, cfg, dtype, mmap, seed):
    model = EngramModel.init(cfg, seed=seed)
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    model.save(path, table_dtype=dtype)
    back = EngramModel.load(path, mmap=mmap)
    assert back.cfg == cfg
    rng = np.random.default_rng(seed)
    T = 7
    ids = rng.integers(-2, cfg.vocab_size, (1, T))
    hid = rng.standard_normal((1, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    for L in cfg.layer_ids:
        ref = back.forward(L, ids, hid)[0]
        if dtype is None:  # float32 tables: bit-identical to the saved model
            assert np.array_equal(ref, model.forward(L, ids, hid)[0])
        eng = back.stream(L)
        got = np.stack([eng.step(int(ids[0, t]), hid[0, t]) for t in range(T)])
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


CFG = EngramConfig(engram_vocab_size=[31, 37], max_ngram_size=3, n_embed_per_ngram=8, n_head_per_ngram=2,
                   layer_ids=[1, 2], pad_id=1, kernel_size=3, hidden_size=8, hc_mult=2, vocab_size=40)


def _mutations(raw: bytes, rng, n):
    hlen = int.from_bytes(raw[:8], "little")
    for i in range(n):
        b = bytearray(raw)
        kind = i % 6
        if kind == 0:      # flip bytes in the JSON header
            for _ in range(rng.integers(1, 4)):
                b[8 + rng.integers(0, hlen)] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:    # flip bytes anywhere in the data (weights, integers, offsets, primes)
            for _ in range(rng.integers(1, 8)):
                b[8 + hlen + rng.integers(0, len(raw) - 8 - hlen)] ^= 1 << int(rng.integers(0, 8))
        elif kind == 2:    # truncate
            b = b[:rng.integers(0, len(raw))]
        elif kind == 3:    # a different header length
            b[:8] = int(rng.choice([0, 1, hlen - 8, hlen + 8, len(raw), 2**40, 2**63 - 1])).to_bytes(8, "little")
        elif kind == 4:    # replace a digit in the header (shapes, offsets, config values)
            digits = [j for j in range(8, 8 + hlen) if chr(b[j]).isdigit()]
            j = digits[rng.integers(0, len(digits))]
            b[j] = ord(str(rng.integers(0, 10)))
        else:              # garbage appended or inserted
            at = rng.integers(0, len(raw))
            b = b[:at] + bytes(rng.integers(0, 256, rng.integers(1, 64)).astype(np.uint8)) + b[at:]
        yield kind, bytes(b)


def _moderate(w, limit=1e4):
    arrays = (w.table, w.proj_w, w.proj_b, w.norm1, w.norm2, w.conv_norm, w.conv_w)
    with np.errstate(invalid="ignore"):
        return all(np.isfinite(a).all() and np.abs(a.astype(np.float32)).max() < limit for a in arrays)


def test_fuzz_mutated_checkpoints(tmp_path):
    model = EngramModel.init(CFG, seed=3, compression=np.arange(40) % 23)
    src = tmp_path / "good.safetensors"
    model.save(src)
    raw = src.read_bytes()
    rng = np.random.default_rng(12345)
    loaded = refused = compared = 0
    ids = rng.integers(0, 40, (1, 6))
    hid = rng.standard_normal((1, 6, CFG.hc_mult, CFG.hidden_size)).astype(np.float32)
    for i, (kind, data) in enumerate(_mutations(raw, rng, 300)):
        p = tmp_path / f"m{i}.safetensors"
        p.write_bytes(data)
        try:
            m = EngramModel.load(p, mmap=bool(i % 2))
        except CheckpointError as e:
            assert str(e), "an error must say what is wrong"
            refused += 1
            continue
        loaded += 1  # a mutation the format cannot see (a weight's bits): decoding must still be sane
        for L in m.cfg.layer_ids:
            with np.errstate(all="ignore"):
                ref = m.forward(L, ids, hid)[0]
            eng = m.stream(L)
            got = np.stack([eng.step(int(ids[0, t]), hid[0, t]) for t in range(6)])
            assert got.shape == ref.shape and got.dtype == np.float32
            if _moderate(m.layer(L)):  # near FLT_MAX, overflow depends on summation order
                np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, equal_nan=True)
                compared += 1
        del m
        p.unlink()
    assert refused > 100 and loaded > 10 and compared > 10, (refused, loaded, compared)
