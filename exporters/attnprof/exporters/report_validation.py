"""Predicted beside measured: the table a validated what-if gets in the cost report (Markdown
and HTML lay out the same rows) and the lines ``attnprof whatif`` prints."""

from __future__ import annotations

import math

from attnprof.contracts.report import WhatIf
from attnprof.contracts.whatif import Check, Validation, VariantResult
from attnprof.exporters.report_format import MISSING, Table

__all__ = ["LABELS", "check_cells", "signed_pct", "status_sentence", "validation_table",
           "variant_lines"]

LABELS = {"tokens_per_s": "Throughput (tokens/s)", "itl_p99": "ITL p99",
          "kv_capacity": "KV capacity (tokens)", "refused_share": "Requests refused",
          "greedy_agreement": "Greedy agreement", "ttft_p50": "TTFT p50",
          "ttft_p99": "TTFT p99", "itl_p50": "ITL p50"}
_SHARES = ("refused_share", "greedy_agreement")


def signed_pct(x: float | None, sign: bool = True) -> str:
    """``0.123`` -> ``+12%``, ``-0.047`` -> ``-4.7%`` (``sign``: a change, else a share)."""
    if x is None or not math.isfinite(x):
        return MISSING
    p = x * 100
    body = f"{abs(p):.1f}".removesuffix(".0") if abs(p) < 10 else f"{abs(p):.0f}"
    if not sign:
        return f"{body}%" if p >= 0 else f"-{body}%"
    return ("+" if p >= 0 else "-") + body + "%"


def check_cells(c: Check) -> list[str]:
    """Metric, predicted (with its band), measured (with its 95% interval), verdict."""
    change = c.metric not in _SHARES
    if c.predicted is None:
        pred = "not predicted"
    else:
        pred = f"{signed_pct(c.predicted, change)} ± {c.band * 100:.0f} pts"
    if c.measured is None:
        meas = "not measured"
    elif c.low is not None and c.high is not None and c.low != c.high:
        meas = (f"{signed_pct(c.measured, change)} [{signed_pct(c.low, change)}, "
                f"{signed_pct(c.high, change)}]")
    else:
        meas = signed_pct(c.measured, change)
    if c.predicted is None or c.measured is None:
        verdict = MISSING
    else:
        verdict = "OFF: outside the stated confidence" if c.off else "within"
    return [LABELS.get(c.metric, c.metric), pred, meas, verdict]


def status_sentence(v: Validation) -> str:
    """How the what-if was measured, in one sentence."""
    flags = " ".join(v.flags)
    if v.status == "could_not_start":
        return f"{flags}: could not start: {v.reason or 'no reason logged'}"
    if v.status == "failed":
        return f"{flags}: the measurement failed: {v.reason or 'no reason logged'}"
    off = sum(c.off for c in v.checks)
    return (f"{flags}: measured on real vLLM servers ({v.rounds} paired rounds, "
            f"{v.source}); " + (f"{off} prediction(s) off by more than the stated "
                                "confidence: the model, not the tolerance, needs fixing"
                                if off else "every prediction within its stated confidence"))


def validation_table(w: WhatIf) -> Table:
    """Predicted vs measured rows of a validated what-if (no rows without a validation)."""
    head = ["Metric", "Predicted", "Measured (95% interval)", "Verdict"]
    v = w.validation
    if v is None or v.status != "measured":
        return head, []
    return head, [check_cells(c) for c in v.checks]


def variant_lines(res: VariantResult, v: Validation | None) -> list[str]:
    """A variant's lines for the terminal: status, then each check (or, for a variant no
    what-if predicts, what it measured)."""
    flags = " ".join(res.flags)
    if res.status != "measured":
        why = "could not start" if res.status == "could_not_start" else "failed"
        return [f"  {res.what_if} ({flags}): {why}: {res.reason or 'no reason logged'}"]
    out = [f"  {res.what_if} ({flags}): measured in {res.seconds:.0f} s"]
    if v is not None:
        for c in v.checks:
            metric, pred, meas, verdict = check_cells(c)
            out.append(f"    {metric:<22} predicted {pred:<16} measured {meas}"
                       + (f"  {verdict}" if verdict != MISSING else ""))
    else:
        for metric, iv in res.changes.items():
            out.append(f"    {LABELS.get(metric, metric):<22} measured "
                       f"{signed_pct(iv.mean)} [{signed_pct(iv.low)}, {signed_pct(iv.high)}]")
    if res.kv_capacity_tokens is not None:
        base = res.baseline_kv_capacity_tokens
        out.append(f"    vLLM's KV capacity: {res.kv_capacity_tokens:,} tokens (baseline "
                   + (f"{base:,})" if base is not None else f"{MISSING})"))
    a = res.agreement
    if a is not None and a.positions:
        kl = f", mean KL {a.mean_kl:.3g} (top-{a.top_k}, a lower bound)" \
            if a.mean_kl is not None else ""
        out.append(f"    greedy agreement {a.greedy_agreement:.1%} over {a.positions} "
                   f"positions of {a.samples} held-out prompts{kl}")
    if res.variant is not None and res.variant.preemptions is not None:
        bp = res.baseline.preemptions if res.baseline is not None else None
        out.append(f"    preemptions: {res.variant.preemptions:.0f} (baseline "
                   + (f"{bp:.0f})" if bp is not None else f"{MISSING})"))
    return out
