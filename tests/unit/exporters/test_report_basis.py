"""report.md and report.html show what the window advice stands on next to the what-ifs and
their money: the sentence, the need-more-traffic verdict, the dynamic-head share, and per
context bucket the traffic's requests, KV block-seconds and query tokens against what the
statistics folded (prefill and decode side by side); a source without coverage gets one
clear line. Inputs: tests/unit/analyze/test_advice_basis.py's snapshot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnprof.analyze.advice_basis import NO_COVERAGE
from attnprof.contracts.report import ModelReport, Report, ReportSource
from attnprof.exporters.report_html import render_html
from attnprof.exporters.report_md import render_markdown
from tests.unit.analyze.test_advice_basis import _model


def _report(m: ModelReport) -> Report:
    return Report(generated_at=0.0, source=ReportSource(kind="files", where=["demo.json"]),
                  models=[m], formulas={}, versions={})


def _section(md: str) -> str:
    start = md.index("### What the window advice stands on")
    return md[start:md.index("### Money", start)]


def test_markdown_prints_the_basis_between_the_what_ifs_and_the_money() -> None:
    md = render_markdown(_report(_model()))
    assert md.index("### What-ifs") < md.index("### What the window advice stands on") \
        < md.index("### Money")
    sec = _section(md)
    assert "The window advice stands on 19 of 20 requests (78% of prompt tokens, 40% of KV " \
           "block-seconds, traffic-weighted)" in sec
    assert "- **Need more traffic:** need more traffic at > 512 tokens (the 512-1024 bucket " \
           "holds 60% of the KV block-seconds" in sec
    assert "- **Dynamic KV heads (kept full):** 1 of 4 (25%); 3 rated by two or more of 4 " \
           "views" in sec
    assert "- **Decode queries in buckets with statistics:** 79%" in sec  # 300 of 380
    rows = [ln for ln in sec.splitlines() if ln.startswith("| ") and "---" not in ln]
    head, *body = rows
    assert "Prompt tokens folded / all" in head and "| Decode seqs |" in head
    cells = {r.split(" | ")[0].lstrip("| "): [c.strip() for c in r.strip("| ").split(" | ")]
             for r in body}
    assert cells["short (under 256)"] == ["short (under 256)", "16 / 16", "10 (10%)",
                                          "1.6K / 1.6K (100%)", "4", "80 / 300 (27%)"]
    assert cells["512\u20131K"] == ["512\u20131K", "0 / 1", "60 (60%)", "0 / 700 (0%)", "0",
                               "0 / 20 (0%)"]
    assert "≥1K" not in cells  # neither the traffic nor the statistics reached it
    assert list(cells) == ["short (under 256)", "256\u2013512", "512\u20131K"]


def test_html_prints_the_same_basis() -> None:
    html = render_html(_report(_model()))
    start = html.index("What the window advice stands on</h3>")
    sec = html[start:html.index("<h3>Money</h3>", start)]
    text = re.sub(r"<[^>]+>", " ", sec)
    assert "The window advice stands on 19 of 20 requests" in text
    assert 'class="warn-box"' in sec  # a need-more-traffic verdict stands out
    assert "need more traffic at &gt; 512 tokens" in sec
    assert "short (under 256)" in sec and "0 / 700 (0%)" in sec and "80 / 300 (27%)" in sec


def test_without_coverage_both_renderings_say_so_in_one_line() -> None:
    m = _model(coverage=False)
    md = render_markdown(_report(m))
    sec = _section(md)
    assert NO_COVERAGE in sec and "|" not in sec  # the line, no table, no facts
    html = render_html(_report(m))
    assert "No coverage data: the source has no head-statistics coverage" in html
    m.advice_basis = None  # a document from before 2.1
    assert NO_COVERAGE in render_markdown(_report(m))
    assert "No coverage data" in render_html(_report(m))


def test_attnprof_report_prints_what_the_advice_stands_on_beside_the_savings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command on a saved demo.json whose snapshot has coverage: the sentence is printed
    after the savings, and report.json/md carry the section."""
    import json

    from attnprof.cli import main
    from tests.golden import DEMO
    from tests.unit.analyze.test_advice_basis import _demo

    raw, wa = _demo()
    demo = {**json.loads(DEMO.read_text()), "snapshot": raw, "window_advice": wa.to_json()}
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(demo))
    out = tmp_path / "out"
    assert main(["report", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "report.json").read_text())
    basis = doc["models"][0]["advice_basis"]
    assert basis["available"] and len(basis["buckets"]) == 4
    line = [ln for ln in printed.splitlines() if "stands on" in ln]
    assert line == [f"  [{doc['models'][0]['model']}] {basis['stands_on']}"], printed
    assert "### What the window advice stands on" in (out / "report.md").read_text()
    # without coverage (the golden demo: a snapshot from before 1.9) nothing is printed
    assert main(["report", str(DEMO), "--out", str(tmp_path / "old")]) == 0
    assert "stands on" not in capsys.readouterr().out
