"""Inputs of any variant (ids, hidden states, the shape of an output), runs of a decoder over
them, and Oracle: the expected outputs of streams stepped through an engine."""
import numpy as np
import pytest

from helpers.numeric import close


def variant_ids(model, rng, shape, p_dead=0.15, p_neg=0.05):
    """Random ids for any variant: some negative (demo: they pass through; V4.1: DEAD in the
    window), and for V4.1 image (DEAD) tokens, for Qwen EOS tokens, also at the start and in runs."""
    cfg = model.cfg
    ids = rng.integers(0, cfg.vocab_size, shape).astype(np.int64)
    if model.plan.dead_id is not None:
        ids[rng.random(shape) < p_dead] = model.plan.dead_id
    from engram_stream import variants
    if getattr(variants.variant_of(cfg), "negative_ids", True):   # longcat-flash-lite's ids index its embedding
        ids[rng.random(shape) < p_neg] = -rng.integers(1, 5)
    if model.plan.history == "separator":  # Qwen: EOS ends a document, also at the start and in runs
        ids[rng.random(shape) < p_dead] = cfg.pad_id
    return ids


class NoHidden:
    """The hidden of an input layer's calls in the contract suites: None at every index, so the
    suites index one hidden for every variant (h[:, p]; h[...] for the whole) and an input layer
    is handed None wherever a residual layer gets its array."""

    def __getitem__(self, index):
        return None


def variant_hidden(model, rng, shape):
    """Random hidden states float32[*shape, G, D] for `model`; an input layer's: NoHidden (None
    at every index, no draw)."""
    from engram_stream import variants
    if variants.variant_of(model.cfg).input_layer:
        return NoHidden()
    return rng.standard_normal(tuple(shape) + (model.cfg.hc_mult, model.cfg.hidden_size)).astype(np.float32)


def out_shape(model, *lead):
    """The shape of an output of `model` with leading dims `lead` ([.., G, D]; an input layer's [.., D])."""
    from engram_stream import variants
    if variants.variant_of(model.cfg).input_layer:
        return tuple(lead) + (model.cfg.hidden_size,)
    return tuple(lead) + (model.cfg.hc_mult, model.cfg.hidden_size)


def variant_inputs(model, seed, shape):
    """variant_ids and variant_hidden of `shape` (S, T) or (T,), drawn in that order from one
    generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    return variant_ids(model, rng, shape), variant_hidden(model, rng, shape)


def stepped(model, layer, ids, hid, n):
    """An engine of `layer` over the S streams of ids [S, T] that has stepped their first n tokens
    (hid [S, T, G, D])."""
    eng = model.stream(layer, n_streams=ids.shape[0])
    for t in range(n):
        eng.step(ids[:, t], hid[:, t])
    return eng


def decode_inputs(model, S, T, P, seed):
    """Steps ids [T, S] (every 5th step the same id in all streams: each row S times in the batch),
    hidden [T, S, G, D]; a prompt of P ids and its hidden."""
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    ids = variant_ids(model, rng, (T, S))
    ids[::5] = ids[::5, :1]
    hid = rng.standard_normal((T, S, cfg.hc_mult, cfg.hidden_size), dtype=np.float32)
    p_ids = variant_ids(model, rng, (P,))
    p_hid = rng.standard_normal((P, cfg.hc_mult, cfg.hidden_size), dtype=np.float32)
    return ids, hid, p_ids, p_hid


def decode_run(model, S, T=25, P=300, seed=0):
    """A prompt prefilled on the last stream (it spans prefill chunks), then T steps of every
    stream: {layer: [outputs]}."""
    ids, hid, p_ids, p_hid = decode_inputs(model, S, T, P, seed)
    dec = model.decoder(n_streams=S)
    outs = {L: [] for L in model.cfg.layer_ids}
    for L, y in dec.prefill(p_ids, {L: p_hid for L in outs}, stream=S - 1).items():
        outs[L].append(y)
    for t in range(T):
        dec.begin(ids[t] if S > 1 else int(ids[t, 0]))
        for L in outs:
            outs[L].append(dec.layer(L, hid[t] if S > 1 else hid[t, 0]).copy())
    return outs


def assert_decoded_identically(got, want):
    for L in want:
        assert len(got[L]) == len(want[L])
        for a, b in zip(got[L], want[L]):
            np.testing.assert_array_equal(a, b)  # bit for bit


def random_inputs(model, S, T, rng, neg=True):
    """ids int64[S, T] (some negative: they pass through uncompressed), hidden float32[S, T, G, D]."""
    cfg = model.cfg
    ids = rng.integers(-3 if neg else 0, cfg.vocab_size, (S, T)).astype(np.int64)
    hid = rng.standard_normal((S, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    return ids, hid


class Oracle:
    """Expected outputs per stream. Stream s plays row s of ids/hid; pos[s] is its next token."""

    def __init__(self, model, L, ids, hid):
        self.model, self.L = model, L
        self.input_layer = model.variant.input_layer
        self.ids = ids.copy()
        self.hid = hid if self.input_layer else hid.copy()
        self.want = model.forward(L, self.ids, self.hid[...]).copy()
        self.pos = np.zeros(len(ids), np.int64)

    def now(self):
        r = np.arange(len(self.pos))
        return self.ids[r, self.pos], self.hid[r, self.pos]

    def step(self, eng, out=None):
        ids, hid = self.now()
        got = eng.step(ids, hid, out=out)
        self.check(got)
        return got

    def check(self, got):
        r = np.arange(len(self.pos))
        close(got, self.want[r, self.pos])
        self.pos += 1

    def prefill(self, eng, s, T):
        p = self.pos[s]
        got = eng.prefill(self.ids[s, p:p + T], None if self.input_layer else self.hid[s, p:p + T], stream=s)
        close(got, self.want[s, p:p + T])
        self.pos[s] += T
        return got

    def restart(self, s, ids_row, hid_row):
        """Stream s starts a new sequence (after reset)."""
        self.ids[s] = ids_row
        if not self.input_layer:
            self.hid[s] = hid_row
        self.want[s] = self.model.forward(self.L, ids_row[None], None if self.input_layer else hid_row[None])[0]
        self.pos[s] = 0


def engine_state(eng):
    """Every field of the engine's snapshot, in order."""
    snap = eng.snapshot()
    return [getattr(snap, k) for k in snap.names]


def assert_step_threads_agree(model, L, ids, hid):
    """S streams (ids [S, T]) stepped by engines on 1, 2 and 3 threads: the oracle's outputs,
    bitwise the same on every thread count, and the same state after."""
    S, T = ids.shape
    want = model.forward(L, ids, hid[...])
    engs = [model.stream(L, S) for _ in range(3)]
    for e, th in zip(engs, (1, 2, 3)):
        e.step_threads = th
    for t in range(T):
        got = [e.step(ids[:, t], hid[:, t]) for e in engs]
        close(got[0], want[:, t])
        for g in got[1:]:
            assert np.array_equal(g, got[0])  # split by columns and streams, never by k
    for e in engs[1:]:
        for a, b in zip(engine_state(e), engine_state(engs[0])):
            assert np.array_equal(a, b)


def assert_foreign_snapshots_refused(eng, o, good, foreign):
    """After 6 tokens a stream of `o` took a snapshot `good`, and 3 more: each foreign snapshot
    (ValueError) and each non-snapshot (TypeError) is refused, and the streams go on unchanged."""
    for _ in range(3):
        o.step(eng)
    for bad in foreign:
        with pytest.raises(ValueError):
            eng.restore(bad)
    for bad in (None, {"hist": good.hist}, good.__dict__):
        with pytest.raises(TypeError):
            eng.restore(bad)
    assert eng.tokens_seen.tolist() == [9, 9, 9]
    for _ in range(10):  # nothing was restored: the sequences continue
        o.step(eng)
