"""Graft mode: Engram added to a frozen model changes nothing at step 0.

With graft_zero_init the value projection is zero, so every Engram output is
exactly 0.0 and the grafted model's logits are bit-identical to the original's:
training can start from the frozen model without disturbing it.

    python examples/graft.py
"""
import numpy as np

from tiny_lm import TinyLM, engram_model, usage

usage(__doc__)

lm = TinyLM()
model = engram_model(graft_zero_init=True)
dec = model.decoder()

tokens = [3, 14, 15, 92, 65, 35, 89, 79]
for tok in tokens:
    base = lm.step(tok)
    dec.begin(tok)
    grafted = lm.step(tok, engram=dec)
    assert np.array_equal(base, grafted), "graft changed the model"
print(f"graft_zero_init: logits bit-identical to the frozen model for {len(tokens)} tokens")
