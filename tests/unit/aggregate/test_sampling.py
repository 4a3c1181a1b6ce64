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
    from attnprof.host.vllm.runtime import State

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
    # An epoch boundary every 8 steps: still rate 0.01 in the long run.
    s = StepSampler(0.01, seed=11, epoch=8)
    assert _rate(s, 400000) == pytest.approx(0.01, rel=0.06)


def test_ranks_with_one_seed_sample_the_same_steps() -> None:
    ranks = [StepSampler(0.05, seed=None) for _ in range(2)]
    for r in ranks:
        r.reseed(1234)  # the server's shared seed, learnt at model build
    picks: list[list[int]] = [[], []]
    for i in range(20000):
        for r, got in zip(ranks, picks, strict=True):
            if r.tick() or (i % 7 == 0 and r.long_prefill(2048)):
                got.append(i)
    assert picks[0] == picks[1] and len(picks[0]) > 500
    assert ranks[0].decisions_digest == ranks[1].decisions_digest


def test_decisions_are_a_pure_function_of_seed_step_and_rate() -> None:
    """Step i is sampled iff its hashed coin is below the rate: whatever happened before
    (other rates, reseeds, set_rate at other steps), the same (seed, i, rate) decides alike."""
    from attnprof.aggregate.sampler import STREAM_STEP, uniform, uniforms

    assert uniforms(77, STREAM_STEP, 1000, 300) == [uniform(77, STREAM_STEP, i)
                                                     for i in range(1000, 1300)]
    s = StepSampler(0.2, seed=77)
    got = [i for i in range(5000) if s.tick()]
    assert got == [i for i in range(5000) if uniform(77, STREAM_STEP, i) < 0.2]
    # Switch the rate at step 2000: the steps after it follow the new rate's coins.
    s2 = StepSampler(0.2, seed=77)
    picks = []
    for i in range(5000):
        if i == 2000:
            s2.set_rate(0.05)
        if s2.tick():
            picks.append(i)
    assert picks == [i for i in range(5000)
                     if uniform(77, STREAM_STEP, i) < (0.2 if i < 2000 else 0.05)]


def test_decisions_are_nested_across_rates() -> None:
    sets = []
    for rate in (0.01, 0.05, 0.2, 0.7, 1.0):
        s = StepSampler(rate, seed=5)
        sets.append({i for i in range(20000) if s.tick()})
    for low, high in itertools.pairwise(sets):
        assert low < high  # every step sampled at a rate is sampled at every higher one


def test_coins_are_independent_of_each_other_and_uniform() -> None:
    from attnprof.aggregate.sampler import STREAM_HEAD_STATS, STREAM_LONG, STREAM_STEP, uniforms

    n = 40000
    a, b, c = (uniforms(3, st, 0, n) for st in (STREAM_STEP, STREAM_LONG, STREAM_HEAD_STATS))
    for xs in (a, b, c):
        assert all(0.0 <= x < 1.0 for x in xs)
        # Deciles within 5 standard errors of n/10.
        counts = [0] * 10
        for x in xs:
            counts[int(x * 10)] += 1
        assert all(abs(k - n / 10) < 5 * (n * 0.09) ** 0.5 for k in counts)
    # The streams are not the same coins (nor shifted copies).
    assert sum(x < 0.5 and y < 0.5 for x, y in zip(a, b, strict=True)) == pytest.approx(
        n / 4, rel=0.05)
    assert a[1:] != b[:-1] and a != c


class Channel:
    """The leader's announcements as rank_sync delivers them, with a delay: a follower
    reads what the leader wrote at the previous boundary."""

    def __init__(self) -> None:
        self.board: list[tuple[int, int, float]] = []
        self.seq = 0
        self.published: float | None = None

    def leader(self, step: int, wanted: float) -> list[tuple[int, int, float]]:
        if wanted != self.published:
            self.seq += 1
            self.published = wanted
            self.board = [*self.board[-7:], (self.seq, step + 128, wanted)]
            return self.board[-1:]
        return []

    def follower(self, step: int, wanted: float) -> list[tuple[int, int, float]]:
        return self.board


def test_ranks_throttled_differently_still_decide_the_same_steps() -> None:
    """Two ranks whose own self times differ (one 10x the other): with the leader's scale
    announced ahead, the sampled steps are identical, and the leader's throttle holds."""
    clocks = [FakeClock(), FakeClock()]
    ranks = [StepSampler(1.0, budget=0.01, seed=9, clock=c) for c in clocks]
    ch = Channel()
    ranks[0].sync, ranks[0].sync_role = ch.leader, "leader"
    ranks[1].sync, ranks[1].sync_role = ch.follower, "follower"
    picks: list[list[int]] = [[], []]
    figures_differed = False
    for i in range(20000):
        for k, (r, c) in enumerate(zip(ranks, clocks, strict=True)):
            c.t += 0.01
            if r.tick():
                picks[k].append(i)
                # rank 0 over budget for the first 5000 steps, rank 1 ten times more
                r.charge((0.002 if i < 5000 else 0.0) * (1 if k == 0 else 10))
        figures_differed |= ranks[0].wanted != ranks[1].wanted
    assert figures_differed  # their own budgets disagreed: only the leader's counted
    assert picks[0] == picks[1]
    assert ranks[0].throttles > 0 and ranks[0].throttles == ranks[1].throttles
    assert list(ranks[0].rate_changes) == list(ranks[1].rate_changes)
    assert ranks[0].late_changes == ranks[1].late_changes == 0
    # Throttled: the first 5000 steps sampled far less than all; recovered afterwards.
    assert sum(1 for i in picks[0] if i < 5000) < 2500
    assert sum(1 for i in picks[0] if i >= 15000) == 5000
    # Every change took effect at an announced step (a multiple of the epoch, 2 ahead).
    assert all(st % 64 == 0 for st, _ in ranks[0].rate_changes)


def test_without_agreement_throttled_ranks_diverge() -> None:
    """The same two ranks, each applying its own budget: the sets differ (what the
    announcements prevent)."""
    clocks = [FakeClock(), FakeClock()]
    ranks = [StepSampler(1.0, budget=0.01, seed=9, clock=c) for c in clocks]
    picks: list[list[int]] = [[], []]
    for i in range(6000):
        for k, (r, c) in enumerate(zip(ranks, clocks, strict=True)):
            c.t += 0.01
            if r.tick():
                picks[k].append(i)
                r.charge((0.002 if i < 5000 else 0.0) * (1 if k == 0 else 10))
    assert picks[0] != picks[1]


def test_a_late_announcement_applies_at_once_and_is_counted() -> None:
    s = StepSampler(1.0, seed=1)
    s.sync, s.sync_role = (lambda step, wanted: []), "follower"
    for _ in range(300):
        s.tick()
    s.announce(1, 100, 0.5)  # step 100 is long past
    assert s.late_changes == 1 and s.scale == 1.0
    s.tick()
    assert s.scale == 0.5 and s.rate_changes[-1] == (300, 0.5)
    s.announce(1, 1000, 0.1)  # an announcement seen before is ignored
    assert list(s.rate_changes) == [(300, 0.5)]


def test_a_scale_taken_at_an_rpc_rules_from_the_very_next_step_clamped() -> None:
    """``apply_now`` (the RPC rate channel, which every rank runs between the same two
    steps) reschedules: the next step is drawn at the new scale, as an announcement for that
    step would have it, not at the one the countdown was drawn with."""
    a, b = (StepSampler(0.5, seed=1, clock=FakeClock()) for _ in range(2))
    for s in (a, b):
        s.sync_role = "follower"  # no budget of its own: the scale is only what it is told
        for _ in range(300):
            s.tick()
    a.apply_now(1e-4)
    b.announce(1, b.step + 1, 1e-4)
    assert a.scale == 1e-4 and a.rate_changes[-1] == (300, 1e-4)
    got = [a.tick() for _ in range(2000)]
    assert got == [b.tick() for _ in range(2000)] and not any(got[:50])
    # Back up: the countdown drawn at 1e-4 would skip thousands of steps the new scale samples
    a.apply_now(1.0)
    b.announce(2, b.step + 1, 1.0)
    got = [a.tick() for _ in range(200)]
    assert got == [b.tick() for _ in range(200)] and 60 < sum(got) < 140
    a.apply_now(0.0)
    assert a.scale == 1e-4  # clamped as announcements are
    a.apply_now(7.0)
    assert a.scale == 1.0


def test_set_rate_switches_immediately_and_rejects_nonsense() -> None:
    s = StepSampler(0.0, seed=1)
    assert not any(s.tick() for _ in range(1000))
    s.set_rate(1.0)
    assert all(s.tick() for _ in range(100))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            s.set_rate(bad)


def test_an_export_never_shows_a_breaker_tripped_beside_fewer_errors_than_trip_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The export thread reads the book while the event loop records into it. CI caught
    ``capture_disabled{place="advice"} 1`` beside ``internal_errors_total{place=
    "window_advice"} 2``: the third error landed between reading the counts and reading
    the breakers. Here it lands exactly there, every time."""
    import attnprof.exporters.samples as samples_mod
    from attnprof._safety import ErrorBook
    from attnprof.host.vllm.runtime import State

    state = State(errors=ErrorBook(max_errors=3))
    state.roles.add("api_server")
    for _ in range(2):
        state.errors.record("window_advice", RuntimeError())
    real = samples_mod.error_samples

    def third_error_between_the_reads(model: str, errors: Any, dropped: Any, roles: Any,
                                      tripped: Any = (), areas: Any = ()) -> Any:
        counts = dict(errors)  # the counts are read...
        state.errors.record("window_advice", RuntimeError())  # ...another thread records...
        return real(model, counts, dropped, roles, tripped, areas)  # ...then the breakers

    monkeypatch.setattr(samples_mod, "error_samples", third_error_between_the_reads)
    got = {(x.name, dict(x.labels).get("place")): getattr(x, "value", None)
           for x in state._process_samples()}
    assert state.errors.is_off("advice")  # the third error did trip it...
    # ...and this export shows either both (count 3, breaker on) or neither: never torn.
    shown = (got[("attnprof_internal_errors_total", "window_advice")],
             got[("attnprof_capture_disabled", "advice")])
    assert shown in {(2.0, 0.0), (3.0, 1.0)}, shown
