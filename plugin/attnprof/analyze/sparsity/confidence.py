"""Wilson score bounds for a share estimated from a (possibly weighted) sample.

One place for the interval used by window decisions (:mod:`.classify`) and underused-head
confidence (:mod:`.underused`). Wilson rather than p +- z SE: a sample with no failures
still gets a non-zero upper bound (z^2 / (n + z^2)), and the bounds stay inside [0, 1].
With weighted samples pass the effective sample size (Kish) as ``n`` and ``k = p n``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["wilson_bounds", "wilson_low"]


def wilson_bounds(k: Any, n: Any, z: float) -> tuple[Any, Any]:
    """(lower, upper) Wilson bounds for k successes in n, elementwise (NaN where n <= 0).
    ``z`` is one-sided: the share is <= upper with probability ~Phi(z)."""
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        nn = np.maximum(n, 1e-300)
        p = np.clip(k / nn, 0.0, 1.0)
        d = 1 + z * z / nn
        c = p + z * z / (2 * nn)
        r = z * np.sqrt(p * (1 - p) / nn + z * z / (4 * nn * nn))
        low = np.clip((c - r) / d, 0.0, 1.0)
        high = np.clip((c + r) / d, 0.0, 1.0)
    bad = ~(n > 0)
    return np.where(bad, np.nan, low), np.where(bad, np.nan, high)


def wilson_low(k: float, n: float, z: float = 1.96) -> float:
    """Lower end of the Wilson interval for k successes in n (NaN when n <= 0)."""
    if n <= 0:
        return math.nan
    return float(wilson_bounds(k, n, z)[0])
