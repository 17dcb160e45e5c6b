"""Every place that lists the variants lists every registered one, from the registry: help(engram_stream),
EngramModel.load's and stream's docstrings, `inspect --help`, `init --help` and the not-a-checkpoint error.
help(engram_stream) and DESIGN.md said "both variants" and the error asked a Qwen folder for a
tokenizer.json (it named V4.1's folder alone) while three variants were registered."""
import pydoc
import re

import numpy as np
import pytest

import engram_stream
from engram_stream import EngramModel, variants
from engram_stream.cli import build_parser
from engram_stream.variants import describe_checkpoint

from helpers.models import contract_model, contract_variants

DemoVariant = type(variants.get(variants.DEFAULT))


class _Listed(DemoVariant):
    """A variant registered by this file alone: the live lists show it without a word elsewhere."""
    name = "docs-test-v0"
    title = "a variant of this test only"
    checkpoint_form = "one file of this test's own"


@pytest.fixture
def extra_variant():
    v = variants.register(_Listed())
    yield v
    variants.unregister(v.name)


def _flat(text):
    return " ".join(text.split())


def _subcommand_help(name):
    import argparse
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return _flat(sub.choices[name].format_help())


def test_help_of_the_package_names_every_variant():
    text = pydoc.render_doc(engram_stream)
    assert len(variants.registered()) >= 3   # the demo, Qwen and V4.1 at least: a list of one proves nothing
    for v in variants.variants():
        assert v.name in text and v.title and v.title in text, v.name
    assert variants.listing(lambda v: v.title, 4) in engram_stream.__doc__   # the registry's lines, as listed
    assert "Both " not in engram_stream.__doc__ and "both variants" not in engram_stream.__doc__


@pytest.mark.parametrize("method, line", [(EngramModel.load, describe_checkpoint),
                                          (EngramModel.stream, lambda v: v.engine.__name__)])
def test_load_and_stream_docstrings_name_every_variant(method, line):
    doc = method.__doc__
    assert "{variants}" not in doc
    assert variants.listing(line, 8) in doc
    for v in variants.variants():
        assert re.search(rf"^ +{re.escape(v.name)} +{re.escape(line(v))}$", doc, re.M), (v.name, doc)


def test_each_variant_says_what_its_checkpoint_is():
    for v in variants.variants():
        assert v.title and v.checkpoint_form, v.name
        assert ("folder" in v.checkpoint_form) == v.folder_checkpoint, v.name
    qwen = [v for v in variants.variants() if v.folder_checkpoint and "tokenizer" not in v.checkpoint_form.replace(
        "no tokenizer", "")]
    assert qwen, "a folder variant that reads no tokenizer (Qwen's) says so"


def test_inspect_and_init_help_name_every_variant(extra_variant):
    inspect_help, init_help = _subcommand_help("inspect"), _subcommand_help("init")
    for v in variants.variants():
        assert f"{v.name}: {_flat(describe_checkpoint(v))}" in inspect_help, v.name
        assert f"({v.name})" in init_help, v.name
    assert extra_variant.name in inspect_help   # from the registry: a variant registered later shows too


def test_not_a_checkpoint_names_every_variant_and_what_each_reads(tmp_path, extra_variant):
    with pytest.raises(ValueError) as e:
        EngramModel.load(str(tmp_path))   # a folder of nothing: no variant's
    msg = str(e.value)
    assert "not a checkpoint of any variant" in msg and str(tmp_path) in msg
    for v in variants.variants():
        assert re.search(rf"^ +{re.escape(v.name)} +{re.escape(describe_checkpoint(v))}$", msg, re.M), (v.name, msg)
    assert "not a deepseek-v4.1 folder" not in msg   # one variant's form is not the answer for every folder


def test_document_fills_a_docstring_from_the_registry(extra_variant):
    def f():
        """Head:
            {variants}
        tail."""
    variants.document(f, lambda v: v.title)
    assert f.__doc__ == "Head:\n" + variants.listing(lambda v: v.title, 12) + "\n        tail."
    assert re.search(rf"^ {{12}}{extra_variant.name} +{extra_variant.title}$", f.__doc__, re.M), f.__doc__
    with pytest.raises(ValueError, match="no {variants} line"):
        variants.document(f, lambda v: v.title)


# ---- token ids: negative ones are valid where the variant says so, and help(step) and the errors say so -----
def test_step_help_and_the_range_error_say_negative_ids_are_taken():
    assert variants.Variant.negative_ids is True   # the default (DESIGN.md 14)
    for variant in contract_variants():
        model = contract_model(variant)
        takes = variants.get(variant).negative_ids
        eng = model.stream(model.cfg.layer_ids[0])
        doc = _flat(pydoc.render_doc(type(eng).step))
        assert "a negative id is taken too" in doc and "step(-1, h) is a valid call" in doc, (variant, doc)
        assert "negative_ids is False refuses one" in doc, (variant, doc)
        h = None if model.variant.input_layer else np.ones((model.cfg.hc_mult, model.cfg.hidden_size), np.float32)
        V = model.cfg.vocab_size
        one = h if h is None else h[None]
        if takes:
            eng.step(-1, h)   # taken, as the help says
            said = rf"token id {V} out of range: ids must be < vocab_size={V} \(negative ids are taken too"
        else:   # refused by the engine (scalar and array) and the plan's two hashes, one message
            assert "negative id is refused" in _flat(type(eng).__doc__), variant
            neg = rf"token id -1 is negative: {variant} takes ids in \[0, vocab_size={V}\) only"
            for bad, hid in ((-1, h), (np.array([-1], np.int64), one)):
                with pytest.raises(ValueError, match=neg):
                    eng.step(bad, hid)
            for hash_ in (model.plan.hash, model.plan.hash_numpy):
                with pytest.raises(ValueError, match=neg):
                    hash_(np.array([[0, -1]]))
            said = rf"token id {V} out of range: ids must be in \[0, vocab_size={V}\)$"
        for bad, hid in ((V, h), (np.array([V], np.int64), one)):   # the scalar check and the array's
            with pytest.raises(ValueError, match=said):
                eng.step(bad, hid)
        with pytest.raises(ValueError, match=said):
            model.plan.hash(np.array([[0, V]]))
        with pytest.raises(ValueError, match=said):
            model.forward(model.cfg.layer_ids[0], np.array([[V]]), one if one is None else one[None])
