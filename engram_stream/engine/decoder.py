"""Decoder: every Engram layer of a model, driven one call at a time.

A token's table rows depend only on the tokens, so when a batch arrives the decoder hashes
every layer at once (begin / begin_packed), before any layer runs: each layer's row source
gets its rows then (a mapped table is asked to page them in, a remote or disk source starts
reading), so the reads overlap the compute of the layers in between, and each layer's call
(layer) only waits for its own rows, gathers, projects and runs its tails.

    dec = model.decoder(n_streams=1)
    for tok in tokens:
        dec.begin(tok)                     # hash all layers, start their rows
        for i, block in enumerate(blocks):
            if i in dec.layers:
                h = h + dec.layer(i, h)    # Engram output, caller adds the residual
            h = block(h)

A serving loop: dec.begin_packed(ids[N], streams[K], lengths[K], draft=, masked=), then
dec.layer(L, hidden[N, G, D]) per layer, then (drafts) dec.commit(accepted[K]).

An input layer (its engine's input_layer: a token in, float32[.., D] out) runs as dec.layer(L)
with no hidden (None); in step() and prefill() its hiddens entry is None or left out.

All or nothing: a begin that fails for one layer (a bad id, a failed read) leaves every layer
as before it; a layer() whose rows cannot be read puts every layer back as before the begin
(the ones that ran already too), so the same call can be retried once the rows are back.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import LayerError
from ..plan import as_ids
from . import args
from .snapshot import DecoderSnapshot


class Decoder:
    """Per-layer engines behind one clock.

    prefetch: "auto" or True (at begin, ask each layer's row source to bring the rows near: a
    mapped file pages them in, a cache asks its source for the rows it lacks, a source that
    started reading at feed does nothing more), False (never ask)."""

    def __init__(self, model, n_streams: int = 1, prefetch="auto"):
        if prefetch not in ("auto", True, False):
            raise ValueError(f"prefetch must be 'auto', True or False, got {prefetch!r}")
        self.model = model
        self.n_streams = n_streams
        self.engines = {L: model.stream(L, n_streams) for L in model.cfg.layer_ids}
        self.prefetch = prefetch is not False
        self._ran = []   # layers that ran for the current batch (a later layer's failure puts them back)
        self._empty = None  # a begun batch with no token to feed: (its step_packed arguments, layers left)

    @property
    def layers(self):
        return tuple(self.engines)

    def pending(self):
        """Layers that still have to run for the current batch."""
        left = self._empty[1] if self._empty else ()
        return [L for L, e in self.engines.items() if e.pending_compute or L in left]

    def _no_pending(self, what):
        left = self.pending()
        if left:
            raise RuntimeError(f"layers {left} have not run for the current token: call layer() for them "
                               f"before {what}")

    def _feed_all(self, feed):
        """feed(engine) for every layer, all or nothing."""
        self._no_pending("begin()")
        fed = []
        try:
            for L, e in self.engines.items():
                feed(e)
                fed.append(e)
                if self.prefetch:
                    e.prefetch()
        except BaseException:
            for e in fed:
                e._abort()
            raise
        self._ran = []
        self._empty = None

    def begin(self, token_ids):
        """A new token (per stream): hash every layer now and hand each its rows. All or nothing:
        the ids are read once and checked by every layer before any is fed."""
        self._no_pending("begin()")
        ids, _ = self.engines[self.layers[0]]._ids(token_ids)  # read once: an int or an int64[S] array
        for e in self.engines.values():
            e._ids(ids)
        self._feed_all(lambda e: e.feed(ids))

    def begin_packed(self, token_ids, streams, lengths, draft=False, masked=None):
        """A serving batch for every layer (see the engines' step_packed): segment k is lengths[k]
        tokens of slot streams[k]; then layer(L, hidden[N, G, D]) for each layer, and after a
        draft, commit(accepted). All or nothing, as begin(). A batch with no token left to feed
        (none given, or every position masked) is taken as step_packed takes it: each layer's
        call returns its zeros."""
        self._no_pending("begin()")
        e0 = self.engines[self.layers[0]]
        ids = as_ids(token_ids, 1, "token_ids")
        st, ln = e0._segments(streams, lengths, ids.shape[0])
        if e0._masked(ids, st, ln, masked)[0].shape[0] == 0:
            self._ran = []
            self._empty = ((ids, st, ln, bool(draft), masked), set(self.engines))
            return
        self._feed_all(lambda e: e.feed_packed(ids, st, ln, draft=draft, masked=masked))

    def layer(self, layer, hidden=None, out=None):
        """Layer `layer`'s Engram output for the current batch (hidden [G, D], [S, G, D] or, after
        begin_packed, [N, G, D]; an input layer's None, its output [D], [S, D] or [N, D]). When
        its rows cannot be read, every layer is put back as before the begin and the error is
        raised."""
        e = self.engines.get(layer)
        if e is None:
            raise LayerError(f"layer {layer!r} is not an Engram layer (layers={self.layers})")
        if self._empty and layer in self._empty[1]:
            (ids, st, ln, draft, masked), left = self._empty
            out = e.step_packed(ids, hidden, st, ln, out=out, draft=draft, masked=masked)
            left.discard(layer)
            self._ran.append(layer)
            return out
        if not e.pending_compute:
            raise RuntimeError(f"layer({layer!r}) needs begin(token_ids) first (each layer runs once per token)")
        # the caller's arrays first, whatever they raise: nothing has changed, call again
        h, o = e._io(hidden, out, e._pending_n(hidden))
        try:
            res = e.compute(h, out=o)
        except BaseException:  # its rows could not be read: every layer back as before the begin
            for other in self.engines.values():
                other._abort()
            self._ran = []
            raise
        self._ran.append(layer)
        return res if out is None else out  # the caller's own (a torch tensor stays one)

    def commit(self, accepted):
        """After begin_packed(..., draft=True) and every layer: each layer's slots stand as if only
        the first accepted[k] tokens of segment k had been fed."""
        self._no_pending("commit()")
        for e in self.engines.values():   # the checks of every layer before any changes
            e._check_commit(accepted)
        for e in self.engines.values():
            e.commit(accepted)

    def _check_hiddens(self, hiddens):
        """{layer: hidden or None} of every layer: the layers that read a hidden each have theirs,
        an input layer's is None or left out (hiddens itself may be None when every layer is one)."""
        if hiddens is None:
            hiddens = {}
        if not isinstance(hiddens, dict):
            raise TypeError(f"hiddens must be a dict {{layer: hidden}} for the layers {list(self.engines)}, "
                            f"got {type(hiddens).__name__}")
        need = [L for L, e in self.engines.items() if not e.input_layer]
        if not set(need) <= set(hiddens) or not set(hiddens) <= set(self.engines):
            inputs = [L for L in self.engines if L not in need]
            raise ValueError(f"hiddens must have exactly the layers {need}" +
                             (f" (and may have the input layers {inputs}, each None)" if inputs else "") +
                             f", got {sorted(hiddens)}")
        return {L: hiddens.get(L) for L in self.engines}

    def step(self, token_ids, hiddens: dict = None) -> dict:
        """begin() then every layer in order: {layer: hidden} -> {layer: output} (an input
        layer's hidden None or left out). (A real model feeds each layer the hidden state its
        earlier layers produced.)"""
        hiddens = self._check_hiddens(hiddens)
        self._no_pending("step()")
        S = self.n_streams
        hid = {}
        for L, e in self.engines.items():  # every hidden checked before any layer is fed
            one = S == 1 and (np.ndim(hiddens[L]) == 2 if hiddens[L] is not None else
                              isinstance(token_ids, (int, np.integer)))
            hid[L] = e._io(hiddens[L], None, None if one else S)[0]
        self.begin(token_ids)
        return {L: self.layer(L, hid[L]) for L in self.engines}

    def prefill(self, ids, hiddens: dict = None, stream: int = 0) -> dict:
        """A prompt on one stream for every layer: {layer: hidden[T, G, D]} -> {layer: out} (an
        input layer's hidden None or left out). One packed call of one segment (as each engine's
        prefill): every layer's rows are handed to its source before any layer runs, and a
        failed read leaves every layer as before."""
        hiddens = self._check_hiddens(hiddens)
        self._no_pending("prefill()")
        a = as_ids(ids, 1, "ids")
        args.stream_index(stream, self.n_streams)
        if a.shape[0] == 0:
            return {L: e.prefill(a, hiddens[L], stream=stream) for L, e in self.engines.items()}
        hid = {L: e._io(hiddens[L], None, a.shape[0])[0] for L, e in self.engines.items()}
        self.begin_packed(a, [stream], [a.shape[0]])  # every hidden checked first: no layer is left pending
        return {L: self.layer(L, hid[L]) for L in self.engines}

    def reset(self, stream=None):
        """Forget one stream's history (or every stream's, which also drops a begun token)."""
        if stream is not None:
            self._no_pending("reset(stream) (or reset() every stream)")
        else:
            self._empty = None
        for e in self.engines.values():
            e.reset(stream)

    def snapshot(self) -> DecoderSnapshot:
        """Every layer's per-stream state (a DecoderSnapshot: {layer: EngineSnapshot}, a few KB)."""
        self._no_pending("snapshot()")
        return DecoderSnapshot({L: e.snapshot() for L, e in self.engines.items()})

    def restore(self, snapshot: DecoderSnapshot):
        """Put back a snapshot() of this decoder or of one with the same layers, config, hash plan
        and stream count; every layer is checked before any changes. A plain dict {layer:
        EngineSnapshot} is taken too."""
        if not isinstance(snapshot, Mapping):
            raise TypeError(f"restore() takes a DecoderSnapshot (Decoder.snapshot()), got {type(snapshot).__name__}")
        if sorted(snapshot) != sorted(self.engines):
            raise ValueError(f"snapshot has layers {sorted(snapshot)}, this decoder {sorted(self.engines)}: "
                             f"restore a Decoder.snapshot() of a decoder with the same layers")
        for L, e in self.engines.items():  # check all before changing any
            e._check_snapshot(snapshot[L])
        for L, e in self.engines.items():
            e.restore(snapshot[L])
