"""Where table rows come from: the mapped table (mapped.py), the checkpoint's files read
directly (direct.py, _direct.pyx, include/engram_io.h; the packed row file: packed.py), the
RAM row cache (_cache.pyx, include/engram_rowcache.h), a Mooncake Store (mooncake.py);
tiers.py puts them together for one model, _source.pyx is the seam the engines read through:
RowSource (one engine's reader of one layer) and RowTier (where a model's rows live, tables=).
`engram_stream.rows` is this package."""
from ..errors import TierError
from ._source import CachedRows, DirectRows, MappedRows, OpenTier, RecordSource, RowSource, RowTier
from .direct import DirectTier
from .mapped import MappedTier
from .mooncake import MooncakeTier, RemoteRows, head_records, store_key, wait_for_port
from .records import record_layout
from .tiers import RowTiers

__all__ = ["CachedRows", "DirectRows", "DirectTier", "MappedRows", "MappedTier", "MooncakeTier", "OpenTier",
           "RecordSource", "RemoteRows", "RowSource", "RowTier", "RowTiers", "TierError", "head_records",
           "record_layout", "store_key", "wait_for_port"]
