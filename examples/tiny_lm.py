"""A tiny numpy language model with Engram layers, shared by the examples.

Not a real LM: random frozen weights, so the examples can show the wiring
(hyper-connection streams, where the Engram output is added) in a few lines.
"""
import argparse

import numpy as np

from engram_stream import EngramConfig, EngramModel


def usage(doc):
    """An example's command line: no arguments; --help prints the example's docstring."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

CONFIG = EngramConfig(engram_vocab_size=[5003, 5003], max_ngram_size=3, n_embed_per_ngram=64,
                      n_head_per_ngram=4, layer_ids=[1, 3], pad_id=0, kernel_size=4,
                      hidden_size=64, hc_mult=2, vocab_size=1000)
N_LAYERS = 4


class TinyLM:
    def __init__(self, cfg=CONFIG, seed=0):
        rng = np.random.default_rng(seed)
        D = cfg.hidden_size
        self.cfg = cfg
        self.embed = rng.standard_normal((cfg.vocab_size, D), dtype=np.float32)
        self.blocks = [rng.standard_normal((D, D), dtype=np.float32) / np.sqrt(D) for _ in range(N_LAYERS)]
        self.unembed = rng.standard_normal((D, cfg.vocab_size), dtype=np.float32)

    def step(self, token, engram=None):
        """Logits for the next token. engram: a Decoder (begin() already called for `token`)."""
        h = np.repeat(self.embed[token][None], self.cfg.hc_mult, axis=0)   # [G, D] mock hyper-connections
        for i, W in enumerate(self.blocks):
            if engram is not None and i in engram.layers:
                h = h + engram.layer(i, h)                                  # the caller adds the residual
            h = h + np.tanh(h @ W)
        return h.mean(axis=0) @ self.unembed


def engram_model(seed=0, graft_zero_init=False):
    return EngramModel.init(CONFIG, seed=seed, graft_zero_init=graft_zero_init)
