"""build_compression on tokenizers trained here, checked against an independent oracle.

The oracle recomputes every key with python's unicodedata/re (not with the
tokenizers normalizers the code uses) and the expected table is derived from
those keys, so a wrong normalization step, a wrong vocab length, a wrong decode
flag or a wrong id order shows up as a mismatch.
"""
import json
import re
import sys
import unicodedata

import numpy as np
import pytest

tk = pytest.importorskip("tokenizers")
from hypothesis import given, settings, strategies as st  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from engram_stream import EngramConfig, HashPlan  # noqa: E402
from engram_stream.compression import build_compression, compress_stats, save_compression  # noqa: E402
from helpers.processes import run_python

CORPUS = [
    "Hello hello HELLO HeLLo world", "hello world, Hello World!", "HELLO world",
    "café cafe CAFÉ Café cafe", "ﬁne ﬁ fi fi fine", "Ｈｅｌｌｏ Ｈｅｌｌｏ",
    "x² x2 2 ²", "¡hola! ¡hola!", "a  b\tc\n\nd\r\ne", "  indented\ttab\n\nnewlines",
]
SPECIALS = ["<s>", "</s>", "<pad>", "<|EOT|>"]
# added (non-special) tokens: whitespace runs, compatibility/accent forms, a case variant of a special
ADDED = ["  ", "\t", "\n\n", "\r\n", " \t \n", "Ｈｅｌｌｏ", "ﬁ", "²", "CAFÉ", "cafe\u0301", "<|eot|>"]

# Unicode White_Space (what the Rust Strip normalizer strips; python's str.strip() also strips \x1c-\x1f)
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + \
    "\u2028\u2029\u202f\u205f\u3000"


def oracle_normalize(text):
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    # tokenizers' StripAccents drops every combining mark (Mn, Mc and Me), see test_strip_accents_drops_all_marks
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
    s = s.lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    return s if s == " " else s.strip(WHITE_SPACE)


def oracle_keys(tok, vocab):
    keys = []
    for i in range(vocab):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            keys.append(tok.id_to_token(i))
        else:
            keys.append(oracle_normalize(text) or text)
    return keys


def first_seen(keys):
    ids = {}
    return np.array([ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64)


def partition(labels):
    groups = {}
    for i, k in enumerate(labels):
        groups.setdefault(k, set()).add(i)
    return sorted(sorted(g) for g in groups.values())


def ids_decoding_to(tok, text):
    return [i for i in range(tok.get_vocab_size(with_added_tokens=True))
            if tok.decode([i], skip_special_tokens=False) == text]


def _train(model, pre, dec, trainer):
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre
    tok.decoder = dec
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens(SPECIALS[3:])
    tok.add_tokens(ADDED)
    return tok


@pytest.fixture(scope="module")
def bytelevel():
    return _train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                  trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS[:3], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))


@pytest.fixture(scope="module")
def metaspace():
    return _train(models.BPE(unk_token="<unk>"), pre_tokenizers.Metaspace(), decoders.Metaspace(),
                  trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"] + SPECIALS[:3],
                                      show_progress=False))


@pytest.fixture(scope="module")
def bytelevel_lookup(bytelevel):
    return build_compression(bytelevel)


# --- the table against the oracle ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["bytelevel", "metaspace"])
def test_matches_independent_oracle(name, request):
    tok = request.getfixturevalue(name)
    lookup = build_compression(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert vocab > tok.get_vocab_size(with_added_tokens=False)  # added tokens exist and are counted
    assert isinstance(lookup, np.ndarray) and lookup.dtype == np.int64 and lookup.shape == (vocab,)
    keys = oracle_keys(tok, vocab)
    assert partition(lookup.tolist()) == partition(keys)  # same classes: equal forms share, others don't
    np.testing.assert_array_equal(lookup, first_seen(keys))  # and numbered in first-seen order
    assert lookup.max() + 1 < vocab  # something was actually merged


def test_dense_first_seen_order(bytelevel_lookup):
    lk = bytelevel_lookup
    assert lk[0] == 0
    values, first_index = np.unique(lk, return_index=True)
    np.testing.assert_array_equal(values, np.arange(lk.max() + 1))  # dense 0..C-1
    assert np.all(np.diff(first_index) > 0)  # id c+1 first appears after id c
    # each new id is exactly one more than the largest seen so far
    running = np.maximum.accumulate(lk)
    assert np.all(np.diff(running) <= 1) and np.all(lk <= running)


def test_variant_groups(bytelevel, bytelevel_lookup):
    lk = bytelevel_lookup

    def cid(*texts):
        ids = [i for t in texts for i in ids_decoding_to(bytelevel, t)]
        found = {bytelevel.decode([i], skip_special_tokens=False) for i in ids}
        assert found == set(texts), f"corpus did not produce tokens for {set(texts) - found}"
        got = {int(lk[i]) for i in ids}
        assert len(got) == 1, f"{texts} should share one compressed id, got {got}"
        return got.pop()

    groups = {
        "hello": cid("hello", "Hello", "HELLO", " hello", " Hello", " HELLO", "Ｈｅｌｌｏ", " Ｈｅｌｌｏ"),
        "cafe": cid("café", " cafe", " Café", " CAFÉ", "cafe\u0301"),
        "fi": cid(" fi", "ﬁ", " ﬁ"),
        "2": cid("2", "²", " 2"),
        "space": cid(" ", "  ", "\t", "\n", "\n\n", "\r\n", " \t \n"),
        "eot": cid("<|EOT|>", "<|eot|>"),  # the special token is decoded (skip_special_tokens=False)
        "<s>": cid("<s>"),
        "world": cid(" world", " World"),
    }
    assert len(set(groups.values())) == len(groups), groups


def test_replacement_char_keys_on_raw_token(bytelevel, bytelevel_lookup):
    lk = bytelevel_lookup
    vocab = len(lk)
    frag = [i for i in range(vocab) if "\ufffd" in bytelevel.decode([i], skip_special_tokens=False)]
    assert len(frag) > 50  # lone high bytes and pieces of multi-byte chars
    raw = [bytelevel.id_to_token(i) for i in frag]
    # all decode to text with U+FFFD, yet distinct raw strings keep distinct ids
    assert len({int(lk[i]) for i in frag}) == len(set(raw)) == len(frag)
    # the lone byte 0xA1 is the byte-level char "¡": it keys on "¡", the key of the token decoding to " ¡"
    lone = bytelevel.token_to_id("¡")
    assert "\ufffd" in bytelevel.decode([lone], skip_special_tokens=False)
    (full,) = ids_decoding_to(bytelevel, " ¡")
    assert lk[lone] == lk[full]
    # non-special added tokens go through the ByteLevel decoder too: "É" is the byte-level char of the
    # lone byte 0xC9, so the added token "CAFÉ" decodes to "CAF\ufffd" and keys on "CAFÉ", not on "cafe"
    added = bytelevel.token_to_id("CAFÉ")
    assert bytelevel.decode([added], skip_special_tokens=False) == "CAF\ufffd"
    (cafe,) = ids_decoding_to(bytelevel, " cafe")
    assert lk[added] != lk[cafe] and list(lk).count(lk[added]) == 1


def test_metaspace_bare_marker_keys_on_empty_text(metaspace):
    lk = build_compression(metaspace)
    bare = metaspace.token_to_id("▁")
    assert metaspace.decode([bare], skip_special_tokens=False) == ""  # normalizes to "", key is raw ""
    assert lk[bare] != lk[metaspace.token_to_id("<unk>")]


WORD_CHARS = st.sampled_from(list("aAbBeEzZ2 \t\n\r") + ["\u00e9", "\u00c9", "\u0301", "ﬁ", "²", "Ａ",
                                                         "ｅ", "\u0903", "\u20dd", "ß", "Ⅻ", "\u3000"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(WORD_CHARS, min_size=1, max_size=4), min_size=1, max_size=25, unique=True))
def test_wordlevel_random_vocab_matches_oracle(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}))
    lookup = build_compression(tok)
    np.testing.assert_array_equal(lookup, first_seen(oracle_keys(tok, len(words))))


def test_strip_accents_drops_all_marks():
    # pins the fact the oracle relies on: StripAccents drops Mc/Me marks, not only Mn
    n = tk.normalizers.StripAccents()
    assert n.normalize_str("e\u0301") == "e"
    assert n.normalize_str("\u0915\u093e") == "\u0915"  # Mc
    assert n.normalize_str("a\u20dd") == "a"  # Me


# --- vocab with holes ----------------------------------------------------------------------------

def test_vocab_with_holes():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "A": 3, "b": 5}, unk_token="[UNK]"))
    assert tok.get_vocab_size(with_added_tokens=True) == 4  # smaller than max id + 1
    lookup = build_compression(tok)
    # ids 2 and 4 have no token: they decode to "" and share the key ""; id 5 is still covered
    np.testing.assert_array_equal(lookup, [0, 1, 2, 1, 2, 3])
    plan = HashPlan(_cfg(len(lookup)), compression=lookup)
    assert plan.compressed_vocab == 4


def test_empty_vocab_raises():
    with pytest.raises(ValueError, match="empty vocab"):
        build_compression(Tokenizer(models.WordLevel({}, unk_token="[UNK]")))


# --- inputs --------------------------------------------------------------------------------------

def test_path_and_instance_inputs_agree(bytelevel, bytelevel_lookup, tmp_path):
    path = tmp_path / "tokenizer.json"
    bytelevel.save(str(path))
    np.testing.assert_array_equal(build_compression(str(path)), bytelevel_lookup)
    np.testing.assert_array_equal(build_compression(path), bytelevel_lookup)
    np.testing.assert_array_equal(build_compression(tmp_path), bytelevel_lookup)  # folder holding one

    class FastTokenizerLike:  # transformers' PreTrainedTokenizerFast exposes backend_tokenizer
        backend_tokenizer = bytelevel
    np.testing.assert_array_equal(build_compression(FastTokenizerLike()), bytelevel_lookup)


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_compression(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_compression(str(tmp_path))  # a folder without tokenizer.json
    for bad in (object(), 42, None, b"tokenizer.json", ["tokenizer.json"]):
        with pytest.raises(TypeError, match="tokenizer"):
            build_compression(bad)
    not_tok = tmp_path / "config.json"
    not_tok.write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        build_compression(not_tok)
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\xffnot json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        build_compression(garbage)


def test_missing_tokenizers_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(ImportError, match=re.escape("pip install '.[tokenizers]'")):
        build_compression("tokenizer.json")


def test_module_import_does_not_import_tokenizers():
    code = "import sys, engram_stream.compression; assert 'tokenizers' not in sys.modules"
    run_python(["-c", code], check=True)


# --- HashPlan, stats, saving ---------------------------------------------------------------------

def _cfg(vocab, pad_id=0):
    return EngramConfig(engram_vocab_size=[1009, 1013], max_ngram_size=3, n_embed_per_ngram=16,
                        n_head_per_ngram=2, layer_ids=[1, 3], pad_id=pad_id, seed=0, kernel_size=4,
                        hidden_size=32, hc_mult=1, vocab_size=vocab)


def test_hashplan_accepts_table(bytelevel, bytelevel_lookup):
    lk = bytelevel_lookup
    pad = bytelevel.token_to_id("<pad>")
    plan = HashPlan(_cfg(len(lk), pad_id=pad), compression=lk)
    assert plan.compressed_vocab == lk.max() + 1
    assert plan.pad_id == lk[pad]
    np.testing.assert_array_equal(plan.compress(np.arange(len(lk))), lk)


def test_compress_stats_and_save(bytelevel_lookup, tmp_path):
    lk = bytelevel_lookup
    stats = compress_stats(lk)
    assert stats == {"vocab": len(lk), "compressed_vocab": int(lk.max()) + 1,
                     "ratio": (int(lk.max()) + 1) / len(lk)}
    assert 0 < stats["ratio"] < 1
    with pytest.raises(ValueError):
        compress_stats(np.array([0.5, 1.0]))
    out = save_compression(lk, tmp_path / "lookup")
    assert out.endswith("lookup.npy")
    back = np.load(out)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, lk)
