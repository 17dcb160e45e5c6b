"""V41StreamEngine (engram_stream/v41/_engine.pyx, include/engram_fp8.h) against the numpy
oracle of the deepseek-v4.1 variant (EngramModel.forward -> engram_stream.v41.reference),
token by token, on every kernel path the CPU runs (the each_isa fixture: baseline, avx2,
avx512; tests/kernels/test_fp8_paths.py has the paths' own checks).

Stream s of an engine plays row s of a batch: its output at its p-th token must equal
forward's [s, p]. Floats compare with rtol=2e-4, atol=2e-5; integers (rows, tokens_seen,
the float8 decoders, the activation quantizer) and replays of the engine by itself compare
exactly. The float8 decoders are checked against ml_dtypes, the quantizer against the oracle's.
"""
from __future__ import annotations

import os
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram_stream import EngramConfig, EngramModel
from engram_stream.v41 import _engine as k
from engram_stream.v41 import reference as ref
from engram_stream.engine.snapshot import EngineSnapshot
from engram_stream.v41._engine import V41StreamEngine
from helpers.inputs import stepped, variant_hidden, variant_ids, variant_inputs
from helpers.models import dense_compression, make_v41_model
from helpers.numeric import close, hypothesis_settings

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("each_isa")]  # every test once per kernel path the CPU runs

HYP = hypothesis_settings(25)
IMG = 299  # the DEAD (image) token id of the models below


def make_model(**kw):
    return make_v41_model(**kw)


@pytest.fixture(scope="module")
def model():
    return make_model()


# ---- the kernels ---------------------------------------------------------------------------------

def test_e4m3_all_256_codes_match_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = k.decode_e4m3(codes)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))  # -0.0 included


def test_e8m0_all_256_codes_match_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = k.decode_e8m0(codes)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[:255], want[:255]) and got[0] == 2.0 ** -127 and got[127] == 1.0


def test_act_quant_bit_equal_to_the_oracle():
    rng = np.random.default_rng(0)
    blocks = [
        rng.standard_normal(32),                       # plain
        rng.standard_normal(32) * 1e-6,                # amax < 1e-4: the floor
        np.zeros(32),                                  # all zero
        rng.standard_normal(32) * 3e4,                 # large
        np.r_[448.0 * 2.0 ** -5, rng.standard_normal(31) * 2.0 ** -16],  # subnormal e4m3 after scaling
        np.linspace(-1, 1, 32),                        # ties of the e4m3 grid somewhere
        np.r_[1.0, np.full(31, 2.0 ** -13 * 3)],       # an exact tie (1.5 x 2^-9 steps) rounds to even
    ]
    # every e4m3 magnitude, the midpoints between neighbours (ties) and one float32 step
    # either side of them, in blocks of 32 (the block max sets each block's scale, a power
    # of two: the ties stay ties after the division)
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    grid = grid[np.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    near = np.concatenate([grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(512))])
    blocks.append(np.resize(np.concatenate([near, -near]), 32 * 32))
    x = np.concatenate(blocks).astype(np.float32)
    x = np.stack([x, -x, x * 7.5])
    q, s = k.act_quant(x)
    wq, ws = ref.act_quant(x)
    assert np.array_equal(s, ws)
    assert np.array_equal(q.view(np.uint32), wq.view(np.uint32))
    # and on dequantized table rows, the engine's real input
    m = make_model(comp=False)
    rows = np.arange(m.plan.table_rows[1]).reshape(-1, 6)[:, :]  # 6 rows = 192 values per token
    e = ref.dequant_rows(m.layer(1), rows).reshape(rows.shape[0], -1)
    q, s = k.act_quant(np.ascontiguousarray(e))
    wq, ws = ref.act_quant(e)
    assert np.array_equal(q, wq) and np.array_equal(s, ws)


def test_fp8_linear_widens_every_finite_code_exactly():
    """One-hot activations read single weights back: every finite e4m3 code, both paths."""
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                          # 254 finite codes
    M, K = 256, 64
    w = np.resize(codes, (M, K)).astype(np.uint8)
    sc = np.full((M // 32, K // 32), 127, np.uint8)
    sc[1, 0], sc[3, 1] = 120, 131                                   # other block scales too
    x = np.zeros((K, K), np.float32)
    np.fill_diagonal(x, 1.0)
    y = k.fp8_linear(x, w, sc)
    want = (ref.e4m3(w) * np.repeat(np.repeat(ref.e8m0(sc), 32, 0), 32, 1)).T
    assert np.array_equal(y, want)
    for i in range(K):  # one token at a time: the GEMV over the bytes
        assert np.array_equal(k.fp8_linear(x[i:i + 1], w, sc)[0], want[i])


@pytest.mark.parametrize("S", [1, 2, 3, 7, 8, 9, 17])
@pytest.mark.parametrize("M,K", [(96, 192), (100, 416), (37, 544)])
def test_fp8_linear_matches_the_oracle(S, M, K):
    """K past 256 crosses the kernel's k blocks (partial sums carried between them)."""
    rng = np.random.default_rng(S * 100 + M)
    w = ref.np.clip(rng.standard_normal((M, K)), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    sc = rng.integers(118, 130, (-(-M // 32), K // 32)).astype(np.uint8)
    x = (rng.standard_normal((S, K)) * np.repeat(2.0 ** rng.integers(-12, 6, (S, K // 32)), 32, 1)).astype(np.float32)
    want = ref.fp8_linear(x, w, sc)
    for threads in (1, 2):
        close(k.fp8_linear(x, w, sc, threads=threads), want)


def test_fp8_linear_every_token_count_and_tile_remainder():
    """Token counts 1..20, 33, 100 cross every tile shape of the many-token projection: along k
    (2..15 tokens, 8 per tile plus a remainder), in the lanes (16 or more: vectors of 16, in
    pairs, a partial last vector); M = 100 leaves a 4-row group and row tiles of 12/16 with
    remainders; K = 416 a partial last k block (256 + 160). Threads split by groups: 1 and 3
    give the same bits."""
    rng = np.random.default_rng(7)
    M, K = 100, 416
    w = np.clip(rng.standard_normal((M, K)), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    sc = rng.integers(118, 130, (-(-M // 32), K // 32)).astype(np.uint8)
    for S in list(range(1, 21)) + [33, 100]:
        x = (rng.standard_normal((S, K)) * np.repeat(2.0 ** rng.integers(-12, 6, (S, K // 32)), 32, 1)).astype(np.float32)
        got = k.fp8_linear(x, w, sc)
        close(got, ref.fp8_linear(x, w, sc))
        assert np.array_equal(k.fp8_linear(x, w, sc, threads=3), got), S


def test_fp8_linear_refuses_bad_shapes():
    w, sc, x = np.zeros((32, 64), np.uint8), np.zeros((1, 2), np.uint8), np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError):
        k.fp8_linear(np.zeros((1, 48), np.float32), np.zeros((32, 48), np.uint8), sc)
    with pytest.raises(ValueError):
        k.fp8_linear(x, w, np.zeros((2, 2), np.uint8))


# ---- the engine against the oracle ------------------------------------------------------------------

def test_single_stream_matches_batch(model):
    T = 60
    ids, h = variant_inputs(model, 1, (T,))
    ids[:2] = IMG                 # DEAD at the start, twice
    ids[30:34] = IMG              # a run
    ids[40] = -1                  # an unknown id
    want = model.forward(4, ids[None], h[None])[0]
    eng = model.stream(4)
    got = np.stack([eng.step(int(t), h[i]) for i, t in enumerate(ids)])
    close(got, want)
    assert not got[ids == IMG].any()
    assert eng.tokens_seen.tolist() == [T]


@pytest.mark.parametrize("S", range(2, 18))
def test_multi_stream_matches_batch(model, S):
    """2..17 streams: tiles along k (2..15) and in the lanes (16, 17: a partial vector); the
    DEAD tokens of variant_ids land inside those tiles. step_threads 2 on odd counts."""
    T = 6
    ids, h = variant_inputs(model, S, (S, T))
    ids[S // 2, 2] = IMG                      # at least one DEAD token inside a tile
    want = model.forward(1, ids, h)
    eng = model.stream(1, n_streams=S)
    eng.step_threads = 1 + S % 2
    out = np.empty((S, 2, 64), np.float32)
    for t in range(T):
        r = eng.step(ids[:, t], h[:, t], out=out)
        assert r is out
        close(out, want[:, t])
        assert not out[ids[:, t] == IMG].any()


def test_step_and_prefill_threads_are_bitwise_equal():
    """The projection splits by row groups, the per-token work by tokens: any thread count
    gives the same bits (multi-stream step: step_threads; prefill: prefill_threads). The
    model has 9 row groups (M = 288), so 2 and 3 threads split them unevenly."""
    m = make_model(G=2, D=96, layers=(1,))
    rng = np.random.default_rng(5)
    for S in (3, 20):
        ids = variant_ids(m, rng, (S, 4))
        h = variant_hidden(m, rng, (S, 4))
        outs = []
        for threads in (1, 2, 3):
            eng = m.stream(1, n_streams=S)
            eng.step_threads = threads
            outs.append(np.stack([eng.step(ids[:, t], h[:, t]) for t in range(4)]))
        assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    ids, h = variant_ids(m, rng, (40,)), variant_hidden(m, rng, (40,))
    outs = []
    for threads in (1, 2):
        eng = m.stream(1)
        eng.prefill_threads = threads
        outs.append(eng.prefill(ids, h))
    assert np.array_equal(outs[0], outs[1])


def test_step_threads_default_and_clamp(model):
    eng = model.stream(1, n_streams=4)
    assert eng.step_threads == 1
    eng.step_threads = 0
    assert eng.step_threads == 1
    eng.step_threads = 1000
    assert eng.step_threads == 16
    eng.step_threads = 2
    assert eng.step_threads == 2
    assert 1 <= eng.prefill_threads <= 8  # default: the cores, at most 8
    for set_to, got in ((0, 1), (-3, 1), (10**20, 16), (3, 3)):
        eng.prefill_threads = set_to
        assert eng.prefill_threads == got


def _with_config(model, cfg):
    """model's plan and weights under another config (the engine checks its limits before it
    reads a weight, so none of the weights needs that config's shape)."""
    class Model:
        plan = model.plan
        layer = staticmethod(model.layer)
        row_source = staticmethod(model.row_source)
    m = Model()
    m.cfg = cfg
    return m


def test_too_wide_projection_is_refused_before_any_weight_is_read(model):
    """16 tokens of the many-token tile are scattered at int32 offsets t * (G+1)*D: a wider
    projection is refused at construction, with the numbers (weights never touched)."""
    import dataclasses

    cfg = dataclasses.replace(model.cfg, hidden_size=(2**31 // 16) // 2 + 32, hc_mult=1)

    with pytest.raises(ValueError, match="too large for the V4.1 engine"):
        V41StreamEngine(_with_config(model, cfg), 1)


def test_too_many_values_per_token_are_refused(model):
    """The one-token projection keeps a token's E scaled values on the stack: E past the
    kernels' limit (16384) is refused by the engine and by fp8_linear, with the numbers."""
    import dataclasses

    n, nh = model.cfg.max_ngram_size, model.cfg.n_head_per_ngram
    hd = (16384 // ((n - 1) * nh) // 32 + 1) * 32  # the smallest float8-block head_dim past the limit
    cfg = dataclasses.replace(model.cfg, n_embed_per_ngram=nh * hd)
    assert cfg.engram_dim > 16384

    with pytest.raises(ValueError, match="engram_dim = .* is too large for the V4.1 engine"):
        V41StreamEngine(_with_config(model, cfg), 1)
    K = 16384 + 32
    with pytest.raises(ValueError, match="values per row of x = 16416 is too large"):
        k.fp8_linear(np.zeros((1, K), np.float32), np.zeros((1, K), np.uint8), np.full((1, K // 32), 127, np.uint8))


@st.composite
def configs(draw):
    n = draw(st.integers(2, 4))
    return dict(G=draw(st.integers(1, 3)), D=draw(st.sampled_from([32, 64, 96])), n=n,
                nh=draw(st.integers(1, 3)), hd=draw(st.sampled_from([32, 64])),
                vocab=draw(st.integers(8, 60)), comp=draw(st.booleans()), seed=draw(st.integers(0, 99)),
                evs=draw(st.integers(5, 80)))


@HYP
@given(c=configs(), S=st.integers(1, 4), T=st.integers(1, 20), data=st.data())
def test_random_configs_match_batch(c, S, T, data):
    img = data.draw(st.integers(0, c["vocab"] - 1).filter(lambda i: i != 2))  # not the pad id
    m = make_model(img=img, layers=(3,), **c)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    ids = variant_ids(m, rng, (S, T), p_dead=0.25, p_neg=0.1)
    h = variant_hidden(m, rng, (S, T))
    want = m.forward(3, ids, h)
    eng = m.stream(3, n_streams=S)
    got = np.stack([eng.step(ids[:, t], h[:, t]) for t in range(T)], axis=1)
    close(got, want)
    eng.reset()
    close(eng.prefill(ids[0], h[0]), want[0])


@pytest.mark.parametrize("T0,threads", [(1, 1), (7, 2), (17, 1), (130, 2), (300, 1), (530, 2)])
def test_prefill_then_step(model, T0, threads):
    """prefill over chunk boundaries (256: 300 and 530 leave 44 and 18 tokens in the last
    chunk), then steps continue the same sequence."""
    T = T0 + 5
    ids, h = variant_inputs(model, T0, (T,))
    want = model.forward(1, ids[None], h[None])[0]
    eng = model.stream(1)
    eng.prefill_threads = threads
    out = np.empty((T0, 2, 64), np.float32)
    assert eng.prefill(ids[:T0], h[:T0], out=out) is out
    close(out, want[:T0])
    got = np.stack([eng.step(int(ids[t]), h[t]) for t in range(T0, T)])
    close(got, want[T0:])
    assert eng.tokens_seen.tolist() == [T]


def test_prefill_one_stream_of_many_leaves_the_others(model):
    S, T = 3, 10
    ids, h = variant_inputs(model, 3, (S, T))
    want = model.forward(1, ids, h)
    eng = stepped(model, 1, ids, h, 1)
    before = eng.snapshot()
    close(eng.prefill(ids[1, 1:], h[1, 1:], stream=1), want[1, 1:])
    after = eng.snapshot()
    assert np.array_equal(after.hist[[0, 2]], before.hist[[0, 2]])
    assert eng.tokens_seen.tolist() == [1, T, 1]
    assert eng.prefill(np.zeros(0, np.int64), np.zeros((0, 2, 64), np.float32)).shape == (0, 2, 64)


def test_feed_compute_equals_step_and_rows(model):
    S, T = 3, 8
    ids, h = variant_inputs(model, 4, (S, T))
    want = model.forward(4, ids, h)
    rows = model.plan.hash_numpy(ids, layers=[4])[4] + model.layer(4).offsets
    eng = model.stream(4, n_streams=S)
    for t in range(T):
        eng.feed(ids[:, t])
        assert eng.pending_compute
        assert np.array_equal(eng.rows, rows[:, t])
        assert eng.prefetch() == 0
        close(eng.compute(h[:, t]), want[:, t])
    with pytest.raises(RuntimeError, match="feed"):
        eng.compute(h[:, 0])
    eng.feed(ids[:, 0])
    with pytest.raises(RuntimeError):
        eng.feed(ids[:, 0])
    with pytest.raises(RuntimeError):
        eng.step(ids[:, 0], h[:, 0])
    with pytest.raises(RuntimeError):
        eng.snapshot()


def test_track_rows_marks_the_rows_read(model):
    eng = model.stream(1)
    bitmap = np.zeros((model.plan.table_rows[1] + 7) // 8, np.uint8)
    eng.track_rows(bitmap)
    ids = np.array([5, 6, IMG, 7])
    for t in ids:
        eng.step(int(t), np.ones((2, 64), np.float32))
    rows = np.unique(model.plan.hash_numpy(ids[None], layers=[1])[1] + model.layer(1).offsets)
    assert np.array_equal(np.flatnonzero(np.unpackbits(bitmap, bitorder="little")), rows)
    with pytest.raises(ValueError):
        eng.track_rows(np.zeros(3, np.uint8))


def test_snapshot_restore_replays_exactly(model):
    S, T = 2, 12
    ids, h = variant_inputs(model, 5, (S, T))
    eng = stepped(model, 1, ids, h, 4)
    snap = eng.snapshot()
    first = [eng.step(ids[:, t], h[:, t]).copy() for t in range(4, T)]
    eng.restore(snap)
    assert eng.tokens_seen.tolist() == [4, 4]
    again = [eng.step(ids[:, t], h[:, t]).copy() for t in range(4, T)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    other = model.stream(1, n_streams=S)  # another engine of the same layer takes it too
    other.restore(snap)
    assert np.array_equal(other.step(ids[:, 4], h[:, 4]), first[0])
    assert isinstance(snap, EngineSnapshot) and snap.nbytes == S * 3 * 8 + S * 8 + S * model.cfg.n_heads * 8


def test_snapshot_refused_state_unchanged(model):
    eng = model.stream(1, n_streams=2)
    eng.step(np.array([3, IMG]), np.ones((2, 2, 64), np.float32))
    good = eng.snapshot()
    for bad, err in [(model.stream(4, n_streams=2).snapshot(), ValueError),
                     (model.stream(1, n_streams=3).snapshot(), ValueError),
                     (make_model(seed=5).stream(1, n_streams=2).snapshot(), ValueError),
                     ("nope", TypeError),
                     (EngineSnapshot(good.fingerprint, hist=np.zeros((2, 2), np.int64), seen=good.seen), ValueError),
                     (EngineSnapshot(good.fingerprint, hist=good.hist, seen=-np.ones(2, np.int64)), ValueError)]:
        with pytest.raises(err):
            eng.restore(bad)
        assert np.array_equal(eng.snapshot().hist, good.hist) and eng.tokens_seen.tolist() == [1, 1]


def test_reset_one_stream_among_many(model):
    S, T = 3, 9
    ids, h = variant_inputs(model, 6, (S, T))
    eng = stepped(model, 4, ids, h, 5)
    eng.reset(1)
    assert eng.tokens_seen.tolist() == [5, 0, 5]
    # stream 1 starts over: its next tokens are a fresh sequence
    seq = np.concatenate([ids[:, :5], ids[:, 5:]], axis=1)
    fresh = seq.copy()
    fresh[1, :5] = IMG  # DEAD blocks history exactly as the start does; its outputs are not compared
    want = model.forward(4, fresh, h)
    for t in range(5, T):
        close(eng.step(ids[:, t], h[:, t]), want[:, t])
    eng.reset()
    assert eng.tokens_seen.tolist() == [0, 0, 0]
    with pytest.raises(IndexError):
        eng.reset(3)
    with pytest.raises(TypeError):
        eng.reset(True)


def test_bad_input_refused_state_unchanged(model):
    ids, h = variant_inputs(model, 7, (6,))
    want = model.forward(1, ids[None], h[None])[0]
    eng = model.stream(1)
    eng.step(int(ids[0]), h[0])
    snap = eng.snapshot()
    bad_calls = [
        (lambda: eng.step(300, h[1]), ValueError),                      # id >= vocab
        (lambda: eng.step(2 ** 70, h[1]), ValueError),
        (lambda: eng.step(1.5, h[1]), TypeError),
        (lambda: eng.step(True, h[1]), TypeError),
        (lambda: eng.step(np.array([1, 2]), h[1]), ValueError),
        (lambda: eng.step(1, h[1, 0]), ValueError),                     # hidden shape
        (lambda: eng.step(1, h[1].astype(np.int32)), TypeError),
        (lambda: eng.step(1, h[1], out=np.empty((2, 64), np.float64)), ValueError),
        (lambda: eng.step(1, h[1], out=np.empty((2, 64), np.float32)[:, ::1][::-1]), ValueError),
        (lambda: eng.prefill(np.array([1, 300]), h[:2]), ValueError),
        (lambda: eng.prefill(np.array([1, 2]), h[:3]), ValueError),
        (lambda: eng.prefill(np.array([1, 2]), h[:2], stream=1), IndexError),
        (lambda: eng.feed(np.array([400])), ValueError),
    ]
    for call, err in bad_calls:
        with pytest.raises(err):
            call()
        assert np.array_equal(eng.snapshot().hist, snap.hist) and eng.tokens_seen.tolist() == [1]
        assert not eng.pending_compute
    got = np.stack([eng.step(int(ids[t]), h[t]) for t in range(1, 6)])
    close(got, want[1:])
    with pytest.raises(AttributeError):  # the path is the kernel selector's (engram_stream.engine.isa.use_isa)
        eng.isa = "avx2"


def test_engine_construction_errors(model):
    with pytest.raises(ValueError):
        V41StreamEngine(model, 1, 0)
    with pytest.raises(KeyError):
        model.stream(2)
    demo = EngramModel.init(EngramConfig(engram_vocab_size=[31, 41], hidden_size=16, hc_mult=1,
                                         n_embed_per_ngram=8, n_head_per_ngram=2, vocab_size=50), seed=0)
    with pytest.raises(ValueError, match="deepseek-v4.1"):
        V41StreamEngine(demo, 1)
    assert type(model.stream(1)).__name__ == "V41StreamEngine"


def test_engine_names_the_running_path(model, each_isa):
    import engram_stream
    eng = model.stream(1)
    assert eng.isa == each_isa == engram_stream.kernel_isa()
    assert repr(eng).endswith(f"isa={each_isa!r})")


def test_decoder_runs_v41_layers(model):
    rng = np.random.default_rng(9)
    S, T = 2, 10
    ids = variant_ids(model, rng, (S, T))
    hs = {L: variant_hidden(model, rng, (S, T)) for L in (1, 4)}
    want = {L: model.forward(L, ids, hs[L]) for L in (1, 4)}
    dec = model.decoder(n_streams=S)
    for t in range(4):
        got = dec.step(ids[:, t], {L: hs[L][:, t] for L in (1, 4)})
        for L in (1, 4):
            close(got[L], want[L][:, t])
    snap = dec.snapshot()
    for t in range(4, T):
        dec.begin(ids[:, t])
        for L in (1, 4):
            close(dec.layer(L, hs[L][:, t]), want[L][:, t])
    dec.restore(snap)
    dec.begin(ids[:, 4])
    close(dec.layer(1, hs[1][:, 4]), want[1][:, 4])
    close(dec.layer(4, hs[4][:, 4]), want[4][:, 4])
    dec.reset()
    one = model.decoder()
    got = one.prefill(ids[0], {L: hs[L][0] for L in (1, 4)})
    for L in (1, 4):
        close(got[L], want[L][0])


def test_steady_state_step_allocates_nothing(model):
    eng = model.stream(1)
    h = np.ones((2, 64), np.float32)
    out = np.empty((2, 64), np.float32)
    for t in range(20):
        eng.step(t, h, out=out)
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    for t in range(500):
        eng.step(t % 300, h, out=out)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename") if s.size_diff > 0)
    tracemalloc.stop()
    assert grown < 4096, grown


def test_mapped_checkpoint_decoder_prefetch_and_residency(model, tmp_path):
    """A V4.1 checkpoint mapped from disk: the Decoder prefetches (madvise) the fed rows, the
    outputs still equal the oracle's, and residency counts the rows the engine touched."""
    from engram_stream.io import memory
    model.save(tmp_path / "ckpt")
    mm = EngramModel.load(tmp_path / "ckpt", mmap=True)
    assert memory.is_file_backed(mm.layer(1).table)
    rng = np.random.default_rng(11)
    ids = variant_ids(mm, rng, (1, 12))
    hs = {L: variant_hidden(mm, rng, (1, 12)) for L in (1, 4)}
    dec = mm.decoder()
    assert all(dec.engines[L].row_source.paged for L in (1, 4))
    bitmap = memory.track_rows(dec.engines[1])
    for t in range(12):
        got = dec.step(int(ids[0, t]), {L: hs[L][0, t] for L in (1, 4)})
        for L in (1, 4):
            close(got[L], model.forward(L, ids[:, :t + 1], hs[L][:, :t + 1])[0, t])
    rows = np.unique(mm.plan.hash_numpy(ids, layers=[1])[1] + mm.layer(1).offsets)
    rep = memory.residency(mm, touched={1: bitmap})
    assert rep[1]["rows_touched"] == rows.size and rep[1]["resident_bytes"] > 0
    memory.release(mm)
