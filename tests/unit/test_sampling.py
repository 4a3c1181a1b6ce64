from __future__ import annotations

import itertools
from typing import Any

import pytest

from attnprof.aggregate.sampler import StepSampler


def _rate(s: StepSampler, n: int = 200000) -> float:
    return sum(s.tick() for _ in range(n)) / n


@pytest.mark.parametrize("rate", [0.01, 0.05, 0.3])
def test_long_run_rate_matches(rate: float) -> None:
    assert _rate(StepSampler(rate, seed=3)) == pytest.approx(rate, rel=0.05)


def test_rate_zero_never_and_one_always() -> None:
    assert _rate(StepSampler(0.0, seed=1), 10000) == 0.0
    assert _rate(StepSampler(1.0, seed=1), 10000) == 1.0


def test_seed_makes_it_deterministic() -> None:
    s1, s2 = StepSampler(0.1, seed=42), StepSampler(0.1, seed=42)
    assert [s1.tick() for _ in range(5000)] == [s2.tick() for _ in range(5000)]


def test_gaps_are_not_periodic() -> None:
    s = StepSampler(0.1, seed=5)
    hits = [i for i in range(50000) if s.tick()]
    gaps = {b - a for a, b in itertools.pairwise(hits)}
    assert len(gaps) > 20  # geometric gaps, not a fixed stride


def test_long_prefill_stratum() -> None:
    s = StepSampler(0.0, long_tokens=1024, long_rate=1.0, seed=0)
    assert s.long_prefill(4000) is True
    assert s.long_prefill(100) is False


class FakeClock:
    """A deterministic clock: the sampler's budget logic is pure arithmetic over time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_budget_lowers_rate_then_recovers() -> None:
    clock = FakeClock()
    s = StepSampler(0.5, budget=0.01, seed=0, clock=clock)
    for _ in range(10):  # 5% self time for 10 s: over budget
        clock.t += 1.0
        s.charge(0.05)
    assert s.rate < 0.5 * 0.3
    low = s.rate
    for _ in range(60):  # no self time: recovers
        clock.t += 1.0
        s.charge(0.0)
    assert s.rate > low and s.rate == pytest.approx(0.5)


def test_throttle_applies_to_the_very_next_steps() -> None:
    # At rate 1 every pending gap is one step; a throttle must redraw it, not wait a sample.
    clock = FakeClock()
    s = StepSampler(1.0, budget=0.01, seed=0, clock=clock)
    clock.t += 1.0
    s.charge(0.5)  # 50% self time: throttled hard
    assert s.rate < 0.2
    assert sum(s.tick() for _ in range(50)) < 25
    # The step right after the cut, over many seeds: sampled at the new rate (< 20%), not
    # always (the gap drawn at rate 1 would take it every time).
    first = 0
    for seed in range(200):
        clock = FakeClock()
        s = StepSampler(1.0, budget=0.01, seed=seed, clock=clock)
        clock.t += 1.0
        s.charge(0.5)
        first += s.tick()
    assert first < 60


def test_exporter_errors_never_trip_the_capture_breaker() -> None:
    from attnprof._safety import ErrorBook

    book = ErrorBook(max_errors=3)
    for _ in range(10):
        book.note("export_otlp", ConnectionRefusedError())
    assert not book.disabled and book.by_place["export_otlp"] == 10
    for _ in range(3):
        book.record("capture", RuntimeError())
    assert book.disabled


def test_a_failing_source_trips_the_breaker_a_failing_exporter_does_not() -> None:
    from attnprof._safety import ErrorBook
    from attnprof.capture.vllm.runtime import State

    state = State(errors=ErrorBook(max_errors=3))
    hub = state.get_hub()  # the hub wiring the server runs with

    class Down:
        name = "otlp"

        def export(self, samples: Any) -> None:
            raise ConnectionRefusedError("collector down")

    hub.sinks[:] = [Down()]
    for _ in range(10):
        hub.flush()
    assert state.errors.by_place["export_otlp"] == 10 and not state.errors.disabled
    hub.add_source("worker", lambda: [][0])  # attnprof's own sample code failing
    for _ in range(3):
        hub.flush()
    assert state.errors.by_place["export_source_worker"] == 3 and state.errors.disabled


def test_a_throttled_rate_recovers_by_elapsed_time_without_sampled_steps() -> None:
    clock = FakeClock()
    s = StepSampler(0.05, budget=0.01, seed=7, clock=clock)
    for _ in range(8):  # an overload: every second, attnprof took half the wall time
        clock.t += 1.0
        s.charge(0.5)
    assert s.scale < 1e-3
    # The load is gone: 20 ms steps, no sampled step charges anything. Within a minute of
    # steps the rate must be back (before: the next gap, drawn at the throttled rate, ran
    # for ~1e5 steps with nothing to restore the rate in between).
    first = None
    for i in range(3000):
        clock.t += 0.02
        if s.tick():
            first = i
            break
    assert first is not None and first < 3000
    for _ in range(3000):
        clock.t += 0.02
        s.tick()
    assert s.scale == 1.0


def test_checkpoints_leave_the_sampling_law_unchanged() -> None:
    # Gaps capped at 8 steps with redraws: still rate 0.01 in the long run.
    s = StepSampler(0.01, seed=11, check_every=8)
    assert _rate(s, 400000) == pytest.approx(0.01, rel=0.06)


def test_ranks_with_one_seed_sample_the_same_steps() -> None:
    ranks = [StepSampler(0.05, seed=None) for _ in range(2)]
    for r in ranks:
        r.reseed(1234)  # the server's shared seed, learnt at model build
    picks: list[list[int]] = [[], []]
    for i in range(20000):
        for r, got in zip(ranks, picks, strict=True):
            r.long_prefill(2048)  # the stratum's coin comes from the same stream, in step
            if r.tick():
                got.append(i)
    assert picks[0] == picks[1] and len(picks[0]) > 500


def test_set_rate_switches_immediately_and_rejects_nonsense() -> None:
    s = StepSampler(0.0, seed=1)
    assert not any(s.tick() for _ in range(1000))
    s.set_rate(1.0)
    assert all(s.tick() for _ in range(100))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            s.set_rate(bad)
