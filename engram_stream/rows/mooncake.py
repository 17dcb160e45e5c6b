"""Tiered rows: a RAM row cache in front of the local file or of a Mooncake Store.

    tier = MooncakeTier(master="127.0.0.1:50051", metadata="http://127.0.0.1:8080/metadata")
    tier.publish(model)                                            # every layer's rows into the store
    remote = EngramModel.load(path, tables=tier, row_cache_mb=64)  # weights from the file, rows from the store
    local = EngramModel.load(path, row_cache_mb=64)                # the same cache in front of the file
    remote.row_cache_stats()   # {"hits", "misses", "bytes_fetched", "evictions", ...}

Row records. A row travels and is cached as its bytes in the table's dtype, followed
for int8 tables by its float32 scale: the gather converts a record exactly as it
converts a table row, so every tier gives the same floats bit for bit.

Store layout (Mooncake's EngramStore): one object per head, key `engram:l{L}:h{h}`,
holding that head's rows [N_h, record bytes] contiguous (N_h = the head's prime).
Float32 tables are byte-identical to what `mooncake.store.EngramStore.populate` of
0.3.13 writes (float32 [N_h, head_dim]), so tables published by either side read the same.

Reads. An engine in remote mode hashes a token at feed(), looks its rows up in the
RAM cache, and fetches the misses before the nogil gather in ONE `get_into_ranges`
call into a registered staging buffer: keys de-duplicated (one entry per head, its
rows as ranges: 0.3.13 leaves a repeated key's buffer unfilled and reports success,
upstream #3876), every range's returned length checked, the call bounded by a
timeout. Any failure raises TierError and the engine's state is left as it was;
no zeros or stale rows reach the output. Calls work again once the store is back.
"""
from __future__ import annotations

import concurrent.futures
import os
import socket
import time
import weakref
from urllib.parse import urlparse

import numpy as np

from ..errors import TierError
from ._cache import slot_bytes
from .tiers import record_layout

MOONCAKE_PIN = "mooncake-transfer-engine-non-cuda==0.3.13.post1"


# ---- row records ---------------------------------------------------------------------------------
def head_records(model, layer, h) -> np.ndarray:
    """Head h's rows of `layer` as records, uint8 [N_h, record bytes] (a view when it can be)."""
    w = model.layer(layer)
    lo = int(w.offsets[h])
    hi = lo + int(model.plan.head_primes[layer][h])
    rows = np.ascontiguousarray(w.table[lo:hi]).view(np.uint8).reshape(hi - lo, -1)
    if w.table_scale is None:
        return rows
    scale = np.ascontiguousarray(w.table_scale[lo:hi], dtype=np.float32).view(np.uint8).reshape(hi - lo, 4)
    return np.ascontiguousarray(np.concatenate([rows, scale], axis=1))


def store_key(layer, h) -> str:
    return f"engram:l{layer}:h{h}"


# ---- Mooncake Store -----------------------------------------------------------------------------
def _host_port(addr):
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def wait_for_port(host, port, timeout):
    """Wait until host:port accepts a TCP connection; False after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)


class MooncakeTier:
    """A Mooncake Store (a running mooncake_master and its store servers) as a row tier.

    master: "HOST:PORT" of mooncake_master; metadata: the transfer engine's metadata URL
    (mooncake_master's HTTP metadata server, e.g. "http://127.0.0.1:8080/metadata");
    local_host: this client's address. This client lends the store no memory (rows live in
    the store servers). timeout: seconds any one store call may take before TierError."""

    def __init__(self, master, metadata, local_host="127.0.0.1", protocol="tcp", timeout=20.0,
                 connect_timeout=10.0):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(f"MooncakeTier needs {MOONCAKE_PIN} (pip install 'engram_stream[mooncake]'; "
                              f"it needs the Debian package libibverbs1): {e}") from None
        self.master, self.metadata, self.local_host = master, metadata, local_host
        self.timeout = float(timeout)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)
        # setup() blocks ~90 s on an address that does not answer: check both first.
        mhost, mport = _host_port(master)
        url = urlparse(metadata)
        for what, host, port in (("master", mhost, mport), ("metadata server", url.hostname, url.port)):
            if port is not None and not wait_for_port(host, port, connect_timeout):
                raise TierError(f"Mooncake {what} at {host}:{port} does not accept connections "
                                f"(waited {connect_timeout} s)")
        self.abandoned = []   # store calls that timed out and may still be running (see close)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_host, metadata, 0, 16 << 20, protocol, "", master)
        if rc != 0:
            raise TierError(f"Mooncake setup(master={master}, metadata={metadata}) failed with code {rc}")

    def __repr__(self):
        return f"MooncakeTier(master={self.master!r}, metadata={self.metadata!r}, local_host={self.local_host!r})"

    def close(self, wait=10.0):
        """Close the client. A call that timed out earlier may still be running inside it: wait
        up to `wait` s for those, and if one is still stuck leave the client open (closing it
        under a running call crashes the process; it goes away with the process)."""
        if self.store is None:
            return
        concurrent.futures.wait(self.abandoned, timeout=wait)
        if all(f.done() for f in self.abandoned):
            self.store.close()
        self.store = None

    def _check(self, rc, what):
        if rc != 0:
            raise TierError(f"Mooncake {what} failed with code {rc}")

    def publish(self, model, layers=None, progress=None) -> int:
        """Write every layer's rows into the store (upsert: replaces what was there), one
        object per head in EngramStore's layout. Returns the bytes written."""
        written = 0
        for L in (model.cfg.layer_ids if layers is None else layers):
            for h in range(model.cfg.n_heads):
                rec = head_records(model, L, h)
                ptr, n = rec.ctypes.data, rec.nbytes
                self._check(self.store.register_buffer(ptr, n), f"register_buffer ({n} bytes)")
                try:
                    rc = self.store.upsert_from(store_key(L, h), ptr, n)
                    if rc != 0:  # e.g. the old copy sat on a store server that died: drop it, write anew
                        self.store.remove(store_key(L, h), True)
                        rc = self.store.upsert_from(store_key(L, h), ptr, n)
                    self._check(rc, f"upsert of {store_key(L, h)}")
                finally:
                    self.store.unregister_buffer(ptr)
                written += n
                if progress is not None:
                    progress(L, h, written)
        self.check_published(model, layers)
        return written

    def check_published(self, model, layers=None):
        """Raise TierError unless every head object of the model is in the store with its size."""
        for L in (model.cfg.layer_ids if layers is None else layers):
            rowbytes, scalebytes = record_layout(model.layer(L))
            for h in range(model.cfg.n_heads):
                want = int(model.plan.head_primes[L][h]) * (rowbytes + scalebytes)
                got = self.store.get_size(store_key(L, h))
                if got != want:
                    raise TierError(f"Mooncake object {store_key(L, h)}: {got} bytes, expected {want} "
                                    f"(not published, or published from another table dtype): tier.publish(model)")

    def rows(self, model, layer, totals=None) -> "RemoteRows":
        return RemoteRows(self, model, layer, totals)


class RemoteRows:
    """One engine's reader of one layer's rows from a MooncakeTier: a registered staging
    buffer and a bounded, checked, de-duplicated batched read into it. totals: a dict whose
    "fetches" and "fetch_seconds" count every read."""

    def __init__(self, tier, model, layer, totals=None):
        w = model.layer(layer)
        rowbytes, scalebytes = record_layout(w)
        self.tier, self.layer = tier, layer
        self.recbytes = rowbytes + scalebytes
        self.stride = slot_bytes(self.recbytes)
        self.offsets = np.asarray(w.offsets, dtype=np.int64)
        self.keys = [store_key(layer, h) for h in range(len(self.offsets))]
        self.stage = None
        self.abandoned = []   # staging buffers a timed-out call may still write into: never reused
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"engram-l{layer}-fetch")
        self.totals = {"fetches": 0, "fetch_seconds": 0.0} if totals is None else totals

    def __del__(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        if getattr(self, "stage", None) is not None and self.tier.store is not None and not self.abandoned:
            self.tier.store.unregister_buffer(self.stage.ctypes.data)

    def staging(self, nrows) -> np.ndarray:
        """The registered staging buffer, uint8 [>= nrows, stride] (64-byte aligned rows)."""
        if self.stage is None or self.stage.shape[0] < nrows:
            buf = np.zeros((max(nrows, 64), self.stride), dtype=np.uint8)
            rc = self.tier.store.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise TierError(f"Mooncake register_buffer ({buf.nbytes} bytes) failed with code {rc}")
            if self.stage is not None:
                self.tier.store.unregister_buffer(self.stage.ctypes.data)
            self.stage = buf
        return self.stage

    def fetch(self, uniq) -> np.ndarray:
        """Read rows `uniq` (absolute, sorted, distinct int64) into the staging buffer: row
        uniq[k] lands at stage[k]. One get_into_ranges call; raises TierError on anything short."""
        n = len(uniq)
        stage = self.staging(n)
        heads = np.searchsorted(self.offsets, uniq, side="right") - 1
        local = uniq - self.offsets[heads]
        cuts = np.flatnonzero(np.diff(heads)) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = np.concatenate((cuts, [n])).tolist()
        base = stage.ctypes.data
        rb, st = self.recbytes, self.stride
        keys = [self.keys[heads[a]] for a in starts]          # one entry per head: no repeated key
        dst = [list(range(a * st, b * st, st)) for a, b in zip(starts, ends)]
        src = [(local[a:b] * rb).tolist() for a, b in zip(starts, ends)]
        sizes = [[rb] * (b - a) for a, b in zip(starts, ends)]
        t0 = time.perf_counter()
        fut = self.pool.submit(self.tier.store.get_into_ranges, [base], [keys], [dst], [src], [sizes])
        try:
            res = fut.result(timeout=self.tier.timeout)
        except concurrent.futures.TimeoutError:
            # the call may still write into this buffer later: retire it and the worker
            self.abandoned.append(stage)
            self.tier.abandoned.append(fut)
            self.stage = None
            self.pool.shutdown(wait=False)
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"engram-l{self.layer}-fetch")
            raise TierError(f"Mooncake read of {n} rows of layer {self.layer}: no answer within "
                            f"{self.tier.timeout} s") from None
        self.totals["fetch_seconds"] += time.perf_counter() - t0
        self.totals["fetches"] += 1
        try:
            per_key = res[0]
            ok = len(res) == 1 and len(per_key) == len(keys) and all(
                len(r) == b - a and all(x == rb for x in r) for r, a, b in zip(per_key, starts, ends))
        except TypeError:
            ok = False
        if not ok:
            raise TierError(f"Mooncake read of {n} rows of layer {self.layer} failed: {_first_error(res, rb)}")
        return stage


def _first_error(res, rb):
    """The first bad entry of a get_into_ranges result, for the message."""
    try:
        for per_buf in res:
            for k, per_key in enumerate(per_buf):
                for x in per_key:
                    if x != rb:
                        return (f"code {x} (head object #{k} of the batch)" if x < 0
                                else f"{x} bytes where a row has {rb}")
    except TypeError:
        pass
    return f"unexpected result shape {res!r:.200}"
