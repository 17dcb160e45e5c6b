"""engram-stream demo: decode through every layer's streaming engine and check it against the batch path."""
from __future__ import annotations

import time

import numpy as np

from .common import add_gguf, at_least, counted, cpu, kernels, load_model
from .progress import Steps


WARMUP_TOKENS = 32   # demo: untimed tokens before the timed decode


def register(command):
    s = command("demo", run, "decode on a built-in model and check it against the batch path")
    s.add_argument("--checkpoint", default=None,
                   help="decode this model instead: a checkpoint file or a model's Hugging Face folder "
                        "(config.json, shards)")
    s.add_argument("--tokens", type=at_least(1), default=300, help="tokens to decode")
    s.add_argument("--seed", type=at_least(0), default=0, help="seed of the weights, ids and hidden states")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr (the results only)")
    add_gguf(s)


def run(args):
    """Decode tokens through every layer's streaming engine and check them against the batch path
    (the built-in model, or --checkpoint: a checkpoint file or a model's Hugging Face folder)."""
    steps = Steps(args.quiet)
    model = load_model(args, steps)
    cfg = model.cfg
    rng = np.random.default_rng(args.seed)
    T, G, D = args.tokens, cfg.hc_mult, cfg.hidden_size
    ids = model.variant.sample_ids(cfg, rng, T)   # the variant's special ids among them (V4.1's DEAD tokens)
    inp = model.variant.input_layer   # an input layer's engines take no hidden and return [D] per token
    hidden = {L: None if inp else rng.standard_normal((T, G, D), dtype=np.float32) for L in cfg.layer_ids}
    print(f"model: {model}")
    print(f"kernels: {kernels()}")
    print(f"cpu: {cpu()}")
    outs = {L: np.empty((T, D) if inp else (T, G, D), np.float32) for L in cfg.layer_ids}
    dec = model.decoder()
    # Untimed tokens first: the first steps fault in the mapped weights and rows and fill the
    # caches; timed, they would measure that (several times a warm step), not the decode.
    warm = min(T, WARMUP_TOKENS)
    steps(f"warming up: {counted(warm, 'token')} x {counted(len(cfg.layer_ids), 'layer')}, not timed")
    for tok in rng.integers(0, cfg.vocab_size, size=warm):
        dec.begin(int(tok))
        for L in cfg.layer_ids:
            dec.layer(L, None if inp else hidden[L][0], out=outs[L][0])
    dec.reset()
    steps(f"decoding {counted(T, 'token')} x {counted(len(cfg.layer_ids), 'layer')}")
    t0 = time.perf_counter()
    for t in range(T):
        dec.begin(int(ids[t]))
        for L in cfg.layer_ids:
            dec.layer(L, None if inp else hidden[L][t], out=outs[L][t])
    dt = time.perf_counter() - t0
    print(f"decoded {counted(T, 'token')} x {counted(len(cfg.layer_ids), 'layer')} in {dt * 1e3:.1f} ms: "
          f"{T / dt:,.0f} tokens/s ({dt / T / len(cfg.layer_ids) * 1e6:.1f} us per layer step)", flush=True)
    worst = 0.0
    for L in cfg.layer_ids:
        steps(f"checking layer {L} against the batch path (the numpy oracle: slower than the decode)")
        ref = model.forward(L, ids[None], None if inp else hidden[L][None])[0]
        err = np.abs(outs[L] - ref) / (2e-5 + 2e-4 * np.abs(ref))
        worst = max(worst, float(err.max()))
    ok = worst <= 1.0
    print(f"check against the batch path (atol 2e-5 + rtol 2e-4): {'OK' if ok else 'FAILED'} "
          f"(worst error {worst:.3f} of tolerance)")
    return 0 if ok else 1
