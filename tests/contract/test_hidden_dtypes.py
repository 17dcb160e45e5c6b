"""Hidden states in other float dtypes, every variant: bfloat16 (an ml_dtypes array: a bf16
model's stream) is read in place and widened exactly, its result returned in bfloat16: exactly
float32 input of the same values rounded to nearest even (tests/contract/test_bf16_io.py has
every variant and kernel path); float16/float64 are converted, so every path returns exactly what
float32 input of the same values gives: model.forward, an engine's step (one stream and
several), prefill, feed/compute, and the Decoder. Anything else is refused, naming the dtype,
with no change."""
import ml_dtypes
import numpy as np
import pytest

from helpers.models import make_model
from engram_stream import EngramConfig, EngramModel

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

BF16 = np.dtype(ml_dtypes.bfloat16)
V41 = dict(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=64,
           n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
           image_token_id=299)


@pytest.fixture(scope="module", params=["demo-v1", "deepseek-v4.1"])
def model(request):
    if request.param == "demo-v1":
        return make_model(G=2, n=3, K=3, D=24, vocab=300, comp=True)
    return EngramModel.init(EngramConfig(**V41), seed=2)


def inputs(model, S, T, dtype, seed=0):
    """ids int64[S, T] (image tokens among them for V4.1) and hidden [S, T, G, D] of `dtype`, whose
    values are bf16-representable, with the same values as float32."""
    cfg, rng = model.cfg, np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (S, T))
    if cfg.variant == "deepseek-v4.1":
        ids[:, T // 2] = cfg.image_token_id
    h = rng.standard_normal((S, T, cfg.hc_mult, cfg.hidden_size)).astype(BF16)
    return ids, h.astype(dtype), h.astype(np.float32)


def same(x, y32):
    """x (of a call given hidden of some dtype) is what the float32 call gave: y32 itself, or for
    a bfloat16 x y32 rounded to bfloat16, bit for bit."""
    if x.dtype == BF16:
        return np.array_equal(x.view(np.uint16), y32.astype(BF16).view(np.uint16))
    return x.dtype == np.float32 and np.array_equal(x, y32)


DTYPES = pytest.mark.parametrize("dtype", [BF16, np.float16, np.float64], ids=["bf16", "f16", "f64"])


@DTYPES
def test_forward(model, dtype):
    ids, h, h32 = inputs(model, 2, 9, dtype)
    for L in model.cfg.layer_ids:
        assert np.array_equal(model.forward(L, ids, h), model.forward(L, ids, h32))


@DTYPES
def test_engine_prefill_step_and_feed_compute(model, dtype):
    L = model.cfg.layer_ids[-1]
    ids, h, h32 = inputs(model, 3, 8, dtype, seed=1)
    a, b = model.stream(L, n_streams=3), model.stream(L, n_streams=3)
    for s in range(3):   # prompts of 5 tokens, then steps over every stream
        assert same(a.prefill(ids[s, :5], h[s, :5], stream=s), b.prefill(ids[s, :5], h32[s, :5], stream=s))
    assert same(a.step(ids[:, 5], h[:, 5]), b.step(ids[:, 5], h32[:, 5]))
    a.feed(ids[:, 6])
    b.feed(ids[:, 6])
    assert same(a.compute(h[:, 6]), b.compute(h32[:, 6]))
    strided = h[:, :, :, ::-1][:, 7, :, ::-1]   # a strided view: copied (bfloat16 kept) or converted
    assert not strided.flags.c_contiguous
    assert same(a.step(ids[:, 7], strided), b.step(ids[:, 7], h32[:, 7]))
    one, one32 = model.stream(L), model.stream(L)   # the one-stream form: step(token_id, hidden[G, D])
    for t in range(4):
        assert same(one.step(int(ids[0, t]), h[0, t]), one32.step(int(ids[0, t]), h32[0, t]))


def test_decoder_layers_take_bf16(model):
    ids, h, h32 = inputs(model, 2, 4, BF16, seed=2)
    a, b = model.decoder(n_streams=2), model.decoder(n_streams=2)
    for t in range(4):
        a.begin(ids[:, t])
        b.begin(ids[:, t])
        for L in model.cfg.layer_ids:
            assert same(a.layer(L, h[:, t]), b.layer(L, h32[:, t]))


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.complex64, np.dtype(ml_dtypes.float8_e4m3fn), object])
def test_other_dtypes_are_refused_and_change_nothing(model, dtype):
    L = model.cfg.layer_ids[0]
    ids, _, h32 = inputs(model, 2, 3, np.float32)
    bad = h32.astype(dtype)
    with pytest.raises(TypeError, match=f"hidden must be a float array .*got dtype {np.dtype(dtype)}"):
        model.forward(L, ids, bad)
    eng = model.stream(L, n_streams=2)
    eng.step(ids[:, 0], h32[:, 0])
    before = eng.snapshot()
    for call in (lambda: eng.step(ids[:, 1], bad[:, 1]), lambda: eng.prefill(ids[0], bad[0], stream=1)):
        with pytest.raises(TypeError, match="float array"):
            call()
    after = eng.snapshot()
    assert all(np.array_equal(getattr(before, k), getattr(after, k)) for k in vars(after) if k != "fingerprint")
