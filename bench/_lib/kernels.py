"""Kernel paths in the benchmarks: forcing one around a call, --paths, and the register-only FMA
floor of a path timed as a contender."""
import threading

from engram_stream.engine import isa as _isa


def forced_now():
    """The forced path (ENGRAM_STREAM_ISA, use_isa), else None: what a forcing helper restores."""
    return _isa.kernel_isa() if _isa.forced() else None


def on_path(isa, f):
    """f() with the kernels forced onto path `isa`, then back as before (forced or not)."""
    before = forced_now()
    _isa.use_isa(isa)
    try:
        return f()
    finally:
        _isa.use_isa(before)


def parse_paths(ap, text):
    """--paths as a list: every name a kernel path this CPU and build run, else ap.error."""
    paths = [p for p in text.split(",") if p]
    for p in paths:
        if p not in _isa.supported_isas():
            ap.error(f"--paths: {p!r} is not a path this CPU and build run ({', '.join(_isa.supported_isas())})")
    return paths


class FmaRunner:
    """A contender that runs the register-only FMA chains of path `isa` on `threads` threads at
    once (`rounds` each a call), so a floor is measured in the same rotation as what it floors
    (a shared machine's load moves both alike). gflops(seconds per call) converts its times."""

    def __init__(self, isa, threads, rounds=4_000_000, chains=None):
        from engram_stream.demo import _engine
        self.isa, self.threads, self.rounds, self.flops = isa, threads, rounds, 0
        self.chains = chains or _engine._fma_chains  # (bench_v41: the projection's own, vdpbf16ps on bf16)

    def __call__(self, n):
        for _ in range(n):
            done = [0] * self.threads

            def work(i):
                done[i] = self.chains(self.rounds)
            pool = [threading.Thread(target=work, args=(i,)) for i in range(self.threads)]
            before = forced_now()
            _isa.use_isa(self.isa)
            try:
                for th in pool:
                    th.start()
                for th in pool:
                    th.join()
            finally:
                _isa.use_isa(before)
            self.flops = 2 * sum(done)

    def gflops(self, seconds):
        return [self.flops / t / 1e9 for t in seconds]


def fma_runner(isa, threads, rounds, chains=None):
    """FmaRunner with the V4.1 projection's own multiply-add chains (_mac_chains: vfmadd,
    vdpbf16ps on bf16; `chains`: another engine's, e.g. the demo's _fma_chains) on `threads`
    threads at once, a contender timed in the same rounds as what it floors."""
    from engram_stream.v41 import _engine
    return FmaRunner(isa, threads, rounds, chains=chains or _engine._mac_chains)
