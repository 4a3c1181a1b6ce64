"""Step sampler: geometric gaps, a long-prefill stratum and a self-time budget.

The unsampled path is one decrement and one branch (``tick``). Gaps between sampled
steps are geometric (the discrete Poisson process), so sampling never locks onto
periodic work. Rare long prefills form their own stratum with their own rate. When
attnprof's own time exceeds ``budget`` of wall time, the effective rate is scaled down
(multiplicatively, like continuous profilers' adaptive intervals) and recovers by elapsed
time: no drawn gap is longer than ``check_every`` steps, and a gap that reaches that cap
without a sample is a checkpoint where the rate recovers and a fresh gap is drawn (geometric
gaps are memoryless, so truncating and redrawing leaves the sampling law unchanged).

Every process given the same seed makes the same decisions for the same step sequence (the
gaps and coins come from one seeded stream in a fixed order), so tensor-parallel ranks sample
the same steps: no rank waits at a collective for another rank's sampled step.
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
        check_every: int = 128,
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
        self.check_every = max(1, check_every)
        self._checkpoint = False
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
        if r >= 1.0:
            self._checkpoint = False
            return 1
        g = 1 << 62 if r <= 0.0 else 1 + int(math.log1p(-self._rng.random()) / math.log1p(-r))
        # A long gap stops at a checkpoint, where elapsed time can restore a throttled rate.
        self._checkpoint = g > self.check_every
        return self.check_every if self._checkpoint else g

    def tick(self) -> bool:
        """Called once per model step; True if the step is sampled by the base stratum."""
        self.countdown -= 1
        if self.countdown > 0:
            return False
        return self.fire()

    def fire(self) -> bool:
        """The countdown reached zero: draw the next gap; True if this step is sampled
        (False at a checkpoint, where the rate may recover first)."""
        if self._checkpoint:
            self._recover()
            self.countdown = self._gap()
            return False
        self.countdown = self._gap()
        return self.rate > 0.0

    def _recover(self) -> None:
        """At a checkpoint: restore a throttled rate by the time elapsed without samples."""
        if self.scale >= 1.0:
            return
        now = self._clock()
        span = now - self._window_start
        if span < 1.0:
            return
        if self._window_self / span <= self.budget:
            self.scale = min(1.0, self.scale * 1.25 ** min(span, 60.0))
        self._window_self = 0.0
        self._window_start = now

    def reseed(self, seed: int) -> None:
        """Restart the seeded stream (a seed shared by all ranks, learnt at model build)."""
        self._rng.seed(seed)
        self.countdown = self._gap()

    def set_rate(self, rate: float) -> None:
        """Switch the base rate at run time (benchmarks' A/B arms, an operator's route); the
        next gap is drawn at the new rate. The budget's throttle stays: a switch cannot
        lift the overhead ceiling, only the rate under it."""
        if not 0.0 <= rate <= 1.0 or rate != rate:
            raise ValueError(f"sample rate {rate!r} is not in [0, 1]")
        self.base_rate = rate
        self.countdown = self._gap()

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
        if self.scale != old:
            # The pending gap was drawn at the old rate (at rate 1 always 1 step): draw afresh
            # (memoryless), or a cut only takes effect a sample later and a recovery a long,
            # throttled gap later.
            self.countdown = self._gap()
        self._window_self = 0.0
        self._window_start = now

    def self_time_fraction(self) -> float:
        wall = self._clock() - self._t0
        return self.self_time / wall if wall > 0 else 0.0
