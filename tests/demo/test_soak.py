"""A short soak (the long one is bench/soak.py): constant private memory, still exact."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from soak import soak  # noqa: E402  (bench/soak.py: a bench tool, not part of the package)

pytestmark = pytest.mark.native  # drives the C kernels: CI runs it again under ASan and clang


def test_soak_constant_memory_and_exact():
    samples, worst = soak(30_000, n_streams=8, check_every=5_000)
    # after the first samples (allocator warm-up), private memory must not grow
    growth_kib = max(samples[1:]) - samples[1]
    assert growth_kib < 512, f"RssAnon grew by {growth_kib} KiB over the soak: {samples}"
    assert worst <= 1.0, f"engine drifted from the batch path after the soak: {worst:.3f} of tolerance"
