"""SIGTERM during a write: raised as Terminated in the main thread, so the writer removes its temp
file, and engram_stream.cli.main exits with 128 + SIGTERM."""
from __future__ import annotations

import signal


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so writers' cleanup (temp files) runs."""


class cleanup_on_sigterm:
    """Within: SIGTERM raises Terminated (the default action would kill the process before
    save() removes its temp file). The previous handler comes back on exit."""

    def __enter__(self):
        def handler(signum, frame):
            raise Terminated()
        self.previous = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.previous)
