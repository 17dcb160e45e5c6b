"""Speculative decoding with rollback: snapshot, try draft tokens, restore on rejection.

    python examples/speculative.py
"""
import numpy as np

from tiny_lm import CONFIG, engram_model, usage

usage(__doc__)

model = engram_model()
dec = model.decoder()
rng = np.random.default_rng(0)
G, D = CONFIG.hc_mult, CONFIG.hidden_size
hiddens = lambda: {L: rng.standard_normal((G, D), dtype=np.float32) for L in dec.layers}  # noqa: E731

accepted = [11, 12]
for tok in accepted:
    dec.step(tok, hiddens())

snap = dec.snapshot()                       # a few KB: hash windows + conv rings
draft = [40, 41, 42]
h_draft = [hiddens() for _ in draft]
out_draft = [dec.step(t, h) for t, h in zip(draft, h_draft)]

dec.restore(snap)                           # the verifier rejected the draft after its first token
out_again = dec.step(draft[0], h_draft[0])  # replay the accepted prefix: identical outputs
assert all(np.array_equal(out_again[L], out_draft[0][L]) for L in dec.layers)
print("rollback replay identical:", True)
