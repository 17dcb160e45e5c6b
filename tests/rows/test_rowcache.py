"""The RAM row cache (include/engram_rowcache.h through RowCache), against plain models of it."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engram_stream.rows._cache import RowCache, cache_nbytes, slot_bytes, slots_for

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang


def gclock_model(nslots, stream):
    """A plain-Python GCLOCK with the header's rules: free slots first; the hand skips a slot
    with uses > 0 (decrementing it); a hit bumps uses up to 3; a new row enters with 0."""
    keys, uses, hand, hits, evictions = [], [], 0, 0, 0
    for r in stream:
        if r in keys:
            i = keys.index(r)
            uses[i] = min(uses[i] + 1, 3)
            hits += 1
            continue
        if nslots == 0:
            continue
        if len(keys) < nslots:
            keys.append(r)
            uses.append(0)
            continue
        while uses[hand]:
            uses[hand] -= 1
            hand = (hand + 1) % nslots
        keys[hand], uses[hand] = r, 0
        hand = (hand + 1) % nslots
        evictions += 1
    return sorted(keys), hits, evictions


@settings(max_examples=150, deadline=None)
@given(nslots=st.integers(0, 40), nrows=st.integers(1, 200), recbytes=st.integers(1, 70),
       seed=st.integers(0, 2**32 - 1), length=st.integers(0, 600))
def test_reads_are_exact_and_match_the_gclock_model(nslots, nrows, recbytes, seed, length):
    rng = np.random.default_rng(seed)
    records = rng.integers(0, 256, (nrows, recbytes), dtype=np.uint8)
    stream = (rng.zipf(1.3, length) - 1) % nrows
    cache = RowCache(nslots, recbytes)
    out = cache.read(stream, records)
    np.testing.assert_array_equal(out, records[stream])
    keys, hits, evictions = gclock_model(nslots, stream.tolist())
    np.testing.assert_array_equal(cache.rows(), keys)
    s = cache.stats()
    assert (s["hits"], s["evictions"]) == (hits, evictions)
    assert s["hits"] + s["misses"] == length
    filled = s["misses"] if nslots else 0
    assert s["bytes_fetched"] == filled * recbytes
    for r in range(nrows):  # the index agrees with the slots after any number of deletions
        assert (r in cache) == (r in keys)


@settings(max_examples=80, deadline=None)
@given(nslots=st.integers(0, 40), nrows=st.integers(1, 200), seed=st.integers(0, 2**32 - 1),
       length=st.integers(0, 600))
def test_keys_only_touch_is_the_same_cache(nslots, nrows, seed, length):
    """touch() (recbytes 0: no bytes, the hit-rate model of bench/bench_hitrate.py) makes the
    same decisions as reads through a cache with bytes."""
    stream = (np.random.default_rng(seed).zipf(1.3, length) - 1) % nrows
    cache = RowCache(nslots, 0)
    hits = sum(cache.touch(stream[i:i + 37]) for i in range(0, length, 37))
    keys, want_hits, evictions = gclock_model(nslots, stream.tolist())
    assert hits == want_hits and cache.stats()["evictions"] == evictions
    np.testing.assert_array_equal(cache.rows(), keys)
    # head, keys, index, counters: no slots
    assert cache.stats()["cache_bytes"] == cache_nbytes(nslots, 0) < cache_nbytes(0, 0) + max(nslots, 1) * 64


def test_hot_rows_survive_a_scan_of_one_off_rows():
    records = np.arange(5000 * 8, dtype=np.uint8).reshape(5000, 8)
    cache = RowCache(8, 8)
    for i in range(1000):
        cache.read([0, 1, 2, 100 + i], records)
    s = cache.stats()
    assert s["hits"] == 3 * 999  # every read of the hot rows after the first
    assert {0, 1, 2} <= set(cache.rows().tolist())


def test_zipf_hit_rate_beats_the_cached_fraction():
    """At 10% of the rows, a Zipf(1.0)-like stream hits far more often than 10%."""
    rng = np.random.default_rng(0)
    n = 20000
    p = 1.0 / np.arange(1, n + 1)
    stream = rng.permutation(n)[rng.choice(n, 100000, p=p / p.sum())]
    records = np.zeros((n, 4), np.uint8)
    cache = RowCache(n // 10, 4)
    cache.read(stream, records)
    s = cache.stats()
    assert s["hits"] / (s["hits"] + s["misses"]) > 0.5


def test_budget_and_layout():
    assert [slot_bytes(r) for r in (264, 256, 64, 60, 12, 1, 0)] == [264, 256, 64, 64, 16, 8, 0]
    for budget in (1 << 20, 3 << 20, 100_000, 5000):
        n = slots_for(budget, 256)
        cache = RowCache(n, 256)
        assert cache.nbytes == cache_nbytes(n, 256) <= budget
        assert cache.nbytes > budget // 2  # the index's power of two costs at most this
    assert slots_for(0, 256) == 0
    with pytest.raises(ValueError):
        RowCache(-1, 8)
    with pytest.raises(ValueError):
        RowCache(4, -1)
    with pytest.raises(IndexError):
        RowCache(4, 8).read([9], np.zeros((9, 8), np.uint8))


@settings(max_examples=100, deadline=None)
@given(nslots=st.integers(0, 30), nrows=st.integers(1, 120), recbytes=st.integers(1, 70),
       seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 12), size=st.integers(1, 50))
def test_batches_through_a_reader_are_exact_read_each_miss_once_and_pin_their_hits(nslots, nrows, recbytes, seed,
                                                                                  batches, size):
    """A call's path through the cache in front of a reader (submit: hits pinned, the distinct
    misses read in one batch; resolve: admitted, pinned), with a cache that may be far smaller
    than a batch: every record right, every missed row read exactly once per batch, and the
    batch's own fills never evict the rows it hit."""
    from engram_stream.rows._direct import DirectReader, IOPool, MemPart, RecordFile
    from engram_stream.rows._source import CachedRows, DirectRows
    rng = np.random.default_rng(seed)
    records = rng.integers(0, 256, (nrows, recbytes), dtype=np.uint8)
    cache = RowCache(nslots, recbytes)
    reader = DirectReader(RecordFile(nrows, [MemPart(records)]), IOPool(2))
    src = CachedRows(cache, DirectRows(reader))
    for _ in range(batches):
        rows = (rng.zipf(1.3, size) - 1) % nrows
        cached_before = set(cache.rows().tolist())
        read_before = reader.stats()["rows_read"]
        np.testing.assert_array_equal(src.read(rows), records[rows])
        want = set(rows.tolist()) - cached_before
        assert reader.stats()["rows_read"] - read_before == len(want)  # only the misses, once each
        hit = set(rows.tolist()) & cached_before
        assert hit <= set(cache.rows().tolist())     # pinned for the call
    s = cache.stats()
    assert s["hits"] + s["misses"] == batches * size
