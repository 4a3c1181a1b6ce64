"""The roofline picture (``roofline.png`` / ``.svg`` from ``attnprof profile``, ``attnprof
snapshot --roofline FILE``) and its text lines (CLI, demo): attained FLOP/s against
arithmetic intensity, under the probed bandwidth roof and matmul roof, one point per phase
and a small one per layer. Through matplotlib's object API: no pyplot, no global state."""

from __future__ import annotations

from typing import Literal

from attnprof.contracts.roofline import MemoryProbe, Roofline, RooflinePoint

__all__ = ["probe_lines", "render", "summary_lines"]

_COLORS = {"prefill": "tab:blue", "decode": "tab:red", "mixed": "tab:purple"}


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for f, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= f:
            return f"{x / f:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def summary_lines(rl: Roofline) -> list[str]:
    """One line per phase: intensity, side of the ridge, and the headline utilisation
    (decode: KV bytes/s over peak bandwidth; prefill and mixed: FLOP/s over matmul peak)."""
    out = []
    for phase, p in rl.phases.items():
        head = (f"KV read {_si(p.kv_bytes_per_second, 'B/s')} = "
                f"{_pct(p.bandwidth_utilization)} of peak bandwidth" if phase == "decode" else
                f"{_si(p.achieved_flops_per_second, 'FLOP/s')} = "
                f"{_pct(p.compute_utilization)} of matmul peak")
        inten = p.intensity_flops_per_byte
        util = p.bandwidth_utilization if phase == "decode" else p.compute_utilization
        out.append(f"{phase}: {'-' if inten is None else f'{inten:.3g}'} FLOP/B "
                   f"({p.bound}-bound side, ridge {rl.ridge_flops_per_byte:.3g}), {head}"
                   + (" (above the roof: see note)" if util is not None and util > 1 else ""))
    if any(line.endswith("see note)") for line in out):
        out.append(f"note: {rl.note}")
    return out


def probe_lines(p: MemoryProbe) -> list[str]:
    """The probe's result as text (``attnprof probe``)."""
    lines = [f"{p.device} ({p.device_name or '?'}"
             + (f", {p.threads} threads" if p.threads else "") + f"), {p.seconds:.1f} s"]
    for k in p.kernels:
        unit = "FLOP/s" if k.name == "matmul" else "B/s"
        size = f"n={k.size} {k.dtype}" if k.name == "matmul" else f"{k.size / 2**20:.0f} MiB"
        lines.append(f"  {k.name:<7} {_si(k.median, unit):>14}  (runs {k.runs}, "
                     f"{_si(k.low, unit)} .. {_si(k.high, unit)}, {size})")
    lines.append(f"peak (best run) bandwidth {_si(p.bandwidth_bytes_per_second, 'B/s')} "
                 "(read stream), "
                 f"matmul {_si(p.matmul_flops_per_second, 'FLOP/s')}")
    s = p.spec
    if s is not None:
        lines.append(f"datasheet {s.part}: {_si(s.bandwidth_bytes_per_second, 'B/s')} "
                     f"(probe/spec {_pct(s.bandwidth_ratio)}), "
                     f"{_si(s.flops_per_second, 'FLOP/s')} BF16 (probe/spec "
                     f"{_pct(s.flops_ratio)})")
    if p.note:
        lines.append(p.note)
    return lines


def _points(rl: Roofline) -> list[tuple[RooflinePoint, bool]]:
    out = [(p, False) for p in rl.layers]
    out += [(p, True) for p in rl.phases.values()]
    return [(p, big) for p, big in out if p.intensity_flops_per_byte
            and p.achieved_flops_per_second]


def render(rl: Roofline, fmt: Literal["png", "svg"] = "png", title: str = "",
           dpi: int = 100) -> bytes:
    """The roofline as PNG or SVG bytes. Needs matplotlib."""
    from matplotlib.figure import Figure

    from attnprof.exporters.activation_map import figure_bytes

    bw, peak = rl.peak_bandwidth_bytes_per_second, rl.peak_flops_per_second
    pts = _points(rl)
    xs = [p.intensity_flops_per_byte or 1.0 for p, _ in pts]
    ridge = rl.ridge_flops_per_byte or 1.0
    lo = min([ridge / 100, *xs]) / 3
    hi = max([ridge * 30, *xs]) * 3
    fig = Figure(figsize=(7.5, 5.0), dpi=dpi)
    ax = fig.add_subplot(1, 1, 1)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, bw * x) for x in grid], color="black", lw=2,
            label=f"roof: {_si(bw, 'B/s')} x intensity, {_si(peak, 'FLOP/s')} matmul")
    ax.axvline(ridge, color="#888888", ls=":", lw=1, label=f"ridge {ridge:.3g} FLOP/B")
    seen: set[str] = set()
    for p, big in pts:
        c = _COLORS.get(p.phase, "tab:gray")
        label = None
        if big and p.phase not in seen:
            seen.add(p.phase)
            util = (p.bandwidth_utilization if p.phase == "decode" else p.compute_utilization)
            label = (f"{p.phase} (all layers): {_pct(util)} of "
                     f"{'bandwidth' if p.phase == 'decode' else 'matmul'} peak")
        ax.plot([p.intensity_flops_per_byte], [p.achieved_flops_per_second],
                "o" if big else ".", color=c, ms=11 if big else 5, alpha=1.0 if big else 0.45,
                markeredgecolor="black" if big else c, label=label, zorder=3 if big else 2)
    if any(not big for _, big in pts):
        ax.plot([], [], ".", color="#777777", label="one layer")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="attained FLOP/s", title=title or f"Attention roofline ({rl.device})")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    if rl.note:
        fig.text(0.01, 0.01, rl.note, fontsize=7, color="#444444", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03 if rl.note else 0, 1, 1))
    return figure_bytes(fig, fmt)
