"""Engram's tokenizer compression table: token id -> compressed id.

Engram hashes n-grams of *compressed* token ids, so that surface variants of
one word ("Hello", "hello", "HELLO", full-width "Ｈｅｌｌｏ", " hello" ...) land
on the same n-gram memory rows. The table is built once from the tokenizer
vocab, following the reference procedure (CompressedTokenizer in DeepSeek's
``engram_demo_v1.py``):

1. vocab is every id ``0..V-1``, V counting added/special tokens
   (``get_vocab_size(with_added_tokens=True)``).
2. Each id is decoded alone by the tokenizer's own decoder,
   ``skip_special_tokens=False``, without any clean-up of spaces.
3. If the decoded text contains U+FFFD (the id is a fragment of a multi-byte
   character, e.g. one byte of a byte-level BPE) the key is the raw token string
   (``id_to_token``): all such fragments decode to the same "\ufffd" and must
   not be merged with each other.
4. Otherwise the text is normalized with a ``tokenizers`` normalizer sequence:
   NFKC (compatibility forms: "ﬁ" -> "fi", "²" -> "2", full-width -> ASCII),
   NFD + StripAccents ("café" -> "cafe"; note that ``StripAccents`` drops every
   combining mark, categories Mn, Mc and Me), Lowercase, runs of space/tab/CR/LF
   -> one space, a text that is exactly one space is kept as " " (so pure
   whitespace tokens share one key instead of vanishing), Strip.
5. If the normalized text is empty the key is the raw decoded text.
6. Compressed ids are handed out in first-seen order over the keys, so they are
   dense ``0..C-1`` and ``lookup[0] == 0`` (what ``HashPlan`` requires).

Keys from step 3 and step 4/5 share one namespace, as in the reference.

``decode`` picks where step 2's text comes from. "python" (the default, the demo's
``tokenizer.decode``): a transformers tokenizer object decodes through its own Python
``decode`` (with whatever clean-up its config asks for) and names fragments with
``convert_ids_to_tokens``. "backend" (DeepSeek-V4.1's ``build_compressed_token_map``):
always the raw Rust decoder, ``backend_tokenizer.decode``, and its ``id_to_token``. A
tokenizer.json (a ``tokenizers.Tokenizer``) has no Python layer: both modes read it alike.

Tokenizers whose ids have holes (an id with no token, or ids at or past
``get_vocab_size``): the table is made long enough to cover the largest id in
``get_vocab(with_added_tokens=True)``, so every id the tokenizer can emit has
an entry (the reference would stop at V). A hole decodes to "" and so keys on
the raw text "": all holes share one compressed id (with any token that
decodes to ""). For a tokenizer without holes the table is exactly the
reference's.
"""
from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["build_compression", "compress_stats", "save_compression"]

_SENTINEL = "\ue000"  # private-use char protecting a lone " " from Strip
_IMPORT_MSG = ("build_compression needs the optional 'tokenizers' package: "
               "pip install '.[tokenizers]' from the engram_stream checkout")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # also raised when sys.modules["tokenizers"] is None
        raise ImportError(_IMPORT_MSG) from e
    return tokenizers


def _load(tokenizer, tk):
    """A tokenizers.Tokenizer from a Tokenizer, a transformers fast tokenizer or a path."""
    if isinstance(tokenizer, tk.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers PreTrainedTokenizerFast
    if isinstance(backend, tk.Tokenizer):
        return backend
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError("build_compression expects a path to a tokenizer.json (str or os.PathLike) "
                        f"or a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    path = os.fsdecode(os.fspath(tokenizer))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer.json not found: {path!r}")
    try:
        return tk.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad content
        raise ValueError(_not_a_tokenizer(path, e)) from None


def _not_a_tokenizer(path, error) -> str:
    """Why `path` is no tokenizer.json. tokenizers reports a JSON file of another shape (a
    config.json) as a JSON syntax error ("expected `,` or `}`"): such a file is named for what it
    is, and only a file that is not JSON gets the parser's line and column."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"{path!r} is not a valid tokenizer.json: not valid JSON ({e})"
    if isinstance(d, dict) and not {"model", "added_tokens"} <= set(d):
        return (f"{path!r} is not a valid tokenizer.json: valid JSON without \"model\" and \"added_tokens\" (a "
                f"config file?): pass the model's tokenizer.json, which holds its vocab")
    return f"{path!r} is not a valid tokenizer.json (tokenizers.Tokenizer.from_file failed: {error})"


DECODES = ("python", "backend")


def _python_decoder(tokenizer, tk):
    """(decode_batch, id_to_token) of a transformers tokenizer's Python layer, or None."""
    if isinstance(tokenizer, tk.Tokenizer) or not all(
            callable(getattr(tokenizer, n, None)) for n in ("decode", "convert_ids_to_tokens")):
        return None
    return (lambda ids: [tokenizer.decode(i, skip_special_tokens=False) for i in ids],
            tokenizer.convert_ids_to_tokens)


def build_compression(tokenizer, decode: str = "python") -> np.ndarray:
    """int64[vocab] table mapping each token id to its compressed id (see module doc).

    tokenizer: path to a ``tokenizer.json`` (or to a folder holding one), a
    ``tokenizers.Tokenizer``, or a transformers fast tokenizer. decode: "python" (the demo)
    or "backend" (DeepSeek-V4.1: the raw backend decoder's text).
    """
    if decode not in DECODES:
        raise ValueError(f"build_compression: decode must be one of {DECODES}, got {decode!r}")
    tk = _tokenizers()
    python_layer = _python_decoder(tokenizer, tk) if decode == "python" else None
    tok = _load(tokenizer, tk)
    norm = tk.normalizers
    normalizer = norm.Sequence([
        norm.NFKC(),
        norm.NFD(),
        norm.StripAccents(),
        norm.Lowercase(),
        norm.Replace(tk.Regex(r"[ \t\r\n]+"), " "),
        norm.Replace(tk.Regex(r"^ $"), _SENTINEL),
        norm.Strip(),
        norm.Replace(_SENTINEL, " "),
    ])
    ids = tok.get_vocab(with_added_tokens=True).values()
    vocab = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    if vocab == 0:
        raise ValueError("build_compression: the tokenizer has an empty vocab")

    decode_batch, id_to_token = python_layer or (
        lambda ids: tok.decode_batch(ids, skip_special_tokens=False), tok.id_to_token)
    texts = decode_batch([[i] for i in range(vocab)])
    key_ids: dict = {}
    lookup = np.empty(vocab, dtype=np.int64)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = id_to_token(i)
            if key is None:  # cannot happen for a decodable id; keep the text then
                key = text
        else:
            key = normalizer.normalize_str(text) or text
        lookup[i] = key_ids.setdefault(key, len(key_ids))
    return lookup


def compress_stats(lookup) -> dict:
    """{'vocab': V, 'compressed_vocab': C, 'ratio': C / V} of a compression table."""
    a = np.asarray(lookup)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer) or a.size == 0:
        raise ValueError(f"compression table must be a non-empty 1-d integer array, "
                         f"got dtype {a.dtype} shape {a.shape}")
    vocab, compressed = int(a.size), int(a.max()) + 1
    return {"vocab": vocab, "compressed_vocab": compressed, "ratio": compressed / vocab}


def save_compression(lookup, path) -> str:
    """Write the table as an int64 ``.npy`` file (``np.load`` reads it back); returns the path."""
    path = os.fsdecode(os.fspath(path))
    if not path.endswith(".npy"):
        path += ".npy"
    np.save(path, np.ascontiguousarray(lookup, dtype=np.int64), allow_pickle=False)
    return path
