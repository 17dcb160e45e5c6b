"""longcat-flash-lite over every row source (helpers.row_sources.ROW_SOURCES: the mapped table, the folder's
files read directly, the packed row file, the RAM and host row caches in front of them, a
Mooncake Store): the engine decodes bit-identically to the mapped table, a prompt across
prefill chunks then steps of 3 streams, with EOS among the ids; the stats count reads."""
from __future__ import annotations

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel
from engram_stream.longcat.config import EXAMPLE
from helpers.row_sources import ROW_SOURCES, load_checkpoint, row_source_model

pytestmark = pytest.mark.native
SOURCES = [pytest.param(w, marks=pytest.mark.mooncake) if "mooncake" in w else w for w in ROW_SOURCES]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def folder(request, tmp_path_factory):
    cfg = EngramConfig(**{**EXAMPLE, "vocab_size": 400, "engram_vocab_size": [1200, 1200]})
    path = str(tmp_path_factory.mktemp("lc-rows") / f"lc-{request.param}")
    EngramModel.init(cfg, seed=13).save(path, table_dtype=request.param)
    return path


def _decode(model, seed=0):
    """A prompt of 700 ids on stream 1 (prefill chunks of the engine's size), then 20 steps of 3 streams."""
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    prompt = rng.integers(0, cfg.vocab_size, 700)
    steps = rng.integers(0, cfg.vocab_size, (20, 3))
    prompt[rng.random(700) < 0.1] = cfg.pad_id
    steps[rng.random((20, 3)) < 0.2] = cfg.pad_id
    eng = model.stream(0, n_streams=3)
    out = [eng.prefill(prompt, stream=1)]
    out += [eng.step(s) for s in steps]
    return np.concatenate([o.reshape(-1) for o in out]), eng.rows


@pytest.mark.parametrize("what", SOURCES)
def test_every_source_decodes_as_the_mapped_table(folder, what, tmp_path, request):
    want, want_rows = _decode(load_checkpoint(folder))
    model = row_source_model(folder, what, tmp_path, request)
    got, rows = _decode(model)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(rows, want_rows)
    st = model.row_cache_stats()
    if ROW_SOURCES[what].get("row_cache_mb"):
        assert st["hits"] > 0 and st["misses"] > 0
    if ROW_SOURCES[what].get("tables") is not None:
        assert st["reads"] > 0
