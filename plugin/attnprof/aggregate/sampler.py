"""Step sampler: geometric gaps, a long-prefill stratum and a self-time budget.

The unsampled path is one decrement and one branch (``tick``). Gaps between sampled
steps are geometric (the discrete Poisson process), so sampling never locks onto
periodic work. Rare long prefills form their own stratum with their own rate. When
attnprof's own time exceeds ``budget`` of wall time, the effective rate is scaled down
(multiplicatively, like continuous profilers' adaptive intervals) and recovers slowly.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

__all__ = ["StepSampler"]


class StepSampler:
    def __init__(
        self,
        rate: float,
        budget: float = 0.01,
        long_tokens: int = 1024,
        long_rate: float = 0.5,
        seed: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.base_rate = rate
        self.long_rate = long_rate
        self.long_tokens = long_tokens
        self.budget = budget
        self.scale = 1.0  # adaptive factor in (0, 1]
        self._rng = random.Random(seed)
        self._clock: Callable[[], float] = clock or time.perf_counter
        self._t0 = self._clock()
        self.self_time = 0.0
        self.throttles = 0
        """How often the budget cut the rate (it recovers by itself afterwards)."""
        self._window_self = 0.0
        self._window_start = self._t0
        self.seen = 0
        self.sampled = 0
        self.sampled_long = 0
        self.countdown = self._gap()
        """Steps left until the next base-stratum sample; capture decrements it inline."""

    @property
    def rate(self) -> float:
        return self.base_rate * self.scale

    def _gap(self) -> int:
        r = self.rate
        if r <= 0.0:
            return 1 << 62
        if r >= 1.0:
            return 1
        u = self._rng.random()
        return 1 + int(math.log1p(-u) / math.log1p(-r))

    def tick(self) -> bool:
        """Called once per model step; True if the step is sampled by the base stratum."""
        self.countdown -= 1
        if self.countdown > 0:
            return False
        return self.fire()

    def fire(self) -> bool:
        """The countdown reached zero: draw the next gap; True if sampling is on."""
        self.countdown = self._gap()
        return self.rate > 0.0

    def draw(self) -> float:
        """A uniform draw from the sampler's seeded stream (sub-sampling decisions)."""
        return self._rng.random()

    def long_prefill(self, prefill_tokens: int) -> bool:
        """Second stratum: an unsampled step whose prefill is long gets its own draw."""
        if prefill_tokens < self.long_tokens or self.long_rate <= 0.0:
            return False
        return self._rng.random() < self.long_rate * self.scale

    def charge(self, seconds: float) -> None:
        """Account attnprof's own time and adapt the rate to the budget (once a second)."""
        self.self_time += seconds
        self._window_self += seconds
        now = self._clock()
        span = now - self._window_start
        if span < 1.0:
            return
        frac = self._window_self / span
        old = self.scale
        if frac > self.budget:
            self.scale = max(1e-4, self.scale * max(0.1, self.budget / frac))
        elif self.scale < 1.0:
            # Recover by 25% per elapsed second, however long since the last sampled step.
            self.scale = min(1.0, self.scale * 1.25 ** min(span, 60.0))
        if self.scale < old:
            self.throttles += 1
            # Throttled: the pending gap was drawn at the old, higher rate (at rate 1 it is
            # always 1 step), so draw afresh or the cut only takes effect a sample later.
            self.countdown = self._gap()
        elif self.scale > old:
            # Recovering: a gap drawn at a throttled rate could otherwise keep sampling off
            # for hours after the load has gone.
            self.countdown = min(self.countdown, self._gap())
        self._window_self = 0.0
        self._window_start = now

    def self_time_fraction(self) -> float:
        wall = self._clock() - self._t0
        return self.self_time / wall if wall > 0 else 0.0
