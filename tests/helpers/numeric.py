"""How results compare: the project's float tolerance, and the property tests' hypothesis settings."""
import os

import numpy as np


# Floats compare within ATOL + RTOL*|x| (the project's tolerance: FMA, summation order);
# integers compare exactly.
RTOL, ATOL = 2e-4, 2e-5


def close(got, want, **kw):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, **kw)


def hypothesis_settings(default_examples):
    """Hypothesis settings of the property tests: ENGRAM_HYPOTHESIS_EXAMPLES=1000 for a longer
    search (the default keeps the suite fast)."""
    from hypothesis import HealthCheck, settings
    return settings(max_examples=int(os.environ.get("ENGRAM_HYPOTHESIS_EXAMPLES", default_examples)),
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bf16_bits(x):
    """bf16 bits of float32 x (exact: for values with at most 8 significant bits)."""
    u = np.float32(x).view(np.uint32)
    assert u & 0xFFFF == 0, x
    return int(u >> 16)


def f32(u):
    """The float32 of bits u."""
    return np.uint32(u).view(np.float32)


def f32_bits(x):
    """The bits of float32 x."""
    return int(np.float32(x).view(np.uint32))


def weight_panels(w):
    """W [M, E] as model weights' packed() panels [ceil(M/16), E, 16] (zero past M)."""
    M, E = w.shape
    P = (M + 15) // 16
    wt = np.zeros((P * 16, E), w.dtype)
    wt[:M] = w
    return np.ascontiguousarray(wt.reshape(P, 16, E).transpose(0, 2, 1))
