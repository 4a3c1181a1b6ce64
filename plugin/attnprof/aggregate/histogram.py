"""Explicit-bucket histograms kept as plain numbers, rendered by every exporter alike.

Prometheus and OpenTelemetry get the same bucket edges, counts and sums from here, so the
two never disagree about a distribution.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BucketHistogram", "HistogramState", "bucket_quantile", "log_buckets",
           "pow2_buckets"]


def log_buckets(max_value: int, per_decade: tuple[int, ...] = (1, 2, 5)) -> list[float]:
    """1-2-5 style edges up to and including ``max_value`` (like vLLM's prompt-token buckets)."""
    if max_value < 1:
        raise ValueError("max_value must be >= 1")
    edges: list[float] = []
    mag = 1
    while True:
        for m in per_decade:
            v = m * mag
            if v >= max_value:
                edges.append(float(max_value))
                return edges
            edges.append(float(v))
        mag *= 10


def pow2_buckets(max_value: int) -> list[float]:
    """0.5, 1, 2, 4, ... up to the first power of two >= ``max_value``, for integer counts.

    The first bucket (<= 0.5) holds exactly the zeros. These edges lie on a base-2 grid, so
    OTLP exponential histograms are converted from them exactly (ATTNPROF_OTLP_HISTOGRAM).
    """
    if max_value < 1:
        raise ValueError("max_value must be >= 1")
    edges = [0.5, 1.0]
    while edges[-1] < max_value:
        edges.append(edges[-1] * 2)
    return edges


def bucket_quantile(bounds: Sequence[float], counts: Sequence[float], q: float, *,
                    interpolate: bool = False) -> float | None:
    """Quantile ``q`` of a histogram (``counts[i]`` in ``(bounds[i-1], bounds[i]]``, the last
    count above ``bounds[-1]``, which then stands for it); None when the histogram is empty or
    has no bounds.

    By default the upper bound of the bucket holding it (what a snapshot's windowed quantiles
    and the KV usage p95 promise: never below the true value). ``interpolate``: linearly
    inside its (non-empty) bucket from the bucket's lower edge, the first bucket's being 0,
    as Prometheus' ``histogram_quantile`` does (what the cost report's bucketed quantiles
    promise); ``bounds`` are then returned as given, not cast to float."""
    total = sum(counts)
    if total <= 0 or not bounds:
        return None
    target = q * total
    acc = 0.0
    lo = 0.0
    for i, c in enumerate(counts):
        if i >= len(bounds):  # the overflow bucket: its lower edge stands for it
            break
        hi = bounds[i]
        if interpolate:
            if acc + c >= target and c > 0:
                return lo + (hi - lo) * (target - acc) / c
        elif acc + c >= target:
            return float(hi)
        acc += c
        lo = hi
    return bounds[-1] if interpolate else float(bounds[-1])


@dataclass(frozen=True, slots=True)
class HistogramState:
    """A consistent copy: ``counts[i]`` values fell in ``(bounds[i-1], bounds[i]]``; the last
    count is the overflow bucket above ``bounds[-1]`` (len(counts) == len(bounds) + 1)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int
    min: float
    max: float


class BucketHistogram:
    """Not thread-safe by itself: owners observe and copy under their own lock."""

    __slots__ = ("bounds", "count", "counts", "max", "min", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        b = [float(x) for x in bounds]
        if not b or any(y <= x for x, y in itertools.pairwise(b)):
            raise ValueError("bucket bounds must be non-empty and strictly increasing")
        self.bounds = tuple(b)
        self.counts = [0] * (len(b) + 1)
        self.sum = 0.0
        self.count = 0
        self.min = math.inf
        self.max = -math.inf

    def observe(self, x: float) -> None:
        # bisect_left: a value equal to an edge belongs to that edge's bucket (le semantics).
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x

    def state(self) -> HistogramState:
        return HistogramState(self.bounds, tuple(self.counts), self.sum, self.count,
                              self.min, self.max)
