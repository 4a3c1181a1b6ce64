"""Predicted beside measured in the report: a validated what-if's table (Markdown, HTML),
its badge, and the lines ``attnprof whatif`` prints."""

from __future__ import annotations

from attnprof.analyze.whatif import check
from attnprof.contracts.report import Report
from attnprof.contracts.whatif import (
    ArmStats,
    Check,
    CheckVerdict,
    Interval,
    TrafficShape,
    Validation,
    VariantResult,
    WhatifRun,
)
from attnprof.exporters.report_format import badges
from attnprof.exporters.report_html import render_html
from attnprof.exporters.report_md import render_markdown
from attnprof.exporters.report_validation import check_cells, validation_table
from attnprof.exporters.terminal_whatif import run_lines
from tests.report_sample import sample_report


def _check(metric: str, predicted: float | None, band: float, measured: float | None,
           low: float | None, high: float | None, verdict: CheckVerdict,
           note: str = "") -> Check:
    return Check(metric, predicted, band, measured, low, high, verdict == "off",
                 verdict=verdict, note=note)


def _validated(verdict: CheckVerdict) -> Report:
    rep = sample_report()
    w = rep.models[0].what_ifs[0]
    lo, hi = {"off": (-0.8, -0.2), "confirmed": (0.2, 0.3),
              "inconclusive": (-0.8, 0.3)}[verdict]
    w.validation = Validation(
        status="measured", flags=list(w.apply.flags), reason=None, rounds=4,
        source="this run", off=verdict == "off", verdict=verdict, mde=0.043,
        checks=[_check("tokens_per_s", 0.25, 0.15, (lo + hi) / 2, lo, hi, verdict),
                _check("itl_p99", -0.3, 0.03, None, None, None, "inconclusive",
                       "too few requests for p99: 20 paired, 100 needed"),
                _check("kv_capacity", 3.0, 0.02, 3.0, 3.0, 3.0, "confirmed"),
                _check("greedy_agreement", None, 0.0, 0.77, 0.6, 0.9, "inconclusive",
                       "6 of 6 prompts diverged")])
    return rep


def test_a_check_reads_predicted_band_measured_interval_and_one_of_three_verdicts() -> None:
    off = _check("tokens_per_s", 0.25, 0.15, -0.5, -0.8, -0.2, "off")
    assert check_cells(off) == ["Throughput (tokens/s)", "+25% ± 15 pts",
                                "-50% [-80%, -20%]", "OFF: outside its band"]
    ok = _check("tokens_per_s", 0.25, 0.077, 0.25, 0.2, 0.3, "confirmed")
    assert check_cells(ok)[1:] == ["+25% ± 7.7 pts", "+25% [+20%, +30%]", "confirmed"]
    few = _check("itl_p99", -0.3, 0.03, None, None, None, "inconclusive",
                 "too few requests for p99: 20 paired, 100 needed")
    assert check_cells(few)[2:] == ["too few requests for p99: 20 paired, 100 needed", "—"]
    share = _check("greedy_agreement", None, 0.0, 0.77, 0.77, 0.77, "inconclusive")
    assert check_cells(share) == ["Greedy agreement", "not predicted", "77%", "—"]


def test_fp8_from_the_docs_table_is_not_printed_within_nor_confirmed() -> None:
    # docs/report.md before issue 32 printed "+9.7% ± 15 pts | +2.1% [-3%, +7.2%] | within".
    c = check("tokens_per_s", 0.0975, 0.021, -0.030, 0.072, rounds=4, what_if="fp8_kv")
    verdict = check_cells(c)[3]
    assert verdict.startswith("inconclusive") and "within" not in verdict
    # One round: never judged, whatever it measured.
    one = check("tokens_per_s", 0.10, 0.10, 0.10, 0.10, rounds=1, what_if="fp8_kv")
    assert check_cells(one)[3] == "inconclusive"


def test_the_report_shows_the_verdict_in_badge_sentence_and_table() -> None:
    rep = _validated("off")
    w = rep.models[0].what_ifs[0]
    assert ("measured: prediction OFF", "bad") in badges(w)
    md = render_markdown(rep)
    assert "| Throughput (tokens/s) | +25% ± 15 pts | -50% [-80%, -20%] | OFF" in md
    assert "OFF: 1 prediction(s) with the whole 95% interval outside the band" in md
    assert "this run could detect throughput changes of ±4.3% or larger" in md
    html = render_html(rep)
    assert "Measured on real vLLM servers" in html and "OFF: outside its band" in html
    ok = _validated("confirmed")
    assert ("measured: confirmed", "good") in badges(ok.models[0].what_ifs[0])
    assert "confirmed: every money figure's 95% interval lies inside" in render_markdown(ok)
    maybe = _validated("inconclusive")
    assert ("measured: inconclusive", "warn") in badges(maybe.models[0].what_ifs[0])
    text = render_markdown(maybe)
    assert "inconclusive: 2 check(s) neither inside nor outside their band" in text
    assert "within" not in text.split("### What-ifs")[1].split("####")[1]
    # Without a validation there is no table.
    assert validation_table(sample_report().models[0].what_ifs[0])[1] == []


def test_a_report_from_before_verdicts_reads_off_as_off() -> None:
    old = {"status": "measured", "flags": [], "reason": None, "off": True, "rounds": 4,
           "source": "x", "checks": [{"metric": "tokens_per_s", "predicted": 0.1,
                                      "band": 0.05, "measured": -0.5, "low": -0.6,
                                      "high": -0.4, "off": True}]}
    v = Validation.from_json(old)
    assert v.verdict == "off" and v.checks[0].verdict == "off"
    old["off"] = False
    old["checks"][0]["off"] = False  # type: ignore[index]
    assert Validation.from_json(old).verdict == "inconclusive"  # "within" meant only "not off"


def test_the_aa_arm_is_the_reports_noise_floor_and_the_terminals_first_line() -> None:
    rep = sample_report()
    floor = Validation(status="measured", flags=[], reason=None, rounds=8, source="this run",
                       off=False, verdict="confirmed", mde=0.02, control=True,
                       checks=[_check("tokens_per_s", 0.0, 0.077, 0.004, -0.012, 0.02,
                                      "confirmed")])
    rep.models[0].noise_floor = floor
    md = render_markdown(rep)
    assert "**Noise floor (A/A arm):** the A/A arm (a second baseline instance" in md
    assert "| Throughput (tokens/s) | +0% ± 7.7 pts | +0.4% [-1.2%, +2%] | confirmed |" in md
    assert "Noise floor (A/A arm)" in render_html(rep)
    arm = ArmStats(requests=40, refused=0, tokens_per_s=[1.0] * 8, ttft_p50_s=[], ttft_p99_s=[],
                   itl_p50_s=[], itl_p99_s=[], preemptions=None)
    run = WhatifRun(time=0.0, model="m", baseline_flags=[], rounds=8, duration_s=8.0,
                    traffic=TrafficShape("f", 3, "x", {"p50": 10.0}, 20, 100),
                    variants=[VariantResult(what_if="aa", flags=[], status="measured",
                                            rounds=8, control=True, baseline=arm,
                                            variant=arm)])
    lines = run_lines(run, rep)
    assert any(x.startswith("  aa (no flags): measured") and x.endswith("confirmed")
               for x in lines)
    assert any("+0.4% [-1.2%, +2%]" in x for x in lines)
    assert any("could detect throughput changes of ±2% or larger" in x for x in lines)
    assert not any("No A/A arm" in x for x in lines)


def test_a_variant_that_could_not_start_says_why_everywhere() -> None:
    rep = sample_report()
    w = rep.models[0].what_ifs[0]
    w.validation = Validation(status="could_not_start", flags=["--kv-cache-dtype fp8"],
                              reason="fp8 needs another backend", checks=[], off=False,
                              rounds=0, source="this run")
    assert ("could not start", "bad") in badges(w)
    assert "could not start: fp8 needs another backend" in render_markdown(rep)
    run = WhatifRun(time=0.0, model="m", baseline_flags=[], rounds=4, duration_s=8.0,
                    traffic=TrafficShape("f", 3, "x", {"p50": 10.0}, 20, 100),
                    variants=[VariantResult(what_if=w.id, flags=["--kv-cache-dtype fp8"],
                                            status="could_not_start",
                                            reason="fp8 needs another backend"),
                              VariantResult(what_if="custom", flags=["--enforce-eager"],
                                            status="measured", rounds=4,
                                            changes={"tokens_per_s":
                                                     Interval(0.1, 0.05, 0.15, 4)})])
    lines = run_lines(run, rep)
    assert any("could not start: fp8 needs another backend" in x for x in lines)
    assert any("Throughput (tokens/s)" in x and "+10% [+5%, +15%]" in x for x in lines)
    assert any("No A/A arm" in x for x in lines)
