"""A place for rows, in two classes: a Tier says where a model's rows live, before any model
(what tables= names); Tier.open(model) gives that model's Tables, built whole (checked, files
opened, budget split), which makes each engine's RowSource. The API a store of its own writes:

    class MyTier(Tier):                      # made from a spec's arguments: no model yet
        def open(self, model) -> "MyTables":
            return MyTables(self, model)

    class MyTables(Tables):                  # one model's rows: everything made in __init__
        def __init__(self, tier, model):
            super().__init__(tier)           # .tier: the Tier it was opened from
            ...
        def source(self, layer, read_totals=None) -> RowSource:   # one engine's reader of `layer`
            ...                              # read_totals: the layer's rows._direct.new_totals()
                                             # array its reads add to (reads, bytes, rows, waits), or None
        def stats(self) -> dict:             # fields it adds to row_cache_stats() (optional)
            return {}

    rows.register_tier("mine", MyTier)       # tables="mine", tables={"mine": {arguments}}

The RowSource is any subclass of rows._source.RowSource (RecordSource for records fetched by
Python code: start(rows), finish()). The tiers of the package: MappedTier ("mapped", rows/mapped.py),
DirectTier ("direct", rows/direct.py), MooncakeTier ("mooncake", rows/mooncake/tier.py), and
CachedTier (rows/tiers.py: the RAM row cache over any of them, the tables a loader opens:
model.tables, a CachedTables). rows.tiers.parse_tier(spec) reads the registry.
"""
from __future__ import annotations

import re

_REGISTRY = {}   # name -> Tier subclass: what parse_tier makes of tables="name"
NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


class Tier:
    """Where a model's table rows live, before a model (a spec of tables=). open(model) gives
    that model's Tables."""

    def open(self, model) -> "Tables":
        raise NotImplementedError(f"{type(self).__name__}.open(model) must return the model's Tables")


class Tables:
    """A Tier opened for one model, built whole by its constructor: source(layer) makes the
    RowSource one engine of `layer` reads through; stats() the fields it adds to
    row_cache_stats() (rows.tiers.STATS_FIELDS). tier: the Tier it was opened from."""

    def __init__(self, tier: Tier):
        self.tier = tier

    def source(self, layer, read_totals=None):
        raise NotImplementedError(f"{type(self).__name__}.source(layer, read_totals) must return a RowSource")

    def stats(self) -> dict:
        return {}


def register_tier(name: str, cls) -> None:
    """Let a spec name `cls` (a Tier subclass): tables="name" is cls(), tables={"name": {kw}}
    is cls(**kw). A name is given once (a second class under it is refused, the same class
    again is nothing); register_tier(name, None) takes it back."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"register_tier: a tier's name is a lowercase letter then up to 31 lowercase letters, "
                         f"digits or '_', got {name!r}")
    if cls is None:
        _REGISTRY.pop(name, None)
        return
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"register_tier({name!r}, ...): give a subclass of engram_stream.rows.Tier, got {cls!r}")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"register_tier: {name!r} names {_REGISTRY[name].__qualname__} already: give "
                         f"{cls.__qualname__} another name, or register_tier({name!r}, None) first")
    _REGISTRY[name] = cls


def registered_tiers() -> dict:
    """{name: Tier subclass} of every registered tier (a copy)."""
    return dict(_REGISTRY)
