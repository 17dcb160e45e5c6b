"""A place for rows written in this file alone (no shared file names it) passes the row-source
contract suite (test_row_sources.py), bare and behind the RAM row cache: a Tier, its RowSource, and
an entry in rows.tiers.TIERS that lets a spec name it (tables="toy").

The toy keeps a layer's records in a Python dict of bytes (as a key-value service would) and
serves them through RecordSource's two calls: start(rows) looks them up, finish() hands the batch
over. It is added to helpers.row_sources.ROW_SOURCES only in a pytest run of its own (this file
loaded as a plugin, `-p test_toy_source` with ENGRAM_STREAM_TOY_SOURCE=1)."""
import os
import re
import time

import numpy as np
import pytest

from engram_stream.rows import TIERS, RecordSource, Tier
from engram_stream.rows._direct import add_read
from engram_stream.rows.records import record_arrays

from helpers import row_sources
from helpers.suites import collect_suite_with_plugin, run_suite_counts

class ToyTier(Tier):
    def open(self, model):
        return ToyTables(model)


class ToyTables(ToyTier):
    """The toy opened for one model: its records."""

    def __init__(self, model):
        self.store = {}
        for L in model.cfg.layer_ids:
            rows, scales = record_arrays(model.layer(L))
            rec = rows if scales is None else np.concatenate([rows, scales], axis=1)
            self.store[L] = ({r: rec[r].tobytes() for r in range(rec.shape[0])}, rows.shape[1],
                             0 if scales is None else scales.shape[1])

    def source(self, layer, read_totals=None):
        return ToyRows(*self.store[layer], read_totals)


class ToyRows(RecordSource):
    def __init__(self, records, rowbytes, scalebytes, read_totals):
        super().__init__(len(records), rowbytes, scalebytes)
        self.records, self.read_totals, self.batch = records, read_totals, None

    def start(self, rows):
        self.t0 = time.perf_counter()
        self.batch = b"".join(self.records[int(r)] for r in rows)
        self.n = len(rows)

    def finish(self):
        out = np.frombuffer(self.batch, np.uint8).reshape(self.n, -1)
        if self.read_totals is not None:  # one batched read of n records
            add_read(self.read_totals, 1, out.nbytes, self.n, time.perf_counter() - self.t0)
        return out


def pytest_configure(config):
    """Loaded as the plugin of the suite's own run: the toy joins the sources (helpers.row_sources,
    one module the suite imports too)."""
    if os.environ.get("ENGRAM_STREAM_TOY_SOURCE") == "1":
        TIERS["toy"] = ToyTier
        row_sources.ROW_SOURCES["toy"] = dict(tables="toy")
        row_sources.ROW_SOURCES["toy+cache"] = dict(tables="toy", row_cache_mb=row_sources.SMALL_CACHE)


def _with_source(node_id, source, other):
    """node_id with its source parameter `source` put as `other`; None when it has no such one."""
    head, sep, params = node_id.partition("[")
    new, n = re.subn(r"(?<![^-])" + re.escape(source) + r"(?![^-\]])", lambda _: other, params)
    return head + sep + new if n == 1 else None


def test_the_row_source_contract_passes_on_a_source_written_here():
    """Every case the suite runs on a source (each one it runs on the mapped tables) runs on the
    toy, bare and cached, and passes: none left out of the collection, none skipped."""
    run = ("test_toy_source", "ENGRAM_STREAM_TOY_SOURCE", ["test_row_sources.py"])
    mapped = [i for i in collect_suite_with_plugin(*run) if _with_source(i, "mapped", "mapped")]
    want = {_with_source(i, "mapped", toy) for i in mapped for toy in ("toy", "toy+cache")}
    assert len(mapped) >= 8 and len(want) == 2 * len(mapped)
    assert set(collect_suite_with_plugin(*run, keyword="toy")) == want
    counts = run_suite_counts(*run, "toy")
    assert counts.get("passed") == len(want) and not set(counts) - {"passed", "deselected", "warning", "warnings"}, \
        counts


def test_the_toy_is_not_a_source_in_this_run():
    assert not any(k.startswith("toy") for k in row_sources.ROW_SOURCES) and "toy" not in TIERS


def test_a_toy_that_returns_short_records_is_refused(row_checkpoints):
    """finish() giving fewer records than asked: ValueError naming what it must return, no read."""
    class Short(ToyRows):
        def finish(self):
            return super().finish()[:-1]
    model = row_sources.load_checkpoint(row_checkpoints["v41"], tables=ToyTier())
    L = model.cfg.layer_ids[0]
    t = model.tier.inner.store[L]
    src = Short(*t, None)
    with pytest.raises(ValueError, match=r"finish\(\) must return uint8"):
        src.read(np.array([0, 1, 2]))
