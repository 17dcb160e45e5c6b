"""Serving batches on every variant: step_packed over stream slots (requests joining and leaving,
prompt chunks beside decode steps, drafts cut back by commit), masked (left-padded) positions,
the Decoder's packed begin, and its all-or-nothing begin when a layer's rows cannot be read.

The oracle is request by request: model.forward over each request's accepted tokens (with the
hidden each was computed with), compared with the outputs the engine returned for them. A
rejected draft token's output is never compared; the tokens after it must not see it."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram_stream import EngramConfig, EngramModel, variants
from engram_stream.errors import TierError
from engram_stream.rows import CachedTier, RecordSource, Tier, record_layout
from engram_stream.rows._cache import slot_bytes
from helpers.inputs import variant_hidden, variant_ids
from helpers.models import contract_model, contract_variants
from helpers.numeric import close, hypothesis_settings

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

HYP = hypothesis_settings(20)
VARIANTS = contract_variants()   # every registered variant
# the variants with two layers or more (longcat-flash-lite has one): the Decoder's across-layer tests
MULTI_LAYER = [v for v in VARIANTS if len(EngramConfig(**variants.get(v).example_config).layer_ids) > 1]


def _model(variant, seed=None):
    return contract_model(variant, seed=seed)


_MODELS = {}


def model_of(variant):
    if variant not in _MODELS:
        _MODELS[variant] = _model(variant)
    return _MODELS[variant]


def _cat(parts):
    """np.concatenate of hiddens, or None for an input layer's (each part None)."""
    return None if parts[0] is None else np.concatenate(parts)


def _hidden(model, rng, *shape):
    """Random hiddens [*shape, G, D] of the model (variant_hidden's draw), or None for an input layer."""
    return variant_hidden(model, rng, shape)[...]


class Request:
    """One request's accepted tokens: their ids, the hidden each was computed with, the output."""

    def __init__(self, model, rng, length):
        self.true = variant_ids(model, rng, (length,))
        self.ids, self.hid, self.out = [], [], []

    def oracle_check(self, model, L):
        if not self.ids:
            return
        ids = np.array(self.ids)[None]
        hid = None if self.hid[0] is None else np.stack(self.hid)[None]
        close(np.stack(self.out), model.forward(L, ids, hid)[0])


def run_schedule(model, L, S, seed, n_calls=12, draft_p=0.4, chunk_max=9, mask_p=0.0, use_decoder=False):
    """Drive one engine (or a Decoder) through a random serving schedule; every request's
    accepted outputs are then held to the oracle."""
    rng = np.random.default_rng(seed)
    eng = model.decoder(S) if use_decoder else model.stream(L, S)
    slots = [None] * S          # the request each slot serves
    pos = [0] * S               # tokens of it accepted so far
    done = []
    for _ in range(n_calls):
        for s in range(S):      # requests leave and join
            if slots[s] is not None and (pos[s] >= len(slots[s].true) or rng.random() < 0.05):
                done.append(slots[s])
                slots[s] = None
            if slots[s] is None and rng.random() < 0.7:
                (eng.reset(stream=s))
                slots[s], pos[s] = Request(model, rng, int(rng.integers(1, 40))), 0
        active = [s for s in range(S) if slots[s] is not None and rng.random() < 0.85]
        if not active:
            continue
        rng.shuffle(active)
        draft = rng.random() < draft_p
        segs, want_acc = [], []
        for s in active:
            left = len(slots[s].true) - pos[s]
            n = int(rng.integers(1, min(chunk_max, left) + 1)) if rng.random() < 0.5 else 1
            a = int(rng.integers(0, n + 1)) if draft else n
            toks = slots[s].true[pos[s]:pos[s] + n].copy()
            if a < n:  # the rejected part of a draft: tokens the request never had
                toks[a:] = variant_ids(model, rng, (n - a,))
            segs.append((s, toks, a))
        ids = np.concatenate([t for _, t, _ in segs])
        hid = variant_hidden(model, rng, (len(ids),))
        streams = [s for s, _, _ in segs]
        lengths = [len(t) for _, t, _ in segs]
        masked = rng.random(len(ids)) < mask_p if mask_p else None
        if use_decoder:
            eng.begin_packed(ids, streams, lengths, draft=draft, masked=masked)
            out = eng.layer(L, hid[...])
            for L2 in eng.layers:
                if L2 != L:
                    eng.layer(L2, hid[...])
        else:
            out = eng.step_packed(ids, hid[...], streams, lengths, draft=draft, masked=masked)
        if masked is not None:
            assert not out[masked].any()  # a masked position is no token: its delta is 0
        skip_commit = draft and rng.random() < 0.2   # a new call without commit accepts everything
        accepted = [a for _, _, a in segs] if draft and not skip_commit else lengths
        if draft and not skip_commit:
            eng.commit(accepted)
        i = 0
        for (s, toks, _), a in zip(segs, accepted):
            req = slots[s]
            for j in range(a):
                if masked is None or not masked[i + j]:   # the request never had a masked position
                    req.ids.append(int(toks[j]))
                    req.hid.append(hid[i + j])
                    req.out.append(out[i + j])
            pos[s] += a
            i += len(toks)
    for req in done + [r for r in slots if r is not None]:
        req.oracle_check(model, L)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("S", [1, 4, 17])
def test_random_schedules_match_the_oracle_request_by_request(variant, S):
    model = model_of(variant)
    run_schedule(model, model.cfg.layer_ids[0], S, seed=S, n_calls=14)


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_chunks_cross_the_engines_chunks(variant):
    """Segments longer than the engine's GEMM chunk (128 / 256 tokens), drafts longer than the
    demo's conv ring: commit must replay the ring from the x it kept."""
    model = model_of(variant)
    run_schedule(model, model.cfg.layer_ids[-1], 3, seed=11, n_calls=6, chunk_max=300, draft_p=0.5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_masked_positions(variant):
    model = model_of(variant)
    run_schedule(model, model.cfg.layer_ids[0], 5, seed=5, n_calls=12, mask_p=0.25)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_packed_begin_and_commit(variant):
    model = model_of(variant)
    for L in model.cfg.layer_ids:
        run_schedule(model, L, 4, seed=21, n_calls=10, use_decoder=True)


@HYP
@given(variant=st.sampled_from(VARIANTS), S=st.integers(1, 17), seed=st.integers(0, 2 ** 31),
       draft_p=st.floats(0, 1), chunk_max=st.integers(1, 40), mask_p=st.sampled_from([0.0, 0.0, 0.2]))
def test_schedules_hypothesis(variant, S, seed, draft_p, chunk_max, mask_p):
    model = model_of(variant)
    run_schedule(model, model.cfg.layer_ids[seed % len(model.cfg.layer_ids)], S, seed, n_calls=8, draft_p=draft_p,
                 chunk_max=chunk_max, mask_p=mask_p)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_left_padded_row_equals_the_row_alone(variant):
    model = model_of(variant)
    L = model.cfg.layer_ids[0]
    rng = np.random.default_rng(3)
    ids = variant_ids(model, rng, (12,))
    hid = _hidden(model, rng, 12)
    pad = 5
    pids = np.concatenate([np.full(pad, 7), ids])
    phid = _cat([_hidden(model, rng, pad), hid])
    masked = np.arange(12 + pad) < pad
    got = model.stream(L).step_packed(pids, phid, [0], [12 + pad], masked=masked)
    assert not got[:pad].any()
    close(got[pad:], model.forward(L, ids[None], None if hid is None else hid[None])[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_lengths_whose_sum_wraps_int64_are_refused(variant):
    """lengths that wrap an int64 sum round to N ([2**63-1, 2**63-1, 3] for N = 1) are refused by
    step_packed, lookup_packed and Decoder.begin_packed, naming the length; nothing changes."""
    model = model_of(variant)
    L = model.cfg.layer_ids[0]
    G, D = model.cfg.hc_mult, model.cfg.hidden_size
    ids = variant_ids(model, np.random.default_rng(8), (1,))
    h = None if model.variant.input_layer else np.zeros((1, G, D), np.float32)
    big = 2 ** 63 - 1
    eng, dec = model.stream(L, 3), model.decoder(3)
    calls = [lambda ln: eng.step_packed(ids, h, [0, 1, 2], ln), lambda ln: eng.lookup_packed(ids, [0, 1, 2], ln),
             lambda ln: dec.begin_packed(ids, [0, 1, 2], ln)]
    for call in calls:
        for ln in ([big, big, 3], [1, big, 2 ** 63 - 1], [2, 1, 1]):
            with pytest.raises(ValueError, match=f"lengths\\[[01]\\] = {ln[0] if ln[0] > 1 else big}"):
                call(ln)
    assert eng.tokens_seen.tolist() == [0, 0, 0] and not dec.pending()
    eng.step_packed(ids, h, [1], [1])
    assert eng.tokens_seen.tolist() == [0, 1, 0]


class _Unreadable:
    """A hidden whose conversion raises what a framework's tensor may raise (not a ValueError)."""

    def __array__(self, *a, **k):
        raise RuntimeError("this tensor cannot be read")


def _same_state(a, b):
    for L in a:
        for k in a[L].names:
            assert np.array_equal(getattr(a[L], k), getattr(b[L], k)), (L, k)


def _inputs(model, rng, S, T):
    """ids [S, T] of the model's variant (variant_ids) and float32 hiddens [S, T, G, D]."""
    ids = variant_ids(model, rng, (S, T))
    return ids, variant_hidden(model, rng, (S, T))


def _two_streams_two_layers(variant, seed, T):
    """The model of `variant`, its two layers, ids and hiddens of 2 streams x T tokens, and a
    Decoder of 2 slots."""
    model = model_of(variant)
    ids, hid = _inputs(model, np.random.default_rng(seed), 2, T)
    return model, tuple(model.cfg.layer_ids), ids, hid, model.decoder(2)


def _close_to_the_oracle(model, outs, ids, hid):
    """outs {layer: its outputs, position by position}, for every layer, against the oracle's."""
    for L in model.cfg.layer_ids:
        close(np.stack(outs[L], 1), model.forward(L, ids, hid[...]))


@pytest.mark.parametrize("variant", MULTI_LAYER)
def test_decoder_layer_given_an_unreadable_hidden_changes_nothing(variant):
    """Decoder.layer with a hidden that raises on conversion (any exception): nothing changes,
    the layer stays pending, the others as they were; calling it again with a good hidden
    gives the oracle's outputs (the demo's conv ring included)."""
    model, (La, Lb), ids, hid, dec = _two_streams_two_layers(variant, seed=9, T=5)
    outs = {La: [], Lb: []}
    for p in range(5):
        dec.begin(ids[:, p])
        if p == 2:
            with pytest.raises((RuntimeError, ValueError), match="cannot be read|takes no hidden"):
                dec.layer(La, _Unreadable())
            assert dec.pending() == [La, Lb]
        outs[La].append(dec.layer(La, hid[:, p]))
        if p == 3:
            with pytest.raises((RuntimeError, ValueError), match="cannot be read|takes no hidden"):
                dec.layer(Lb, _Unreadable())
            assert dec.pending() == [Lb]
        outs[Lb].append(dec.layer(Lb, hid[:, p]))
    _close_to_the_oracle(model, outs, ids, hid)


@pytest.mark.parametrize("bad", ["shape", "unreadable"])
@pytest.mark.parametrize("variant", MULTI_LAYER)
def test_decoder_step_checks_every_hidden_before_any_layer_runs(variant, bad):
    """Decoder.step with a bad hidden for its last layer: refused before any layer is fed (no
    layer advanced or pending); the same step with good hiddens then equals the oracle."""
    model, (La, Lb), ids, hid, dec = _two_streams_two_layers(variant, seed=10, T=3)
    outs = {La: [], Lb: []}
    for p in range(3):
        if p == 1:
            before = dec.snapshot()
            wrong = _Unreadable() if bad == "unreadable" else (
                np.zeros(1, np.float32) if model.variant.input_layer else hid[:, p, :, :-1])
            with pytest.raises((ValueError, RuntimeError)):
                dec.step(ids[:, p], {La: hid[:, p], Lb: wrong})
            assert not dec.pending()
            _same_state(before, dec.snapshot())
        for L, o in dec.step(ids[:, p], {La: hid[:, p], Lb: hid[:, p]}).items():
            outs[L].append(o)
    _close_to_the_oracle(model, outs, ids, hid)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reset_of_a_slot_outside_the_draft_keeps_its_record(variant):
    """reset(stream=i) of a slot the last draft call did not name leaves that call's record:
    commit() still works and leaves the slots as the accepted tokens alone would (engine and
    Decoder); a reset of a slot the call named voids the record (commit refuses)."""
    model = model_of(variant)
    L = model.cfg.layer_ids[0]
    rng = np.random.default_rng(11)
    ids = variant_ids(model, rng, (5,))
    h = _hidden(model, rng, 5)
    nxt, hn = variant_ids(model, rng, (2,)), _hidden(model, rng, 2)
    want = model.stream(L, 3)
    want.step_packed(np.concatenate([ids[:2], ids[3:4]]), None if h is None else np.concatenate([h[:2], h[3:4]]),
                     [0, 1], [2, 1])
    want_next = want.step_packed(nxt, hn, [0, 1], [1, 1])
    eng, dec = model.stream(L, 3), model.decoder(3)
    eng.step_packed(ids, h, [0, 1], [3, 2], draft=True)
    dec.begin_packed(ids, [0, 1], [3, 2], draft=True)
    for Ld in dec.layers:
        dec.layer(Ld, h)
    eng.reset(stream=2)
    dec.reset(stream=2)
    eng.commit([2, 1])
    dec.commit([2, 1])
    assert eng.tokens_seen.tolist() == [2, 1, 0]
    close(eng.step_packed(nxt, hn, [0, 1], [1, 1]), want_next)
    dec.begin_packed(nxt, [0, 1], [1, 1])
    close(dec.layer(L, hn), want_next)
    eng.step_packed(ids, h, [0, 1], [3, 2], draft=True)
    eng.reset(stream=1)
    with pytest.raises(RuntimeError, match="draft"):
        eng.commit([2, 1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_begin_packed_takes_the_batches_step_packed_takes(variant):
    """An empty batch and an all-masked one: Decoder.begin_packed takes them as step_packed
    does (the same outputs, the same commit)."""
    model = model_of(variant)
    rng = np.random.default_rng(12)
    dec = model.decoder(2)
    dec.begin_packed(np.zeros(0, np.int64), [], [])
    assert dec.pending() == list(dec.layers)
    for L in dec.layers:
        assert dec.layer(L, _hidden(model, rng, 0)).shape == dec.engines[L].out_shape(0)
    assert not dec.pending()
    ids = variant_ids(model, rng, (4,))
    h = _hidden(model, rng, 4)
    masked = np.ones(4, bool)
    engs = {L: model.stream(L, 2) for L in dec.layers}
    dec.begin_packed(ids, [1, 0], [3, 1], draft=True, masked=masked)
    for L, e in engs.items():
        want = e.step_packed(ids, h, [1, 0], [3, 1], draft=True, masked=masked)
        np.testing.assert_array_equal(dec.layer(L, h), want)
        e.commit([2, 1])
    dec.commit([2, 1])
    for L, e in engs.items():
        assert dec.engines[L].tokens_seen.tolist() == e.tokens_seen.tolist()


def _hold_the_same(a, b, exact=True):
    """Two engines (or Decoders) whose every slot holds the same state: every snapshot array equal
    (exact=False: the float ones within the tolerance, for states computed in other batches, whose
    GEMMs may sum in another order)."""
    sa, sb = a.snapshot(), b.snapshot()
    for x, y in ((sa, sb),) if not isinstance(sa, Mapping) else ((sa[L], sb[L]) for L in sa):
        for name in x.names:
            u, v = getattr(x, name), getattr(y, name)
            if exact or not np.issubdtype(np.asarray(u).dtype, np.floating):
                np.testing.assert_array_equal(u, v, err_msg=name)
            else:
                close(u, v, err_msg=name)


def _padded_batch(model, rng, history):
    """Slot 1 fed [a, b, PAD, PAD, c, d] (the pads masked) beside a decode step of slot 0, after
    `history` tokens on both slots; and the same batch without the pads."""
    hist = variant_ids(model, rng, (2, history))
    hist_h = variant_hidden(model, rng, (2, history))
    x = variant_ids(model, rng, (1,), p_dead=0.0, p_neg=0.0)
    a, b, c, d = variant_ids(model, rng, (4,), p_dead=0.0, p_neg=0.0)
    pad = variant_ids(model, rng, (2,), p_dead=0.0, p_neg=0.0)   # real ids: padding is not a token
    ids = np.array([x[0], a, b, pad[0], pad[1], c, d], np.int64)
    hid = _hidden(model, rng, 7)
    masked = np.array([False, False, False, True, True, False, False])
    return hist, hist_h, (ids, hid, [0, 1], [1, 6], masked), (ids[~masked], None if hid is None else hid[~masked],
                                                              [0, 1], [1, 4])


def _feed_history(eng, hist, hist_h, decoder):
    for s in range(hist.shape[0]):
        if not hist.shape[1]:
            continue
        if decoder:
            eng.begin_packed(hist[s], [s], [hist.shape[1]])
            for L in eng.layers:
                eng.layer(L, hist_h[s])
        else:
            eng.step_packed(hist[s], hist_h[s], [s], [hist.shape[1]])


def _run(eng, decoder, ids, hid, streams, lengths, masked=None, draft=False):
    if not decoder:
        return {None: eng.step_packed(ids, hid, streams, lengths, draft=draft, masked=masked)}
    eng.begin_packed(ids, streams, lengths, draft=draft, masked=masked)
    return {L: eng.layer(L, hid) for L in eng.layers}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("history", [0, 5], ids=["fresh", "continuing"])
@pytest.mark.parametrize("via", ["step_packed", "decoder"])
def test_a_masked_position_takes_no_part_in_any_ngram(variant, history, via):
    """One rule on every variant: a masked position is not a token. A slot fed [a, b, PAD, PAD,
    c, d] with the pads masked returns what the slot fed [a, b, c, d] returns at a, b, c, d
    (bit for bit: the same tokens in the same GEMM), 0 at the pads, and is left in the same
    state (windows, tokens seen, rows, the variant's own), on a fresh slot and on one with
    history."""
    model = model_of(variant)
    L = model.cfg.layer_ids[0]
    decoder = via == "decoder"
    make = (lambda: model.decoder(2)) if decoder else (lambda: model.stream(L, 2))
    rng = np.random.default_rng(31 + history)
    hist, hist_h, padded, plain = _padded_batch(model, rng, history)
    got_eng, want_eng = make(), make()
    _feed_history(got_eng, hist, hist_h, decoder)
    _feed_history(want_eng, hist, hist_h, decoder)
    masked = padded[4]
    got = _run(got_eng, decoder, *padded)
    want = _run(want_eng, decoder, *plain)
    for k in got:
        assert not got[k][masked].any()
        np.testing.assert_array_equal(got[k][~masked], want[k])
    _hold_the_same(got_eng, want_eng)
    nxt = variant_ids(model, rng, (2,), p_dead=0.0, p_neg=0.0)
    h = _hidden(model, rng, 2)
    got, want = _run(got_eng, decoder, nxt, h, [0, 1], [1, 1]), _run(want_eng, decoder, nxt, h, [0, 1], [1, 1])
    for k in got:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("via", ["step_packed", "decoder"])
def test_a_draft_with_masked_positions_commits_as_its_tokens(variant, via):
    """commit(accepted) counts the call's positions, masked ones included: keeping the first
    accepted[1] positions of [a, b, PAD, PAD, c, d] leaves the slot as the tokens among them
    alone would (a snapshot equal to it, the next token equal)."""
    model = model_of(variant)
    L = model.cfg.layer_ids[0]
    decoder = via == "decoder"
    make = (lambda: model.decoder(2)) if decoder else (lambda: model.stream(L, 2))
    rng = np.random.default_rng(47)
    hist, hist_h, padded, plain = _padded_batch(model, rng, 4)
    masked = padded[4]
    kept_of = np.cumsum(~masked[1:])   # unmasked tokens among slot 1's first k + 1 positions
    for acc in range(7):
        got_eng, want_eng = make(), make()
        _feed_history(got_eng, hist, hist_h, decoder)
        _feed_history(want_eng, hist, hist_h, decoder)
        _run(got_eng, decoder, *padded, draft=True)
        got_eng.commit([1, acc])
        n = int(kept_of[acc - 1]) if acc else 0
        ids, hid = plain[0][:1 + n], None if plain[1] is None else plain[1][:1 + n]
        _run(want_eng, decoder, ids, hid, [0, 1] if n else [0], [1, n] if n else [1])
        _hold_the_same(got_eng, want_eng, exact=False)
        snap = got_eng.snapshot()
        nxt = variant_ids(model, rng, (2,), p_dead=0.0, p_neg=0.0)
        h = _hidden(model, rng, 2)
        got, want = _run(got_eng, decoder, nxt, h, [0, 1], [1, 1]), _run(want_eng, decoder, nxt, h, [0, 1], [1, 1])
        for k in got:
            close(got[k], want[k])
        got_eng.restore(snap)   # the snapshot taken after the commit holds that state
        again = _run(got_eng, decoder, nxt, h, [0, 1], [1, 1])
        for k in got:
            np.testing.assert_array_equal(again[k], got[k])


@pytest.mark.parametrize("variant", VARIANTS)
def test_commit_rules(variant):
    model = model_of(variant)
    L = model.cfg.layer_ids[0]
    rng = np.random.default_rng(4)
    eng = model.stream(L, 3)
    ids = variant_ids(model, rng, (6,))
    h = variant_hidden(model, rng, (6,))
    eng.step_packed(ids, h[...], [2, 0], [4, 2], draft=True)
    for bad in ([1], [5, 1], [-1, 1], [1, 3]):
        with pytest.raises(ValueError, match="accepted"):
            eng.commit(bad)
    eng.commit([4, 0])
    assert eng.tokens_seen.tolist() == [0, 0, 4]
    with pytest.raises(RuntimeError, match="draft"):
        eng.commit([4, 0])          # once
    eng.step_packed(ids, h[...], [2, 0], [4, 2])
    with pytest.raises(RuntimeError, match="draft"):
        eng.commit([1, 1])          # only after a draft
    eng.step_packed(ids, h[...], [2, 0], [4, 2], draft=True)
    eng.step_packed(ids[:1], h[:1], [1], [1])   # a new call accepts the draft whole
    assert eng.tokens_seen.tolist() == [4, 1, 12]


def test_commit_costs_little_next_to_its_call():
    """Bounded rollback: the commit touches only the slots of the call (no engine copy)."""
    model = model_of("demo-v1")
    eng = model.stream(model.cfg.layer_ids[0], 16)
    rng = np.random.default_rng(0)
    ids = variant_ids(model, rng, (80,))
    h = rng.standard_normal((80, 2, 16)).astype(np.float32)
    eng.step_packed(ids, h, list(range(16)), [5] * 16, draft=True)
    before = eng.snapshot()
    eng.commit([0] * 16)
    after = eng.snapshot()
    assert np.array_equal(after.seen, before.seen - 5)


# ---- all or nothing across layers ------------------------------------------------------------------
class FakeTier(Tier):
    """A row tier that serves a model's own table rows, and fails on demand (layers in .down):
    when the read is started (fail_at "start": begin) or when it is waited for ("finish": the
    layer's call)."""

    def __init__(self, fail_at="start"):
        self.down, self.fail_at, self.log = set(), fail_at, []

    def open(self, model):
        return _FakeTables(self, model)


class _FakeTables(Tier):
    """A FakeTier opened for one model."""

    def __init__(self, tier, model):
        self.tier, self.model = tier, model

    def source(self, layer, read_totals=None):
        return _FakeRows(self.tier, self.model, layer)


class _FakeRows(RecordSource):
    def __init__(self, tier, model, layer):
        w = model.layer(layer)
        t = np.ascontiguousarray(w.table).view(np.uint8).reshape(w.table.shape[0], -1)
        if w.table_scale is not None:
            t = np.concatenate([t, np.ascontiguousarray(w.table_scale).view(np.uint8).reshape(t.shape[0], -1)], 1)
        super().__init__(t.shape[0], *record_layout(w))
        self.records, self.tier, self.layer, self.uniq = t, tier, layer, None

    def _check(self, when):
        if self.layer in self.tier.down and self.tier.fail_at == when:
            raise TierError(f"layer {self.layer} is down")

    def start(self, uniq):
        self._check("start")
        self.tier.log.append(("start", self.layer))
        self.uniq = uniq

    def finish(self):
        uniq, self.uniq = self.uniq, None
        self.tier.log.append(("finish", self.layer))
        self._check("finish")
        out = np.zeros((len(uniq), slot_bytes(self.records.shape[1])), np.uint8)
        out[:, :self.records.shape[1]] = self.records[uniq]
        return out


def _on_a_fake_tier(variant, tier, row_cache_mb=0):
    """(the model of `variant`, a copy of it whose rows come through `tier`)."""
    base = model_of(variant)
    model = EngramModel(base.cfg, base.plan, base.layers)
    model.tier = CachedTier(tier, row_cache_mb).open(model)
    return base, model


@pytest.mark.parametrize("fail_at", ["start", "finish"])
@pytest.mark.parametrize("variant", MULTI_LAYER)
def test_decoder_call_is_all_or_nothing(variant, fail_at):
    """Layer B's rows cannot be read after layer A's were (refused at begin, or failing while
    layer B waits for them after layer A ran): TierError, every layer stands as before the begin,
    and the same call works once the rows are back; outputs equal the oracle."""
    tier = FakeTier(fail_at)
    _, model = _on_a_fake_tier(variant, tier)
    La, Lb = model.cfg.layer_ids
    dec = model.decoder(2)
    ids, hid = _inputs(model, np.random.default_rng(6), 2, 6)
    outs = {L: [] for L in (La, Lb)}
    for p in range(6):
        if p == 3:
            before = dec.snapshot()
            tier.down = {Lb}
            with pytest.raises(TierError):
                dec.begin(ids[:, p])
                dec.layer(La, hid[:, p])
                dec.layer(Lb, hid[:, p])
            assert not dec.pending()
            _same_state(before, dec.snapshot())
            tier.down = set()
        dec.begin(ids[:, p])
        for L in (La, Lb):
            outs[L].append(dec.layer(L, hid[:, p]))
    _close_to_the_oracle(model, outs, ids, hid)


@pytest.mark.parametrize("variant", MULTI_LAYER)
def test_every_layers_reads_start_before_any_layer_runs(variant):
    """begin() and prefill() start every layer's reads (the sources' start) before any layer
    waits for its rows; each layer waits only for its own, in the order the layers run."""
    tier = FakeTier()
    _, model = _on_a_fake_tier(variant, tier, 0.01)
    La, Lb = model.cfg.layer_ids
    dec = model.decoder(2)
    rng = np.random.default_rng(2)
    ids, hid = _inputs(model, rng, 2, 3)
    dec.begin(ids[:, 0])
    assert tier.log == [("start", La), ("start", Lb)]
    assert all(dec.engines[L].row_source.reading for L in (La, Lb))
    dec.layer(La, hid[:, 0])
    assert tier.log[2:] == [("finish", La)] and dec.engines[Lb].row_source.reading
    dec.layer(Lb, hid[:, 0])
    assert tier.log[3:] == [("finish", Lb)]
    del tier.log[:]
    p_ids = variant_ids(model, rng, (40,))
    p_hid = _hidden(model, rng, 40)
    dec.prefill(p_ids, {La: p_hid, Lb: p_hid}, stream=1)
    assert tier.log == [("start", La), ("start", Lb), ("finish", La), ("finish", Lb)]


@pytest.mark.parametrize("variant", MULTI_LAYER)
def test_decoder_prefill_is_all_or_nothing(variant):
    """A prompt whose last layer's rows fail after the first layer ran: TierError, every layer
    as before; the same prefill then gives the oracle's outputs (each engine's own prefill)."""
    tier = FakeTier("finish")
    base, model = _on_a_fake_tier(variant, tier)
    La, Lb = model.cfg.layer_ids
    dec = model.decoder(3)
    rng = np.random.default_rng(4)
    ids, hid = _inputs(model, rng, 3, 2)
    for p in range(2):
        dec.begin(ids[:, p])
        for L in (La, Lb):
            dec.layer(L, hid[:, p])
    p_ids = variant_ids(model, rng, (70,))
    p_hid = {L: _hidden(model, rng, 70) for L in (La, Lb)}
    before = dec.snapshot()
    tier.down = {Lb}
    with pytest.raises(TierError):
        dec.prefill(p_ids, p_hid, stream=1)
    assert not dec.pending()
    _same_state(before, dec.snapshot())
    tier.down = set()
    got = dec.prefill(p_ids, p_hid, stream=1)
    ref = base.decoder(3)  # the mapped tables, each engine's own prefill
    ref.restore(before)
    for L in (La, Lb):
        np.testing.assert_array_equal(got[L], ref.engines[L].prefill(p_ids, p_hid[L], stream=1))
    with pytest.raises(ValueError):  # a bad hidden for the last layer: refused before any layer is fed
        dec.prefill(p_ids, {La: p_hid[La], Lb: np.zeros(5, np.float32) if p_hid[Lb] is None else p_hid[Lb][:5]},
                    stream=0)
    assert not dec.pending()


# ---- the rows alone ---------------------------------------------------------------------------------
def _oracle_rows(model, L, ids):
    """[T, E] rows of one request, from the numpy hash and the weights' own dequantization."""
    rows = model.plan.hash_numpy(ids[None], layers=[L])[L][0] + model.plan.offsets[L]
    w = model.layer(L)
    if model.plan.dead_id is not None:   # V4.1's float8 rows and their scales
        from engram_stream.v41.reference import dequant_rows
        return dequant_rows(w, rows).reshape(len(ids), -1)
    return w.table_f32(rows).reshape(len(ids), -1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_lookup_packed_gives_each_requests_rows(variant):
    import ml_dtypes
    model = model_of(variant)
    L = model.cfg.layer_ids[-1]
    rng = np.random.default_rng(12)
    reqs = [variant_ids(model, rng, (n,)) for n in (9, 1, 30)]
    eng = model.stream(L, 4)
    got = {k: [] for k in range(3)}
    for lo, hi in ((0, 4), (4, 5), (5, 30)):   # chunks of each request, interleaved in one call each
        segs = [(k, r[lo:hi]) for k, r in enumerate(reqs) if len(r[lo:hi])]
        ids = np.concatenate([t for _, t in segs])
        out = eng.lookup_packed(ids, [k + 1 for k, _ in segs], [len(t) for _, t in segs])
        i = 0
        for k, t in segs:
            got[k].append(out[i:i + len(t)])
            i += len(t)
    for k, r in enumerate(reqs):
        np.testing.assert_array_equal(np.concatenate(got[k]), _oracle_rows(model, L, r))
    ids = variant_ids(model, rng, (5,))
    f32 = model.stream(L).lookup_packed(ids, [0], [5])
    b16 = model.stream(L).lookup_packed(ids, [0], [5], dtype="bfloat16")
    assert b16.dtype == ml_dtypes.bfloat16 and np.array_equal(b16, f32.astype(ml_dtypes.bfloat16))


_ALLOC = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from helpers.models import make_model, make_v41_model
from helpers.processes import native_allocations
res = {}
for variant, model in (("demo-v1", make_model(G=2, n=3, K=3, D=136, vocab=60, layers=(1,))),
                       ("deepseek-v4.1", make_v41_model(D=128))):
    G, D = model.cfg.hc_mult, model.cfg.hidden_size
    eng = model.stream(1, 4)
    rng = np.random.default_rng(0)
    streams, lengths = np.array([2, 0, 3], np.int64), np.array([3, 1, 1], np.int64)
    ids = [rng.integers(0, 60, 5).astype(np.int64) for _ in range(300)]
    h = rng.standard_normal((5, G, D)).astype(np.float32)
    out = np.empty_like(h)
    for t in range(10):
        eng.step_packed(ids[t], h, streams, lengths, out=out)
    for mode, o in (("out", out), ("no_out", None)):
        def packed():
            for t in range(300):
                eng.step_packed(ids[t], h, streams, lengths, out=o)
        res[f"{variant}_{mode}"] = native_allocations(packed)
print(json.dumps(res))
"""


def test_packed_calls_allocate_nothing_with_out():
    """No native allocation in 300 packed calls given out= and int64 arrays (memray.Tracker in a
    subprocess); the same loop without out= shows its fresh outputs, so the measurement can fail."""
    pytest.importorskip("memray")
    import json
    import os
    from helpers.processes import run_python
    from helpers.repo import ROOT
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("allocation counts are the optimized build's: CI's sanitized -O0 build (bounds checks, "
                    "interceptors) allocates where the release build does not; CI's first run covers it")
    r = run_python(["-c", _ALLOC, os.path.join(ROOT, "tests")], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for variant in ("demo-v1", "deepseek-v4.1"):
        n, nbytes = res[f"{variant}_out"]
        assert n <= 2 and nbytes < 4096, res
        assert res[f"{variant}_no_out"][0] >= 300, res
