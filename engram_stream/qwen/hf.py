"""qwen3.8-flash-next checkpoints in the model's Hugging Face layout (not yet readable here)."""
from __future__ import annotations

import os


def load(path, mmap=True, compression=None):
    raise NotImplementedError("qwen3.8-flash-next checkpoints cannot be loaded yet")


def save(cfg, plan, layers, path, table_dtype=None, progress=None, before_write=None):
    raise NotImplementedError("qwen3.8-flash-next checkpoints cannot be saved yet")


def folder_of(path):
    return None


def is_checkpoint(path) -> bool:
    return os.path.isdir(path)
