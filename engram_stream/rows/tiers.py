"""The rows a model's engines read: the spec of a tier, and the RAM row cache over any tier.

    model = EngramModel.load(path, row_cache_mb=64)                    # a cache in front of the file
    model = EngramModel.load(path, tables="direct", row_cache_mb=64)   # rows read from the files
    model = EngramModel.load(path, tables=tier, row_cache_mb=64)       # rows from a MooncakeTier
    model = EngramModel.load(path, row_cache_mb=64, host_cache="vllm") # one cache for the host's processes

tables= is a spec (parse_tier: "mapped", "direct", a Tier, {"mooncake": {...}}) of a Tier
(rows/_source.pyx: where rows live; open(model) gives the model's Tier, whose source(layer) makes
each engine's RowSource); CachedTier is the model's shared RAM row cache in front of every source
its tier makes (model.tier). Rows travel and are cached as records (records.py): the gather converts a record exactly as
it converts a table row, so every source gives the same floats bit for bit.
"""
from __future__ import annotations

import math
import numbers
import os
import re
import threading
import weakref

import numpy as np

from ..errors import shown
from ._cache import RowCache, cache_nbytes, slots_for
from ._direct import new_totals, totals_summary
from ._source import CachedRows, Tier
from .direct import DirectTier
from .mapped import MappedTier
from .identity import host_model_id
from .gguf_tier import GGUFTier
from .mooncake.tier import MooncakeTier
from .records import record_layout


# Every field of row_cache_stats(): its unit and its one meaning, whichever source is behind the
# cache (DESIGN.md's table of them is checked against this). A lookup is one row of one position
# (token, head) of one layer; a record is a row's bytes then its scale's (264 bytes for V4.1).
STATS_FIELDS = {
    "hits": "lookups, count: served without a read of their own: the row was cached, or a read "
            "for an earlier position of the same call brought it",
    "misses": "rows, count: rows the source read for the cache (a row once per call; its repeats "
              "in that call are hits)",
    "bytes_fetched": "bytes: records the source delivered to the cache, misses x record bytes",
    "evictions": "rows, count: rows the cache dropped to make room",
    "rows_cached": "rows, count: rows in the cache now",
    "capacity_rows": "rows, count: rows the cache can hold",
    "cache_bytes": "bytes: RAM the cache holds, its capacity (head, slots, index, keys, pins: "
                   "reserved whole when the cache is made), not the bytes of the rows in it",
    "reads": "operations, count: reads behind the cache: preads (tables=\"direct\") or batched "
             "gets (a Mooncake Store); 0 for the mapped tables (page faults are not counted)",
    "bytes_read": "bytes: what those reads transferred: whole 4 KiB pages for preads (one 264-byte "
                  "record costs a page), the records' own bytes for a store's gets",
    "rows_read": "rows, count: distinct rows those reads brought",
    "read_wait_p50": "seconds: the median time a call waited for its reads (within 5%)",
    "read_wait_p99": "seconds: the 99th percentile of that wait (within 5%)",
    "budget_bytes": "bytes: the budget the caches split: row_cache_mb, at most budget_cap_bytes",
    "budget_cap_bytes": "bytes: what caching every row of every layer costs; a larger row_cache_mb "
                        "caches the tables whole and is cut to this",
    "fetches": "operations, count (a Mooncake Store only): batched gets issued",
    "fetch_seconds": "seconds (a Mooncake Store only): the gets' total time, start to end",
    "layers": "{layer: that layer's hits .. read_wait_p99}",
}
HOST_CACHE_DIR = "/dev/shm"  # a host cache's files: engram-rows-{name}-c{config digest}-t{tables_id}-l{layer}
HOST_CACHE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def host_cache_path(name, model_id, layer) -> str:
    """The file of one layer's host cache (model_id: host_model_id of the model)."""
    return os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-{model_id}-l{layer}")


# The largest row_cache_mb: 2**63 bytes. Any budget above the tables' size caches them whole, so
# a larger number asks for nothing more, and its bytes would no longer fit a size.
ROW_CACHE_MB_MAX = 1 << 43


def check_row_cache_mb(value, what="row_cache_mb") -> float:
    """row_cache_mb as a float of MiB, or a ValueError naming `what` (the argument, or the setting
    and where it came from), the value and the valid range. One check for every entry that takes
    a budget (EngramModel.load, from_deepseek_v41, the serving plugins' settings)."""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
          and 0 <= value <= ROW_CACHE_MB_MAX)   # compared exactly: False for NaN, inf and 10**400
    if not ok:
        raise ValueError(f"{what} must be a finite number of MiB from 0 (no row cache) to 2**43, got "
                         f"{shown(value, 40)}: "
                         f"give the RAM the row cache may take (a budget above the tables' size caches them "
                         f"whole)")
    return float(value)   # numpy's numbers too (np.int64(64))


LAYER_FIELDS = ("hits", "misses", "bytes_fetched", "evictions", "rows_cached", "capacity_rows", "cache_bytes",
                "reads", "bytes_read", "rows_read", "read_wait_p50", "read_wait_p99")


# The tiers a spec names (parse_tier): a string is the class made with no argument, a one-key dict
# {name: {argument: value}} the class made with those arguments. A tier of your own is a class and
# an entry here.
TIERS = {"mapped": MappedTier, "direct": DirectTier, "mooncake": MooncakeTier, "gguf": GGUFTier}


def parse_tier(spec) -> Tier:
    """The Tier a spec names, one parser for EngramModel.load / from_deepseek_v41 (tables=), the CLI
    and the serving plugins' settings: "mapped" (the tables where the loader put them), "direct"
    (pread from the checkpoint's files, or its packed row file), a Tier (returned as it is), or a
    one-key dict {"mooncake": {"master": ..., "metadata": ..., MooncakeTier's other arguments}}
    (any name of TIERS with the arguments of its class)."""
    if isinstance(spec, Tier):
        return spec
    if isinstance(spec, str) and spec in TIERS:
        return TIERS[spec]()
    if isinstance(spec, dict) and len(spec) == 1:
        (name, kw), = spec.items()
        if name in TIERS and isinstance(kw, dict) and all(isinstance(k, str) for k in kw):
            try:
                return TIERS[name](**kw)
            except TypeError as e:   # an argument the class does not take
                code = TIERS[name].__init__.__code__
                raise TypeError(f"tables={spec!r}: {e}; the arguments are "
                                f"{code.co_varnames[1:code.co_argcount]}") from None
    raise TypeError(f"tables= takes {' | '.join(repr(n) for n in TIERS)}, a Tier (a DirectTier, a MooncakeTier, a "
                    f"CachedTier, a subclass of engram_stream.rows.Tier) or a one-key dict {{name: {{arguments}}}} "
                    f"such as {{\"mooncake\": {{\"master\": \"HOST:PORT\", \"metadata\": \"URL\"}}}}, got {shown(spec)}")


def _layout(inner, model, layer):
    """(row bytes, scale bytes) of a record of `layer` from the opened tier `inner`: its own
    record_layout when its records are not the weights' (a GGUF's quantized rows), else the
    weights' (records.record_layout)."""
    own = getattr(inner, "record_layout", None)
    return own(layer) if own is not None else record_layout(model.layer(layer))


class CachedTier(Tier):
    """The RAM row cache over any tier: CachedTier(tier, row_cache_mb, host_cache). Opened for a
    model (open(model): what EngramModel.load does with its tables=, row_cache_mb= and
    host_cache=; model.tier), it is that model's rows and budget.

    tier: a spec of parse_tier (the tier the cache is in front of; inner: that tier opened for
    the model). row_cache_mb: the model's cache budget (MiB; at most what caching every row
    costs: a larger one caches the tables whole; 0: no cache, sources read the tier directly),
    split over layers in proportion to their table bytes: one RowCache per layer, made at the
    first engine of the layer and shared by every engine and stream of the model (its own lock;
    pins by count). host_cache: a name the processes of one host give to share one cache per
    layer (a file under /dev/shm each: the same budget, a row one process read is a hit for all,
    and stats() counts every process's lookups); None: the caches are this process's."""

    def __init__(self, tier="mapped", row_cache_mb=0, host_cache=None):
        self.row_cache_mb = check_row_cache_mb(row_cache_mb)
        self.tier = parse_tier(tier)
        if isinstance(self.tier, CachedTier):
            raise TypeError(f"CachedTier: {self.tier!r} is a cache already: give the tier it is in front of")
        if host_cache is not None and (not isinstance(host_cache, str) or not HOST_CACHE_NAME.fullmatch(host_cache)):
            raise ValueError(f"host_cache must be a name of 1 to 64 letters, digits, '_', '.' or '-' (it names "
                             f"files under {HOST_CACHE_DIR}), got {host_cache!r}")
        if host_cache is not None and not self.row_cache_mb:
            raise ValueError(f"host_cache={host_cache!r} shares the row cache, and row_cache_mb is 0: give the "
                             f"host's budget as row_cache_mb (MiB, the same in every process)")
        self.host_cache = host_cache
        self.model_ref = self.inner = None

    def __repr__(self):
        return f"CachedTier({self.tier!r}, row_cache_mb={self.row_cache_mb:g}, host_cache={self.host_cache!r})"

    def open(self, model) -> "CachedTier":
        """This cache and tier for `model` (a with_weight_dtype copy opens its model's own: the
        same budget and tier, caches of its own)."""
        opened = CachedTier(self.tier, self.row_cache_mb, self.host_cache)
        opened._bind(model)
        return opened

    def _bind(self, model):
        row_cache_mb, host_cache = self.row_cache_mb, self.host_cache
        self.model_ref = weakref.ref(model)
        # host_model_id names a host cache's files; a table in RAM is digested whole for it, so
        # it is taken here, at load, and no engine made later touches the tables
        self.model_id = host_model_id(model) if host_cache is not None else None
        self.inner = self.tier.open(model)   # first: its records' layout sizes the caches
        layouts = {L: _layout(self.inner, model, L) for L in model.cfg.layer_ids}
        table_bytes = {L: model.plan.table_rows[L] * sum(layouts[L]) for L in model.cfg.layer_ids}
        whole = {L: cache_nbytes(model.plan.table_rows[L], sum(layouts[L]))
                 for L in table_bytes}  # a layer's cache holding every row
        total, asked = sum(table_bytes.values()), int(row_cache_mb * (1 << 20))
        self.cap = sum(whole.values())
        self.budget = min(asked, self.cap)
        self.layer_budget = (whole if asked >= self.cap else
                             {L: min(whole[L], self.budget * b // max(1, total)) for L, b in table_bytes.items()})
        if host_cache is not None:
            # a layer whose share holds no row would have no host cache at all: every process
            # would read all of that layer's rows, which the budget was given to avoid
            short = [L for L in table_bytes if not slots_for(self.layer_budget[L], sum(layouts[L]))]
            if short:
                need = max(-(-cache_nbytes(1, sum(layouts[L])) * total // table_bytes[L]) for L in table_bytes)
                raise ValueError(f"host_cache={host_cache!r}: row_cache_mb={row_cache_mb!r} leaves layer "
                                 f"{short[0]}'s cache no room for one row (the budget is split over the layers "
                                 f"by their table bytes): give row_cache_mb >= "
                                 f"{math.ceil(need / (1 << 20) * 1000) / 1000:g}")
        self.caches = {}                                          # layer -> the shared RowCache
        self._caches_lock = threading.Lock()                      # engines are made on any thread
        self.read_totals = {L: new_totals() for L in table_bytes}  # every reader of the layer adds here

    def cache(self, layer) -> RowCache:
        """The layer's shared RowCache (made at the first call, once: under a lock, so engines
        made on several threads at once share one); with host_cache, the host's (attached, or
        created by the first process)."""
        with self._caches_lock:
            if layer not in self.caches:
                model = self.model_ref()
                rowbytes, scalebytes = _layout(self.inner, model, layer)
                rec = rowbytes + scalebytes
                nslots = slots_for(self.layer_budget[layer], rec)
                host = identity = None
                if self.host_cache is not None and nslots:
                    host = host_cache_path(self.host_cache, self.model_id, layer)
                    identity = f"{self.model_id}:l{layer}"
                self.caches[layer] = (RowCache(nslots, rec, layer) if host is None else
                                      RowCache(nslots, rec, layer, host=host, identity=identity))
            return self.caches[layer]

    def source(self, layer, read_totals=None):
        """The RowSource one engine of `layer` reads through: the tier's source of the layer,
        behind the layer's shared cache when the budget gives it slots. (Reads count in this
        tier's own read totals: read_totals is not used.)"""
        if self.inner is None:
            raise RuntimeError("CachedTier.source(layer): the cache is a model's: tier.open(model).source(layer)")
        src = self.inner.source(layer, self.read_totals[layer])
        cache = self.cache(layer)
        return CachedRows(cache, src) if cache.nslots else src

    def stats(self) -> dict:
        """Per layer ("layers") and in total: the fields of STATS_FIELDS (units and meanings there)."""
        counters = RowCache.COUNTERS
        sizes = ("rows_cached", "capacity_rows", "cache_bytes")
        per = {}
        for L in self.layer_budget:
            c = self.caches.get(L)
            st = c.stats() if c is not None else dict.fromkeys(counters + sizes, 0)
            per[L] = {k: int(st[k]) for k in counters + sizes}
            per[L].update(totals_summary(self.read_totals[L]))
        out = {k: sum(p[k] for p in per.values()) for k in counters + sizes + ("reads", "bytes_read", "rows_read")}
        out.update({k: v for k, v in totals_summary(sum(self.read_totals.values())).items() if k.startswith("read_wait")})
        out["layers"] = per
        out["budget_bytes"] = self.budget
        out["budget_cap_bytes"] = self.cap
        out.update(self.inner.stats())
        return out
