"""_records.records_to_bf16, the plugins' bf16 conversion of row records, on any strided
`out` (and records): the bytes equal the contiguous call's. Needs neither vLLM nor SGLang."""
from __future__ import annotations

import numpy as np
import pytest

from engram_stream.integrations._records import records_to_bf16

pytestmark = pytest.mark.native  # drives the C conversion: CI runs it again under ASan and clang

HD = 256           # V4.1's head_dim: a 264-byte record (256 e4m3 + 8 e8m0 bytes)


def _records(T, k, seed=0):
    rng = np.random.default_rng(seed)
    rec = rng.integers(0, 256, (T, k, HD + HD // 32), dtype=np.uint8)
    rec[..., HD:] = rng.integers(100, 150, (T, k, HD // 32), dtype=np.uint8)   # ordinary scales
    rec[0, 0, HD] = 0                                                            # and the zero scale
    return rec


@pytest.mark.parametrize("zero_scale", [0.0, 2.0 ** -127])
def test_strided_out_gets_the_contiguous_bytes(zero_scale):
    T, k = 5, 3
    rec = _records(T, k)
    want = np.empty((T, k, HD), np.uint16)
    records_to_bf16(rec, want, zero_scale)
    fill = np.uint16(0xABCD)
    views = {
        "out[::2]": (lambda: np.full((2 * T, k, HD), fill, np.uint16), lambda a: a[::2]),
        "out[:, 1:4]": (lambda: np.full((T, k + 3, HD), fill, np.uint16), lambda a: a[:, 1:1 + k]),
        "head_dim of a wider row": (lambda: np.full((T, k, 2 * HD), fill, np.uint16), lambda a: a[:, :, HD:]),
        "every other value": (lambda: np.full((T, k, 2 * HD), fill, np.uint16), lambda a: a[:, :, ::2]),
        "reversed": (lambda: np.full((T, k, HD), fill, np.uint16), lambda a: a[::-1, ::-1, ::-1]),
        "Fortran order": (lambda: np.full((T, k, HD), fill, np.uint16, order="F"), lambda a: a),
    }
    for name, (make, view) in views.items():
        base = make()
        out = view(base)
        assert not out.flags.c_contiguous, name
        before = base.copy()
        records_to_bf16(rec, out, zero_scale)
        assert out.tobytes() == want.tobytes(), name      # byte-exact, NaN bits included
        untouched = np.ones(base.shape, bool)
        view(untouched)[...] = False                      # what out does not view is left alone
        assert (base[untouched] == before[untouched]).all(), name
    raw = np.zeros(T * k * HD * 2 + 1, np.uint8)          # uint16 values at odd addresses
    out = np.ndarray((T, k, HD), np.uint16, raw.data, 1)
    assert not out.flags.aligned
    records_to_bf16(rec, out, zero_scale)
    assert out.tobytes() == want.tobytes() and raw[0] == 0


def test_strided_records_and_torch_views():
    """Records of any strides too; a bf16 torch tensor's strided view (the plugins' `out`)."""
    torch = pytest.importorskip("torch")
    T, k = 4, 2
    rec = _records(T, k, seed=1)
    want = np.empty((T, k, HD), np.uint16)
    records_to_bf16(rec, want)
    wide = np.zeros((T, 2 * k, HD + HD // 32 + 8), np.uint8)
    wide[:, ::2, 3:3 + HD + HD // 32] = rec
    got = np.empty((T, k, HD), np.uint16)
    records_to_bf16(wide[:, ::2, 3:3 + HD + HD // 32], got)
    assert got.tobytes() == want.tobytes()
    out = torch.zeros(2 * T, k, HD, dtype=torch.bfloat16)[::2]
    records_to_bf16(rec, out.view(torch.int16).numpy().view(np.uint16))
    assert out.contiguous().view(torch.int16).numpy().view(np.uint16).tobytes() == want.tobytes()


def test_mismatched_shapes_and_read_only_out_are_refused():
    rec = _records(2, 2)
    with pytest.raises(ValueError, match="do not match"):
        records_to_bf16(rec, np.empty((2, 3, HD), np.uint16)[:, :2, :HD - 32])
    ro = np.empty((2, 2, HD), np.uint16)
    ro.flags.writeable = False
    with pytest.raises((ValueError, TypeError)):
        records_to_bf16(rec, ro)
    records_to_bf16(rec[:0], np.empty((4, 2, HD), np.uint16)[:0:2])   # nothing to convert
