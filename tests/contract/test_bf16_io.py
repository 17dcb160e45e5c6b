"""bfloat16 in and out, every registered variant on every kernel path this CPU runs (DESIGN.md 14):
a bf16 hidden (an ml_dtypes array, or a torch bf16 tensor) is read in place by the tails, widened
exactly, and a bf16 out is the float32 result rounded to nearest even as it is stored. So a call
with bf16 hidden returns, bit for bit, the engine's own float32 call on the hidden widened to
float32, rounded to bf16 (ml_dtypes' rounding); a float32 out= of a bf16 hidden is that float32
call's result itself. Both within the oracle's tolerance (EngramModel.forward, the rounding's
half ulp of bf16 added). step, step_packed (prompt and decode segments, masked), prefill,
feed/compute, lookup_packed, the Decoder; an input layer (no hidden) writes bf16 where out= is."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from helpers.inputs import variant_inputs
from helpers.models import contract_model, contract_variants
from helpers.numeric import ATOL, RTOL

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]

BF16 = np.dtype(ml_dtypes.bfloat16)
S, T = 3, 9


@pytest.fixture(params=contract_variants(), scope="module")
def model(request):
    return contract_model(request.param)


def bits(a):
    return np.asarray(a).view(np.uint16)


def rounded(y32):
    """float32 results as bf16 bits, rounded as ml_dtypes rounds (the engine's own float32 result)."""
    assert y32.dtype == np.float32
    with np.errstate(invalid="ignore"):   # NaN casts quietly: the test of the rounding holds NaN
        return bits(y32.astype(BF16))


def inputs(model, seed=0):
    """ids [S, T]; hidden bf16 [S, T, G, D] and the same values in float32 (None for an input layer)."""
    ids, h = variant_inputs(model, seed, (S, T))
    if model.variant.input_layer:
        return ids, None, None
    hb = h[...].astype(BF16)
    return ids, hb, hb.astype(np.float32)


def at(h, *ix):
    return None if h is None else h[ix]


def test_each_call_in_bf16_is_the_float32_call_rounded(model):
    """Four engines fed the same tokens: bf16 hidden (bf16 result), bf16 hidden with float32
    out=, float32 hidden with bf16 out=, and the float32 call: bf16 results equal the float32
    one's rounding, float32 results equal it exactly, every call."""
    L = model.cfg.layer_ids[-1]
    ids, hb, h32 = inputs(model)
    f32, bb, bf, fb = (model.stream(L, n_streams=S) for _ in range(4))
    inp = model.variant.input_layer

    def check(call, n):
        """call(engine, hidden, out) on each engine; n: the call's tokens (None: one-stream form)."""
        want = call(f32, h32, None)
        assert want.dtype == np.float32
        shape = f32.out_shape(n)
        got = call(bb, hb, None)
        assert got.dtype == (np.float32 if inp else BF16)   # an input layer: float32 unless out= is bf16
        if not inp:
            assert np.array_equal(bits(got), rounded(want))
        got = call(bf, hb, np.empty(shape, np.float32))
        assert got.dtype == np.float32 and np.array_equal(got, want, equal_nan=True)
        got = call(fb, h32, np.empty(shape, BF16))
        assert got.dtype == BF16 and np.array_equal(bits(got), rounded(want))
        return want

    for s in range(S):   # a prompt of 4 tokens per stream
        want = check(lambda e, h, o: e.prefill(ids[s, :4], at(h, s, slice(0, 4)), stream=s, out=o), 4)
        forward = model.forward(L, ids[s:s + 1, :4], at(h32, slice(s, s + 1), slice(0, 4)))[0]
        np.testing.assert_allclose(want, forward, rtol=RTOL, atol=ATOL)
    check(lambda e, h, o: e.step(ids[:, 4], at(h, slice(None), 4), out=o), S)

    def fed(e, h, o):
        e.feed(ids[:, 5])
        return e.compute(at(h, slice(None), 5), out=o)
    check(fed, S)
    # a packed call: stream 2 decodes one token, stream 0 a chunk of 3 with one padding position
    pk = np.concatenate([ids[2, 6:7], ids[0, 6:9]])
    mask = np.array([False, False, True, False])

    def packed(e, h, o):
        hp = None if h is None else np.ascontiguousarray(np.concatenate([h[2, 6:7], h[0, 6:9]]))
        return e.step_packed(pk, hp, [2, 0], [1, 3], out=o, masked=mask)
    check(packed, 4)


def test_one_stream_form_and_the_oracle(model):
    """step(token_id, hidden[G, D]) on one stream, bf16 out held to the oracle on the bf16 inputs
    (its tolerance plus half a bf16 ulp)."""
    L = model.cfg.layer_ids[0]
    ids, hb, h32 = inputs(model, seed=1)
    eng, ref = model.stream(L), model.stream(L)
    outs = []
    for t in range(T):
        o = np.empty(eng.out_shape(), BF16)
        got = eng.step(int(ids[0, t]), at(hb, 0, t), out=o)
        assert got is o
        want = ref.step(int(ids[0, t]), at(h32, 0, t))
        assert np.array_equal(bits(got), rounded(want))
        outs.append(got.astype(np.float32))
    forward = model.forward(L, ids[:1], at(h32, slice(0, 1)))[0]
    np.testing.assert_allclose(np.stack(outs), forward, rtol=RTOL + 2.0 ** -8, atol=ATOL)


def test_hidden_and_out_are_read_and_written_in_place(model):
    """No copy: the hidden's own address is what the kernels get (float32 and bf16), and out= is
    the array written (and returned)."""
    L = model.cfg.layer_ids[0]
    ids, hb, h32 = inputs(model, seed=2)
    eng = model.stream(L, n_streams=S)
    for h in (hb, h32):
        for o in (np.empty(eng.out_shape(S), BF16), np.empty(eng.out_shape(S), np.float32)):
            hs = None if h is None else np.ascontiguousarray(h[:, 0])   # (h[:, 0] is strided: copied)
            got = eng.step(ids[:, 0], hs, out=o)
            assert got is o
            assert eng._hidden_address == (0 if hs is None else hs.ctypes.data)
            hp = at(h, 1)
            o = np.empty(eng.out_shape(T), o.dtype)
            assert eng.prefill(ids[1], hp, stream=1, out=o) is o
            assert eng._hidden_address == (0 if hp is None else hp.ctypes.data)
            eng.reset()


def test_torch_bf16_tensors_in_place(model):
    """A torch bf16 tensor (no buffer protocol, no DLPack bf16 in numpy) is read through a
    zero-copy view: its data_ptr reaches the kernels; a torch out= is written and returned."""
    torch = pytest.importorskip("torch")
    L = model.cfg.layer_ids[-1]
    ids, hb, h32 = inputs(model, seed=3)
    eng, ref = model.stream(L, n_streams=S), model.stream(L, n_streams=S)
    for t in range(3):
        th = None if hb is None else torch.from_numpy(hb[:, t].view(np.int16).copy()).view(torch.bfloat16)
        to = torch.empty(eng.out_shape(S), dtype=torch.bfloat16)
        got = eng.step(ids[:, t], th, out=to)
        assert got is to
        assert eng._hidden_address == (0 if th is None else th.data_ptr())
        want = ref.step(ids[:, t], at(h32, slice(None), t))
        assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), rounded(want))
    if hb is not None:   # a bf16 tensor as hidden, no out: a bf16 numpy result of the same bits
        th = torch.from_numpy(hb[:, 3].view(np.int16).copy()).view(torch.bfloat16)
        got = eng.step(ids[:, 3], th)
        assert got.dtype == BF16 and np.array_equal(bits(got), rounded(ref.step(ids[:, 3], h32[:, 3])))


def test_decoder_in_bf16(model):
    ids, hb, h32 = inputs(model, seed=4)
    a, b = model.decoder(n_streams=S), model.decoder(n_streams=S)
    for t in range(4):
        got = a.step(ids[:, t], {L: at(hb, slice(None), t) for L in model.cfg.layer_ids})
        want = b.step(ids[:, t], {L: at(h32, slice(None), t) for L in model.cfg.layer_ids})
        for L in model.cfg.layer_ids:
            assert (got[L].dtype == np.float32 and np.array_equal(got[L], want[L])) if hb is None else \
                np.array_equal(bits(got[L]), rounded(want[L]))
    a.begin(ids[:, 4])
    b.begin(ids[:, 4])
    for L in model.cfg.layer_ids:   # out= bf16 through Decoder.layer
        o = np.empty(a.engines[L].out_shape(S), BF16)
        assert a.layer(L, at(hb, slice(None), 4), out=o) is o
        assert np.array_equal(bits(o), rounded(b.layer(L, at(h32, slice(None), 4))))


def test_lookup_packed_in_bf16(model):
    """lookup_packed's rows rounded to bf16 (dtype="bfloat16", or a bf16 out=) equal its float32
    rows rounded; out= of another dtype than `dtype` is refused."""
    L = model.cfg.layer_ids[0]
    ids = variant_inputs(model, 5, (6,))[0]
    a, b, c = (model.stream(L, n_streams=2) for _ in range(3))
    st, ln = [1, 0], [4, 2]
    want = a.lookup_packed(ids, st, ln)
    assert want.dtype == np.float32
    got = b.lookup_packed(ids, st, ln, dtype="bfloat16")
    assert got.dtype == BF16 and np.array_equal(bits(got), rounded(want))
    o = np.empty(want.shape, BF16)
    assert c.lookup_packed(ids, st, ln, out=o) is o and np.array_equal(bits(o), rounded(want))
    with pytest.raises(ValueError, match="out is bfloat16 but dtype='float32'"):
        c.lookup_packed(ids, st, ln, out=o, dtype="float32")


def test_rounding_is_ml_dtypes_rounding():
    """Ties to even, NaN of either sign to the quiet NaN of its sign, inf, subnormals, the largest
    finite rounding to inf: the engine's float32 -> bf16 (lookup_packed of a table holding them)
    equals ml_dtypes' astype bit for bit."""
    model = contract_model("demo-v1")
    L = model.cfg.layer_ids[0]
    w = model.layers[L]
    special = np.array([0x3f808000, 0x3f818000, 0x3f80ffff, 0x3f807fff, 0x7f7fffff, 0xff7fffff, 0x7f800000,
                        0xff800000, 0x7fc00001, 0xffa00000, 0x7f800001, 0x00000001, 0x80008000, 0x00018000, 0,
                        0x80000000], np.uint32).view(np.float32)
    table = np.array(w.table, dtype=np.float32)
    table.reshape(-1)[:] = np.resize(special, table.size)
    from engram_stream import EngramModel
    m = EngramModel(model.cfg, model.plan, {**model.layers, L: w.replace(model.cfg, table=table)})
    ids = np.arange(40) % model.cfg.vocab_size
    want = m.stream(L).lookup_packed(ids, [0], [40])
    got = m.stream(L).lookup_packed(ids, [0], [40], dtype="bfloat16")
    assert np.isnan(want).any() and np.isinf(want).any()
    assert np.array_equal(bits(got), rounded(want))


def test_nan_and_inf_hidden_round_as_the_float32_call(model):
    """A hidden holding NaN and inf (a diverged model): the bf16 result is still the float32 call's
    rounded, bit for bit (NaN rounds to the quiet NaN of its sign in the vector stores too)."""
    if model.variant.input_layer:
        return   # no hidden: test_rounding_is_ml_dtypes_rounding holds its rounding
    L = model.cfg.layer_ids[0]
    ids, hb, h32 = inputs(model, seed=6)
    hb = hb.copy()
    hb[0, 1, 0, :3] = [np.nan, np.inf, -np.inf]
    hb[1, 2, -1, -1] = -np.nan
    hb[2, 3] = np.inf
    h32 = hb.astype(np.float32)
    a, b = model.stream(L, n_streams=S), model.stream(L, n_streams=S)
    nan_seen = False
    for t in range(T):
        got = a.step(ids[:, t], np.ascontiguousarray(hb[:, t]))
        want = b.step(ids[:, t], np.ascontiguousarray(h32[:, t]))
        assert np.array_equal(bits(got), rounded(want))
        nan_seen |= bool(np.isnan(want).any())
    assert nan_seen   # the NaN stores were exercised


def test_other_out_dtypes_are_refused():
    model = contract_model("demo-v1")
    eng = model.stream(model.cfg.layer_ids[0])
    h = np.zeros(eng.hidden_shape(), np.float32)
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous float32 or bfloat16 array"):
        eng.step(1, h, out=np.empty(eng.out_shape(), np.float16))
    assert eng.tokens_seen[0] == 0
