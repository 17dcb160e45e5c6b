"""tables="mapped": engines read the tables where the loader put them (in RAM, or views of
the mapped checkpoint: page advice and residency are engram_stream.io.memory's)."""
from __future__ import annotations

from ..io.files import mapping_of
from ..io.memory import advise
from ._source import MappedRows
from .records import record_format
from .tier import Tables, Tier, register_tier


class MappedTier(Tier):
    """The tables where the loader put them (tables="mapped"): in RAM, or views of the mapped
    checkpoint, whose pages are advised MADV_RANDOM (a cold gather must not read ahead) and paged
    in by prefetch() (MADV_WILLNEED of the rows a call reads)."""

    def __repr__(self):
        return "MappedTier()"

    def open(self, model) -> "MappedTables":
        return MappedTables(self, model)


class MappedTables(Tables):
    """A MappedTier opened for one model: each engine's MappedRows points into its tables."""

    def __init__(self, tier, model):
        super().__init__(tier)
        self.layers = {L: (model.layer(L).table, model.layer(L).table_scale, record_format(model.layer(L)))
                       for L in model.cfg.layer_ids}
        for arrays in self.layers.values():
            for a in arrays[:2]:
                if a is not None and a.nbytes and mapping_of(a) is not None:
                    advise(a, "random")

    def source(self, layer, read_totals=None) -> MappedRows:
        return MappedRows(*self.layers[layer])


register_tier("mapped", MappedTier)
