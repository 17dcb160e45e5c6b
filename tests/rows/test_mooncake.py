"""The Mooncake tier beyond decoding: V4.1's EngramStore byte rows (both directions against the
installed EngramStore), refusing another model's rows, bounded connects, prompt exit after a
fault, calls after close(). Real servers (LocalMooncake), marked `mooncake`."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.errors import TierError
from engram_stream.rows.mooncake.calls import EXIT_GRACE
from engram_stream.v41 import hf as hf_v41

from helpers.models import fine_tuned_outside_samples
from helpers.mooncake import mooncake_or_skip

pytestmark = pytest.mark.mooncake

V41 = dict(variant="deepseek-v4.1", engram_vocab_size=[211] * 3, max_ngram_size=4, n_embed_per_ngram=512,
           n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, hidden_size=64, hc_mult=2, vocab_size=300,
           image_token_id=299)  # head_dim 256: the real 264-byte record
DEMO = dict(hidden_size=64, hc_mult=2, n_embed_per_ngram=32, n_head_per_ngram=2, max_ngram_size=3,
            engram_vocab_size=[211, 223], layer_ids=[1, 3], vocab_size=500, kernel_size=3)


@pytest.fixture(scope="module")
def v41_models(tmp_path_factory):
    """Two V4.1 checkpoints of one config, different weights: {name: folder}."""
    d = tmp_path_factory.mktemp("mc_v41")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        out[name] = str(d / name)
        hf_v41.make_synthetic(out[name], EngramConfig(**V41), seed=seed, n_shards=2)
    return out


def records(model, L, h):
    """Head h's records built here from the weights: e4m3 row bytes then e8m0 scale bytes."""
    w = model.layer(L)
    lo, n = int(w.offsets[h]), int(model.plan.head_primes[L][h])
    return np.concatenate([w.embed_weight[lo:lo + n], w.embed_scale[lo:lo + n]], axis=1)


def read_rows(tier, model, L, rows):
    """Absolute rows of layer L read through the tier's batched reader (records, in order)."""
    from engram_stream.rows.mooncake.tier import RemoteRows
    r = RemoteRows(tier, model, L)
    u, inv = np.unique(rows, return_inverse=True)
    got = r.fetch(u)[:, :r.recbytes][inv].copy()
    r.close()
    return got


def test_v41_publish_writes_engramstore_byte_rows(bare_tier, v41_models):
    """264-byte rows (256 e4m3 + 8 e8m0), one object per head, read back by Mooncake's own
    EngramStore; and rows EngramStore populates are read by the tier. The installed EngramStore
    (0.3.13) predates #4065's `row_bytes`: its float32 rows of 66 values are the same 264 bytes."""
    from mooncake.store import EngramStore, EngramStoreConfig
    a = EngramModel.from_deepseek_v41(v41_models["a"])
    b = EngramModel.from_deepseek_v41(v41_models["b"])
    bare_tier.publish(a)
    rng = np.random.default_rng(0)
    for L in V41["layer_ids"]:
        heads = [int(p) for p in a.plan.head_primes[L]]
        for h in range(len(heads)):
            assert bare_tier.store.get_size(f"engram:l{L}:h{h}") == heads[h] * 264
        conf = EngramStoreConfig()
        conf.embedding_dim = 264 // 4
        conf.table_vocab_sizes = heads
        es = EngramStore(L, conf, bare_tier.store)
        assert es.get_store_keys() == [f"engram:l{L}:h{h}" for h in range(len(heads))]
        rows = rng.integers(0, min(heads), (3, 5, len(heads)))
        got = es.lookup(rows).view(np.uint8)             # ours -> EngramStore
        for h in range(len(heads)):
            np.testing.assert_array_equal(got[:, :, h], records(a, L, h)[rows[:, :, h]])
        es.remove_from_store(True)                       # EngramStore -> ours: b's rows
        es.populate([np.ascontiguousarray(records(b, L, h)).view(np.float32) for h in range(len(heads))])
        absolute = rng.integers(0, b.plan.table_rows[L], 200)
        want = np.concatenate([b.layer(L).embed_weight, b.layer(L).embed_scale], axis=1)[absolute]
        np.testing.assert_array_equal(read_rows(bare_tier, b, L, absolute), want)
    # a's fingerprints (and their digests of a's tables) are still there, the rows are b's: both refused
    with pytest.raises(TierError, match="tables whose digest is .*, this model's tables digest to"):
        bare_tier.check_published(b)
    with pytest.raises(TierError, match="row .* differs from this model's"):
        bare_tier.check_published(a)


def test_v41_small_heads_keep_their_e8m0_scale_bytes(bare_tier, tmp_path):
    """head_dim 32: 32 e4m3 bytes + 1 e8m0 byte a row (not a float32 scale)."""
    d = tmp_path / "tiny"
    hf_v41.make_synthetic(d, EngramConfig(**dict(V41, n_embed_per_ngram=64, layer_ids=[7])), seed=3)
    m = EngramModel.from_deepseek_v41(d)
    bare_tier.publish(m)
    for h in range(m.cfg.n_heads):
        n = int(m.plan.head_primes[7][h])
        assert bare_tier.store.get_size(f"engram:l7:h{h}") == n * 33
        np.testing.assert_array_equal(np.frombuffer(bare_tier.store.get(f"engram:l7:h{h}"), np.uint8).reshape(n, 33),
                                      records(m, 7, h))
    fp = bare_tier.published(7)
    assert (fp["rowbytes"], fp["scalebytes"], fp["variant"]) == (32, 1, "deepseek-v4.1")


def test_another_models_rows_are_refused(bare_tier, tmp_path):
    """Model B of the same config as the published model A: refused at load, whatever the sizes say."""
    cfg = EngramConfig(**DEMO)
    pa, pb = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    EngramModel.init(cfg, seed=1).save(pa)
    EngramModel.init(cfg, seed=2).save(pb)
    bare_tier.publish(EngramModel.load(pa))
    EngramModel.load(pa, tables=bare_tier)  # its own rows: fine
    with pytest.raises(TierError, match="another model's rows"):
        EngramModel.load(pb, tables=bare_tier)
    fp = bare_tier.published(1)
    assert fp["heads"] == [int(p) for p in EngramModel.load(pa).plan.head_primes[1]] and fp["scalebytes"] == 0
    # a fingerprint of another layout is named as such
    bare_tier.store.upsert("engram:l1:fingerprint", json.dumps(dict(fp, rowbytes=3)).encode())
    with pytest.raises(TierError, match="in rowbytes"):
        bare_tier.check_published(EngramModel.load(pa))
    bare_tier.publish(EngramModel.load(pa))


def test_calls_after_close_raise_tier_error(mooncake, tmp_path):
    from mooncake_servers import wait_until_writable
    from engram_stream.rows import MooncakeTier
    t = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, timeout=5)
    wait_until_writable(t)
    p = str(tmp_path / "m.safetensors")
    EngramModel.init(EngramConfig(**DEMO), seed=1).save(p)
    m = EngramModel.load(p)
    t.publish(m)
    remote = EngramModel.load(p, tables=t)
    dec = remote.decoder()
    dec.begin(5)
    reader = t.rows(m, 1)
    t.close()
    t.close()  # twice: nothing
    assert t.closed
    for call in (lambda: t.publish(m), lambda: t.check_published(m), lambda: t.rows(m, 1),
                 lambda: reader.fetch(np.array([1, 2])), lambda: t.published(1),
                 lambda: EngramModel.load(p, tables=t)):
        with pytest.raises(TierError, match="closed"):
            call()
    for L in m.cfg.layer_ids:
        dec.layer(L, np.zeros((DEMO["hc_mult"], DEMO["hidden_size"]), np.float32))
    with pytest.raises(TierError, match="closed"):
        dec.begin(7)
        dec.layer(m.cfg.layer_ids[0], np.zeros((DEMO["hc_mult"], DEMO["hidden_size"]), np.float32))


def test_stopped_master_at_connect_is_refused_in_time():
    """A stopped master accepts connections (the kernel does) but never answers: TierError
    within connect_timeout, not a hang in setup()."""
    mooncake_or_skip()
    from mooncake_servers import LocalMooncake
    from engram_stream.rows import MooncakeTier
    with LocalMooncake(segment_mb=16) as mc:
        os.kill(mc.master_proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TierError, match="does not answer"):
                MooncakeTier(master=mc.master, metadata=mc.metadata, timeout=3, connect_timeout=3)
            assert time.monotonic() - t0 < 3 + 2
        finally:
            os.kill(mc.master_proc.pid, signal.SIGCONT)


_CLIENT = """
import sys, time, numpy as np
from engram_stream import EngramModel
from engram_stream.rows import MooncakeTier, TierError
from mooncake_servers import wait_until_writable
master, metadata, path = sys.argv[1:4]
t = MooncakeTier(master=master, metadata=metadata, timeout=3)
wait_until_writable(t)
t.publish(EngramModel.load(path))
model = EngramModel.load(path, tables=t)
dec = model.decoder()
dec.begin(5)
for L in model.cfg.layer_ids:
    dec.layer(L, np.zeros((model.cfg.hc_mult, model.cfg.hidden_size), np.float32))
print("ready", flush=True)
sys.stdin.readline()          # the test breaks a server now
try:
    dec.begin(7)  # starts the reads; a layer waits for them
    for L in model.cfg.layer_ids:
        dec.layer(L, np.zeros((model.cfg.hc_mult, model.cfg.hidden_size), np.float32))
    print("no error", flush=True)
except TierError as e:
    print("TierError", flush=True)
print("exiting", time.monotonic(), flush=True)
sys.exit(3)                   # the status the process must end with
"""


@pytest.mark.parametrize("fault", ["stop_master", "kill_master", "stop_store", "kill_store", "kill_store"])
def test_process_exits_promptly_after_a_fault(tmp_path, fault):
    """After a TierError from a dead or stopped server, the process exits, with its own status:
    no abort in Mooncake's teardown ("terminate called without an active exception", 134), which
    a killed store server's client hit in about 1 of 3 runs (kill_store runs twice)."""
    import subprocess
    mooncake_or_skip()
    from mooncake_servers import LocalMooncake
    p = str(tmp_path / "m.safetensors")
    EngramModel.init(EngramConfig(**DEMO), seed=1).save(p)
    with LocalMooncake(segment_mb=16) as mc:
        proc = subprocess.Popen([sys.executable, "-c", _CLIENT, mc.master, mc.metadata, p], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        try:
            assert proc.stdout.readline().strip() == "ready"
            if fault == "stop_master":
                os.kill(mc.master_proc.pid, signal.SIGSTOP)
            elif fault == "kill_master":
                mc.kill_master()
            elif fault == "kill_store":
                mc.kill_store()
            else:
                os.kill(mc.store_proc.pid, signal.SIGSTOP)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "TierError"
            assert proc.stdout.readline().startswith("exiting")
            t0 = time.monotonic()
            err = proc.communicate(timeout=30)[1]
            # a call that never ends (a stopped server) costs the exit its bound and EXIT_GRACE
            assert time.monotonic() - t0 < 3 + EXIT_GRACE + 2
            assert proc.returncode == 3 and "terminate called" not in err, (proc.returncode, err[-2000:])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for p_ in (mc.master_proc, mc.store_proc):
                if p_ is not None and p_.poll() is None:
                    os.kill(p_.pid, signal.SIGCONT)


def test_two_models_share_one_store_under_their_names(tier, v41_models, mooncake):
    """Two models of one config (or two revisions of one model) published to one store: each
    keeps its own keys (the default name: its fingerprint), each decodes its own rows exactly."""
    from engram_stream.rows import MooncakeTier
    from engram_stream.rows.identity import model_name
    from engram_stream.rows.mooncake.keys import store_key
    a, b = (EngramModel.from_deepseek_v41(v41_models[k]) for k in ("a", "b"))
    assert model_name(a) != model_name(b) and model_name(a) == model_name(EngramModel.from_deepseek_v41(v41_models["a"]))
    tier.publish(a)
    tier.publish(b)  # does not replace a's rows
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 299, 30)
    hid = rng.standard_normal((30, V41["hc_mult"], V41["hidden_size"]), dtype=np.float32)
    for m, folder in ((a, v41_models["a"]), (b, v41_models["b"])):
        assert tier.store.get_size(store_key(1, 0, model_name(m))) == int(m.plan.head_primes[1][0]) * 264
        remote = EngramModel.from_deepseek_v41(folder, tables=tier, row_cache_mb=0.01)
        want = m.decoder().prefill(ids, {L: hid for L in m.cfg.layer_ids})
        got = remote.decoder().prefill(ids, {L: hid for L in m.cfg.layer_ids})
        for L in want:
            np.testing.assert_array_equal(got[L], want[L])
    named = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, timeout=5, name="rev-2")
    try:
        with pytest.raises(TierError, match="'rev-2'"):  # nothing under that name yet
            named.check_published(a)
        named.publish(a)
        assert named.name_of(b) == "rev-2" and named.store.get_size("engram:rev-2:l4:h1") > 0
        EngramModel.from_deepseek_v41(v41_models["a"], tables=named)
    finally:
        named.close()
    with pytest.raises(ValueError, match="name must be"):
        MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, name="a b")


_BEGIN_THEN_EXIT = """
import sys
from engram_stream import EngramModel
from engram_stream.rows import MooncakeTier
master, metadata, path = sys.argv[1:4]
tier = MooncakeTier(master=master, metadata=metadata, timeout=5)
model = EngramModel.load(path, tables=tier)
dec = model.decoder()
dec.begin(5)                  # every layer's read starts; the process ends before any layer waits
sys.exit(3)
"""


def test_a_process_that_exits_with_reads_in_flight_keeps_its_status(tmp_path, mooncake, tier):
    """Exiting between Decoder.begin() and layer() on tables=tier (no close()): the client is closed
    at exit after its reads end, so the process ends with its own status (it aborted in 7 of 8 runs)."""
    import subprocess
    p = str(tmp_path / "m.safetensors")
    EngramModel.init(EngramConfig(**DEMO), seed=3).save(p)
    tier.publish(EngramModel.load(p))
    for _ in range(4):
        r = subprocess.run([sys.executable, "-c", _BEGIN_THEN_EXIT, mooncake.master, mooncake.metadata, p],
                           capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert r.returncode == 3 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])


def test_publish_is_quiet_unless_asked(mooncake, tmp_path):
    """`publish` printed ~25 lines of the Mooncake client's INFO log: errors only by default,
    everything with MC_LOG_LEVEL=INFO."""
    import subprocess
    p = str(tmp_path / "m.safetensors")
    EngramModel.init(EngramConfig(**DEMO), seed=4).save(p)
    lines = {}
    for level in (None, "INFO"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        env.pop("MC_LOG_LEVEL", None)
        if level:
            env["MC_LOG_LEVEL"] = level
        r = subprocess.run([sys.executable, "-m", "engram_stream.cli", "publish", p, "--master", mooncake.master,
                            "--metadata", mooncake.metadata], capture_output=True, text=True, timeout=120,
                           cwd=str(tmp_path), env=env)
        assert r.returncode == 0 and "published 2 layers" in r.stdout, r.stderr
        lines[level] = [ln for ln in r.stderr.splitlines() if ln[:1] == "I"]
    assert lines[None] == [] and len(lines["INFO"]) > 5


def _cached_table_pages(model) -> int:
    """Pages of the model's mapped tables in the page cache (mincore), each array's first and
    last page left out: those it may share with the weights beside it, which load and the
    engines read."""
    from engram_stream.io import memory
    n = 0
    for L in model.cfg.layer_ids:
        for a in (model.layer(L).table, model.layer(L).table_scale):
            if a is None:
                continue
            assert memory.is_file_backed(a)
            first, length = memory._pages(a)
            if length // memory.PAGE > 2:
                n += int(memory._resident_pages(first + memory.PAGE, length // memory.PAGE - 2).sum())
    return n


@pytest.mark.parametrize("variant", ["demo", "v41"])
def test_a_remote_model_reads_nothing_of_its_local_tables(tier, tmp_path, variant):
    """tables=MooncakeTier: the identity check runs at load and reads its sampled rows by pread
    (no read-ahead, their pages dropped from the page cache again); stream(), the steps and a
    decoder read every row from the store. From a cold page cache, not one page of the local tables is cached
    after load, stream() and steps (the check read 100+ pages through the mapping, and a V4.1
    engine's first step ~750 through read-ahead from wkv into the table beside it)."""
    from engram_stream.io import memory
    if variant == "demo":
        cfg = EngramConfig(**dict(DEMO, engram_vocab_size=[20011, 20021]))   # ~1250 pages a table
        path, other = str(tmp_path / "m.safetensors"), str(tmp_path / "o.safetensors")
        EngramModel.init(cfg, seed=5).save(path)
        EngramModel.init(cfg, seed=6).save(other)
        load, files = EngramModel.load, [path]
    else:
        cfg = EngramConfig(**dict(V41, engram_vocab_size=[2003] * 3))            # ~800 pages a table
        path, other = str(tmp_path / "m"), str(tmp_path / "o")
        hf_v41.make_synthetic(path, cfg, seed=5, n_shards=2)
        hf_v41.make_synthetic(other, cfg, seed=6, n_shards=2)
        load = EngramModel.from_deepseek_v41
        files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    tier.publish(load(path, mmap=False))   # read into RAM: no mapping keeps the file's pages
    for f in files:
        memory.evict_file(f)
    if _cached_table_pages(load(path)):
        pytest.skip("posix_fadvise(DONTNEED) does not evict this file system's pages (tmpfs?)")
    model = load(path, tables=tier)
    assert _cached_table_pages(model) == 0
    rng = np.random.default_rng(0)
    for L in cfg.layer_ids:
        eng = model.stream(L)
        for tok in rng.integers(0, cfg.vocab_size - 1, 6).tolist():
            eng.step(tok, rng.standard_normal((cfg.hc_mult, cfg.hidden_size), dtype=np.float32))
    dec = model.decoder()   # its begin() asks each layer's source to prefetch
    for tok in rng.integers(0, cfg.vocab_size - 1, 3).tolist():
        dec.begin(tok)
        for L in cfg.layer_ids:
            dec.layer(L, rng.standard_normal((cfg.hc_mult, cfg.hidden_size), dtype=np.float32))
    assert _cached_table_pages(model) == 0
    assert model.row_cache_stats()["fetches"] > 0
    with pytest.raises(TierError, match="not published"):   # a store without this model's rows: refused by load
        load(other, tables=tier)


# ---- the tables' digest: two fine-tunes whose sampled rows agree ----------------------------------
@pytest.fixture
def fine_tunes(tmp_path):
    """(path of a demo model, path of its fine-tune differing in every row but the sampled ones)."""
    plain = EngramModel.init(EngramConfig(**DEMO), seed=21)
    pa, pb = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    plain.save(pa)
    fine_tuned_outside_samples(plain).save(pb)
    return pa, pb


def all_records(model, L):
    """Every row of a demo float32 table, and its records: the row's bytes (no scale)."""
    w = model.layer(L)
    assert w.table.dtype == np.float32 and w.table_scale is None
    return np.arange(w.table.shape[0]), np.ascontiguousarray(w.table).view(np.uint8)


def test_fine_tunes_differing_outside_the_samples_each_serve_their_own_rows(tier, fine_tunes):
    """Two fine-tunes whose tables differ only outside the sampled rows, published into one store
    under their default names: each gets its own keys (the name digests every table byte) and
    every row a model loading from the store reads is its own. (Named by sampled rows, the second
    publish replaced the first's rows and the first model served them.)"""
    from engram_stream.rows.identity import model_name
    from engram_stream.rows.mooncake.keys import fingerprint
    a, b = (EngramModel.load(p) for p in fine_tunes)
    for L in DEMO["layer_ids"]:
        assert fingerprint(a, L)["sample_digest"] == fingerprint(b, L)["sample_digest"]
    assert model_name(a) != model_name(b)
    tier.publish(a)
    tier.publish(b)
    for m, p in ((a, fine_tunes[0]), (b, fine_tunes[1])):
        remote = EngramModel.load(p, tables=tier)
        for L in DEMO["layer_ids"]:
            rows, want = all_records(m, L)
            np.testing.assert_array_equal(read_rows(tier, remote, L, rows), want)


def test_a_name_holding_other_tables_is_refused_naming_both_digests(mooncake, fine_tunes):
    """One name, two fine-tunes: the one that did not publish is refused at load, the error naming
    the store's digest and its own (the sampled rows agree: only the digest tells them apart)."""
    from mooncake_servers import wait_until_writable
    from engram_stream.rows import MooncakeTier
    from engram_stream.rows.identity import layer_digests
    a, b = (EngramModel.load(p) for p in fine_tunes)
    named = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, timeout=5, name="ft")
    try:
        wait_until_writable(named)
        named.publish(a)
        EngramModel.load(fine_tunes[0], tables=named)
        da, db = layer_digests(a), layer_digests(b)
        L = DEMO["layer_ids"][0]
        assert len(da[L]) == 64 and da[L] != db[L]
        with pytest.raises(TierError) as e:
            EngramModel.load(fine_tunes[1], tables=named)
        assert f"digest is {da[L]}, this model's tables digest to {db[L]}" in str(e.value), str(e.value)
        assert named.published(L, "ft")["tables_digest"] == da[L]
    finally:
        named.close()


def test_a_store_without_a_digest_of_its_tables_is_refused(tier, fine_tunes):
    """A fingerprint of format 1 (no tables_digest), or none at all (rows EngramStore.populate
    wrote): which tables the rows are from is unknown, and the load is refused."""
    from engram_stream.rows.identity import model_name
    from engram_stream.rows.mooncake.keys import fingerprint_key
    a = EngramModel.load(fine_tunes[0])
    tier.publish(a)
    L, name = DEMO["layer_ids"][1], model_name(a)
    fp = tier.published(L, name)
    old = {k: v for k, v in fp.items() if k != "tables_digest"}
    tier.store.upsert(fingerprint_key(L, name), json.dumps(dict(old, format=1)).encode())
    with pytest.raises(TierError, match="format 1, not 2, so no digest"):
        EngramModel.load(fine_tunes[0], tables=tier)
    assert tier.store.remove(fingerprint_key(L, name), True) == 0   # force: past the lease of the get before
    with pytest.raises(TierError, match="no fingerprint .*tier.publish"):
        EngramModel.load(fine_tunes[0], tables=tier)
    tier.publish(a)
    EngramModel.load(fine_tunes[0], tables=tier)


def test_the_tables_are_digested_once_a_host(tier, fine_tunes, tmp_path, monkeypatch):
    """A mapped checkpoint's digest is read once (at publish here) and cached under
    $XDG_CACHE_HOME, keyed by the file's stamps: loading from the store reads no table byte again;
    the file touched (another mtime and ctime) is read again; an unusable cache folder only costs
    the reading. Tables in RAM are read at every load."""
    from engram_stream.rows import identity
    from engram_stream.rows.identity import layer_digests
    reads = []
    real = identity.byte_chunks

    def counted(a, chunk):
        reads.append(a.nbytes)
        return real(a, chunk)

    monkeypatch.setattr(identity, "byte_chunks", counted)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = fine_tunes[0]
    model = EngramModel.load(path)
    tables = sum(model.layer(L).table.nbytes for L in DEMO["layer_ids"])   # float32: no scales
    tier.publish(model)
    assert sum(reads) == tables                       # publish read every table byte, once
    want = layer_digests(model)
    assert len(os.listdir(tmp_path / "xdg" / "engram_stream" / "tables")) == len(DEMO["layer_ids"])
    reads.clear()
    EngramModel.load(path, tables=tier)
    assert reads == []                                # the cached digests
    os.utime(path, ns=(time.time_ns(), time.time_ns()))
    assert layer_digests(EngramModel.load(path)) == want and sum(reads) == tables   # read again
    reads.clear()
    (tmp_path / "not a folder").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not a folder"))
    for _ in range(2):
        EngramModel.load(path, tables=tier)
    assert sum(reads) == 2 * tables                   # no cache: read at each load, loads still work
    reads.clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert layer_digests(EngramModel.load(path, mmap=False)) == want and sum(reads) == tables
