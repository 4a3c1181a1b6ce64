"""``report.html``: the cost report (:class:`~attnprof.contracts.report.Report`) as one
self-contained page: inline CSS and inline SVG plots, no script, no font, no image, no link
that makes a request when it is viewed. Every string from the document is HTML-escaped.

The facts and tables are the ones ``report.md`` prints (:mod:`attnprof.exporters.report_format`);
this module adds the layout and the plots (:mod:`attnprof.exporters.svg_plot`).
"""

from __future__ import annotations

import math
import re
from html import escape

from attnprof.contracts.report import ModelReport, Report, WhatIf
from attnprof.exporters import report_format as md
from attnprof.exporters.report_validation import (
    checks_table,
    status_sentence,
    validation_table,
)
from attnprof.exporters.svg_plot import Marker, RefLine, bar_chart, line_chart

__all__ = ["render_html"]

_FUSED = "#3b6fb6"
_FALLBACK = "#e07b24"

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f4f5f7; color: #1d2228;
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
main { max-width: 1120px; margin: 0 auto; padding: 24px 32px 48px; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 22px; margin: 36px 0 8px; padding-top: 8px; border-top: 3px solid #3b6fb6;
  overflow-wrap: anywhere; }
h3 { font-size: 17px; margin: 28px 0 8px; color: #2c3e57; }
h4 { font-size: 15px; margin: 0 0 6px; overflow-wrap: anywhere; }
p { margin: 6px 0 10px; }
.sub { color: #5a6270; margin: 0 0 12px; }
section.box { background: #fff; border: 1px solid #dde1e6; border-radius: 8px;
  padding: 14px 20px; margin: 12px 0; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px;
  margin: 6px 0 10px; }
dl.facts dt { color: #5a6270; }
dl.facts dd { margin: 0; font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
table { border-collapse: collapse; width: 100%; margin: 8px 0 14px; font-size: 14px; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid #e3e6ea;
  vertical-align: top; overflow-wrap: break-word; }
th { background: #f0f2f5; font-weight: 600; }
td.nw { white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
ol.savings li { margin: 4px 0; font-size: 16px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(480px, 1fr));
  gap: 14px; }
.card { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; padding: 14px 18px; }
.badge { display: inline-block; font-size: 12px; font-weight: 600; padding: 1px 8px;
  border-radius: 10px; margin: 0 6px 6px 0; border: 1px solid; }
.badge.good { background: #e6f4ea; color: #1e6b34; border-color: #9fd3ad; }
.badge.plain { background: #eef0f3; color: #454d59; border-color: #c9ced6; }
.badge.warn { background: #fff4e0; color: #8a5300; border-color: #f0c77a; }
.badge.bad { background: #fde8e8; color: #a11d1d; border-color: #f0a7a7; }
.warn-box { background: #fff4e0; border-left: 4px solid #e0a028; padding: 6px 12px;
  margin: 8px 0; }
.bad-box { background: #fde8e8; border-left: 4px solid #c0392b; padding: 6px 12px;
  margin: 8px 0; }
.verdict { font-weight: 600; font-size: 16px; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace;
  font-size: 13px; }
code { background: #f0f2f5; padding: 1px 5px; border-radius: 4px; overflow-wrap: anywhere; }
pre { background: #f6f8fa; border: 1px solid #e3e6ea; border-radius: 6px; padding: 8px 10px;
  white-space: pre-wrap; overflow-wrap: anywhere; margin: 6px 0 10px; }
pre code { background: none; padding: 0; }
.plot { background: #fff; border: 1px solid #dde1e6; border-radius: 8px; padding: 8px;
  margin: 10px 0; }
.plot svg { display: block; width: 100%; height: auto; }
ul.warnings li { margin: 4px 0; }
nav.toc { margin: 8px 0 0; }
footer { color: #5a6270; font-size: 13px; margin-top: 32px; }
"""


def _e(text: object) -> str:
    return escape(str(text), quote=True)


_NUMERIC = re.compile(r"^[-+$<>≤]?[\d.,]+")


def _table(t: md.Table, numeric_from: int = 1) -> str:
    """A table; columns from ``numeric_from`` on whose cells start with a number are
    right-aligned."""
    head, rows = t
    if not rows:
        return ""
    num = [i >= numeric_from and all(_NUMERIC.match(r[i]) or r[i] == md.MISSING
                                     for r in rows if i < len(r)) for i in range(len(head))]
    cls = [' class="num"' if n else "" for n in num]
    out = ["<table><thead><tr>"
           + "".join(f"<th{c}>{_e(h)}</th>" for h, c in zip(head, cls, strict=True))
           + "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td{c or _nowrap(v)}>{_e(v)}</td>"
                                    for v, c in zip(r, cls, strict=False)) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _nowrap(cell: str) -> str:
    # One short word (a flag, a backend, "L30-L31") is not broken at its hyphens.
    return ' class="nw"' if len(cell) <= 40 and not any(ch.isspace() for ch in cell) else ""


def _facts(facts: list[tuple[str, str]]) -> str:
    return ('<dl class="facts">'
            + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts) + "</dl>")


def _anchor(i: int) -> str:
    return f"model-{i}"


# ---------------------------------------------------------------------------------------
# Plots


def _bucket_pos(bounds: list[float], v: float) -> float:
    """``v`` in bar units of the context histogram: bucket ``i`` spans [i, i+1], and within
    it the position is log-interpolated between its edges (the overflow bucket ends at
    twice the last edge)."""
    if not bounds or not math.isfinite(v) or v <= 0:
        return 0.0
    lo = bounds[0] / 2 if bounds[0] > 0 else 0.0
    for i, hi in enumerate(bounds):
        if v <= hi:
            if lo <= 0 or hi <= lo:
                return i + 0.5
            return i + max(0.0, math.log(v / lo) / math.log(hi / lo))
        lo = hi
    hi = bounds[-1] * 2
    return len(bounds) + min(1.0, math.log(v / lo) / math.log(hi / lo))


def _context_plot(m: ModelReport) -> str:
    c = m.traffic.context
    if not c.counts:
        return ""
    markers = []
    for label, v in (("p50", c.p50), ("p99", c.p99), ("p99.9", c.p999)):
        if v is not None and math.isfinite(v):
            markers.append(Marker(_bucket_pos(c.bounds, v), f"{label} {md.short_tokens(v)}",
                                  "#2c7a4b"))
    mml = m.traffic.max_model_len
    if mml is not None:
        markers.append(Marker(_bucket_pos(c.bounds, float(mml)),
                              f"max_model_len {md.short_tokens(float(mml))}", "#c0392b"))
    return bar_chart(c.counts, md.context_labels(c),
                     title="Requests by context length (prompt + generated tokens)",
                     x_label="context length bucket (tokens)", y_label="requests",
                     markers=markers, y_format=lambda v: md.fmt_count(v))


def _layer_plot(m: ModelReport) -> str:
    layers = m.time.per_layer
    if not layers:
        return ""
    has_fb = any(not x.fused for x in layers)
    legend = [("fused", _FUSED), ("fallback (unfused)", _FALLBACK)] if has_fb else \
        [("fused", _FUSED)]
    return bar_chart([x.share for x in layers], [x.layer for x in layers],
                     title="Attention time per layer (share of all sampled attention time)",
                     x_label="layer", y_label="share of attention time (%)",
                     colors=[_FUSED if x.fused else _FALLBACK for x in layers],
                     legend=legend, y_format=lambda v: md.fmt_pct(v))


def _usage_plot(m: ModelReport) -> str:
    pts = m.kv.usage_over_time
    if len(pts) < 2:
        return ""
    t0 = pts[0].t
    span = pts[-1].t - t0
    div, unit = next(((d, u) for d, u in ((86400, "days"), (3600, "hours"), (60, "minutes"))
                      if span >= 3 * d), (1, "seconds"))
    return line_chart([(p.t - t0) / div for p in pts], [p.usage for p in pts],
                      title="KV cache usage over time",
                      x_label=f"{unit} since {md.fmt_time(t0)}",
                      y_label="KV cache used (%)", y_min=0.0, y_max=1.0,
                      y_format=lambda v: f"{v * 100:.0f}%",
                      ref_lines=[RefLine(0.9, "90%")])


def _plot(svg: str) -> str:
    return f'<div class="plot">{svg}</div>' if svg else ""


# ---------------------------------------------------------------------------------------
# Sections


def _whatif_card(i: int, w: WhatIf, titles: dict[str, str]) -> str:
    out = [f'<div class="card" id="{_anchor(i)}-whatif-{_e(w.id)}"><h4>{_e(w.title)}</h4><div>']
    out += [f'<span class="badge {kind}">{_e(text)}</span>' for text, kind in md.badges(w)]
    out.append("</div>")
    alt = md.alternatives_text(w, titles)
    if alt:
        out.append(f'<div class="warn-box">{_e(alt[0].upper() + alt[1:])}.</div>')
    if w.apply.needs_change:
        out.append(f'<div class="warn-box"><strong>Needs a change no flag gives:</strong> '
                   f"{_e(w.apply.needs_change)}</div>")
    if w.apply.supported is None:
        out.append(f'<div class="warn-box"><strong>Not checked against vLLM:</strong> '
                   f"{_e(w.apply.checked_against)}.</div>")
    elif not w.apply.supported:
        out.append(f'<div class="bad-box"><strong>Not supported by the installed vLLM'
                   f"</strong> (checked against {_e(w.apply.checked_against)}).</div>")
    nums = md.whatif_numbers(w)
    out.append(_facts(nums) if nums else "<p>No saving this report can put a number on.</p>")
    if w.validation is not None:
        box = ("bad-box" if w.validation.verdict == "off" or w.validation.status != "measured"
               else "sub")
        out.append(f'<p class="{box}"><strong>Measured on real vLLM servers:</strong> '
                   f"{_e(status_sentence(w.validation))}</p>")
        vt = validation_table(w)
        if vt[1]:
            out.append(_table(vt))
    out.append(f"<p><strong>Evidence:</strong> {_e(md.evidence_text(w))}</p>")
    out.append(f"<div><strong>Formula</strong></div><pre><code>{_e(w.formula)}</code></pre>")
    if w.inputs:
        out.append("<p><strong>Inputs:</strong> " + ", ".join(
            f"<code>{_e(k)}</code> = {_e(md.input_text(v))}" for k, v in w.inputs.items()) + "</p>")
    flags = " ".join(f"<code>{_e(f)}</code>" for f in w.apply.flags) or "no flags"
    out.append(f"<p><strong>Apply:</strong> {flags} "
               f"<span class=\"sub\">(checked against {_e(w.apply.checked_against)})</span></p>")
    if w.notes:
        out.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in w.notes) + "</ul>")
    out.append("</div>")
    return "\n".join(out)


def _model(rep: Report, i: int, m: ModelReport) -> str:
    out = [f'<h2 id="{_anchor(i)}">{_e(m.model)}</h2>',
           f'<section class="box">{_facts(md.header_facts(rep, m))}</section>']

    out.append("<h3>Biggest savings</h3>")
    out.append(f'<p class="sub">{_e(md.money_basis_sentence(m))}</p>')
    if m.savings:
        out.append('<ol class="savings">' + "".join(f"<li>{_e(s)}</li>" for s in m.savings)
                   + "</ol>")
    else:
        out.append("<p>No what-if found a saving for this model.</p>")

    t = m.traffic
    out.append("<h3>Traffic</h3>")
    out.append(f'<section class="box">{_facts(md.traffic_facts(m))}')
    if t.drift is not None:
        d = t.drift
        out.append(f"<p><strong>Drift</strong> (first vs second half of the window): "
                   f"{_e(d.shift)} (p50 {_e(md.fmt_count(d.first_p50))} → "
                   f"{_e(md.fmt_count(d.second_p50))}, p99 {_e(md.fmt_count(d.first_p99))} → "
                   f"{_e(md.fmt_count(d.second_p99))} tokens)</p>")
    out.append("</section>")
    out.append(_plot(_context_plot(m)))

    tb = m.time
    out.append("<h3>Where time goes</h3>")
    if tb.overall_share is not None and math.isfinite(tb.overall_share):
        out.append(f"<p>Attention is <strong>{_e(md.fmt_pct(tb.overall_share))}</strong> of "
                   "sampled model time.</p>")
    out.append(_table(md.phase_table(m)) or "<p>No sampled model time.</p>")
    out.append(_table(md.backend_table(m)))
    out.append(_plot(_layer_plot(m)))
    if tb.fallbacks:
        out.append("<p><strong>Fallbacks</strong>: layers that ran an unfused path.</p>")
        out.append(_table(md.fallback_table(m), numeric_from=99))

    kv = m.kv
    out.append("<h3>KV memory</h3>")
    out.append(f'<section class="box"><p class="sub">{_e(md.kv_source_sentence(kv))}</p>'
               f"{_facts(md.kv_facts(kv, m.traffic.scope))}")
    if kv.verdict:
        out.append(f'<p class="verdict">Verdict: {_e(kv.verdict)}</p>')
        if kv.verdict_evidence:
            out.append("<ul>" + "".join(f"<li>{_e(x)}</li>" for x in kv.verdict_evidence)
                       + "</ul>")
    out.append("</section>")
    out.append(_plot(_usage_plot(m)))

    out.append("<h3>What-ifs</h3>")
    if m.noise_floor is not None:
        floor = m.noise_floor
        box = "bad-box" if floor.verdict == "off" or floor.status != "measured" else "sub"
        out.append(f'<p class="{box}"><strong>Noise floor (A/A arm):</strong> '
                   f"{_e(status_sentence(floor))}</p>")
        if checks_table(floor)[1]:
            out.append(_table(checks_table(floor)))
    if m.what_ifs:
        titles = {w.id: w.title for w in m.what_ifs}
        out.append('<div class="cards">'
                   + "\n".join(_whatif_card(i, w, titles) for w in m.what_ifs) + "</div>")
    else:
        out.append("<p>No what-ifs apply to this model.</p>")

    out.append(f'<h3 id="{_anchor(i)}-basis">What the window advice stands on</h3>')
    b = m.advice_basis
    box = "warn-box" if b is None or not b.available or b.need_more_traffic else "sub"
    out.append(f'<section class="box"><p class="{box}">{_e(md.basis_sentence(m))}</p>'
               + (_facts(md.basis_facts(m)) if md.basis_facts(m) else "") + "</section>")
    out.append(_table(md.basis_table(m)))

    out.append("<h3>Money</h3>")
    out.append(f'<section class="box">{_facts(md.money_facts(m))}')
    np = md.no_price_sentence(m)
    if np:
        out.append(f'<div class="warn-box">{_e(np)}</div>')
    if m.money.note:
        out.append(f"<p>{_e(m.money.note)}</p>")
    out.append("</section>")
    out.append(_table(md.money_table(m)))

    if m.warnings:
        out.append("<h3>Warnings</h3>")
        out.append('<ul class="warnings">' + "".join(f"<li>{_e(w)}</li>" for w in m.warnings)
                   + "</ul>")
    return "\n".join(x for x in out if x)


def _appendix(rep: Report) -> str:
    out = ['<h2 id="appendix">Appendix</h2>', "<h3>Formulas</h3>"]
    if rep.formulas:
        out.append('<dl class="facts">' + "".join(
            f"<dt><code>{_e(k)}</code></dt><dd><code>{_e(v)}</code></dd>"
            for k, v in rep.formulas.items()) + "</dl>")
    else:
        out.append("<p>None.</p>")
    out.append(f"<h3>Data window</h3><p>{_e(md.window_text(rep))}</p>")
    out.append("<h3>Versions</h3>" + _table(md.version_rows(rep), numeric_from=99))
    if rep.provenance is not None:
        out.append("<h3>Provenance</h3>" + _facts(md.provenance_facts(rep.provenance)))
    if rep.report_seconds is not None and math.isfinite(rep.report_seconds):
        out.append(f"<footer>Report built in {_e(md.fmt_duration(rep.report_seconds))}."
                   "</footer>")
    return "\n".join(out)


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML page (inline CSS and SVG). Returns the
    text; never reads anything but ``report`` and never emits a URL that is fetched."""
    title = "attnprof cost report"
    if len(report.models) == 1:
        title += f": {report.models[0].model}"
    body = ["<h1>attnprof cost report</h1>",
            f'<p class="sub">Generated {_e(md.fmt_time(report.generated_at))} from '
            f"{_e(report.source.kind)} data · window {_e(md.window_text(report))}</p>"]
    if len(report.models) > 1:
        body.append('<nav class="toc">Models: ' + " · ".join(
            f'<a href="#{_anchor(i)}">{_e(m.model)}</a>' for i, m in enumerate(report.models))
            + ' · <a href="#appendix">appendix</a></nav>')
    if not report.models:
        body.append("<p>No models in this report.</p>")
    body += [_model(report, i, m) for i, m in enumerate(report.models)]
    body.append(_appendix(report))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_e(title)}</title>\n<style>{_CSS}</style></head>\n"
            "<body><main>\n" + "\n".join(body) + "\n</main></body></html>\n")
