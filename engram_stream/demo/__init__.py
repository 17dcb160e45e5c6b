"""The demo variant (the public engram_demo_v1 module): weights.py, the oracle (reference.py),
the streaming engine (_engine.pyx), single-file checkpoints (checkpoint.py)."""
