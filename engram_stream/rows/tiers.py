"""The rows a model's engines read: the RAM row cache and the row source behind it.

    model = EngramModel.load(path, row_cache_mb=64)                # a cache in front of the file
    model = EngramModel.load(path, tables=tier, row_cache_mb=64)   # rows from a MooncakeTier

Row records. A row travels and is cached as its bytes in the table's dtype, followed
for int8 tables by its float32 scale: the gather converts a record exactly as it
converts a table row, so every source gives the same floats bit for bit.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from ._cache import RowCache, cache_nbytes, slots_for
from ._source import CachedRows, MappedRows


# ---- row records --------------------------------------------------------------------------------
def record_arrays(w):
    """(rows, scales) of layer weights `w` as byte views: uint8 [N, row bytes] and uint8 [N, scale
    bytes] (None without scales): demo int8 tables have a float32 scale per row, V4.1 tables
    8 e8m0 bytes. A record is a row's bytes followed by its scale's."""
    t = np.ascontiguousarray(w.table)
    rows = t.reshape(t.shape[0], -1).view(np.uint8)
    if w.table_scale is None:
        return rows, None
    s = np.ascontiguousarray(w.table_scale)
    return rows, s.reshape(s.shape[0], -1).view(np.uint8)


def record_layout(w):
    """(row bytes, scale bytes) of one row record of layer weights `w`."""
    rows, scales = record_arrays(w)
    return rows.shape[1], (0 if scales is None else scales.shape[1])


class RowTiers:
    """The row source and RAM budget of a loaded model (model.row_tiers).

    row_cache_mb: the model's whole cache budget (at most what caching every row costs: a larger
    one caches the tables whole), split over layers in proportion to their table bytes; each
    engine of a layer owns a cache of that layer's share (one engine, one owner: the cache needs
    no lock; a second engine of the same layer gets a cache of its own).
    tier: None (rows from the model's own table) or a MooncakeTier."""

    def __init__(self, model, row_cache_mb=0, tier=None):
        if (not isinstance(row_cache_mb, (int, float)) or isinstance(row_cache_mb, bool)
                or not math.isfinite(row_cache_mb) or row_cache_mb < 0):
            raise ValueError(f"row_cache_mb must be a finite number >= 0, got {row_cache_mb!r}")
        if tier is not None and not callable(getattr(tier, "rows", None)):
            raise TypeError(f"tables= takes a row tier (a MooncakeTier), got {type(tier).__name__}")
        self.model_ref = weakref.ref(model)
        self.tier = tier
        table_bytes = {L: model.layer(L).table.nbytes + (0 if model.layer(L).table_scale is None
                                                          else model.layer(L).table_scale.nbytes)
                       for L in model.cfg.layer_ids}
        whole = {L: cache_nbytes(model.layer(L).table.shape[0], sum(record_layout(model.layer(L))))
                 for L in table_bytes}  # a layer's cache holding every row
        total, asked = sum(table_bytes.values()), int(row_cache_mb * (1 << 20))
        self.budget = min(asked, sum(whole.values()))
        self.layer_budget = (whole if asked >= sum(whole.values()) else
                             {L: min(whole[L], self.budget * b // max(1, total)) for L, b in table_bytes.items()})
        self.caches = weakref.WeakSet()                        # live ones
        self.retired = {L: np.zeros(4, np.int64) for L in table_bytes}  # counters of caches gone
        self.remote = {"fetches": 0, "fetch_seconds": 0.0}      # every remote read of this model
        if tier is not None:
            tier.check_published(model)

    def for_model(self, model) -> "RowTiers":
        """The same budget and row source for another model of the same tables (a
        with_weight_dtype copy)."""
        return RowTiers(model, self.budget / (1 << 20), self.tier)

    def source_for(self, layer):
        """The RowSource one engine of `layer` reads through: its own cache (of the layer's share
        of the budget) in front of the local table or of the remote tier."""
        model = self.model_ref()
        w = model.layer(layer)
        cache = self.new_cache(layer)
        if self.tier is None:
            local = MappedRows(w.table, w.table_scale)
            return CachedRows(cache, local=local) if cache.nslots else local
        rowbytes, scalebytes = record_layout(w)
        remote = self.tier.rows(model, layer, self.remote)
        return CachedRows(cache, fetch=remote.fetch, rowbytes=rowbytes, scalebytes=scalebytes,
                          nrows=model.plan.table_rows[layer])

    def new_cache(self, layer) -> RowCache:
        """A RowCache of this layer's share of the budget (for one engine)."""
        model = self.model_ref()
        rowbytes, scalebytes = record_layout(model.layer(layer))
        cache = RowCache(slots_for(self.layer_budget[layer], rowbytes + scalebytes), rowbytes + scalebytes, layer,
                         self.retired[layer])
        self.caches.add(cache)
        return cache

    def new_source(self, layer):
        """The remote rows of a layer for one engine (its own staging buffer), or None (local)."""
        if self.tier is None:
            return None
        return self.tier.rows(self.model_ref(), layer, self.remote)

    def stats(self) -> dict:
        counters = RowCache.COUNTERS
        sizes = ("rows_cached", "capacity_rows", "cache_bytes")  # of the live caches
        per = {L: dict(zip(counters, map(int, t)), **dict.fromkeys(sizes, 0)) for L, t in self.retired.items()}
        for c in list(self.caches):
            for k, v in c.stats().items():
                per[c.layer][k] += v
        out = {k: sum(p[k] for p in per.values()) for k in counters + sizes}
        out["layers"] = per
        out["budget_bytes"] = self.budget
        if self.tier is not None:
            out.update(self.remote)
        return out
