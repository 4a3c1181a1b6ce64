"""OTLP histogram points from :class:`HistogramState`: explicit buckets as they are, or
base-2 exponential ones when the conversion is exact (``ATTNPROF_OTLP_HISTOGRAM``)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from attnprof.aggregate.histogram import HistogramState

__all__ = ["ExponentialBuckets", "exponential_buckets"]


@dataclass(frozen=True)
class ExponentialBuckets:
    """An OTLP base-2 exponential histogram's buckets: ``counts[i]`` counts values in
    ``(base**(offset+i), base**(offset+i+1)]`` with ``base = 2**(2**-scale)``."""

    scale: int
    zero_count: int
    offset: int
    counts: tuple[int, ...]


def _exact_log2(x: float) -> int | None:
    if not x > 0 or not math.isfinite(x):
        return None
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None


def _ceil_log2(x: float) -> int:
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def exponential_buckets(state: HistogramState,
                        integer: bool = False) -> ExponentialBuckets | None:
    """Exact conversion of explicit buckets to a base-2 exponential histogram, or None.

    Exact means every observation lands in the exponential bucket it would have been
    counted in directly. That holds when the bounds are consecutive points of a base-2
    grid (powers of two, equal exponent steps of 2**k: scale -k) and the under/overflow
    buckets can be placed from min/max: all underflow values positive, or all exactly zero
    (zero_count); the grid is coarsened (down to scale -10) until the underflow and overflow
    ranges each fit in one bucket. Explicit bounds such as 1-2-5 can never be converted
    exactly (their edges cut exponential buckets), so they return None. ``integer``: the
    values are non-negative integers (token counts), so an underflow bucket below 1 holds
    only zeros (see :func:`attnprof.aggregate.histogram.pow2_buckets`).
    """
    b, c = state.bounds, state.counts
    exps = [_exact_log2(x) for x in b]
    if any(e is None for e in exps):
        return None
    ex = [e for e in exps if e is not None]
    q = ex[1] - ex[0] if len(ex) > 1 else 1
    if q <= 0 or q & (q - 1) or any(y - x != q for x, y in itertools.pairwise(ex)):
        return None
    if ex[0] % q:
        return None
    scale = -(q.bit_length() - 1)
    k0 = ex[0] // q
    n = len(b)

    def index(v: float) -> int:  # fine-grid bucket of v > 0: base**i < v <= base**(i+1)
        return -((-_ceil_log2(v)) // q) - 1

    # (lowest, highest fine index, count) of every range whose values we know.
    ranges = [(k0 + j - 1, k0 + j - 1, c[j]) for j in range(1, n)]
    zero = 0
    if c[0]:
        if state.min > 0:
            ranges.append((index(state.min), k0 - 1, c[0]))
        elif state.min == 0 and (state.max == 0 or (integer and b[0] < 1)):
            zero = c[0]
        else:
            return None  # zeros mixed with positives (or negatives): cannot be split
    if c[n]:
        if not math.isfinite(state.max):
            return None
        ranges.append((k0 + n - 1, index(state.max), c[n]))
    live = [r for r in ranges if r[2]]
    for d in range(scale + 11):  # coarsen by d: fine index i -> i >> d; scale >= -10
        if all(lo >> d == hi >> d for lo, hi, _ in live):
            break
    else:
        return None
    merged: dict[int, int] = {}
    for lo, _, cnt in live:
        merged[lo >> d] = merged.get(lo >> d, 0) + cnt
    if not merged:
        return ExponentialBuckets(scale - d, zero, 0, ())
    off = min(merged)
    return ExponentialBuckets(scale - d, zero, off,
                              tuple(merged.get(i, 0) for i in range(off, max(merged) + 1)))
