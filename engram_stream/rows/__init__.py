"""Where table rows come from: the mapped table (mapped.py), the checkpoint's files read
directly (direct.py, _direct.pyx, include/engram_io.h; the packed row file: packed.py), the
RAM row cache (_cache.pyx, include/engram_rowcache.h), a Mooncake Store (mooncake/), a llama.cpp
GGUF's quantized tables (gguf_tier.py; the file format and decoders: gguf.py, _gguf.pyx);
identity.py names a model's tables (digests, model_name, tables_id); tier.py is the API of a
place for rows: Tier (where a model's rows live, tables=), Tables (a Tier opened for one model),
register_tier (a name for specs); tiers.py parses a spec (parse_tier) and puts the RAM row cache
over any tier (CachedTier, CachedTables); _source.pyx is the seam the engines read through:
RowSource (one engine's reader of one layer, made by the model's Tables).
`engram_stream.rows` is this package."""
from ..errors import TierError
from ._source import CachedRows, DirectRows, MappedRows, RecordSource, RowSource
from .tier import Tables, Tier, register_tier, registered_tiers
from .mapped import MappedTables, MappedTier
from .direct import DirectTables, DirectTier
from .gguf_tier import GGUFTables, GGUFTier
from .mooncake.calls import wait_for_port
from .mooncake.keys import head_records, store_key
from .mooncake.tier import MooncakeTier, RemoteRows, StoreTables
from .records import record_layout
from .tiers import CachedTables, CachedTier, parse_tier

__all__ = ["CachedRows", "CachedTables", "CachedTier", "DirectRows", "DirectTables", "DirectTier", "GGUFTables",
           "GGUFTier", "MappedRows", "MappedTables", "MappedTier", "MooncakeTier", "RecordSource", "RemoteRows",
           "RowSource", "StoreTables", "Tables", "Tier", "TierError", "head_records", "parse_tier", "record_layout",
           "register_tier", "registered_tiers", "store_key", "wait_for_port"]
