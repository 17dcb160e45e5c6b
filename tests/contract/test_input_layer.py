"""The input-layer engine shape (EngineBase.input_layer: a token in, float32[hidden_size] out, no
hidden), held by a variant defined and registered from this file alone, with an engine of its own
that knows nothing of LongCat: InputSumEngine (_input_sum.pyx beside this file), the plain sum of
a token's H table rows. The engine is compiled here against the package's .pxd files and
headers (engram_stream.get_include()), as a third-party variant's engine is built.

The contract suites (test_engine_contract.py, test_serving.py) run over it in a pytest run of its
own (this file loaded as a plugin, `-p test_input_layer` with ENGRAM_STREAM_INPUT_SUM=1), so the
main run's registry holds the built-in variants alone."""
import hashlib
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, variants

from helpers.numeric import close
from helpers.suites import run_suite_with_plugin

NAME = "input-sum-v0"
HERE = os.path.dirname(os.path.abspath(__file__))
PYX = os.path.join(HERE, "_input_sum.pyx")


def build_engine():
    """The compiled _input_sum module, built once per source and package build (a folder of the
    system temp dir named by their digest) and imported from there."""
    import engram_stream
    from engram_stream.engine import _base
    key = hashlib.sha256(open(PYX, "rb").read() + open(_base.__file__, "rb").read()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"engram-stream-test-ext-{os.getuid()}", key)
    if not any(f.startswith("_input_sum.") and f.endswith((".so", ".pyd")) for f in
               (os.listdir(out) if os.path.isdir(out) else ())):
        import numpy
        from Cython.Build import cythonize
        from setuptools import Distribution, Extension
        work = tempfile.mkdtemp(prefix="input-sum-")
        src = os.path.join(work, "_input_sum.pyx")
        with open(PYX) as f, open(src, "w") as g:
            g.write(f.read())
        ext = Extension("_input_sum", [src], include_dirs=[numpy.get_include(), engram_stream.get_include()],
                        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(engram_stream.__file__)))
        dist = Distribution({"ext_modules": cythonize([ext], include_path=[pkg_root], quiet=True,
                                                      compiler_directives={"language_level": 3})})
        cmd = dist.get_command_obj("build_ext")
        part = os.path.join(work, "lib")   # this run's own, renamed into place whole
        cmd.build_lib, cmd.build_temp = part, os.path.join(work, "tmp")
        cmd.ensure_finalized()
        cmd.run()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        try:
            os.rename(part, out)
        except OSError:   # another run built it meanwhile: theirs is the same
            pass
        shutil.rmtree(work, ignore_errors=True)
    if out not in sys.path:
        sys.path.insert(0, out)
    import _input_sum
    return _input_sum.InputSumEngine


def sum_forward(cfg, w, rows, dead, hidden):
    """The oracle: the sum over heads of each token's rows, float64 then float32, [B, T, D]."""
    assert hidden is None
    B, T, H = rows.shape
    return np.asarray(w.table_f32(rows + w.offsets), np.float64).reshape(B, T, H, -1).sum(2).astype(np.float32)


def make_variant():
    demo = type(variants.get(variants.DEFAULT))   # the demo's config, weights and files

    class InputSumVariant(demo):
        name = NAME
        example_config = {"variant": NAME, "engram_vocab_size": [37, 53], "max_ngram_size": 3,
                          "n_embed_per_ngram": 24, "n_head_per_ngram": 2, "layer_ids": [0, 3], "pad_id": 1,
                          "kernel_size": 2, "hidden_size": 12, "hc_mult": 1, "vocab_size": 70}
        table_dtypes = ("float32",)
        engine = build_engine()

        def forward(self, cfg, w, rows, dead, hidden, ids):
            return sum_forward(cfg, w, rows, dead, hidden)

        def describe(self, cfg):
            return "the sum of a token's rows (an input layer)"

    return InputSumVariant()


if os.environ.get("ENGRAM_STREAM_INPUT_SUM") == "1":   # loaded as the plugin of the suites' own run
    variants.register(make_variant())


@pytest.fixture(scope="module")
def model():
    v = make_variant()
    registered = NAME not in variants.registered()
    if registered:
        variants.register(v)
    yield EngramModel.init(EngramConfig(**variants.get(NAME).example_config), seed=2)
    if registered:
        variants.unregister(NAME)


def _ids(model, seed, shape):
    return np.random.default_rng(seed).integers(-3, model.cfg.vocab_size, shape).astype(np.int64)


def test_the_contract_suites_pass_on_an_input_layer_variant():
    build_engine()   # built here once: the suites' process imports it
    passed = run_suite_with_plugin("test_input_layer", "ENGRAM_STREAM_INPUT_SUM",
                                   ["test_engine_contract.py", "test_serving.py"], NAME)
    assert passed >= 20


def test_an_input_layer_takes_a_token_and_returns_hidden_size_floats(model):
    L, D = 3, model.cfg.hidden_size
    assert model.variant.input_layer and not variants.get(variants.DEFAULT).input_layer
    ids = _ids(model, 1, (3, 9))
    want = model.forward(L, ids)                             # [B, T, D]: the oracle, no hidden
    assert want.shape == (3, 9, D)
    one = model.stream(L)
    assert one.input_layer and one.out_shape() == (D,) and one.out_shape(5) == (5, D)
    assert one.hidden_shape(5) is None
    got = [one.step(int(t)) for t in ids[0, :4]] + [one.step(int(t), None) for t in ids[0, 4:]]
    assert all(g.shape == (D,) and g.dtype == np.float32 for g in got)
    close(np.stack(got), want[0])
    many = model.stream(L, n_streams=3)
    close(np.stack([many.step(ids[:, p]) for p in range(9)], 1), want)
    assert many.step(ids[:, 0]).shape == (3, D)
    pre = model.stream(L)
    close(pre.prefill(ids[1]), want[1])
    out = np.empty((9, D), np.float32)
    packed = model.stream(L, n_streams=3)
    r = packed.step_packed(ids[:, :3].ravel(), None, streams=[0, 1, 2], lengths=[3, 3, 3], out=out)
    assert r is out
    close(out.reshape(3, 3, D), want[:, :3])
    fed = model.stream(L)
    fed.feed(int(ids[2, 0]))
    close(fed.compute(), want[2, 0])
    fed.feed(np.array([ids[2, 1]]))
    assert fed.compute().shape == (1, D)


def test_hidden_given_to_an_input_layer_or_missing_for_a_residual_one_is_refused(model):
    L, D = 0, model.cfg.hidden_size
    eng = model.stream(L)
    eng.step(5)
    before = eng.snapshot()
    h = np.zeros((D,), np.float32)
    for call in (lambda: eng.step(6, h), lambda: eng.prefill([6, 7], np.zeros((2, D), np.float32)),
                 lambda: eng.step_packed([6], np.zeros((1, D), np.float32), [0], [1])):
        with pytest.raises(ValueError, match="InputSumEngine serves an input layer .*takes no hidden; pass "
                                             "hidden=None"):
            call()
    eng.feed(6)
    with pytest.raises(ValueError, match="takes no hidden"):
        eng.compute(h)
    eng.compute()
    with pytest.raises(ValueError, match="forward takes no hidden"):
        model.forward(L, [[1, 2]], np.zeros((1, 2, 1, D), np.float32))
    eng.restore(before)
    close(eng.step(6), model.forward(L, [[5, 6]])[0, 1])
    demo = EngramModel.init(EngramConfig(**{k: v for k, v in model.cfg.to_dict().items() if k != "variant"}))
    res = demo.stream(0)
    with pytest.raises(ValueError, match=r"StreamEngine serves a residual layer: it needs hidden of shape \(1, 12\)"):
        res.step(5)
    with pytest.raises(ValueError, match=r"needs hidden of shape \(2, 1, 12\)"):
        res.prefill([5, 6])
    with pytest.raises(ValueError, match="needs hidden"):
        demo.forward(0, [[5]])
    assert res.tokens_seen.tolist() == [0]


def test_drafts_masks_snapshots_and_lookup_on_an_input_layer(model):
    L, D = 3, model.cfg.hidden_size
    ids = _ids(model, 4, (2, 8))
    want = model.forward(L, ids)
    eng = model.stream(L, n_streams=2)
    snap = eng.snapshot()
    out = eng.step_packed(ids[:, :4].ravel(), None, streams=[0, 1], lengths=[4, 4], draft=True)
    close(out.reshape(2, 4, D), want[:, :4])
    eng.commit([2, 1])   # slot 0 keeps 2 tokens, slot 1 one
    assert eng.tokens_seen.tolist() == [2, 1]
    close(eng.step_packed(np.concatenate([ids[0, 2:4], ids[1, 1:4]]), None, [0, 1], [2, 3]),
          np.concatenate([want[0, 2:4], want[1, 1:4]]))
    masked = np.array([False, True, False, False, True, False])
    fresh = model.stream(L, n_streams=2)
    got = fresh.step_packed(np.array([ids[0, 0], 9, ids[0, 1], ids[1, 0], 9, ids[1, 1]]), None, [0, 1], [3, 3],
                            masked=masked)
    assert got.shape == (6, D) and not got[masked].any()
    close(got[~masked], np.stack([want[0, 0], want[0, 1], want[1, 0], want[1, 1]]))
    eng.restore(snap)
    close(eng.prefill(ids[0], stream=0), want[0])
    rows = model.stream(L).lookup_packed(ids[0], [0], [8])
    table = model.layer(L).table_f32(model.plan.hash_numpy(ids[:1])[L][0] + model.plan.offsets[L])
    np.testing.assert_array_equal(rows, table.reshape(8, -1))


def test_the_decoder_runs_an_input_layer_with_no_hidden(model):
    D = model.cfg.hidden_size
    ids = _ids(model, 5, (1, 6))
    want = {L: model.forward(L, ids)[0] for L in model.cfg.layer_ids}
    dec = model.decoder()
    for p in range(3):
        dec.begin(int(ids[0, p]))
        for L in dec.layers:
            close(dec.layer(L), want[L][p])
    out = dec.step(int(ids[0, 3]))                        # no hiddens at all: every layer an input layer
    assert all(out[L].shape == (D,) for L in dec.layers)
    out = dec.step(int(ids[0, 4]), {0: None})             # an input layer's entry None, another left out
    close(out[3], want[3][4])
    with pytest.raises(ValueError, match=r"hiddens must have exactly the layers \[\] \(and may have the input "
                                         r"layers \[0, 3\], each None\), got \[7\]"):
        dec.step(int(ids[0, 5]), {7: None})
    with pytest.raises(ValueError, match="takes no hidden"):
        dec.step(int(ids[0, 5]), {0: np.zeros((1, D), np.float32)})
    assert not dec.pending()
    close(dec.step(int(ids[0, 5]))[0], want[0][5])
    pre = model.decoder().prefill(ids[0])
    close(pre[3], want[3])
    many = model.decoder(n_streams=2)
    both = np.stack([ids[0, :2], ids[0, 2:4]], 1)   # two streams
    many.begin_packed(both.T.ravel(), [0, 1], [2, 2])
    assert many.layer(0).shape == (4, D) and many.layer(3, None).shape == (4, D)


def test_the_tuner_measures_an_input_layer(model):
    """engine/tune.py times an input layer's operations with no hidden (model.stream measures the
    first engine of a model's shapes when tuning is on)."""
    from engram_stream.engine import isa, tune
    here = (isa.ISA_NAMES[isa.process_level()], 1)
    runs = tune._runners(model, 3)
    assert sorted(runs) == sorted(tune.OPS)
    for run in runs.values():
        run(here)
    table = tune.tune_model(model, 3, paths=[here[0]], threads=[1], budget=0.05)
    assert sorted(table) == sorted(tune.OPS) and all(e["isa"] == here[0] for e in table.values())


def test_the_cli_decodes_and_benches_an_input_layer(model, tmp_path, capsys):
    """engram-stream demo (decode checked against the oracle), bench and profile on an
    input-layer checkpoint: no hidden is made for it."""
    from engram_stream.cli import main
    path = model.save(tmp_path / "input-sum.st")
    assert main(["demo", "--checkpoint", str(path), "--tokens", "40", "--quiet"]) == 0
    assert "check against the batch path (atol 2e-5 + rtol 2e-4): OK" in capsys.readouterr().out
    assert main(["bench", "--checkpoint", str(path), "--layer", "3", "--steps", "10", "--streams", "2",
                 "--repeat", "2", "--quiet"]) == 0
    pytest.importorskip("memray")   # the profile command's tracker (the test extra installs it)
    assert main(["profile", str(path), "--steps", "20"]) == 0
