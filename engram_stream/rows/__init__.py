"""Where table rows come from: the mapped table (mapped.py), the checkpoint's files read
directly (direct.py, _direct.pyx, include/engram_io.h; the packed row file: packed.py), the
RAM row cache (_cache.pyx, include/engram_rowcache.h), a Mooncake Store (mooncake/), a llama.cpp
GGUF's quantized tables (gguf_tier.py; the file format and decoders: gguf.py, _gguf.pyx);
identity.py names a model's tables (digests, model_name, tables_id); tiers.py parses a tier's spec (parse_tier) and puts the RAM row cache over any tier (CachedTier);
_source.pyx is the seam the engines read through: Tier (where a model's rows live, tables=) and
RowSource (one engine's reader of one layer, made by the tier opened for its model).
`engram_stream.rows` is this package."""
from ..errors import TierError
from ._source import CachedRows, DirectRows, MappedRows, RecordSource, RowSource, Tier
from .direct import DirectTier
from .gguf_tier import GGUFTier
from .mapped import MappedTier
from .mooncake.calls import wait_for_port
from .mooncake.keys import head_records, store_key
from .mooncake.tier import MooncakeTier, RemoteRows
from .records import record_layout
from .tiers import TIERS, CachedTier, parse_tier

__all__ = ["CachedRows", "CachedTier", "DirectRows", "DirectTier", "GGUFTier", "MappedRows", "MappedTier", "MooncakeTier",
           "RecordSource", "RemoteRows", "RowSource", "TIERS", "Tier", "TierError", "head_records", "parse_tier",
           "record_layout", "store_key", "wait_for_port"]
