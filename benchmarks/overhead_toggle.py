"""attnprof's own overhead, toggled inside one vLLM server (issue 32, point 7).

One vLLM-CPU server serves SmolLM2 with attnprof enabled; ``POST /attnprof/sampling`` (the
monitoring key's route) switches sampling between short rounds, so every arm runs in the
same process, on the same requests, seconds apart:

  on   - the default rates (sample rate 0.05, head statistics on 0.1 of sampled steps)
  off  - sample rate 0 and head-statistics rate 0 (the plugin stays loaded: its unsampled
         step hook is the micro-benchmark's figure, not this one's)
  full - optional: sample rate 1.0 under the default 1% overhead budget (which throttles
         it); kept only when the pilot says the headline still fits the time cap

A block runs ``on`` twice, ``off`` twice (and ``full`` once) on one request list
(``tools.whatif.draw_requests`` with the block's seed: the same requests in the same order in
every round of the block). Blocks come in pairs: a seeded random order of the rounds, then
its reverse, so every round's mean position (drift, warmth) is the same and no round always
follows another. Per block, with g() the geometric mean of the throughputs:

  headline  g(on, on')  / g(off, off')      the overhead of sampling at the default rates
  A/A       g(off', on') / g(off, on)       identical settings both sides: must hold 0
  full      full / g(off, off')

The A/A contrast costs no extra round and has the same per-block variance as the headline,
so it is the run's own noise floor. Intervals: ``analyze.measure_stats.log_ratio_interval``
over blocks (95% Student-t on log-ratios); latency quantiles from pooled per-request values
with ``paired_bootstrap_quantile`` (pairs: the same request of the same block).

Stopping: from ``--min-blocks`` on, and then only every ``--check-every`` blocks, the run
stops once the headline's 95% interval is +-``--target`` or narrower, or at the cap
(``--max-blocks``, ``--max-minutes``). The rule reads the interval's width, never its centre
(a fixed-width sequential procedure, as Chow and Robbins'), and looks rarely; stopping on a
width that happens to be low still makes the stated 95% slightly optimistic, so the results
say which bound stopped the run and every look's width.

The long-prefill stratum (prefill steps of >= ``ATTNPROF_LONG_PREFILL_TOKENS``) samples at its
own rate, which the route does not switch: the server runs with ``ATTNPROF_LONG_PREFILL_RATE=0``
so ``off`` is truly off, and this measures the base-rate sampling and head statistics.

Run: ``make bench`` (about 20 minutes on 2 cores); results in
benchmarks/results/overhead_toggle.json, then docs/overhead.md is regenerated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnprof.analyze.measure_stats import (
    log_ratio_interval,
    mde,
    paired_bootstrap_quantile,
    quantile,
    t_quantile,
)
from attnprof.contracts.whatif import Interval, TrafficShape
from attnprof.tools.whatif import RoundResult

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "benchmarks" / "results" / "overhead_toggle.json"
KEY = "bench-key"

# Prompts up to 960 tokens, over half past the 256 tokens head statistics need; all 6 of a
# round in flight at once (one wave: no closed-loop refill jitter in a round's length).
SHAPE = TrafficShape(source="benchmarks/overhead_toggle.py (fixed)", concurrency=6,
                     concurrency_basis="fixed", prompt_quantiles={"p50": 300.0, "p90": 700.0,
                                                                  "p99": 900.0, "max": 960.0},
                     output_tokens=32, max_prompt_tokens=960)

Label = tuple[str, int]
"""A round of a block: (arm, copy)."""

OFF: tuple[Label, ...] = (("off", 0), ("off", 1))
ON: tuple[Label, ...] = (("on", 0), ("on", 1))
CONTRASTS: dict[str, tuple[tuple[Label, ...], tuple[Label, ...]]] = {
    "on": (OFF, ON),
    "aa": ((("off", 0), ("on", 0)), (("off", 1), ("on", 1))),
    "full": (OFF, (("full", 0),)),
}
"""Each contrast: (baseline rounds, variant rounds) of a block, compared by geometric mean."""
HEADLINE = "on"


@dataclass(frozen=True)
class Arm:
    name: str
    sample_rate: float
    head_stats_rate: float
    copies: int
    label: str


@dataclass
class Plan:
    """When the run stops: ``target`` is the headline interval's half-width (relative)."""

    target: float = 0.005
    min_blocks: int = 8
    check_every: int = 4
    max_blocks: int = 400
    max_s: float = 15 * 60.0


@dataclass
class Round:
    block: int
    position: int
    arm: str
    copy: int
    tokens_per_s: float | None
    ttft_s: list[float | None]
    itl_s: list[float | None]
    wall_s: float
    error: str | None = None


@dataclass
class Run:
    rounds: list[Round] = field(default_factory=list)
    blocks: int = 0
    stopped_by: str = ""
    """``target`` (the headline reached +-target), ``max_blocks`` or ``max_time``."""
    checks: list[dict[str, Any]] = field(default_factory=list)
    """Each look at the headline's width: blocks so far and the half-width then."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Arms dropped after the pilot, and why."""


def default_arms(full: bool = True) -> list[Arm]:
    from attnprof.config import Config

    d = Config()
    arms = [Arm("on", d.sample_rate, d.head_stats_rate, 2,
                f"on: default rates (sample {d.sample_rate}, head statistics "
                f"{d.head_stats_rate})"),
            Arm("off", 0.0, 0.0, 2, "off: sample rate 0, head statistics 0")]
    if full:
        arms.append(Arm("full", 1.0, d.head_stats_rate, 1,
                        f"full: sample rate 1.0 under the default {d.overhead_budget:.0%} "
                        f"budget"))
    return arms


def labels(arms: Sequence[Arm]) -> list[Label]:
    return [(a.name, c) for a in arms for c in range(a.copies)]


def block_order(rounds: Sequence[Label], block: int, seed: int) -> list[Label]:
    """The rounds' order in ``block``: a seeded random order in even blocks, its reverse in
    the odd block after, so over each pair every round's mean position is the same."""
    order = list(rounds)
    random.Random(seed * 100_003 + block // 2).shuffle(order)
    return order if block % 2 == 0 else order[::-1]


def half_width(iv: Interval | None) -> float | None:
    return None if iv is None else (iv.high - iv.low) / 2


def per_block(rounds: Sequence[Round], which: Sequence[Label], blocks: int
              ) -> list[float | None]:
    """Per block 0..blocks-1, the geometric mean throughput of the rounds ``which`` (None:
    one of them did not run or failed)."""
    got: dict[tuple[int, Label], float] = {
        (r.block, (r.arm, r.copy)): r.tokens_per_s for r in rounds
        if r.error is None and r.tokens_per_s is not None and r.tokens_per_s > 0}
    out: list[float | None] = []
    for b in range(blocks):
        xs = [got.get((b, lab)) for lab in which]
        out.append(math.exp(statistics.fmean(math.log(x) for x in xs if x is not None))
                   if all(x is not None for x in xs) else None)
    return out


def contrast(rounds: Sequence[Round], name: str, blocks: int) -> Interval | None:
    """Throughput change of contrast ``name`` (:data:`CONTRASTS`), paired by block."""
    base, var = CONTRASTS[name]
    return log_ratio_interval(per_block(rounds, base, blocks), per_block(rounds, var, blocks))


def sd_log(rounds: Sequence[Round], name: str, blocks: int) -> float | None:
    """Standard deviation over blocks of contrast ``name``'s log-ratio."""
    base, var = CONTRASTS[name]
    xs = [math.log(v / b) for b, v in zip(per_block(rounds, base, blocks),
                                          per_block(rounds, var, blocks), strict=True)
          if b is not None and v is not None]
    return statistics.stdev(xs) if len(xs) > 1 else None


def blocks_for(target: float, sd: float, most: int = 10_000) -> int:
    """The fewest blocks whose 95% t interval has half-width ``target`` or less at
    log-ratio spread ``sd`` per block (``most`` when none up to it)."""
    for n in range(2, most + 1):
        if t_quantile(0.975, n - 1) * sd / math.sqrt(n) <= math.log1p(target):
            return n
    return most


def is_look(blocks: int, plan: Plan) -> bool:
    return blocks >= plan.min_blocks and (blocks - plan.min_blocks) % plan.check_every == 0


def stop_reason(blocks: int, width: float | None, elapsed_s: float, plan: Plan) -> str | None:
    """Why the run stops after ``blocks`` blocks, or None to go on. The headline interval's
    half-width counts only on a look (:func:`is_look`); its centre never does."""
    if is_look(blocks, plan) and width is not None and width <= plan.target:
        return "target"
    if blocks >= plan.max_blocks:
        return "max_blocks"
    if elapsed_s >= plan.max_s:
        return "max_time"
    return None


def drop_optional(run: Run, rounds_per_block: int, optional_rounds: int, plan: Plan,
                  elapsed_s: float) -> str | None:
    """After the pilot: the reason to drop the optional arm (``optional_rounds`` of the
    ``rounds_per_block``), or None to keep it. Kept only when the headline's projected
    blocks, at the pilot's spread and time per block with the arm, fit in the cap; else the
    headline gets its time."""
    sd = sd_log(run.rounds, HEADLINE, run.blocks)
    if sd is None or not run.rounds:
        return None
    need = blocks_for(plan.target, sd)
    per_round = statistics.fmean(r.wall_s for r in run.rounds)
    fit = run.blocks + (plan.max_s - elapsed_s) / (per_round * rounds_per_block)
    if need <= min(plan.max_blocks, fit):
        return None
    without = run.blocks + (plan.max_s - elapsed_s) / (per_round * (rounds_per_block
                                                                   - optional_rounds))
    return (f"the pilot's spread ({sd * 100:.2f}% per block) needs ~{need} blocks for "
            f"+-{plan.target:.1%}; with it ~{int(fit)} fit in the cap, without it "
            f"~{int(without)}")


def run_blocks(measure: Callable[[Label, int, int], Round], arms: Sequence[Arm], plan: Plan,
               *, seed: int = 0, optional: str | None = None,
               clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] = lambda s: None) -> Run:
    """Blocks of every round once (``measure((arm, copy), block, position)``), in
    :func:`block_order`, until :func:`stop_reason` says stop. The arm ``optional`` is
    dropped after the pilot (``min_blocks``, a block pair's end) when
    :func:`drop_optional` says so."""
    arms = list(arms)
    run = Run()
    t0 = clock()
    while True:
        for pos, lab in enumerate(block_order(labels(arms), run.blocks, seed)):
            run.rounds.append(measure(lab, run.blocks, pos))
        run.blocks += 1
        elapsed = clock() - t0
        opt = [a for a in arms if a.name == optional]
        if opt and run.blocks == plan.min_blocks and run.blocks % 2 == 0:
            why = drop_optional(run, len(labels(arms)), opt[0].copies, plan, elapsed)
            if why is not None:
                arms.remove(opt[0])
                run.dropped[opt[0].name] = why
                log(f"dropped {opt[0].name}: {why}")
        width: float | None = None
        if is_look(run.blocks, plan):
            width = half_width(contrast(run.rounds, HEADLINE, run.blocks))
            run.checks.append({"blocks": run.blocks, "half_width": width,
                               "elapsed_s": elapsed})
            log(f"look at {run.blocks} blocks: +-{(width or math.nan) * 100:.2f}%")
        why_stop = stop_reason(run.blocks, width, elapsed, plan)
        if why_stop is not None:
            run.stopped_by = why_stop
            return run


def pooled(rounds: Sequence[Round], arm: str, key: str) -> list[float]:
    """Every per-request value of ``key`` over ``arm``'s rounds (both copies)."""
    return [x for r in rounds if r.arm == arm and r.error is None
            for x in getattr(r, key) if x is not None]


def paired_lists(rounds: Sequence[Round], name: str, key: str, blocks: int
                 ) -> tuple[list[list[float | None]], list[list[float | None]]]:
    """Per-request values of contrast ``name``'s baseline and variant rounds, paired by
    (block, k-th round of each side): the same requests in the same order. A side with one
    round (``full``) pairs with the baseline's first."""
    base_labs, var_labs = CONTRASTS[name]
    by = {(r.block, (r.arm, r.copy)): r for r in rounds if r.error is None}
    base: list[list[float | None]] = []
    var: list[list[float | None]] = []
    for b in range(blocks):
        for bl, vl in zip(base_labs, var_labs, strict=False):
            if (b, bl) in by and (b, vl) in by:
                base.append(list(getattr(by[(b, bl)], key)))
                var.append(list(getattr(by[(b, vl)], key)))
    return base, var


def summarize(run: Run, arms: Sequence[Arm]) -> dict[str, Any]:
    """Per arm: pooled TTFT / ITL p50 and p99. Per contrast: the throughput interval, the
    log-ratio spread and minimum detectable effect, and the paired-bootstrap change of each
    latency quantile."""
    out_arms: dict[str, Any] = {}
    for a in arms:
        s: dict[str, Any] = {"label": a.label, "sample_rate": a.sample_rate,
                             "head_stats_rate": a.head_stats_rate,
                             "rounds": sum(1 for r in run.rounds
                                           if r.arm == a.name and r.error is None)}
        tput = [r.tokens_per_s for r in run.rounds
                if r.arm == a.name and r.error is None and r.tokens_per_s is not None]
        s["tokens_per_s_mean"] = statistics.fmean(tput) if tput else None
        for key, name in (("ttft_s", "ttft"), ("itl_s", "itl")):
            xs = pooled(run.rounds, a.name, key)
            s[f"{name}_requests"] = len(xs)
            for q in (0.5, 0.99):
                s[f"{name}_p{round(q * 100)}_s"] = quantile(xs, q) if xs else None
        out_arms[a.name] = s
    out_con: dict[str, Any] = {}
    for name in CONTRASTS:
        if not all(lab[0] in out_arms for side in CONTRASTS[name] for lab in side):
            continue
        iv = contrast(run.rounds, name, run.blocks)
        sd = sd_log(run.rounds, name, run.blocks)
        c: dict[str, Any] = {"throughput_change": asdict(iv) if iv is not None else None,
                             "half_width": half_width(iv), "sd_log": sd,
                             "mde": mde(sd, iv.rounds) if sd is not None and iv else None,
                             "holds_zero": None if iv is None else iv.low <= 0.0 <= iv.high}
        for key, qn in (("ttft_s", "ttft"), ("itl_s", "itl")):
            base, var = paired_lists(run.rounds, name, key, run.blocks)
            for q in (0.5, 0.99):
                qi = paired_bootstrap_quantile(base, var, q)
                c[f"{qn}_p{round(q * 100)}_change"] = asdict(qi) if qi is not None else None
        out_con[name] = c
    head = out_con[HEADLINE]
    return {"arms": out_arms, "contrasts": out_con, "headline_half_width": head["half_width"],
            "target_reached": run.stopped_by == "target",
            "aa_holds_zero": out_con["aa"]["holds_zero"]}


# ----- docs/overhead.md -----

def _pct(iv: dict[str, Any] | None) -> str:
    if iv is None:
        return "n/a"
    return f"{iv['mean'] * 100:+.2f}% [{iv['low'] * 100:+.2f}%, {iv['high'] * 100:+.2f}%]"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f}"


def _look(k: dict[str, Any]) -> str:
    return f"{k['blocks']} blocks +-{(k['half_width'] or math.nan) * 100:.2f}%"


def markdown(res: dict[str, Any]) -> list[str]:
    """The headline section of docs/overhead.md from overhead_toggle.json."""
    c = res["config"]
    sh = c["shape"]
    q = sh["prompt_quantiles"]
    con = res["contrasts"]
    head = con[HEADLINE]
    aa = con["aa"]
    names = {"on": "on vs off (headline)", "aa": "A/A: off', on' vs off, on (noise floor)",
             "full": "full (rate 1.0) vs off"}
    plan = c["plan"]
    target = plan["target"]
    reached = res["stopped_by"] == "target"
    lines = [
        "## Sampling switched inside one server (headline)", "",
        f"One server ({c['server']}) serving {c['model']} on {c['cores']} "
        f"cores"
        + (f" (the run and its server at niceness {c['niceness']}, so other jobs on the "
           f"machine yield to it)" if c.get("niceness") else "")
        + "; `POST /attnprof/sampling` switches attnprof's sampling between rounds "
        f"(`benchmarks/overhead_toggle.py`, raw data `benchmarks/results/overhead_toggle.json`, "
        f"run {res.get('date', '')}). A round: {c['requests']} streamed completions, all in "
        f"flight at once, prompts drawn by `tools.whatif.draw_requests` (p50 {q['p50']:.0f}, "
        f"p90 {q['p90']:.0f}, max {q['max']:.0f} tokens), {sh['output_tokens']} output tokens "
        f"each. A block: `on` twice, `off` twice"
        + (", `full` once" if "full" in res["arms"] else "")
        + " on the block's own requests (the same in every round of it), in a seeded random "
        f"order, reversed in the next block; {c['settle_s']} s after each switch before the "
        f"round. Throughput is prompt + generated tokens per second of a round's wall time; "
        f"each contrast is the per-block log-ratio of geometric means, with a 95% Student-t "
        f"interval over blocks.", "",
        f"**Sampling at the default rates changes throughput by {_pct(head['throughput_change'])}"
        f"** (95%, {res['blocks']} blocks, {res['rounds_s'] / 60:.1f} min of rounds). "
        f"**The A/A control, identical settings on both sides: {_pct(aa['throughput_change'])}, "
        f"{'holds 0' if aa['holds_zero'] else 'does NOT hold 0'}.**", ""]
    if reached:
        lines += [f"The goal of +-{target:.1%} was reached (half-width "
                  f"+-{head['half_width'] * 100:.2f}%).", ""]
    else:
        sd = head["sd_log"]
        need = blocks_for(target, sd) if sd else None
        block_s = res["rounds_s"] / max(1, res["blocks"])
        lb, la = res["load_average_before"][0], res["load_average_after"][0]
        rs = [Round(**r) for r in res.get("rounds", [])]
        base, var = CONTRASTS[HEADLINE]
        blk = [math.log(v / b) for b, v in zip(per_block(rs, base, res["blocks"]),
                                               per_block(rs, var, res["blocks"]), strict=True)
               if b is not None and v is not None]
        worst = max(blk, key=abs) if blk else None
        lines += [
            f"The goal of +-{target:.1%} was **not** reached: the run stopped at its cap "
            f"({res['stopped_by'].replace('_', ' ')}) at +-{head['half_width'] * 100:.2f}%. "
            f"Why: one block's headline log-ratio scatters by {sd * 100:.2f}% on this shared "
            f"2-core machine"
            + (f" (the worst block alone {math.expm1(worst) * 100:+.1f}%)" if worst else "")
            + f"; load average {lb:.1f} before the run, {la:.1f} after: other jobs' bursts "
            f"land in one round and not its pair, and the client, the API server and the "
            f"engine share the two cores. So +-{target:.1%} needs about "
            f"{need} blocks, ~{(need or 0) * block_s / 60:.0f} minutes of rounds at this "
            f"block length. The run was capped at {plan['max_s'] / 60:.0f} minutes.", ""]
    lines += [
        f"Minimum detectable effect (alpha 0.05, power 0.8) of the headline: "
        f"{head['mde'] * 100:.2f}%. Stopping: looks at the headline's half-width only (never "
        f"its centre) from block {plan['min_blocks']} and every {plan['check_every']} blocks "
        f"after ({len(res['checks'])} looks: "
        + ", ".join(_look(k) for k in res["checks"][:2])
        + (", ..., " + _look(res["checks"][-1]) if len(res["checks"]) > 2 else "")
        + "); stopping on a width that happened to be low would make the stated 95% slightly "
        "optimistic, which is why it looks rarely and says where it stopped.", ""]
    if res.get("dropped"):
        for arm, why in res["dropped"].items():
            lines += [f"The `{arm}` arm was dropped after the pilot ({plan['min_blocks']} "
                      f"blocks): {why}; its row uses the pilot's blocks.", ""]
    lines += ["| contrast | throughput change [95%] | MDE | TTFT p50 | TTFT p99 | ITL p50 "
              "| ITL p99 |", "|---|---|---|---|---|---|---|"]
    for k, v in con.items():
        tc = v["throughput_change"]
        lines.append(f"| {names.get(k, k)} | {_pct(tc)} ({tc['rounds'] if tc else 0} blocks) "
                     f"| {v['mde'] * 100:.2f}% | {_pct(v['ttft_p50_change'])} "
                     f"| {_pct(v['ttft_p99_change'])} | {_pct(v['itl_p50_change'])} "
                     f"| {_pct(v['itl_p99_change'])} |")
    lines += ["", "Latency changes: the quantile of pooled per-request values, paired request "
              "by request (same block, same request) with a percentile bootstrap that draws "
              "rounds, then requests within each drawn round "
              "(`analyze.measure_stats.paired_bootstrap_quantile`: a round's requests share "
              "its moment on the machine; resampling requests alone gave A/A intervals that "
              "excluded 0 on an earlier run of this benchmark); ITL is each request's "
              "mean gap between streamed tokens; n/a: too few paired requests for the "
              "quantile."]
    spurious = [f"{m.upper()} {q}" for m in ("ttft", "itl") for q in ("p50", "p99")
                if (iv := aa.get(f"{m}_{q}_change")) and not iv["low"] <= 0.0 <= iv["high"]]
    if spurious:
        lines += ["", f"**The A/A's {', '.join(spurious)} interval(s) exclude 0**: identical "
                  f"settings on both sides, so these latency intervals are narrower than this "
                  f"run's noise (a shared slowdown the bootstrap's rounds do not carry). Read the "
                  f"latency columns as descriptive, not as a verdict."]
    lines += ["",
              "| arm | rounds | mean tok/s | requests | TTFT p50 ms | TTFT p99 ms | "
              "ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for a in res["arms"].values():
        lines.append(f"| {a['label']} | {a['rounds']} | {a['tokens_per_s_mean']:.1f} "
                     f"| {a['ttft_requests']} | {_ms(a['ttft_p50_s'])} | {_ms(a['ttft_p99_s'])} "
                     f"| {_ms(a['itl_p50_s'])} | {_ms(a['itl_p99_s'])} |")
    d = res["sampler_delta"]
    sampling = [k for k, a in res["arms"].items() if a["sample_rate"] > 0]
    sampling_s = sum(r["wall_s"] for r in res.get("rounds", []) if r["arm"] in sampling) \
        or res["rounds_s"]
    lines += ["", f"attnprof's own count over the rounds (all arms): {d['seen']:.0f} steps "
              f"seen, {d['sampled']:.0f} sampled ({d['sampled_long']:.0f} in the long-prefill "
              f"stratum), {d['head_stats_steps']:.0f} with head statistics; self time "
              f"{d['self_time_s']:.2f} s ({d['head_stats_time_s']:.2f} s of it head statistics),"
              f" {d['self_time_s'] / sampling_s * 100:.2f}% of the wall time of the rounds "
              f"that sampled ({', '.join(sampling)}): attnprof's own account of its cost there, "
              f"which this run cannot check at its resolution; {d['throttles']:.0f} budget "
              f"throttles, "
              f"{d['errors']:.0f} internal errors, {d['dropped']:.0f} statistics dropped.", "",
              "What this does not measure: the plugin being loaded at all (its unsampled step "
              "hook, below, runs in every arm), and the long-prefill stratum (off in every "
              "arm: the route does not switch it). Work an `on` round leaves queued (the "
              "statistics' worker) can run into the next round despite the settle pause, "
              "which biases the headline towards 0; the random, reversed order spreads it "
              "over the arms alike.", ""]
    return lines


# ----- the real run -----

def _post(base: str, path: str, body: dict[str, Any]) -> Any:
    from attnprof.tools import http

    for _ in range(10):
        try:
            return http.post_json(base + path, body, timeout=60.0, api_key=KEY)
        except http.HttpError as err:
            if err.status != 429:  # the sampling switch: one a second
                raise
            time.sleep(1.05)
    raise RuntimeError(f"{path}: still 429 after 10 tries")


def _sampler_totals(base: str) -> dict[str, float]:
    """The workers' sampler counters and self time, head statistics' cost, internal errors
    and dropped statistics (by any reason), summed over workers."""
    from attnprof.tools import http

    snap = http.get_json(base + "/attnprof/snapshot", timeout=120.0, api_key=KEY)
    tot: dict[str, float] = {"seen": 0, "sampled": 0, "sampled_long": 0, "self_time_s": 0.0,
                             "throttles": 0, "head_stats_steps": 0, "head_stats_time_s": 0.0,
                             "errors": 0, "dropped": 0}
    for w in snap.get("workers", []):
        s = w.get("sampler", {})
        for k in ("seen", "sampled", "sampled_long", "self_time_s", "throttles"):
            tot[k] += float(s.get(k, 0) or 0)
        hs = w.get("head_stats_cost", {})
        tot["head_stats_steps"] += float(hs.get("steps", 0) or 0)
        tot["head_stats_time_s"] += float(hs.get("time_s", 0) or 0)
        for k in ("errors", "dropped"):  # counts by reason
            tot[k] += float(sum((w.get(k) or {}).values()))
    return tot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6, help="requests per round (one wave)")
    ap.add_argument("--target", type=float, default=0.005,
                    help="stop at this half-width of the headline's 95%% interval")
    ap.add_argument("--min-blocks", type=int, default=8)
    ap.add_argument("--check-every", type=int, default=4)
    ap.add_argument("--max-blocks", type=int, default=400)
    ap.add_argument("--max-minutes", type=float, default=15.0,
                    help="cap on the rounds' time (server start-up not counted)")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="pause after each switch, so work left from the previous round (the "
                    "statistics' worker's queue) drains before the next")
    ap.add_argument("--nice", type=int, default=-10,
                    help="niceness change for the run and its server (root only), so other "
                    "jobs on a shared machine yield to it; 0 leaves it")
    ap.add_argument("--no-full", action="store_true", help="leave the rate-1.0 arm out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resummarize", action="store_true",
                    help="recompute the intervals of the saved run from its raw rounds with "
                         "today's statistics, rewrite its results and docs/overhead.md")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite docs/overhead.md from the saved results, no run")
    args = ap.parse_args()
    if args.markdown_only:
        return _write_page()
    if args.resummarize:
        return _resummarize()
    plan = Plan(target=args.target, min_blocks=args.min_blocks, check_every=args.check_every,
                max_blocks=args.max_blocks, max_s=args.max_minutes * 60)
    arms = default_arms(full=not args.no_full)
    by_name = {a.name: a for a in arms}
    niceness: int | None = None
    if args.nice:
        try:
            niceness = os.nice(args.nice)
        except OSError:
            niceness = None

    from transformers import AutoTokenizer

    from attnprof.tools import models
    from attnprof.tools.server import VllmServer, free_port
    from attnprof.tools.whatif import SERVED, Corpus, draw_requests, run_round

    model = models.verified_model_dir()
    corpus = Corpus(AutoTokenizer.from_pretrained(model), 4 * SHAPE.max_prompt_tokens, args.seed)
    srv = VllmServer(model, port=free_port(), served_name=SERVED, eager=True,
                     env={"ATTNPROF_API_KEY": KEY, "ATTNPROF_LONG_PREFILL_RATE": "0"},
                     log=ROOT / "benchmarks" / "results" / "overhead_toggle.log",
                     # No prefix cache: the rounds of a block replay identical prompts, whose
                     # prefill (and head statistics) a cache hit would skip.
                     extra_args=["--no-enable-prefix-caching", "--max-model-len", "2048"])

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    reqs: dict[int, Any] = {}

    def measure(lab: Label, block: int, position: int) -> Round:
        a = by_name[lab[0]]
        _post(srv.base_url, "/attnprof/sampling",
              {"sample_rate": a.sample_rate, "head_stats_rate": a.head_stats_rate})
        time.sleep(args.settle_s)
        if block not in reqs:
            reqs.clear()
            reqs[block] = draw_requests(corpus, SHAPE, args.seed * 1_000_003 + block,
                                        args.requests)
        t = time.monotonic()
        rr: RoundResult = run_round(srv.base_url, reqs[block], args.requests)
        wall = time.monotonic() - t + args.settle_s
        log(f"block {block} {lab[0]}#{lab[1]}: {rr.tokens_per_s or math.nan:.1f} tok/s"
            + (f" ({rr.error})" if rr.error else ""))
        return Round(block, position, lab[0], lab[1], rr.tokens_per_s, rr.ttft_s, rr.itl_s,
                     wall, rr.error)

    load_before = os.getloadavg()
    srv.start()
    try:
        srv.wait_ready(900)
        warm = draw_requests(corpus, SHAPE, 999_999, args.requests)
        for _ in range(2):
            run_round(srv.base_url, warm, args.requests)
        before = _sampler_totals(srv.base_url)
        t0 = time.monotonic()
        run = run_blocks(measure, arms, plan, seed=args.seed,
                         optional=None if args.no_full else "full", log=log)
        rounds_s = time.monotonic() - t0
        time.sleep(2.5)  # past the snapshot cache's 2 s, so the totals are this run's
        after = _sampler_totals(srv.base_url)
    finally:
        srv.stop()
    result = {
        "config": {**vars(args), "shape": asdict(SHAPE), "plan": asdict(plan),
                   "model": "SmolLM2-135M-Instruct",
                   "server": "vLLM-CPU 0.32, float32, eager, prefix caching off, "
                             "max_model_len 2048, ATTNPROF_LONG_PREFILL_RATE=0",
                   "cores": os.cpu_count(), "niceness": niceness},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "blocks": run.blocks, "stopped_by": run.stopped_by, "checks": run.checks,
        "dropped": run.dropped, "rounds_s": rounds_s,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "sampler_delta": {k: after[k] - before.get(k, 0) for k in after},
        **summarize(run, arms),
        "rounds": [asdict(r) for r in run.rounds],
    }
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps(result, indent=1) + "\n")
    return _write_page()


def _resummarize() -> int:
    """The saved run's summary again from its raw rounds (the statistics changed, the
    measurements did not)."""
    res = json.loads(OUT_JSON.read_text())
    run = Run(rounds=[Round(**r) for r in res["rounds"]], blocks=res["blocks"],
              stopped_by=res["stopped_by"], checks=res["checks"], dropped=res["dropped"])
    present = {r.arm for r in run.rounds}
    arms = [a for a in default_arms() if a.name in present]
    res.update(summarize(run, arms))
    OUT_JSON.write_text(json.dumps(res, indent=1) + "\n")
    return _write_page()


def _write_page() -> int:
    """docs/overhead.md from the saved results of both overhead benchmarks."""
    import overhead

    overhead.write_markdown(json.loads(overhead.OUT_JSON.read_text()))
    print(overhead.OUT_MD.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
