"""Two-sample statistics for ``attnprof diff``: is one set of timings slower than another,
by how much, and how sure; how far apart two context-length distributions are.

Pure Python (no numpy, no scipy): the samples are small (a profile's repeats, a snapshot's
last 64 calls per layer) and the diff must run wherever attnprof is installed.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RatioTest", "distribution_distance", "mann_whitney", "ratio_test"]


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """``(U_b, p)``: U of ``b`` over ``a`` and the two-sided p-value of the Mann-Whitney U
    test, normal approximation with tie and continuity correction. ``p`` is 1.0 when either
    sample is empty or every value ties."""
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return 0.0, 1.0
    pooled = sorted([(x, 0) for x in a] + [(x, 1) for x in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = r
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    r_b = sum(r for r, (_, side) in zip(ranks, pooled, strict=True) if side == 1)
    u_b = r_b - n2 * (n2 + 1) / 2
    n = n1 + n2
    mu = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return u_b, 1.0
    z = (abs(u_b - mu) - 0.5) / math.sqrt(var)
    return u_b, min(1.0, 2 * _normal_sf(max(0.0, z)))


@dataclass
class RatioTest:
    """New vs base timings: the ratio of medians (effect size: 1.25 = 25% slower), its
    bootstrap confidence interval, and the Mann-Whitney p-value."""

    ratio: float
    low: float
    high: float
    p_value: float
    n_base: int
    n_new: int
    confidence: float = 0.95


def ratio_test(base: Sequence[float], new: Sequence[float], *, resamples: int = 2000,
               confidence: float = 0.95, seed: int = 0) -> RatioTest | None:
    """Ratio of medians new/base with a percentile-bootstrap interval (seeded: the same
    inputs give the same answer) and the Mann-Whitney p-value; None when a side is empty
    or a median is not positive."""
    base = [x for x in base if math.isfinite(x)]
    new = [x for x in new if math.isfinite(x)]
    if not base or not new:
        return None
    mb, mn = statistics.median(base), statistics.median(new)
    if mb <= 0 or mn <= 0:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        sb = statistics.median(rng.choices(base, k=len(base)))
        sn = statistics.median(rng.choices(new, k=len(new)))
        if sb > 0:
            ratios.append(sn / sb)
    ratios.sort()
    alpha = (1 - confidence) / 2
    lo = ratios[int(alpha * (len(ratios) - 1))] if ratios else float("nan")
    hi = ratios[math.ceil((1 - alpha) * (len(ratios) - 1))] if ratios else float("nan")
    _, p = mann_whitney(base, new)
    return RatioTest(ratio=mn / mb, low=lo, high=hi, p_value=p, n_base=len(base),
                     n_new=len(new), confidence=confidence)


def distribution_distance(bounds: Sequence[float], base: Sequence[float],
                          new: Sequence[float]) -> tuple[float, float] | None:
    """``(ks, w1_octaves)`` between two histograms on the same buckets: the Kolmogorov-
    Smirnov statistic (largest CDF gap, 0..1) and the Wasserstein-1 distance in octaves
    (log2 of length; 1.0 = lengths doubled), each bucket at its upper bound (the overflow
    bucket at twice the last bound). None when a side is empty or the shapes differ."""
    if not bounds or len(base) != len(new) or len(base) != len(bounds) + 1:
        return None
    tb, tn = float(sum(base)), float(sum(new))
    if tb <= 0 or tn <= 0:
        return None
    at = [math.log2(max(1.0, b)) for b in bounds]
    at.append(at[-1] + 1 if at else 0.0)
    cb = cn = 0.0
    ks = w1 = 0.0
    for i in range(len(base)):
        cb += base[i] / tb
        cn += new[i] / tn
        ks = max(ks, abs(cb - cn))
        if i + 1 < len(at):
            w1 += abs(cb - cn) * (at[i + 1] - at[i])
    return ks, w1
