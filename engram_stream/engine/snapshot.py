"""The snapshot types: EngineSnapshot (one engine's per-stream state, as named arrays) and
DecoderSnapshot (a Decoder's: one EngineSnapshot a layer).

Every engine has the arrays of the base (hist: the hash windows, seen: tokens since reset,
rows: the last token's table rows); a variant adds its own (the demo: ring and pos, its
ShortConv state). restore() reads each array once, checks them all, then commits.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class EngineSnapshot:
    """A copy of an engine's per-stream state: EngineSnapshot(fingerprint, hist=..., seen=..., ...).

    Restorable into the engine it came from or any engine of the same layer, config, hash plan
    and stream count (speculative decoding: snapshot, try tokens, restore)."""

    def __init__(self, fingerprint, **arrays):
        self.fingerprint = fingerprint
        self.names = tuple(arrays)
        for name, a in arrays.items():
            if isinstance(a, np.ndarray):
                a.flags.writeable = False
            setattr(self, name, a)

    @property
    def nbytes(self):
        return sum(a.nbytes for a in (getattr(self, n, None) for n in self.names) if isinstance(a, np.ndarray))

    def __repr__(self):
        return (f"EngineSnapshot(layer={self.fingerprint[0]}, n_streams={self.fingerprint[2]}, "
                f"arrays={list(self.names)}, {self.nbytes} bytes)")


class DecoderSnapshot(Mapping):
    """A copy of a Decoder's state: every Engram layer's EngineSnapshot, from Decoder.snapshot().

    Read-only, and a mapping {layer: EngineSnapshot} (snap[L], sorted(snap), len(snap)), so a
    layer's part can be handed to that layer's engine. Decoder.restore() takes it back into the
    decoder it came from or any decoder of the same model's layers and stream count, checking
    every layer before changing any."""

    def __init__(self, layers):
        self._layers = dict(layers)
        for L, snap in self._layers.items():
            if not isinstance(snap, EngineSnapshot):
                raise TypeError(f"DecoderSnapshot: layer {L} must be an EngineSnapshot, got {type(snap).__name__}")

    def __getitem__(self, layer):
        return self._layers[layer]

    def __iter__(self):
        return iter(self._layers)

    def __len__(self):
        return len(self._layers)

    @property
    def layers(self) -> list:
        return list(self._layers)

    @property
    def nbytes(self):
        return sum(s.nbytes for s in self._layers.values())

    def __repr__(self):
        streams = sorted({s.fingerprint[2] for s in self._layers.values()})
        return (f"DecoderSnapshot(layers={self.layers}, n_streams={streams[0] if len(streams) == 1 else streams}, "
                f"{self.nbytes} bytes)")


def fingerprint(cfg, layer, n_streams, mult, lookup) -> tuple:
    """What a snapshot must match to be restored: (layer, the config's semantics as JSON,
    stream count, multipliers, lookup digest). The sizes a checkpoint declares (checks, not
    semantics: the variant's Variant.declared_fields, which its save adds) are left out, so a
    model saved and loaded again takes its own snapshots."""
    import hashlib
    import json

    from ..variants import variant_of
    d = cfg.to_dict()
    for k in variant_of(cfg).declared_fields:
        d.pop(k, None)
    return (layer, json.dumps(d, sort_keys=True), n_streams, np.asarray(mult).tobytes(),
            None if lookup is None else hashlib.sha1(np.asarray(lookup).tobytes()).hexdigest())


def why_foreign(fp, mine) -> str:
    return ("layer" if fp[0] != mine[0] else "config" if fp[1] != mine[1] else
            "stream count" if fp[2] != mine[2] else "hash plan")
