"""The kernel paths the each_isa fixture runs a module's tests on."""
import os


def kernel_isas():
    """Every kernel path this CPU runs (ENGRAM_STREAM_ISA, when set, names the only one)."""
    forced = os.environ.get("ENGRAM_STREAM_ISA", "").strip().lower()
    if forced:
        return [forced]
    from engram_stream.engine.isa import supported_isas
    return list(supported_isas())
