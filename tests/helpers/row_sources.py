"""The row-source contract (tests/contract/test_row_sources.py): checkpoints of each record
layout, every place a model's rows can come from as the load arguments that select it, and the
serving plugins' settings for each source. A test file may add a source to ROW_SOURCES
(tests/contract/test_toy_source.py)."""
import os
import tempfile

from helpers.models import make_model, make_qwen_model, make_v41_model

ROW_MODELS = {
    "demo-f32": lambda: make_model(G=2, n=3, K=3, D=16, comp=True, seed=5, vocab=60),
    "demo-int8": lambda: make_model(G=2, n=3, K=3, D=16, comp=True, seed=6, vocab=60, table_dtype="int8"),
    "v41": lambda: make_v41_model(seed=7),
    "v41-flash-rows": lambda: make_v41_model(seed=8, hd=256, D=32),  # the 264-byte record
    "qwen": lambda: make_qwen_model(seed=9),
    "qwen-bf16": lambda: make_qwen_model(seed=10, table_dtype="bfloat16"),  # the released tables' dtype
}
SMALL_CACHE = "small"   # row_cache_mb far below the rows one call reads: evictions within a call
ROW_SOURCES = {
    "mapped": {},
    "cache on the mapping": dict(row_cache_mb=SMALL_CACHE),
    "direct": dict(tables="direct"),
    "direct+cache": dict(tables="direct", row_cache_mb=SMALL_CACHE),
    "scales in RAM+cache": dict(tables="direct-scales-in-ram", row_cache_mb=SMALL_CACHE),
    "packed row file": dict(tables="direct", packed=True),
    "packed row file+cache": dict(tables="direct", row_cache_mb=SMALL_CACHE, packed=True),
    "host cache on the mapping": dict(row_cache_mb=SMALL_CACHE, host_cache=True),
    "direct+host cache": dict(tables="direct", row_cache_mb=SMALL_CACHE, host_cache=True),
    "mooncake": dict(tables="mooncake"),
    "mooncake+cache": dict(tables="mooncake", row_cache_mb=SMALL_CACHE),
}


def load_checkpoint(path, **kw):
    """A saved ROW_MODELS checkpoint (a demo file, a V4.1 or a Qwen folder) loaded with `kw`."""
    from engram_stream import EngramModel, variants
    if os.path.isdir(path) and variants.get("deepseek-v4.1").is_checkpoint(path):
        return EngramModel.from_deepseek_v41(path, **kw)
    return EngramModel.load(path, **kw)


def row_source_model(path, what, tmp_path, request):
    """The checkpoint at `path` loaded to read its rows from ROW_SOURCES[what] (packing a row file
    beside a copy, publishing to the session's Mooncake Store, as the entry asks)."""
    import shutil
    from engram_stream.rows import packed
    from engram_stream.rows.direct import DirectTier
    kw = dict(ROW_SOURCES[what])
    if kw.get("row_cache_mb") == SMALL_CACHE:
        kw["row_cache_mb"] = 0.05 if os.path.isdir(path) else 0.004
    if kw.pop("host_cache", False):   # a name of this test's own: no other process shares it
        import glob
        import uuid
        from engram_stream.rows.tiers import HOST_CACHE_DIR
        name = kw["host_cache"] = f"t{uuid.uuid4().hex[:12]}"
        request.addfinalizer(lambda: [os.unlink(f) for f in glob.glob(os.path.join(HOST_CACHE_DIR,
                                                                                   f"engram-rows-{name}-*"))])
    if kw.pop("packed", False):
        copy = os.path.join(tempfile.mkdtemp(dir=tmp_path), os.path.basename(path))
        (shutil.copytree if os.path.isdir(path) else shutil.copyfile)(path, copy)
        packed.pack_rows(load_checkpoint(copy), packed.rows_path(copy))
        model = load_checkpoint(copy, **kw)
        assert model.tier.inner.rows_path == packed.rows_path(copy)
        return model
    if kw.get("tables") == "direct-scales-in-ram":
        kw["tables"] = DirectTier(scales_in_ram=True)
    elif kw.get("tables") == "mooncake":
        tier = request.getfixturevalue("tier")
        tier.publish(load_checkpoint(path))
        kw["tables"] = tier
    elif callable(kw.get("tables")):
        kw["tables"] = kw["tables"]()
    return load_checkpoint(path, **kw)


# ---- the serving plugins' tests (tests/integrations/test_vllm.py, test_sglang.py) -------------------
PLUGIN_SOURCES = {   # the plugins' settings (their JSON) for each source they read rows from
    "mapped": {"tables": "mapped"},
    "mapped+cache": {"tables": "mapped", "row_cache_mb": 0.2},
    "direct": {"tables": "direct"},
    "direct+cache": {"tables": "direct", "row_cache_mb": 0.2},
    "packed row file+cache": {"tables": "direct", "row_cache_mb": 0.2},
}
