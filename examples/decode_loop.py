"""Greedy decoding with a tiny numpy LM whose layers 1 and 3 are Engram layers.

    python examples/decode_loop.py
"""
import numpy as np

from tiny_lm import TinyLM, engram_model, usage

usage(__doc__)

lm, model = TinyLM(), engram_model()
dec = model.decoder()                  # one StreamEngine per Engram layer, one token clock

token, text = 7, [7]
for _ in range(32):
    dec.begin(token)                   # every layer's rows are hashed now, before any layer runs
    token = int(np.argmax(lm.step(token, engram=dec)))
    text.append(token)
print("generated:", text)
