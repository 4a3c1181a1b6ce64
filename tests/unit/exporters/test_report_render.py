"""The cost report's renderings (report.html, report.md) of a hand-built report: rounded
numbers, escaping, self-containment, every what-if and flag, table sizes, the price-less
variant, and the formatting helpers and SVG plots they are made of."""

from __future__ import annotations

import re
from html import escape
from typing import Any

import pytest

from attnprof.contracts.report import Report, UsagePoint
from attnprof.exporters import report_format as md
from attnprof.exporters import svg_plot
from attnprof.exporters.report_html import _bucket_pos, render_html
from attnprof.exporters.report_md import render_markdown
from tests.report_sample import sample_report

EVIL = '<b>x</b>&"'


def _md_tables(text: str) -> dict[str, list[list[str]]]:
    """Markdown tables by their first header cell: the data rows' cells."""
    out: dict[str, list[list[str]]] = {}
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in block]
            assert set(block[1]) <= set("|-"), block[:2]
            out[cells[0][0]] = cells[2:]
            block = []
    return out


# ---------------------------------------------------------------------------------------
# Formatting helpers


@pytest.mark.parametrize(("x", "want"), [
    (182_400, "182K"), (1650, "1.65K"), (2.114, "2.11"), (950, "950"), (1_703_936, "1.7M"),
    (0.0612, "0.0612"), (999_999, "1M"), (0, "0"), (None, "—"), (float("nan"), "—"),
])
def test_fmt_count(x: float | None, want: str) -> None:
    assert md.fmt_count(x) == want


@pytest.mark.parametrize(("x", "want"), [
    (0.123, "12%"), (0.047, "4.7%"), (0.0004, "<0.1%"), (0.0, "0%"), (1.0, "100%"),
    (None, "—"),
])
def test_fmt_pct(x: float | None, want: str) -> None:
    assert md.fmt_pct(x) == want


def test_fmt_units() -> None:
    assert md.fmt_bytes(131072) == "128 KiB"
    assert md.fmt_bytes(3.4 * 2**30) == "3.4 GiB"
    assert md.fmt_bytes(512) == "512 B"
    assert md.fmt_money(1234.4) == "$1,234"
    assert md.fmt_money(0.573) == "$0.57"
    assert md.fmt_money(-12.5) == "-$12.50"
    assert md.fmt_money(None) == "—"
    assert md.fmt_duration(86400) == "24 h"
    assert md.fmt_duration(7 * 86400) == "7 d"
    assert md.fmt_duration(90) == "1.5 min"
    assert md.fmt_time(1748736000) == "2025-06-01 00:00 UTC"
    assert md.short_tokens(131072) == "128K"
    assert md.short_tokens(2**20) == "1M"
    assert md.short_tokens(1000) == "1K"
    assert md.input_text(131072.0) == "131,072"
    assert md.input_text(0.0612345) == "0.06123"
    assert md.layers_text(["L31", "L5", "L30", "L29"]) == "L5, L29\u2013L31"
    assert md.layers_text(["enc.q", "enc.k"]) == "enc.q, enc.k"


def test_nice_ticks() -> None:
    assert svg_plot.nice_ticks(0, 52300) == [0, 10000, 20000, 30000, 40000, 50000, 60000]
    assert svg_plot.nice_ticks(0, 0.062) == [0, 0.02, 0.04, 0.06, 0.08]
    t = svg_plot.nice_ticks(3.2, 97.1, 8)
    assert t[0] <= 3.2 and t[-1] >= 97.1 and len(t) <= 12
    assert svg_plot.nice_ticks(5, 5)[-1] > 5  # a flat range still gets an axis


@pytest.mark.parametrize(("x", "want"), [
    (12.5, "12.5"), (17.5, "17.5"), (250, "250"), (2.5, "2.5"), (0.25, "0.25"), (0, "0"),
    (60000, "60K"), (1_500_000, "1.5M"),
])
def test_tick_labels_keep_their_value(x: float, want: str) -> None:
    assert svg_plot.short_number(x) == want


def test_bucket_positions_are_monotone_and_on_edges() -> None:
    bounds = [128.0 * 2**i for i in range(11)]
    assert _bucket_pos(bounds, 128) == pytest.approx(1.0)
    assert _bucket_pos(bounds, 1024) == pytest.approx(4.0)
    assert 4 < _bucket_pos(bounds, 1650) < 5
    xs = [_bucket_pos(bounds, v) for v in (10, 100, 500, 3000, 131072, 300000)]
    assert xs == sorted(xs) and xs[-1] <= 12


def test_svg_plots_are_deterministic_and_escaped() -> None:
    kw: dict[str, Any] = dict(title="t <i>", x_label="layer", y_label="share (%)")
    a = svg_plot.bar_chart([1, 2, float("nan")], ["<L0>", "L1", "L2"], **kw)
    assert a == svg_plot.bar_chart([1, 2, float("nan")], ["<L0>", "L1", "L2"], **kw)
    assert "<L0>" not in a and "&lt;L0&gt;" in a and "<i>" not in a
    assert a.count("<rect") == 1 + 3  # background + one bar per value
    line = svg_plot.line_chart([0, 1, 2], [0.2, 0.5, 0.9], y_min=0, y_max=1,
                               ref_lines=[svg_plot.RefLine(0.9, "90%")], **kw)
    assert "<path d=\"M" in line and ">90%<" in line
    assert svg_plot.line_chart([], [], **kw).startswith("<svg")  # empty: an empty frame


# ---------------------------------------------------------------------------------------
# HTML


def test_html_has_the_numbers_rounded_for_people() -> None:
    h = render_html(sample_report())
    for text in ("182K", "2.11 req/s", "4.86K tok/s", "128K tokens (131,072)",
                 "1.65K / 6.1K / 21.5K / 48.2K tokens", "128 KiB (bfloat16)", "1.7M tokens",
                 "88% / 97%", "6.2%", "412", "$2.50/GPU-hour", "$7,300/month",
                 "$1,825/month", "$67.89", "0.229 GPU-h", "2.92K GPU-h", "4 \u2192 3",
                 "Attention is <strong>39%</strong>", "Verdict: KV-bound at peak",
                 "vLLM&#x27;s own scheduler statistics", "L30\u2013L31",
                 "Contexts grew in the second half", "Report built in 3.4 s"):
        assert text in h, text
    assert "131072" not in h.replace("131,072", "")  # raw numbers are not shown to people


def test_html_sections_plots_and_appendix() -> None:
    rep = sample_report()
    h = render_html(rep)
    for title in ("Biggest savings", "Traffic", "Where time goes", "KV memory", "What-ifs",
                  "Money", "Warnings", "Appendix", "Formulas", "Data window", "Versions",
                  "Provenance"):
        assert f">{title}</h" in h, title
    assert h.count("<svg") == 3
    assert "Requests by context length" in h and "max_model_len 128K" in h
    assert "p50 1.65K" in h and "p99 21.5K" in h and "p99.9 48.2K" in h
    assert "fallback (unfused)" in h and "#e07b24" in h  # per-layer legend and colour
    assert ">90%</text>" in h and "hours since 2025-06-01 00:00 UTC" in h
    for name, formula in rep.formulas.items():
        assert escape(name) in h and escape(formula) in h
    # No usage points: no usage plot (and no empty frame).
    rep.models[0].kv.usage_over_time = []
    assert render_html(rep).count("<svg") == 2


def test_html_escapes_every_string_from_the_document() -> None:
    rep = sample_report()
    m = rep.models[0]
    m.model = EVIL
    m.time.per_layer[0].layer = EVIL
    m.kv.kv_dtype = EVIL
    m.kv.verdict_evidence.append(EVIL)
    m.what_ifs[0].apply.flags.append(EVIL)
    m.what_ifs[1].notes.append("<script>alert(1)</script>")
    m.warnings.append(EVIL)
    m.savings.append(EVIL)
    rep.source.where.append(EVIL)
    rep.formulas[EVIL] = EVIL
    h = render_html(rep)
    assert "<b>x</b>" not in h and "<script" not in h
    assert h.count("&lt;b&gt;x&lt;/b&gt;&amp;&quot;") >= 10
    # Flags keep their quotes, escaped.
    assert "--hf-overrides={&quot;sliding_window&quot;: 4096" in h


def test_html_is_self_contained() -> None:
    h = render_html(sample_report())
    refs = re.findall(r"""\b(?:src|href|action|srcset|xlink:href)\s*=\s*["']?([^"'\s>]*)""", h,
                      re.I)
    assert all(r.startswith("#") for r in refs), refs
    assert not re.search(r"<(script|link|img|iframe|object|embed|audio|video)\b", h, re.I)
    assert "url(" not in h and "@import" not in h and "@font-face" not in h
    # The Prometheus URL is shown as text, never as a link.
    assert "http://prometheus.monitoring:9090" in h
    assert not re.search(r"""=\s*["']?(?:https?:)?//""", h)


def test_html_shows_every_what_if_with_its_evidence_and_flags() -> None:
    rep = sample_report()
    h = render_html(rep)
    for w in rep.models[0].what_ifs:
        assert escape(w.title) in h, w.title
        assert escape(w.formula) in h
        for f in w.apply.flags:
            assert f"<code>{escape(f)}</code>" in h, f
    assert h.count('class="badge good">measured') == 2
    assert h.count('class="badge plain">estimated') == 2
    assert h.count("<strong>Not supported by the installed vLLM</strong>") == 2
    warn = re.search(r'<div class="warn-box"><strong>Needs a change no flag gives:</strong>'
                     r"([^<]*)</div>", h)
    assert warn and "DuoAttention-style" in warn.group(1)
    # A what-if's missing numbers are left out, not shown as 0.
    card = h[h.index('id="model-0-whatif-fallback"'):h.index(">Money</h3>")]
    assert "Model time saved</dt><dd>1.2%" in card and "KV freed" not in card


def test_html_multi_model_has_a_toc_and_one_section_each() -> None:
    rep = sample_report()
    other = Report.from_json(rep.to_json()).models[0]
    other.model = "Qwen/Qwen2.5-7B-Instruct"
    rep.models.append(other)
    h = render_html(rep)
    assert '<a href="#model-0">' in h and '<a href="#model-1">' in h
    assert 'id="model-1">Qwen/Qwen2.5-7B-Instruct</h2>' in h
    assert h.count(">Biggest savings</h3>") == 2


def test_missing_values_are_a_dash_not_zero() -> None:
    rep = sample_report()
    m = rep.models[0]
    m.traffic.requests_per_s = None
    m.kv.preemptions = None
    m.kv.usage_p95 = None
    for text in (render_html(rep), render_markdown(rep)):
        assert "— req/s" not in text and "0 req/s" not in text
        assert re.search(r"Requests per second(</dt><dd>|:\*\* )—", text)
        assert re.search(r"Preemptions(</dt><dd>|:\*\* )—", text)
        assert "— / 97%" in text


def test_round_trip_through_json_renders_the_same() -> None:
    rep = sample_report()
    back = Report.from_json(rep.to_json())
    assert render_html(back) == render_html(rep)
    assert render_markdown(back) == render_markdown(rep)


# ---------------------------------------------------------------------------------------
# Markdown


def test_markdown_tables_have_one_row_per_item() -> None:
    rep = sample_report()
    m = rep.models[0]
    t = _md_tables(render_markdown(rep))
    assert len(t["Context (tokens)"]) == len(m.traffic.context.counts) == 12
    assert t["Context (tokens)"][0] == ["≤128", "2.1K", "1.2%"]
    assert t["Context (tokens)"][-1][0] == ">128K"
    assert len(t["Layer"]) == len(m.time.per_layer) == 32
    assert t["Layer"][31][:3] == ["L31", "TRITON_ATTN", "fallback"]
    assert len(t["Backend"]) == 4
    assert len(t["Phase"]) == 3  # prefill, decode, all
    assert len(t["Layers"]) == 1 and t["Layers"][0][3] == "--attention-backend=FLASHINFER"
    assert len(t["Scenario"]) == 1 + len(m.what_ifs)
    assert t["Scenario"][0][:3] == ["now", "0.229 GPU-h", "$0.57"]
    # FP8: 1 replica removed, $1,825 at a fixed fleet; autoscaled 50% of 3.1 mean replicas
    # x 1 GPU x 730 h = 1,132 GPU-hours: $2,829.
    assert t["Scenario"][1][3:] == ["1", "$1,825", "730 GPU-h", "$2,829", "1.13K GPU-h"]
    assert len(t["Component"]) == len(rep.versions)
    # 48 usage points are too many for a table; 6 are not.
    assert "KV usage" not in t
    m.kv.usage_over_time = [UsagePoint(t=1748736000.0 + 600 * k, usage=0.1 * k)
                            for k in range(6)]
    t = _md_tables(render_markdown(rep))
    assert len(t["Time"]) == 6 and t["Time"][5] == ["+50 min", "50%"]


def test_markdown_has_every_what_if_flag_and_warning() -> None:
    rep = sample_report()
    text = render_markdown(rep)
    for w in rep.models[0].what_ifs:
        assert f"#### {w.title}" in text
        for f in w.apply.flags:
            assert f"`{f}`" in text
    # A badge each, and FP8's and the fallback's savings lines end with theirs (FP8's with
    # its verdict, interval and what it banks).
    assert text.count("[measured]") == 3  # the two cards' badges and the fallback's line
    assert text.count("[measured, confirmed: time saving +6.2% [+2.1%, +9.8%], banks 2.1%]") \
        == 1
    assert text.count("[estimated]") == 2
    assert "> **Warning:** needs a change no flag gives: a kernel" in text
    assert text.count("**Not supported by the installed vLLM**") == 2
    for s in rep.models[0].savings:
        assert s in text


def test_markdown_escapes_document_strings() -> None:
    rep = sample_report()
    rep.models[0].model = EVIL
    rep.models[0].time.per_layer[0].layer = "a|b<i>"
    text = render_markdown(rep)
    assert "<b>" not in text and "<i>" not in text
    assert "## &lt;b>x&lt;/b>&\"" in text
    t = _md_tables(text)
    assert len(t["Layer"]) == 32 and t["Layer"][0][0] == "a\\|b&lt;i>"


# ---------------------------------------------------------------------------------------
# Without a price


@pytest.mark.parametrize("render", [render_html, render_markdown])
def test_without_a_price_the_report_speaks_gpu_hours(render: object) -> None:
    assert callable(render)
    text = render(sample_report(price=None))
    assert "$" not in text and "€" not in text and "Cost" not in text
    assert "GPU-hours" in text and "--gpu-hour-price" in text
    assert "0.229 GPU-h" in text and "2.92K GPU-h" in text and "730 GPU-h" in text
    priced = render(sample_report())
    assert "$7,300/month" in priced and "--gpu-hour-price" not in priced


def test_without_a_price_the_money_table_has_no_cost_columns() -> None:
    t = _md_tables(render_markdown(sample_report(price=None)))
    assert t["Scenario"][0] == ["now", "0.229 GPU-h", "—", "—", "—"]
    assert all(len(r) == 5 for r in t["Scenario"])


def test_alternatives_are_marked_wherever_savings_are_listed() -> None:
    rep = sample_report()
    text, h = render_markdown(rep), render_html(rep)
    t = _md_tables(text)
    rows = {r[0]: r for r in t["Scenario"]}
    assert ("Sliding window of 4K tokens on 24 of 32 layers (alternative to Streaming heads: "
            "20 of 32 KV heads on a 512-token window: not additive)") in rows
    assert "> Alternative to Sliding window of 4K tokens on 24 of 32 layers: not additive." \
        in text
    assert h.count("not additive.</div>") == 2
    # A what-if that replaces none says nothing of the kind.
    assert rows["FP8 KV cache"][0] == "FP8 KV cache"


def test_both_money_bases_and_the_ranking_basis_are_stated() -> None:
    rep = sample_report()
    text = render_markdown(rep)
    assert "ranked by the fixed-fleet figure" in text and "autoscaled" in text
    assert "- **Replicas removed (fixed fleet):** 1" in text
    assert "- **Saving per month (autoscaled):** $2,829/month" in text
    assert "assumes replicas follow load and memory sizes the fleet" in text
    assert "- **Evidence:** measured (measured on real vLLM servers" in text
    rep.models[0].ranked_by = "autoscaled"
    assert "ranked by the autoscaled figure (--autoscaled)" in render_html(rep)


def test_a_one_replica_source_says_whose_rate_it_is() -> None:
    rep = sample_report()
    assert "(one replica's)" not in render_markdown(rep)  # Prometheus: the fleet's
    rep.models[0].traffic.scope = "replica"
    text = render_markdown(rep)
    assert "4.86K tok/s (one replica's)" in text and "2.11 req/s (one replica's)" in text
    assert "Capacity (one replica's)" in text


def test_marker_labels_neither_overlap_nor_are_crossed() -> None:
    from attnprof.exporters.svg_plot import _place_labels

    def check(xs: list[float], labels: list[str]) -> list[tuple[int, bool]]:
        placed = _place_labels(xs, labels, right=980.0)
        for i, (ri, (a, b), _) in enumerate(placed):
            assert b <= 980.0
            for j, (rj, (c, d), full_j) in enumerate(placed):
                if i != j and ri == rj:
                    assert b < c or d < a, (i, j)  # no two labels overlap
                if i != j and full_j and rj > ri:  # j's line runs down past i's row
                    assert not a <= xs[j] <= b, (i, j)
        return [(row, full) for row, _, full in placed]

    # p99.9 near max_model_len, whose label (left of its line, at the right edge) goes
    # one row up, clear of p99.9's line.
    assert check([300.0, 560.0, 880.0, 960.0],
                 ["p50 1.65K", "p99 21.5K", "p99.9 48.2K", "max_model_len 128K"]) \
        == [(0, True), (0, True), (0, True), (1, True)]
    # A marker under another's label on every row: its line stops at the plot's top.
    assert check([560.0, 600.0], ["p99 21.5K", "p99.9 48.2K"]) == [(0, True), (1, False)]
    assert check([], []) == []
