"""A Mooncake Store as a row tier: MooncakeTier (publish, adopt, check), StoreTables (the tier
opened for one model) and RemoteRows (one layer's reader: a step's missed rows in one call)."""
from __future__ import annotations

import json
import os
import time
import weakref
from urllib.parse import urlparse

import numpy as np

from ...errors import TierError
from .._cache import slot_bytes
from .._direct import add_read
from .._source import RecordSource
from ..identity import layer_digests, model_name
from ..tier import Tables, Tier, register_tier
from .calls import (OPEN_TIERS, BoundedCalls, answers, fault, host_port, keep_forever, register_close_at_exit,
                    wait_for_port)
from .keys import (FINGERPRINT_FORMAT, fingerprint, fingerprint_key, head_records, layout_of, sampled_records,
                   store_key)

MOONCAKE_PIN = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
LOG_LEVEL = "ERROR"   # the client's default MC_LOG_LEVEL here


class MooncakeTier(Tier):
    """A Mooncake Store (a running mooncake_master and its store servers) as a row tier.

    master: "HOST:PORT" of mooncake_master; metadata: the transfer engine's metadata URL
    (mooncake_master's HTTP metadata server, e.g. "http://127.0.0.1:8080/metadata");
    local_host: this client's address. This client lends the store no memory (rows live in
    the store servers). timeout: seconds any one store call may take before TierError;
    connect_timeout: the same for reaching the servers and setting the client up.
    name: the name in every key (see the module doc): None, each model's model_name(); a
    string of letters, digits, "_", "-", "."; "" EngramStore's own keys (one model a store).
    gguf: the path of the GGUF whose rows the store holds (published from a model loaded with
    tables=GGUFTier(path)): a model loading with this tier checks and decodes those records
    ("gguf:TYPE", quantized as the file holds them). None: a model's own records, or its GGUF's
    when it was loaded with a GGUFTier (publish)."""

    def __init__(self, master, metadata, local_host="127.0.0.1", protocol="tcp", timeout=20.0,
                 connect_timeout=10.0, name=None, gguf=None):
        if gguf is not None and not isinstance(gguf, (str, os.PathLike)):
            raise TypeError(f"MooncakeTier(gguf=): the path of a .gguf file or None, got {type(gguf).__name__}")
        self.gguf = None if gguf is None else os.fspath(gguf)
        self._gguf_tables = weakref.WeakKeyDictionary()   # model -> its GGUFTables of `gguf`
        if name is not None and (not isinstance(name, str) or not all(c.isalnum() or c in "_-." for c in name)):
            raise ValueError(f"name must be None or a string of letters, digits, '_', '-', '.', got {name!r}")
        self.name = name
        # Mooncake's client logs every connection and retry at INFO (~25 lines a publish): errors
        # only, unless the user set MC_LOG_LEVEL (MC_LOG_LEVEL=INFO shows everything)
        os.environ.setdefault("MC_LOG_LEVEL", LOG_LEVEL)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(f"MooncakeTier needs {MOONCAKE_PIN} (pip install '.[mooncake]' from the engram_stream checkout; "
                              f"it needs the Debian package libibverbs1): {e}") from None
        self.master, self.metadata, self.local_host = master, metadata, local_host
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self.store = None
        self.stuck = False    # a call timed out and may still run inside the client (see close)
        self._calls = BoundedCalls("engram-mooncake", max(self.timeout, self.connect_timeout))
        self._readers = weakref.WeakSet()   # RemoteRows of this tier (close waits for their reads)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_host)
        # setup() blocks ~90 s on an address that does not answer: check both first.
        mhost, mport = host_port(master)
        url = urlparse(metadata)
        for what, host, port in (("master", mhost, mport), ("metadata server", url.hostname, url.port)):
            if port is not None and not wait_for_port(host, port, connect_timeout):
                raise TierError(f"Mooncake {what} at {host}:{port} does not accept connections "
                                f"(waited {connect_timeout} s)")
        # A stopped (SIGSTOP) master still accepts connections (the kernel does), and setup()
        # holds the GIL while it waits for an answer that never comes: no thread could time it
        # out. So each server must answer first (the master closes a connection that sends it
        # no valid request; the metadata server answers HTTP).
        if not answers(mhost, mport, b"\0" * 32, connect_timeout):
            raise TierError(f"Mooncake master at {mhost}:{mport} accepts connections but does not answer "
                            f"(waited {connect_timeout} s): a stopped or overloaded master")
        if url.scheme == "http" and url.port is not None and not answers(
                url.hostname, url.port, f"GET {url.path or '/'}?key=engram-probe HTTP/1.0\r\n\r\n".encode(),
                connect_timeout):
            raise TierError(f"Mooncake metadata server at {url.hostname}:{url.port} does not answer "
                            f"(waited {connect_timeout} s)")
        store = MooncakeDistributedStore()
        rc = self._call(f"setup(master={master}, metadata={metadata})", store.setup, local_host, metadata, 0,
                        16 << 20, protocol, "", master, timeout=connect_timeout, client=store)
        if rc != 0:
            raise TierError(f"Mooncake setup(master={master}, metadata={metadata}) failed with code {rc}")
        self.store = store
        register_close_at_exit()
        OPEN_TIERS.add(self)

    def __repr__(self):
        return (f"MooncakeTier(master={self.master!r}, metadata={self.metadata!r}, local_host={self.local_host!r}, "
                f"name={self.name!r})")

    def name_of(self, model, digests=None) -> str:
        """The name `model`'s keys carry in this tier (digests: as model_name's)."""
        if self.name is not None:
            return self.name
        return model_name(model, digests or self._digests(model, model.cfg.layer_ids))

    def _digests(self, model, layers, progress=None) -> dict:
        """layer_digests of `layers`, and of every layer when the name is the model's (it digests all)."""
        return layer_digests(model, model.cfg.layer_ids if self.name is None else layers, progress,
                             self.own_tables(model))

    def own_tables(self, model):
        """The opened tier whose records this tier publishes and checks for `model`: the GGUF of
        `gguf` (opened for the model once), the model's own GGUF tables when it was loaded with a
        GGUFTier, else None (the records of its weights)."""
        from ..gguf_tier import GGUFTables, GGUFTier
        if self.gguf is not None:
            if model not in self._gguf_tables:
                self._gguf_tables[model] = GGUFTier(self.gguf).open(model)
            return self._gguf_tables[model]
        inner = getattr(model.tables, "inner", model.tables)
        return inner if isinstance(inner, GGUFTables) else None

    def _call(self, what, fn, *args, timeout=None, client=None, keep=()):
        """fn(*args) bounded by the timeout; TierError when it takes longer (the client and what
        the call uses, `keep`, are then kept alive for good: the call may still be running)."""
        t = self.timeout if timeout is None else timeout
        try:
            return self._calls.call(t, fn, *args)
        except TimeoutError:
            self.stuck = True
            fault()
            keep_forever(client if client is not None else self.store, *keep)
            raise TierError(f"Mooncake {what}: no answer within {t} s (a stopped or unreachable master or "
                            f"store server)") from None

    def _open(self):
        if self.store is None:
            raise TierError(f"{self!r} is closed")
        return self.store

    @property
    def closed(self) -> bool:
        return self.store is None

    def close(self):
        """Close the client. Calls after close raise TierError. When a call timed out earlier it may
        still be running inside the client: closing under it would crash, so the client is then
        left open (it goes away with the process, which waits for nothing)."""
        if self.store is None:
            return
        for reader in list(self._readers):  # reads still running inside the client: let them end
            if not reader.settle():
                self.stuck = True
        store, self.store = self.store, None
        OPEN_TIERS.discard(self)
        if not self.stuck:
            store.close()

    def _check(self, rc, what):
        if rc != 0:
            fault()
            raise TierError(f"Mooncake {what} failed with code {rc}")

    def publish(self, model, layers=None, progress=None, digest_progress=None) -> int:
        """Write every layer's rows into the store (upsert: replaces what was there), one object per
        head in EngramStore's layout, then the layer's fingerprint. Returns the bytes written.
        A head's records are built contiguous in RAM for the write (N_h x record bytes).
        First the tables are digested whole (layer_digests: about 1 s a GB, once a host
        for mapped tables; digest_progress(done, total) in bytes), for the name and the
        fingerprints. progress(layer, head, written bytes) after each head's write."""
        store = self._open()
        layers = model.cfg.layer_ids if layers is None else layers
        digests = self._digests(model, layers, digest_progress)
        written, name, own = 0, self.name_of(model, digests), self.own_tables(model)
        for L in layers:
            for h in range(model.cfg.n_heads):
                rec = head_records(model, L, h, own)
                ptr, n, key = rec.ctypes.data, rec.nbytes, store_key(L, h, name)
                self._check(self._call("register_buffer", store.register_buffer, ptr, n),
                            f"register_buffer ({n} bytes)")
                ok = False
                try:
                    rc = self._call(f"upsert of {key}", store.upsert_from, key, ptr, n)
                    if rc != 0:  # e.g. the old copy sat on a store server that died: drop it, write anew
                        self._call(f"remove of {key}", store.remove, key, True)
                        rc = self._call(f"upsert of {key}", store.upsert_from, key, ptr, n)
                    ok = True
                    self._check(rc, f"upsert of {key}")
                finally:
                    if ok:
                        store.unregister_buffer(ptr)
                    else:  # an upsert that timed out may still read it
                        keep_forever(rec)
                written += n
                if progress is not None:
                    progress(L, h, written)
            fp = json.dumps(fingerprint(model, L, digest=digests[L], tables=own), sort_keys=True).encode()
            key = fingerprint_key(L, name)
            self._check(self._call(f"upsert of {key}", store.upsert, key, fp), f"upsert of {key}")
        self.check_published(model, layers, digests)
        return written

    def adopt(self, model, layers=None) -> str:
        """Rows another writer put under this tier's name for `model` (EngramStore.populate, which
        writes no fingerprint): every head object is read back whole and compared byte for byte
        with the model's records; when all agree, the fingerprints publish() writes (with the
        tables' digest) go beside them, and the model loads from them. A difference is a
        TierError naming the key and the first row that differs (nothing is written). Returns the
        name. Reads every row of the store and of the local tables: as costly as a publish."""
        store = self._open()
        layers = model.cfg.layer_ids if layers is None else layers
        digests = self._digests(model, layers)
        name, own = self.name_of(model, digests), self.own_tables(model)
        for L in layers:
            for h in range(model.cfg.n_heads):
                key, want = store_key(L, h, name), head_records(model, L, h, own)
                got = np.frombuffer(self._call(f"get of {key}", store.get, key), np.uint8)
                fix = "not this model's rows, nothing adopted. tier.publish(model) to write them"
                if got.size != want.size:
                    raise TierError(f"Mooncake object {key}: {got.size} bytes, this model's head has {want.size}: {fix}")
                bad = np.flatnonzero((got.reshape(want.shape) != want).any(axis=1))
                if bad.size:
                    raise TierError(f"Mooncake object {key}: head row {int(bad[0])} differs from this model's: {fix}")
        for L in layers:
            fp = json.dumps(fingerprint(model, L, digest=digests[L], tables=own), sort_keys=True).encode()
            key = fingerprint_key(L, name)
            self._check(self._call(f"upsert of {key}", store.upsert, key, fp), f"upsert of {key}")
        return self.check_published(model, layers, digests)

    def published(self, layer, name=""):
        """The fingerprint publish() wrote for `layer` under `name` (a dict; name: name_of(model)),
        or None when there is none (e.g. tables written by EngramStore.populate)."""
        store = self._open()
        key = fingerprint_key(layer, name)
        if self._call(f"get_size of {key}", store.get_size, key) <= 0:
            return None
        raw = self._call(f"get of {key}", store.get, key)
        try:
            fp = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            return {}
        return fp if isinstance(fp, dict) else {}

    def check_published(self, model, layers=None, digests=None):
        """Raise TierError unless the store holds this model's tables: every head object with its
        size, a published fingerprint of the same layout whose tables_digest is the digest of this
        model's tables (layer_digests; digests: those already taken), and the store's
        bytes of the fingerprint's sampled rows equal to the model's. The digest refuses another
        model's tables, however few rows differ; the samples refuse rows another writer put under
        the name after the publish (EngramStore.populate). Returns the name the model's keys carry."""
        store = self._open()
        layers = model.cfg.layer_ids if layers is None else layers
        digests = digests or self._digests(model, layers)
        name, own = self.name_of(model, digests), self.own_tables(model)
        samples = {L: sampled_records(model, L, own) for L in layers}
        for L in layers:
            rowbytes, scalebytes, _ = layout_of(model, L, own)
            for h in range(model.cfg.n_heads):
                want = int(model.plan.head_primes[L][h]) * (rowbytes + scalebytes)
                key = store_key(L, h, name)
                got = self._call(f"get_size of {key}", store.get_size, key)
                if got != want:
                    raise TierError(f"Mooncake object {key}: {got} bytes, expected {want} (not published under "
                                    f"the name {name!r}, or published from another table dtype): tier.publish(model)")
            theirs, mine = self.published(L, name), fingerprint(model, L, samples[L], digests[L], own)
            key = fingerprint_key(L, name)
            if theirs is None or theirs.get("format") != FINGERPRINT_FORMAT:
                what = ("no fingerprint (rows written by EngramStore.populate or another writer?)" if theirs is None
                        else f"a fingerprint of format {theirs.get('format')!r}, not {FINGERPRINT_FORMAT}")
                raise TierError(f"Mooncake layer {L}: {key} holds {what}, so no digest of the tables its rows are "
                                f"from: which model's rows they are is unknown. tier.publish(model) to publish them "
                                f"with one, or tier.adopt(model) to compare every row and add it")
            bad = [k for k in ("variant", "layer", "heads", "rowbytes", "scalebytes", "record_format")
                   if theirs.get(k) != mine.get(k)]
            if bad:
                raise TierError(f"Mooncake layer {L}: the store's fingerprint differs from this model's in "
                                f"{', '.join(bad)}: it holds another model's rows. tier.publish(model) to "
                                f"replace them")
            if theirs.get("tables_digest") != mine["tables_digest"]:
                raise TierError(f"Mooncake layer {L} under the name {name!r}: the store's rows are of tables whose "
                                f"digest is {theirs.get('tables_digest')}, this model's tables digest to "
                                f"{mine['tables_digest']}: the store holds another model's rows. tier.publish(model) "
                                f"to replace them, or load with the name its tables were published under")
            self._check_samples(model, L, samples[L], name, own)
        return name

    def _check_samples(self, model, L, samples, name, own=None):
        """The store's bytes of the fingerprint's sampled rows against the model's own."""
        reader = RemoteRows(self, model, L, name=name, tables=own)
        offsets = model.layer(L).offsets
        absolute = np.concatenate([int(offsets[h]) + local for h, (local, _) in samples.items()])
        order = np.argsort(absolute, kind="stable")
        stage = reader.fetch(absolute[order])
        got = stage[:, :reader.recbytes][np.argsort(order)]
        want = np.concatenate([rec for _, rec in samples.values()])
        if not np.array_equal(got, want):
            k = int(np.flatnonzero((got != want).any(axis=1))[0])
            raise TierError(f"Mooncake layer {L}: row {int(absolute[k])} in the store differs from this model's: "
                            f"the store holds another model's rows. tier.publish(model) to replace them")
        reader.close()

    def open(self, model) -> "StoreTables":
        """A model loading with tables=this tier: refused unless the store holds its rows. The
        check digests the model's own tables (once a host for mapped ones: the digest is cached)
        and reads their sampled rows, both by pread, leaving the page cache as it was
        (io.memory.byte_chunks, read_rows); nothing after it reads them: its engines' rows all
        come from the store."""
        return StoreTables(self, model, self.check_published(model), self.own_tables(model))

    def rows(self, model, layer, totals=None, read_totals=None, name=None, tables=None) -> "RemoteRows":
        """One engine's reader of `layer` (name: the model's name in this tier, when known;
        tables: the opened tier whose records the store holds, own_tables(model))."""
        self._open()
        reader = RemoteRows(self, model, layer, totals, read_totals, name, tables)
        self._readers.add(reader)
        return reader


class StoreTables(Tables):
    """A MooncakeTier opened for one model (name: its name in the store, checked published):
    each engine's RemoteRows reads its rows; every read of the model counts in stats()
    (fetches, fetch_seconds)."""

    def __init__(self, tier, model, name, own=None):
        super().__init__(tier)
        self.model_ref, self.name, self.own = weakref.ref(model), name, own
        self.totals = {"fetches": 0, "fetch_seconds": 0.0}

    def source(self, layer, read_totals=None) -> "RemoteRows":
        return self.tier.rows(self.model_ref(), layer, self.totals, read_totals, self.name, self.own)

    def record_layout(self, layer):
        """(row bytes, scale bytes) of the records the store holds (a GGUF's own, or the weights')."""
        return layout_of(self.model_ref(), layer, self.own)[:2]

    def stats(self) -> dict:
        return dict(self.totals)


class RemoteRows(RecordSource):
    """One engine's reader of one layer's rows from a MooncakeTier (a RecordSource: start/finish):
    a registered staging buffer and a bounded, checked, de-duplicated batched read into it.
    totals: a dict whose "fetches" and "fetch_seconds" count every read."""

    def __init__(self, tier, model, layer, totals=None, read_totals=None, name=None, tables=None):
        w = model.layer(layer)
        rowbytes, scalebytes, fmt = layout_of(model, layer, tables)
        super().__init__(int(model.plan.table_rows[layer]), rowbytes, scalebytes, fmt)
        self.tier, self.layer = tier, layer
        self.recbytes = rowbytes + scalebytes
        self.stride = slot_bytes(self.recbytes)
        self.offsets = np.asarray(w.offsets, dtype=np.int64)
        name = tier.name_of(model) if name is None else name
        self.keys = [store_key(layer, h, name) for h in range(len(self.offsets))]
        self.stage = None
        self._pending = None
        self._calls = BoundedCalls(f"engram-l{layer}-fetch", tier.timeout)
        self.totals = {"fetches": 0, "fetch_seconds": 0.0} if totals is None else totals
        self.read_totals = read_totals  # rows._direct.new_totals(): reads, bytes, rows, wait histogram

    def close(self):
        """Unregister the staging buffer (not one a timed-out read may still write into)."""
        stage, self.stage = getattr(self, "stage", None), None
        if stage is not None and self.tier.store is not None:
            self.tier.store.unregister_buffer(stage.ctypes.data)

    def __del__(self):
        self.close()

    def staging(self, nrows) -> np.ndarray:
        """The registered staging buffer, uint8 [>= nrows, stride] (64-byte aligned rows)."""
        store = self.tier._open()
        if self.stage is None or self.stage.shape[0] < nrows:
            buf = np.zeros((max(nrows, 64), self.stride), dtype=np.uint8)
            rc = self.tier._call("register_buffer", store.register_buffer, buf.ctypes.data, buf.nbytes, keep=(buf,))
            if rc != 0:
                raise TierError(f"Mooncake register_buffer ({buf.nbytes} bytes) failed with code {rc}")
            self.close()
            self.stage = buf
        return self.stage

    def fetch(self, uniq) -> np.ndarray:
        """Read rows `uniq` (absolute, sorted, distinct int64) into the staging buffer: row
        uniq[k] lands at stage[k]. One get_into_ranges call; raises TierError on anything short."""
        self.start(uniq)
        return self.finish()

    def start(self, uniq):
        """Start reading rows `uniq` (as fetch) and return at once; finish() waits for them. One
        read in flight per reader: one started and never finished (its call was abandoned) is
        waited for first and dropped."""
        self.drop()
        n = len(uniq)
        stage = self.staging(n)
        store = self.tier.store
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
        handle = self._calls.start(store.get_into_ranges, [base], [keys], [dst], [src], [sizes])
        self._pending = (handle, n, stage, store, keys, starts, ends, time.perf_counter())

    def settle(self) -> bool:
        """Wait (bounded by the timeout from its start) until a started read has ended, keeping
        its result for finish(): the tier can then close its client under no running call.
        False when it is still running."""
        if self._pending is None:
            return True
        box, done, t0 = self._pending[0]
        return done.wait(max(0.0, t0 + self.tier.timeout - time.monotonic()))

    def drop(self):
        """Wait for a started read nobody finished (an aborted call; close()) and keep nothing."""
        if self._pending is not None:
            try:
                self.finish()
            except TierError:
                pass

    def finish(self) -> np.ndarray:
        """Wait for the started read (bounded by the tier's timeout from its start): the staging
        buffer, row uniq[k] at stage[k]; TierError on a timeout or anything short."""
        if self._pending is None:
            raise RuntimeError("RemoteRows.finish: no read was started")
        (handle, n, stage, store, keys, starts, ends, t0), self._pending = self._pending, None
        rb = self.recbytes
        w0 = time.perf_counter()
        try:
            res = self._calls.finish(handle, self.tier.timeout)
        except TimeoutError:
            # the call may still write into this buffer later: it is never reused nor freed
            keep_forever(stage, store)
            fault()
            self.tier.stuck = True
            self.stage = None
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
            fault()
            raise TierError(f"Mooncake read of {n} rows of layer {self.layer} failed: {_first_error(res, rb)}")
        if self.read_totals is not None:  # one batched get: a read of n rows
            add_read(self.read_totals, 1, n * rb, n, time.perf_counter() - w0)
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


register_tier("mooncake", MooncakeTier)
