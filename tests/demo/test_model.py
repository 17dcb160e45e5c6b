"""EngramModel: init (graft zero init), from_reference / state_dict, forward input checks, and an
independent float64 per-token implementation of DESIGN.md 1.1-1.9 that model.forward (and so the
numpy oracle in reference.py) must match.

The independent implementation below uses Python ints for the hash and plain per-token float64
numpy for the float math; it shares no code with engram_stream beyond reading plan.primes and
plan.multipliers (themselves pinned independently in test_plan.py).
"""
from __future__ import annotations

import math
import mmap
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan
from pyref import py_rows

EPS32 = 1.1920928955078125e-07  # float32 machine epsilon (2**-23), torch RMSNorm's default eps
EPS_CONV = 1e-5                 # ShortConv's RMSNorm eps


def make_cfg(evs=(11, 13), n_head=2, n_embed=8, layers=(0, 3), vocab=20, pad=2, hidden=6, hc=2, K=3,
             seed=1):
    return EngramConfig(engram_vocab_size=list(evs), max_ngram_size=len(evs) + 1, n_embed_per_ngram=n_embed,
                        n_head_per_ngram=n_head, layer_ids=list(layers), pad_id=pad, seed=seed,
                        kernel_size=K, hidden_size=hidden, hc_mult=hc, vocab_size=vocab)


CFGS = {
    "n3_hc2_k3": make_cfg(),
    "n2_hc1_k1": make_cfg(evs=(17,), n_head=3, n_embed=6, layers=(5,), hidden=5, hc=1, K=1),
    "n4_hc3_k4": make_cfg(evs=(7, 7, 9), n_head=2, n_embed=4, layers=(2, 0), vocab=16, pad=0, hidden=4,
                          hc=3, K=4, seed=9),
    "n2_hc1_k5": make_cfg(evs=(5,), n_head=1, n_embed=3, layers=(1,), vocab=9, pad=8, hidden=3, hc=1, K=5),
}


def dense_lookup(vocab, m, seed):
    rng = np.random.default_rng(seed)
    return rng.permutation(np.concatenate([np.arange(m), rng.integers(0, m, vocab - m)])).astype(np.int64)


def ref_names(G):
    """DESIGN.md section 1: the demo module's per-layer state_dict names."""
    names = {"multi_head_embedding.embedding.weight", "multi_head_embedding.offsets", "value_proj.weight",
             "value_proj.bias", "short_conv.conv.weight"}
    for g in range(G):
        names |= {f"key_projs.{g}.weight", f"key_projs.{g}.bias", f"norm1.{g}.weight", f"norm2.{g}.weight",
                  f"short_conv.norms.{g}.weight"}
    return names


def exclusive_cumsum(primes_by_order):
    flat = [int(p) for heads in primes_by_order for p in heads]
    out, acc = [], 0
    for p in flat:
        out.append(acc)
        acc += p
    return out, acc


def random_state_dict(cfg, plan, L, rng):
    """A reference-layout state dict with random (non-unit) norm weights."""
    G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
    offsets, rows = exclusive_cumsum(plan.primes[L])
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    sd = {"multi_head_embedding.embedding.weight": f(rows, cfg.head_dim),
          "multi_head_embedding.offsets": np.array(offsets, np.int64),
          "value_proj.weight": f(D, E) * np.float32(0.5), "value_proj.bias": f(D) * np.float32(0.1),
          "short_conv.conv.weight": f(G * D, 1, K) * np.float32(0.5)}
    for g in range(G):
        sd[f"key_projs.{g}.weight"] = f(D, E) * np.float32(0.5)
        sd[f"key_projs.{g}.bias"] = f(D) * np.float32(0.1)
        sd[f"norm1.{g}.weight"] = (1 + 0.3 * f(D)).astype(np.float32)
        sd[f"norm2.{g}.weight"] = (1 + 0.3 * f(D)).astype(np.float32)
        sd[f"short_conv.norms.{g}.weight"] = (1 + 0.3 * f(D)).astype(np.float32)
    return sd


# --- the independent implementation -----------------------------------------------------------

def loop_forward(cfg, plan, L, sd, ids, hidden, lookup=None):
    """DESIGN.md 1.5-1.9 token by token in float64. Returns float64[B, T, G, D]."""
    G, D, K, dil = cfg.hc_mult, cfg.hidden_size, cfg.kernel_size, cfg.max_ngram_size
    d = {k: np.asarray(v, dtype=np.float64) for k, v in sd.items()}
    pad = cfg.pad_id if lookup is None else int(lookup[cfg.pad_id])
    rows = py_rows(ids, lookup, pad, plan.multipliers[L], plan.primes[L])
    offsets, _ = exclusive_cumsum(plan.primes[L])
    table = d["multi_head_embedding.embedding.weight"]
    conv_w = d["short_conv.conv.weight"]                       # [G*D, 1, K]
    B, T = len(ids), len(ids[0]) if len(ids) else 0
    v = np.zeros((B, T, G, D))
    x = np.zeros((B, T, G * D))
    for b in range(B):
        for t in range(T):
            e = np.concatenate([table[offsets[j] + rows[b][t][j]] for j in range(cfg.n_heads)])
            val = d["value_proj.weight"] @ e + d["value_proj.bias"]
            for g in range(G):
                k = d[f"key_projs.{g}.weight"] @ e + d[f"key_projs.{g}.bias"]
                k = k / math.sqrt(float(np.mean(k * k)) + EPS32) * d[f"norm1.{g}.weight"]
                h = np.asarray(hidden[b, t, g], dtype=np.float64)
                q = h / math.sqrt(float(np.mean(h * h)) + EPS32) * d[f"norm2.{g}.weight"]
                s = float(np.dot(k, q)) / math.sqrt(D)
                s = math.copysign(math.sqrt(max(abs(s), 1e-6)), s) if s != 0 else 0.0
                gate = 1.0 / (1.0 + math.exp(-s))
                v[b, t, g] = gate * val
                xv = v[b, t, g]
                x[b, t, g * D:(g + 1) * D] = xv / math.sqrt(float(np.mean(xv * xv)) + EPS_CONV) * \
                    d[f"short_conv.norms.{g}.weight"]
    out = np.zeros((B, T, G, D))
    for b in range(B):
        for t in range(T):
            for c in range(G * D):
                y = 0.0
                for i in range(K):
                    tt = t - (K - 1 - i) * dil
                    if tt >= 0:
                        y += conv_w[c, 0, i] * x[b, tt, c]
                silu = y / (1.0 + math.exp(-y))
                g, dd = divmod(c, D)
                out[b, t, g, dd] = v[b, t, g, dd] + silu
    return out


def assert_close_rel(got, want, rtol=1e-4):
    got = np.asarray(got, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 1e-2 * scale)


@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("compressed", [False, True])
def test_forward_matches_independent_loop(name, compressed):
    cfg = CFGS[name]
    rng = np.random.default_rng(10 * list(CFGS).index(name) + compressed)
    lookup = dense_lookup(cfg.vocab_size, max(1, cfg.vocab_size // 3), seed=7) if compressed else None
    plan = HashPlan(cfg, compression=lookup)
    sds = {L: random_state_dict(cfg, plan, L, rng) for L in cfg.layer_ids}
    model = EngramModel.from_reference(cfg, sds, compression=lookup)
    B, T = 2, 3 * cfg.conv_len + 4
    ids = rng.integers(0, cfg.vocab_size, (B, T))
    ids[0, :3] = cfg.vocab_size - 1
    hidden = rng.standard_normal((B, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    for L in cfg.layer_ids:
        got = model.forward(L, ids, hidden)
        assert got.dtype == np.float32 and got.shape == hidden.shape
        want = loop_forward(cfg, plan, L, sds[L], ids.tolist(), hidden, lookup)
        assert_close_rel(got, want)


def test_forward_independent_loop_injected_wrapping_multipliers():
    cfg = CFGS["n3_hc2_k3"]
    inj = {0: np.array([np.iinfo(np.int64).max, -1, 6], np.int64),
           3: np.array([np.iinfo(np.int64).min, 2 ** 62 + 1, -3], np.int64)}
    rng = np.random.default_rng(4)
    plan = HashPlan(cfg, multipliers=inj)
    sds = {L: random_state_dict(cfg, plan, L, rng) for L in cfg.layer_ids}
    model = EngramModel.from_reference(cfg, sds, multipliers=inj)
    ids = rng.integers(0, cfg.vocab_size, (2, 9))
    hidden = rng.standard_normal((2, 9, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    for L in cfg.layer_ids:
        assert_close_rel(model.forward(L, ids, hidden), loop_forward(cfg, plan, L, sds[L], ids.tolist(), hidden))


def _small_scale_case():
    """Tiny activations (mean squares ~1e-6): here the RMSNorm eps values matter."""
    cfg = CFGS["n3_hc2_k3"]
    rng = np.random.default_rng(8)
    plan = HashPlan(cfg)
    sds = {L: random_state_dict(cfg, plan, L, rng) for L in cfg.layer_ids}
    for sd in sds.values():
        for k in list(sd):
            if k.startswith(("key_projs", "value_proj")):
                sd[k] = (sd[k] * np.float32(2e-3)).astype(np.float32)
    model = EngramModel.from_reference(cfg, sds)
    ids = rng.integers(0, cfg.vocab_size, (2, 10))
    hidden = (rng.standard_normal((2, 10, cfg.hc_mult, cfg.hidden_size)) * 1e-3).astype(np.float32)
    return cfg, plan, sds, model, ids, hidden


def test_forward_matches_independent_loop_small_activations():
    cfg, plan, sds, model, ids, hidden = _small_scale_case()
    for L in cfg.layer_ids:
        assert_close_rel(model.forward(L, ids, hidden), loop_forward(cfg, plan, L, sds[L], ids.tolist(), hidden))


@pytest.mark.parametrize("eps_name", ["EPS32", "EPS_CONV"])
def test_small_activation_case_is_sensitive_to_eps(monkeypatch, eps_name):
    """Swapping either eps in the independent loop makes the small-activation comparison fail,
    so the test above really pins eps = float32 eps (keys/hidden) and 1e-5 (conv norm)."""
    cfg, plan, sds, model, ids, hidden = _small_scale_case()
    monkeypatch.setitem(globals(), eps_name, 1e-5 if eps_name == "EPS32" else EPS32)
    want = loop_forward(cfg, plan, 0, sds[0], ids.tolist(), hidden)
    with pytest.raises(AssertionError):
        assert_close_rel(model.forward(0, ids, hidden), want)


def test_forward_loop_detects_a_perturbation():
    """The comparison above can fail: a tiny change in one conv tap is visible."""
    cfg = CFGS["n3_hc2_k3"]
    rng = np.random.default_rng(0)
    plan = HashPlan(cfg)
    sds = {L: random_state_dict(cfg, plan, L, rng) for L in cfg.layer_ids}
    ids = rng.integers(0, cfg.vocab_size, (1, 12))
    hidden = rng.standard_normal((1, 12, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    want = loop_forward(cfg, plan, 0, sds[0], ids.tolist(), hidden)
    sds[0]["short_conv.conv.weight"] = sds[0]["short_conv.conv.weight"].copy()
    sds[0]["short_conv.conv.weight"][3, 0, 0] += 0.05
    got = EngramModel.from_reference(cfg, sds).forward(0, ids, hidden)
    with pytest.raises(AssertionError):
        assert_close_rel(got, want)


# --- init and graft zero init -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CFGS))
def test_graft_zero_init_output_is_exactly_zero(name):
    cfg = CFGS[name]
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (3, 11))
    hidden = (rng.standard_normal((3, 11, cfg.hc_mult, cfg.hidden_size)) * 5).astype(np.float32)
    zero = EngramModel.init(cfg, seed=3, graft_zero_init=True)
    live = EngramModel.init(cfg, seed=3, graft_zero_init=False)
    for L in cfg.layer_ids:
        z = zero.forward(L, ids, hidden)
        assert z.shape == hidden.shape and z.dtype == np.float32
        assert np.array_equal(z, np.zeros_like(z))
        out = live.forward(L, ids, hidden)
        assert np.all(np.isfinite(out)) and np.count_nonzero(out) > out.size // 2
        sd = zero.state_dict(L)
        assert not np.any(sd["value_proj.weight"]) and not np.any(sd["value_proj.bias"])
        assert np.any(live.state_dict(L)["value_proj.weight"])


def test_init_geometry_and_determinism():
    cfg = CFGS["n3_hc2_k3"]
    m = EngramModel.init(cfg, seed=0)
    G, D, E, K = 2, 6, 16, 3
    for L in cfg.layer_ids:
        sd = m.state_dict(L)
        assert set(sd) == ref_names(G)
        offsets, rows = exclusive_cumsum(m.plan.primes[L])
        assert sd["multi_head_embedding.embedding.weight"].shape == (rows, 4)
        assert np.asarray(sd["multi_head_embedding.offsets"]).tolist() == offsets
        assert sd["value_proj.weight"].shape == (D, E) and sd["value_proj.bias"].shape == (D,)
        assert sd["short_conv.conv.weight"].shape == (G * D, 1, K)
        for g in range(G):
            assert sd[f"key_projs.{g}.weight"].shape == (D, E)
            for n in ("norm1", "norm2", "short_conv.norms"):
                np.testing.assert_array_equal(sd[f"{n}.{g}.weight"], np.ones(D, np.float32))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, (1, 7))
    hidden = rng.standard_normal((1, 7, 2, 6)).astype(np.float32)
    a = m.forward(0, ids, hidden)
    assert np.array_equal(a, EngramModel.init(cfg, seed=0).forward(0, ids, hidden))
    assert not np.array_equal(a, EngramModel.init(cfg, seed=1).forward(0, ids, hidden))


# --- from_reference / state_dict round trip ------------------------------------------------------

@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("compressed", [False, True])
def test_state_dict_round_trip(name, compressed):
    cfg = CFGS[name]
    lookup = dense_lookup(cfg.vocab_size, 3, seed=2) if compressed else None
    m = EngramModel.init(cfg, seed=5, compression=lookup)
    sds = {L: {k: np.array(v, copy=True) for k, v in m.state_dict(L).items()} for L in cfg.layer_ids}
    m2 = EngramModel.from_reference(cfg, sds, compression=lookup)
    rng = np.random.default_rng(2)
    ids = rng.integers(-3, cfg.vocab_size, (2, 10))
    hidden = rng.standard_normal((2, 10, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    for L in cfg.layer_ids:
        assert np.array_equal(m.forward(L, ids, hidden), m2.forward(L, ids, hidden))
        for k, v in m2.state_dict(L).items():
            np.testing.assert_array_equal(v, sds[L][k])


def _good(cfg=None):
    cfg = cfg or CFGS["n3_hc2_k3"]
    m = EngramModel.init(cfg, seed=0)
    return cfg, {L: {k: np.array(v, copy=True) for k, v in m.state_dict(L).items()} for L in cfg.layer_ids}


@pytest.mark.parametrize("key", ["norm2.1.weight", "value_proj.bias", "short_conv.conv.weight",
                                 "multi_head_embedding.offsets", "key_projs.0.weight"])
def test_from_reference_missing_key(key):
    cfg, sds = _good()
    del sds[3][key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        EngramModel.from_reference(cfg, sds)


@pytest.mark.parametrize("key", ["key_projs.2.weight", "norm3.0.weight", "bogus"])
def test_from_reference_unexpected_key(key):
    cfg, sds = _good()
    sds[0][key] = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        EngramModel.from_reference(cfg, sds)


@pytest.mark.parametrize("key,fn", [
    ("value_proj.weight", lambda a: a.T),
    ("key_projs.1.weight", lambda a: a[:, :-1]),
    ("key_projs.0.bias", lambda a: a[:-1]),
    ("norm1.0.weight", lambda a: a[None]),
    ("short_conv.conv.weight", lambda a: a[:, 0, :]),                       # [G*D, K] instead of [G*D, 1, K]
    ("short_conv.conv.weight", lambda a: a.transpose(0, 2, 1)),
    ("multi_head_embedding.embedding.weight", lambda a: a[:-1]),
    ("multi_head_embedding.embedding.weight", lambda a: a[:, :-1]),
    ("multi_head_embedding.offsets", lambda a: a[:-1]),
])
def test_from_reference_misshaped(key, fn):
    cfg, sds = _good()
    sds[0][key] = fn(sds[0][key])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        EngramModel.from_reference(cfg, sds)


@pytest.mark.parametrize("delta", [1, -1])
def test_from_reference_wrong_offsets(delta):
    cfg, sds = _good()
    off = sds[3]["multi_head_embedding.offsets"].copy()
    off[-1] += delta
    sds[3]["multi_head_embedding.offsets"] = off
    with pytest.raises(ValueError, match=r"multi_head_embedding\.offsets"):
        EngramModel.from_reference(cfg, sds)


def test_from_reference_offsets_of_another_layer():
    cfg, sds = _good()
    sds[0]["multi_head_embedding.offsets"], sds[3]["multi_head_embedding.offsets"] = \
        sds[3]["multi_head_embedding.offsets"], sds[0]["multi_head_embedding.offsets"]
    with pytest.raises(ValueError):
        EngramModel.from_reference(cfg, sds)


@pytest.mark.parametrize("layers", [[0], [3], [0, 3, 4], [1, 3], []])
def test_from_reference_wrong_layer_set(layers):
    cfg, sds = _good()
    bad = {L: sds.get(L, sds[0]) for L in layers}
    with pytest.raises(ValueError, match="layer"):
        EngramModel.from_reference(cfg, bad)


def test_from_reference_non_dict_and_non_numeric():
    cfg, sds = _good()
    with pytest.raises(TypeError):
        EngramModel.from_reference(cfg, [sds[0], sds[3]])
    sds[0]["norm1.0.weight"] = np.array(["a"] * 6)
    with pytest.raises(TypeError, match=r"norm1\.0\.weight"):
        EngramModel.from_reference(cfg, sds)


def test_from_reference_accepts_float64_and_float16_arrays():
    cfg, sds = _good()
    ref = EngramModel.from_reference(cfg, sds)
    sd64 = {L: {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in sd.items()}
            for L, sd in sds.items()}
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 20, (1, 8))
    hidden = rng.standard_normal((1, 8, 2, 6)).astype(np.float32)
    m64 = EngramModel.from_reference(cfg, sd64)
    for L in cfg.layer_ids:
        assert np.array_equal(m64.forward(L, ids, hidden), ref.forward(L, ids, hidden))


def test_from_reference_torch_tensors():
    torch = pytest.importorskip("torch")
    cfg, sds = _good()
    ref = EngramModel.from_reference(cfg, sds)
    tsd = {}
    for L, sd in sds.items():
        tsd[L] = {}
        for k, v in sd.items():
            t = torch.from_numpy(np.array(v))
            if k.endswith("weight") and t.ndim == 2:           # a non-contiguous view with the right shape
                t = t.t().contiguous().t()
            if v.dtype == np.float32 and "norm" in k:          # parameters that require grad
                t = torch.nn.Parameter(t)
            tsd[L][k] = t
    m = EngramModel.from_reference(cfg, tsd)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 20, (2, 8))
    hidden = rng.standard_normal((2, 8, 2, 6)).astype(np.float32)
    for L in cfg.layer_ids:
        assert np.array_equal(m.forward(L, ids, hidden), ref.forward(L, ids, hidden))


def test_from_reference_torch_bfloat16():
    torch = pytest.importorskip("torch")
    cfg, sds = _good()
    tsd = {L: {k: (torch.from_numpy(v).to(torch.bfloat16) if v.dtype == np.float32 else torch.from_numpy(v))
               for k, v in sd.items()} for L, sd in sds.items()}
    m = EngramModel.from_reference(cfg, tsd)
    want = {L: {k: (torch.from_numpy(v).to(torch.bfloat16).float().numpy() if v.dtype == np.float32 else v)
                for k, v in sd.items()} for L, sd in sds.items()}
    ref = EngramModel.from_reference(cfg, want)
    ids = np.array([[1, 2, 3, 4]])
    hidden = np.ones((1, 4, 2, 6), np.float32)
    assert np.array_equal(m.forward(0, ids, hidden), ref.forward(0, ids, hidden))


# --- forward input checks -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    cfg = CFGS["n3_hc2_k3"]
    m = EngramModel.init(cfg, seed=2)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 20, (2, 7))
    hidden = rng.standard_normal((2, 7, 2, 6)).astype(np.float32)
    return cfg, m, ids, hidden


@pytest.mark.parametrize("shape", [(2, 7, 2, 5), (2, 7, 3, 6), (2, 7, 12), (2, 6, 2, 6), (1, 7, 2, 6),
                                   (2, 7, 2, 6, 1), (7, 2, 6)])
def test_forward_rejects_hidden_shapes(small, shape):
    cfg, m, ids, _ = small
    with pytest.raises(ValueError):
        m.forward(0, ids, np.zeros(shape, np.float32))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
def test_forward_rejects_non_float_hidden(small, dtype):
    cfg, m, ids, hidden = small
    with pytest.raises(TypeError):
        m.forward(0, ids, hidden.astype(dtype))


def test_forward_rejects_bad_ids(small):
    cfg, m, ids, hidden = small
    bad = ids.copy()
    bad[1, 4] = 20                                    # == vocab_size
    with pytest.raises(ValueError):
        m.forward(0, bad, hidden)
    with pytest.raises(TypeError):
        m.forward(0, ids.astype(np.float64), hidden)
    with pytest.raises(ValueError):
        m.forward(0, ids[0], hidden)                  # 1-d ids
    with pytest.raises(ValueError):
        m.forward(0, ids[:, :6], hidden)              # ids shape != hidden's [B, T]
    with pytest.raises(KeyError):
        m.forward(1, ids, hidden)                     # not an Engram layer


def test_forward_float64_and_float16_hidden_convert_to_float32(small):
    cfg, m, ids, hidden = small
    want = m.forward(0, ids, hidden)
    assert np.array_equal(m.forward(0, ids, hidden.astype(np.float64)), want)
    h16 = hidden.astype(np.float16)
    assert np.array_equal(m.forward(0, ids, h16), m.forward(0, ids, h16.astype(np.float32)))
    strided = np.zeros((2, 7, 2, 12), np.float32)
    strided[..., ::2] = hidden
    assert np.array_equal(m.forward(0, ids, strided[..., ::2]), want)
    assert np.array_equal(m.forward(0, ids.tolist(), hidden.tolist()), want)


def test_forward_does_not_modify_inputs(small):
    cfg, m, ids, hidden = small
    i0, h0 = ids.copy(), hidden.copy()
    m.forward(3, ids, hidden)
    np.testing.assert_array_equal(ids, i0)
    np.testing.assert_array_equal(hidden, h0)


def test_forward_nan_is_local(small):
    cfg, m, ids, hidden = small
    clean = m.forward(0, ids, hidden)
    t0, g0, dil, K = 1, 1, cfg.max_ngram_size, cfg.kernel_size
    h = hidden.copy()
    h[0, t0, g0, 2] = np.nan
    with np.errstate(invalid="ignore"):
        out = m.forward(0, ids, h)
    assert np.all(np.isnan(out[0, t0, g0]))                          # that token's stream: NaN
    np.testing.assert_array_equal(out[1], clean[1])                   # the other batch row: untouched
    np.testing.assert_array_equal(out[0, :t0], clean[0, :t0])         # earlier tokens: untouched
    np.testing.assert_array_equal(out[0, :, 0], clean[0, :, 0])       # the other stream: untouched
    # later tokens of stream g0: NaN exactly where the dilated causal conv reads x[t0]
    reach = {t0 + j * dil for j in range(K)}
    for t in range(t0 + 1, ids.shape[1]):
        if t in reach:
            assert np.all(np.isnan(out[0, t, g0])), t
        else:
            np.testing.assert_array_equal(out[0, t, g0], clean[0, t, g0])


# --- shared read-only --------------------------------------------------------------
LAYER_ARRAYS = ("offsets", "table", "proj_w", "proj_b", "key_w", "key_b", "value_w", "value_b", "norm1", "norm2",
                "conv_norm", "conv_w")


def _assert_read_only(a, what):
    assert isinstance(a, np.ndarray) and not a.flags.writeable, what
    with pytest.raises(ValueError, match="read-only"):
        a.reshape(-1)[:1] = 0


def test_model_and_plan_arrays_are_read_only():
    """Engines read these through raw pointers while they run: nobody may change them (a changed
    offset or fp constant sends an engine's reads outside the table)."""
    cfg = CFGS["n3_hc2_k3"]
    model = EngramModel.init(cfg, seed=0, compression=dense_lookup(cfg.vocab_size, 11, 0))
    plan = model.plan
    for L in cfg.layer_ids:
        w = model.layer(L)
        for name in LAYER_ARRAYS:
            _assert_read_only(getattr(w, name), f"layer {L} {name}")
        for i, a in enumerate(w.packed()):
            _assert_read_only(a, f"layer {L} packed[{i}]")
        for name in ("multipliers", "head_primes", "offsets", "head_fp"):
            _assert_read_only(getattr(plan, name)[L], f"plan.{name}[{L}]")
    _assert_read_only(plan.lookup, "plan.lookup")
    eng = model.stream(cfg.layer_ids[0])          # engines still build on read-only weights
    assert eng.step(3, np.ones((cfg.hc_mult, cfg.hidden_size), np.float32)).shape == (cfg.hc_mult, cfg.hidden_size)


def test_callers_arrays_keep_their_flags_and_small_ones_are_copied():
    cfg, sds = _good()
    mult = {L: np.array([3, 5, 7], np.int64) for L in cfg.layer_ids}
    model = EngramModel.from_reference(cfg, sds, multipliers=mult)
    for L in cfg.layer_ids:
        assert sds[L]["multi_head_embedding.embedding.weight"].flags.writeable   # the caller's, untouched
        mult[L][0] = 11                                                        # changing the caller's copy ...
        assert model.plan.multipliers[L].tolist() == [3, 5, 7]                 # ... does not reach the plan
    from engram_stream.demo.weights import LayerWeights
    w = model.layer(cfg.layer_ids[0])
    offsets = np.array(w.offsets)
    lw = LayerWeights(cfg, offsets, w.table, w.proj_w, w.proj_b, w.norm1, w.norm2, w.conv_norm, w.conv_w)
    offsets[:] = 10 ** 12
    assert lw.offsets.tolist() == w.offsets.tolist()


def _vm_flags(addr):
    """The VmFlags of the mapping holding addr (/proc/self/smaps), or None."""
    lo = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                lo = a <= addr < b
            elif lo and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                    reason="needs Linux's MADV_HUGEPAGE and /proc/self/smaps")
def test_large_packed_arrays_are_advised_huge_pages():
    """Panels of 2 MiB or more (the demo's 20 MiB) are streamed whole every step: their aligned
    2 MiB pages are advised MADV_HUGEPAGE ("hg" in the mapping's VmFlags), the partial tail not."""
    from engram_stream.demo.weights import HUGE_PAGE, aligned_zeros
    big = aligned_zeros((HUGE_PAGE // 4 * 3 + 100,), np.float32)
    assert big.ctypes.data % HUGE_PAGE == 0 and not big.any()
    assert "hg" in _vm_flags(big.ctypes.data)
    assert "hg" in _vm_flags(big.ctypes.data + 2 * HUGE_PAGE - 4096)      # the last whole huge page
    assert "hg" not in _vm_flags(big[-1:].ctypes.data)                     # the partial tail: 4 KiB pages
    assert aligned_zeros((1000, 16), np.float32).ctypes.data % 64 == 0   # small: numpy's heap, aligned


def test_packed_weights_start_on_a_64_byte_boundary():
    """numpy's allocator gives 16-byte alignment only; the engine's AVX-512 GEMM reads the packed
    panels in 64-byte rows (measured 1.6x slower steps when they were off a boundary)."""
    cfg = CFGS["n4_hc3_k4"]
    w = EngramModel.init(cfg, seed=0).layer(cfg.layer_ids[0])
    for _ in range(8):  # fresh copies: before, most landed 16, 32 or 48 bytes off
        for a in w.replace(cfg).packed():
            assert a.ctypes.data % 64 == 0 and not a.flags.writeable
    wp, bp, cw = w.packed()
    assert np.array_equal(cw, w.conv_w.T) and np.array_equal(bp[:w.proj_b.size], w.proj_b)
