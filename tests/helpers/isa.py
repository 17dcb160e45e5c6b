"""The kernel paths the each_isa fixture runs a module's tests on; one path forced for a block."""
import contextlib
import os


def kernel_isas():
    """Every kernel path this CPU runs (ENGRAM_STREAM_ISA, when set, names the only one), or those
    of them ENGRAM_TEST_ISAS lists (comma-separated: tools/test_aarch64.sh keeps its every-path
    run to baseline and neon, and runs neon_bf16's own tests apart, for time under qemu)."""
    forced = os.environ.get("ENGRAM_STREAM_ISA", "").strip().lower()
    if forced:
        return [forced]
    from engram_stream.engine.isa import supported_isas
    keep = [n.strip() for n in os.environ.get("ENGRAM_TEST_ISAS", "").lower().split(",") if n.strip()]
    return [n for n in supported_isas() if not keep or n in keep]


@contextlib.contextmanager
def on_path(name):
    """Every kernel on path `name` inside the block, the process's path back after it."""
    from engram_stream.engine import isa
    before = isa.kernel_isa()
    isa.use_isa(name)
    try:
        yield
    finally:
        isa.use_isa(before)
