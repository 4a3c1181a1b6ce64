"""Step sampler: hashed per-step coins, a long-prefill stratum and a self-time budget.

**Decisions are a pure function of (seed, step index, rate in force).** Step ``i`` is sampled
when ``u(seed, i) < base_rate * scale``, where ``u`` is a splitmix64 hash of the seed and the
index mapped to [0, 1). So the coins are independent across steps (the gaps between sampled
steps are geometric, as a Poisson process would give: sampling never locks onto periodic
work), and they are **nested across rates**: a step sampled at rate r is sampled at every rate
above r. The long-prefill stratum and the head-statistics share use coins of their own
(other hash streams) at the same step index.

**The rate in force changes only at announced step indices.** The self-time budget measures
attnprof's own time each second and computes the *wanted* scale (cut multiplicatively when
over ``budget``, recovered by 25% per elapsed second when under). A sampler alone in its
engine (``sync`` unset) applies it at once. Tensor-parallel ranks must decide the same steps
(a sampled step is slower: a rank sampling alone would make the others wait at the next
collective), and their self times differ, so with ``sync`` set the scale changes only through
announcements ``(sequence, step index, scale)``: at every epoch boundary (every ``epoch``
steps, where every rank runs this slow path) the first rank publishes its wanted scale for the
boundary ``lead`` steps ahead and the other ranks read it (:mod:`attnprof.capture.vllm.rank_sync`
is the channel). Every rank applies it at that same index, so the sets of sampled steps stay
identical however the budget throttles. Ranks that cannot share that channel (other nodes)
take the leader's scale at a collective RPC instead (:meth:`StepSampler.apply_now`), which
every rank runs between the same two steps.

The unsampled path is one decrement and one compare (``countdown``): the next event (a
sampled step, an epoch boundary or an announced change) is found when the countdown runs out.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["STREAM_HEAD_STATS", "STREAM_LONG", "STREAM_STEP", "StepSampler", "uniform",
           "uniforms"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
COIN_BLOCK = 1024
"""Base-stratum coins are computed this many steps at a time."""
STREAM_STEP = 0
"""Hash stream of the base stratum's per-step coin."""
STREAM_LONG = 1
"""Hash stream of the long-prefill stratum's coin."""
STREAM_HEAD_STATS = 2
"""Hash stream of the head-statistics coin of a sampled step."""

MIN_SCALE = 1e-4
"""The lowest scale the budget sets and an announcement may carry."""


def _scale(x: float) -> float:
    """A scale from outside (an announcement, an RPC) within [MIN_SCALE, 1]."""
    return min(1.0, max(MIN_SCALE, float(x)))


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _base(seed: int, stream: int) -> int:
    # Distinct, well-mixed starting points per (seed, stream).
    return _mix((seed * _GOLDEN + stream * 0xD1B54A32D192ED03) & _M64)


def uniform(seed: int, stream: int, step: int) -> float:
    """The coin of ``step`` in ``stream``: splitmix64 of (seed, stream, step) in [0, 1)."""
    z = _mix((_base(seed, stream) + (step + 1) * _GOLDEN) & _M64)
    return (z >> 11) * (1.0 / (1 << 53))


def uniforms(seed: int, stream: int, start: int, n: int) -> list[float]:
    """``uniform(seed, stream, i)`` for ``i`` in ``start .. start + n - 1``, vectorized
    (1024 coins in ~20 us: 0.02 us a step, against ~0.6 us a coin in Python)."""
    import numpy as np

    u64 = np.uint64
    with np.errstate(over="ignore"):  # splitmix64 is arithmetic modulo 2**64
        z = np.arange(start + 1, start + n + 1, dtype=u64) * u64(_GOLDEN) + u64(
            _base(seed, stream))
        z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
        z = z ^ (z >> u64(31))
    out: list[float] = ((z >> u64(11)).astype(np.float64) * (1.0 / (1 << 53))).tolist()
    return out


Sync = Callable[[int, float], "list[tuple[int, int, float]]"]
"""Called at each epoch boundary with (step index, wanted scale); returns the engine's ranks'
recent announcements ``(sequence, at_step, scale)``, oldest first (those already taken are
skipped by sequence number)."""


class StepSampler:
    def __init__(
        self,
        rate: float,
        budget: float = 0.01,
        long_tokens: int = 1024,
        long_rate: float = 0.5,
        seed: int | None = None,
        clock: Callable[[], float] | None = None,
        epoch: int = 64,
    ) -> None:
        self.base_rate = rate
        self.long_rate = long_rate
        self.long_tokens = long_tokens
        self.budget = budget
        self.scale = 1.0
        """The adaptive factor in force, in (0, 1]."""
        self.wanted = 1.0
        """What this process's own budget figure asks for (applied at once when alone)."""
        self.seed = seed if seed is not None else int.from_bytes(
            hashlib.blake2b(str((time.time_ns(), id(self))).encode(), digest_size=8).digest(),
            "little")
        self._clock: Callable[[], float] = clock or time.perf_counter
        self._t0 = self._clock()
        self.self_time = 0.0
        self.throttles = 0
        """How often the rate in force was cut (it recovers by itself afterwards)."""
        self._window_self = 0.0
        self._window_start = self._t0
        self.epoch = max(1, epoch)
        self.sync: Sync | None = None
        self.sync_role = "solo"
        """``solo`` (applies its own budget), ``leader`` (publishes it) or ``follower``."""
        self._pending: list[tuple[int, float]] = []  # announced (at_step, scale), by step
        self._seq = 0  # last announcement taken
        self.late_changes = 0
        """Announcements read after their step (the ranks' decisions may have diverged)."""
        self.rate_changes: deque[tuple[int, float]] = deque(maxlen=16)
        """The last changes of the scale in force: (step index, scale)."""
        self.decided = 0
        """Steps sampled by either stratum (decisions, before capture runs them)."""
        self._digest = hashlib.blake2b(digest_size=8)
        self._coins: Any = None
        self._coins_at = -1
        self._hits_key: tuple[int, float] = (-1, -1.0)
        self._hits_list: list[int] = []
        self._next = 0
        self.countdown = 0
        """Steps left until the next event (sampled step, epoch boundary, announced change);
        capture decrements it inline. The step being run is ``_next - countdown``."""
        self._reschedule(0)

    # ----- the pure part: coins and the next event -----
    @property
    def rate(self) -> float:
        return self.base_rate * self.scale

    @property
    def step(self) -> int:
        """Index of the step being decided (the last one begun)."""
        return self._next - self.countdown

    def coin(self, stream: int, step: int | None = None) -> float:
        """The uniform coin of ``step`` (default: the current step) in ``stream``."""
        return uniform(self.seed, stream, self.step if step is None else step)

    def _hits(self, block: int, r: float) -> list[int]:
        """Offsets in the coin block starting at ``block`` whose coin is below ``r``
        (cached per block and rate: one vectorized compare per 1024 steps)."""
        if (block, r) != self._hits_key:
            import numpy as np

            if block != self._coins_at:
                self._coins = np.asarray(uniforms(self.seed, STREAM_STEP, block, COIN_BLOCK))
                self._coins_at = block
            self._hits_list = np.flatnonzero(self._coins < r).tolist()
            self._hits_key = (block, r)
        return self._hits_list

    def _sampled_in(self, start: int, stop: int) -> int:
        """The first step in [start, stop) whose base coin is below the rate, else stop."""
        r = self.rate
        j = start
        while j < stop and r > 0.0:
            block = j - j % COIN_BLOCK
            hits = self._hits(block, r)
            k = bisect.bisect_left(hits, j - block)
            if k < len(hits):
                return min(block + hits[k], stop)
            j = block + COIN_BLOCK
        return stop

    def _reschedule(self, start: int) -> None:
        """Point the countdown at the first event at or after step ``start``, taking the
        step before it as the current one."""
        stop = start - start % self.epoch + self.epoch  # the next boundary after start
        if start % self.epoch == 0:
            stop = start
        if self._pending:
            stop = min(stop, self._pending[0][0])
        j = self._sampled_in(start, stop)
        self._next = j
        self.countdown = j - start + 1

    # ----- per step -----
    def tick(self) -> bool:
        """Called once per model step; True if the step is sampled by the base stratum."""
        self.countdown -= 1
        if self.countdown > 0:
            return False
        return self.fire()

    def fire(self) -> bool:
        """The countdown reached zero at step ``s``: apply announced changes, synchronize at
        an epoch boundary, decide ``s`` and point the countdown at the next event."""
        s = self._next
        if s % self.epoch == 0:
            self._boundary(s)
        while self._pending and self._pending[0][0] <= s:
            self._apply(s, self._pending.pop(0)[1])
        sampled = self._sampled_in(s, s + 1) == s
        if sampled:
            self._decide(s)
        self._reschedule(s + 1)
        return sampled

    def long_prefill(self, prefill_tokens: int) -> bool:
        """Second stratum: an unsampled step whose prefill is long gets its own coin."""
        if prefill_tokens < self.long_tokens or self.long_rate <= 0.0:
            return False
        s = self.step
        if uniform(self.seed, STREAM_LONG, s) < self.long_rate * self.scale:
            self._decide(s)
            return True
        return False

    def _decide(self, s: int) -> None:
        self.decided += 1
        self._digest.update(s.to_bytes(8, "little", signed=True))

    @property
    def decisions_digest(self) -> str:
        """A digest of every sampled step index so far: equal digests, equal sets."""
        return self._digest.hexdigest()

    # ----- the rate in force -----
    def _apply(self, s: int, scale: float) -> None:
        if scale != self.scale:
            if scale < self.scale:
                self.throttles += 1
            self.scale = scale
            self.rate_changes.append((s, scale))

    def _boundary(self, s: int) -> None:
        if self.sync_role != "follower":
            self._recover()
        if self.sync is None:
            return
        for got in self.sync(s, self.wanted):
            self._announce(*got, first_free=s)

    def announce(self, seq: int, at_step: int, scale: float) -> None:
        """Take an announcement between steps: from step ``at_step`` on, the scale is
        ``scale``. Read after its step (late), it applies from the next step and is counted."""
        self._announce(seq, at_step, scale, first_free=self.step + 1)
        self._reschedule(self.step + 1)

    def _announce(self, seq: int, at_step: int, scale: float, first_free: int) -> None:
        if seq <= self._seq:
            return
        if seq > self._seq + 1:
            # Announcements between the last taken and this one were never seen (overwritten
            # in the channel): the ranks may have diverged, counted like a late change.
            self.late_changes += 1
        self._seq = seq
        scale = _scale(scale)
        if at_step < first_free:
            self.late_changes += 1
            at_step = first_free
        self._pending = sorted([p for p in self._pending if p[0] < at_step]
                               + [(at_step, scale)])

    def apply_now(self, scale: float) -> None:
        """Put ``scale`` in force from the next step: an announcement taken at a collective
        RPC, which every rank of an engine runs between the same two steps (the RPC rate
        channel: ranks that cannot share the announcement file)."""
        scale = _scale(scale)
        self._apply(self.step + 1, scale)
        self._reschedule(self.step + 1)

    def reseed(self, seed: int) -> None:
        """Switch to a seed shared by all ranks (learnt at model build)."""
        self.seed = seed
        self._coins_at = -1
        self._hits_key = (-1, -1.0)
        self._reschedule(self.step + 1)

    def set_rate(self, rate: float) -> None:
        """Switch the base rate from the next step (benchmarks' A/B arms, an operator's route,
        delivered to every rank between the same two steps). The budget's scale stays: a
        switch cannot lift the overhead ceiling, only the rate under it."""
        if not 0.0 <= rate <= 1.0 or rate != rate:
            raise ValueError(f"sample rate {rate!r} is not in [0, 1]")
        self.base_rate = rate
        self._reschedule(self.step + 1)

    # ----- the budget -----
    def _want(self, scale: float) -> None:
        self.wanted = scale
        if self.sync is None and scale != self.scale:
            # Alone: no one to agree with, so the change applies from the next step.
            self._apply(self.step, scale)
            self._reschedule(self.step + 1)

    def _recover(self) -> None:
        """At a boundary: raise a throttled scale by the time elapsed without charges."""
        if self.wanted >= 1.0:
            return
        now = self._clock()
        span = now - self._window_start
        if span < 1.0:
            return
        if self._window_self / span <= self.budget:
            self._want(min(1.0, self.wanted * 1.25 ** min(span, 60.0)))
        self._window_self = 0.0
        self._window_start = now

    def charge(self, seconds: float) -> None:
        """Account attnprof's own time and compute the wanted scale (once a second)."""
        self.self_time += seconds
        self._window_self += seconds
        now = self._clock()
        span = now - self._window_start
        if span < 1.0:
            return
        frac = self._window_self / span
        want = self.wanted
        if frac > self.budget:
            want = max(MIN_SCALE, want * max(0.1, self.budget / frac))
        elif want < 1.0:
            # Recover by 25% per elapsed second, however long since the last sampled step.
            want = min(1.0, want * 1.25 ** min(span, 60.0))
        self._window_self = 0.0
        self._window_start = now
        self._want(want)

    def self_time_fraction(self) -> float:
        wall = self._clock() - self._t0
        return self.self_time / wall if wall > 0 else 0.0
