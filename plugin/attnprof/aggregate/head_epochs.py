"""A bounded ring of per-epoch head statistics: disjoint time windows of the traffic, for
head stability (:mod:`attnprof.analyze.sparsity.stability`).

The API server's live view merges every rank's head-statistics delta into its global strata;
it also hands each delta to :meth:`EpochRing.add`, which places the delta's prefill total at
its global layers and heads in the current epoch's accumulator. An epoch closes after
``epoch_s`` seconds or once it holds ``epoch_requests`` folded requests, whichever comes
first (a busy server compares many small windows, a quiet one waits for evidence); the ring
keeps the last ``max_epochs`` closed epochs. Memory: at most ``max_epochs + 1`` accumulators
of the model's global shape (one per epoch, prefill only: decode and the context buckets
are compared in the strata themselves). Pure numpy; thread safety is the caller's (the live
view holds its head-statistics lock).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_stats_merge import add_rank_delta, global_for
from attnprof.aggregate.head_strata import HeadStatsStrata

__all__ = ["EPOCH_REQUESTS", "EPOCH_SECONDS", "MAX_EPOCHS", "EpochRing"]

EPOCH_SECONDS = 600.0
"""An epoch closes after this long (ten minutes: heads compared across the day's traffic)."""
EPOCH_REQUESTS = 256
"""... or once it holds this many folded requests (enough to decide most windows)."""
MAX_EPOCHS = 4
"""Closed epochs kept (the oldest goes): bounded memory."""


class EpochRing:
    def __init__(self, max_epochs: int = MAX_EPOCHS, epoch_s: float = EPOCH_SECONDS,
                 epoch_requests: int = EPOCH_REQUESTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_epochs < 1 or epoch_s <= 0 or epoch_requests < 1:
            raise ValueError("max_epochs, epoch_s and epoch_requests must be positive")
        self.epoch_s = float(epoch_s)
        self.epoch_requests = int(epoch_requests)
        self.clock = clock
        self.closed: deque[HeadStatsAccumulator] = deque(maxlen=max_epochs)
        self.current: HeadStatsAccumulator | None = None
        self.started: float | None = None

    def add(self, part: HeadStatsAccumulator | HeadStatsStrata, rank: Mapping[str, Any],
            total_kv_heads: int | None = None, total_layers: int | None = None) -> None:
        """One rank's delta (strata or a plain accumulator, as the live view merges it):
        its prefill statistics go into the current epoch, at their global heads and layers
        (``ValueError`` on a shape that does not fit, as :func:`add_rank_delta`)."""
        self.rotate()
        one = part.total("prefill") if isinstance(part, HeadStatsStrata) else part
        cur = global_for(self.current, one, rank, total_kv_heads, total_layers)
        assert isinstance(cur, HeadStatsAccumulator)
        if self.current is not None and cur is not self.current and self.closed:
            # the model grew (a later pipeline stage reported more layers): the closed
            # epochs no longer share a shape with the new one and are dropped
            self.closed.clear()
        self.current = cur
        if self.started is None:
            self.started = self.clock()
        add_rank_delta(cur, one, rank)

    def rotate(self) -> None:
        """Close the current epoch when it is old enough or full enough."""
        if self.current is None or self.started is None:
            return
        full = int(self.current.requests.max(initial=0)) >= self.epoch_requests
        if full or self.clock() - self.started >= self.epoch_s:
            if self.current.queries.any():
                self.closed.append(self.current)
            self.current, self.started = None, None

    def epochs(self) -> list[HeadStatsAccumulator]:
        """Closed epochs oldest first, then the current one (each disjoint in time)."""
        out = list(self.closed)
        if self.current is not None and self.current.queries.any():
            out.append(self.current)
        return out
