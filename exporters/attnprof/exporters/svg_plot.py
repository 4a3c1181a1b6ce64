"""Tiny inline-SVG charts for the HTML report: a bar chart (categorical x, optional vertical
markers and a colour legend) and a line chart (optional horizontal reference lines).

Output is deterministic (fixed decimals, no ids or timestamps), self-contained (no fonts,
scripts or links) and every piece of text is HTML-escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Marker", "RefLine", "bar_chart", "line_chart", "nice_ticks", "short_number"]

_FONT = "font-family=\"system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif\""
_AXIS = "#444"
_GRID = "#e3e6ea"
_BAR = "#3b6fb6"
_CHAR_W = 6.4  # average width of an 11 px glyph, for fitting tick labels


@dataclass(frozen=True)
class Marker:
    """A vertical line on a bar chart at ``x`` in bar units (bar ``i`` spans [i, i+1])."""

    x: float
    label: str
    color: str = "#c0392b"


@dataclass(frozen=True)
class RefLine:
    """A horizontal dashed line on a line chart at ``y`` (data units)."""

    y: float
    label: str
    color: str = "#c0392b"


def _f(v: float) -> str:
    return f"{v:.1f}"


def short_number(v: float) -> str:
    """``1234`` -> ``1.2K``, ``0.25`` -> ``0.25``: a compact tick label (never scientific)."""
    a = abs(v)
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if a >= div:
            s = f"{v / div:.1f}".removesuffix(".0")
            return s + suf
    if a == 0 or a >= 100:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.1f}".removesuffix(".0")
    return f"{v:.2g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` evenly spaced round tick values (1, 2, 2.5 or 5 x 10^k) covering
    [lo, hi]; the first tick is <= lo and the last >= hi."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    # The round step whose number of intervals is closest to n (ties: the larger step).
    step = min((m * mag for m in (10, 5, 2.5, 2, 1)),
               key=lambda s: abs(math.ceil((hi - lo) / s - 1e-9) - n))
    start = math.floor(lo / step + 1e-9) * step
    ticks = []
    k = 0
    while True:
        t = start + k * step
        ticks.append(round(t, 12))
        if t >= hi - 1e-9 * step:
            return ticks
        k += 1


def _frame(width: int, height: int, title: str) -> list[str]:
    return [
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" {_FONT} '
        f'style="max-width:100%;height:auto">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{width / 2:.1f}" y="20" font-size="14" font-weight="600" '
        f'text-anchor="middle" fill="#222">{escape(title)}</text>',
    ]


def _y_axis(out: list[str], ticks: Sequence[float], y_of: Callable[[float], float],
            left: float, right: float, fmt: Callable[[float], str]) -> None:
    for t in ticks:
        y = y_of(t)
        out.append(f'<line x1="{_f(left)}" y1="{_f(y)}" x2="{_f(right)}" y2="{_f(y)}" '
                   f'stroke="{_GRID}" stroke-width="1"/>')
        out.append(f'<text x="{_f(left - 6)}" y="{_f(y + 4)}" font-size="11" '
                   f'text-anchor="end" fill="{_AXIS}">{escape(fmt(t))}</text>')


def _axis_labels(out: list[str], width: int, height: int, left: float, top: float,
                 bottom: float, x_label: str, y_label: str) -> None:
    mid_x = (left + width - 20) / 2
    out.append(f'<text x="{_f(mid_x)}" y="{_f(height - 8)}" font-size="12" '
               f'text-anchor="middle" fill="{_AXIS}">{escape(x_label)}</text>')
    mid_y = (top + bottom) / 2
    out.append(f'<text x="16" y="{_f(mid_y)}" font-size="12" text-anchor="middle" '
               f'fill="{_AXIS}" transform="rotate(-90 16 {_f(mid_y)})">'
               f"{escape(y_label)}</text>")


def _legend(out: list[str], items: Sequence[tuple[str, str]], right: float) -> None:
    # Right-aligned in the title row's second line, each item a swatch and its label.
    x = right
    for label, color in reversed(items):
        w = len(label) * _CHAR_W + 22
        x -= w
        out.append(f'<rect x="{_f(x)}" y="30" width="12" height="12" fill="{escape(color)}"/>')
        out.append(f'<text x="{_f(x + 16)}" y="40" font-size="11" fill="#222">'
                   f"{escape(label)}</text>")
        x -= 8


def _place_labels(xs: Sequence[float], labels: Sequence[str],
                  right: float) -> list[tuple[int, tuple[float, float], bool]]:
    """Per marker: its label's row (0: just above the plot), the label's x extent (beside
    its line: to the right, or to the left near the right edge) and whether its line may
    run up to the label. No two labels on a row overlap, and no line crosses a label: when
    no row allows both (a label over another marker's line), the marker's line stops at
    the plot's top instead."""
    out: list[tuple[int, tuple[float, float], bool]] = []

    def overlaps(row: int, ext: tuple[float, float]) -> bool:
        return any(r == row and not (ext[1] + 6 < a or b + 6 < ext[0])
                   for r, (a, b), _ in out)

    def crossed(row: int, x: float, ext: tuple[float, float]) -> bool:
        for px, (r, (a, b), full) in zip(xs, out, strict=False):
            if full and r > row and ext[0] - 3 <= px <= ext[1] + 3:
                return True  # a higher label's line would cross this label
            if r < row and a - 3 <= x <= b + 3:
                return True  # this line would cross a lower label
        return False

    for x, label in zip(xs, labels, strict=True):
        w = len(label) * _CHAR_W
        ext = (x + 4, x + 4 + w) if x + 4 + w <= right else (x - 4 - w, x - 4)
        rows = range(len(xs) + 1)
        row = next((r for r in rows if not overlaps(r, ext) and not crossed(r, x, ext)), None)
        if row is not None:
            out.append((row, ext, True))
        else:
            out.append((next(r for r in rows if not overlaps(r, ext)), ext, False))
    return out


def bar_chart(values: Sequence[float], labels: Sequence[str], *, title: str, x_label: str,
              y_label: str, colors: Sequence[str] | None = None,
              legend: Sequence[tuple[str, str]] = (), markers: Sequence[Marker] = (),
              y_format: Callable[[float], str] = short_number, width: int = 1000,
              height: int = 320) -> str:
    """An SVG bar chart, one bar per value with its label under it (labels are thinned
    when they would collide), y from 0 with round ticks, optional vertical markers and a
    legend of (label, colour). Returns the ``<svg>`` element; never raises on empty or
    non-finite input (those bars are drawn as 0)."""
    vals = [v if math.isfinite(v) and v > 0 else 0.0 for v in values]
    left, right = 70.0, width - 20.0
    n = max(len(values), 1)
    slot = (right - left) / n
    xs = [left + min(max(m.x, 0.0), float(n)) * slot for m in markers]
    placed = _place_labels(xs, [m.label for m in markers], right)
    top = 50.0 + 15 * (max((r for r, _, _ in placed), default=-1) + 1)
    bottom = height - 52.0
    ticks = nice_ticks(0.0, max(vals, default=0.0) or 1.0)
    y_max = ticks[-1]

    def y_of(v: float) -> float:
        return bottom - (bottom - top) * v / y_max

    out = _frame(width, height, title)
    _legend(out, legend, right)
    _y_axis(out, ticks, y_of, left, right, y_format)
    longest = max((len(s) for s in labels), default=1)
    every = max(1, math.ceil((longest * _CHAR_W + 6) / slot))
    for i, v in enumerate(vals):
        x = left + i * slot
        color = colors[i] if colors and i < len(colors) else _BAR
        bar_w = max(slot * 0.8, 1.0)
        out.append(f'<rect x="{_f(x + (slot - bar_w) / 2)}" y="{_f(y_of(v))}" '
                   f'width="{_f(bar_w)}" height="{_f(bottom - y_of(v))}" '
                   f'fill="{escape(color)}"><title>{escape(labels[i] if i < len(labels) else "")}'
                   f": {escape(y_format(v))}</title></rect>")
        if i < len(labels) and i % every == 0:
            out.append(f'<text x="{_f(x + slot / 2)}" y="{_f(bottom + 15)}" font-size="11" '
                       f'text-anchor="middle" fill="{_AXIS}">{escape(labels[i])}</text>')
    out.append(f'<line x1="{_f(left)}" y1="{_f(bottom)}" x2="{_f(right)}" y2="{_f(bottom)}" '
               f'stroke="{_AXIS}" stroke-width="1"/>')
    for m, x, (row, (x0, _x1), full) in zip(markers, xs, placed, strict=True):
        ly = top - 6 - 15 * row
        out.append(f'<line x1="{_f(x)}" y1="{_f(ly + 3 if full else top)}" x2="{_f(x)}" '
                   f'y2="{_f(bottom)}" '
                   f'stroke="{escape(m.color)}" stroke-width="1.5" stroke-dasharray="5 3"/>')
        out.append(f'<text x="{_f(x0)}" y="{_f(ly)}" font-size="11" '
                   f'fill="{escape(m.color)}">{escape(m.label)}</text>')
    _axis_labels(out, width, height, left, top, bottom, x_label, y_label)
    out.append("</svg>")
    return "\n".join(out)


def line_chart(xs: Sequence[float], ys: Sequence[float], *, title: str, x_label: str,
               y_label: str, x_format: Callable[[float], str] = short_number,
               y_format: Callable[[float], str] = short_number, y_min: float | None = None,
               y_max: float | None = None, ref_lines: Sequence[RefLine] = (),
               width: int = 1000, height: int = 300) -> str:
    """An SVG line chart of (x, y) points in x order, round ticks on both axes, optional
    fixed y range and horizontal reference lines. Returns the ``<svg>`` element; points
    with a non-finite coordinate are skipped (the line joins its neighbours)."""
    pts = sorted((x, y) for x, y in zip(xs, ys, strict=False)
                 if math.isfinite(x) and math.isfinite(y))
    left, right, top, bottom = 70.0, width - 20.0, 44.0, height - 52.0
    x_lo = pts[0][0] if pts else 0.0
    x_hi = pts[-1][0] if pts else 1.0
    x_ticks = nice_ticks(x_lo, x_hi, 8)
    lo = y_min if y_min is not None else min((y for _, y in pts), default=0.0)
    hi = y_max if y_max is not None else max((y for _, y in pts), default=1.0)
    y_ticks = nice_ticks(lo, hi)
    if y_min is not None:
        y_ticks = [t for t in y_ticks if t >= y_min - 1e-12]
    if y_max is not None:
        y_ticks = [t for t in y_ticks if t <= y_max + 1e-12]
    y0, y1 = (y_min if y_min is not None else y_ticks[0],
              y_max if y_max is not None else y_ticks[-1])
    x0, x1 = x_ticks[0], x_ticks[-1]
    if y1 <= y0:
        y1 = y0 + 1.0
    if x1 <= x0:
        x1 = x0 + 1.0

    def x_of(v: float) -> float:
        return left + (right - left) * (v - x0) / (x1 - x0)

    def y_of(v: float) -> float:
        return bottom - (bottom - top) * (min(max(v, y0), y1) - y0) / (y1 - y0)

    out = _frame(width, height, title)
    _y_axis(out, y_ticks, y_of, left, right, y_format)
    for t in x_ticks:
        out.append(f'<text x="{_f(x_of(t))}" y="{_f(bottom + 15)}" font-size="11" '
                   f'text-anchor="middle" fill="{_AXIS}">{escape(x_format(t))}</text>')
    out.append(f'<line x1="{_f(left)}" y1="{_f(bottom)}" x2="{_f(right)}" y2="{_f(bottom)}" '
               f'stroke="{_AXIS}" stroke-width="1"/>')
    for r in ref_lines:
        y = y_of(r.y)
        out.append(f'<line x1="{_f(left)}" y1="{_f(y)}" x2="{_f(right)}" y2="{_f(y)}" '
                   f'stroke="{escape(r.color)}" stroke-width="1.5" stroke-dasharray="6 4"/>')
        out.append(f'<text x="{_f(right - 4)}" y="{_f(y - 5)}" font-size="11" '
                   f'text-anchor="end" fill="{escape(r.color)}">{escape(r.label)}</text>')
    if pts:
        path = " ".join(f"{'M' if i == 0 else 'L'}{_f(x_of(x))},{_f(y_of(y))}"
                        for i, (x, y) in enumerate(pts))
        out.append(f'<path d="{path}" fill="none" stroke="{_BAR}" stroke-width="2"/>')
        if len(pts) <= 60:
            for x, y in pts:
                out.append(f'<circle cx="{_f(x_of(x))}" cy="{_f(y_of(y))}" r="2.5" '
                           f'fill="{_BAR}"/>')
    _axis_labels(out, width, height, left, top, bottom, x_label, y_label)
    out.append("</svg>")
    return "\n".join(out)
