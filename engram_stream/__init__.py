"""engram_stream: a streaming inference engine for Engram, DeepSeek's conditional n-gram memory.

A decode loop hands it one token and one hidden state at a time and gets the Engram output back,
equal to the reference module, with tables mapped from disk, read directly, held in a RAM row
cache or in a Mooncake Store. The variants served (engram_stream.variants.registered()):

    {variants}

Quick start:

    import numpy as np
    from engram_stream import EngramConfig, EngramModel

    cfg = EngramConfig(hidden_size=256, n_embed_per_ngram=128, n_head_per_ngram=4,
                       engram_vocab_size=[20011, 20011], vocab_size=32000)
    model = EngramModel.init(cfg, seed=0)        # or EngramModel.load(path) / from_deepseek_v41(folder)
    dec = model.decoder()                        # every Engram layer behind one clock
    h = np.zeros((cfg.hc_mult, cfg.hidden_size), np.float32)
    for tok in [5, 17, 42]:
        dec.begin(tok)                           # hash every layer, start reading their rows
        y = {L: dec.layer(L, h) for L in dec.layers}   # the Engram delta: the caller adds h + y

The API (this package's __all__):

    EngramConfig       the module's hyperparameters (EngramConfig.from_hf_config: a model's config.json)
    EngramModel        weights and tables: init, load, save, from_deepseek_v41, forward (the numpy
                       oracle), stream(layer) -> a layer's engine, decoder() -> Decoder,
                       row_cache_stats(), warm()
    StreamEngine       the demo module's engine of one layer (every variant's has the same methods): step,
                       prefill, step_packed, commit, reset, snapshot -> EngineSnapshot, restore
    Decoder            every layer: begin / begin_packed, layer, commit, reset,
                       snapshot -> DecoderSnapshot, restore
    EngineSnapshot     an engine's per-stream state (snapshot, try a draft, restore)
    DecoderSnapshot    a Decoder's: {layer: EngineSnapshot}
    HashPlan           the n-gram hash: multipliers, primes, offsets, hash(ids)
    build_compression  tokenizer.json -> the token compression lookup
    kernel_isa         the kernel path that runs (ENGRAM_STREAM_ISA chooses another)
    get_include        the C headers' folder

Beside it: engram_stream.rows (row sources and tiers: DirectTier, MooncakeTier, RowSource),
engram_stream.errors (the error classes), engram_stream.integrations.transformers (attach),
engram_stream.integrations.vllm (the vLLM plugin), engram_stream.integrations.sglang, and the
engram-stream command (engram_stream.cli). Modules whose names start with "_" are the compiled
kernels behind these names, not an API. README.md is the user's guide; DESIGN.md (the
repository's) the contract, and in section 12 the map of every file.
"""
import os as _os
import sys as _sys

from . import variants as _variants
from .compression import build_compression
from .config import EngramConfig

from .model import EngramModel
from .plan import HashPlan
from .engine.decoder import Decoder
from .engine.snapshot import DecoderSnapshot, EngineSnapshot
from .engine.isa import kernel_isa

# The variants register at the first registry lookup (variants.discover), not here: a plugin's
# module that imports this package at its top (from engram_stream import EngramModel) finds it
# whole. Nothing below may ask the registry while the package imports: the docstrings that list
# every variant are written when the registry is first asked (help() of the package asks it).
_variants.when_discovered(lambda: _variants.document(EngramModel.load, _variants.describe_checkpoint))
_variants.when_discovered(lambda: _variants.document(EngramModel.stream, lambda v: v.engine.__name__))


class _Package(_sys.modules[__name__].__class__):
    """This package's module type: its docstring lists the registered variants, read from the
    registry when asked (so a variant registered later is listed too)."""

    @property
    def __doc__(self):
        return _DOC.replace("    {variants}", _variants.listing(lambda v: v.title, 4))


_DOC = __doc__
_sys.modules[__name__].__class__ = _Package

__all__ = ["EngramConfig", "HashPlan", "EngramModel", "StreamEngine", "EngineSnapshot", "Decoder",
           "DecoderSnapshot", "build_compression", "get_include", "kernel_isa"]
__version__ = "0.1.0"


def __getattr__(name):
    """StreamEngine: the default variant's engine, looked up at first use (a registry lookup)."""
    if name == "StreamEngine":
        return _variants.get(_variants.DEFAULT).engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"StreamEngine"})


def get_include() -> str:
    """Folder of the C headers the extensions share (engram_hash.h, engram_step.h, ...).

    Installed, the wheel carries them in engram_stream/include; in a development
    checkout (in-place build) they are the repository's top-level include/."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    installed = _os.path.join(here, "include")
    return installed if _os.path.isdir(installed) else _os.path.join(_os.path.dirname(here), "include")
