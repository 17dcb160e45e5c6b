#!/usr/bin/env python
"""Generate the DeepSeek-V4.1 golden vectors in tests/data/golden_v41_<name>.npz.

What this is
------------
An INDEPENDENT re-implementation, in torch, of DeepSeek-V4.1-Flash's Engram
(`inference/engram.py`: EngramLayout, NgramHashState; `inference/model.py`:
ParallelEngramEmbedding, Linear with float8 weights, Engram; the fp8 kernels
act_quant / fp8_gemm as their CPU port describes them). It does not import
engram_stream: the package is tested against what this script writes.

Departures from the reference, all outside the numerics:
  * the compression comes from a given table (dense, with collisions) or the
    identity, not from a tokenizer (build_compressed_token_map is tested apart);
  * DEAD positions are the ids equal to image_token_id (the reference marks
    image spans through token_types; every span position carries that id), and
    negative ids are "unknown": they enter the cache as DEAD (block history) but
    do not close the gate (the reference would index token_map with them);
  * the prime search uses trial division (tools/goldens/demo.py) instead of sympy.isprime;
  * the torch default dtype is set per run: float32 gives `delta_f32`, the
    precision of the package's oracle; bfloat16 (what generate.py runs) gives
    the reference's own output `out_bf16` = bf16(h + delta).

Each npz holds
  config_json         EngramConfig fields (variant "deepseek-v4.1")
  compression         int64[vocab]      (only when a table is used)
  ids                 int64[B, T]       raw ids (DEAD tokens, negatives, pads at the start)
  hidden              float32[B, T, G, D]  (bf16-representable: both runs see the same h)
  dead                bool[B, T]        gate-0 positions
  L{L}.multipliers    int64[max_ngram]
  L{L}.primes         int64[H]          order-major
  L{L}.offsets        int64[H]
  L{L}.hash           int64[B, T, H]    head-local rows (the reference adds offsets)
  L{L}.sd.<name>      the module's state_dict: float8 tensors as raw uint8 bytes
                      (embed.weight, embed.scale, wkv.weight, wkv.scale), q/k float32
  L{L}.delta_f32      float32[B, T, G, D]  gate * value, default dtype float32
  L{L}.out_bf16       float32[B, T, G, D]  the reference's return value bf16(h + gate*value)

Regenerate:  python tools/goldens/v41.py [NAME ...]      (torch and numpy only)
tests/v41/test_goldens_v41.py re-runs it and compares with the committed files.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import is_prime_trial  # noqa: E402  (the demo generator's primality test)

DEAD = -1
BLOCK = 32
FP8_MAX = 448.0
_MASK64 = (1 << 64) - 1

CONFIGS = [
    # dead tokens (also at the start), negative ids, a compression table, two streams
    dict(name="hc2_dead_comp", engram_vocab_size=101, max_ngram_size=4, n_heads=2, head_dim=32,
         layer_ids=[1, 4], pad_id=2, dim=64, hc_mult=2, vocab_size=300, image_token_id=299,
         comp_classes=180, B=2, T=14, dead_frac=0.15, dead_prefix=(1, 3), negatives=[(0, 5, -1), (0, 9, -7)],
         small_scales=False, data_seed=11),
    # identity compression, three layers, orders 2..3
    dict(name="hc4_ident_layers", engram_vocab_size=61, max_ngram_size=3, n_heads=2, head_dim=32,
         layer_ids=[0, 2, 5], pad_id=0, dim=32, hc_mult=4, vocab_size=120, image_token_id=100,
         comp_classes=None, B=2, T=12, dead_frac=0.1, dead_prefix=None, negatives=[(1, 0, -1)],
         small_scales=False, data_seed=22),
    # one stream; the second layer's table has tiny scales (every block's amax < 1e-4: the
    # activation quantizer is not exact there), the Flash layer ids
    dict(name="hc1_tiny_scales", engram_vocab_size=131, max_ngram_size=4, n_heads=2, head_dim=32,
         layer_ids=[1, 14], pad_id=2, dim=64, hc_mult=1, vocab_size=2000, image_token_id=1990,
         comp_classes=1500, B=2, T=14, dead_frac=0.1, dead_prefix=None, negatives=[],
         small_scales=True, data_seed=33),
]


# --- integer geometry (engram.py) ------------------------------------------------------------
def layout_primes(spec):
    """[layer][order][head]: for every (layer, order) the search restarts at vocab-1; one seen-set."""
    seen, out = set(), []
    for _ in spec["layer_ids"]:
        per_order = []
        for _ in range(spec["max_ngram_size"] - 1):
            cur, sizes = spec["engram_vocab_size"] - 1, []
            for _ in range(spec["n_heads"]):
                cur += 1
                while not is_prime_trial(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per_order.append(sizes)
        out.append(per_order)
    return out


def multipliers(layer_ids, max_ngram, compressed_vocab):
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    return torch.stack([torch.tensor(np.random.default_rng(10007 * L).integers(
        0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1) for L in layer_ids])


def ngram_hash(spec, ids, token_map, pad, mults, primes, offsets):
    """NgramHashState.forward at start_pos 0: absolute rows [B, T, n_layers, H]."""
    ids = torch.as_tensor(ids)
    dead = (ids == spec["image_token_id"]) | (ids < 0)
    cache = torch.where(dead, DEAD, token_map[ids.clamp_min(0)])
    B, T = ids.shape
    positions = torch.arange(T).expand(B, T)
    tokens, blocked = [], torch.zeros_like(positions, dtype=torch.bool)
    for shift in range(spec["max_ngram_size"]):
        source = cache.gather(1, (positions - shift).clamp_min(0))
        blocked = blocked | (positions < shift) | (source == DEAD)
        tokens.append(torch.where(blocked, pad, source))
    tokens = torch.stack(tokens, dim=-1)
    products = tokens.unsqueeze(2) * mults                     # [B, T, n_layers, max_ngram]
    rolling, hashes = products[..., 0], []
    for i in range(1, spec["max_ngram_size"]):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % primes[:, i - 1])
    return torch.cat(hashes, dim=-1) + offsets


def ngram_hash_exact(spec, ids, token_map, pad, mult, primes_flat):
    """The same rows with Python integers (explicit 2**64 wrap), for one layer: head-local."""
    n, h = spec["max_ngram_size"], spec["n_heads"]

    def signed(u):
        u &= _MASK64
        return u - (1 << 64) if u >> 63 else u
    out = []
    for row in ids.tolist():
        dead = [i < 0 or i == spec["image_token_id"] for i in row]
        r_out = []
        for t in range(len(row)):
            w, blocked = [], False
            for k in range(n):
                blocked = blocked or t - k < 0 or dead[t - k]
                w.append(pad if blocked else int(token_map[row[t - k]]))
            mix, heads = signed(w[0] * int(mult[0])), []
            for order in range(2, n + 1):
                mix = signed(mix ^ signed(w[order - 1] * int(mult[order - 1])))
                heads += [mix % p for p in primes_flat[(order - 2) * h:(order - 1) * h]]
            r_out.append(heads)
        out.append(r_out)
    return np.array(out, dtype=np.int64)


class NgramHashState:
    """NgramHashState at decode time: per row, the last max_ngram-1 cache entries (a compressed
    id, or DEAD for an image token and for the slots before the start), so a sequence fed in
    pieces hashes as it would whole (ngram_hash). advance() feeds some rows a piece each."""

    def __init__(self, spec, token_map, pad, mults, primes, offsets, batch):
        self.spec, self.token_map, self.pad = spec, torch.as_tensor(token_map), pad
        self.mults, self.primes, self.offsets = mults, torch.as_tensor(primes), offsets
        self.cache = torch.full((batch, spec["max_ngram_size"] - 1), DEAD, dtype=torch.int64)

    def advance(self, row, ids):
        """Row `row` takes the tokens ids[T]: absolute rows [T, n_layers, H] of each."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        n, T = self.spec["max_ngram_size"], ids.shape[0]
        dead = (ids == self.spec["image_token_id"]) | (ids < 0)
        full = torch.cat([self.cache[row], torch.where(dead, DEAD, self.token_map[ids.clamp_min(0)])])
        tokens, blocked = [], torch.zeros(T, dtype=torch.bool)
        for shift in range(n):
            source = full[n - 1 - shift:n - 1 - shift + T]
            blocked = blocked | (source == DEAD)
            tokens.append(torch.where(blocked, self.pad, source))
        self.cache[row] = full[-(n - 1):]
        products = torch.stack(tokens, dim=-1).unsqueeze(1) * self.mults    # [T, n_layers, n]
        rolling, hashes = products[..., 0], []
        for i in range(1, n):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return torch.cat(hashes, dim=-1) + self.offsets


def geometry(spec, table=None):
    """(token_map, compressed pad, multipliers [n_layers, n], primes [layer][order][head],
    offsets [n_layers, H]) of a spec, with a compression table or the identity."""
    token_map = torch.arange(spec["vocab_size"]) if table is None else torch.as_tensor(np.asarray(table, np.int64))
    C = int(token_map.max()) + 1
    primes = layout_primes(spec)
    flat = [[p for order in layer for p in order] for layer in primes]
    offsets = torch.tensor(np.array([np.cumsum([0, *f[:-1]]) for f in flat]), dtype=torch.int64)
    return token_map, int(token_map[spec["pad_id"]]), multipliers(spec["layer_ids"], spec["max_ngram_size"], C), \
        primes, offsets


# --- float8 numerics (model.py, kernel_cpu.py) --------------------------------------------------
def fast_round_scale(x):
    """2**ceil(log2(x)) of float32 x from its bits."""
    bits = x.float().contiguous().view(torch.int32)
    log2_ceil = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((log2_ceil + 127) << 23).view(torch.float32)


def act_quant(x):
    """bf16 x -> (e4m3 values, float32 power-of-two scale per 32)."""
    xg = x.float().unflatten(-1, (-1, BLOCK))
    amax = xg.abs().amax(dim=-1).clamp_min(1e-4)
    s = fast_round_scale(amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
    q = (xg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def fp8_gemm(a, a_s, b, b_s):
    """a[M, K] e4m3 with a_s[M, K/32]; b[N, K] e4m3 with b_s[ceil(N/32), K/32]: float32
    partial per 32-wide K block, scaled and added in K order; out in the default dtype."""
    M, K = a.shape
    N = b.shape[0]
    b_rows = b_s.float().repeat_interleave(BLOCK, dim=0)[:N]
    acc = torch.zeros(M, N, dtype=torch.float32)
    for k in range(K // BLOCK):
        sl = slice(k * BLOCK, (k + 1) * BLOCK)
        acc += (a[:, sl].float() @ b[:, sl].float().T) * a_s[:, k:k + 1] * b_rows[:, k].unsqueeze(0)
    return acc.to(torch.get_default_dtype())


class Engram(torch.nn.Module):
    """model.py's Engram with its ParallelEngramEmbedding (one rank) and float8 wkv."""

    def __init__(self, spec, num_embeddings):
        super().__init__()
        G, D, hd = spec["hc_mult"], spec["dim"], spec["head_dim"]
        E = (spec["max_ngram_size"] - 1) * spec["n_heads"] * hd
        M = D * (G + 1)
        self.G, self.D, self.eps = G, D, 1e-20
        self.embed_weight = torch.nn.Parameter(torch.empty(num_embeddings, hd, dtype=torch.float8_e4m3fn),
                                               requires_grad=False)
        self.embed_scale = torch.nn.Parameter(torch.empty(num_embeddings, hd // BLOCK, dtype=torch.float8_e8m0fnu),
                                              requires_grad=False)
        self.wkv_weight = torch.nn.Parameter(torch.empty(M, E, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.wkv_scale = torch.nn.Parameter(torch.empty(-(-M // BLOCK), -(-E // BLOCK),
                                                        dtype=torch.float8_e8m0fnu), requires_grad=False)
        self.q_weight = torch.nn.Parameter(torch.ones(G, D))
        self.k_weight = torch.nn.Parameter(torch.ones(G, D))

    def embed(self, idx):
        values = self.embed_weight[idx].float().unflatten(-1, (-1, BLOCK)) * self.embed_scale[idx].float().unsqueeze(-1)
        return values.flatten(-2).to(torch.bfloat16)

    def forward(self, x, hash_ids, token_mask):
        """x [B, T, G, D] (default dtype); returns (delta float32, reference output bf16(h + delta))."""
        e = self.embed(hash_ids).flatten(-2)                      # [B, T, E] bf16
        q, s = act_quant(e.reshape(-1, e.shape[-1]))
        kv = fp8_gemm(q, s, self.wkv_weight, self.wkv_scale).reshape(e.shape[:-1] + (-1,))
        key, value = kv.split([self.G * self.D, self.D], dim=-1)
        key = key.float().unflatten(-1, (self.G, self.D))
        weight = self.q_weight.float() * self.k_weight.float()
        h = x.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.D ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
        delta = gate.unsqueeze(-1) * value.float().unsqueeze(-2)
        return delta, (h + delta).to(x.dtype)


def engram_module(spec, sd, dtype=torch.float32):
    """An Engram with the weights of state_dict sd (float8 tensors as raw uint8 bytes, q/k as
    floats), its float parameters in `dtype` (bf16: as generate.py builds it). Call it under
    torch.set_default_dtype(dtype): the projection's output takes the default dtype."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        mod = Engram(spec, sd["embed.weight"].shape[0])
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        mod.embed_weight.copy_(torch.from_numpy(np.ascontiguousarray(sd["embed.weight"])).view(torch.float8_e4m3fn))
        mod.embed_scale.copy_(torch.from_numpy(np.ascontiguousarray(sd["embed.scale"])).view(torch.float8_e8m0fnu))
        mod.wkv_weight.copy_(torch.from_numpy(np.ascontiguousarray(sd["wkv.weight"])).view(torch.float8_e4m3fn))
        mod.wkv_scale.copy_(torch.from_numpy(np.ascontiguousarray(sd["wkv.scale"])).view(torch.float8_e8m0fnu))
        mod.q_weight.copy_(torch.from_numpy(np.asarray(sd["q_weight"], np.float32)))
        mod.k_weight.copy_(torch.from_numpy(np.asarray(sd["k_weight"], np.float32)))
    return mod


# --- data ------------------------------------------------------------------------------------------
def random_state_dict(spec, rng, num_embeddings, small_scales=False):
    """A layer's state_dict at reference-like magnitudes (q/k bf16-representable)."""
    G, D, hd = spec["hc_mult"], spec["dim"], spec["head_dim"]
    E = (spec["max_ngram_size"] - 1) * spec["n_heads"] * hd
    N, M = num_embeddings, (G + 1) * D
    emb_scale = rng.integers(123, 128, (N, hd // BLOCK), dtype=np.uint8)
    if small_scales:
        # scales 2**-31..2**-26, every block's amax < 1e-4, so the activation quantizer rounds
        # (x / scale falls among e4m3 subnormals)
        emb_scale = rng.integers(96, 102, (N, hd // BLOCK), dtype=np.uint8)
    e_shift = int(np.ceil(np.log2(np.sqrt(E))))
    return {"embed.weight": random_e4m3_bytes(rng, (N, hd)), "embed.scale": emb_scale,
            "wkv.weight": random_e4m3_bytes(rng, (M, E)),
            "wkv.scale": rng.integers(126 - e_shift, 129 - e_shift, (-(-M // BLOCK), -(-E // BLOCK)),
                                      dtype=np.uint8),
            "q_weight": torch.from_numpy(rng.uniform(0.5, 1.5, (G, D)).astype(np.float32)).bfloat16().float().numpy(),
            "k_weight": torch.from_numpy(rng.uniform(0.5, 1.5, (G, D)).astype(np.float32)).bfloat16().float().numpy()}



def random_e4m3_bytes(rng, shape):
    """Random sign and mantissa, exponent field 4..8: magnitudes 0.125..3.75."""
    return ((rng.integers(0, 256, shape, dtype=np.uint8) & 0x87)
            | (rng.integers(4, 9, shape, dtype=np.uint8) << 3)).astype(np.uint8)


def generate(spec):
    rng = np.random.default_rng(spec["data_seed"])
    V, G, D = spec["vocab_size"], spec["hc_mult"], spec["dim"]
    table = None
    if spec["comp_classes"] is not None:  # dense: every label used, the rest drawn at random
        labels = np.concatenate([np.arange(spec["comp_classes"]), rng.integers(0, spec["comp_classes"],
                                                                             V - spec["comp_classes"])])
        table = rng.permutation(labels).astype(np.int64)
    token_map, pad, mults, primes, offsets = geometry(spec, table)
    flat = [[p for order in layer for p in order] for layer in primes]

    B, T = spec["B"], spec["T"]
    ids = rng.integers(0, V, (B, T)).astype(np.int64)
    ids[rng.random((B, T)) < spec["dead_frac"]] = spec["image_token_id"]
    if spec["dead_prefix"]:
        b, k = spec["dead_prefix"]
        ids[b, :k] = spec["image_token_id"]
    for b, t, v in spec["negatives"]:
        ids[b, t] = v
    dead = ids == spec["image_token_id"]
    hidden = torch.from_numpy(rng.standard_normal((B, T, G, D)).astype(np.float32)).bfloat16().float()

    rows = ngram_hash(spec, ids, token_map, pad, mults, torch.tensor(primes), offsets)   # [B, T, nL, H]
    out = {"config_json": np.array(json.dumps(config_fields(spec))), "ids": ids,
           "hidden": hidden.numpy(), "dead": dead}
    if table is not None:
        out["compression"] = table
    for li, L in enumerate(spec["layer_ids"]):
        local = (rows[:, :, li] - offsets[li]).numpy()
        exact = ngram_hash_exact(spec, ids, token_map.numpy(), pad, mults[li].tolist(), flat[li])
        assert np.array_equal(local, exact), "torch and exact-integer hashes disagree"
        N = sum(flat[li])
        # the last layer of a small_scales spec: tiny rows (the activation quantizer rounds)
        sd = random_state_dict(spec, rng, N, spec["small_scales"] and li == len(spec["layer_ids"]) - 1)
        for k, v in sd.items():
            out[f"L{L}.sd.{k}"] = v
        out[f"L{L}.multipliers"] = mults[li].numpy()
        out[f"L{L}.primes"] = np.array(flat[li], dtype=np.int64)
        out[f"L{L}.offsets"] = offsets[li].numpy()
        out[f"L{L}.hash"] = local
        for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):  # bf16: as generate.py
            mod = engram_module(spec, sd, dtype)
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.no_grad():
                    delta, ref_out = mod(hidden.to(dtype), rows[:, :, li], torch.from_numpy(~dead))
            finally:
                torch.set_default_dtype(prev)
            if tag == "f32":
                out[f"L{L}.delta_f32"] = delta.numpy()
            else:
                out[f"L{L}.out_bf16"] = ref_out.float().numpy()
    return out


def config_fields(spec):
    n = spec["max_ngram_size"]
    return dict(variant="deepseek-v4.1", engram_vocab_size=[spec["engram_vocab_size"]] * (n - 1),
                max_ngram_size=n, n_embed_per_ngram=spec["n_heads"] * spec["head_dim"],
                n_head_per_ngram=spec["n_heads"], layer_ids=spec["layer_ids"], pad_id=spec["pad_id"],
                hidden_size=spec["dim"], hc_mult=spec["hc_mult"], vocab_size=spec["vocab_size"],
                image_token_id=spec["image_token_id"], norm_eps=1e-20)


def write(spec, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"golden_v41_{spec['name']}.npz")
    np.savez_compressed(path, **generate(spec))
    return path


def main(argv=None):
    """Regenerate every config (or the ones named on the command line) into tests/data."""
    names = sys.argv[1:] if argv is None else argv
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "tests", "data")
    for path in (write(c, out_dir) for c in CONFIGS if not names or c["name"] in names):
        print(f"{os.path.relpath(path)}  {os.path.getsize(path):>7d} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
