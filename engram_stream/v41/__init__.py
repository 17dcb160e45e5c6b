"""The DeepSeek-V4.1 variant: weights.py (float8 bytes), the oracle (reference.py), the
streaming engine (_engine.pyx, include/engram_fp8.h), Hugging Face folders (hf.py)."""
from .weights import BF16, E4M3, E8M0, FLOAT, NAMES, RAW, V41LayerWeights, random_e4m3, random_layer, shapes  # noqa: F401
