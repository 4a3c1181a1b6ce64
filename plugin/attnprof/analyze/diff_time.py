"""Per-layer and total attention time of two diff inputs, compared statistically.

Each layer's calls are divided by the base median of their group (a sequence length or a
phase) and, when both sides timed the rest of the model, by how much slower that ran (a
busy machine slows everything, a kernel regression slows attention). A regression needs
Mann-Whitney p < :data:`ALPHA` and the bootstrap 95% interval of the ratio of medians wholly
beyond the ``time`` threshold, so noise does not trip it. Changes here when the test does.
"""

from __future__ import annotations

import statistics
import zlib
from typing import Any

from attnprof.analyze.diff_sides import Side, Site, site_key, site_label
from attnprof.analyze.twosample import ratio_test
from attnprof.contracts.diff import Finding, Severity
from attnprof.facts.layers import format_sites

__all__ = ["ALPHA", "MIN_SAMPLES", "time_findings"]

ALPHA = 0.01
"""Significance level of the per-layer time test (Mann-Whitney)."""
MIN_SAMPLES = 6
"""Fewest samples per side with which Mann-Whitney's p can go below ALPHA (n=5: 0.012)."""


def _normalised(b: Side, n: Side, layer: Site, relative: bool
                ) -> tuple[list[float], list[float]]:
    """Both sides' calls of one layer, each divided by the base median of its group (a
    sequence length or a phase), so groups of different lengths pool into one test.
    ``relative``: the new side is also divided by how much slower the rest of its model
    ran (a busy or slower machine slows everything; a kernel regression slows attention)."""
    gb, gn = b.times.get(layer, {}), n.times.get(layer, {})
    xb: list[float] = []
    xn: list[float] = []
    for g in sorted(set(gb) & set(gn)):
        sb, sn = _scale_group(b, n, g, gb[g], gn[g], relative)
        xb += sb
        xn += sn
    return xb, xn


def _scale_group(b: Side, n: Side, g: str, base: list[float], new: list[float],
                 relative: bool) -> tuple[list[float], list[float]]:
    """One group's samples divided by the base median (and the new side, ``relative``, by
    how much slower the rest of its model ran); empty when the group cannot be compared."""
    base = [x for x in base if x > 0]
    if not base or not new:
        return [], []
    k = 1.0
    if relative:
        ob, on = b.other.get(g), n.other.get(g)
        if not ob or not on:
            return [], []
        k = on / ob
    m = statistics.median(base)
    return [x / m for x in base], [x / m / k for x in new if x > 0]


def _machine_speed(b: Side, n: Side) -> float | None:
    """Median over groups of new/base non-attention time (1.0: the rest ran as fast)."""
    ks = [n.other[g] / b.other[g] for g in set(b.other) & set(n.other) if b.other[g] > 0]
    return statistics.median(ks) if ks else None


def time_findings(b: Side, n: Side, limit: float | None) -> tuple[list[Finding],
                                                                    list[str]]:
    """Per layer and in total: attention time relative to the rest of the model when both
    sides measured it (what a regression changes and a busy machine does not), else raw."""
    speed = _machine_speed(b, n)
    relative = speed is not None
    out = []
    small = 0
    for site in sorted(set(b.times) & set(n.times), key=site_key):
        xb, xn = _normalised(b, n, site, relative)
        small += min(len(xb), len(xn)) < MIN_SAMPLES
        # A plain layer keeps its index as the bootstrap seed; other sites a stable hash.
        seed = site[1] if site[0] is None and site[2] == "self" else \
            zlib.crc32(site_label(site).encode())
        t = ratio_test(xb, xn, seed=seed, resamples=1000)
        if t is None:
            continue
        raw = ratio_test(*_normalised(b, n, site, False), resamples=0) if relative else t
        out.append(_time_finding("layer_time", format_sites([site_label(site)]), [site[1]], t,
                                 limit, raw, relative, sites=[site_label(site)]))
    t = ratio_test(*_totals(b, n, relative), seed=10_000)
    if t is not None:
        raw = ratio_test(*_totals(b, n, False), resamples=0) if relative else None
        out.insert(0, _time_finding("attention_time", "attention time per forward (all "
                                    "layers)", [], t, limit, raw, relative))
    notes = []
    if speed is not None and abs(speed - 1) > 0.10:
        notes.append(f"the rest of the model ran {speed:.2f}x as long in NEW as in BASE "
                     f"(another machine, load, or a framework change): attention times are "
                     f"compared relative to it")
    if small:
        notes.append(f"{small} layer(s) have fewer than {MIN_SAMPLES} calls per side: their "
                     f"per-layer time test cannot reach p < {ALPHA:g} (profile with more "
                     f"--repeats or lengths)")
    return out, notes


def _sums(groups: dict[Site, dict[str, list[float]]], g: str) -> list[float]:
    """Per forward (profile repeat) or step (snapshot), the sum of every layer's call in
    group ``g``: the independent unit. The calls of one forward share its machine state,
    so testing pooled calls would overstate the evidence."""
    lists = [groups[site][g] for site in sorted(groups, key=site_key) if g in groups[site]]
    if not lists or len(lists) != len(groups):
        return []
    k = min(len(x) for x in lists)  # the last k calls of each layer: the same forwards
    return [sum(x[len(x) - k + i] for x in lists) for i in range(k)]


def _totals(b: Side, n: Side, relative: bool) -> tuple[list[float], list[float]]:
    """Per-forward attention totals of both sides, each group divided by its base median
    (and, ``relative``, the new side by how much slower the rest of the model ran)."""
    layers = sorted(set(b.times) & set(n.times), key=site_key)
    tb = {layer: b.times[layer] for layer in layers}
    tn = {layer: n.times[layer] for layer in layers}
    groups = set.intersection(*(set(tb[x]) & set(tn[x]) for x in layers)) if layers else set()
    xb: list[float] = []
    xn: list[float] = []
    for g in sorted(groups):
        sb, sn = _scale_group(b, n, g, _sums(tb, g), _sums(tn, g), relative)
        xb += sb
        xn += sn
    return xb, xn


def _time_finding(kind: str, what: str, layers: list[int], t: Any, limit: float | None,
                  raw: Any, relative: bool, sites: list[str] | None = None) -> Finding:
    slower = t.p_value < ALPHA and limit is not None and t.low > 1 + limit
    faster = t.p_value < ALPHA and t.high < 1 - (0.10 if limit is None else limit)
    sev: Severity = "regression" if slower else "improvement" if faster else "info"
    rel = " relative to the rest of the model" if relative else ""
    if relative and raw is not None and kind == "attention_time":
        rel += f" (raw {raw.ratio - 1:+.0%})"
    ev = {"ratio": round(t.ratio, 4), "ci_low": round(t.low, 4), "ci_high": round(t.high, 4),
          "p_value": t.p_value, "n_base": t.n_base, "n_new": t.n_new, "relative": relative,
          "test": "Mann-Whitney U; bootstrap 95% CI of the ratio of medians"}
    if raw is not None and relative:
        ev["raw_ratio"] = round(raw.ratio, 4)
    return Finding(
        kind=kind, severity=sev,
        title=(f"{what}: {t.ratio - 1:+.0%}{rel} (95% CI {t.low - 1:+.0%} to "
               f"{t.high - 1:+.0%}, p={t.p_value:.2g}, n={t.n_base}/{t.n_new})"),
        layers=layers, sites=sites or [], base=1.0, new=round(t.ratio, 4),
        change=round(t.ratio - 1, 4),
        threshold="time", evidence=ev)
