"""bfloat16 projection weights (model.with_weight_dtype): held as bf16, widened in registers by
every kernel path, equal to float32 math on the bf16-rounded weights; save/load keep them."""
import ml_dtypes
import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every kernel path (tests/conftest.py)

RTOL, ATOL = 2e-4, 2e-5
BF16 = np.dtype(ml_dtypes.bfloat16)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def models():
    # M = (G+1)*D = 3*40 = 120 columns: 7 full panels and a partial one (every tile edge)
    cfg = EngramConfig(engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=64, n_head_per_ngram=4,
                       layer_ids=[1, 2], kernel_size=3, hidden_size=40, hc_mult=2, vocab_size=60)
    f32 = EngramModel.init(cfg, seed=1)
    rng = np.random.default_rng(3)
    layers = {L: w.replace(cfg, proj_b=w.proj_b + 0.1 * rng.standard_normal(w.proj_b.shape)) for L, w in f32.layers.items()}
    f32 = EngramModel(cfg, f32.plan, layers)
    return f32, f32.with_weight_dtype("bfloat16")


def rounded(model):
    """The float32 model whose weights are the bf16-rounded ones (the meaning of a bf16 model)."""
    layers = {L: w.replace(model.cfg, proj_w=w.proj_w.astype(BF16).astype(np.float32)) for L, w in model.layers.items()}
    return EngramModel(model.cfg, model.plan, layers)


def inputs(cfg, S, T, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2, cfg.vocab_size, (S, T))
    hidden = rng.standard_normal((S, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    return ids, hidden


def test_weights_held_as_bf16_and_shared_rest(models):
    f32, bf = models
    assert bf.weight_dtype == "bfloat16" and f32.weight_dtype == "float32"
    w, w0 = bf.layer(1), f32.layer(1)
    assert w.proj_w.dtype == BF16 and w.packed()[0].dtype == BF16
    assert w.proj_w.nbytes * 2 == w0.proj_w.nbytes
    assert np.shares_memory(w.table, w0.table) and np.shares_memory(w.norm1, w0.norm1)  # only projections change
    assert not w.proj_w.flags.writeable
    # round to nearest even, as ml_dtypes / torch do
    assert np.array_equal(w.proj_w.view(np.uint16), w0.proj_w.astype(BF16).view(np.uint16))
    back = bf.with_weight_dtype("float32")
    assert back.weight_dtype == "float32" and np.array_equal(back.layer(1).proj_w, rounded(f32).layer(1).proj_w)


def test_oracle_is_float32_math_on_rounded_weights(models):
    f32, bf = models
    ids, hidden = inputs(bf.cfg, 2, 9)
    close(bf.forward(1, ids, hidden), rounded(f32).forward(1, ids, hidden))
    assert np.abs(bf.forward(1, ids, hidden) - f32.forward(1, ids, hidden)).max() > 0  # bf16 changes it


@pytest.mark.parametrize("S", [1, 3, 16])
def test_engine_steps_match_oracle(models, S):
    _, bf = models
    ids, hidden = inputs(bf.cfg, S, 12, seed=S)
    want = {L: bf.forward(L, ids, hidden) for L in bf.cfg.layer_ids}
    for L in bf.cfg.layer_ids:
        eng = bf.stream(L, n_streams=S)
        for t in range(ids.shape[1]):
            if S == 1:
                close(eng.step(int(ids[0, t]), hidden[0, t]), want[L][0, t])
            else:
                close(eng.step(ids[:, t], hidden[:, t]), want[L][:, t])


@pytest.mark.parametrize("n", [2, 3])  # E = 15 (odd: the 16-lane GEMV's last k alone) and 30
def test_one_row_gemv_matches_oracle(n):
    """M = 5*64 = 320 columns: 20 panels, so the one-row bf16 GEMV (8, 4 or 2 panels at a
    time, per path) runs, then the tile on the rest."""
    cfg = EngramConfig(engram_vocab_size=[101, 103][:n - 1], max_ngram_size=n, n_embed_per_ngram=15,
                       n_head_per_ngram=3, layer_ids=[1], kernel_size=2, hidden_size=64, hc_mult=4, vocab_size=60)
    bf = EngramModel.init(cfg, seed=4).with_weight_dtype("bfloat16")
    ids, hidden = inputs(cfg, 1, 6, seed=n)
    want = bf.forward(1, ids, hidden)[0]
    eng = bf.stream(1)
    for t in range(6):
        close(eng.step(int(ids[0, t]), hidden[0, t]), want[t])


@pytest.mark.parametrize("T", [1, 13, 40, 130])
def test_prefill_matches_oracle(models, T):
    _, bf = models
    ids, hidden = inputs(bf.cfg, 1, T + 3, seed=T)
    want = bf.forward(2, ids, hidden)[0]
    eng = bf.stream(2)
    close(eng.prefill(ids[0, :T], hidden[0, :T]), want[:T])
    for t in range(T, T + 3):  # the state prefill leaves
        close(eng.step(int(ids[0, t]), hidden[0, t]), want[t])


@pytest.mark.parametrize("mmap", [True, False])
def test_save_load_keep_bf16(models, tmp_path, mmap):
    _, bf = models
    path = tmp_path / "bf16.safetensors"
    bf.save(path)
    back = EngramModel.load(path, mmap=mmap)
    assert back.weight_dtype == "bfloat16"
    for L in bf.cfg.layer_ids:
        assert np.array_equal(back.layer(L).proj_w.view(np.uint16), bf.layer(L).proj_w.view(np.uint16))
    ids, hidden = inputs(bf.cfg, 1, 6)
    close(back.stream(1).prefill(ids[0], hidden[0]), bf.forward(1, ids, hidden)[0])


def test_from_reference_keeps_bf16(models):
    f32, bf = models
    sds = {L: f32.state_dict(L) for L in f32.cfg.layer_ids}
    got = EngramModel.from_reference(f32.cfg, sds, weight_dtype="bfloat16")
    assert got.weight_dtype == "bfloat16"
    assert np.array_equal(got.layer(1).proj_w.view(np.uint16), bf.layer(1).proj_w.view(np.uint16))
    # a bf16 model's state_dict is float32 (exact): it rebuilds the same bf16 model
    again = EngramModel.from_reference(bf.cfg, {L: bf.state_dict(L) for L in bf.cfg.layer_ids},
                                       weight_dtype="bfloat16")
    assert np.array_equal(again.layer(2).proj_w.view(np.uint16), bf.layer(2).proj_w.view(np.uint16))


def test_from_reference_torch_bf16_tensors(models):
    torch = pytest.importorskip("torch")
    f32, bf = models
    sds = {L: {k: torch.from_numpy(np.array(v)).to(torch.bfloat16) if k.endswith("proj.weight") or
               ".weight" in k and k.startswith("key_projs") else torch.from_numpy(np.array(v))
               for k, v in f32.state_dict(L).items()} for L in f32.cfg.layer_ids}
    got = EngramModel.from_reference(f32.cfg, sds, weight_dtype="bfloat16")
    assert np.array_equal(got.layer(1).proj_w.view(np.uint16), bf.layer(1).proj_w.view(np.uint16))


@pytest.mark.parametrize("bad", ["float16", "int8", "bf16", None, np.float64])
def test_bad_weight_dtype_refused(models, bad):
    f32, _ = models
    with pytest.raises(ValueError, match="weight dtype"):
        f32.with_weight_dtype(bad)
