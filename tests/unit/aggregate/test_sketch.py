"""The one quantile estimator (attnprof.aggregate.quantiles): nearest-rank, exact while
small, within rel_err beyond; and the same p50/p90/p99 everywhere traffic is summarized."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from attnprof.aggregate.histogram import log_buckets
from attnprof.aggregate.quantiles import QuantileEstimator, QuantileSketch, nearest_rank

QS = (0.0, 0.01, 0.1, 0.25, 0.29, 0.5, 0.7, 0.9, 0.95, 0.99, 1.0)


def _rank_def(xs: list[float], q: float) -> float:
    """The documented definition, literally: x[ceil(q n)] (1-based), Q(0) = min."""
    s = sorted(xs)
    k = max(1, math.ceil(round(q * len(s), 9)))
    return s[k - 1]


def test_log_buckets_1_2_5_up_to_max() -> None:
    assert log_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096]
    assert log_buckets(1000)[-1] == 1000
    with pytest.raises(ValueError):
        log_buckets(0)


def test_small_samples_are_exact_nearest_rank() -> None:
    rng = random.Random(0)
    for n in [1, 2, 3, 5, 10, 20, 99, 100, 101, 777, 2048]:
        xs = [int(rng.lognormvariate(6, 1.5)) + 1 for _ in range(n)]
        est = QuantileEstimator()
        for x in xs:
            est.add(x)
        assert est.exact and est.count == n
        for q in QS:
            want = _rank_def(xs, q)
            assert est.quantile(q) == want, (n, q)
            assert want == np.quantile(xs, q, method="inverted_cdf")
        s = est.summary()
        assert (s["p50"], s["p90"], s["p99"]) == tuple(_rank_def(xs, q) for q in (.5, .9, .99))
        assert s["max"] == max(xs) and s["count"] == n and s["exact"] is True
        assert s["mean"] == pytest.approx(sum(xs) / n)


def test_p99_of_twenty_requests_is_the_largest() -> None:
    est = QuantileEstimator()
    for x in range(1, 21):
        est.add(x * 100)
    assert est.summary()["p99"] == 2000 and est.quantile(0.9) == 1800
    assert est.quantile(0.5) == 1000


@pytest.mark.parametrize("q", [0.1, 0.5, 0.9, 0.99])
def test_large_samples_within_relative_error(q: float) -> None:
    rng = random.Random(1)
    xs = [int(rng.lognormvariate(6, 1.2)) + 1 for _ in range(20000)]
    est = QuantileEstimator(0.01)
    for x in xs:
        est.add(x)
    assert not est.exact
    exact = _rank_def(xs, q)
    got = est.quantile(q)
    assert got is not None and got == int(got)  # integer data, integer answers
    assert abs(got - exact) <= 0.01 * exact + 0.5


@pytest.mark.slow
def test_switches_to_sketch_past_the_limit_and_memory_is_bounded() -> None:
    est = QuantileEstimator(exact_limit=10)
    for x in range(1, 11):
        est.add(x)
    assert est.exact and est.values() == list(range(1, 11))
    est.add(11)
    assert not est.exact and est.values() is None and est.count == 11
    big = QuantileEstimator()
    for i in range(200000):
        big.add(1 + i % 8192)
    assert len(big.sketch.counts) < 500 and big.count == 200000 and not big.exact


def test_merge_keeps_exactness_while_it_fits() -> None:
    a, b = QuantileEstimator(), QuantileEstimator()
    xs = list(range(1, 1001))
    for x in xs:
        (a if x % 2 else b).add(x)
    a.merge(b)
    assert a.exact and a.count == 1000 and a.sum == sum(xs)
    for q in QS:
        assert a.quantile(q) == _rank_def(xs, q)
    c, d = QuantileEstimator(exact_limit=1500), QuantileEstimator(exact_limit=1500)
    for x in xs:
        c.add(x)
        d.add(x + 1000)
    c.merge(d)
    assert not c.exact and c.count == 2000
    want = _rank_def(xs + [x + 1000 for x in xs], 0.9)
    got = c.quantile(0.9)
    assert got is not None and abs(got - want) <= 0.01 * want + 0.5
    with pytest.raises(ValueError):
        c.merge(QuantileEstimator(rel_err=0.02))


def test_round_trip_and_old_sketch_dicts() -> None:
    est = QuantileEstimator()
    for x in [5, 1, 3, 3, 700]:
        est.add(x)
    back = QuantileEstimator.from_dict(json.loads(json.dumps(est.to_dict())))
    assert back.exact and back.summary() == est.summary()
    assert est.to_dict()["values"] == [1, 3, 3, 5, 700]
    # Past the limit: only the sketch travels, and answers survive the trip.
    big = QuantileEstimator(exact_limit=100)
    for x in range(1, 1001):
        big.add(x)
    d = json.loads(json.dumps(big.to_dict()))
    assert "values" not in d
    assert QuantileEstimator.from_dict(d).summary() == big.summary()
    # attnprof 0.1 snapshots carry QuantileSketch.to_dict (no values, no integral flag).
    old = big.sketch.to_dict()
    del old["integral"]
    o = QuantileEstimator.from_dict(old)
    assert not o.exact and o.sketch.integral and o.summary()["p50"] == big.summary()["p50"]
    assert QuantileSketch.from_dict(est.to_dict()).count == 5
    empty = QuantileEstimator.from_dict(QuantileSketch().to_dict())
    assert empty.exact and empty.quantile(0.5) is None


def test_empty_and_ignored_values() -> None:
    est = QuantileEstimator()
    assert est.quantile(0.5) is None
    assert est.summary() == {"p50": None, "p90": None, "p99": None, "mean": None,
                             "max": None, "count": 0, "exact": True}
    est.add(-1)
    est.add(4, n=0)
    assert est.count == 0
    sk = QuantileSketch()
    assert sk.quantile(0.5) is None and sk.summary()["mean"] is None


def test_nearest_rank_weighted() -> None:
    # 80 requests of 1000, 15 of 8000, 5 of 32000
    assert nearest_rank([1000, 8000, 32000], [80, 95, 100], 0.8) == 1000
    assert nearest_rank([1000, 8000, 32000], [80, 95, 100], 0.81) == 8000
    assert nearest_rank([1000, 8000, 32000], [80, 95, 100], 0.99) == 32000
    assert nearest_rank([1, 2], [0.5, 1.0], 0.0) == 1
    with pytest.raises(ValueError):
        nearest_rank([], [], 0.5)
