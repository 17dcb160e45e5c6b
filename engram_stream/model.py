"""EngramModel: the config, hash plan and weights of every Engram layer of a model, and the
ways to run them: the numpy batch path (forward, the oracle), one layer's streaming engine
(stream), every layer per token (decoder).

What differs between the variants (weights, oracle, engine, files) comes from the variant
registry (engram_stream.variants); this class holds what they share.
"""
from __future__ import annotations

import copy
import functools
import os

import numpy as np

from .config import EngramConfig
from .engine.args import check_hidden
from .errors import CheckpointError
from .io.files import check_file
from .plan import HashPlan, as_ids
from .variants import get as get_variant
from .variants import describe_checkpoint, listing, variant_of, variants


def _check_state_dicts(cfg, state_dicts):
    if not isinstance(state_dicts, dict):
        raise TypeError(f"state_dicts must be a dict {{layer: state_dict}}, got {type(state_dicts).__name__}")
    if sorted(state_dicts) != sorted(cfg.layer_ids):
        raise ValueError(f"state_dicts must have exactly the layers {cfg.layer_ids}, got {sorted(state_dicts)}")


class EngramModel:
    """All Engram layers of a model: config, hash plan and weights.

    forward() is the numpy batch path (the oracle); stream() gives the Cython
    streaming engine of one layer; decoder() drives every layer per token.
    """

    tables = None  # rows.CachedTables: this model's rows, its tier and row cache (set by load())
    source = None     # the checkpoint it was loaded from (load, from_deepseek_v41): its row file sits beside it

    def __init__(self, cfg: EngramConfig, plan: HashPlan, layers: dict):
        if not isinstance(cfg, EngramConfig):
            raise TypeError(f"EngramModel needs an EngramConfig, got {type(cfg).__name__}")
        if not isinstance(plan, HashPlan) or plan.cfg != cfg:
            raise ValueError("EngramModel: plan must be a HashPlan of the same config")
        if not isinstance(layers, dict) or sorted(layers) != sorted(cfg.layer_ids):
            raise ValueError(f"EngramModel: layers {sorted(layers)} != config layer_ids {cfg.layer_ids}")
        variant = variant_of(cfg)
        for L, w in layers.items():
            variant.validate_layer(cfg, plan, L, w)
            if not np.array_equal(w.offsets, plan.offsets[L]):
                raise ValueError(f"layer {L} offsets disagree with the config's prime chain")
        self.cfg, self.plan, self.layers, self.variant = cfg, plan, dict(layers), variant

    def __repr__(self):
        c = self.cfg
        return (f"EngramModel(variant={c.variant!r}, layers={c.layer_ids}, D={c.hidden_size}, G={c.hc_mult}, "
                f"H={c.n_heads}x{c.head_dim}, table_rows={[self.plan.table_rows[L] for L in c.layer_ids]}, "
                f"table_dtype={self.layers[c.layer_ids[0]].table_dtype})")

    # Construction ----------------------------------------------------------------------
    @classmethod
    def from_reference(cls, cfg: EngramConfig, state_dicts: dict, compression=None, multipliers=None,
                       weight_dtype=None):
        """Build from the reference module's per-layer state_dicts ({layer: {name: array}}):
        the demo module's names, or V4.1's (engram_stream.v41.NAMES) for a deepseek-v4.1
        config. Every key and shape is checked; tensors are taken as numpy arrays (torch CPU
        tensors convert through numpy). weight_dtype (demo): "bfloat16" holds the projection
        weights as bf16 (exact for a bf16 checkpoint, rounded otherwise); default float32."""
        variant = variant_of(cfg)
        if weight_dtype is not None:
            _check_weight_dtype(variant, weight_dtype)
        plan = HashPlan(cfg, compression=compression, multipliers=multipliers)
        _check_state_dicts(cfg, state_dicts)
        model = cls(cfg, plan, {L: variant.from_state_dict(cfg, plan, L, state_dicts[L]) for L in cfg.layer_ids})
        return model if weight_dtype is None else model.with_weight_dtype(weight_dtype)

    @classmethod
    def init(cls, cfg: EngramConfig, seed: int = 0, graft_zero_init: bool = False, compression=None,
             multipliers=None):
        """Random weights. Demo: torch's default initializations (tables N(0,1), Linear and
        Conv1d uniform(+-1/sqrt(fan_in)), norms 1); V4.1: random float8 weights at the
        reference's magnitudes. graft_zero_init zeroes the value projection, so the module's
        output is exactly 0: adding it to a frozen model changes nothing at step 0. `seed`
        seeds the weights (cfg.seed seeds the hash multipliers)."""
        plan = HashPlan(cfg, compression=compression, multipliers=multipliers)
        return cls(cfg, plan, variant_of(cfg).init_layers(cfg, plan, seed, graft_zero_init))

    def with_weight_dtype(self, dtype) -> "EngramModel":
        """The same model with its projection weights held as `dtype`: "bfloat16" (half the
        bytes a step reads; engines widen them in registers, so outputs are float32 math on
        the bf16-rounded weights) or "float32" (demo); a V4.1 model keeps its float8 weights.
        Tables, norms, biases and the row tiers (cache budget, row source) are kept."""
        name = _check_weight_dtype(self.variant, dtype)
        if name == self.weight_dtype:
            return self
        new = type(self)(self.cfg, self.plan, self.variant.with_weight_dtype(self.cfg, self.layers, name))
        new.source = self.source
        if self.tables is not None:
            new.tables = self.tables.tier.open(new)
        return new

    @property
    def weight_dtype(self) -> str:
        """How the projection weights are held: "float32" or "bfloat16" (demo, see
        with_weight_dtype), "float8_e4m3fn" (V4.1)."""
        return self.layers[self.cfg.layer_ids[0]].weight_dtype

    # Paths -------------------------------------------------------------------------------
    def layer(self, layer):
        """The weights of one Engram layer (one of cfg.layer_ids; any other raises KeyError):
        demo LayerWeights (table [rows, head_dim], fused projection proj_w [(G+1)*D, E], norms,
        conv taps) or V41LayerWeights (float8 bytes). Shared read-only by every engine and
        decoder of this model: copy an array before changing it."""
        return self.layers[self.plan.check_layer(layer)]

    def state_dict(self, layer) -> dict:
        """The reference module's state_dict of one layer (numpy arrays)."""
        return self.layer(layer).state_dict(self.cfg)

    def forward(self, layer, ids, hidden=None) -> np.ndarray:
        """The numpy batch path (the oracle): ids int[B, T], hidden float[B, T, G, D] ->
        float32[B, T, G, D], the Engram delta (the caller adds h). Other float dtypes are
        computed in float32 (the reference's precision). An input-layer variant
        (variant.input_layer) takes no hidden (None) and returns float32[B, T, D]. With tables
        from a GGUF (rows.GGUFTier) the table read is the GGUF's, decoded (the quantized model)."""
        w = self.layer(layer)
        a = as_ids(ids, 2)
        if self.variant.input_layer:
            if hidden is not None:
                raise ValueError(f"the {self.variant.name} layer {layer} is an input layer (a token in, "
                                 f"float32[{self.cfg.hidden_size}] out): forward takes no hidden; pass None")
            h = None
        elif hidden is None:
            raise ValueError(f"forward of the {self.variant.name} layer {layer} needs hidden "
                             f"[B, T, {self.cfg.hc_mult}, {self.cfg.hidden_size}], got None")
        else:
            h = check_hidden(hidden, a.shape + (self.cfg.hc_mult, self.cfg.hidden_size), "hidden", keep_bf16=False)
        rows = self.plan.hash_numpy(a, layers=[layer])[layer]
        for arr in w.file_arrays():  # a mapped file truncated or rewritten since load is refused
            check_file(arr)
        decoded = getattr(getattr(self.tables, "inner", None), "table_f32", None)
        if decoded is not None:   # a tier's own rows (a GGUF's): the oracle is the model of those rows
            w = copy.copy(w)
            w.table_f32 = functools.partial(decoded, layer)
        return self.variant.forward(self.cfg, w, rows, self.plan.dead_mask(a), h, a)

    def stream(self, layer, n_streams: int = 1, rows=None):
        """The streaming engine of one layer, its variant's engine class (each has the same calls):
        {variants}
        An input-layer variant's engine takes no hidden (engine.input_layer).
        rows: the RowSource it reads the layer's table rows through (default: row_source(layer)). Each of
        its operations runs the kernel path and threads measured fastest for this model's shapes
        on this CPU (engine/tune.py: measured on the first engine, then cached)."""
        from .engine import tune
        engine = self.variant.engine(self, layer, n_streams, rows=rows)
        tune.apply(self, engine, layer)
        return engine

    def decoder(self, n_streams: int = 1, prefetch="auto"):
        """Every layer's engine behind one per-token driver (engram_stream.engine.decoder)."""
        from .engine.decoder import Decoder
        return Decoder(self, n_streams, prefetch=prefetch)

    # Files ---------------------------------------------------------------------------------
    def save(self, path, table_dtype=None, progress=None):
        """Write the model to `path`, atomically. Demo: one safetensors-layout file (config,
        hash plan, every layer's weights), tables converted chunk by chunk when table_dtype is
        "float32", "float16" or "int8" (None: as held); progress: callable(done_bytes,
        total_bytes). V4.1: the model's own HF folder layout. Returns the path; read it with
        load()."""
        for w in self.layers.values():  # never copy a mapped file that changed under the model
            for arr in w.file_arrays():
                check_file(arr)
        return self.variant.save(self.cfg, self.plan, self.layers, path, table_dtype=table_dtype,
                                 progress=progress)

    @classmethod
    def load(cls, path, mmap: bool = True, tables="mapped", row_cache_mb=None, host_cache=None):
        """Read a checkpoint of any registered variant, as save() (or `engram-stream init`) writes
        it; the variant is the one whose checkpoint `path` is:
        {variants}
        Every header field, shape and the prime chain are checked; a bad file raises CheckpointError.
        mmap=True (the default): tables are read-only zero-copy views of the file, so only the
        rows a decode touches come into RAM (the file must not change while the model lives);
        mmap=False reads everything into RAM.
        tables: where table rows are read from (weights always come from the file), a spec of
        rows.parse_tier: "mapped" (the mapped tables), "direct" or a rows.DirectTier (pread from
        the checkpoint's files, O_DIRECT where the file system allows it; the packed row file when
        there is one), a rows.MooncakeTier or {"mooncake": {its arguments}}. row_cache_mb: the
        model's RAM cache of whole rows in front of them, shared by every engine
        (engram_stream.rows.CachedTier; opened: model.tables). host_cache: a name ("vllm") that makes that
        cache the host's: every process loading the same model with the same row_cache_mb and
        host_cache shares one cache (files under /dev/shm), one budget and its stats."""
        path = os.fspath(path)
        tier, mapped = _cached_tier(tables, row_cache_mb, host_cache)   # a bad spec refused before any read
        variant = next((v for v in variants() if v.is_checkpoint(path)), None)
        if variant is None:
            raise ValueError(f"{path}: not a checkpoint of any variant; a checkpoint is, by variant:\n"
                             f"{listing(describe_checkpoint, 2)}")
        try:
            model = cls(*variant.load(path, mmap=mmap or not mapped))
        except CheckpointError:
            for v in variants():  # a file of another variant's checkpoint folder: say what to pass
                folder = v.folder_of(path)
                if folder is not None:
                    raise CheckpointError(f"{path}: this is a file of the {v.name} folder {folder}: pass the folder, "
                                          f"not one of its files") from None
            raise
        model.source = os.path.abspath(path)  # files opened later (tables="direct") are this folder's
        model.tables = tier.open(model)
        return model

    def row_source(self, layer):
        """A RowSource of `layer`'s table as an engine of this model reads it (the model's shared
        row cache in front of its tables, the files or the store; the mapped table without
        tiers): source.read_into(rows, out) fills a caller's buffer with row records by row id.
        One reader: a thread takes its own."""
        if layer not in self.cfg.layer_ids:
            raise KeyError(f"layer {layer} is not an Engram layer of this model (layers: {self.cfg.layer_ids})")
        if self.tables is not None:
            return self.tables.source(layer)
        from .rows._source import MappedRows  # a model made in memory: its tables are RAM arrays
        from .rows.records import record_format
        w = self.layer(layer)
        return MappedRows(w.table, w.table_scale, record_format(w))

    def row_cache_stats(self) -> dict:
        """Row cache counters summed over this model's engines (with host_cache: over every
        process sharing the host's cache), and per layer ("layers"); all zero without a row cache. Every field has one meaning whatever the source behind the cache
        (engram_stream.rows.tiers.STATS_FIELDS; DESIGN.md's table):

        hits           count   lookups (a row of one position and head) served without a read of
                               their own: cached, or read for an earlier position of the same call
        misses         count   rows read from the source for the cache (once per call)
        bytes_fetched  bytes   misses x record bytes (a row then its scale: 264 for V4.1)
        evictions      count   rows dropped to make room
        rows_cached, capacity_rows   count   rows in the cache now, rows it can hold
        cache_bytes    bytes   the cache's RAM: its capacity, reserved whole (not the rows in it)
        reads          count   preads (tables="direct") or a store's batched gets; 0 when mapped
        bytes_read     bytes   what those reads transferred: whole 4 KiB pages for preads (a
                               264-byte record costs a page), the records' bytes from a store
        rows_read      count   distinct rows those reads brought
        read_wait_p50, read_wait_p99   seconds   time a call waited for its reads
        budget_bytes   bytes   row_cache_mb as the caches split it: at most budget_cap_bytes
        budget_cap_bytes bytes what caching every row costs (a larger row_cache_mb is cut to it)
        fetches, fetch_seconds   count, seconds   a Mooncake Store's gets and their total time"""
        return (self.tables or _cached_tier("mapped", 0, None)[0].open(self)).stats()

    def warm(self, token_ids, chunk: int = 4096) -> dict:
        """Seed the row cache with the rows a prompt reads: token_ids (int array, or the path of
        a .npy or whitespace-separated text file of ids) are hashed as one stream, chunk tokens
        at a time, and every layer's rows are read through its row source (every layer's reads
        start before any is waited for), so the model's shared cache holds them as far as its
        budget goes. Nothing else of the model changes. Returns row_cache_stats()."""
        if isinstance(token_ids, (str, os.PathLike)):
            p = os.fspath(token_ids)
            token_ids = np.load(p) if p.endswith(".npy") else np.loadtxt(p, dtype=np.int64, ndmin=1)
        ids = as_ids(np.asarray(token_ids).ravel(), 1, "token_ids")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        bad = np.flatnonzero(ids >= self.cfg.vocab_size)
        if bad.size:  # refused before any read
            raise ValueError(f"token_ids[{bad[0]}] = {ids[bad[0]]} is not < vocab_size {self.cfg.vocab_size}: "
                             f"pass this model's token ids")
        engines = {L: self.stream(L, 1) for L in self.cfg.layer_ids}
        for a in range(0, ids.shape[0], chunk):
            part = np.ascontiguousarray(ids[a:a + chunk])
            for e in engines.values():
                e.feed_packed(part, [0], [part.shape[0]])
            for e in engines.values():
                e.fetch()
        return self.row_cache_stats()

    @classmethod
    def from_deepseek_v41(cls, ckpt_dir, mmap: bool = True, compression=None, tables="mapped", row_cache_mb=None,
                          host_cache=None):
        """A deepseek-v4.1 model from its HF folder (config.json, model.safetensors.index.json, the
        shards, tokenizer.json): only the layers.{L}.engram.* tensors are read, the tables are
        mapped in place. compression: a lookup to use instead of building it from tokenizer.json.
        tables, row_cache_mb, host_cache: where the rows are read from, the RAM row cache and
        whether it is the host's, as in load() (e.g. tables="direct", row_cache_mb=4096: rows
        read from disk, a 4 GiB cache)."""
        load = get_variant("deepseek-v4.1").load   # a thin entry of the public API: the registry's loader
        tier, mapped = _cached_tier(tables, row_cache_mb, host_cache)
        model = cls(*load(ckpt_dir, mmap=mmap or not mapped, compression=compression))
        model.source = os.path.abspath(ckpt_dir)  # files opened later (tables="direct") are this folder's
        model.tables = tier.open(model)
        return model


def _cached_tier(tables, row_cache_mb, host_cache):
    """A loader's tables=, row_cache_mb= and host_cache= as one rows.CachedTier (not yet opened),
    and whether its tier reads the mapped tables (else the tables must be mapped from their files
    whatever mmap= says: the tier reads at their offsets)."""
    from .rows.mapped import MappedTier
    from .rows.tiers import CachedTier
    tier = CachedTier(tables, row_cache_mb or 0, host_cache)
    return tier, isinstance(tier.tier, MappedTier)


def _check_weight_dtype(variant, dtype) -> str:
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in variant.weight_dtypes:
        raise ValueError(f"weight dtype must be one of {variant.weight_dtypes} for the {variant.name} variant, "
                         f"got {dtype!r}")
    return name
