"""A local Mooncake Store for the tests and benchmarks (imported from tests/ on sys.path, not part
of the package):
mooncake_master (with its HTTP metadata server) and one store server (`mooncake_client`,
which lends the store its memory), on free loopback ports, stopped by PID.

    with LocalMooncake(segment_mb=512) as mc:
        tier = MooncakeTier(master=mc.master, metadata=mc.metadata)

The master keeps the objects' metadata in memory: after kill_master() + start_master()
the store is empty again (re-publish); the store server re-registers by itself.

Every address flag given here is 127.0.0.1, but Mooncake 0.3.13 still binds some ports on
all interfaces (the master's HTTP metadata server, the store server's transfer engine). On a
machine with other interfaces, run it in a network namespace (the test suite moves itself
into one: tests/conftest.py) or behind a firewall.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from engram_stream.errors import TierError
from engram_stream.rows.mooncake.calls import wait_for_port


def _binary(name):
    here = os.path.join(os.path.dirname(sys.executable), name)
    path = here if os.path.exists(here) else shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found (pip install '.[mooncake]' from the engram_stream checkout)")
    return path


def _die_with_parent():
    """In the child before exec: SIGKILL when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a crashed test or bench run leaves no server behind."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalMooncake:
    """mooncake_master + one store server on 127.0.0.1 (ports picked free unless given)."""

    def __init__(self, segment_mb=256, log_dir=None, lease_ttl_ms=24 * 3600 * 1000, client_ttl=3):
        # client_ttl: seconds before the master drops a dead store server's memory (default 10)
        self.segment_mb, self.lease_ttl_ms, self.client_ttl = segment_mb, lease_ttl_ms, client_ttl
        self.rpc_port, self.http_port, self.metrics_port, self.store_port = (free_port() for _ in range(4))
        self.log_dir = log_dir
        self.env = dict(os.environ, GLOG_minloglevel="2", MC_TCP_BIND_ADDRESS="127.0.0.1")
        self.master_proc = self.store_proc = None

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def _log(self, name):
        if self.log_dir is None:
            return subprocess.DEVNULL
        return open(os.path.join(self.log_dir, f"{name}.log"), "ab")

    def start_master(self, timeout=20.0):
        cmd = [_binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
               f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
               f"--client_ttl={self.client_ttl}"]
        log = self._log("master")
        self.master_proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        for port in (self.rpc_port, self.http_port):
            if not wait_for_port("127.0.0.1", port, timeout):
                self.stop()
                raise TierError(f"mooncake_master did not open port {port} within {timeout} s")

    def start_store(self, timeout=20.0):
        cmd = [_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.store_port}",
               f"--master_server_address={self.master}", f"--metadata_server={self.metadata}",
               f"--global_segment_size={self.segment_mb << 20}"]
        log = self._log("store")
        self.store_proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        if not wait_for_port("127.0.0.1", self.store_port, timeout):
            self.stop()
            raise TierError(f"mooncake store server did not open port {self.store_port} within {timeout} s")

    def start(self):
        self.start_master()
        self.start_store()
        return self

    @staticmethod
    def _kill(proc):
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill_master(self):
        self._kill(self.master_proc)
        self.master_proc = None

    def kill_store(self):
        self._kill(self.store_proc)
        self.store_proc = None

    def stop(self):
        self.kill_store()
        self.kill_master()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def wait_until_writable(tier, timeout=30.0):
    """Wait until the store takes a write (a store server has mounted its memory with the
    master: a few seconds after a master restart); TierError after `timeout` seconds."""
    import numpy as np
    probe = np.zeros(64, np.uint8)
    end = time.monotonic() + timeout
    tier._check(tier.store.register_buffer(probe.ctypes.data, probe.nbytes), "register_buffer")
    try:
        while True:
            rc = tier.store.upsert_from("engram:probe", probe.ctypes.data, probe.nbytes)
            if rc == 0:
                tier.store.remove("engram:probe")
                return
            if time.monotonic() > end:
                raise TierError(f"Mooncake store takes no writes after {timeout} s (code {rc})")
            time.sleep(0.2)
    finally:
        tier.store.unregister_buffer(probe.ctypes.data)
