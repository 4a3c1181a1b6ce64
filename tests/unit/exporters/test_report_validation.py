"""Predicted beside measured in the report: a validated what-if's table (Markdown, HTML),
its badge, and the lines ``attnprof whatif`` prints."""

from __future__ import annotations

from attnprof.contracts.report import Report
from attnprof.contracts.whatif import (
    Check,
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


def _validated(off: bool) -> Report:
    rep = sample_report()
    w = rep.models[0].what_ifs[0]
    hi = -0.2 if off else 0.3
    w.validation = Validation(
        status="measured", flags=list(w.apply.flags), reason=None, rounds=4,
        source="this run", off=off,
        checks=[Check("tokens_per_s", 0.25, 0.15, -0.5, -0.8, hi, off),
                Check("kv_capacity", 3.0, 0.02, 3.0, 3.0, 3.0, False),
                Check("greedy_agreement", None, 0.0, 0.77, 0.77, 0.77, False)])
    return rep


def test_a_check_reads_predicted_band_measured_interval_and_verdict() -> None:
    c = Check("tokens_per_s", 0.25, 0.15, -0.5, -0.8, -0.2, True)
    assert check_cells(c) == ["Throughput (tokens/s)", "+25% ± 15 pts", "-50% [-80%, -20%]",
                              "OFF: outside the stated confidence"]
    share = Check("greedy_agreement", None, 0.0, 0.77, 0.77, 0.77, False)
    assert check_cells(share) == ["Greedy agreement", "not predicted", "77%", "—"]


def test_the_report_shows_the_table_and_flags_an_off_prediction() -> None:
    rep = _validated(off=True)
    w = rep.models[0].what_ifs[0]
    assert ("prediction off: outside its confidence", "bad") in badges(w)
    md = render_markdown(rep)
    assert "| Throughput (tokens/s) | +25% ± 15 pts | -50% [-80%, -20%] | OFF" in md
    assert "1 prediction(s) off by more than the stated confidence" in md
    html = render_html(rep)
    assert "Measured on real vLLM servers" in html and "OFF: outside the stated" in html
    ok = _validated(off=False)
    assert ("predictions within their confidence", "good") in badges(ok.models[0].what_ifs[0])
    assert "every prediction within its stated confidence" in render_markdown(ok)
    # Without a validation there is no table.
    assert validation_table(sample_report().models[0].what_ifs[0])[1] == []


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
