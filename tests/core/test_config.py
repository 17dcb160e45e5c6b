"""EngramConfig: demo defaults, validation (every rule names its field), derived geometry,
serialization round trips.

Expected values are written out by hand from DESIGN.md (demo defaults, section 1) and
from the definitions of the derived quantities, never read back from the code under test.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engram_stream import EngramConfig

DEMO = dict(engram_vocab_size=[646400, 646400], max_ngram_size=3, n_embed_per_ngram=512,
            n_head_per_ngram=8, layer_ids=[1, 15], pad_id=2, seed=0, kernel_size=4,
            hidden_size=1024, hc_mult=4, vocab_size=129280)

TINY = dict(engram_vocab_size=[11, 13, 17], max_ngram_size=4, n_embed_per_ngram=12,
            n_head_per_ngram=3, layer_ids=[2, 0, 7], pad_id=5, seed=3, kernel_size=3,
            hidden_size=6, hc_mult=2, vocab_size=40)


def tiny(**kw):
    d = dict(TINY)
    d.update(kw)
    return d


# --- defaults -------------------------------------------------------------------------------

def test_defaults_are_the_demo_defaults():
    cfg = EngramConfig()
    for name, want in DEMO.items():
        got = getattr(cfg, name)
        assert got == want and type(got) is type(want), (name, got, want)


def test_default_lists_are_not_shared_between_instances():
    a, b = EngramConfig(), EngramConfig()
    assert a.layer_ids is not b.layer_ids
    assert a.engram_vocab_size is not b.engram_vocab_size


def test_frozen():
    cfg = EngramConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 7


def test_explicit_demo_equals_default():
    assert EngramConfig(**DEMO) == EngramConfig()
    assert EngramConfig(**tiny()) != EngramConfig()


# --- derived geometry (by hand) ---------------------------------------------------------------

def test_derived_demo():
    cfg = EngramConfig()
    assert cfg.head_dim == 512 // 8 == 64
    assert cfg.n_heads == (3 - 1) * 8 == 16
    assert cfg.engram_dim == (3 - 1) * 512 == 1024
    assert cfg.conv_len == (4 - 1) * 3 == 9


def test_derived_tiny():
    cfg = EngramConfig(**tiny())
    assert cfg.head_dim == 4
    assert cfg.n_heads == 9
    assert cfg.engram_dim == 36
    assert cfg.conv_len == 8


@pytest.mark.parametrize("K,n,want", [(1, 2, 0), (2, 2, 2), (5, 4, 16), (4, 5, 15)])
def test_conv_len(K, n, want):
    cfg = EngramConfig(**tiny(kernel_size=K, max_ngram_size=n, engram_vocab_size=[11] * (n - 1)))
    assert cfg.conv_len == want


# --- validation ---------------------------------------------------------------------------------

POSITIVE = ["n_embed_per_ngram", "n_head_per_ngram", "kernel_size", "hidden_size", "hc_mult",
            "vocab_size"]


@pytest.mark.parametrize("name", POSITIVE)
@pytest.mark.parametrize("value", [0, -1, -1000])
def test_non_positive_sizes_rejected(name, value):
    with pytest.raises(ValueError, match=name):
        EngramConfig(**tiny(**{name: value}))


@pytest.mark.parametrize("value", [(1 << 31) + 1, 1 << 62, 1 << 70])
def test_vocab_size_upper_bound(value):
    """vocab_size is the length of an int64 lookup table and every engine's id bound (a C int64)."""
    with pytest.raises(ValueError, match="vocab_size"):
        EngramConfig(**tiny(vocab_size=value))
    EngramConfig(**tiny(vocab_size=1 << 31))


@pytest.mark.parametrize("name", POSITIVE + ["max_ngram_size", "seed", "pad_id"])
@pytest.mark.parametrize("value", [True, False, 3.0, 2.5, "3", None, [3]])
def test_non_int_scalars_rejected(name, value):
    with pytest.raises(TypeError, match=name):
        EngramConfig(**tiny(**{name: value}))


def test_numpy_integers_accepted_and_normalized_to_int():
    cfg = EngramConfig(**tiny(hidden_size=np.int64(6), engram_vocab_size=np.array([11, 13, 17]),
                              layer_ids=(np.int32(2), 0, 7)))
    assert type(cfg.hidden_size) is int and cfg.hidden_size == 6
    assert cfg.engram_vocab_size == [11, 13, 17] and all(type(v) is int for v in cfg.engram_vocab_size)
    assert cfg.layer_ids == [2, 0, 7] and all(type(v) is int for v in cfg.layer_ids)


@pytest.mark.parametrize("n", [1, 0, -3])
def test_max_ngram_below_2_rejected(n):
    with pytest.raises(ValueError, match="max_ngram_size"):
        EngramConfig(**tiny(max_ngram_size=n, engram_vocab_size=[11]))


def test_seed_negative_rejected():
    with pytest.raises(ValueError, match="seed"):
        EngramConfig(**tiny(seed=-1))


@pytest.mark.parametrize("evs", [[11, 13], [11, 13, 17, 19], [], [11]])
def test_engram_vocab_size_wrong_length(evs):
    with pytest.raises(ValueError, match="engram_vocab_size"):
        EngramConfig(**tiny(engram_vocab_size=evs))


@pytest.mark.parametrize("evs", [[1, 13, 17], [11, 0, 17], [11, 13, -5]])
def test_engram_vocab_size_entries_below_2(evs):
    with pytest.raises(ValueError, match=r"engram_vocab_size"):
        EngramConfig(**tiny(engram_vocab_size=evs))


def test_engram_vocab_size_entry_2_is_the_minimum():
    EngramConfig(**tiny(engram_vocab_size=[2, 2, 2]))


@pytest.mark.parametrize("evs", [[11, 13.0, 17], [11, True, 17], "abc", 11, [11, "13", 17], None])
def test_engram_vocab_size_types(evs):
    with pytest.raises(TypeError, match="engram_vocab_size"):
        EngramConfig(**tiny(engram_vocab_size=evs))


@pytest.mark.parametrize("emb,heads", [(12, 5), (10, 3), (7, 2)])
def test_embed_not_divisible_by_heads(emb, heads):
    with pytest.raises(ValueError, match="n_embed_per_ngram"):
        EngramConfig(**tiny(n_embed_per_ngram=emb, n_head_per_ngram=heads))


@pytest.mark.parametrize("ids", [[0, 0], [1, 15, 1], [3, 2, 3]])
def test_duplicate_layer_ids(ids):
    with pytest.raises(ValueError, match="layer_ids"):
        EngramConfig(**tiny(layer_ids=ids))


@pytest.mark.parametrize("ids", [[-1], [0, -2], [5, -1, 3]])
def test_negative_layer_ids(ids):
    with pytest.raises(ValueError, match="layer_ids"):
        EngramConfig(**tiny(layer_ids=ids))


def test_empty_layer_ids():
    with pytest.raises(ValueError, match="layer_ids"):
        EngramConfig(**tiny(layer_ids=[]))


@pytest.mark.parametrize("ids", [[1.0], [True], ["1"], 1, "12"])
def test_layer_ids_types(ids):
    with pytest.raises(TypeError, match="layer_ids"):
        EngramConfig(**tiny(layer_ids=ids))


@pytest.mark.parametrize("pad", [-1, 40, 41, 10**6])
def test_pad_id_out_of_range(pad):
    with pytest.raises(ValueError, match="pad_id"):
        EngramConfig(**tiny(pad_id=pad))


@pytest.mark.parametrize("pad", [0, 39])
def test_pad_id_bounds_inclusive(pad):
    assert EngramConfig(**tiny(pad_id=pad)).pad_id == pad


def test_seed_plus_layer_stride_must_fit_int64():
    big = (1 << 63) - 1 - 10007 * 7
    EngramConfig(**tiny(seed=big))                    # exactly INT64_MAX: fine
    with pytest.raises(ValueError, match="seed"):
        EngramConfig(**tiny(seed=big + 1))


# --- serialization --------------------------------------------------------------------------

def test_to_dict_is_plain_and_complete():
    cfg = EngramConfig(**tiny())
    d = cfg.to_dict()
    assert d == TINY
    d["layer_ids"].append(99)            # a copy: mutating it must not touch the config
    assert cfg.layer_ids == [2, 0, 7]


@pytest.mark.parametrize("kw", [DEMO, TINY, tiny(hc_mult=1, kernel_size=1)])
def test_dict_and_json_round_trip(kw):
    cfg = EngramConfig(**kw)
    assert EngramConfig.from_dict(cfg.to_dict()) == cfg
    js = cfg.to_json()
    assert json.loads(js) == kw
    assert EngramConfig.from_dict(json.loads(js)) == cfg


def test_from_dict_partial_uses_defaults():
    cfg = EngramConfig.from_dict({"hidden_size": 64, "hc_mult": 1})
    assert cfg.hidden_size == 64 and cfg.hc_mult == 1
    assert cfg.engram_vocab_size == [646400, 646400] and cfg.layer_ids == [1, 15]


def test_from_dict_unknown_fields_rejected():
    d = dict(TINY, bogus_field=1)
    with pytest.raises(ValueError, match="bogus_field"):
        EngramConfig.from_dict(d)


def test_from_dict_validates():
    with pytest.raises(ValueError, match="pad_id"):
        EngramConfig.from_dict(dict(TINY, pad_id=40))


@pytest.mark.parametrize("bad", [None, [("hidden_size", 4)], "{}"])
def test_from_dict_non_dict(bad):
    with pytest.raises(TypeError):
        EngramConfig.from_dict(bad)


def test_from_dict_names_the_field_an_unknown_one_resembles():
    with pytest.raises(ValueError, match=r"unknown fields \['max_ngram', 'totally_bogus'\] \('max_ngram': did you "
                                         r"mean 'max_ngram_size'\?\)$"):
        EngramConfig.from_dict(dict(TINY, max_ngram=4, totally_bogus=1))


# --- a model's config.json (from_hf_config): keys the user may have misspelled --------------------
QWEN = "qwen3.8-flash-next"
V41 = "deepseek-v4.1"


def _hf(variant, **keys):
    """The config.json keys of the variant's example config, with `keys` over them (None: left out)."""
    from engram_stream import variants
    d = EngramConfig(**variants.get(variant).example_config).to_hf_config()
    d.update(keys)
    return {k: v for k, v in d.items() if v is not None}


def _config_key_warnings(d, **overrides):
    import warnings
    from engram_stream.errors import ConfigKeyWarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = EngramConfig.from_hf_config(d, **overrides)
    return cfg, [str(w.message) for w in caught if w.category is ConfigKeyWarning]


def test_a_misspelled_qwen_key_is_a_warning_naming_the_key_it_resembles():
    """ngram_vocab_base for ngram_vocab_size_base: the table sizes came from transformers' default
    (20,000,000) without a word."""
    cfg, said = _config_key_warnings(_hf(QWEN, ngram_vocab_size_base=None, ngram_vocab_base=1000))
    assert cfg.engram_vocab_size == [20_000_000, 20_000_000]   # the key's default, as transformers reads it
    assert said == ["config.json: key 'ngram_vocab_base' is not read by qwen3.8-flash-next: did you mean "
                    "'ngram_vocab_size_base'? ('ngram_vocab_size_base' is absent: its default 20000000 is used)"]


@pytest.mark.parametrize("variant, key, value, closest", [
    (V41, "engram_num_embedding", [5, 5], "'engram_num_embeddings'? ('engram_num_embeddings' is absent: not set)"),
    (QWEN, "ple_embed_size", 32, "'ple_embed_dim'?"),
    (QWEN, "max_ngram_size", 4, "'ngram_size'?"),     # an EngramConfig field's name in config.json
    (QWEN, "hc_mult", 2, "'hc_count'?"),
])
def test_an_engram_looking_key_no_variant_reads_is_named(variant, key, value, closest):
    _, said = _config_key_warnings(_hf(variant, **{key: value}))
    assert len(said) == 1 and said[0].startswith(f"config.json: key {key!r} is not read by {variant}: did you "
                                                 f"mean {closest}"), said


def test_a_path_is_named_in_the_warning_and_a_broken_file_gives_its_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf(QWEN, ple_layers=[1, 2])))
    _, said = _config_key_warnings(str(path))
    assert said == [f"{path}: key 'ple_layers' is not read by qwen3.8-flash-next: did you mean 'ple_layer_ids'?"]
    path.write_text('{\n  "model_type": "qwen4_exp_text",\n  "ple_layer_ids": [1,\n}\n')
    with pytest.raises(ValueError, match=f"{path}: not valid JSON \\(Expecting value: line 4 column 1"):
        EngramConfig.from_hf_config(str(path))


def test_a_whole_models_other_keys_are_not_warned_about():
    """transformers' own Qwen4-Exp (flat and multimodal) and DeepSeek-V4 config.json keys: dozens
    no Engram reads (architectures, num_attention_heads, linear_conv_kernel_dim, pad_token_id, ...),
    none of them a warning."""
    pytest.importorskip("transformers")
    from engram_stream import variants
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig, Qwen4ExpTextConfig
    text = Qwen4ExpTextConfig(ple_layer_ids=[2, 5], eos_token_id=1).to_dict()
    full = Qwen4ExpConfig(text_config=dict(ple_layer_ids=[2, 5], eos_token_id=1)).to_dict()
    v41 = EngramConfig(**variants.get(V41).example_config)
    ds = DeepseekV4Config(hidden_size=v41.hidden_size, vocab_size=v41.vocab_size, hc_mult=v41.hc_mult,
                          rms_norm_eps=v41.norm_eps).to_dict()
    for d, variant in ((text, QWEN), (full, QWEN), ({**ds, **v41.to_hf_config()}, V41)):
        assert len(d) + len(d.get("text_config") or {}) > 30
        cfg, said = _config_key_warnings(d)
        assert cfg.variant == variant and said == [], said


def test_every_key_a_variant_writes_is_one_it_reads():
    """HF_KEYS (what the warnings compare with) holds every key to_hf_config writes, and the
    defaults' keys: a key the variant reads is never reported."""
    from engram_stream import variants
    for v in variants.variants():
        if not v.hf_config:
            continue
        read, own, defaults = v.hf_config_keys()
        written = EngramConfig(**v.example_config).to_hf_config()
        assert set(written) <= set(read) and set(own) <= set(read) and set(defaults) <= set(read), v.name
        assert _config_key_warnings(written)[1] == []


def test_from_hf_config_refuses_an_unknown_keyword_naming_the_closest_field():
    with pytest.raises(TypeError, match=r"from_hf_config: unknown fields \['max_ngram', 'totally_bogus'\] "
                                        r"\('max_ngram': did you mean 'max_ngram_size'\?\)"):
        EngramConfig.from_hf_config(_hf(QWEN), totally_bogus=1, max_ngram=4)
    assert EngramConfig.from_hf_config(_hf(QWEN), table_parts=8).table_parts == 8   # a field: taken
