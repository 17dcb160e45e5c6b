"""One row cache per host (host_cache=): processes of one host share a cache per layer, mapped
from a file under /dev/shm. Held to the plain model's rows and outputs, bit for bit; every test
checks that it leaves no file in /dev/shm.

The multi-process tests drive worker processes (WORKER, started outside the checkout) one
command at a time, so the order of their reads is the test's: a row one worker read is then a
hit for the next.
"""
from __future__ import annotations

import glob
import json
import os
import select
import signal
import subprocess
import time
import uuid

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.rows._cache import RowCache, cache_nbytes
from engram_stream.rows.tiers import HOST_CACHE_DIR

from helpers.models import fine_tuned_outside_samples
from helpers.processes import run_python, start_python

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

if not os.path.isdir(HOST_CACHE_DIR):
    pytest.skip(f"no {HOST_CACHE_DIR} on this system", allow_module_level=True)

CFG = dict(hidden_size=64, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
           engram_vocab_size=[30011, 30013], layer_ids=[1, 3], vocab_size=500, kernel_size=3)
S = 3
REPLY_SECONDS = 120  # a worker's answer to one command (a deadlocked one never answers)

WORKER = r'''
import json, mmap, os, signal, sys
import numpy as np
from engram_stream import EngramModel

model = None
sources = {}


def host_stats():
    s = model.row_cache_stats()
    out = {k: s[k] for k in ("hits", "misses", "rows_cached", "capacity_rows", "cache_bytes", "budget_bytes")}
    out["recoveries"] = sum(c.recoveries for c in model.tier.caches.values())
    out["pinned"] = sum(c.pinned() for c in model.tier.caches.values())
    out["layers"] = {str(L): {k: v[k] for k in ("hits", "misses", "rows_cached", "capacity_rows")}
                     for L, v in s["layers"].items()}
    return out


def mapping_kb(prefix):
    """Rss and Pss (kB) of this process's mappings of files starting with prefix."""
    from engram_stream.io.memory import mapping_bytes
    m = mapping_bytes(prefix)
    return {"rss_kb": m["rss"] // 1024, "pss_kb": m["pss"] // 1024}


held = []
for line in sys.stdin:
    cmd = json.loads(line)
    op, reply = cmd["op"], {}
    try:
        if op == "load":
            model = EngramModel.load(cmd["path"], tables=cmd.get("tables", "mapped"), row_cache_mb=cmd["mb"],
                                     host_cache=cmd["host"])
            for L in model.cfg.layer_ids:
                model.tier.cache(L)
            reply = host_stats()
        elif op == "read":
            L = cmd["layer"]
            src = sources.setdefault(L, model.row_source(L))  # one reader per layer: its pins persist
            np.save(cmd["out"], src.read(np.load(cmd["rows"])))
            reply = host_stats()
        elif op == "hold":
            # a call in flight when the process dies: an engine fed tokens whose rows are cached
            # (its submit pins every one) and never computed
            L = cmd["layer"]
            eng = model.stream(L)
            ids = np.load(cmd["ids"])
            eng.feed_packed(ids, [0], [len(ids)])
            eng.fetch()                            # the rows read and cached, released
            eng.reset()
            eng.feed_packed(ids, [0], [len(ids)])  # the same rows: every cached one pinned
            np.save(cmd["out"], np.unique(eng.pending_rows))
            held.append(eng)
            reply = host_stats()
        elif op == "decode":
            ids, hid = np.load(cmd["ids"]), np.load(cmd["hid"])
            dec = model.decoder(n_streams=ids.shape[1])
            outs = {str(L): [] for L in model.cfg.layer_ids}
            for t in range(len(ids)):
                dec.begin(ids[t])
                for L in model.cfg.layer_ids:
                    outs[str(L)].append(dec.layer(L, hid[t]).copy())
            np.savez(cmd["out"], **{L: np.stack(v) for L, v in outs.items()})
            reply = host_stats()
        elif op == "stats":
            reply = host_stats()
        elif op == "rss":
            reply = mapping_kb(cmd["prefix"])
        elif op == "spin":
            # read a row from a table whose pages fault, inside the cache's lock: the fault's handler
            # returns, the copy faults again, and the process spins holding the lock until killed
            cache = model.tier.cache(cmd["layer"])
            signal.signal(signal.SIGSEGV, lambda *a: None)
            signal.signal(signal.SIGBUS, lambda *a: None)
            nrows = cmd["row"] + 1
            buf = mmap.mmap(-1, nrows * cache.recbytes, prot=0)
            faulting = np.frombuffer(buf, np.uint8).reshape(nrows, cache.recbytes)
            sys.stdout.write(json.dumps({"spinning": True}) + "\n")
            sys.stdout.flush()
            cache.read([cmd["row"]], faulting)
        elif op == "exit":
            break
    except Exception as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
'''


class Worker:
    def __init__(self, folder):
        script = os.path.join(folder, "worker.py")
        if not os.path.exists(script):
            with open(script, "w") as f:
                f.write(WORKER)
        self.folder = folder
        self.err = open(os.path.join(folder, f"worker-{uuid.uuid4().hex[:6]}.err"), "w+")
        self.p = start_python([script], stdin=-1, stdout=-1, stderr=self.err, text=True, bufsize=1)

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.reply()

    def reply(self, seconds=REPLY_SECONDS):
        ready, _, _ = select.select([self.p.stdout], [], [], seconds)
        if not ready:
            raise AssertionError(f"worker {self.p.pid} gave no answer in {seconds} s (deadlocked?)")
        line = self.p.stdout.readline()
        if not line:
            self.err.seek(0)
            raise AssertionError(f"worker {self.p.pid} ended: {self.err.read()[-2000:]}")
        return json.loads(line)

    def read(self, layer, rows):
        name = uuid.uuid4().hex[:8]
        rp, op = os.path.join(self.folder, f"r{name}.npy"), os.path.join(self.folder, f"o{name}.npy")
        np.save(rp, np.asarray(rows, np.int64))
        st = self.send(op="read", layer=layer, rows=rp, out=op)
        assert "error" not in st, st["error"]
        return np.load(op), st

    def hold(self, layer, ids):
        """The worker's engine of `layer` fed `ids` (cached first) and left mid-call: (the rows it
        holds, stats)."""
        name = uuid.uuid4().hex[:8]
        ip, op = os.path.join(self.folder, f"i{name}.npy"), os.path.join(self.folder, f"o{name}.npy")
        np.save(ip, np.asarray(ids, np.int64))
        st = self.send(op="hold", layer=layer, ids=ip, out=op)
        assert "error" not in st, st["error"]
        return np.load(op), st

    def close(self):
        if self.p.poll() is None:
            try:
                self.send(op="exit")
            except (AssertionError, OSError):
                pass
        try:
            self.p.wait(30)
        except Exception:
            self.p.kill()
            self.p.wait()
        for f in (self.p.stdin, self.p.stdout, self.err):
            f.close()

    def kill(self):
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("host_cache")
    model = EngramModel.init(EngramConfig(**CFG), seed=3)
    return model.save(str(d / "m.safetensors"))


@pytest.fixture(scope="module")
def plain(ckpt):
    return EngramModel.load(ckpt)


@pytest.fixture
def host(tmp_path):
    """A host-cache name of this test only; after the test no file of it is left in /dev/shm."""
    name = f"test{os.getpid()}-{uuid.uuid4().hex[:8]}"
    workers = []

    def start(n=1):
        new = [Worker(str(tmp_path)) for _ in range(n)]
        workers.extend(new)
        return new

    yield name, start
    for w in workers:
        w.close()
    left = glob.glob(os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-*"))
    for f in left:
        os.unlink(f)
    assert not left, f"files left in {HOST_CACHE_DIR}: {left}"


def table_rows(model, L):
    return int(model.plan.table_rows[L])


def test_four_processes_share_one_cache_and_its_stats(ckpt, plain, host):
    name, start = host
    ws = start(4)
    loads = [w.send(op="load", path=ckpt, mb=8, host=name) for w in ws]
    assert all("error" not in s for s in loads), loads
    files = sorted(glob.glob(os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-*")))
    assert len(files) == len(CFG["layer_ids"])  # one file per layer, whoever made it
    rng = np.random.default_rng(0)
    L = CFG["layer_ids"][0]
    rows = rng.choice(table_rows(plain, L), 5000, replace=False)
    want = plain.row_source(L).read(rows)
    got, st = ws[0].read(L, rows)
    np.testing.assert_array_equal(got, want)
    assert st["misses"] == 5000 and st["hits"] == 0
    for k, w in enumerate(ws[1:], 1):  # a row the first read is a hit for every other process
        got, st = w.read(L, rows[::-1])
        np.testing.assert_array_equal(got, want[::-1])
        assert st["misses"] == 5000 and st["hits"] == 5000 * k
    assert ws[0].send(op="stats")["hits"] == 15000  # the host's counters, seen from any process
    # each process's rows go into the one cache: misses of one process's new rows, hits for the next
    more = rng.choice(table_rows(plain, L), 3000, replace=False)
    ws[3].read(L, more)
    before = ws[1].send(op="stats")
    got, after = ws[1].read(L, more)
    np.testing.assert_array_equal(got, plain.row_source(L).read(more))
    assert after["misses"] == before["misses"] and after["hits"] == before["hits"] + 3000


def plain_decode(model, ids, hid):
    dec = model.decoder(n_streams=ids.shape[1])
    outs = {L: [] for L in model.cfg.layer_ids}
    for t in range(len(ids)):
        dec.begin(ids[t])
        for L in outs:
            outs[L].append(dec.layer(L, hid[t]).copy())
    return {L: np.stack(v) for L, v in outs.items()}


@pytest.mark.parametrize("tables", ["mapped", "direct"])
def test_decodes_are_the_plain_models_and_the_second_process_only_hits(ckpt, plain, host, tmp_path, tables):
    name, start = host
    ws = start(4)
    for w in ws:
        assert "error" not in w.send(op="load", path=ckpt, mb=8, host=name, tables=tables)
    rng = np.random.default_rng(1)
    T = 40
    ids = ((rng.zipf(1.3, (T, S)) + 3) % CFG["vocab_size"]).astype(np.int64)
    hid = rng.standard_normal((T, S, CFG["hc_mult"], CFG["hidden_size"]), dtype=np.float32)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "hid.npy", hid)
    want = plain_decode(plain, ids, hid)
    stats = []
    for k, w in enumerate(ws):
        out = str(tmp_path / f"dec{k}.npz")
        st = w.send(op="decode", ids=str(tmp_path / "ids.npy"), hid=str(tmp_path / "hid.npy"), out=out)
        assert "error" not in st, st
        got = np.load(out)
        for L in CFG["layer_ids"]:
            np.testing.assert_array_equal(got[str(L)], want[L])  # bit for bit
        stats.append(st)
    lookups = T * S * plain.cfg.n_heads * len(CFG["layer_ids"])
    assert stats[0]["misses"] > 0
    for k in range(1, 4):  # the first process's rows are all cached: the others only hit
        assert stats[k]["misses"] == stats[0]["misses"]
        assert stats[k]["hits"] + stats[k]["misses"] == (k + 1) * lookups


def test_combined_memory_of_four_processes_is_one_budget(ckpt, plain, host):
    """Every process reads every row (the caches fill up); the pages of the host's files are
    counted once: the processes' Pss of them sums to at most the budget (and 256 kB), while
    each process maps nearly all of it (Rss)."""
    name, start = host
    mb = 6
    ws = start(4)
    for w in ws:
        assert "error" not in w.send(op="load", path=ckpt, mb=mb, host=name)
    rng = np.random.default_rng(2)
    for w in ws:
        for L in CFG["layer_ids"]:
            w.read(L, rng.permutation(table_rows(plain, L)))
    st = ws[0].send(op="stats")
    assert st["rows_cached"] == st["capacity_rows"]  # full
    prefix = os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-")
    kb = [w.send(op="rss", prefix=prefix) for w in ws]
    budget_kb = mb * 1024
    pss = sum(k["pss_kb"] for k in kb)
    assert st["cache_bytes"] <= mb << 20
    assert pss <= budget_kb + 256, kb  # one copy: 4 private caches would hold 4 budgets
    assert min(k["rss_kb"] for k in kb) >= 0.9 * st["cache_bytes"] / 1024, kb  # each maps the whole cache


def test_a_process_killed_holding_the_lock_does_not_stop_the_others(ckpt, plain, host):
    """A worker is SIGKILLed inside the lock, in the middle of filling a slot (its row taken,
    its bytes never copied): the next taker recovers the lock (EOWNERDEAD) and drops the rows,
    so no one reads the half-filled slot; the others go on, exact."""
    name, start = host
    a, b, spinner = start(3)
    for w in (a, b, spinner):
        assert "error" not in w.send(op="load", path=ckpt, mb=4, host=name)
    L = CFG["layer_ids"][0]
    rows = np.arange(0, 4000, 3)
    a.read(L, rows)
    victim = 1  # not cached: the spinner's read takes a slot for it, then faults copying its bytes
    assert victim not in rows
    spinner.p.stdin.write(json.dumps({"op": "spin", "layer": L, "row": victim}) + "\n")
    spinner.p.stdin.flush()
    assert spinner.reply() == {"spinning": True}
    time.sleep(0.5)
    assert spinner.p.poll() is None  # spinning, in the lock
    spinner.kill()
    check = np.concatenate([[victim], rows])
    got, st = b.read(L, check)  # a deadlock would never answer (Worker.reply's timeout)
    np.testing.assert_array_equal(got, plain.row_source(L).read(check))
    assert st["recoveries"] == 1
    got, st2 = a.read(L, check)  # after the recovery the cache works again: all hits
    np.testing.assert_array_equal(got, plain.row_source(L).read(check))
    assert st2["misses"] == st["misses"] and st2["hits"] == st["hits"] + len(check)


def test_pins_of_a_killed_process_leak_and_reads_stay_exact(ckpt, plain, host):
    """tables="direct": a reader's pins last while its call reads them. A worker killed mid-call
    with every slot pinned: its pins stay (DESIGN.md section 10), the others read every row from
    the files, exact, without waiting; a process that then finds the file with no user in it
    clears the pins."""
    name, start = host
    a, b = start(2)
    mb = 0.1
    for w in (a, b):
        assert "error" not in w.send(op="load", path=ckpt, mb=mb, host=name, tables="direct")
    L = CFG["layer_ids"][0]
    rng = np.random.default_rng(4)
    rows, st = a.hold(L, rng.integers(0, CFG["vocab_size"], 1500))
    cap = st["layers"][str(L)]["capacity_rows"]
    assert 0 < cap < 2000 < len(rows) and st["layers"][str(L)]["rows_cached"] == cap
    assert st["pinned"] >= cap  # every slot pinned by a's call in flight
    a.kill()
    other = np.setdiff1d(rng.choice(table_rows(plain, L), 3000, replace=False), rows)
    for _ in range(2):  # every slot pinned: nothing is cached, every row comes from the files
        got, st2 = b.read(L, other)
        np.testing.assert_array_equal(got, plain.row_source(L).read(other))
    assert st2["misses"] == st["misses"] + 2 * len(other)
    assert st2["pinned"] == st["pinned"]  # b's finished reads hold no pin; the dead a's stay
    got, st3 = b.read(L, rows)  # the rows the dead process pinned are still cached, bytes intact
    np.testing.assert_array_equal(got, plain.row_source(L).read(rows))
    assert st3["hits"] == st2["hits"] + cap
    b.close()  # the last user: the file is removed
    assert not glob.glob(os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-*"))


def test_a_file_left_by_dead_processes_is_reused_with_its_pins_cleared(ckpt, plain, host):
    name, start = host
    a, = start(1)
    assert "error" not in a.send(op="load", path=ckpt, mb=0.1, host=name, tables="direct")
    L = CFG["layer_ids"][0]
    rows, st = a.hold(L, np.random.default_rng(5).integers(0, CFG["vocab_size"], 1500))  # every slot pinned
    assert st["pinned"] >= st["layers"][str(L)]["capacity_rows"]
    a.kill()  # the only user dies: its files stay, pins and all
    assert glob.glob(os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-*"))
    b, = start(1)
    st_b = b.send(op="load", path=ckpt, mb=0.1, host=name, tables="direct")
    assert st_b["misses"] == st["misses"]  # the same cache, its counters kept
    other = np.setdiff1d(np.arange(6000, 7000), rows)[:300]
    b.read(L, other)
    got, st2 = b.read(L, other[::-1])  # b's pins of the first read went with its second: all cached
    np.testing.assert_array_equal(got, plain.row_source(L).read(other[::-1]))
    assert st2["hits"] == st_b["hits"] + len(other)


def test_a_layout_mismatch_is_refused_with_the_file_and_the_fix(ckpt, host):
    name, start = host
    a, b = start(2)
    assert "error" not in a.send(op="load", path=ckpt, mb=4, host=name)
    err = b.send(op="load", path=ckpt, mb=2, host=name)["error"]
    assert "ValueError" in err and os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-") in err
    assert "row_cache_mb" in err and "rows" in err
    assert "error" not in b.send(op="load", path=ckpt, mb=4, host=name)  # the same settings attach


# ---- RowCache(host=) in one process: two attachments are two users ------------------------------
@pytest.fixture
def shm_path():
    """A fresh path under /dev/shm for one test's cache file, removed after it whatever happens."""
    path = os.path.join(HOST_CACHE_DIR, f"engram-rows-test{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_two_attachments_share_rows_and_the_last_removes_the_file(shm_path):
    path = shm_path
    records = np.random.default_rng(0).integers(0, 256, (500, 24), dtype=np.uint8)
    a = RowCache(64, 24, host=path, identity="x:l1")
    b = RowCache(64, 24, host=path, identity="x:l1")
    np.testing.assert_array_equal(a.read([3, 4, 5], records), records[[3, 4, 5]])
    np.testing.assert_array_equal(b.read([5, 4, 3], records), records[[5, 4, 3]])
    assert b.stats()["hits"] == 3 and a.stats() == b.stats()
    assert a.nbytes == cache_nbytes(64, 24) and os.path.getsize(path) == a.nbytes
    del a
    assert os.path.exists(path)  # b still uses it
    del b
    assert not os.path.exists(path)


def test_a_forked_child_going_away_leaves_its_parents_file(shm_path):
    path = shm_path
    a = RowCache(16, 8, host=path, identity="x")
    pid = os.fork()
    if pid == 0:  # the child shares the parent's open file and its flock: dropping it detaches nothing
        del a
        os._exit(0 if os.path.exists(path) else 1)
    assert os.waitpid(pid, 0)[1] == 0 and os.path.exists(path)
    del a
    assert not os.path.exists(path)


def test_layout_and_identity_mismatches_are_refused_and_unused_files_replaced(shm_path):
    path = shm_path
    a = RowCache(64, 24, host=path, identity="x:l1")
    for nslots, rec, ident, what in [(65, 24, "x:l1", "rows"), (64, 32, "x:l1", "record bytes"),
                                     (64, 24, "y:l1", "identity")]:
        with pytest.raises(ValueError, match=what) as e:
            RowCache(nslots, rec, host=path, identity=ident)
        assert path in str(e.value) and "host_cache" in str(e.value)
    del a
    with open(path, "wb") as f:  # a file no process uses, not a cache: replaced
        f.write(b"not a row cache")
    c = RowCache(8, 8, host=path, identity="z")
    assert c.read([1], np.ones((2, 8), np.uint8)).tolist() == [[1] * 8]
    del c
    assert not os.path.exists(path)


def test_bad_host_cache_arguments(ckpt, shm_path):
    with pytest.raises(ValueError, match="host_cache"):
        EngramModel.load(ckpt, row_cache_mb=1, host_cache="a/b")
    with pytest.raises(ValueError, match="row_cache_mb"):
        EngramModel.load(ckpt, host_cache="fine")
    with pytest.raises(ValueError, match="totals"):
        RowCache(4, 8, totals=np.zeros(4, np.int64), host=shm_path)


def test_a_host_cache_too_small_for_one_row_is_refused(ckpt, host):
    """host_cache with a budget whose share leaves a layer no room for one row: refused at load,
    naming the value and the least budget that works (which then makes a cache of every layer)."""
    import re
    name, _ = host
    with pytest.raises(ValueError, match=r"row_cache_mb=1e-09 leaves layer \d+'s cache no room for one row") as e:
        EngramModel.load(ckpt, row_cache_mb=1e-9, host_cache=name)
    least = float(re.search(r">= ([0-9.e+-]+)", str(e.value)).group(1))
    m = EngramModel.load(ckpt, row_cache_mb=least, host_cache=name)
    assert all(m.tier.cache(L).nslots >= 1 for L in m.cfg.layer_ids)
    del m


def test_vllm_settings_take_host_cache():
    from engram_stream.integrations.serving import parse_settings
    assert parse_settings('{"row_cache_mb": 64, "host_cache": "vllm"}', "env")["host_cache"] == "vllm"
    assert parse_settings('{"row_cache_mb": 64}', "env")["host_cache"] is None
    for bad in ('{"row_cache_mb": 64, "host_cache": "a b"}', '{"host_cache": "vllm"}'):
        with pytest.raises(ValueError, match="host_cache"):
            parse_settings(bad, "env")


# ---- files nobody should trust: planted by another user, or garbage --------------------------------
def _a_real_cache_file(path, records, rows):
    """The bytes of a host cache file that holds `rows` (made at `path`, copied, then removed)."""
    a = RowCache(64, 24, host=path, identity="x:l1")
    a.read(rows, records)
    with open(path, "rb") as f:
        data = f.read()
    del a
    assert not os.path.exists(path)
    return data


def _plant(path, data, mode):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)  # past the umask
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["writable by all", "another user's", "a symlink"])
def test_a_planted_cache_file_is_refused_not_trusted(shm_path, how):
    """A file at a host cache's name that another local user could have written (or holds the
    lock of) is refused before it is locked or mapped, with the file, what was found and the fix."""
    if how == "another user's" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path, rng = shm_path, np.random.default_rng(7)
    theirs = rng.integers(0, 256, (500, 24), dtype=np.uint8)  # the planter's rows
    data = _a_real_cache_file(path, theirs, np.arange(40))
    target = path + ".target"
    try:
        if how == "writable by all":
            _plant(path, data, 0o666)
        elif how == "another user's":
            _plant(path, data, 0o600)
            os.chown(path, 65534, 65534)
        else:
            _plant(target, data, 0o600)
            os.symlink(target, path)
        ours = rng.integers(0, 256, (500, 24), dtype=np.uint8)
        with pytest.raises(PermissionError) as e:
            c = RowCache(64, 24, host=path, identity="x:l1")
            c.read(np.arange(40), ours)  # what a trusting process would serve: the planter's rows
        msg = str(e.value)
        assert path in msg and "host_cache" in msg and f"rm {path}" in msg
        assert ("symbolic link" in msg) if how == "a symlink" else ("mode 0o6" in msg and "uid" in msg)
        assert os.path.lexists(path)  # not ours to remove
    finally:
        for p in (path, target):
            if os.path.lexists(p):
                os.unlink(p)


CORRUPT = r'''
import os, sys, numpy as np
from engram_stream.rows._cache import RowCache

path, kind, alone = sys.argv[1], sys.argv[2], sys.argv[3] == "alone"
rng = np.random.default_rng(9)
records = rng.integers(0, 256, (5000, 24), dtype=np.uint8)
rows = rng.choice(5000, 40, replace=False)
a = RowCache(64, 24, host=path, identity="x:l1")
a.read(rows, records)
a.read(rows[:7], records)
st = a.stats()
with open(path, "rb") as f:
    data = bytearray(f.read())
head_bytes = int(np.frombuffer(data, np.int64, 1, 16)[0])  # where the index starts
# hand and used sit just before the counters: find hits and misses by the values stats() gives
words = np.frombuffer(bytes(data[:head_bytes]), np.int64)
at = next(i for i in range(20, len(words) - 1) if words[i] == st["hits"] and words[i + 1] == st["misses"])
hand, used = 8 * (at - 2), 8 * (at - 1)
entries = 128  # the index of 64 slots: a power of two >= 2 per slot
lock = bytes(data[160:hand])   # the mutex follows the identity, 160 bytes in: a free one's bytes
index = np.frombuffer(data, np.int64, entries, head_bytes).copy()
if kind == "index full":       # every entry names a slot that holds a row: no empty entry ends a probe
    index[:] = 1 + np.arange(entries) % 40
elif kind == "index garbage":  # entries naming slots far outside the region
    index[:] = rng.integers(-2**62, 2**62, entries)
elif kind == "hand and used":
    data[hand:hand + 8] = (2**40).to_bytes(8, "little", signed=True)
    data[used:used + 8] = (-5).to_bytes(8, "little", signed=True)
elif kind == "lock":           # the mutex's bytes, garbage
    data[160:hand] = b"\xff" * (hand - 160)
elif kind == "lock zeroed":    # a free lock, but neither process-shared nor robust: made afresh
    data[160:hand] = bytes(hand - 160)
data[head_bytes:head_bytes + 8 * entries] = index.tobytes()
if alone:   # a file no process uses: the last user gone, the garbage left for the next to find
    del a
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, bytes(data))
    os.close(fd)
    b = RowCache(64, 24, host=path, identity="x:l1")
else:       # garbage written into a file in use, between two holds of its lock
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(data[hand:used + 8]), hand)
    os.pwrite(fd, bytes(data[head_bytes:head_bytes + 8 * entries]), head_bytes)
    os.close(fd)
    b = RowCache(64, 24, host=path, identity="x:l1")
more = np.concatenate([rows, rng.choice(5000, 300)])
for _ in range(3):
    got = b.read(more, records)
    assert np.array_equal(got, records[more]), "wrong rows"
    assert 0 <= len(b) <= 64 and 0 <= b.stats()["rows_cached"] <= 64, (len(b), b.stats())
    assert set(b.rows().tolist()) <= set(more.tolist())
if alone:
    with open(path, "rb") as f:
        assert f.read(hand)[160:] == lock, "the lock was not made afresh"
print("ok", b.recoveries)
'''


# (not a garbage lock in a file in use: its users would have met it first)
@pytest.mark.parametrize("kind, alone", [(k, a) for k in ("index full", "index garbage", "hand and used", "lock")
                                         for a in ("alone", "in use") if (k, a) != ("lock", "in use")]
                         + [("lock zeroed", "alone")])
def test_a_corrupt_cache_file_gives_exact_rows_and_never_hangs(shm_path, tmp_path, kind, alone):
    """A file whose head is whole but whose index, CLOCK hand, slot count or lock is garbage
    (or zeroed: a lock that works in one process, whose waiters in another are never woken):
    every lookup ends (bounded probes, ranges checked), rows come back exact, and the garbage is
    dropped (the region rebuilt by a process that finds no other user in it, the rows forgotten
    under the lock by one that does). Run in a child: a hang fails the test, not CI."""
    script = tmp_path / "corrupt.py"
    script.write_text(CORRUPT)
    try:
        r = run_python([str(script), shm_path, kind, alone], timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{kind} ({alone}): the lookups did not end in 60 s") from None
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


# ---- two checkpoints, one host cache name --------------------------------------------------------
@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "in RAM"])
def test_checkpoints_differing_only_in_unsampled_rows_get_their_own_host_caches(ckpt, plain, host, tmp_path, mmap):
    import gc
    from engram_stream.rows.mooncake.keys import fingerprint
    name, _ = host
    tuned_path = fine_tuned_outside_samples(plain).save(str(tmp_path / "tuned.safetensors"))
    tuned = EngramModel.load(tuned_path)
    for L in CFG["layer_ids"]:   # what a sample of rows sees: the same
        assert fingerprint(tuned, L)["sample_digest"] == fingerprint(plain, L)["sample_digest"]
    L = CFG["layer_ids"][0]
    rows = np.arange(0, table_rows(plain, L), 7)
    assert not np.array_equal(plain.row_source(L).read(rows), tuned.row_source(L).read(rows))
    a = EngramModel.load(ckpt, mmap=mmap, row_cache_mb=8, host_cache=name)
    b = EngramModel.load(tuned_path, mmap=mmap, row_cache_mb=8, host_cache=name)
    np.testing.assert_array_equal(a.row_source(L).read(rows), plain.row_source(L).read(rows))
    np.testing.assert_array_equal(b.row_source(L).read(rows), tuned.row_source(L).read(rows))
    assert b.row_cache_stats()["hits"] == 0  # nothing of a's is b's
    rng = np.random.default_rng(11)
    T = 12
    ids = ((rng.zipf(1.3, (T, S)) + 3) % CFG["vocab_size"]).astype(np.int64)
    hid = rng.standard_normal((T, S, CFG["hc_mult"], CFG["hidden_size"]), dtype=np.float32)
    for served, model in ((a, plain), (b, tuned)):
        got, want = plain_decode(served, ids, hid), plain_decode(model, ids, hid)
        for layer in CFG["layer_ids"]:
            np.testing.assert_array_equal(got[layer], want[layer])
    files = glob.glob(os.path.join(HOST_CACHE_DIR, f"engram-rows-{name}-*"))
    assert len(files) == 2 * len(CFG["layer_ids"])
    del a, b
    gc.collect()
