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
