"""The one quantile estimator: exact on small samples, a relative-error sketch beyond.

Definition (every quantile attnprof reports: snapshot, CLI table, Prometheus
``attnprof_request_tokens_quantile``, window advice): the **nearest-rank** (inverted-CDF)
quantile. Of values with total weight W, ``Q(q)`` is the smallest value x whose cumulative
weight (values <= x) is at least ``q * W``. For n unweighted values sorted ascending that is
``x[ceil(q * n)]`` (1-based; ``Q(0)`` is the minimum), numpy's ``method="inverted_cdf"``.
Quantiles are always observed values, never interpolated: p99 of 20 requests is the largest.

:class:`QuantileEstimator` keeps the raw values while there are at most ``exact_limit``
(2048) of them and answers exactly; past that it answers from its :class:`QuantileSketch`,
which applies the same rank rule to buckets, so the answer is within ``rel_err`` (1%) of the
exact one (plus 0.5 for integer data, whose answers are rounded to integers). Memory is
bounded either way: at most ``exact_limit`` values plus one counter per occupied bucket.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_EXACT_LIMIT", "QuantileEstimator", "QuantileSketch", "nearest_rank"]

DEFAULT_EXACT_LIMIT = 2048


def nearest_rank(values: Sequence[float], cum_weights: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of ``values`` (ascending) with cumulative weights ``cum_weights``
    (ascending, last = total): the first value whose cumulative weight is >= ``q * total``.

    A relative tolerance of 1e-9 absorbs float error in ``q * total`` (0.29 * 100 is
    28.999999999999996), so ``q * n`` that is mathematically an integer k picks the k-th value.
    """
    if not values:
        raise ValueError("no values")
    total = cum_weights[-1]
    target = min(max(q, 0.0), 1.0) * total - 1e-9 * total
    i = bisect.bisect_left(cum_weights, target)
    return values[min(i, len(values) - 1)]


def _cumsum(weights: Iterable[float]) -> list[float]:
    out: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        out.append(acc)
    return out


class QuantileSketch:
    """DDSketch-style sketch for non-negative values: quantiles within ``rel_err`` relative
    error, by the nearest-rank rule of this module.

    Buckets are powers of gamma = (1+a)/(1-a); a value's bucket is ceil(log_gamma(x)); a
    bucket answers with 2 gamma^k / (gamma + 1) clamped to [min, max], rounded when every
    value added was an integer. For token counts up to 10^7 at 1% error this is at most
    ~810 buckets.
    """

    def __init__(self, rel_err: float = 0.01) -> None:
        if not 0 < rel_err < 1:
            raise ValueError("rel_err must be in (0, 1)")
        self.rel_err = rel_err
        self._gamma = (1 + rel_err) / (1 - rel_err)
        self._lg = math.log(self._gamma)
        self.counts: dict[int, int] = {}
        self.zeros = 0
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.integral = True
        """Every value added was an integer (answers are then rounded to integers)."""

    def add(self, x: float, n: int = 1) -> None:
        if x < 0 or n <= 0:
            return
        self.count += n
        self.sum += x * n
        self.min = min(self.min, x)
        self.max = max(self.max, x)
        if self.integral and x != int(x):
            self.integral = False
        if x == 0:
            self.zeros += n
            return
        k = math.ceil(math.log(x) / self._lg)
        self.counts[k] = self.counts.get(k, 0) + n

    def _value(self, k: int) -> float:
        v = min(max(2 * self._gamma ** k / (self._gamma + 1), self.min), self.max)
        return float(round(v)) if self.integral else v

    def buckets(self) -> list[tuple[float, int]]:
        """``(representative value, count)`` ascending, zeros first: the distribution the
        sketch answers from (what :func:`~attnprof.analyze.sparsity.inputs.from_sketch`
        turns into lengths)."""
        out = [(0.0, self.zeros)] if self.zeros else []
        out += [(self._value(k), self.counts[k]) for k in sorted(self.counts)]
        return out

    def quantile(self, q: float) -> float | None:
        if self.count == 0:
            return None
        b = self.buckets()
        return nearest_rank([v for v, _ in b], _cumsum(n for _, n in b), q)

    def merge(self, other: QuantileSketch) -> None:
        if other.rel_err != self.rel_err:
            raise ValueError("cannot merge sketches with different rel_err")
        for k, n in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + n
        self.zeros += other.zeros
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.integral = self.integral and other.integral

    def to_dict(self) -> dict[str, Any]:
        return {
            "rel_err": self.rel_err, "count": self.count, "sum": self.sum,
            "min": None if self.count == 0 else self.min,
            "max": None if self.count == 0 else self.max,
            "zeros": self.zeros, "integral": self.integral,
            "buckets": {str(k): n for k, n in sorted(self.counts.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantileSketch:
        """Reads :meth:`to_dict` output, including attnprof 0.1 sketches (no ``integral``:
        inferred from integral sum, min and max, which token counts always have)."""
        s = cls(float(d["rel_err"]))
        s.count = int(d["count"])
        s.sum = float(d["sum"])
        s.zeros = int(d.get("zeros", 0))
        if s.count:
            s.min = float(d["min"])
            s.max = float(d["max"])
        buckets = d.get("buckets", {})
        if not isinstance(buckets, Mapping):
            raise ValueError("sketch buckets must be an object")
        s.counts = {int(k): int(v) for k, v in buckets.items()}
        if "integral" in d:
            s.integral = bool(d["integral"])
        else:
            s.integral = all(float(x).is_integer() for x in (s.sum, s.min, s.max)
                             if math.isfinite(x))
        return s

    def summary(self, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
        out: dict[str, float | None] = {f"p{round(q * 100):d}": self.quantile(q) for q in qs}
        out["mean"] = self.sum / self.count if self.count else None
        out["max"] = self.max if self.count else None
        return out


class QuantileEstimator:
    """Mergeable quantiles of a stream: exact (raw values kept) up to ``exact_limit`` values,
    the :class:`QuantileSketch` beyond. See the module docstring for the definition.

    ``add`` costs one log and a list append; ``quantile`` sorts the kept values once per
    change. Not thread-safe (callers hold their lock).
    """

    def __init__(self, rel_err: float = 0.01, exact_limit: int = DEFAULT_EXACT_LIMIT) -> None:
        if exact_limit < 0:
            raise ValueError("exact_limit must be >= 0")
        self.sketch = QuantileSketch(rel_err)
        self.exact_limit = exact_limit
        self._values: list[float] | None = []
        self._sorted = True

    # -- state --
    @property
    def count(self) -> int:
        return self.sketch.count

    @property
    def sum(self) -> float:
        return self.sketch.sum

    @property
    def rel_err(self) -> float:
        return self.sketch.rel_err

    @property
    def exact(self) -> bool:
        """True while every value is kept: quantiles are exact."""
        return self._values is not None

    def values(self) -> list[float] | None:
        """The kept values, ascending (None past ``exact_limit``)."""
        if self._values is not None and not self._sorted:
            self._values.sort()
            self._sorted = True
        return self._values

    # -- updates --
    def add(self, x: float, n: int = 1) -> None:
        if x < 0 or n <= 0:
            return
        self.sketch.add(x, n)
        if self._values is not None:
            if len(self._values) + n > self.exact_limit:
                self._values = None
            else:
                self._values.extend([x] * n)
                self._sorted = False

    def merge(self, other: QuantileEstimator) -> None:
        """Add ``other``'s observations; exact while both are and the sum fits the limit."""
        self.sketch.merge(other.sketch)
        mine, theirs = self.values(), other.values()
        if mine is None or theirs is None or len(mine) + len(theirs) > self.exact_limit:
            self._values = None
        else:
            mine.extend(theirs)
            self._sorted = False

    # -- answers --
    def distribution(self) -> list[tuple[float, int]]:
        """``(value, count)`` ascending: the exact values, or the sketch's buckets."""
        vals = self.values()
        if vals is None:
            return self.sketch.buckets()
        out: list[tuple[float, int]] = []
        for v in vals:
            if out and out[-1][0] == v:
                out[-1] = (v, out[-1][1] + 1)
            else:
                out.append((v, 1))
        return out

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile (module docstring); None when empty."""
        if self.count == 0:
            return None
        vals = self.values()
        if vals is None:
            return self.sketch.quantile(q)
        return nearest_rank(vals, range(1, len(vals) + 1), q)

    def summary(self, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[str, Any]:
        """``p50``/``p90``/``p99`` (keys ``p{100 q}``), ``mean``, ``max``, ``count``, ``exact``."""
        n = self.count
        out: dict[str, Any] = {f"p{round(q * 100):d}": self.quantile(q) for q in qs}
        out["mean"] = self.sketch.sum / n if n else None
        out["max"] = self.sketch.max if n else None
        out["count"] = n
        out["exact"] = self.exact
        return out

    # -- wire format --
    def to_dict(self) -> dict[str, Any]:
        """The sketch's dict (readable as a :class:`QuantileSketch`) plus ``exact_limit`` and,
        while exact, the sorted ``values``."""
        d = self.sketch.to_dict()
        d["exact_limit"] = self.exact_limit
        vals = self.values()
        if vals is not None:
            d["values"] = [int(v) if self.sketch.integral else v for v in vals]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantileEstimator:
        """Reads :meth:`to_dict` and plain :meth:`QuantileSketch.to_dict` dicts (attnprof 0.1
        snapshots: not exact unless empty). ``ValueError``/``KeyError``/``TypeError`` when
        malformed."""
        est = cls(float(d["rel_err"]), int(d.get("exact_limit", DEFAULT_EXACT_LIMIT)))
        est.sketch = QuantileSketch.from_dict(d)
        vals = d.get("values")
        if est.sketch.count == 0:
            est._values = []
        elif isinstance(vals, list) and len(vals) == est.sketch.count:
            est._values = [float(v) for v in vals]
            est._sorted = False
        else:
            est._values = None
        return est
