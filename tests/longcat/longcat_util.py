"""Calls of an input-layer engine for the longcat tests: no hidden, float32[.., hidden_size] out.
An engine without the input-layer shape (EngineBase.out_shape) gets a zero hidden [.., 1, D]
it does not read, and its [.., 1, D] output is squeezed."""
from __future__ import annotations

import numpy as np


def _legacy(eng):
    return not hasattr(eng, "out_shape")


def _zeros(eng, lead):
    return np.zeros(tuple(lead) + (1, eng.model.cfg.hidden_size), np.float32)


def step(eng, ids, **kw):
    if not _legacy(eng):
        return eng.step(ids, **kw)
    lead = () if np.ndim(ids) == 0 else (np.shape(ids)[0],)
    return eng.step(ids, _zeros(eng, lead), **kw)[..., 0, :]


def step_packed(eng, ids, **kw):
    if not _legacy(eng):
        return eng.step_packed(ids, None, **kw)
    return eng.step_packed(ids, _zeros(eng, (len(ids),)), **kw)[:, 0]


def prefill(eng, ids, **kw):
    if not _legacy(eng):
        return eng.prefill(ids, **kw)
    return eng.prefill(ids, _zeros(eng, (len(ids),)), **kw)[:, 0]


def compute(eng, n):
    if not _legacy(eng):
        return eng.compute()
    return eng.compute(_zeros(eng, (n,) if n else ()))[..., 0, :]
