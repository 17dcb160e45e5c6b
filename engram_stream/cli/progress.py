"""Progress on stderr: a line as each long step starts, and a bar over a long write or measurement
(tools/make_v41_checkpoint.py draws the same bar). stdout keeps the results only."""
from __future__ import annotations

import sys


def size(nbytes) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


class Steps:
    """One stderr line as each long step starts (loading, warming up, decoding, checking), so a
    command that runs for seconds says what it waits for; stdout keeps the results only."""

    def __init__(self, quiet=False):
        self.quiet = quiet

    def __call__(self, what):
        if not self.quiet:
            print(f"{what} ...", file=sys.stderr, flush=True)


class Progress:
    """stderr bar, one update per percent (only created when stderr is a terminal).
    unit: "bytes" (the total shown as a size) or a word counted ("repeats")."""

    def __init__(self, unit="bytes"):
        self.last, self.unit = -1, unit

    def __call__(self, done, total):
        pct = int(100 * done / total) if total else 100
        if pct != self.last:
            self.last = pct
            bar = "#" * (40 * pct // 100)
            of = size(total) if self.unit == "bytes" else f"{total} {self.unit}"
            print(f"\r[{bar:<40}] {pct:3d}% of {of}", end="", file=sys.stderr, flush=True)

    def end(self):
        print(file=sys.stderr, flush=True)


def progress_bar(quiet=False, unit="bytes"):
    """The progress of a long step, for every command and tool that has one: a stderr bar
    (progress(done, total); .end() closes the line) when stderr is a terminal and not quiet,
    else None (pipes and logs get the final lines only)."""
    return Progress(unit) if not quiet and sys.stderr.isatty() else None
