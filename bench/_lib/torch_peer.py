"""Torch peers of the engine, for the benchmarks (not part of the package).

TorchStep   a careful eager-torch incremental step of one Engram layer, for 1 or S
            streams: a ring of the last max_ngram-1 compressed ids, a conv state of the
            last (K-1)*max_ngram normalized rows, the new token hashed in python ints (or
            in torch int64 ops for S streams), H rows gathered with index_select, the G key
            projections and the value projection FUSED into one addmv/addmm over a
            concatenated [(G+1)*D, E] weight (stored transposed, the faster layout here), the
            RMSNorms folded into per-stream scalars, gate, value, the conv taps read
            from the ring as one strided view (weights pre-rotated per ring phase), SiLU.
            Preallocated buffers and out= wherever torch offers them; call it under
            torch.inference_mode() (the benchmarks hold it around the whole loop).
TorchBatch  the torch batch forward of the reference module with the demo's structure
            (engram_demo_v1.py): ids hashed in numpy (the reference's numpy expression,
            HashPlan.hash_numpy, for this layer only), an nn.Embedding gather, G separate
            key_projs Linear, nn.RMSNorm, value_proj, ShortConv with nn.Conv1d.

Both are built from an EngramModel (model.state_dict(L): the reference-named numpy
arrays, shared with torch zero-copy; model.plan: multipliers, primes, offsets, lookup).

    python bench/torch_peer.py --check     # both peers == model.forward, token by token

Import after tools/checkout.py has chosen the engram_stream (the scripts do).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

EPS_KEY = float(np.finfo(np.float32).eps)  # torch RMSNorm default (eps=None) for float32
EPS_CONV = 1e-5
_WRAP = 1 << 63
_MASK = (1 << 64) - 1
RTOL, ATOL = 2e-4, 2e-5


def _wrap64(v: int) -> int:
    return ((v + _WRAP) & _MASK) - _WRAP


class TorchStep:
    """One Engram layer decoded token by token in eager torch (batch of S streams).

    step(token_id, hidden[G, D])            -> torch float32[G, D]    (n_streams == 1)
    step(token_ids[S], hidden[S, G, D])     -> torch float32[S, G, D]
    hidden: a float32 torch tensor (torch.from_numpy of the caller's array is zero-copy).
    hash_mode: "py" (python ints, the fastest for a few streams) or "torch" (int64 ops,
    vectorized over streams); default "py" for S == 1, "torch" otherwise.
    """

    def __init__(self, model, layer, n_streams: int = 1, hash_mode: str | None = None):
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.__init__(model, layer, n_streams, hash_mode)
        cfg, plan = model.cfg, model.plan
        sd = model.state_dict(layer)
        G, D, E, K = cfg.hc_mult, cfg.hidden_size, cfg.engram_dim, cfg.kernel_size
        S, n, nh, H, hd = n_streams, cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.n_heads, cfg.head_dim
        self.G, self.D, self.E, self.K, self.S, self.n, self.H = G, D, E, K, S, n, H
        self.C, self.M = G * D, (G + 1) * D
        self.dil, self.conv_len = n, cfg.conv_len
        self.hash_mode = hash_mode or ("py" if S == 1 else "torch")
        if self.hash_mode not in ("py", "torch"):
            raise ValueError(f"hash_mode must be 'py' or 'torch', got {hash_mode!r}")

        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
        self.table = torch.from_numpy(sd["multi_head_embedding.embedding.weight"])  # zero-copy
        if self.table.dtype != torch.float32:
            self.table = self.table.float()
        # the G key projections and the value projection as one [(G+1)*D, E] weight
        W = np.concatenate([sd[f"key_projs.{g}.weight"] for g in range(G)] + [sd["value_proj.weight"]])
        # stored transposed, [E, (G+1)*D] contiguous: measured here, addmv(b, WT.t(), e) and
        # addmm(b, e, WT) are 1.2-1.7x faster than the same calls on the [out, in] weight
        self.WT = t(W.T)
        self.W = self.WT.t()  # a column-major view of the [(G+1)*D, E] weight
        self.b = t(np.concatenate([sd[f"key_projs.{g}.bias"] for g in range(G)] + [sd["value_proj.bias"]]))
        n1 = np.stack([sd[f"norm1.{g}.weight"] for g in range(G)])
        n2 = np.stack([sd[f"norm2.{g}.weight"] for g in range(G)])
        # The RMSNorms fold into one scalar per (stream, g), with D moved into the weights:
        #   s = <n1 k/rms(k), n2 h/rms(h)>/sqrt(D) = <k, h*n12> / sqrt((|k|^2 + D eps)(|h|^2 + D eps)),
        #   n12 = n1*n2*sqrt(D);  x = n3 v_g/rms(v_g) = v * n3s * gate/sqrt(gate^2 |v|^2 + D eps3),
        #   n3s = n3*sqrt(D). (F.rms_norm costs ~60 us a call here, a composite of ~8 kernels.)
        self.n12 = t(n1 * n2 * np.float32(math.sqrt(D)))
        self.n3s = t(np.stack([sd[f"short_conv.norms.{g}.weight"] for g in range(G)]) * np.float32(math.sqrt(D)))
        # 0-d tensor constants: a python scalar operand costs ~4 us more per op (wrapped-number path)
        self.deps_key = torch.tensor(D * EPS_KEY, dtype=torch.float32)
        self.deps_conv = torch.tensor(D * EPS_CONV, dtype=torch.float32)
        self.tiny = torch.tensor(1e-6, dtype=torch.float32)
        cw = np.asarray(sd["short_conv.conv.weight"], dtype=np.float32).reshape(self.C, K)
        self.cw_last = t(cw[:, K - 1])  # the tap on x(t) itself
        # Ring slot of x(t-j), j = 1..conv_len, is (pos - j) mod conv_len. Viewed as
        # [K-1, dil, S, C], the K-1 older taps of phase pos are ring4[:, pos % dil] (one
        # strided view) in block order rotated by q = pos // dil: rotate the weights instead.
        nb = K - 1
        if nb:
            taps = cw[:, :nb].T  # [K-1, C], tap i reads x(t - (K-1-i)*dil)
            self.wrot = []
            for q in range(nb):
                w = np.empty((nb, 1, self.C), np.float32)
                for i in range(nb):  # tap i reads ring block (q + i) mod (K-1)
                    w[(q + i) % nb, 0] = taps[i]
                self.wrot.append(torch.from_numpy(w))
            self.ring = torch.zeros(self.conv_len, S, self.C)
            ring4 = self.ring.view(nb, self.dil, S, self.C)
            self.ring_taps = [ring4[:, r] for r in range(self.dil)]   # views, made once
            self.ring_slot = [self.ring[i] for i in range(self.conv_len)]
            self.ctmp = torch.empty(nb, S, self.C)
        self.pos = 0

        # hashing
        self.pad = int(plan.pad_id)
        self.mult = [int(m) for m in plan.multipliers[layer]]
        primes = [int(p) for p in plan.head_primes[layer]]
        self.primes_by_order = [primes[i * nh:(i + 1) * nh] for i in range(n - 1)]
        self.offsets = [int(o) for o in plan.offsets[layer]]
        self.poff = [list(zip(self.primes_by_order[i], self.offsets[i * nh:(i + 1) * nh])) for i in range(n - 1)]
        self.lookup = None if plan.lookup is None else plan.lookup.tolist()
        self.vocab = cfg.vocab_size
        self.hist = [[self.pad] * (n - 1) for _ in range(S)]  # hist[s][k-1]: compressed id at t-k
        self.lookup_t = None if plan.lookup is None else torch.from_numpy(plan.lookup)
        self.mult_t = torch.tensor(self.mult, dtype=torch.int64)
        self.primes_t = [torch.tensor(p, dtype=torch.int64) for p in self.primes_by_order]
        self.off_t = [torch.tensor(self.offsets[i * nh:(i + 1) * nh], dtype=torch.int64) for i in range(n - 1)]
        self.hist_t = torch.full((S, n - 1), self.pad, dtype=torch.int64)

        # preallocated buffers
        self.rows_np = np.zeros(S * H, dtype=np.int64)
        self.rows = torch.from_numpy(self.rows_np)           # shares memory with rows_np
        self.rows2 = self.rows.view(S, H)
        self.e = torch.empty(S, E)
        self.e_rows = self.e.view(S * H, hd)
        self.e1 = self.e.view(E)[:E] if S == 1 else None
        self.proj = torch.empty(S, self.M)
        self.proj1 = self.proj.view(self.M) if S == 1 else None
        self.y = torch.empty(S, self.C)
        self.y3 = self.y.view(S, G, D)
        self.out = torch.empty(S, G, D)
        # views of the projection buffer, made once: keys [S, G, D], value [S, 1, D]
        self.k = self.proj[:, :self.C].view(S, G, D)
        self.v = self.proj[:, self.C:]
        self.v1 = self.v.unsqueeze(1)

    def reset(self):
        with torch.inference_mode():
            self.hist = [[self.pad] * (self.n - 1) for _ in range(self.S)]
            self.hist_t.fill_(self.pad)
            if self.K > 1:
                self.ring.zero_()
            self.pos = 0

    # hashing ---------------------------------------------------------------------------------
    def _hash_py(self, ids):
        rows, mult, lookup = [], self.mult, self.lookup
        for s, tok in enumerate(ids):
            tok = int(tok)
            if tok >= self.vocab:
                raise ValueError(f"token id {tok} out of range")
            c = tok if (tok < 0 or lookup is None) else lookup[tok]
            h = self.hist[s]
            mix = _wrap64(c * mult[0])
            for i, po in enumerate(self.poff):
                mix ^= _wrap64(h[i] * mult[i + 1])  # XOR of two int64 values stays int64
                rows += [mix % p + o for p, o in po]  # python % is floored
            h.insert(0, c)
            h.pop()
        self.rows_np[:] = rows

    def _hash_torch(self, ids):
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(self.S)
        if self.lookup_t is None:
            c = ids
        else:
            c = torch.where(ids >= 0, self.lookup_t[ids.clamp(min=0)], ids)
        mix = c * self.mult_t[0]  # int64 multiply wraps (two's complement)
        nh = len(self.primes_by_order[0])
        for i in range(self.n - 1):
            mix = torch.bitwise_xor(mix, self.hist_t[:, i] * self.mult_t[i + 1])
            blk = self.rows2[:, i * nh:(i + 1) * nh]
            torch.remainder(mix.unsqueeze(1), self.primes_t[i], out=blk)  # floored, like numpy
            blk += self.off_t[i]
        for k in range(self.n - 2, 0, -1):
            self.hist_t[:, k].copy_(self.hist_t[:, k - 1])
        self.hist_t[:, 0].copy_(c)

    # the step --------------------------------------------------------------------------------
    def step(self, token_ids, hidden, out=None):
        S, G, D, C = self.S, self.G, self.D, self.C
        if self.hash_mode == "py":
            self._hash_py((token_ids,) if S == 1 and np.ndim(token_ids) == 0 else token_ids)
        else:
            self._hash_torch(token_ids)
        torch.index_select(self.table, 0, self.rows, out=self.e_rows)
        if S == 1:
            torch.addmv(self.b, self.W, self.e1, out=self.proj1)
        else:
            torch.addmm(self.b, self.e, self.WT, out=self.proj)
        h = hidden.view(S, G, D)
        k, v1, vd = self.k, self.v1, torch.linalg.vecdot
        # gate = sigmoid(sign(s) sqrt(max(|s|, 1e-6))), the norms folded (see __init__)
        den = vd(k, k).add_(self.deps_key).mul_(vd(h, h).add_(self.deps_key)).rsqrt_()
        s = vd(k, h * self.n12).mul_(den)                          # [S, G]
        gate = s.abs().clamp_min_(self.tiny).sqrt_().mul_(s.sign()).sigmoid_()
        g1 = gate.unsqueeze(-1)                                    # [S, G, 1]
        # conv input x = n3 * rms-normalized (gate * v)
        r3 = torch.mul(gate, gate).mul_(vd(self.v, self.v).unsqueeze(1)).add_(self.deps_conv).rsqrt_().mul_(gate)
        x = (r3.unsqueeze(-1) * v1).mul_(self.n3s).view(S, C)
        y = self.y
        if self.K > 1:
            q, r = divmod(self.pos, self.dil)
            torch.mul(self.ring_taps[r], self.wrot[q], out=self.ctmp)  # the K-1 older taps
            torch.sum(self.ctmp, 0, out=y)
            y.addcmul_(x, self.cw_last)                                # the tap on x(t)
            self.ring_slot[self.pos].copy_(x)                          # after the read: slot pos held x(t-conv_len)
            self.pos = (self.pos + 1) % self.conv_len
        else:
            torch.mul(x, self.cw_last, out=y)
        # out = gate * v + SiLU(y)
        o = self.out if out is None else out
        torch.addcmul(F.silu(self.y3, inplace=True), g1, v1, out=o.view(S, G, D))
        return o.view(G, D) if S == 1 and hidden.dim() == 2 else o


# -----------------------------------------------------------------------------------------
# The batch reference module (the demo's structure and state_dict names)
# -----------------------------------------------------------------------------------------
class MultiHeadEmbedding(nn.Module):
    def __init__(self, list_of_N, D):
        super().__init__()
        offs = [0]
        for n in list_of_N[:-1]:
            offs.append(offs[-1] + n)
        self.register_buffer("offsets", torch.tensor(offs, dtype=torch.long))
        self.embedding = nn.Embedding(num_embeddings=sum(list_of_N), embedding_dim=D)

    def forward(self, input_ids):
        return self.embedding(input_ids + self.offsets)


class ShortConv(nn.Module):
    def __init__(self, hidden_size, kernel_size, dilation, norm_eps=1e-5, hc_mult=4):
        super().__init__()
        C = hidden_size * hc_mult
        self.hc_mult = hc_mult
        self.conv = nn.Conv1d(C, C, kernel_size=kernel_size, groups=C, bias=False,
                              padding=(kernel_size - 1) * dilation, dilation=dilation)
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps) for _ in range(hc_mult)])
        self.act_fn = nn.SiLU()

    def forward(self, x):  # [B, T, G, D]
        B, T, G, D = x.shape
        x_norm = torch.cat([self.norms[i](x[:, :, i, :]) for i in range(G)], dim=-1)
        y = self.conv(x_norm.transpose(1, 2))[..., :T]
        y = self.act_fn(y)
        return y.transpose(1, 2).reshape(B, T, G, D).contiguous()


class EngramModule(nn.Module):
    def __init__(self, cfg, list_of_N):
        super().__init__()
        D, G, E = cfg.hidden_size, cfg.hc_mult, cfg.engram_dim
        self.hidden_size, self.hc_mult = D, G
        self.multi_head_embedding = MultiHeadEmbedding(list_of_N, cfg.head_dim)
        self.short_conv = ShortConv(D, cfg.kernel_size, cfg.max_ngram_size, hc_mult=G)
        self.value_proj = nn.Linear(E, D)
        self.key_projs = nn.ModuleList([nn.Linear(E, D) for _ in range(G)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(D) for _ in range(G)])
        self.norm2 = nn.ModuleList([nn.RMSNorm(D) for _ in range(G)])

    def forward(self, hash_ids, hidden_states):  # [B, T, H] head-local rows, [B, T, G, D]
        embeddings = self.multi_head_embedding(hash_ids).flatten(start_dim=-2)
        gates = []
        for g in range(self.hc_mult):
            normed_key = self.norm1[g](self.key_projs[g](embeddings))
            normed_query = self.norm2[g](hidden_states[:, :, g, :])
            gate = (normed_key * normed_query).sum(dim=-1) / math.sqrt(self.hidden_size)
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gates.append(gate.sigmoid().unsqueeze(-1))
        gates = torch.stack(gates, dim=2)
        value = gates * self.value_proj(embeddings).unsqueeze(2)
        return value + self.short_conv(value)


class TorchBatch:
    """forward(ids int[B, T] numpy, hidden torch float32[B, T, G, D]) -> torch [B, T, G, D]:
    hash in numpy (the reference expression, this layer only), then the module."""

    def __init__(self, model, layer):
        self.plan, self.layer = model.plan, layer
        primes = [int(p) for p in model.plan.head_primes[layer]]
        with torch.device("meta"):  # no 2.6 GB random init: the weights are assigned below
            self.module = EngramModule(model.cfg, primes)
        sd = {k: torch.from_numpy(np.asarray(v)) for k, v in model.state_dict(layer).items()}
        self.module.load_state_dict(sd, assign=True, strict=True)
        self.module.eval()

    def forward(self, ids, hidden):
        rows = self.plan.hash_numpy(ids, layers=[self.layer])[self.layer]
        with torch.inference_mode():
            return self.module(torch.from_numpy(rows), hidden)


# -----------------------------------------------------------------------------------------
# Correctness
# -----------------------------------------------------------------------------------------
CHECK_CONFIGS = [
    # (EngramConfig kwargs, compression classes or None)
    (dict(engram_vocab_size=[211, 199], max_ngram_size=3, n_embed_per_ngram=32, n_head_per_ngram=4,
          layer_ids=[1, 3], pad_id=2, seed=0, kernel_size=4, hidden_size=40, hc_mult=4, vocab_size=600), 350),
    (dict(engram_vocab_size=[97], max_ngram_size=2, n_embed_per_ngram=16, n_head_per_ngram=2,
          layer_ids=[0], pad_id=5, seed=3, kernel_size=2, hidden_size=24, hc_mult=1, vocab_size=300), None),
    (dict(engram_vocab_size=[61, 67, 71], max_ngram_size=4, n_embed_per_ngram=12, n_head_per_ngram=3,
          layer_ids=[2], pad_id=0, seed=7, kernel_size=5, hidden_size=16, hc_mult=2, vocab_size=200), 90),
    (dict(engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=16, n_head_per_ngram=2,
          layer_ids=[1], pad_id=1, seed=1, kernel_size=1, hidden_size=16, hc_mult=2, vocab_size=120), None),
]


def check(engine=True, verbose=True, T=40, B=3):
    """Every peer (and the engine) equals model.forward token by token on small configs.
    Raises AssertionError on the first mismatch; returns the number of tokens compared."""
    from engram_stream import EngramConfig, EngramModel
    rng = np.random.default_rng(1234)
    compared = 0
    with torch.inference_mode():
        for kw, classes in CHECK_CONFIGS:
            cfg = EngramConfig(**kw)
            comp = None if classes is None else (np.arange(cfg.vocab_size) * 7919 % classes).astype(np.int64)
            model = EngramModel.init(cfg, seed=11, compression=comp)
            layers = {}
            for L, w in model.layers.items():  # non-trivial norm and conv weights, like trained ones
                n1, n2, n3 = (1 + 0.3 * rng.standard_normal(a.shape) for a in (w.norm1, w.norm2, w.conv_norm))
                layers[L] = w.replace(cfg, norm1=n1, norm2=n2, conv_norm=n3,
                                      proj_b=0.2 * rng.standard_normal(w.proj_b.shape))
            model = EngramModel(cfg, model.plan, layers)
            ids = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int64)
            ids[0, 3], ids[1, 7], ids[2, 0] = -1, -5, -(1 << 40) + 3   # negative ids pass through
            hidden = rng.standard_normal((B, T, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
            hidden_t = torch.from_numpy(hidden)
            for L in cfg.layer_ids:
                ref = model.forward(L, ids, hidden)
                name = f"{cfg.hidden_size=} {cfg.hc_mult=} {cfg.max_ngram_size=} {cfg.kernel_size=} L{L}"
                got = TorchBatch(model, L).forward(ids, hidden_t).numpy()
                np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL, err_msg=f"TorchBatch {name}")
                for mode in ("py", "torch"):
                    for b in range(B):  # one stream, fresh state per sequence
                        peer = TorchStep(model, L, 1, hash_mode=mode)
                        for t in range(T):
                            o = peer.step(int(ids[b, t]), hidden_t[b, t])
                            np.testing.assert_allclose(o.numpy(), ref[b, t], rtol=RTOL, atol=ATOL,
                                                       err_msg=f"TorchStep S=1 {mode} {name} b={b} t={t}")
                            compared += 1
                    peer = TorchStep(model, L, B, hash_mode=mode)   # B streams in lockstep
                    for t in range(T):
                        o = peer.step(ids[:, t], hidden_t[:, t].contiguous())
                        np.testing.assert_allclose(o.numpy(), ref[:, t], rtol=RTOL, atol=ATOL,
                                                   err_msg=f"TorchStep S={B} {mode} {name} t={t}")
                        compared += B
                    peer.reset()
                    o = peer.step(ids[:, 0], hidden_t[:, 0].contiguous())
                    np.testing.assert_allclose(o.numpy(), ref[:, 0], rtol=RTOL, atol=ATOL,
                                               err_msg=f"TorchStep reset {name}")
                if engine:
                    for b in range(B):
                        eng = model.stream(L)
                        for t in range(T):
                            o = eng.step(int(ids[b, t]), hidden[b, t])
                            np.testing.assert_allclose(o, ref[b, t], rtol=RTOL, atol=ATOL,
                                                       err_msg=f"engine step {name} b={b} t={t}")
                        eng.reset()
                        o = eng.prefill(ids[b], hidden[b])
                        np.testing.assert_allclose(o, ref[b], rtol=RTOL, atol=ATOL,
                                                   err_msg=f"engine prefill {name} b={b}")
                    eng = model.stream(L, n_streams=B)
                    for t in range(T):
                        o = eng.step(ids[:, t], np.ascontiguousarray(hidden[:, t]))
                        np.testing.assert_allclose(o, ref[:, t], rtol=RTOL, atol=ATOL,
                                                   err_msg=f"engine S={B} {name} t={t}")
            if verbose:
                print(f"  ok: {cfg.hidden_size=} {cfg.hc_mult=} {cfg.max_ngram_size=} {cfg.kernel_size=} "
                      f"compression={'yes' if comp is not None else 'no'} layers={cfg.layer_ids}")
    return compared
