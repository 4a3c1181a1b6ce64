"""The cost report's savings lines: one sentence per ranked what-if, rendered from its typed
figures (report.json carries the numbers; this is the text the demo, the terminal, report.md
and report.html print). Money goes through :func:`~attnprof.exporters.report_format.fmt_money`
(one format); a measured saving prints its interval beside what it banks, and its verdict.
Pure: no I/O.
"""

from __future__ import annotations

from attnprof.contracts.report import FleetSaving, ModelReport, WhatIf
from attnprof.exporters.report_format import fmt_money

__all__ = ["autoscaled_text", "measured_text", "saving_line", "saving_lines"]


def _gpu_hours(gh: float, money: float | None, unit: str = "month") -> str:
    return (f"{fmt_money(money)}/{unit} ({gh:,.0f} GPU-hours)" if money is not None
            else f"{gh:,.0f} GPU-hours/{unit}")


def autoscaled_text(a: FleetSaving | None, price: float | None) -> str:
    """The autoscaled figure: monthly over the fleet's mean replicas, else per replica-month
    and why the monthly one is not computable."""
    if a is None:
        return "no autoscaled figure"
    if a.monthly_gpu_hours_saved is not None:
        return f"{_gpu_hours(a.monthly_gpu_hours_saved, a.monthly_saving)} autoscaled"
    per = a.gpu_hours_saved_per_replica_month
    if per is None:
        return "autoscaled: not computable"
    money = per * price if price is not None else None
    return (f"autoscaled: not computable without the fleet's mean replicas (--mean-replicas"
            f"), {_gpu_hours(per, money, 'replica-month')}")


def measured_text(w: WhatIf) -> str:
    """``measured, confirmed: time saving +8.2% [+3.1%, +12.0%], banks 3.1%`` for a measured
    what-if; the evidence kind alone otherwise."""
    how = {"replay": "replay-validated"}.get(w.evidence, w.evidence)
    if w.verdict is not None:
        how += f", {w.verdict}"
    if w.time_saving is not None and (w.time_saving_low is not None or w.verdict is not None):
        how += f": time saving {w.time_saving:+.1%}"
        if w.time_saving_low is not None and w.time_saving_high is not None:
            how += f" [{w.time_saving_low:+.1%}, {w.time_saving_high:+.1%}]"
        else:
            how += " (no interval)"
        if w.banked_time_saving is not None:
            how += f", banks {w.banked_time_saving:.1%}"
    return how


def saving_line(w: WhatIf, titles: dict[str, str], price: float | None = None) -> str:
    """One savings line: both money figures, what the what-if frees, its evidence (with a
    measurement's verdict and interval), and the what-ifs it is an alternative to."""
    if w.monthly_gpu_hours_saved is None or w.replicas_removed is None:
        fixed = "fixed fleet: not computable (see the what-if's notes)"
    else:
        n = w.replicas_removed
        fixed = (f"{_gpu_hours(w.monthly_gpu_hours_saved, w.monthly_saving)} at a "
                 f"fixed fleet ({n} replica{'' if n == 1 else 's'} removed)")
    parts = []
    if w.kv_saving:
        parts.append(f"{w.kv_saving:.0%} KV bytes per token")
    if w.attention_flop_saving:
        parts.append(f"{w.attention_flop_saving:.0%} attention FLOPs")
    if w.extra_sequences:
        parts.append(f"+{w.extra_sequences:,.0f} concurrent sequences")
    tail = " (needs a model/kernel change)" if w.apply.needs_change else ""
    tail += "".join(f"; alternative to {titles.get(x, x)}: not additive"
                    for x in w.alternative_to)
    b = w.measured_beside
    if b is not None:
        tail += (f"; measured on another setup ({b.mismatch}): time saving "
                 f"{b.time_saving:+.1%}" + (f", KV {b.kv_saving:.0%}" if b.kv_saving else "")
                 + ", not adopted")
    return (f"{w.title}: {fixed}, {autoscaled_text(w.autoscaled, price)}; "
            f"{', '.join(parts) or 'no direct saving'} [{measured_text(w)}]{tail}")


def saving_lines(m: ModelReport) -> list[str]:
    """The lines of ``m.ranking``, in its order (ids it does not hold are skipped)."""
    by_id = {w.id: w for w in m.what_ifs}
    titles = {w.id: w.title for w in m.what_ifs}
    return [saving_line(by_id[i], titles, m.money.gpu_hour_price)
            for i in m.ranking if i in by_id]
