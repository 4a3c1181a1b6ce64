"""Predicted beside measured: the table a validated what-if gets in the cost report (Markdown
and HTML lay out the same rows), its status sentence, and the lines ``attnprof whatif``
prints (its badge is :func:`attnprof.exporters.report_format.badges`). Every verdict is one
of three: confirmed (the 95% interval inside the prediction's band), OFF (wholly outside
it), inconclusive (anything else)."""

from __future__ import annotations

import math

from attnprof.contracts.report import WhatIf
from attnprof.contracts.whatif import Check, CheckVerdict, Validation, VariantResult
from attnprof.exporters.report_format import MISSING, Table

__all__ = ["LABELS", "VERDICT_WORDS", "check_cells", "checks_table", "mde_sentence", "signed_pct",
           "status_sentence", "validation_table", "variant_lines"]

LABELS = {"tokens_per_s": "Throughput (tokens/s)", "itl_p99": "ITL p99",
          "kv_capacity": "KV capacity (tokens)", "refused_share": "Requests refused",
          "greedy_agreement": "Greedy agreement", "ttft_p50": "TTFT p50",
          "ttft_p99": "TTFT p99", "itl_p50": "ITL p50"}
VERDICT_WORDS: dict[CheckVerdict, str] = {
    "confirmed": "confirmed", "off": "OFF: outside its band", "inconclusive": "inconclusive"}
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


def _band(b: float) -> str:
    pts = b * 100
    return f"{pts:.1f}".removesuffix(".0") + " pts"


def check_cells(c: Check) -> list[str]:
    """Metric, predicted (with its band), measured (with its 95% interval, or why there is
    none), verdict (with why it is inconclusive)."""
    change = c.metric not in _SHARES
    pred = ("not predicted" if c.predicted is None
            else f"{signed_pct(c.predicted, change)} ± {_band(c.band)}")
    if c.measured is None:
        meas = c.note or "not measured"
    elif c.low is not None and c.high is not None and c.low != c.high:
        meas = (f"{signed_pct(c.measured, change)} [{signed_pct(c.low, change)}, "
                f"{signed_pct(c.high, change)}]")
    else:
        meas = signed_pct(c.measured, change)
    # Agreement's note describes its data (prompts diverged, effective n): beside the value.
    described = c.metric == "greedy_agreement" and c.measured is not None and bool(c.note)
    if described:
        meas += f" ({c.note})"
    if c.predicted is None or c.measured is None:
        verdict = MISSING
    else:
        verdict = VERDICT_WORDS[c.verdict]
        if c.note and not described:
            verdict += f" ({c.note})"
    return [LABELS.get(c.metric, c.metric), pred, meas, verdict]


def mde_sentence(v: Validation) -> str:
    """"this run could detect throughput changes of +/-X% or larger", or nothing."""
    if v.mde is None or not math.isfinite(v.mde):
        return ""
    return (f"this run could detect throughput changes of ±{signed_pct(v.mde, False)} or "
            "larger (alpha 0.05, power 0.8)")


def status_sentence(v: Validation) -> str:
    """How the what-if was measured and its verdict, in one sentence."""
    flags = " ".join(v.flags) or "no flags"
    if v.status == "could_not_start":
        return f"{flags}: could not start: {v.reason or 'no reason logged'}"
    if v.status == "failed":
        return f"{flags}: the measurement failed: {v.reason or 'no reason logged'}"
    judged = [c for c in v.checks if c.predicted is not None]
    off = sum(c.verdict == "off" for c in judged)
    open_ = sum(c.verdict == "inconclusive" for c in judged)
    what = ("the A/A arm (a second baseline instance, every change 0)" if v.control
            else flags)
    head = f"{what}: measured on real vLLM servers ({v.rounds} paired rounds, {v.source}); "
    if v.verdict == "off":
        body = (f"OFF: {off} prediction(s) with the whole 95% interval outside the band "
                "the prediction has proven: the model, not the tolerance, needs fixing"
                if not v.control else
                f"OFF: {off} change(s) of a no-op measured away from 0: the noise floor "
                "is understated and no change this run measured can be trusted")
    elif v.verdict == "confirmed":
        body = ("confirmed: every money figure's 95% interval lies inside its "
                "prediction's band" if not v.control else
                "confirmed: every interval holds 0 and fits inside the band")
    else:
        body = (f"inconclusive: {open_} check(s) neither inside nor outside their band "
                "(one round, too few requests, no A/A arm, or an interval wider than the "
                "band): nothing banked as confirmed")
    mde = mde_sentence(v)
    return head + body + (f"; {mde}" if mde else "")


def checks_table(v: Validation | None) -> Table:
    """Predicted vs measured rows of a validation (none unless it was measured)."""
    head = ["Metric", "Predicted", "Measured (95% interval)", "Verdict"]
    if v is None or v.status != "measured":
        return head, []
    return head, [check_cells(c) for c in v.checks]


def validation_table(w: WhatIf) -> Table:
    """Predicted vs measured rows of a validated what-if (no rows without a validation)."""
    return checks_table(w.validation)


def variant_lines(res: VariantResult, v: Validation | None) -> list[str]:
    """A variant's lines for the terminal: status and verdict, then each check (or, for a
    variant no what-if predicts, what it measured)."""
    flags = " ".join(res.flags) or "no flags"
    if res.status != "measured":
        why = "could not start" if res.status == "could_not_start" else "failed"
        return [f"  {res.what_if} ({flags}): {why}: {res.reason or 'no reason logged'}"]
    head = f"  {res.what_if} ({flags}): measured in {res.seconds:.0f} s"
    if v is not None:
        head += f": {v.verdict.upper() if v.verdict == 'off' else v.verdict}"
    out = [head]
    if v is not None:
        for c in v.checks:
            metric, pred, meas, verdict = check_cells(c)
            out.append(f"    {metric:<22} predicted {pred:<18} measured {meas}"
                       + (f"  {verdict}" if verdict != MISSING else ""))
        mde = mde_sentence(v)
        if mde:
            out.append(f"    {mde[0].upper()}{mde[1:]}")
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
        div = ""
        if a.diverged_at:
            n = sum(d is not None for d in a.diverged_at)
            div = f"; {n} of {len(a.diverged_at)} prompts diverged within " \
                  f"{a.compared_tokens} tokens"
        out.append(f"    greedy agreement {a.greedy_agreement:.1%} over {a.positions} "
                   f"positions of {a.samples} held-out prompts{kl}{div}")
    if res.variant is not None and res.variant.preemptions is not None:
        bp = res.baseline.preemptions if res.baseline is not None else None
        out.append(f"    preemptions: {res.variant.preemptions:.0f} (baseline "
                   + (f"{bp:.0f})" if bp is not None else f"{MISSING})"))
    return out
