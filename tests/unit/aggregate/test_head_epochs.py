"""The API server's bounded ring of per-epoch head statistics (disjoint time windows)."""

from __future__ import annotations

import numpy as np
import pytest

from attnprof.aggregate.head_epochs import EpochRing
from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HeadStatsStrata


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def delta(requests: int, heads: int = 2, phase: str = "prefill", bucket: int = 256
          ) -> HeadStatsStrata:
    """One rank's strata delta: ``requests`` requests folded at layer 0, each with one
    sampled query of weight 1."""
    st = HeadStatsStrata(HeadStatsAccumulator(1, heads, 1, window_grid=(8,)))
    acc = st.get(phase, bucket)
    for _ in range(requests):
        acc.fold_rows(0, np.array([20]), np.zeros((1, heads, len(acc.sinks_grid))),
                      np.full((1, heads, 1), 0.5), np.zeros((1, heads)), np.zeros((1, heads)))
        acc.count_request(0)
    return st


def test_epochs_close_on_requests_or_time_and_the_ring_is_bounded() -> None:
    clock = Clock()
    ring = EpochRing(max_epochs=2, epoch_s=60, epoch_requests=3, clock=clock)
    ring.add(delta(2), {})
    ring.add(delta(1), {})  # 3 requests: full, closes at the next add
    assert [int(e.requests[0]) for e in ring.epochs()] == [3]
    ring.add(delta(1), {})
    assert [int(e.requests[0]) for e in ring.epochs()] == [3, 1]
    clock.t = 61  # old enough: closes though it holds one request
    ring.add(delta(2), {})
    ring.add(delta(1, phase="decode"), {})  # decode is compared in the strata, not here
    assert [int(e.requests[0]) for e in ring.epochs()] == [3, 1, 2]
    clock.t = 200
    ring.rotate()
    ring.add(delta(1), {})
    # two closed epochs kept (the oldest went) and the current one
    assert [int(e.requests[0]) for e in ring.epochs()] == [1, 2, 1]
    assert len(ring.closed) == 2


def test_ranks_land_at_their_global_heads() -> None:
    ring = EpochRing(epoch_requests=100)
    for tp_rank in (0, 1):
        ring.add(delta(1, heads=2), {"tp_size": 2, "tp_rank": tp_rank}, total_kv_heads=4,
                 total_layers=1)
    (ep,) = ring.epochs()
    assert ep.num_q_heads == 4 and ep.queries[0].tolist() == [1, 1, 1, 1]
    assert ep.requests[0] == 1  # every rank saw the prompt: counted once
    with pytest.raises(ValueError):
        ring.add(delta(1, heads=3), {"tp_size": 2, "tp_rank": 0}, total_kv_heads=4,
                 total_layers=1)
