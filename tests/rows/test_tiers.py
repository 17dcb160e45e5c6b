"""Tiered rows: the RAM row cache in front of a local file, and the Mooncake Store tier.

Every path is held to the plain engine on the local file, bit for bit (the plain engine is
itself tested against the numpy oracle). Mooncake tests run a real mooncake_master and store
server on loopback ports (marked `mooncake`, skipped when the extra is not installed).
"""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.cli import main
from engram_stream.errors import TierError

from helpers.mooncake import publish_when_back
from helpers.network import LOOPBACK_ONLY

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

CFG = dict(hidden_size=64, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
           engram_vocab_size=[211, 223], layer_ids=[1, 3], vocab_size=500, kernel_size=3)
S = 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One small model saved with each table dtype: {dtype: path}."""
    d = tmp_path_factory.mktemp("tiers")
    model = EngramModel.init(EngramConfig(**CFG), seed=1)
    out = {}
    for dt in ("float32", "float16", "int8"):
        out[dt] = str(d / f"m_{dt}.safetensors")
        model.save(out[dt], table_dtype=dt)
    return out


def tokens(T, seed, shared=False):
    """Zipf-ish ids [T, S] (repeats make cache hits; `shared`: every stream the same id, so a
    step's batch repeats every row S times)."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.3, (T, S)) + 3) % CFG["vocab_size"]
    if shared:
        ids[:] = ids[:, :1]
    return ids.astype(np.int64)


def hiddens(T, seed):
    rng = np.random.default_rng(seed + 100)
    return rng.standard_normal((T, S, CFG["hc_mult"], CFG["hidden_size"]), dtype=np.float32)


def decode(model, ids, hid, prompt=None):
    """A decoder run: an optional prompt prefilled on stream 1 of every layer, then steps of
    every stream. Returns {layer: [outputs...]}."""
    dec = model.decoder(n_streams=S)
    outs = {L: [] for L in model.cfg.layer_ids}
    if prompt is not None:
        p_ids, p_hid = prompt
        for L, y in dec.prefill(p_ids, {L: p_hid for L in outs}, stream=1).items():
            outs[L].append(y)
    for t in range(len(ids)):
        dec.begin(ids[t])
        for L in outs:
            outs[L].append(dec.layer(L, hid[t]).copy())
    return outs


def assert_identical(got, want):
    for L in want:
        assert len(got[L]) == len(want[L])
        for a, b in zip(got[L], want[L]):
            np.testing.assert_array_equal(a, b)  # bit for bit, not within a tolerance


def prompt(T=150, seed=7):  # > PREFILL_CHUNK: two chunks
    rng = np.random.default_rng(seed)
    return ((rng.zipf(1.3, T) + 3) % CFG["vocab_size"]).astype(np.int64), \
        rng.standard_normal((T, CFG["hc_mult"], CFG["hidden_size"]), dtype=np.float32)


# ---- the RAM row cache in front of the local file ---------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("mb", [0.002, 0.05])
def test_local_row_cache_is_exact(ckpts, dtype, mb):
    ids, hid = tokens(60, 0), hiddens(60, 0)
    want = decode(EngramModel.load(ckpts[dtype]), ids, hid, prompt())
    cached = EngramModel.load(ckpts[dtype], row_cache_mb=mb)
    got = decode(cached, ids, hid, prompt())
    assert_identical(got, want)
    s = cached.row_cache_stats()
    H = cached.cfg.n_heads
    reads = (60 * S + 150) * H * len(CFG["layer_ids"])
    assert s["hits"] + s["misses"] == reads and s["hits"] > 0 and s["misses"] > 0
    assert s["bytes_fetched"] > 0 and s["rows_cached"] <= s["capacity_rows"]
    assert s["cache_bytes"] <= mb * 2**20
    if mb == 0.002:
        assert s["evictions"] > 0
    assert sorted(s["layers"]) == CFG["layer_ids"]


def test_engine_without_cache_reports_zeros(ckpts):
    model = EngramModel.load(ckpts["float32"])
    decode(model, tokens(3, 0), hiddens(3, 0))
    s = model.row_cache_stats()
    assert s["hits"] == s["misses"] == s["bytes_fetched"] == s["evictions"] == 0


def test_bad_tier_arguments(ckpts):
    with pytest.raises(ValueError, match="row_cache_mb"):
        EngramModel.load(ckpts["float32"], row_cache_mb=-1)
    with pytest.raises(TypeError, match="MooncakeTier"):
        EngramModel.load(ckpts["float32"], tables="127.0.0.1:50051")


@pytest.mark.parametrize("mb", [float("nan"), float("inf"), -float("inf"), "64", True])
def test_row_cache_mb_must_be_a_finite_number(ckpts, mb):
    with pytest.raises(ValueError, match="row_cache_mb"):
        EngramModel.load(ckpts["float32"], row_cache_mb=mb)


@pytest.mark.parametrize("mb", [1e308, 10 ** 400, 2 ** 43 + 1, float("nan")])
def test_row_cache_mb_past_its_range_is_a_value_error_naming_it(ckpts, mb):
    """Finite but past any size (1e308 MiB overflowed into a bare OverflowError) or an int past
    float's range: the same ValueError, with the argument, the value and the range."""
    with pytest.raises(ValueError, match=r"row_cache_mb must be a finite number of MiB from 0 \(no row cache\) "
                                         r"to 2\*\*43, got "):
        EngramModel.load(ckpts["float32"], row_cache_mb=mb)
    whole = EngramModel.load(ckpts["float32"], row_cache_mb=2 ** 43).row_cache_stats()   # the largest: every row
    assert whole["budget_bytes"] == whole["budget_cap_bytes"]


def test_row_cache_mb_takes_numpy_numbers(ckpts):
    want = EngramModel.load(ckpts["float32"], row_cache_mb=64).row_cache_stats()["budget_bytes"]
    for mb in (np.int64(64), np.float32(64), np.uint16(64)):
        assert EngramModel.load(ckpts["float32"], row_cache_mb=mb).row_cache_stats()["budget_bytes"] == want
    with pytest.raises(ValueError, match="row_cache_mb"):
        EngramModel.load(ckpts["float32"], row_cache_mb=np.bool_(True))


def test_engines_made_on_several_threads_share_one_cache(ckpts):
    """CachedTier.cache() makes a layer's cache once, however many threads ask at the same time."""
    import sys
    import threading
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race, if any, shows in a few rounds
    try:
        for _ in range(30):
            model = EngramModel.load(ckpts["float32"], row_cache_mb=0.05)
            go, got = threading.Barrier(6), []

            def make():
                go.wait()
                got.append(model.tier.cache(CFG["layer_ids"][0]))
            ts = [threading.Thread(target=make) for _ in range(6)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert len(got) == 6 and all(c is got[0] for c in got)
    finally:
        sys.setswitchinterval(switch)


def test_row_cache_budget_is_capped_at_the_tables(ckpts):
    """A budget past the tables' bytes (1e6 MB: a MemoryError at stream()) caches them whole."""
    from engram_stream.rows._cache import cache_nbytes
    model = EngramModel.load(ckpts["int8"], row_cache_mb=1e6)
    tables = sum(model.layer(L).table.nbytes + model.layer(L).table_scale.nbytes for L in CFG["layer_ids"])
    whole = sum(cache_nbytes(model.plan.table_rows[L], CFG["n_embed_per_ngram"] // CFG["n_head_per_ngram"] + 4)
                for L in CFG["layer_ids"])   # an int8 row record: its bytes and a float32 scale
    assert model.row_cache_stats()["budget_bytes"] == whole < 1e6 * 2 ** 20
    ids, hid = tokens(20, 3), hiddens(20, 3)
    assert_identical(decode(model, ids, hid), decode(EngramModel.load(ckpts["int8"]), ids, hid))
    assert model.row_cache_stats()["evictions"] == 0
    engines = [model.stream(L) for L in CFG["layer_ids"]]   # live: their caches count in the stats
    s = model.row_cache_stats()
    assert 0 < s["cache_bytes"] <= whole and s["capacity_rows"] > 0
    del engines


def test_with_weight_dtype_keeps_the_row_cache(ckpts):
    """A bf16 copy of a cached model reads through a cache of the same budget (it was bypassed)."""
    model = EngramModel.load(ckpts["float32"], row_cache_mb=0.05)
    bf = model.with_weight_dtype("bfloat16")
    ids, hid = tokens(30, 4), hiddens(30, 4)
    got = decode(bf, ids, hid)
    s = bf.row_cache_stats()
    assert s["budget_bytes"] == model.row_cache_stats()["budget_bytes"] > 0
    assert s["hits"] > 0 and s["hits"] + s["misses"] == 30 * S * bf.cfg.n_heads * len(CFG["layer_ids"])
    assert_identical(got, decode(EngramModel.load(ckpts["float32"]).with_weight_dtype("bfloat16"), ids, hid))


# ---- Mooncake ----------------------------------------------------------------------------------
@pytest.mark.mooncake
@pytest.mark.skipif(not LOOPBACK_ONLY, reason="needs CAP_SYS_ADMIN for a network namespace (CI runs as root)")
def test_mooncake_servers_are_reachable_on_loopback_only(tier, mooncake):
    """Mooncake binds some ports on 0.0.0.0 despite its host flags; the session runs in its own
    network namespace (tests/helpers/network.py), so loopback is the only interface any
    of those sockets is on, and the servers answer there."""
    import socket
    assert [name for _, name in socket.if_nameindex()] == ["lo"]
    pids = {mooncake.master_proc.pid, mooncake.store_proc.pid}
    ours = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.islink(f"/proc/{pid}/fd/{fd}") else ""
            if target.startswith("socket:["):
                ours.add(target[8:-1])
    wildcard = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # this namespace's sockets
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in ours and set(cols[1].split(":")[0]) == {"0"}:
                    wildcard.append(int(cols[1].split(":")[1], 16))
    assert wildcard, "no wildcard listener found: Mooncake may bind loopback by itself now (drop the namespace)"
    for port in wildcard:  # each one answers on 127.0.0.1, the only address it can have here
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


@pytest.mark.mooncake
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("mb", [0, 0.01])
def test_remote_decode_is_bit_identical_to_the_local_file(tier, ckpts, dtype, mb):
    tier.publish(EngramModel.load(ckpts[dtype]))
    for shared in (False, True):
        ids, hid = tokens(40, 1, shared), hiddens(40, 1)
        want = decode(EngramModel.load(ckpts[dtype]), ids, hid, prompt())
        remote = EngramModel.load(ckpts[dtype], tables=tier, row_cache_mb=mb)
        got = decode(remote, ids, hid, prompt())
        assert_identical(got, want)
        s = remote.row_cache_stats()
        assert s["fetches"] > 0 and s["rows_read"] > 0 and (s["capacity_rows"] > 0) == (mb > 0)
        if mb:
            assert s["misses"] > 0 and s["hits"] > 0 and s["bytes_fetched"] > 0
            assert s["rows_read"] == s["misses"]   # a miss is a row read, whatever the cache holds
        else:  # no cache: no cache counters, as for every source
            assert s["misses"] == s["hits"] == s["bytes_fetched"] == 0
        if shared:  # S copies of every row in a step's batch: fetched once
            H, R = remote.cfg.n_heads, s["bytes_fetched"] // tier.rows(remote, 1).recbytes
            assert R <= (40 + 150) * H * len(CFG["layer_ids"])


@pytest.mark.mooncake
def test_rows_published_by_engramstore_read_the_same(bare_tier, ckpts, mooncake):
    """Mooncake's own EngramStore (0.3.13: float32 [N_h, dim] per head) and our tier share the layout."""
    from mooncake.store import EngramStore, EngramStoreConfig
    a = EngramModel.load(ckpts["float32"])
    b = EngramModel.init(EngramConfig(**CFG), seed=5)
    bare_tier.publish(a)
    for L in CFG["layer_ids"]:  # ours -> EngramStore.lookup
        conf = EngramStoreConfig()
        conf.embedding_dim = a.cfg.head_dim
        conf.table_vocab_sizes = [int(p) for p in a.plan.head_primes[L]]
        es = EngramStore(L, conf, bare_tier.store)
        assert es.get_store_keys() == [f"engram:l{L}:h{h}" for h in range(a.cfg.n_heads)]
        rows = np.random.default_rng(L).integers(0, min(conf.table_vocab_sizes), (2, 5, a.cfg.n_heads))
        got = es.lookup(rows)
        want = a.layer(L).table[rows + a.layer(L).offsets]
        np.testing.assert_array_equal(got, want)
        # EngramStore -> ours: b's table written by populate, read through the tier
        es.remove_from_store(True)
        es.populate([np.ascontiguousarray(b.layer(L).table[o:o + p])
                     for o, p in zip(b.layer(L).offsets, conf.table_vocab_sizes)])
    ids, hid = tokens(20, 2), hiddens(20, 2)
    path = ckpts["float32"] + ".b.safetensors"
    b.save(path)
    # a's fingerprints (their digest of a's tables) are beside b's rows: refused until adopted
    with pytest.raises(TierError, match="another model's rows"):
        EngramModel.load(path, tables=bare_tier)
    with pytest.raises(TierError, match=f"engram:l{CFG['layer_ids'][0]}:h0: head row 0 differs from this model's"):
        bare_tier.adopt(a)   # every row compared: b's rows are not a's
    assert bare_tier.adopt(EngramModel.load(path)) == ""
    assert_identical(decode(EngramModel.load(path, tables=bare_tier), ids, hid), decode(b, ids, hid))


@pytest.mark.mooncake
def test_with_weight_dtype_keeps_the_remote_source(tier, ckpts):
    """A bf16 copy of a model whose rows come from the store still reads them from the store
    (it read the local table instead)."""
    tier.publish(EngramModel.load(ckpts["float16"]))
    remote = EngramModel.load(ckpts["float16"], tables=tier, row_cache_mb=0.01)
    bf = remote.with_weight_dtype("bfloat16")
    ids, hid = tokens(12, 5), hiddens(12, 5)
    got = decode(bf, ids, hid)
    s = bf.row_cache_stats()
    assert s["fetches"] > 0 and s["bytes_fetched"] > 0 and bf.tier.tier is tier
    assert_identical(got, decode(EngramModel.load(ckpts["float16"]).with_weight_dtype("bfloat16"), ids, hid))


@pytest.mark.mooncake
def test_unpublished_or_mismatched_tables_are_refused(tier, bare_tier, ckpts):
    from engram_stream.rows import TierError
    other = EngramConfig(**dict(CFG, layer_ids=[7]))
    path = ckpts["float32"] + ".l7.safetensors"
    EngramModel.init(other, seed=0).save(path)
    with pytest.raises(TierError, match=r"engram:m[0-9a-f]{32}:l7:h0"):
        EngramModel.load(path, tables=tier)
    bare_tier.publish(EngramModel.load(ckpts["float16"]))  # one name for both: the sizes differ
    with pytest.raises(TierError, match="another table dtype"):
        EngramModel.load(ckpts["float32"], tables=bare_tier)


@pytest.mark.mooncake
def test_cli_publish(tier, ckpts, mooncake, capsys):
    assert main(["publish", ckpts["int8"], "--master", mooncake.master, "--metadata", mooncake.metadata]) == 0
    assert "published 2 layers" in capsys.readouterr().out
    EngramModel.load(ckpts["int8"], tables=tier)  # every object there with its size
    assert main(["publish", ckpts["int8"], "--master", "127.0.0.1:1", "--metadata", mooncake.metadata,
                 "--connect-timeout", "0.5"]) == 1
    assert "does not accept connections" in capsys.readouterr().err


# ---- faults: a store of our own, killed and restarted -------------------------------------------

def _state(dec):
    return {L: (e.tokens_seen.copy(), e.snapshot()) for L, e in dec.engines.items()}


def _same_state(a, b):
    for L in a:
        np.testing.assert_array_equal(a[L][0], b[L][0])
        for k in ("hist", "ring", "pos", "seen"):
            np.testing.assert_array_equal(getattr(a[L][1], k), getattr(b[L][1], k))


@pytest.mark.mooncake
@pytest.mark.parametrize("fault", ["kill_master", "stop_master", "kill_store"])
def test_dead_store_raises_in_bounded_time_then_works_again(own_store, ckpts, fault):
    from engram_stream.rows import TierError
    mc, tier = own_store
    local = EngramModel.load(ckpts["float32"])
    tier.publish(local)
    remote = EngramModel.load(ckpts["float32"], tables=tier)
    ids, hid = tokens(30, 3), hiddens(30, 3)
    want = decode(local, ids, hid)[1]
    dec = remote.decoder(n_streams=S)
    got = []
    for t in range(10):
        dec.begin(ids[t])
        got.append(dec.layer(1, hid[t]).copy())
        dec.layer(3, hid[t])
    before = _state(dec)
    if fault == "kill_master":
        mc.kill_master()
    elif fault == "stop_master":  # alive but silent: only the timeout ends the wait
        os.kill(mc.master_proc.pid, signal.SIGSTOP)
    else:
        mc.kill_store()
    t0 = time.monotonic()
    with pytest.raises(TierError):  # the reads start at begin; a layer waiting for its rows gets the error
        dec.begin(ids[10])
        dec.layer(1, hid[10])
    assert time.monotonic() - t0 < tier.timeout + 3
    assert dec.pending() == []
    _same_state(before, _state(dec))  # the refused token changed nothing
    # the store comes back (empty: the master held the objects' metadata); publish again
    if fault == "stop_master":
        os.kill(mc.master_proc.pid, signal.SIGCONT)
    elif fault == "kill_master":
        mc.start_master()
    else:
        mc.start_store()
    publish_when_back(tier, local, 20)
    for t in range(10, 30):
        dec.begin(ids[t])
        got.append(dec.layer(1, hid[t]).copy())
        dec.layer(3, hid[t])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


_ALLOC = """
import json, os, sys, tempfile
import numpy as np, memray
from engram_stream import EngramConfig, EngramModel
cfg = EngramConfig(hidden_size=160, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
                   engram_vocab_size=[211, 223], layer_ids=[1], vocab_size=500, kernel_size=3)
d = tempfile.mkdtemp()
EngramModel.init(cfg, seed=0).save(os.path.join(d, "m.safetensors"))
model = EngramModel.load(os.path.join(d, "m.safetensors"), row_cache_mb=0.005)   # evicts all along
eng = model.stream(1)
rng = np.random.default_rng(0)
toks = [int(x) for x in rng.integers(0, 500, 2000)]
h = rng.standard_normal((2, 160)).astype(np.float32)
out = np.empty_like(h)
for t in toks[:10]:
    eng.step(t, h, out=out)
res = {}
for mode in ("out", "no_out"):
    fn = os.path.join(d, mode + ".bin")
    with memray.Tracker(fn):
        for t in toks:
            if mode == "out":
                eng.step(t, h, out=out)
            else:
                eng.step(t, h)
    frees = {memray.AllocatorType.FREE, memray.AllocatorType.MUNMAP}
    recs = [r for r in memray.FileReader(fn).get_allocation_records()
            if memray.AllocatorType(r.allocator) not in frees]
    res[mode] = len(recs)
res["evictions"] = model.row_cache_stats()["evictions"]
print(json.dumps(res))
"""


def test_cached_step_allocates_nothing():
    """Through a row cache that evicts on most steps, 2000 steps with out= make no native
    allocation (memray.Tracker in a subprocess); without out= every step's output shows up."""
    pytest.importorskip("memray")
    from helpers.processes import run_python
    r = run_python(["-c", _ALLOC], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["evictions"] > 1000, res
    assert res["out"] <= 2, res
    assert res["no_out"] >= 2000, res
