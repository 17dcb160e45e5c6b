"""A third variant, registered from this file alone (no shared file names it), passes the engine
and serving contract suites.

The toy is the demo module under its own name with a rule of its own (one hyper-connection pair:
hc_mult 2) and its own example config. It is registered only in a pytest run of its own (this
file loaded as a plugin, `-p test_toy_variant` with ENGRAM_STREAM_TOY=1), so the main run's
registry holds the built-in variants alone."""
import dataclasses
import os

import pytest

from engram_stream import EngramConfig, EngramModel, variants

from conftest import run_suite_with_plugin

TOY = "toy-v0"


def _validate(cfg, put):
    if cfg.hc_mult != 2:
        raise ValueError(f"EngramConfig.hc_mult must be 2 for {TOY}, got {cfg.hc_mult}")


def toy_variant():
    demo = variants.get(variants.DEFAULT)
    return dataclasses.replace(
        demo, name=TOY, validate_config=_validate,
        example_config={"variant": TOY, "engram_vocab_size": [37, 53], "max_ngram_size": 3, "n_embed_per_ngram": 8,
                        "n_head_per_ngram": 2, "layer_ids": [2, 5], "pad_id": 1, "kernel_size": 2,
                        "hidden_size": 24, "hc_mult": 2, "vocab_size": 70},
        describe=lambda cfg: f"the demo module, hc_mult {cfg.hc_mult}")


if os.environ.get("ENGRAM_STREAM_TOY") == "1":   # loaded as the plugin of the suite's own run
    variants.register(toy_variant())


def test_the_contract_suites_pass_on_a_variant_registered_here():
    passed = run_suite_with_plugin("test_toy_variant", "ENGRAM_STREAM_TOY",
                                   ["test_engine_contract.py", "test_serving.py"], TOY)
    assert passed >= 20   # the suites ran on the toy


def test_the_toy_is_not_registered_in_this_run():
    assert TOY not in variants.registered()
    with pytest.raises(ValueError, match="must be one of"):
        EngramConfig(variant=TOY)


def test_a_registered_variant_is_asked_for_its_config_rule_and_files(tmp_path):
    """Registered, the toy is a variant like the others: its own rule refuses a config, a model of
    it saves and loads back under its own name."""
    toy = variants.register(toy_variant())
    try:
        with pytest.raises(ValueError, match="hc_mult must be 2"):
            EngramConfig(**dict(toy.example_config, hc_mult=1))
        m = EngramModel.init(EngramConfig(**toy.example_config), seed=1)
        assert m.variant is toy and m.cfg.to_dict()["variant"] == TOY
        back = EngramModel.load(m.save(tmp_path / "toy.st"))
        assert back.cfg == m.cfg and back.variant is toy
    finally:
        variants.unregister(TOY)
