"""The kernel activation map as a picture: one row per attention layer, one column per shape
class, each cell coloured by the kernel that ran and whether it was fused.

Pure functions, in three steps: a profile or a live snapshot -> :class:`Grid` (typed cells,
no drawing) -> :func:`layout` (where every cell lands, in figure fractions) -> :func:`render`
(PNG or SVG bytes, through matplotlib's object API: no pyplot, no global state, so it is
safe in the ``attnprof tensorboard`` loop). :func:`markdown` gives the same grid as a table.

Reading it without the legend: fused cells are green/teal and name their kernel; fallbacks
are red/orange and print the reason code; grey cells are shape classes a layer never ran.
A run of identical cells down a column carries its label once, in the run's middle, and runs
of identical rows are bracketed on the right ("layers 0-11"); every layer keeps its own row.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from attnprof.contracts.profile import ActivationRow, ProfileReport
from attnprof.contracts.snapshot import KernelGroup, LayerProfile, Snapshot
from attnprof.facts.shape import layer_label, site_order

__all__ = [
    "DEFAULT_PALETTE",
    "Cell",
    "Column",
    "Grid",
    "Layout",
    "Palette",
    "cell_color",
    "figure_bytes",
    "grid_from_profile",
    "grid_from_rows",
    "grid_from_snapshot",
    "layout",
    "markdown",
    "render",
    "row_groups",
]

PHASE_ORDER = ("prefill", "mixed", "decode")


@dataclass(frozen=True)
class Column:
    """One shape class. ``mask``/``length_bucket`` are None for a live snapshot, whose
    aggregates are per phase only."""

    phase: str
    mask: str | None = None
    length_bucket: int | None = None
    dtype: str | None = None
    """Set only when the profile holds more than one dtype (else it is the same everywhere)."""

    @property
    def label(self) -> str:
        """Two lines: the phase, then mask and length bucket (``bool mask, L<=256``)."""
        parts = []
        if self.mask is not None:
            parts.append(f"{self.mask} mask")
        if self.length_bucket is not None:
            parts.append(f"L\u2264{self.length_bucket}")
        if self.dtype is not None:
            parts.append(self.dtype)
        return self.phase + ("\n" + ", ".join(parts) if parts else "")


@dataclass(frozen=True)
class Cell:
    """What ran for one layer and shape class."""

    kernel: str
    """Short name, written in the cell (SDPA path, or the vLLM backend)."""
    fused: bool
    reasons: tuple[str, ...] = ()
    """Reason codes for a fallback, most important first (printed in the cell)."""
    detail: str | None = None
    """Longer kernel name (a vLLM kernel variant); shown in the legend, not the cell."""
    calls: int = 0
    time_s: float = 0.0

    @property
    def key(self) -> tuple[str, bool]:
        """What the colour depends on: the kernel and fused/fallback."""
        return (self.kernel, self.fused)

    @property
    def look(self) -> tuple[str, bool, tuple[str, ...]]:
        """What the picture shows (calls and time are not drawn): cells with the same look
        are grouped."""
        return (self.kernel, self.fused, self.reasons)

    @property
    def text(self) -> str:
        """The cell's label: the kernel, and for a fallback its first reason code."""
        if self.fused:
            return f"{self.kernel} (fused)"
        why = [r for r in self.reasons if r != self.kernel]  # "eager: eager" says nothing
        if not why:
            return f"{self.kernel} (fallback)"
        return f"{self.kernel}: {why[0]}" + ("+" if len(why) > 1 else "")


@dataclass(frozen=True)
class Grid:
    """Layers x shape classes; ``cells[i][j]`` is layer ``layers[i]`` in ``columns[j]``
    (None: that layer never ran that shape class)."""

    title: str
    layers: tuple[int, ...]
    columns: tuple[Column, ...]
    cells: tuple[tuple[Cell | None, ...], ...]
    reasons: Mapping[str, str] = field(default_factory=dict)
    """Reason code -> its message (the first one seen), for the legend."""
    details: Mapping[str, str] = field(default_factory=dict)
    """Kernel -> longer name (vLLM kernel variants), for the legend."""
    labels: tuple[str, ...] = ()
    """Row names when layer indices alone are ambiguous (encoder-decoder models:
    ``encoder.L0``, ``decoder.L0``, ``decoder.L0.cross``); empty: ``L<index>``."""

    def row_label(self, i: int) -> str:
        """Row ``i``'s name in the picture and the table."""
        return self.labels[i] if self.labels else f"L{self.layers[i]}"

    def kinds(self) -> list[tuple[str, bool]]:
        """Distinct (kernel, fused) pairs, fused first, then by name."""
        seen = {c.key for row in self.cells for c in row if c is not None}
        return sorted(seen, key=lambda k: (not k[1], k[0]))


@dataclass(frozen=True)
class Palette:
    """Colours: fused kernels take the ``fused`` ramp (greens), fallbacks the ``fallback``
    ramp (reds/oranges), in :meth:`Grid.kinds` order unless ``fixed`` names them."""

    fused: tuple[str, ...] = ("#3a9e4f", "#16857a", "#7cb342", "#2e6b30", "#4db6ac")
    fallback: tuple[str, ...] = ("#d73027", "#f28e2b", "#c2185b", "#e6b030", "#8c4a2f")
    fixed: Mapping[tuple[str, bool], str] = field(default_factory=lambda: {
        ("math", False): "#d73027", ("eager", False): "#f28e2b"})
    missing: str = "#e4e4e4"


DEFAULT_PALETTE = Palette()


def cell_color(grid: Grid, palette: Palette = DEFAULT_PALETTE) -> dict[tuple[str, bool], str]:
    """(kernel, fused) -> hex colour for every kind in ``grid``: fixed names first, the
    others take the next unused colour of their ramp (cycling when a ramp runs out)."""
    out: dict[tuple[str, bool], str] = {}
    used = set()
    for k in grid.kinds():
        if k in palette.fixed:
            out[k] = palette.fixed[k]
            used.add(palette.fixed[k])
    for k in grid.kinds():
        if k in out:
            continue
        ramp = palette.fused if k[1] else palette.fallback
        free = [c for c in ramp if c not in used] or list(ramp)
        out[k] = free[0] if free else ("#3a9e4f" if k[1] else "#d73027")
        used.add(out[k])
    return out


# ---------------------------------------------------------------- grids from the contracts


def _column_key(r: ActivationRow, with_dtype: bool) -> Column:
    return Column(r.phase, r.mask, r.length_bucket, r.dtype if with_dtype else None)


def _column_order(c: Column) -> tuple[Any, ...]:
    ph = PHASE_ORDER.index(c.phase) if c.phase in PHASE_ORDER else len(PHASE_ORDER)
    return (ph, c.phase, c.mask or "", c.length_bucket or 0, c.dtype or "")


def grid_from_rows(rows: Sequence[ActivationRow], title: str,
                   num_layers: int | None = None) -> Grid:
    """The grid of a profile's ``activation_map`` rows. Every layer 0..num_layers-1 gets a row
    (a layer without calls shows grey). Where two rows fall in one cell (two attention
    implementations in one layer and class), the one with more calls is shown."""
    with_dtype = len({r.dtype for r in rows}) > 1
    columns = sorted({_column_key(r, with_dtype) for r in rows}, key=_column_order)
    # One row per attention site; encoder-decoder models (or any cross-attention) have
    # several sites per index, named apart (facts.shape.layer_label).
    labelled = any(r.stack is not None or r.kind != "self" for r in rows)
    if labelled:
        sites = sorted({(r.stack, r.layer_idx, r.kind) for r in rows},
                       key=lambda s: site_order(*s))
    else:
        n = max([num_layers or 0, *(r.layer_idx + 1 for r in rows)])
        sites = [(None, i, "self") for i in range(n)]
    row_of = {s: i for i, s in enumerate(sites)}
    col_index = {c: j for j, c in enumerate(columns)}
    best: dict[tuple[int, int], ActivationRow] = {}
    messages: dict[str, str] = {}
    for r in rows:
        at = (row_of[(r.stack, r.layer_idx, r.kind)] if labelled else r.layer_idx,
              col_index[_column_key(r, with_dtype)])
        if at not in best or r.calls > best[at].calls:
            best[at] = r
        for reason in r.reasons:
            messages.setdefault(reason.code, reason.message)
    cells = tuple(
        tuple(_row_cell(best[(i, j)]) if (i, j) in best else None for j in range(len(columns)))
        for i in range(len(sites)))
    return Grid(title=title, layers=tuple(s[1] for s in sites), columns=tuple(columns),
                cells=cells, reasons=messages,
                labels=tuple(layer_label(s[1], s[0], s[2]) for s in sites) if labelled else ())


def _row_cell(r: ActivationRow) -> Cell:
    codes = tuple(dict.fromkeys(x.code for x in r.reasons))
    return Cell(kernel=r.kernel, fused=r.fused, reasons=codes, calls=r.calls, time_s=r.time_s)


def grid_from_profile(report: ProfileReport) -> Grid:
    """The grid of an ``attnprof profile`` result (its ``activation_map``)."""
    m = report.model
    mode = ""
    if report.run.train:
        p = report.run.attention_dropout
        mode = ", training mode" + ("" if p is None else f", attention dropout {p:g}")
    title = (f"{m.name}: attention kernels by layer and shape class "
             f"(attn_implementation={m.attn_implementation}, {m.dtype}{mode})")
    return grid_from_rows(report.activation_map, title, m.num_layers)


def _live_reasons(layer: LayerProfile, group: KernelGroup | None) -> tuple[str, ...]:
    """Why a live layer is not fused: vLLM's rejections of the other backends, then a note."""
    if layer.fused or group is None:
        return ()
    out: list[str] = []
    for backend, why in (group.rejected or {}).items():
        items = why if isinstance(why, list) else [why]
        out.extend(f"{backend}: {w}" for w in items if w)
    if group.note:
        out.append(group.note)
    return tuple(dict.fromkeys(out))


def grid_from_snapshot(snap: Snapshot) -> Grid:
    """The grid of a live snapshot: per layer its vLLM backend (``workers[].layers``, with the
    kernel variant as detail); one column per phase that some layer ran on sampled steps (one
    column "any phase" before the first sampled call). A layer held by several workers
    (tensor-parallel ranks) is read from the first, as the Prometheus exporter does."""
    layers: dict[int, tuple[LayerProfile, KernelGroup | None]] = {}
    for w in snap.workers:
        groups = {i: g for g in w.kernel_map for i in g.layers}
        for lay in w.layers:
            layers.setdefault(lay.index, (lay, groups.get(lay.index)))
    phases = {p for lay, _ in layers.values() for p, st in lay.phases.items() if st.calls > 0}
    columns = tuple(Column(p) for p in sorted(phases, key=lambda p: _column_order(Column(p))))
    if not columns:
        columns = (Column("any phase"),)
    messages: dict[str, str] = {}
    details: dict[str, str] = {}
    cells = []
    for i in sorted(layers):
        lay, group = layers[i]
        reasons = _live_reasons(lay, group)
        for r in reasons:
            messages.setdefault(r, r)
        if lay.kernel and lay.kernel != lay.backend:
            details.setdefault(lay.backend, lay.kernel)
        row: list[Cell | None] = []
        for col in columns:
            st = lay.phases.get(col.phase)
            if col.phase != "any phase" and (st is None or st.calls <= 0):
                row.append(None)
                continue
            row.append(Cell(kernel=lay.backend, fused=lay.fused, reasons=reasons,
                            detail=lay.kernel, calls=st.calls if st else 0,
                            time_s=st.time_s if st else 0.0))
        cells.append(tuple(row))
    title = f"{snap.model}: attention backend by layer and phase (live, sampled steps)"
    return Grid(title=title, layers=tuple(sorted(layers)), columns=columns,
                cells=tuple(cells), reasons=messages, details=details)


# ---------------------------------------------------------------- grouping and text


def _look(c: Cell | None) -> tuple[str, bool, tuple[str, ...]] | None:
    return None if c is None else c.look


def row_groups(grid: Grid) -> list[tuple[int, int]]:
    """Runs of consecutive rows that look the same, as (first, last) row indices."""
    out: list[tuple[int, int]] = []
    for i, row in enumerate(grid.cells):
        if out and [_look(c) for c in grid.cells[out[-1][0]]] == [_look(c) for c in row]:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _column_runs(grid: Grid, j: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in range(len(grid.layers)):
        if out and _look(grid.cells[out[-1][0]][j]) == _look(grid.cells[i][j]):
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _span(grid: Grid, a: int, b: int) -> str:
    if grid.labels:
        na, nb = grid.labels[a], grid.labels[b]
        return f"layer {na}" if a == b else f"layers {na} to {nb}"
    la, lb = grid.layers[a], grid.layers[b]
    return f"layer {la}" if a == b else f"layers {la}-{lb}"


def markdown(grid: Grid) -> str:
    """The grid as a Markdown table (TensorBoard's text tab), identical rows grouped."""
    head = ["layers", *(c.label.replace("\n", " ") for c in grid.columns)]
    lines = [f"**{grid.title}**", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for a, b in row_groups(grid):
        cells = []
        for c in grid.cells[a]:
            if c is None:
                cells.append("-")
            elif c.fused:
                cells.append(f"{c.kernel} (fused)")
            else:
                cells.append(f"**{c.kernel}** (fallback: {', '.join(c.reasons) or '?'})")
        lines.append(f"| {_span(grid, a, b).split(' ', 1)[1]} | " + " | ".join(cells) + " |")
    if grid.reasons:
        lines += ["", "Reasons: " + "; ".join(f"`{k}`: {v}" if v and v != k else f"`{k}`"
                                              for k, v in grid.reasons.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- geometry and drawing

# Sizes in inches; a cell is wide enough for "flash_cpu: dropout" at the cell font size.
CELL_W = 1.35
CELL_H = 0.2
LEFT = 0.55
RIGHT = 1.2
TITLE_H = 0.45
HEADER_H = 0.45
FONT = 7.0


@dataclass(frozen=True)
class Layout:
    """Where things land: figure size in inches and the cell area in figure fractions
    (left, bottom, width, height)."""

    width_in: float
    height_in: float
    axes: tuple[float, float, float, float]
    nrows: int
    ncols: int

    def cell_box(self, i: int, j: int) -> tuple[float, float, float, float]:
        """Row ``i``, column ``j`` as (x0, y0, x1, y1) in figure fractions, y up."""
        left, bottom, w, h = self.axes
        x0 = left + w * j / self.ncols
        y1 = bottom + h * (1 - i / self.nrows)
        return (x0, y1 - h / self.nrows, x0 + w / self.ncols, y1)


def _legend_lines(grid: Grid) -> int:
    return len(grid.kinds()) + 1 + len(grid.reasons) + len(grid.details) + 1


def layout(grid: Grid) -> Layout:
    """The figure's geometry for ``grid`` (pure: no matplotlib)."""
    nrows, ncols = max(1, len(grid.layers)), max(1, len(grid.columns))
    legend_h = 0.35 + 0.17 * _legend_lines(grid)
    # Room for the longest row name (~0.6 em per character at the tick font size).
    left = max(LEFT, 0.15 + max((len(x) for x in grid.labels), default=0) * 0.6
               * (FONT - 0.5) / 72)
    # And for the bracket names right of the grid ("layers encoder.L0 to encoder.L1").
    right = max(RIGHT, 0.3 + max((len(_span(grid, a, b)) for a, b in row_groups(grid)),
                                 default=0) * 0.6 * FONT / 72)
    width = left + ncols * CELL_W + right
    # Room for the title (~0.55 em per character) and the legend's reason messages.
    width = max(width, 6.0, 0.4 + len(grid.title) * 0.55 * (FONT + 2.5) / 72)
    grid_h = nrows * CELL_H
    height = TITLE_H + HEADER_H + grid_h + legend_h
    ax_w = ncols * CELL_W
    return Layout(width_in=width, height_in=height,
                  axes=(left / width, legend_h / height, ax_w / width, grid_h / height),
                  nrows=nrows, ncols=ncols)


def _text_color(hex_color: str) -> str:
    r, g, b = (int(hex_color[k:k + 2], 16) / 255 for k in (1, 3, 5))
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "black"


def _fit(text: str, width_in: float, size: float = FONT) -> str:
    # ~0.6 em per character at this size; cut with an ellipsis rather than spill over.
    room = max(3, int(width_in * 72 / (0.6 * size)))
    return text if len(text) <= room else text[:room - 1] + "\u2026"


def render(grid: Grid, fmt: Literal["png", "svg"] = "png",
           palette: Palette = DEFAULT_PALETTE, dpi: int = 110) -> bytes:
    """The picture as PNG or SVG bytes. Each cell is a rectangle whose SVG id is
    ``cell-<row>-<column>`` (row and column indices into the grid). Needs matplotlib;
    never touches pyplot's global figure state."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    lay = layout(grid)
    colors = cell_color(grid, palette)
    fig = Figure(figsize=(lay.width_in, lay.height_in), dpi=dpi)
    ax = fig.add_axes(lay.axes)
    nrows, ncols = lay.nrows, lay.ncols
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)  # layer 0 at the top, as in the model's stack
    ax.set_xticks([j + 0.5 for j in range(ncols)],
                  [c.label for c in grid.columns] or [""], fontsize=FONT + 0.5)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(len(grid.layers))],
                  [grid.row_label(i) for i in range(len(grid.layers))], fontsize=FONT - 0.5)
    ax.tick_params(length=0, pad=2)
    for s in ax.spines.values():
        s.set_visible(False)
    for i, row in enumerate(grid.cells):
        for j, c in enumerate(row):
            face = palette.missing if c is None else colors[c.key]
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=face, edgecolor="white",
                                   linewidth=0.6, gid=f"cell-{i}-{j}"))
    # One label per vertical run of identical cells, in the run's middle; a dark rule where
    # the run changes, so a change of kernel between layers is seen at a glance.
    for j in range(len(grid.columns)):
        for a, b in _column_runs(grid, j):
            c = grid.cells[a][j]
            if c is None:
                text, color = "not run", "#777777"
            else:
                text, color = c.text, _text_color(colors[c.key])
            # The middle row's centre (a run's own centre may sit on a rule between rows).
            ax.text(j + 0.5, (a + b) // 2 + 0.5, _fit(text, CELL_W), ha="center", va="center",
                    fontsize=FONT, color=color,
                    fontweight="normal" if c is None or c.fused else "bold")
            if a > 0:
                ax.plot([j, j + 1], [a, a], color="#333333", linewidth=1.0)
    # Brackets for runs of identical rows (identical layers), right of the grid.
    for a, b in row_groups(grid):
        if b > a:
            x = ncols + 0.06
            ax.plot([x, x + 0.05, x + 0.05, x], [a + 0.1, a + 0.1, b + 0.9, b + 0.9],
                    color="#555555", linewidth=0.8, clip_on=False)
        ax.text(ncols + 0.16, (a + b) // 2 + 0.5, _span(grid, a, b), ha="left", va="center",
                fontsize=FONT, clip_on=False)
    fig.suptitle(grid.title, fontsize=FONT + 2.5, y=1 - 0.08 / lay.height_in)
    fig.text(0.5, 1 - 0.3 / lay.height_in, "green: fused kernel   red/orange: fallback, with its "
             "reason code   grey: not run", ha="center", va="center", fontsize=FONT + 0.5,
             color="#444444")
    handles = [Patch(facecolor=colors[k], edgecolor="none",
                     label=f"{k[0]} ({'fused' if k[1] else 'fallback'})"
                           + (f" = {grid.details[k[0]]}" if k[0] in grid.details else ""))
               for k in grid.kinds()]
    if any(c is None for row in grid.cells for c in row):
        handles.append(Patch(facecolor=palette.missing, edgecolor="none",
                             label="not run by this layer"))
    legend_top = lay.axes[1] - 0.1 / lay.height_in
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.02, legend_top),
               fontsize=FONT + 0.5, frameon=False, title="colour = kernel, fused or fallback",
               title_fontsize=FONT + 0.5, alignment="left")
    if grid.reasons:
        # Under the legend's entries (a title line plus one line per entry), full width.
        top = legend_top - (len(handles) + 1.7) * FONT * 1.75 / 72 / lay.height_in
        lines = [f"{code}: {msg}" if msg and msg != code else code
                 for code, msg in grid.reasons.items()]
        fig.text(0.02, top, "\n".join(["fallback reasons:"] + [
            "  " + _fit(x, lay.width_in - 0.4, FONT) for x in lines]),
                 ha="left", va="top", fontsize=FONT, linespacing=1.35)
    return figure_bytes(fig, fmt)


def figure_bytes(fig: Any, fmt: Literal["png", "svg"]) -> bytes:
    """A matplotlib Figure as PNG or SVG bytes, without pyplot's global state. The SVG keeps
    text as text (searchable, smaller) and has no date or random ids: the same figure gives
    the same bytes (the activation map, roofline and scaling pictures all use this)."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buf = io.BytesIO()
    if fmt == "png":
        FigureCanvasAgg(fig).print_png(buf)
    else:
        with rc_context({"svg.fonttype": "none", "svg.hashsalt": "attnprof"}):
            FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None})
    return buf.getvalue()

