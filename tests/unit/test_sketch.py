from __future__ import annotations

import random

import pytest

from attnprof.aggregate.histogram import log_buckets
from attnprof.aggregate.quantiles import QuantileSketch


def test_log_buckets_1_2_5_up_to_max() -> None:
    assert log_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096]
    assert log_buckets(1000)[-1] == 1000
    with pytest.raises(ValueError):
        log_buckets(0)


@pytest.mark.parametrize("q", [0.1, 0.5, 0.9, 0.99])
def test_quantiles_within_relative_error(q: float) -> None:
    rng = random.Random(1)
    xs = [int(rng.lognormvariate(6, 1.2)) + 1 for _ in range(20000)]
    sk = QuantileSketch(0.01)
    for x in xs:
        sk.add(x)
    exact = sorted(xs)[int(q * (len(xs) - 1))]
    est = sk.quantile(q)
    assert est is not None
    assert abs(est - exact) <= 0.011 * exact + 1


def test_memory_is_bounded_by_range_not_count() -> None:
    sk = QuantileSketch(0.01)
    for i in range(200000):
        sk.add(1 + i % 8192)
    assert len(sk.counts) < 500
    assert sk.count == 200000


def test_merge_and_roundtrip() -> None:
    a, b = QuantileSketch(), QuantileSketch()
    for x in range(1, 1001):
        (a if x % 2 else b).add(x)
    a.merge(b)
    c = QuantileSketch.from_dict(a.to_dict())
    assert c.count == 1000 and c.sum == sum(range(1, 1001))
    assert c.quantile(0.5) == a.quantile(0.5)
    assert c.min == 1 and c.max == 1000


def test_empty_sketch() -> None:
    sk = QuantileSketch()
    assert sk.quantile(0.5) is None
    assert sk.summary()["mean"] is None
