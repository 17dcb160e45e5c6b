"""A model's keys in a Mooncake Store and the fingerprint beside each layer's heads (the
package doc, rows/mooncake/__init__.py, gives the layout)."""
from __future__ import annotations

import hashlib

import numpy as np

from ...io.memory import read_rows
from ..identity import layer_digests
from ..records import record_arrays, record_format, record_layout

FINGERPRINT_FORMAT = 2   # 2: with tables_digest
SAMPLES_PER_HEAD = 8


# ---- row records ---------------------------------------------------------------------------------
# tables: None (the records are the model's weights': record_arrays) or an opened tier whose records
# are its own (a GGUF's quantized rows: GGUFTables, its record_layout and formats), published as
# they are, "gguf:TYPE" in the fingerprint so that a model reading them from the store decodes them.

def layout_of(model, layer, tables=None):
    """(row bytes, scale bytes, record format) of a record of `layer`."""
    if tables is not None:
        return (*tables.record_layout(layer), tables.formats[layer])
    w = model.layer(layer)
    return (*record_layout(w), record_format(w))


def _tier_rows(tables, layer, rows) -> np.ndarray:
    """The records of absolute rows `rows` of `layer` as `tables` serves them (its own reader, no cache)."""
    rb, sb = tables.record_layout(layer)
    out = np.empty((len(rows), rb + sb), np.uint8)
    tables.source(layer).read_into(np.ascontiguousarray(rows, np.int64), out)
    return out


def head_records(model, layer, h, tables=None) -> np.ndarray:
    """Head h's rows of `layer` as records, uint8 [N_h, record bytes] (a view when it can be)."""
    lo = int(model.layer(layer).offsets[h])
    hi = lo + int(model.plan.head_primes[layer][h])
    if tables is not None:
        return _tier_rows(tables, layer, np.arange(lo, hi))
    rows, scales = record_arrays(model.layer(layer))
    if scales is None:
        return rows[lo:hi]
    return np.ascontiguousarray(np.concatenate([rows[lo:hi], scales[lo:hi]], axis=1))


def _prefix(name) -> str:
    return f"engram:{name}:" if name else "engram:"


def store_key(layer, h, name="") -> str:
    """The key of head h of `layer` under `name` ("": EngramStore's own `engram:l{L}:h{h}`)."""
    return f"{_prefix(name)}l{layer}:h{h}"


def fingerprint_key(layer, name="") -> str:
    return f"{_prefix(name)}l{layer}:fingerprint"


def sample_rows(n_h, layer, h) -> np.ndarray:
    """The head-local rows whose records the fingerprint covers: first, last and a few fixed ones."""
    rng = np.random.default_rng([0xE9, int(layer), int(h)])
    return np.unique(np.concatenate([[0, n_h - 1], rng.integers(0, n_h, SAMPLES_PER_HEAD - 2)])).astype(np.int64)


def sampled_records(model, layer, tables=None):
    """{head: (head-local rows, their records uint8 [k, record bytes])} of the fingerprint's sample.
    A model whose tables are a mapped file gets the rows by pread (rows.memory.read_rows): a
    model that reads its rows from a store checks them at load without bringing its local table
    into the page cache."""
    heads = [sample_rows(int(n_h), layer, h) for h, n_h in enumerate(model.plan.head_primes[layer])]
    absolute = np.concatenate([int(model.layer(layer).offsets[h]) + local for h, local in enumerate(heads)])
    if tables is not None:
        rec = _tier_rows(tables, layer, absolute)
    else:
        rows, scales = record_arrays(model.layer(layer))
        rec = read_rows(rows, absolute)
        if scales is not None:
            rec = np.concatenate([rec, read_rows(scales, absolute)], axis=1)
    out, at = {}, 0
    for h, local in enumerate(heads):
        out[h] = (local, np.ascontiguousarray(rec[at:at + local.size]))
        at += local.size
    return out


def fingerprint(model, layer, samples=None, digest=None, tables=None) -> dict:
    """What publish() writes beside a layer's heads: layout, the digest of every byte of the
    layer's tables and a digest of the sampled records (samples: sampled_records(model, layer)
    already read, or None; digest: layer_digests(model)[layer] already taken, or None). A
    tier's own records (tables: a GGUF's) add their record_format ("gguf:Q4_K")."""
    rowbytes, scalebytes, fmt = layout_of(model, layer, tables)
    digest = layer_digests(model, [layer], tables=tables)[layer] if digest is None else digest
    d = hashlib.blake2b(digest_size=16)
    for h, (local, rec) in (samples or sampled_records(model, layer, tables)).items():
        d.update(local.tobytes())
        d.update(rec.tobytes())
    fp = {"format": FINGERPRINT_FORMAT, "variant": model.cfg.variant, "layer": int(layer),
          "heads": [int(p) for p in model.plan.head_primes[layer]], "rowbytes": rowbytes,
          "scalebytes": scalebytes, "tables_digest": digest, "sample_digest": d.hexdigest()}
    if tables is not None:
        fp["record_format"] = fmt
    return fp
