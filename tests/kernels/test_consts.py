"""The constants C, Cython and Python share have one source, include/engram_consts.h
(DESIGN.md section 8): the values Python sees equal the header's text."""
import pytest
import os
import re

import numpy as np

import engram_stream
from engram_stream import _hash
from engram_stream.demo import _engine
from engram_stream.demo import reference
from engram_stream.config import EngramConfig

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang


def header_values():
    path = os.path.join(engram_stream.get_include(), "engram_consts.h")
    with open(path) as f:
        text = f.read()
    return {m.group(1): m.group(2) for m in re.finditer(r"^#define ES_(\w+) +([0-9.eE+-]+)f?\b", text, re.M)}


def test_header_defines_every_shared_constant():
    assert set(header_values()) == {"MAX_NGRAM", "MAX_KERNEL_SIZE", "EPS_KEY", "EPS_CONV", "GATE_CLAMP",
                                    "PREFILL_CHUNK"}


def test_python_sees_the_header_values():
    h = header_values()
    for name in ("MAX_NGRAM", "MAX_KERNEL_SIZE", "PREFILL_CHUNK"):
        assert getattr(_hash, name) == int(h[name]), name
    for name in ("EPS_KEY", "EPS_CONV", "GATE_CLAMP"):  # float literals (the f suffix): float32 values
        assert getattr(_hash, name) == float(np.float32(float(h[name]))), name
    assert _hash.EPS_KEY == float(np.finfo(np.float32).eps)   # what the semantics pin (DESIGN.md 1.6)
    assert np.float32(_hash.EPS_CONV) == np.float32(1e-5)     # DESIGN.md 1.8
    assert np.float32(_hash.GATE_CLAMP) == np.float32(1e-6)   # DESIGN.md 1.6
    assert _engine.PREFILL_CHUNK == _hash.PREFILL_CHUNK
    assert (reference.EPS_F32, reference.EPS_CONV) == (_hash.EPS_KEY, _hash.EPS_CONV)


def test_config_bounds_come_from_the_header():
    h = header_values()
    EngramConfig(kernel_size=int(h["MAX_KERNEL_SIZE"]))
    for kw in (dict(kernel_size=int(h["MAX_KERNEL_SIZE"]) + 1),
               dict(max_ngram_size=int(h["MAX_NGRAM"]) + 1, engram_vocab_size=[11] * int(h["MAX_NGRAM"]))):
        try:
            EngramConfig(**kw)
        except ValueError:
            continue
        raise AssertionError(f"EngramConfig accepted {kw}")
