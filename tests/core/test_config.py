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
