"""``report.md``: the cost report (:class:`~attnprof.contracts.report.Report`) as Markdown
(the formatting and rows it shares with report.html live in ``report_format``).
"""

from __future__ import annotations

from attnprof.contracts.report import ModelReport, Report
from attnprof.exporters.report_format import (
    Facts,
    Table,
    _ok,
    alternatives_text,
    backend_table,
    badges,
    basis_facts,
    basis_sentence,
    basis_table,
    context_table,
    evidence_text,
    fallback_table,
    fmt_count,
    fmt_duration,
    fmt_time,
    header_facts,
    input_text,
    kv_facts,
    kv_source_sentence,
    layer_table,
    money_basis_sentence,
    money_facts,
    money_table,
    no_price_sentence,
    phase_table,
    provenance_facts,
    traffic_facts,
    usage_table,
    version_rows,
    whatif_numbers,
    window_text,
)
from attnprof.exporters.report_validation import (
    checks_table,
    status_sentence,
    validation_table,
)

__all__ = ["render_markdown"]


def _esc(text: str) -> str:
    """Text from the document, inert in Markdown: no table breaks, no HTML."""
    return (str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ")
            .replace("\n", " ").replace("<", "&lt;"))


def _code(text: str) -> str:
    """An inline code span (a backtick inside would end it early)."""
    return "`" + str(text).replace("`", "'").replace("\n", " ").replace("|", "\\|") + "`"


def _table(t: Table) -> list[str]:
    head, rows = t
    if not rows:
        return []
    out = ["| " + " | ".join(_esc(h) for h in head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_esc(c) for c in r) + " |" for r in rows]
    return [*out, ""]


def _facts(f: Facts) -> list[str]:
    return [*(f"- **{_esc(k)}:** {_esc(v)}" for k, v in f), ""]


def _model_md(rep: Report, m: ModelReport) -> list[str]:
    out = [f"## {_esc(m.model)}", "", *_facts(header_facts(rep, m))]
    out += ["### Biggest savings", "", _esc(money_basis_sentence(m)), ""]
    out += [f"{i}. {_esc(s)}" for i, s in enumerate(m.savings, 1)] or \
        ["No what-if found a saving for this model."]
    out.append("")

    out += ["### Traffic", "", *_facts(traffic_facts(m))]
    if m.traffic.drift is not None:
        d = m.traffic.drift
        out += [f"Drift (first vs second half of the window): {_esc(d.shift)} "
                f"(p50 {fmt_count(d.first_p50)} → {fmt_count(d.second_p50)}, "
                f"p99 {fmt_count(d.first_p99)} → {fmt_count(d.second_p99)} tokens)", ""]
    out += _table(context_table(m))

    out += ["### Where time goes", ""]
    out += _table(phase_table(m)) or ["No sampled model time.", ""]
    out += _table(backend_table(m))
    out += _table(layer_table(m))
    if m.time.fallbacks:
        out += ["Fallbacks (layers that ran an unfused path):", "", *_table(fallback_table(m))]

    kv = m.kv
    out += ["### KV memory", "", kv_source_sentence(kv), "",
            *_facts(kv_facts(kv, m.traffic.scope))]
    if kv.verdict:
        out += [f"**Verdict:** {_esc(kv.verdict)}", ""]
        out += [*(f"- {_esc(e)}" for e in kv.verdict_evidence), ""] if kv.verdict_evidence \
            else []
    ut = usage_table(kv)
    if ut[1]:
        out += ["KV usage over time:", "", *_table(ut)]
    elif kv.usage_over_time:
        out += [f"KV usage over time: {len(kv.usage_over_time)} points (see report.html or "
                "report.json).", ""]

    out += ["### What-ifs", ""]
    if m.noise_floor is not None:
        out += [f"**Noise floor (A/A arm):** {_esc(status_sentence(m.noise_floor))}", ""]
        out += _table(checks_table(m.noise_floor)) if checks_table(m.noise_floor)[1] else []
    if not m.what_ifs:
        out += ["No what-ifs apply to this model.", ""]
    titles = {w.id: w.title for w in m.what_ifs}
    for w in m.what_ifs:
        out += [f"#### {_esc(w.title)}", "",
                " ".join(f"[{_esc(t)}]" for t, _ in badges(w)), ""]
        alt = alternatives_text(w, titles)
        if alt:
            out += [f"> {_esc(alt[0].upper() + alt[1:])}.", ""]
        if w.apply.needs_change:
            out += [f"> **Warning:** needs a change no flag gives: {_esc(w.apply.needs_change)}",
                    ""]
        if not w.apply.supported:
            out += [f"> **Not supported by the installed vLLM** (checked against "
                    f"{_esc(w.apply.checked_against)}).", ""]
        out += _facts(whatif_numbers(w))
        if w.validation is not None:
            out += [f"**Measured on real vLLM servers:** {_esc(status_sentence(w.validation))}",
                    ""]
            vt = validation_table(w)
            if vt[1]:
                out += _table(vt)
        out += [f"- **Evidence:** {_esc(evidence_text(w))}; **confidence:** "
                f"{_esc(w.confidence)}",
                f"- **Formula:** {_code(w.formula)}"]
        if w.inputs:
            out.append("- **Inputs:** " + ", ".join(
                f"{_code(k)} = {_esc(input_text(v))}" for k, v in w.inputs.items()))
        flags = " ".join(_code(f) for f in w.apply.flags) or "no flags"
        out.append(f"- **Apply:** {flags} (checked against {_esc(w.apply.checked_against)})")
        out += [f"- {_esc(n)}" for n in w.notes]
        out.append("")

    out += ["### What the window advice stands on", "", _esc(basis_sentence(m)), ""]
    out += _facts(basis_facts(m)) if basis_facts(m) else []
    out += _table(basis_table(m))

    out += ["### Money", "", *_facts(money_facts(m))]
    np = no_price_sentence(m)
    if np:
        out += [_esc(np), ""]
    if m.money.note:
        out += [_esc(m.money.note), ""]
    out += _table(money_table(m))
    if m.warnings:
        out += ["### Warnings", "", *(f"- {_esc(w)}" for w in m.warnings), ""]
    return out



def render_markdown(report: Report) -> str:
    """The whole report as GitHub-flavoured Markdown (tables, no plots). Returns the text;
    never reads anything but ``report``."""
    out = ["# attnprof cost report", "",
           f"Generated {fmt_time(report.generated_at)} from {_esc(report.source.kind)} "
           f"data; window {_esc(window_text(report))}.", ""]
    if not report.models:
        out += ["No models in this report.", ""]
    for m in report.models:
        out += _model_md(report, m)
    out += ["## Appendix", "", "### Formulas", ""]
    out += [f"- **{_esc(k)}:** {_code(v)}" for k, v in report.formulas.items()] or ["None."]
    out += ["", "### Data window", "", _esc(window_text(report)), ""]
    out += ["### Versions", "", *_table(version_rows(report))]
    if report.provenance is not None:
        out += ["### Provenance", "", *_facts(provenance_facts(report.provenance))]
    if report.report_seconds is not None and _ok(report.report_seconds):
        out += [f"Report built in {fmt_duration(report.report_seconds)}.", ""]
    return "\n".join(out).rstrip() + "\n"
