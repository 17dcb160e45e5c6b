"""What the row sources do beyond the contract (tests/contract/test_row_sources.py): the packed
row file read once per row, one cache shared by engines and threads, the stats, faults of the
files (a device error, a truncated file) and of a Mooncake Store refusing the call and leaving
every layer as it was (the same calls then continue exactly), warm(), prompts longer than a
submit window."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engram_stream import EngramModel
from engram_stream.errors import FileChangedError
from engram_stream.rows import packed
from engram_stream.rows.direct import DirectTier

from helpers.inputs import assert_decoded_identically as assert_identical, decode_inputs as inputs, decode_run as run
from helpers.inputs import variant_ids
from helpers.mooncake import publish_when_back
from helpers.row_sources import load_checkpoint as load

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang

@pytest.mark.parametrize("name", ["demo-int8", "v41-flash-rows"])
def test_packed_row_file_is_used_and_reads_once_per_row(row_checkpoints, name, tmp_path):
    import shutil
    src = row_checkpoints[name]
    path = str(tmp_path / os.path.basename(src))
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, path)
    want = run(load(path), 3)
    packed.pack_rows(load(path), packed.rows_path(path))
    model = load(path, tables="direct")
    assert model.tier.inner.rows_path == packed.rows_path(path)
    assert_identical(run(model, 3), want)
    st = model.row_cache_stats()
    assert st["reads"] <= st["rows_read"]  # one page per distinct row read (pages shared: fewer)
    cached = load(path, tables="direct", row_cache_mb=0.01)
    assert_identical(run(cached, 3), want)
    assert cached.row_cache_stats()["reads"] <= cached.row_cache_stats()["misses"]


def test_the_cache_is_shared_by_engines_and_threads(row_checkpoints):
    """Two decoders of one model on two threads read through the layer's one cache: both exact;
    the second decoder of the same ids hits what the first brought in."""
    path = row_checkpoints["v41"]
    want = run(load(path), 3, seed=1)
    model = load(path, tables="direct", row_cache_mb=64)
    assert_identical(run(model, 3, seed=1), want)
    before = model.row_cache_stats()
    assert_identical(run(model, 3, seed=1), want)
    after = model.row_cache_stats()
    assert after["misses"] == before["misses"] and after["hits"] > before["hits"]  # all hits the 2nd time
    assert after["reads"] == before["reads"]
    results, errors = {}, []

    def work(k):
        try:
            results[k] = run(model, 3, seed=10 + k % 2)
        except BaseException as e:  # pragma: no cover (the assertion below shows it)
            errors.append(e)
    wants = {s: run(load(path), 3, seed=10 + s) for s in (0, 1)}
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for k, got in results.items():
        assert_identical(got, wants[k % 2])
    st = model.row_cache_stats()
    assert st["capacity_rows"] and len(model.tier.caches) == len(model.cfg.layer_ids)


def test_stats_per_layer(row_checkpoints):
    model = load(row_checkpoints["v41"], tables="direct", row_cache_mb=0.004)
    run(model, 3)
    st = model.row_cache_stats()
    for k in ("hits", "misses", "evictions", "reads", "bytes_read", "read_wait_p50", "read_wait_p99"):
        assert k in st and all(k in st["layers"][L] for L in model.cfg.layer_ids), k
    assert st["reads"] == sum(st["layers"][L]["reads"] for L in model.cfg.layer_ids)
    assert 0 < st["read_wait_p50"] <= st["read_wait_p99"]
    assert st["reads"] * 33 <= st["bytes_read"] <= st["reads"] * 256 * 1024  # pages (the last one of a file short)


def _lookups(model, ids):
    """{layer: (lookups, distinct rows)} of ids read as one stream: the numpy hash is the oracle."""
    rows = model.plan.hash_numpy(np.asarray(ids)[None], layers=list(model.cfg.layer_ids))
    return {L: (r.size, np.unique(r[0] + model.plan.offsets[L]).size) for L, r in rows.items()}


@pytest.mark.parametrize("name", ["demo-int8", "v41-flash-rows"])
def test_stats_fields_mean_one_thing_across_sources_and_calls(row_checkpoints, name):
    """hits, misses and bytes_fetched count the same whichever source is behind the cache and
    however the ids arrive (warm's one long call, a prefill, token by token): a miss is a row
    read once, every other lookup (a repeat in the same call too) a hit."""
    from engram_stream.rows.tiers import LAYER_FIELDS, STATS_FIELDS
    path = row_checkpoints[name]
    ref = load(path)
    rng = np.random.default_rng(3)
    ids = np.tile(rng.integers(0, min(200, ref.cfg.vocab_size - 1), 40), 3)  # every row repeated, in and across calls
    want = _lookups(ref, ids)
    hid = rng.standard_normal((ids.size, ref.cfg.hc_mult, ref.cfg.hidden_size), dtype=np.float32)
    for tables in ("mapped", "direct"):
        for how in ("warm", "prefill", "steps"):
            model = load(path, tables=tables, row_cache_mb=64)
            if how == "warm":
                model.warm(ids)
            elif how == "prefill":
                model.decoder().prefill(ids, {L: hid for L in model.cfg.layer_ids})
            else:
                dec = model.decoder()
                for t, tok in enumerate(ids):
                    dec.begin(int(tok))
                    for L in model.cfg.layer_ids:
                        dec.layer(L, hid[t])
            st = model.row_cache_stats()
            assert set(st) == set(STATS_FIELDS) - {"fetches", "fetch_seconds"}, (tables, how)
            for L, (lookups, distinct) in want.items():
                s = st["layers"][L]
                assert set(s) == set(LAYER_FIELDS)
                rec = model.tier.caches[L].recbytes
                got = (s["hits"], s["misses"], s["bytes_fetched"], s["rows_cached"])
                assert got == (lookups - distinct, distinct, distinct * rec, distinct), (tables, how, L)
                assert s["cache_bytes"] >= s["capacity_rows"] * rec  # the capacity, not the rows in it
                if tables == "direct":
                    assert s["rows_read"] == distinct and s["bytes_read"] > s["reads"] * 2048 > distinct * rec  # pages
                else:
                    assert s["reads"] == s["rows_read"] == s["bytes_read"] == 0


def test_stats_expose_the_budget_cap(row_checkpoints):
    model = load(row_checkpoints["v41"], row_cache_mb=1e6)
    st = model.row_cache_stats()
    assert 0 < st["budget_bytes"] == st["budget_cap_bytes"] < 1e6 * 2**20
    small = load(row_checkpoints["v41"], row_cache_mb=0.01).row_cache_stats()
    assert small["budget_bytes"] == int(0.01 * 2**20) and small["budget_cap_bytes"] == st["budget_cap_bytes"]


def test_every_stats_field_is_documented_with_its_unit():
    from engram_stream.rows.tiers import STATS_FIELDS
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "DESIGN.md")) as f:
        design = f.read()
    doc = EngramModel.row_cache_stats.__doc__
    units = ("count", "bytes", "seconds", "layer")
    for k, meaning in STATS_FIELDS.items():
        assert any(u in meaning.split(":")[0] for u in units), k
        assert k in doc, k
        row = next((ln for ln in design.splitlines() if ln.startswith("| ") and f"`{k}`" in ln.split("|")[1]), None)
        assert row is not None, k
        if k != "layers":
            assert row.split("|")[2].strip(), k  # a unit


def _break_reads(model, layer):
    """Point layer's scale file descriptor at /proc/self/mem (reads at its offsets: EIO); return a
    function that puts it back."""
    f = model.tier.inner.files[layer]
    path = f.paths[-1]
    fd = f.fileno(path)
    keep = os.dup(fd)
    mem = os.open("/proc/self/mem", os.O_RDONLY)
    os.dup2(mem, fd)
    os.close(mem)
    f._restamp()  # the same file to its change check: only its reads fail

    def restore():
        os.dup2(keep, fd)
        os.close(keep)
        f._restamp()
    return restore


@pytest.mark.parametrize("cache_mb", [0, 0.004])
def test_a_failed_read_refuses_the_call_and_changes_nothing(row_checkpoints, cache_mb):
    """A device error (EIO) while a call's rows are read: OSError, every layer as before the
    call, and once the device is back the same calls give exactly the mapped tables' outputs."""
    path = row_checkpoints["v41"]
    S, T = 3, 12
    ids, hid, _, _ = inputs(load(path), S, T, 1, seed=3)
    ref = load(path)
    want = run_steps(ref, ids, hid)
    model = load(path, tables=DirectTier(o_direct=False), row_cache_mb=cache_mb)
    dec = model.decoder(n_streams=S)
    got = {L: [] for L in model.cfg.layer_ids}
    for t in range(6):
        step(dec, ids[t], hid[t], got)
    snap = dec.snapshot()
    restore = _break_reads(model, model.cfg.layer_ids[-1])
    try:
        with pytest.raises(OSError):
            dec.begin(ids[6])
            for L in model.cfg.layer_ids:
                dec.layer(L, hid[6])
    finally:
        restore()
    assert dec.pending() == []
    after = dec.snapshot()
    for L in model.cfg.layer_ids:  # every layer's windows, counts and rows as before the call
        for k in snap[L].names:
            np.testing.assert_array_equal(getattr(after[L], k), getattr(snap[L], k))
    for t in range(6, T):
        step(dec, ids[t], hid[t], got)
    assert_identical(got, want)


def step(dec, ids, hid, outs):
    dec.begin(ids)
    for L in outs:
        outs[L].append(dec.layer(L, hid).copy())


def run_steps(model, ids, hid):
    dec = model.decoder(n_streams=ids.shape[1])
    outs = {L: [] for L in model.cfg.layer_ids}
    for t in range(ids.shape[0]):
        step(dec, ids[t], hid[t], outs)
    return outs


def test_a_truncated_file_is_refused(row_checkpoints, tmp_path):
    import shutil
    path = str(tmp_path / "m.safetensors")
    shutil.copyfile(row_checkpoints["demo-int8"], path)
    model = load(path, tables="direct")
    dec = model.decoder(n_streams=2)
    hid = np.zeros((2, model.cfg.hc_mult, model.cfg.hidden_size), np.float32)
    step(dec, np.array([3, 4]), hid, {L: [] for L in model.cfg.layer_ids})
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(FileChangedError):
        step(dec, np.array([5, 6]), hid, {L: [] for L in model.cfg.layer_ids})


@pytest.mark.parametrize("tables", ["mapped", "direct"])
def test_a_file_written_in_place_with_its_mtime_put_back_is_refused(row_checkpoints, tmp_path, tables):
    """The stat check before every read compares the file's ctime too: bytes written in place
    with the mtime put back (utime: same size, same mtime) are refused with FileChangedError,
    mapped (FileStamps) and direct (RecordFile) alike, not read as tables."""
    import shutil
    path = str(tmp_path / "m.safetensors")
    shutil.copyfile(row_checkpoints["demo-int8"], path)
    model = load(path, tables=tables)
    dec = model.decoder(n_streams=2)
    hid = np.zeros((2, model.cfg.hc_mult, model.cfg.hidden_size), np.float32)
    step(dec, np.array([3, 4]), hid, {L: [] for L in model.cfg.layer_ids})
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size - 1)
        f.write(bytes([open(path, "rb").read()[-1] ^ 0x40]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(FileChangedError, match="ctime"):
        step(dec, np.array([5, 6]), hid, {L: [] for L in model.cfg.layer_ids})


def test_begin_starts_every_layers_disk_reads(row_checkpoints):
    """Decoder.begin hands every layer's rows to its source before any layer runs: every
    layer's source is reading after begin, and still is for the last layer after the first ran."""
    path = row_checkpoints["v41"]
    for kw in (dict(tables="direct"), dict(tables="direct", row_cache_mb=0.004)):
        model = load(path, **kw)
        ids, hid, _, _ = inputs(model, 3, 2, 1, seed=4)
        dec = model.decoder(n_streams=3)
        dec.begin(ids[0])
        La, Lb = model.cfg.layer_ids
        assert dec.engines[La].row_source.reading and dec.engines[Lb].row_source.reading
        dec.layer(La, hid[0])
        assert not dec.engines[La].row_source.reading and dec.engines[Lb].row_source.reading
        dec.layer(Lb, hid[0])


# ---- V4.1 (and the demo) through a Mooncake Store: the tests' own servers ----------------------
@pytest.mark.mooncake
@pytest.mark.parametrize("fault", ["kill_store", "stop_store"])
def test_mooncake_v41_store_down_refuses_then_continues_exactly(own_store, row_checkpoints, fault):
    """The store server dies (or stops) mid-decode of a V4.1 model: the token is refused with
    TierError within the timeout, every layer as before; once a store is back and the rows
    published again, the same decoder continues bit-identically to the mapped tables."""
    import signal
    import time
    from engram_stream.errors import TierError
    mc, tier = own_store
    path = row_checkpoints["v41-flash-rows"]
    local = load(path)
    tier.publish(local)
    S, T = 3, 14
    ids, hid, _, _ = inputs(local, S, T, 1, seed=9)
    want = run_steps(local, ids, hid)
    model = load(path, tables=tier, row_cache_mb=0.05)
    dec = model.decoder(n_streams=S)
    got = {L: [] for L in model.cfg.layer_ids}
    for t in range(6):
        step(dec, ids[t], hid[t], got)
    snap = dec.snapshot()
    if fault == "kill_store":
        mc.kill_store()
    else:
        os.kill(mc.store_proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TierError):
        step(dec, ids[6], hid[6], {L: [] for L in got})
    assert time.monotonic() - t0 < tier.timeout + 3
    assert dec.pending() == []
    after = dec.snapshot()
    for L in model.cfg.layer_ids:
        for k in snap[L].names:
            np.testing.assert_array_equal(getattr(after[L], k), getattr(snap[L], k))
    if fault == "kill_store":
        mc.start_store()
    else:
        os.kill(mc.store_proc.pid, signal.SIGCONT)
    publish_when_back(tier, local, 30)
    for t in range(6, T):
        step(dec, ids[t], hid[t], got)
    assert_identical(got, want)


@pytest.mark.parametrize("name", ["demo-int8", "v41"])
def test_warm_seeds_the_cache_with_a_prompts_rows(row_checkpoints, name, tmp_path):
    """model.warm(prompt): every row the prompt reads is cached (the numpy hash is the oracle),
    so decoding that prompt then reads nothing from disk and gives the mapped tables' outputs."""
    path = row_checkpoints[name]
    ref = load(path)
    rng = np.random.default_rng(11)
    p_ids = variant_ids(ref, rng, (300,))
    p_hid = rng.standard_normal((300, ref.cfg.hc_mult, ref.cfg.hidden_size), dtype=np.float32)
    want = ref.decoder().prefill(p_ids, {L: p_hid for L in ref.cfg.layer_ids})
    model = load(path, tables="direct", row_cache_mb=64)
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(map(str, p_ids.tolist())))
    st = model.warm(str(f), chunk=70)
    rows = ref.plan.hash_numpy(p_ids[None], layers=list(ref.cfg.layer_ids))
    for L in ref.cfg.layer_ids:
        cached = model.tier.caches[L].rows()
        want_rows = np.unique(rows[L][0] + ref.plan.offsets[L])
        np.testing.assert_array_equal(cached, want_rows)
        assert st["layers"][L]["rows_read"] == want_rows.size
    reads = st["reads"]
    got = model.decoder().prefill(p_ids, {L: p_hid for L in model.cfg.layer_ids})
    for L in want:
        np.testing.assert_array_equal(got[L], want[L])
    after = model.row_cache_stats()
    assert after["reads"] == reads and after["misses"] == st["misses"]  # all hits
    with pytest.raises(ValueError, match="vocab_size"):
        model.warm([1, ref.cfg.vocab_size])


@pytest.mark.parametrize("name,P", [("v41", 11000), ("demo-int8", 16500)])
def test_a_prompt_longer_than_a_submit_window(row_checkpoints, name, P):
    """A prompt whose rows exceed one submit (65536 rows: the next window is handed over at the
    chunk that needs it) decodes bit-identically through the files, with and without a cache
    far smaller than the prompt, and through the decoder's prefill of every layer."""
    path = row_checkpoints[name]
    ref = load(path)
    rng = np.random.default_rng(13)
    ids = variant_ids(ref, rng, (P,))
    hid = rng.standard_normal((P, ref.cfg.hc_mult, ref.cfg.hidden_size), dtype=np.float32)
    assert P * ref.cfg.n_heads > 1 << 16
    want = ref.decoder().prefill(ids, {L: hid for L in ref.cfg.layer_ids})
    for kw in (dict(tables="direct"), dict(tables="direct", row_cache_mb=0.004), dict(row_cache_mb=0.004)):
        model = load(path, **kw)
        got = model.decoder().prefill(ids, {L: hid for L in model.cfg.layer_ids})
        for L in want:
            np.testing.assert_array_equal(got[L], want[L])
        L = model.cfg.layer_ids[0]
        np.testing.assert_array_equal(model.stream(L).prefill(ids, hid), want[L])
