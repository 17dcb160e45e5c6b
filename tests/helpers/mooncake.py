"""A Mooncake Store for the tests marked `mooncake` (servers: tests/mooncake_servers.py)."""
import pytest


def mooncake_or_skip():
    """Skip unless the mooncake extra and its server binaries are installed."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    from mooncake_servers import _binary
    try:
        _binary("mooncake_master"), _binary("mooncake_client")
    except FileNotFoundError as e:
        pytest.skip(str(e))


def publish_when_back(tier, model, seconds):
    """tier.publish(model) once a restarted store takes it: the master drops a dead store
    server's memory only after its client ttl, so writes fail (TierError) for a while."""
    import time
    from engram_stream.rows import TierError
    from mooncake_servers import wait_until_writable
    wait_until_writable(tier)
    end = time.monotonic() + seconds
    while True:
        try:
            return tier.publish(model)
        except TierError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)
