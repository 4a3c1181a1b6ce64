"""Renderers of an ``attnprof diff`` report: Markdown for a pull-request comment and a plain
terminal view. Both lead with the verdict and the regressions, then what else changed,
then what changed in versions, hardware, model and source (the two revisions; the diff runs
no ``git``). Every string that comes from an input file (model names, command lines, labels,
notes, file names) is printed through :func:`inert`: a control character in a file cannot
drive the terminal (ANSI escapes, ``\\r``) or forge lines.
"""

from __future__ import annotations

from attnprof._text import inert
from attnprof.contracts.diff import DiffReport, Finding
from attnprof.facts.layers import format_layers, format_sites

__all__ = ["render_markdown", "render_text"]

_MAX_INFO = 12


def _side(rep: DiffReport, which: str, markdown: bool) -> str:
    """One input's line: file, model, revision, time, window; for Markdown escaped as
    Markdown, for the terminal only made inert (a model ``org/m@v2`` stays as it is)."""
    s = rep.base if which == "base" else rep.new
    esc = _md_escape if markdown else inert
    rev = (f" @ {esc(s.git_revision[:10])}{'+dirty' if s.git_dirty else ''}"
           if s.git_revision else "")
    when = f", {esc(s.time_iso)}" if s.time_iso else ""
    win = f", {s.window_s:g} s window" if s.window_s else ""
    return f"{_code(s.file) if markdown else inert(s.file)} ({esc(s.model)}{rev}{when}{win})"


def _verdict(rep: DiffReport) -> str:
    reg = _collapse([f for f in rep.findings if f.severity == "regression"])
    if reg:
        return f"REGRESSION: {len(reg)} finding{'s' if len(reg) != 1 else ''} over threshold"
    return "no regression"


def _collapse(items: list[Finding]) -> list[Finding]:
    """Per-layer time findings of one verdict, more than three of them, as one line naming
    the layers and the range of changes (the JSON keeps each)."""
    per = [f for f in items if f.kind == "layer_time"]
    if len(per) <= 3:
        return items
    lo = min(f.change or 0.0 for f in per)
    hi = max(f.change or 0.0 for f in per)
    layers = sorted(x for f in per for x in f.layers)
    # Site labels when the findings have them (encoder.L0 and decoder.L0 are not one layer).
    sites = [x for f in per for x in f.sites] if all(f.sites for f in per) else []
    one = Finding(kind="layer_time", severity=per[0].severity, threshold=per[0].threshold,
                  layers=layers, sites=sites,
                  title=(f"{format_sites(sites) if sites else format_layers(layers)}: "
                         f"attention time {lo:+.0%} to {hi:+.0%} per "
                         f"layer (each with p below 0.01; see --json for intervals)"))
    first = items.index(per[0])
    rest = [f for f in items if f.kind != "layer_time"]
    return [*rest[:first], one, *rest[first:]]


def _interesting(rep: DiffReport) -> tuple[list[Finding], list[Finding], list[Finding]]:
    reg = _collapse([f for f in rep.findings if f.severity == "regression"])
    imp = _collapse([f for f in rep.findings if f.severity == "improvement"])
    # Per-layer times that are not findings would be 30 lines of noise: only the total.
    info = [f for f in rep.findings if f.severity == "info" and f.kind != "layer_time"]
    return reg, imp, info


_MD_SYNTAX = str.maketrans({"|": "\\|", "<": "&lt;", "@": "&#64;"})


def _md_escape(text: str) -> str:
    """Text from the input files, made inert in a PR comment: no table breaks, no HTML, no
    links or images (``](`` needs its parenthesis), no mentions (``@team``), no autolinks."""
    # "<" opens HTML; ">" alone cannot (and "->" must stay readable in the raw text).
    out = inert(text).translate(_MD_SYNTAX)
    return (out.replace("](", "]&#40;").replace("://", "&#58;//")
            .replace("www.", "www&#46;"))


def _code(value: object) -> str:
    """A value as an inline code span (a backtick inside would end it early)."""
    return "`" + inert(value).replace("`", "'").replace("|", "\\|") + "`"


def _thresholds(rep: DiffReport) -> str:
    parts = []
    for k, v in rep.thresholds.items():
        if v is None:
            parts.append(f"{k}=off")
        elif k == "kernel":
            parts.append("kernel=on")
        elif k == "context-shift":
            parts.append(f"{k}={v:g}")
        else:
            parts.append(f"{k}={v * 100:g}%")
    return ",".join(parts)


def render_markdown(rep: DiffReport) -> str:
    """A pull-request comment: verdict, regressions (with layers and reasons), improvements,
    other changes, what changed in provenance, and the thresholds used."""
    reg, imp, info = _interesting(rep)
    lines = [f"### attnprof diff: {_verdict(rep)}", "",
             f"- base: {_side(rep, 'base', True)}", f"- new: {_side(rep, 'new', True)}", ""]
    if reg:
        lines += ["#### Regressions", "", "| check | finding |", "|---|---|"]
        lines += [f"| {f.threshold or f.kind} | {_md_escape(f.title)} |" for f in reg]
        lines.append("")
    if imp:
        lines += ["#### Improvements", ""]
        lines += [f"- {_md_escape(f.title)}" for f in imp]
        lines.append("")
    if info:
        lines += ["<details><summary>Other comparisons (within thresholds)</summary>", ""]
        lines += [f"- {_md_escape(f.title)}" for f in info[:_MAX_INFO]]
        if len(info) > _MAX_INFO:
            lines.append(f"- ... and {len(info) - _MAX_INFO} more (see --json)")
        lines += ["", "</details>", ""]
    if rep.changes:
        lines += ["#### What changed", ""]
        for c in rep.changes:
            lines.append(f"- **{_md_escape(c.field)}**: {_code(c.base)} -> {_code(c.new)}")
        lines.append("")
    for note in rep.notes:
        lines.append(f"> {_md_escape(note)}")
    if rep.notes:
        lines.append("")
    lines.append(f"<sub>attnprof diff --fail-on {_thresholds(rep)}</sub>")
    return "\n".join(lines) + "\n"


def render_text(rep: DiffReport) -> str:
    """The terminal view: the same content as the Markdown, as plain lines."""
    reg, imp, info = _interesting(rep)
    out = [f"attnprof diff: {_verdict(rep)}",
           f"  base: {_side(rep, 'base', False)}",
           f"  new:  {_side(rep, 'new', False)}", ""]
    for title, items in (("Regressions", reg), ("Improvements", imp), ("Other", info)):
        if not items:
            continue
        out.append(f"{title}:")
        mark = {"Regressions": "  ✗ ", "Improvements": "  ✓ ", "Other": "  · "}[title]
        out += [mark + inert(f.title) for f in items[:_MAX_INFO if title == "Other" else None]]
        out.append("")
    if rep.changes:
        out.append("What changed:")
        out += [f"  {inert(c.field)}: {inert(c.base)} -> {inert(c.new)}" for c in rep.changes]
        out.append("")
    out += [f"note: {inert(n)}" for n in rep.notes]
    return "\n".join(out).rstrip() + "\n"
