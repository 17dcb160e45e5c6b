"""The engine base's argument checks (engram_stream/engine/args.py, engine/_base.pyx) on every
registered variant: ids past the vocabulary or past int64, bool ids and streams, bad shapes,
dtypes and outputs, engines of a missing layer or no streams; each refused with the state
unchanged, so the sequences go on as if the call had not been made. The hidden states' own
checks and conversions (float64, strided, lists, NaN and inf) run on the variants that take a
hidden: an input layer (longcat-flash-lite) takes none, and refuses one
(tests/contract/test_input_layer.py)."""
from __future__ import annotations

import numpy as np
import pytest

from engram_stream import kernel_isa, variants
from helpers.inputs import out_shape, variant_hidden, variant_ids, variant_inputs
from helpers.models import contract_model, contract_variants
from helpers.numeric import close

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

VARIANTS = contract_variants()   # every registered variant
WITH_HIDDEN = [v for v in VARIANTS if not variants.get(v).input_layer]   # the residual layers


@pytest.fixture(params=VARIANTS, scope="module")
def model(request):
    return contract_model(request.param)


@pytest.fixture(params=WITH_HIDDEN, scope="module")
def residual(request):
    return contract_model(request.param)


def _layer(model):
    return model.cfg.layer_ids[-1]


def _readonly(shape):
    a = np.zeros(shape, np.float32)
    a.flags.writeable = False
    return a


def _hidden(model, *lead):
    """Zeros of the hidden an engine of `model` takes for `lead` tokens (None: an input layer)."""
    if model.variant.input_layer:
        return None
    return np.zeros(tuple(lead) + (model.cfg.hc_mult, model.cfg.hidden_size), np.float32)


def _stepped(model, S=3, n=4, seed=0, T=20):
    """An S-stream engine that has stepped n tokens of its inputs, the inputs and the oracle."""
    L = _layer(model)
    ids, hid = variant_inputs(model, seed, (S, T))
    eng = model.stream(L, S)
    for t in range(n):
        eng.step(ids[:, t], hid[:, t])
    return eng, ids, hid, model.forward(L, ids, hid[...])


def _continues(eng, ids, hid, want, t0, n=6):
    """The engine's next n steps from token t0 are the oracle's: nothing was changed."""
    for t in range(t0, t0 + n):
        close(eng.step(ids[:, t], hid[:, t]), want[:, t])


def _each_refused_state_unchanged(eng, bad_calls):
    """Each (exception, call) raises its exception and leaves the 3 streams at 3 tokens, nothing fed."""
    for i, (exc, call) in enumerate(bad_calls):
        with pytest.raises(exc):
            call()
        assert not eng.pending_compute, i
        assert eng.tokens_seen.tolist() == [3, 3, 3], i


def test_out_of_vocab_id_refused_state_unchanged(model):
    V = model.cfg.vocab_size
    eng, ids, hid, want = _stepped(model, seed=1)
    for bad in (V, V + 1000, np.iinfo(np.int64).max):
        bad_ids = ids[:, 4].copy()
        bad_ids[1] = bad
        with pytest.raises(ValueError, match="vocab"):
            eng.step(bad_ids, hid[:, 4])
        with pytest.raises(ValueError, match="vocab"):
            eng.feed(bad_ids)
        assert not eng.pending_compute
        with pytest.raises(ValueError, match="vocab"):
            eng.prefill(np.array([1, 2, bad, 3]), _hidden(model, 4), stream=2)
    assert eng.tokens_seen.tolist() == [4, 4, 4]
    _continues(eng, ids, hid, want, 4)
    one = model.stream(_layer(model))
    with pytest.raises(ValueError):
        one.step(V, _hidden(model))
    assert one.tokens_seen.tolist() == [0]


def test_huge_scalar_id_is_a_value_error(model):
    """A scalar id past int64 is a ValueError (not an OverflowError), in the oracle too."""
    eng, h = model.stream(_layer(model)), _hidden(model)
    with pytest.raises(ValueError):
        model.forward(_layer(model), np.array([[2**63]], dtype=np.uint64), None if h is None else h[None, None])
    with pytest.raises(ValueError):
        eng.step(2**63, h)
    with pytest.raises(ValueError):
        eng.step(np.uint64(2**63), h)
    assert eng.tokens_seen.tolist() == [0]


def test_bool_ids_and_streams_refused(model):
    """A bool is no id and no stream (prefill's stream was an int64_t argument: True became 1)."""
    L, h = _layer(model), _hidden(model)
    one = model.stream(L)
    for tok in (True, False, np.bool_(True), np.array([True])):
        with pytest.raises(TypeError):
            one.step(tok, h if np.ndim(tok) == 0 or h is None else h[None])
    assert one.tokens_seen.tolist() == [0]
    eng = model.stream(L, 2)
    with pytest.raises(TypeError):
        eng.reset(True)
    with pytest.raises(TypeError):
        eng.prefill([1, 2], _hidden(model, 2), stream=True)
    assert eng.tokens_seen.tolist() == [0, 0]


def test_engine_construction_errors(model):
    missing = max(model.cfg.layer_ids) + 1
    with pytest.raises(KeyError):
        model.stream(missing)
    with pytest.raises(KeyError):
        model.stream(str(model.cfg.layer_ids[0]))
    L = _layer(model)
    for S in (0, -1):
        with pytest.raises(ValueError):
            model.stream(L, S)
    eng = model.stream(L, 2)
    assert eng.n_streams == 2 and eng.layer == L and eng.model is model
    assert repr(eng).startswith(type(eng).__name__)
    assert repr(eng).endswith(f"isa={kernel_isa()!r})")  # the kernel path it runs


def test_bad_ids_streams_and_outputs_refused_state_unchanged(model):
    eng, ids_all, hid_all, want = _stepped(model, n=3, seed=2)
    ids, hid = ids_all[:, 3], hid_all[:, 3]
    out = out_shape(model, 3)
    bad_calls = [
        (ValueError, lambda: eng.step(ids[:2], hid)),                   # wrong number of ids
        (ValueError, lambda: eng.step(np.append(ids, 1), hid)),
        (ValueError, lambda: eng.step(ids[None], hid)),                 # 2-d ids
        (ValueError, lambda: eng.step(5, hid)),                         # scalar id, 3 streams
        (TypeError, lambda: eng.step(ids.astype(np.float64), hid)),     # float ids
        (TypeError, lambda: eng.step(ids.astype(bool), hid)),           # bool ids
        (TypeError, lambda: eng.step(["a", "b", "c"], hid)),
        (ValueError, lambda: eng.prefill(ids[None], _hidden(model, 3), stream=0)),    # 2-d ids
        (IndexError, lambda: eng.prefill(ids, _hidden(model, 3), stream=3)),          # missing stream
        (IndexError, lambda: eng.prefill(ids, _hidden(model, 3), stream=-1)),
        (IndexError, lambda: eng.reset(3)),                             # missing stream
        (IndexError, lambda: eng.reset(-1)),
        (TypeError, lambda: eng.reset("0")),
        (TypeError, lambda: eng.reset(True)),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty(out, np.float64))),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty(out[:-1] + (out[-1] + 1,), np.float32))),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty(int(np.prod(out)), np.float32))),  # flat
        (ValueError, lambda: eng.step(ids, hid, out=np.empty(out[:-1] + (2 * out[-1],), np.float32)[..., ::2])),
        (ValueError, lambda: eng.step(ids, hid, out=np.empty(out[::-1], np.float32).T)),
        (ValueError, lambda: eng.step(ids, hid, out=_readonly(out))),
        (ValueError, lambda: eng.step(ids, hid, out=np.zeros(out).tolist())),
        (ValueError, lambda: eng.prefill(ids, _hidden(model, 3), stream=0, out=np.empty(out, np.float64))),
        (ValueError, lambda: eng.prefill(ids, _hidden(model, 3), stream=0, out=_readonly(out))),
        (ValueError, lambda: eng.feed(ids[:1])),
        (TypeError, lambda: eng.feed(True)),
    ]
    _each_refused_state_unchanged(eng, bad_calls)
    eng.feed(ids)
    for exc, call in [(ValueError, lambda: eng.compute(hid, out=_readonly(out))),
                      (ValueError, lambda: eng.compute(hid, out=np.empty(out, np.float16)))]:
        with pytest.raises(exc):
            call()
    assert eng.pending_compute
    close(eng.compute(hid), want[:, 3])
    _continues(eng, ids_all, hid_all, want, 4)


# ---- the hidden states of a residual layer ------------------------------------------------------
def test_bad_hidden_refused_state_unchanged(residual):
    eng, ids_all, hid_all, want = _stepped(residual, n=3, seed=3)
    ids, hid = ids_all[:, 3], hid_all[:, 3]
    bad_calls = [
        (ValueError, lambda: eng.step(ids, hid[:, :, :-1])),            # wrong D
        (ValueError, lambda: eng.step(ids, hid[0])),                    # wrong ndim
        (ValueError, lambda: eng.step(ids, hid[None])),
        (TypeError, lambda: eng.step(ids, hid.astype(np.int32))),       # int hidden
        (TypeError, lambda: eng.step(ids, hid.astype(bool))),
        (ValueError, lambda: eng.step(5, hid[0])),                      # scalar id and one stream's hidden, 3 streams
        (ValueError, lambda: eng.prefill(ids, hid[:2], stream=0)),      # lengths disagree
        (ValueError, lambda: eng.prefill(ids, hid[:, 0], stream=0)),    # hidden ndim
    ]
    _each_refused_state_unchanged(eng, bad_calls)
    eng.feed(ids)
    with pytest.raises(TypeError):
        eng.compute(hid.astype(np.int64))
    close(eng.compute(hid), want[:, 3])
    _continues(eng, ids_all, hid_all, want, 4)


def test_compute_hidden_shapes_single_stream(residual):
    L = _layer(residual)
    ids, hid = variant_inputs(residual, 9, (1, 6))
    want = residual.forward(L, ids, hid)[0]
    eng = residual.stream(L)
    for t in range(6):
        eng.feed(int(ids[0, t]) if t % 2 else ids[0, t:t + 1])
        got = eng.compute(hid[0, t] if t % 3 else hid[0, t:t + 1])
        close(got.reshape(want[t].shape), want[t])


def test_hidden_conversions_same_result(residual):
    """float64, strided, Fortran-ordered and list hidden states give the bits of float32 C order."""
    L = _layer(residual)
    G, D = residual.cfg.hc_mult, residual.cfg.hidden_size
    ids, hid = variant_inputs(residual, 10, (3, 12))
    want = residual.forward(L, ids, hid)
    engines = [residual.stream(L, 3) for _ in range(5)]
    wide = np.zeros((3, 12, G, 2 * D), np.float32)
    wide[..., ::2] = hid
    for t in range(12):
        h = hid[:, t]
        forms = [h, h.astype(np.float64), wide[:, t, :, ::2], np.asfortranarray(h), h.tolist()]
        assert not forms[2].flags.c_contiguous and not forms[3].flags.c_contiguous
        outs = [e.step(ids[:, t], f) for e, f in zip(engines, forms)]
        close(outs[0], want[:, t])
        for x in outs[1:]:
            np.testing.assert_array_equal(x, outs[0])
    close(residual.forward(L, ids, hid.astype(np.float64)), want)   # the oracle converts float64 alike
    p = residual.stream(L, 3)
    np.testing.assert_array_equal(p.prefill(ids[2], wide[2, :, :, ::2].astype(np.float64), stream=2),
                                  residual.stream(L, 3).prefill(ids[2], hid[2], stream=2))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the oracle's overflow/invalid warnings
def test_nan_inf_hidden_propagate_like_batch(residual):
    L = _layer(residual)
    G = residual.cfg.hc_mult
    rng = np.random.default_rng(11)
    ids = variant_ids(residual, rng, (4, 45), p_dead=0)   # no dead token: a poisoned hidden reaches the output
    hid = variant_hidden(residual, rng, (4, 45))
    hid[1, 5, 0, 3] = np.nan
    hid[2, 8, G - 1, :] = np.inf
    hid[3, 10, G // 2, 0] = -np.inf
    hid[3, 11, G // 2, 1] = 1e30                       # large but finite
    want = residual.forward(L, ids, hid)
    assert np.isnan(want[1, 5]).any() and np.isnan(want[2, 8]).any()
    eng = residual.stream(L, 4)
    got = np.stack([eng.step(ids[:, t], hid[:, t]) for t in range(45)], axis=1)
    close(got, want, equal_nan=True)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isfinite(got[0]).all()                                  # other streams unaffected
    assert np.isfinite(got[1, :5]).all() and np.isfinite(got[1, -3:]).all()  # a stream recovers
    close(residual.stream(L, 4).prefill(ids[2], hid[2], stream=3), want[2], equal_nan=True)
