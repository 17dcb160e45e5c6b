"""The demo step's contenders as run(n) callables: the engine, the torch peer, the BLAS floor of
its fused projection."""
import numpy as np

try:
    import torch
    from _lib import torch_peer
    HAVE_TORCH = True
except ImportError:  # the engine rows still run
    torch = torch_peer = None
    HAVE_TORCH = False

LAYER = 1


def make_inputs(cfg, n_tok=4096, n_hid=16, S=1, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, size=(n_tok, S)).astype(np.int64)
    hid = rng.standard_normal((n_hid, S, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    if S == 1:
        return toks[:, 0].tolist(), [np.ascontiguousarray(h[0]) for h in hid]
    return [np.ascontiguousarray(t) for t in toks], [np.ascontiguousarray(h) for h in hid]


def engine_runner(model, S=1, threads=None):
    """run(n): n steps of an engine of S streams; threads: its step_threads (None: the count
    measured fastest, engine/tune.py). run.engine is the engine (its kernel_choice())."""
    eng = model.stream(LAYER, n_streams=S)
    if threads is not None:
        eng.step_threads = threads  # a step's projection and tails over threads
    toks, hid = make_inputs(model.cfg, S=S, seed=S)
    out = np.empty(hid[0].shape, np.float32)
    nt, nh = len(toks), len(hid)
    state = [0]

    def run(n):
        i, step = state[0], eng.step
        for j in range(i, i + n):
            step(toks[j % nt], hid[j % nh], out=out)
        state[0] = i + n
    run.engine = eng
    return run


def torch_runner(model, S=1, hash_mode=None):
    with torch.inference_mode():
        peer = torch_peer.TorchStep(model, LAYER, n_streams=S, hash_mode=hash_mode)
    toks, hid = make_inputs(model.cfg, S=S, seed=S)
    hid = [torch.from_numpy(h) for h in hid]
    if S > 1:
        toks = [torch.from_numpy(t) for t in toks]
    nt, nh = len(toks), len(hid)
    state = [0]

    def run(n):
        i, step = state[0], peer.step
        with torch.inference_mode():
            for j in range(i, i + n):
                step(toks[j % nt], hid[j % nh])
        state[0] = i + n
    return run


def floor_runners(model, S=1):
    """The fused projection alone, one numpy BLAS call per step, both weight layouts."""
    w = model.layer(LAYER)
    W = w.proj_w                               # [(G+1)*D, E] row-major
    WT = np.ascontiguousarray(W.T)             # [E, (G+1)*D]
    rng = np.random.default_rng(5)
    E, M = W.shape[1], W.shape[0]
    if S == 1:
        e = rng.standard_normal(E).astype(np.float32)
        y = np.empty(M, np.float32)

        def run_w(n):
            for _ in range(n):
                np.matmul(W, e, out=y)

        def run_wt(n):
            for _ in range(n):
                np.matmul(e, WT, out=y)
    else:
        e = rng.standard_normal((S, E)).astype(np.float32)
        y = np.empty((S, M), np.float32)

        def run_w(n):
            Wt = W.T
            for _ in range(n):
                np.matmul(e, Wt, out=y)

        def run_wt(n):
            for _ in range(n):
                np.matmul(e, WT, out=y)
    return run_w, run_wt
