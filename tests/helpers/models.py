"""Small models of every registered variant (the contract suites' among them), and the changed
copies of one that the tests compare against."""
import numpy as np


def dense_compression(vocab, rng):
    """A dense first-seen-order map: raw buckets renumbered 0, 1, 2, ... as they first appear."""
    raw = rng.integers(0, max(2, vocab // 2), vocab)
    first, lookup = {}, np.empty(vocab, np.int64)
    for i, r in enumerate(raw):
        lookup[i] = first.setdefault(int(r), len(first))
    return lookup


def make_model(G=2, n=3, K=3, D=13, nh=2, hd=3, vocab=40, layers=(1, 4), evs=None, comp=False,
               seed=0, pad=1, table_dtype="float32", table=None):
    """A small demo-variant model with non-trivial norm weights and biases (perturbed);
    table float32/float16/int8; table(L, array) -> array may replace a layer's table (e.g.
    with a file-backed copy)."""
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.demo.weights import LayerWeights
    rng = np.random.default_rng(seed + 12345)
    cfg = EngramConfig(engram_vocab_size=list(evs) if evs else [31 + 10 * i for i in range(n - 1)],
                       max_ngram_size=n, n_embed_per_ngram=nh * hd, n_head_per_ngram=nh,
                       layer_ids=list(layers), pad_id=pad, seed=seed, kernel_size=K, hidden_size=D,
                       hc_mult=G, vocab_size=vocab)
    compression = dense_compression(vocab, rng) if comp else None
    model = EngramModel.init(cfg, seed=seed, compression=compression)
    if table_dtype != "float32" or table is not None:
        layers_w = {}
        for L, w in model.layers.items():
            t, scale = w.table, None
            if table_dtype == "float16":
                t = w.table.astype(np.float16)
            elif table_dtype == "int8":
                scale = (np.abs(w.table).max(axis=1) / 127 + 1e-3).astype(np.float32)
                t = np.clip(np.round(w.table / scale[:, None]), -127, 127).astype(np.int8)
            if table is not None:
                t = table(L, t)
            layers_w[L] = LayerWeights(cfg, w.offsets, t, w.proj_w, w.proj_b, w.norm1, w.norm2,
                                       w.conv_norm, w.conv_w, table_scale=scale)
        model = EngramModel(cfg, model.plan, layers_w)
    return perturbed(model, rng)


V41_IMG = 299  # the DEAD (image) token id of make_v41_model's models


def make_v41_model(G=2, D=64, n=4, nh=2, hd=32, vocab=300, img=V41_IMG, layers=(1, 4), comp=True, seed=0, evs=211):
    """A small deepseek-v4.1 model (random float8 weights at the reference's magnitudes)."""
    from engram_stream import EngramConfig, EngramModel
    rng = np.random.default_rng(seed + 99)
    cfg = EngramConfig(variant="deepseek-v4.1", engram_vocab_size=[evs] * (n - 1), max_ngram_size=n,
                       n_embed_per_ngram=nh * hd, n_head_per_ngram=nh, layer_ids=list(layers), pad_id=2,
                       hidden_size=D, hc_mult=G, vocab_size=vocab, image_token_id=img)
    return EngramModel.init(cfg, seed=seed, compression=dense_compression(vocab, rng) if comp else None)


# The contract suites' models: a small one of every registered variant. The built-in variants have
# theirs here (non-trivial norms, a compression); any other variant is made from its registry
# entry's example_config (tests/contract/test_toy_variant.py registers one).
CONTRACT_MODELS = {
    "demo-v1": lambda seed=3, **kw: make_model(G=2, n=3, K=3, D=16, comp=True, seed=seed, vocab=60, **kw),
    "deepseek-v4.1": lambda seed=0, **kw: make_v41_model(seed=seed, **kw),
}


def make_qwen_model(seed=0, table_dtype="float32"):
    """A small qwen3.8-flash-next model (the variant's example config: EOS 299, padded tables)."""
    import ml_dtypes
    from engram_stream import EngramConfig, EngramModel
    from engram_stream.qwen.config import EXAMPLE
    m = EngramModel.init(EngramConfig(**EXAMPLE), seed=seed)
    if table_dtype == "bfloat16":
        m = EngramModel(m.cfg, m.plan, {L: w.replace(m.cfg, table=w.table.astype(ml_dtypes.bfloat16))
                                        for L, w in m.layers.items()})
    return m


def contract_variants() -> list:
    """The names of every registered variant: the contract suites run on each."""
    from engram_stream import variants
    return list(variants.registered())


def contract_model(variant, seed=None, **kw):
    """A small model of a registered variant, for the contract suites."""
    from engram_stream import EngramConfig, EngramModel, variants
    if variant in CONTRACT_MODELS:
        return CONTRACT_MODELS[variant](**kw) if seed is None else CONTRACT_MODELS[variant](seed=seed, **kw)
    return EngramModel.init(EngramConfig(**variants.get(variant).example_config), seed=seed or 0)


def checkpoint_path(model, folder, name="ckpt"):
    """Where a test saves `model`: a folder for a variant whose checkpoints are folders, else a file."""
    from engram_stream import variants
    return folder / (name if variants.variant_of(model.cfg).folder_checkpoint else f"{name}.st")


def perturbed(model, rng):
    """The same model with non-trivial norm weights and biases, like trained ones (a model's
    arrays are read-only: the changed ones are new arrays)."""
    from engram_stream import EngramModel
    layers = {}
    for L, w in model.layers.items():
        n1, n2, n3 = (1 + 0.3 * rng.standard_normal(a.shape) for a in (w.norm1, w.norm2, w.conv_norm))
        bias = w.proj_b + 0.2 * rng.standard_normal(w.proj_b.shape)
        layers[L] = w.replace(model.cfg, norm1=n1, norm2=n2, conv_norm=n3, proj_b=bias)
    return EngramModel(model.cfg, model.plan, layers)


def fine_tuned_outside_samples(model):
    """The demo model with every table row changed except the ones the Mooncake fingerprint
    samples (rows.mooncake.keys.sample_rows): the same config and sampled rows, other tables."""
    from engram_stream import EngramModel
    from engram_stream.rows.mooncake.keys import sample_rows
    layers = {}
    for L, w in model.layers.items():
        keep = np.zeros(w.table.shape[0], bool)
        for h, n_h in enumerate(model.plan.head_primes[L]):
            keep[int(w.offsets[h]) + sample_rows(int(n_h), L, h)] = True
        table = np.array(w.table)
        table[~keep] = -table[~keep] + 0.5
        layers[L] = w.replace(model.cfg, table=table)
    return EngramModel(model.cfg, model.plan, layers)
