"""Shared test helpers.

Which engram_stream the tests exercise (tools/checkout.py, before anything imports it): this
checkout when it holds a complete in-place build, else the installed package; never the unbuilt
source tree, which `python -m pytest` from the repository root would otherwise put first. The
choice is made for subprocesses too (PYTHONPATH), and they run with their working directory
outside the checkout. The report header names it.
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_checkout():
    spec = importlib.util.spec_from_file_location("engram_checkout", os.path.join(ROOT, "tools", "checkout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


checkout = _load_checkout()
# Which kernel path runs is the tests' choice (each_isa, use_isa), never a measurement of this
# machine's moment (engine/tune.py): subprocesses inherit it. Tests of tuning turn it on themselves.
os.environ.setdefault("ENGRAM_STREAM_TUNE", "0")
try:
    PACKAGE = checkout.use(ROOT, os.environ)
except SystemExit as e:
    pytest.exit(f"engram_stream: {e}", returncode=pytest.ExitCode.USAGE_ERROR)


def _package_header():
    """Which engram_stream the session tests (and a warning when its in-place build is stale)."""
    stale = checkout.stale_builds(ROOT) if PACKAGE.endswith("(in-place build)") else []
    return [f"engram_stream: {PACKAGE}"] + [f"engram_stream: WARNING {', '.join(stale)} changed since the "
                                            f"in-place build: rebuild (python setup.py build_ext --inplace)"
                                            for _ in stale[:1]]


# Floats compare within ATOL + RTOL*|x| (the project's tolerance: FMA, summation order);
# integers compare exactly.
RTOL, ATOL = 2e-4, 2e-5

# CI runs hypothesis derandomized: the same examples every run, so a red CI is reproducible and
# never a fresh random draw landing on a float edge (ENGRAM_HYPOTHESIS_EXAMPLES=1000 without CI
# set searches randomly, as a developer should).
try:
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; the tests that use it import it themselves
    pass


def _loopback_only_network():
    """Move this process (its main thread, and so every thread and process it starts later)
    into a fresh network namespace whose one interface is loopback. Why: Mooncake's
    mooncake_master and mooncake_client bind some ports (the HTTP metadata server, the
    transfer engine) on 0.0.0.0 whatever their host flags say; here the only address they
    can listen on is this namespace's 127.0.0.1. Needs CAP_SYS_ADMIN (root, as in CI);
    otherwise nothing changes. ENGRAM_STREAM_TEST_NETNS=0 turns it off. Returns whether
    the namespace is in effect."""
    import ctypes
    import fcntl
    import socket
    import struct
    if os.environ.get("ENGRAM_STREAM_TEST_NETNS") == "0" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # lo up: SIOCGIFFLAGS, SIOCSIFFLAGS
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1))  # IFF_UP
    return True


LOOPBACK_ONLY = _loopback_only_network()


@pytest.fixture(scope="session", autouse=True)
def _private_user_cache(tmp_path_factory):
    """Tests never write the user's cache folder (engram_stream.v41.hf.cached_compression): the
    session, and every subprocess it starts, caches under a temp folder."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


def close(got, want, **kw):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, **kw)


def hypothesis_settings(default_examples):
    """Hypothesis settings of the property tests: ENGRAM_HYPOTHESIS_EXAMPLES=1000 for a longer
    search (the default keeps the suite fast)."""
    from hypothesis import HealthCheck, settings
    return settings(max_examples=int(os.environ.get("ENGRAM_HYPOTHESIS_EXAMPLES", default_examples)),
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])


def dense_compression(vocab, rng):
    """A dense first-seen-order map: raw buckets renumbered 0, 1, 2, ... as they first appear."""
    raw = rng.integers(0, max(2, vocab // 2), vocab)
    first, lookup = {}, np.empty(vocab, np.int64)
    for i, r in enumerate(raw):
        lookup[i] = first.setdefault(int(r), len(first))
    return lookup


def make_model(G=2, n=3, K=3, D=13, nh=2, hd=3, vocab=40, layers=(1, 4), evs=None, comp=False,
               seed=0, pad=1, table_dtype="float32", table=None):
    """A small demo-variant model with non-trivial norm weights and biases (perturbed);
    table float32/float16/int8; table(L, array) -> array may replace a layer's table (e.g.
    with a file-backed copy)."""
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.demo.weights import LayerWeights
    rng = np.random.default_rng(seed + 12345)
    cfg = EngramConfig(engram_vocab_size=list(evs) if evs else [31 + 10 * i for i in range(n - 1)],
                       max_ngram_size=n, n_embed_per_ngram=nh * hd, n_head_per_ngram=nh,
                       layer_ids=list(layers), pad_id=pad, seed=seed, kernel_size=K, hidden_size=D,
                       hc_mult=G, vocab_size=vocab)
    compression = dense_compression(vocab, rng) if comp else None
    model = EngramModel.init(cfg, seed=seed, compression=compression)
    if table_dtype != "float32" or table is not None:
        layers_w = {}
        for L, w in model.layers.items():
            t, scale = w.table, None
            if table_dtype == "float16":
                t = w.table.astype(np.float16)
            elif table_dtype == "int8":
                scale = (np.abs(w.table).max(axis=1) / 127 + 1e-3).astype(np.float32)
                t = np.clip(np.round(w.table / scale[:, None]), -127, 127).astype(np.int8)
            if table is not None:
                t = table(L, t)
            layers_w[L] = LayerWeights(cfg, w.offsets, t, w.proj_w, w.proj_b, w.norm1, w.norm2,
                                       w.conv_norm, w.conv_w, table_scale=scale)
        model = EngramModel(cfg, model.plan, layers_w)
    return perturbed(model, rng)


V41_IMG = 299  # the DEAD (image) token id of make_v41_model's models


def make_v41_model(G=2, D=64, n=4, nh=2, hd=32, vocab=300, img=V41_IMG, layers=(1, 4), comp=True, seed=0, evs=211):
    """A small deepseek-v4.1 model (random float8 weights at the reference's magnitudes)."""
    from engram_stream import EngramConfig, EngramModel
    rng = np.random.default_rng(seed + 99)
    cfg = EngramConfig(variant="deepseek-v4.1", engram_vocab_size=[evs] * (n - 1), max_ngram_size=n,
                       n_embed_per_ngram=nh * hd, n_head_per_ngram=nh, layer_ids=list(layers), pad_id=2,
                       hidden_size=D, hc_mult=G, vocab_size=vocab, image_token_id=img)
    return EngramModel.init(cfg, seed=seed, compression=dense_compression(vocab, rng) if comp else None)


# The contract suites' models: a small one of every registered variant. The built-in variants have
# theirs here (non-trivial norms, a compression); any other variant is made from its registry
# entry's example_config (tests/contract/test_toy_variant.py registers one).
CONTRACT_MODELS = {
    "demo-v1": lambda seed=3, **kw: make_model(G=2, n=3, K=3, D=16, comp=True, seed=seed, vocab=60, **kw),
    "deepseek-v4.1": lambda seed=0, **kw: make_v41_model(seed=seed, **kw),
}


def make_qwen_model(seed=0, table_dtype="float32"):
    """A small qwen3.8-flash-next model (the variant's example config: EOS 299, padded tables)."""
    import ml_dtypes
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.qwen.config import EXAMPLE
    m = EngramModel.init(EngramConfig(**EXAMPLE), seed=seed)
    if table_dtype == "bfloat16":
        m = EngramModel(m.cfg, m.plan, {L: w.replace(m.cfg, table=w.table.astype(ml_dtypes.bfloat16))
                                        for L, w in m.layers.items()})
    return m


def contract_variants() -> list:
    """The names of every registered variant: the contract suites run on each."""
    from engram_stream import variants
    return list(variants.registered())


def contract_model(variant, seed=None, **kw):
    """A small model of a registered variant, for the contract suites."""
    from engram_stream import EngramConfig, EngramModel, variants
    if variant in CONTRACT_MODELS:
        return CONTRACT_MODELS[variant](**kw) if seed is None else CONTRACT_MODELS[variant](seed=seed, **kw)
    return EngramModel.init(EngramConfig(**variants.get(variant).example_config), seed=seed or 0)


def checkpoint_path(model, folder, name="ckpt"):
    """Where a test saves `model`: a folder for a variant whose checkpoints are folders, else a file."""
    from engram_stream import variants
    return folder / (name if variants.variant_of(model.cfg).folder_checkpoint else f"{name}.st")


# ---- the row-source contract (tests/contract/test_row_sources.py) -----------------------------------
# Checkpoints of both record layouts, and every place a model's rows can come from, as the load
# arguments that select it. A test file may add a source here (tests/contract/test_toy_source.py).
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


@pytest.fixture(scope="session")
def row_checkpoints(tmp_path_factory):
    """{name: path}: each of ROW_MODELS saved (a file for the demo, an HF folder for V4.1)."""
    d = tmp_path_factory.mktemp("row-models")
    out = {}
    for name, make in ROW_MODELS.items():
        path = str(d / (name + (".safetensors" if name.startswith("demo") else "")))
        make().save(path)
        out[name] = path
    return out


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
        assert model.tables.inner.rows_path == packed.rows_path(copy)
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


def _suite_pytest(plugin, env_var, files, extra):
    """pytest over contract suites (files of tests/contract) in a process of its own, with a test
    file loaded as a plugin (`-p plugin`, env_var=1: it registers its toy there). cwd is
    tests/contract, not the repository root, whose unbuilt engram_stream/ would shadow the
    installed package."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "contract")
    env = {**os.environ, env_var: "1", "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)] + sys.path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-p", plugin] + extra + [os.path.join(here, f) for f in files],
                          cwd=here, env=env, capture_output=True, text=True, timeout=600)


def collect_suite_with_plugin(plugin, env_var, files, keyword=None):
    """The node ids of the suites' cases as a run with the plugin collects them (those named by
    `keyword` when given)."""
    r = _suite_pytest(plugin, env_var, files, ["--collect-only"] + (["-k", keyword] if keyword else []))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return [line.strip() for line in r.stdout.splitlines() if "::" in line]


def run_suite_counts(plugin, env_var, files, keyword):
    """Run the suites' cases named by `keyword` with the plugin; asserts the run was green and
    returns its outcome counts ({"passed": n, "skipped": n, ...} as pytest's summary gives them)."""
    r = _suite_pytest(plugin, env_var, files, ["-k", keyword])
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "failed" not in tail and "error" not in tail, tail
    return {what: int(n) for n, what in re.findall(r"(\d+) (\w+)", tail.rsplit(" in ", 1)[0])}


def run_suite_with_plugin(plugin, env_var, files, keyword):
    """run_suite_counts' passed count."""
    return run_suite_counts(plugin, env_var, files, keyword).get("passed", 0)


def publish_when_back(tier, model, seconds):
    """tier.publish(model) once a restarted store takes it: the master drops a dead store
    server's memory only after its client ttl, so writes fail (TierError) for a while."""
    import time
    from engram_stream.rows import TierError
    from mooncake_servers import wait_until_writable
    wait_until_writable(tier)
    end = time.monotonic() + seconds
    while True:
        try:
            return tier.publish(model)
        except TierError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


# ---- the serving plugins' tests (tests/integrations/test_vllm.py, test_sglang.py) -------------------
PLUGIN_SOURCES = {   # the plugins' settings (their JSON) for each source they read rows from
    "mapped": {"tables": "mapped"},
    "mapped+cache": {"tables": "mapped", "row_cache_mb": 0.2},
    "direct": {"tables": "direct"},
    "direct+cache": {"tables": "direct", "row_cache_mb": 0.2},
    "packed row file+cache": {"tables": "direct", "row_cache_mb": 0.2},
}


@pytest.fixture(scope="session")
def plugin_checkpoints(tmp_path_factory):
    """A V4.1 folder: 3 heads per order (9 columns: a TP shard of 2 ranks has a padded head),
    head_dim 256 (the 264-byte record), and its copy with the packed row file:
    {"plain": folder, "rows": its copy}."""
    import shutil
    from engram_stream import EngramModel
    from engram_stream.rows import packed
    d = tmp_path_factory.mktemp("plugins")
    path = str(d / "v41")
    make_v41_model(seed=11, nh=3, hd=256, D=32).save(path)
    with_rows = str(d / "v41-rows")
    shutil.copytree(path, with_rows)
    packed.pack_rows(EngramModel.from_deepseek_v41(with_rows), packed.rows_path(with_rows))
    return {"plain": path, "rows": with_rows}


def variant_ids(model, rng, shape, p_dead=0.15, p_neg=0.05):
    """Random ids for any variant: some negative (demo: they pass through; V4.1: DEAD in the
    window), and for V4.1 image (DEAD) tokens, for Qwen EOS tokens, also at the start and in runs."""
    cfg = model.cfg
    ids = rng.integers(0, cfg.vocab_size, shape).astype(np.int64)
    if model.plan.dead_id is not None:
        ids[rng.random(shape) < p_dead] = model.plan.dead_id
    from engram_stream import variants
    if getattr(variants.variant_of(cfg), "negative_ids", True):   # longcat-flash-lite's ids index its embedding
        ids[rng.random(shape) < p_neg] = -rng.integers(1, 5)
    if model.plan.history == "separator":  # Qwen: EOS ends a document, also at the start and in runs
        ids[rng.random(shape) < p_dead] = cfg.pad_id
    return ids


class NoHidden:
    """The hidden of an input layer's calls in the contract suites: None at every index, so the
    suites index one hidden for every variant (h[:, p]; h[...] for the whole) and an input layer
    is handed None wherever a residual layer gets its array."""

    def __getitem__(self, index):
        return None


def variant_hidden(model, rng, shape):
    """Random hidden states float32[*shape, G, D] for `model`; an input layer's: NoHidden (None
    at every index, no draw)."""
    from engram_stream import variants
    if variants.variant_of(model.cfg).input_layer:
        return NoHidden()
    return rng.standard_normal(tuple(shape) + (model.cfg.hc_mult, model.cfg.hidden_size)).astype(np.float32)


def out_shape(model, *lead):
    """The shape of an output of `model` with leading dims `lead` ([.., G, D]; an input layer's [.., D])."""
    from engram_stream import variants
    if variants.variant_of(model.cfg).input_layer:
        return tuple(lead) + (model.cfg.hidden_size,)
    return tuple(lead) + (model.cfg.hc_mult, model.cfg.hidden_size)


def variant_inputs(model, seed, shape):
    """variant_ids and variant_hidden of `shape` (S, T) or (T,), drawn in that order from one
    generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    return variant_ids(model, rng, shape), variant_hidden(model, rng, shape)


def stepped(model, layer, ids, hid, n):
    """An engine of `layer` over the S streams of ids [S, T] that has stepped their first n tokens
    (hid [S, T, G, D])."""
    eng = model.stream(layer, n_streams=ids.shape[0])
    for t in range(n):
        eng.step(ids[:, t], hid[:, t])
    return eng


def decode_inputs(model, S, T, P, seed):
    """Steps ids [T, S] (every 5th step the same id in all streams: each row S times in the batch),
    hidden [T, S, G, D]; a prompt of P ids and its hidden."""
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    ids = variant_ids(model, rng, (T, S))
    ids[::5] = ids[::5, :1]
    hid = rng.standard_normal((T, S, cfg.hc_mult, cfg.hidden_size), dtype=np.float32)
    p_ids = variant_ids(model, rng, (P,))
    p_hid = rng.standard_normal((P, cfg.hc_mult, cfg.hidden_size), dtype=np.float32)
    return ids, hid, p_ids, p_hid


def decode_run(model, S, T=25, P=300, seed=0):
    """A prompt prefilled on the last stream (it spans prefill chunks), then T steps of every
    stream: {layer: [outputs]}."""
    ids, hid, p_ids, p_hid = decode_inputs(model, S, T, P, seed)
    dec = model.decoder(n_streams=S)
    outs = {L: [] for L in model.cfg.layer_ids}
    for L, y in dec.prefill(p_ids, {L: p_hid for L in outs}, stream=S - 1).items():
        outs[L].append(y)
    for t in range(T):
        dec.begin(ids[t] if S > 1 else int(ids[t, 0]))
        for L in outs:
            outs[L].append(dec.layer(L, hid[t] if S > 1 else hid[t, 0]).copy())
    return outs


def assert_decoded_identically(got, want):
    for L in want:
        assert len(got[L]) == len(want[L])
        for a, b in zip(got[L], want[L]):
            np.testing.assert_array_equal(a, b)  # bit for bit


def random_inputs(model, S, T, rng, neg=True):
    """ids int64[S, T] (some negative: they pass through uncompressed), hidden float32[S, T, G, D]."""
    cfg = model.cfg
    ids = rng.integers(-3 if neg else 0, cfg.vocab_size, (S, T)).astype(np.int64)
    hid = rng.standard_normal((S, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    return ids, hid


def native_allocations(run):
    """[count, bytes] of the native allocations memray.Tracker records while run() runs (frees and
    unmaps not counted). For the allocation tests' subprocesses, which import this file."""
    import memray
    fn = os.path.join(tempfile.mkdtemp(), "t.bin")
    with memray.Tracker(fn):
        run()
    frees = {memray.AllocatorType.FREE, memray.AllocatorType.MUNMAP}
    recs = [r for r in memray.FileReader(fn).get_allocation_records()
            if memray.AllocatorType(r.allocator) not in frees]
    os.unlink(fn)
    return [len(recs), sum(r.size for r in recs)]


def run_python(args, cwd=None, **kw):
    """subprocess.run([sys.executable, *args]) from a folder outside the checkout."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run([sys.executable, *args], cwd=cwd or tempfile.gettempdir(), **kw)


def run_python_on_a_terminal(args, timeout=300):
    """run_python with stderr on a terminal (a pseudo-terminal: where progress bars show) and
    stdout a pipe. Both are read while it runs, so a long bar cannot fill the terminal's buffer
    and stall it. Returns a CompletedProcess whose stderr is what the terminal showed (text)."""
    import pty
    import select
    import time
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, *args], cwd=tempfile.gettempdir(), stdout=subprocess.PIPE,
                             stderr=slave)
    finally:
        os.close(slave)
    out_fd = p.stdout.fileno()
    chunks = {master: [], out_fd: []}
    reading = set(chunks)
    deadline = time.monotonic() + timeout
    try:
        while reading:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(p.args, timeout)
            for fd in select.select(sorted(reading), [], [], left)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the terminal's last writer closed it
                    chunk = b""
                if chunk:
                    chunks[fd].append(chunk)
                else:
                    reading.discard(fd)
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        os.close(master)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_fd, master))
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def start_python(args, cwd=None, **kw):
    """subprocess.Popen([sys.executable, *args]) from a folder outside the checkout (a process
    the test talks to while it runs)."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd or tempfile.gettempdir(), **kw)


def perturbed(model, rng):
    """The same model with non-trivial norm weights and biases, like trained ones (a model's
    arrays are read-only: the changed ones are new arrays)."""
    from engram_stream import EngramModel
    layers = {}
    for L, w in model.layers.items():
        n1, n2, n3 = (1 + 0.3 * rng.standard_normal(a.shape) for a in (w.norm1, w.norm2, w.conv_norm))
        bias = w.proj_b + 0.2 * rng.standard_normal(w.proj_b.shape)
        layers[L] = w.replace(model.cfg, norm1=n1, norm2=n2, conv_norm=n3, proj_b=bias)
    return EngramModel(model.cfg, model.plan, layers)


def fine_tuned_outside_samples(model):
    """The demo model with every table row changed except the ones the Mooncake fingerprint
    samples (rows.mooncake.keys.sample_rows): the same config and sampled rows, other tables."""
    from engram_stream import EngramModel
    from engram_stream.rows.mooncake.keys import sample_rows
    layers = {}
    for L, w in model.layers.items():
        keep = np.zeros(w.table.shape[0], bool)
        for h, n_h in enumerate(model.plan.head_primes[L]):
            keep[int(w.offsets[h]) + sample_rows(int(n_h), L, h)] = True
        table = np.array(w.table)
        table[~keep] = -table[~keep] + 0.5
        layers[L] = w.replace(model.cfg, table=table)
    return EngramModel(model.cfg, model.plan, layers)


def _kernel_isas():
    """Every kernel path this CPU runs (ENGRAM_STREAM_ISA, when set, names the only one)."""
    forced = os.environ.get("ENGRAM_STREAM_ISA", "").strip().lower()
    if forced:
        return [forced]
    from engram_stream.engine.isa import supported_isas
    return list(supported_isas())


def pytest_report_header(config):
    """Which engram_stream is tested, which kernel paths the each_isa tests run here, and why the others cannot."""
    from engram_stream.engine.isa import ISA_NAMES, cpu_isas, supported_isas
    run = _kernel_isas()
    why = {n: ("ENGRAM_STREAM_ISA names another" if n in supported_isas() else
               "this build lacks it" if n in cpu_isas() else "this CPU lacks it") for n in ISA_NAMES if n not in run}
    return _package_header() + [f"kernel paths tested (each_isa): {', '.join(run)}"
                                + "".join(f"; {n} not run: {w}" for n, w in why.items())]


@pytest.fixture(scope="module", params=_kernel_isas())
def each_isa(request):
    """Run a module's tests once per kernel path (`pytestmark = pytest.mark.usefixtures("each_isa")`):
    every path is held to the numpy oracle."""
    from engram_stream.engine import isa as _isa
    before = _isa.kernel_isa()
    _isa.use_isa(request.param)
    yield request.param
    _isa.use_isa(before)


# ---- a Mooncake Store for the session (tests marked `mooncake`) ---------------------------------
def mooncake_or_skip():
    """Skip unless the mooncake extra and its server binaries are installed."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    from mooncake_servers import _binary
    try:
        _binary("mooncake_master"), _binary("mooncake_client")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def mooncake():
    """A mooncake_master and one store server on free loopback ports, for the session."""
    mooncake_or_skip()
    from mooncake_servers import LocalMooncake
    mc = LocalMooncake(segment_mb=64)
    mc.start()
    yield mc
    mc.stop()


@pytest.fixture(scope="session")
def tier(mooncake):
    from mooncake_servers import wait_until_writable
    from engram_stream.rows import MooncakeTier
    t = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, local_host="127.0.0.1", timeout=5)
    wait_until_writable(t)
    yield t
    t.close()


@pytest.fixture(scope="session")
def bare_tier(mooncake):
    """A tier on the session's servers under EngramStore's own keys (name="": engram:l{L}:h{h})."""
    from mooncake_servers import wait_until_writable
    from engram_stream.rows import MooncakeTier
    t = MooncakeTier(master=mooncake.master, metadata=mooncake.metadata, local_host="127.0.0.1", timeout=5,
                     name="")
    wait_until_writable(t)
    yield t
    t.close()


@pytest.fixture
def own_store():
    """(LocalMooncake, MooncakeTier) of a test's own servers (a test that kills or stops them)."""
    mooncake_or_skip()
    from mooncake_servers import LocalMooncake, wait_until_writable
    from engram_stream.rows import MooncakeTier
    mc = LocalMooncake(segment_mb=32).start()
    try:
        t = MooncakeTier(master=mc.master, metadata=mc.metadata, timeout=4)
        wait_until_writable(t)
        yield mc, t
        t.close()
    finally:
        mc.stop()


# ---- what a run skipped, for the run that has the extras (.ci/run) ---------------------------------
SKIPPED_FILE = os.environ.get("ENGRAM_STREAM_SKIPPED_FILE")  # a path: every skipped test's id, one a line


def _record_skip(report):
    if SKIPPED_FILE and report.skipped:
        with open(SKIPPED_FILE, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)   # a module skipped whole (importorskip at its top)


# ---- exit after Mooncake tests --------------------------------------------------------------------
def pytest_sessionfinish(session, exitstatus):
    session.config._engram_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A session that ran a Mooncake client ends with os._exit(its status), after every other
    plugin has finished. A user's process exits with its own status after a fault (closed
    clients, running calls waited for: engram_stream.rows.mooncake.calls._close_at_exit, tested in
    subprocesses by tests/rows/test_mooncake.py), but this session leaves calls that outlive
    their bound by minutes: the stop_master tests' calls, stuck until the master is resumed and
    killed, return whenever the client's retries end, and one that returns while the interpreter
    finalizes aborts it ("terminate called without an active exception": 2 of 2 sessions here).
    The tests' verdict is the session's status, not that race."""
    status = getattr(config, "_engram_exitstatus", None)
    if status is not None and "mooncake.store" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
