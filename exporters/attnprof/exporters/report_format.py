"""Number formatting and the facts/tables both cost-report renderings share (``report_md``
writes them as Markdown, ``report_html`` lays the same rows out as HTML): every value is
rounded for people, ``None`` (and NaN, what a null float reads back as) is shown as "—",
never as zero.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

from attnprof.contracts.provenance import Provenance
from attnprof.contracts.report import (
    BasisBucket,
    ContextDistribution,
    KvMemory,
    ModelReport,
    Money,
    Report,
    Scope,
    WhatIf,
)
from attnprof.facts.layers import ranges_text

__all__ = [
    "MISSING",
    "Table",
    "alternatives_text",
    "backend_table",
    "badges",
    "basis_facts",
    "basis_label",
    "basis_sentence",
    "basis_table",
    "context_labels",
    "context_table",
    "evidence_text",
    "fallback_table",
    "fmt_bytes",
    "fmt_count",
    "fmt_duration",
    "fmt_gpu_hours",
    "fmt_money",
    "fmt_pct",
    "fmt_time",
    "fmt_tokens",
    "header_facts",
    "input_text",
    "kv_facts",
    "kv_source_sentence",
    "layer_table",
    "layers_text",
    "money_basis_sentence",
    "money_facts",
    "money_table",
    "no_price_sentence",
    "phase_table",
    "provenance_facts",
    "short_tokens",
    "traffic_facts",
    "usage_table",
    "version_rows",
    "whatif_numbers",
    "window_text",
]

MISSING = "—"
"""What a value the source does not have is shown as."""

Table = tuple[list[str], list[list[str]]]
"""(header, rows) of plain-text cells (each renderer escapes them)."""

Facts = list[tuple[str, str]]

_USAGE_ROWS_MAX = 24
_DASH = "\u2013"  # en dash, for ranges
_TIMES = "\u00d7"


# ---------------------------------------------------------------------------------------
# Number formatting


def _ok(x: float | None) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def fmt_count(x: float | None) -> str:
    """``182400`` -> ``182K``, ``1650`` -> ``1.65K``, ``2.114`` -> ``2.11``: three
    significant digits with K/M/B; never scientific notation."""
    if x is None or not _ok(x):
        return MISSING
    a = abs(x)
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if a >= div * 0.9995:
            return _sig(x / div) + suf
    if float(x).is_integer():
        return f"{x:.0f}"
    return _sig(x)


def _sig(v: float) -> str:
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}".removesuffix(".0")
    if a >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    if a == 0:
        return "0"
    return f"{v:.3g}"


def fmt_tokens(x: float | None) -> str:
    """``1650`` -> ``1.65K tokens`` (see :func:`fmt_count`)."""
    return MISSING if x is None or not _ok(x) else f"{fmt_count(x)} tokens"


def short_tokens(x: float) -> str:
    """A context length for a tick or a bucket: powers-of-two multiples of 1024 in binary
    K/M as people name context windows (``131072`` -> ``128K``), else :func:`fmt_count`."""
    if _ok(x) and x >= 1024 and float(x).is_integer():
        n = int(x)
        if n % 2**20 == 0:
            return f"{n // 2**20}M"
        if n % 1024 == 0:
            return f"{n // 1024}K"
    return fmt_count(x)


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage: ``0.123`` -> ``12%``, ``0.047`` -> ``4.7%``,
    ``0.0004`` -> ``<0.1%``."""
    if x is None or not _ok(x):
        return MISSING
    p = x * 100
    if p == 0:
        return "0%"
    if abs(p) < 0.1:
        return "<0.1%" if p > 0 else ">-0.1%"
    if abs(p) < 10:
        return f"{p:.1f}".removesuffix(".0") + "%"
    return f"{p:.0f}%"


def fmt_bytes(x: float | None) -> str:
    """Bytes in binary units: ``131072`` -> ``128 KiB``, ``3.6e9`` -> ``3.4 GiB``."""
    if x is None or not _ok(x):
        return MISSING
    a = abs(x)
    for div, suf in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if a >= div:
            return f"{_sig(x / div)} {suf}"
    return f"{x:.0f} B"


def fmt_money(x: float | None) -> str:
    """``1234.5`` -> ``$1,235``, ``0.573`` -> ``$0.57``, ``0.0042`` -> ``$0.0042``. The
    report has no currency field: the price's unit is shown as $."""
    if x is None or not _ok(x):
        return MISSING
    sign = "-" if x < 0 else ""
    a = abs(x)
    if a >= 100:
        return f"{sign}${a:,.0f}"
    if a >= 0.01 or a == 0:
        return f"{sign}${a:,.2f}"
    return f"{sign}${a:.2g}"


def fmt_gpu_hours(x: float | None) -> str:
    """``2920`` -> ``2.92K GPU-h``, ``0.229`` -> ``0.23 GPU-h``."""
    return MISSING if x is None or not _ok(x) else f"{fmt_count(x)} GPU-h"


def fmt_duration(s: float | None) -> str:
    """Seconds for people: ``45`` -> ``45 s``, ``5400`` -> ``1.5 h``, ``604800`` -> ``7 d``."""
    if s is None or not _ok(s):
        return MISSING
    for div, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if s >= (2 * div if unit == "d" else div):
            return f"{_sig(s / div)} {unit}"
    return f"{_sig(s)} s"


def fmt_time(t: float | None) -> str:
    """Unix time as ``2025-06-01 14:03 UTC``."""
    if t is None or not _ok(t):
        return MISSING
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _rate(x: float | None, unit: str) -> str:
    return MISSING if x is None or not _ok(x) else f"{fmt_count(x)} {unit}"


_LNUM = re.compile(r"^L(\d+)$")


def layers_text(layers: Sequence[str]) -> str:
    """``["L28", "L29", "L30", "L5"]`` -> ``L5, L28-L30`` (en dash); other names joined as given."""
    nums = [_LNUM.match(x) for x in layers]
    if not layers or not all(nums):
        return ", ".join(layers) or MISSING
    return ranges_text((int(m.group(1)) for m in nums if m), ", ", _DASH, "L")


# ---------------------------------------------------------------------------------------
# Shared facts and tables (plain text; each renderer escapes)


def window_text(rep: Report) -> str:
    """The data window in one phrase: ``2025-06-01 00:00 UTC - ... (24 h)``."""
    s = rep.source
    if s.start is None and s.end is None:
        span = "since the server started"
    else:
        span = f"{fmt_time(s.start) if s.start is not None else 'server start'} {_DASH} " \
               f"{fmt_time(s.end) if s.end is not None else 'now'}"
    extra = []
    if s.duration_s is not None and _ok(s.duration_s):
        extra.append(fmt_duration(s.duration_s))
    if s.range:
        extra.append(f"--range {s.range}")
    return span + (f" ({', '.join(extra)})" if extra else "")


def header_facts(rep: Report, m: ModelReport) -> Facts:
    """Source, what was read, data window, replicas."""
    mo = m.money
    return [
        ("Source", rep.source.kind),
        ("Read from", ", ".join(rep.source.where) or MISSING),
        ("Data window", window_text(rep)),
        ("Replicas", f"{mo.replicas} {_TIMES} {fmt_count(mo.gpus_per_replica)} GPU "
                     f"({mo.replicas_basis})"),
    ]


def traffic_facts(m: ModelReport) -> Facts:
    """Rates, totals, max_model_len and the context quantiles."""
    t = m.traffic
    c = t.context
    q = "interpolated in histogram buckets" if c.estimated_from_buckets else "measured"
    # One server's rate is not the fleet's: say so next to the number.
    whose = " (one replica's)" if t.scope == "replica" else ""
    return [
        ("Requests finished", fmt_count(t.requests)),
        ("Requests per second", _rate(t.requests_per_s, "req/s")
         + (whose if _ok(t.requests_per_s) else "")),
        ("Tokens per second", _rate(t.tokens_per_s, "tok/s")
         + (whose if _ok(t.tokens_per_s) else "")),
        ("Prompt tokens", fmt_tokens(t.prompt_tokens)),
        ("Generated tokens", fmt_tokens(t.generation_tokens)),
        ("max_model_len", MISSING if t.max_model_len is None else
         f"{short_tokens(t.max_model_len)} tokens ({t.max_model_len:,})"),
        ("Context p50 / p90 / p99 / p99.9",
         " / ".join(fmt_count(v) for v in (c.p50, c.p90, c.p99, c.p999)) + f" tokens ({q})"),
        ("Longest context", fmt_tokens(c.max)),
    ]


def context_labels(c: ContextDistribution) -> list[str]:
    """One label per histogram bucket: ``≤128``, ``128-256``, …, ``>128K``."""
    out = []
    prev: float | None = None
    for b in c.bounds:
        out.append(f"≤{short_tokens(b)}" if prev is None
                   else f"{short_tokens(prev)}{_DASH}{short_tokens(b)}")
        prev = b
    if len(c.counts) > len(c.bounds):
        out.append(f">{short_tokens(c.bounds[-1])}" if c.bounds else "all")
    return out[:len(c.counts)]


def context_table(m: ModelReport) -> Table:
    """Requests per context-length bucket and their share."""
    c = m.traffic.context
    total = sum(v for v in c.counts if _ok(v))
    rows = [[lab, fmt_count(v), fmt_pct(v / total) if total else MISSING]
            for lab, v in zip(context_labels(c), c.counts, strict=False)]
    return ["Context (tokens)", "Requests", "Share"], rows


def phase_table(m: ModelReport) -> Table:
    """Attention's share of sampled model time, by phase."""
    t = m.time
    phases = list(dict.fromkeys([*t.attention_share, *t.model_time_s]))
    rows = [[p, fmt_pct(t.attention_share.get(p)), fmt_duration(t.model_time_s.get(p))]
            for p in phases]
    if t.overall_share is not None and _ok(t.overall_share):
        rows.append(["all", fmt_pct(t.overall_share),
                     fmt_duration(sum(v for v in t.model_time_s.values() if _ok(v)))])
    return ["Phase", "Attention share", "Sampled model time"], rows


def backend_table(m: ModelReport) -> Table:
    """Attention time by backend and phase."""
    rows = [[b.backend, b.phase, fmt_duration(b.time_s), fmt_pct(b.share)]
            for b in m.time.by_backend]
    return ["Backend", "Phase", "Attention time", "Share of attention"], rows


def layer_table(m: ModelReport) -> Table:
    """Attention time per layer, fused or fallback."""
    rows = [[x.layer, x.backend, "fused" if x.fused else "fallback", fmt_duration(x.time_s),
             fmt_pct(x.share)] for x in m.time.per_layer]
    return ["Layer", "Backend", "Path", "Attention time", "Share"], rows


def fallback_table(m: ModelReport) -> Table:
    """Unfused layers, why, the fix and what it gains."""
    rows = [[layers_text(f.layers), f.backend, f.reason, f.fix, f.gain]
            for f in m.time.fallbacks]
    return ["Layers", "Backend", "Why", "Fix", "Gain"], rows


def kv_facts(kv: KvMemory, scope: Scope = "fleet") -> Facts:
    """KV cache size, capacity, usage, pressure (``scope``: whose capacity, as the traffic's)."""
    seqs = ", ".join(f"{fmt_count(v)} at {k}" for k, v in kv.capacity_sequences.items())
    out = [
        ("KV bytes per token", fmt_bytes(kv.bytes_per_token)
         + (f" ({kv.kv_dtype})" if kv.kv_dtype else "")),
        ("Capacity (one replica's)" if scope == "replica" else "Capacity (all replicas)",
         fmt_tokens(kv.capacity_tokens)),
        ("Concurrent sequences that fit", seqs + " context" if seqs else MISSING),
        ("Usage p95 / peak", f"{fmt_pct(kv.usage_p95)} / {fmt_pct(kv.usage_peak)}"),
        ("Time above 90% full", fmt_pct(kv.above_90_fraction)),
        ("Preemptions", fmt_count(kv.preemptions)),
        ("Time with requests waiting", fmt_pct(kv.waiting_fraction)),
    ]
    if kv.peak_concurrency is not None and _ok(kv.peak_concurrency):
        basis = f" ({kv.peak_concurrency_basis})" if kv.peak_concurrency_basis else ""
        out.append(("Peak concurrent sequences", fmt_count(kv.peak_concurrency) + basis))
    return out


def basis_label(b: BasisBucket, min_tokens: int | None) -> str:
    """A coverage bucket: ``short (under 256)``, ``256-512`` (en dash), ``≥8K``."""
    if b.bucket == 0:
        return f"short (under {short_tokens(min_tokens)})" if min_tokens else "short"
    if b.hi is None:
        return f"≥{short_tokens(b.bucket)}"
    return f"{short_tokens(b.bucket)}{_DASH}{short_tokens(b.hi)}"


def _of(folded: float | None, traffic: float | None, share: float | None = None) -> str:
    """``folded / traffic (share)``."""
    out = f"{fmt_count(folded)} / {fmt_count(traffic)}"
    return out + (f" ({fmt_pct(share)})" if share is not None and _ok(share) else "")


def basis_table(m: ModelReport) -> Table:
    """Per context bucket, prefill and decode side by side: the traffic's requests, KV
    block-seconds and query tokens against what the head statistics folded."""
    b = m.advice_basis
    if b is None or not b.available:
        return [], []
    rows = []
    for x in b.buckets:
        pre, dec = x.prefill, x.decode
        if not (x.traffic_requests or x.kv_block_seconds or any(
                p is not None and (p.folded_requests or p.traffic_queries)
                for p in (pre, dec))):
            continue  # a bucket neither the traffic nor the statistics reached
        rows.append([
            basis_label(x, b.min_tokens),
            _of(pre.folded_requests if pre is not None else None, x.traffic_requests),
            MISSING if x.kv_block_seconds is None else
            f"{fmt_count(x.kv_block_seconds)} ({fmt_pct(x.kv_share)})",
            MISSING if pre is None else _of(pre.folded_queries, pre.traffic_queries,
                                            pre.query_share),
            MISSING if dec is None else fmt_count(dec.folded_requests),
            MISSING if dec is None else _of(dec.folded_queries, dec.traffic_queries,
                                            dec.query_share)])
    return ["Context (tokens)", "Requests folded / all", "KV block-s (share)",
            "Prompt tokens folded / all", "Decode seqs",
            "Decode queries folded / all"], rows


def basis_facts(m: ModelReport) -> Facts:
    """What the window advice stands on: the sentence, the need-more-traffic verdict, the
    dynamic heads, the shares of the traffic the statistics cover (empty without coverage:
    :func:`basis_sentence` says so)."""
    b = m.advice_basis
    if b is None or not b.available:
        return []
    out: Facts = []
    if b.need_more_traffic:
        out.append(("Need more traffic", b.need_more_traffic))
    if b.dynamic_kv_heads is not None:
        views = f" of {b.stability_views} views" if b.stability_views is not None else " views"
        rated = (f"; {b.rated_kv_heads} rated by two or more{views}"
                 if b.rated_kv_heads is not None else "")
        out.append(("Dynamic KV heads (kept full)",
                    f"{b.dynamic_kv_heads} of {fmt_count(b.kv_heads)} "
                    f"({fmt_pct(b.dynamic_share)}){rated}"))
    else:
        out.append(("Dynamic KV heads (kept full)", "not rated yet (no stability views)"))
    out += [("Prompt tokens in buckets with statistics", fmt_pct(b.prefill_query_share)),
            ("KV block-seconds in buckets with statistics", fmt_pct(b.kv_share))]
    if b.decode_query_share is not None:
        out.append(("Decode queries in buckets with statistics",
                    fmt_pct(b.decode_query_share)))
    if b.corrected is not None:
        out.append(("Statistics weighted to the traffic",
                    "yes (post-stratified per context bucket)" if b.corrected
                    else "no (the sample's own mix: no per-bucket traffic counts)"))
    return out


def basis_sentence(m: ModelReport) -> str:
    """The one sentence: what share of the traffic the window advice stands on, or that
    the source has no coverage data."""
    from attnprof.analyze.advice_basis import NO_COVERAGE

    return m.advice_basis.stands_on if m.advice_basis is not None else NO_COVERAGE


def kv_source_sentence(kv: KvMemory) -> str:
    """Where the usage and preemption figures come from, in words."""
    if kv.source == "vllm":
        return "Usage and preemption figures are vLLM's own scheduler statistics."
    if kv.source == "attnprof":
        return "Usage and preemption figures are attnprof's own measurement."
    return f"Usage and preemption figures come from {kv.source}."


def usage_table(kv: KvMemory, t0: float | None = None) -> Table:
    """KV usage over time (rows only when there are at most 24 points)."""
    pts = kv.usage_over_time
    if not pts or len(pts) > _USAGE_ROWS_MAX:
        return ["Time", "KV usage"], []
    base = pts[0].t if t0 is None else t0
    return ["Time", "KV usage"], [[f"+{fmt_duration(p.t - base)}" if p.t > base
                                   else fmt_time(p.t), fmt_pct(p.usage)] for p in pts]


def badges(w: WhatIf) -> list[tuple[str, str]]:
    """(text, kind) labels of a what-if: evidence, confidence, support; kind is ``good``,
    ``plain``, ``warn`` or ``bad``."""
    out = [{"measured": ("measured", "good"), "replay": ("replay-validated", "good")}
           .get(w.evidence, ("estimated", "plain"))]
    conf = w.confidence.strip().lower()
    out.append((f"{conf or 'unknown'} confidence",
                {"high": "good", "medium": "plain", "low": "warn"}.get(conf, "plain")))
    if w.apply.supported is None:
        out.append(("not checked against vLLM", "warn"))
    elif not w.apply.supported:
        out.append(("not supported by the installed vLLM", "bad"))
    if w.apply.needs_change:
        out.append(("needs a model or kernel change", "warn"))
    v = w.validation
    if v is not None and v.status != "measured":
        out.append(("could not start" if v.status == "could_not_start"
                    else "measurement failed", "bad"))
    elif v is not None:
        out.append({"off": ("measured: prediction OFF", "bad"),
                    "confirmed": ("measured: confirmed", "good")}.get(
            v.verdict, ("measured: inconclusive", "warn")))
    return out


def whatif_numbers(w: WhatIf) -> Facts:
    """The what-if's numbers that are not None."""
    out: Facts = []

    def add(label: str, v: float | None, text: str) -> None:
        if v is not None and _ok(v):
            out.append((label, text))

    add("Model time saved", w.time_saving, fmt_pct(w.time_saving) + (
        f" [{fmt_pct(w.time_saving_low)}, {fmt_pct(w.time_saving_high)}]"
        if w.time_saving_low is not None and w.time_saving_high is not None else ""))
    if w.banked_time_saving is not None and w.banked_time_saving != w.time_saving:
        out.append(("Time saving the money banks", fmt_pct(w.banked_time_saving)
                    + " (a measured saving's lower bound; 0 when its interval holds 0)"))
    if w.verdict is not None:
        out.append(("Measured verdict", w.verdict))
    if not w.ranked:
        out.append(("Not ranked", w.not_ranked or "yes"))
    add("Attention FLOPs saved", w.attention_flop_saving, fmt_pct(w.attention_flop_saving))
    add("KV bytes per token saved", w.kv_saving, fmt_pct(w.kv_saving))
    add("KV freed per token", w.kv_bytes_freed_per_token, fmt_bytes(w.kv_bytes_freed_per_token))
    add("Extra concurrent sequences (mean context)", w.extra_sequences,
        f"+{fmt_count(w.extra_sequences)}")
    if w.replicas_now is not None and w.replicas_after is not None:
        out.append(("Replicas at peak", f"{w.replicas_now} → {w.replicas_after}"))
    elif w.replicas_now is not None:
        out.append(("Replicas at peak", str(w.replicas_now)))
    if w.replicas_removed is not None:
        out.append(("Replicas removed (fixed fleet)", str(w.replicas_removed)))
    add("GPU-hours per 1M tokens after (fixed fleet)", w.gpu_hours_per_mtok_after,
        fmt_gpu_hours(w.gpu_hours_per_mtok_after))
    add("Cost per 1M tokens after (fixed fleet)", w.cost_per_mtok_after,
        fmt_money(w.cost_per_mtok_after))
    add("Saving per month (fixed fleet)", w.monthly_saving,
        f"{fmt_money(w.monthly_saving)}/month")
    add("GPU-hours saved per month (fixed fleet)", w.monthly_gpu_hours_saved,
        fmt_gpu_hours(w.monthly_gpu_hours_saved))
    if w.compute_floor is not None:
        out.append(("Compute floor (replicas)", str(w.compute_floor)))
    a = w.autoscaled
    if a is not None:
        add("Saving per month (autoscaled)", a.monthly_saving,
            f"{fmt_money(a.monthly_saving)}/month")
        add("GPU-hours saved per month (autoscaled)", a.monthly_gpu_hours_saved,
            f"{fmt_gpu_hours(a.monthly_gpu_hours_saved)} ({fmt_pct(a.share)}; "
            f"assumes {a.assumes})")
        if a.monthly_gpu_hours_saved is None:
            add("GPU-hours saved per replica-month (autoscaled)",
                a.gpu_hours_saved_per_replica_month,
                f"{fmt_gpu_hours(a.gpu_hours_saved_per_replica_month)} ({fmt_pct(a.share)}; "
                f"assumes {a.assumes})")
    b = w.measured_beside
    if b is not None:
        out.append(("Measured on another setup (not adopted)",
                    f"time saving {fmt_pct(b.time_saving)}"
                    + (f" [{fmt_pct(b.time_saving_low)}, {fmt_pct(b.time_saving_high)}]"
                       if b.time_saving_low is not None and b.time_saving_high is not None
                       else "")
                    + (f", KV {fmt_pct(b.kv_saving)}" if b.kv_saving is not None else "")
                    + f" ({b.mismatch})"))
    return out


def alternatives_text(w: WhatIf, titles: dict[str, str]) -> str:
    """``alternative to <title>: not additive`` for each what-if this one replaces; empty
    when it replaces none."""
    return "; ".join(f"alternative to {titles.get(x, x)}: not additive"
                     for x in w.alternative_to)


def evidence_text(w: WhatIf) -> str:
    """The evidence kind with its detail: ``replay (99.5% greedy agreement ...)``."""
    return w.evidence + (f" ({w.evidence_detail})" if w.evidence_detail else "")


def _priced(mo: Money) -> bool:
    return mo.gpu_hour_price is not None and _ok(mo.gpu_hour_price)


def money_facts(m: ModelReport) -> Facts:
    """Price, GPU-hours and cost per 1M tokens, monthly GPU-hours and cost."""
    mo = m.money
    gpus = mo.replicas * mo.gpus_per_replica
    out = [("GPUs", f"{fmt_count(gpus)} ({mo.replicas} replicas {_TIMES} "
                    f"{fmt_count(mo.gpus_per_replica)}, {mo.replicas_basis})"),
           ("GPU-hours per 1M tokens", fmt_gpu_hours(mo.gpu_hours_per_mtok)),
           ("GPU-hours per month", f"{fmt_gpu_hours(mo.monthly_gpu_hours)} "
                                   f"({fmt_count(mo.hours_per_month)} h/month)"),
           ("Mean replicas (autoscaled base)",
            f"{mo.mean_replicas:,.2f} ({mo.mean_replicas_basis})" if mo.mean_replicas
            else "not known: autoscaled savings per replica-month (--mean-replicas)")]
    if _priced(mo):
        out[0:0] = [("GPU price", f"{fmt_money(mo.gpu_hour_price)}/GPU-hour")]
        out.append(("Cost per 1M tokens", fmt_money(mo.cost_per_mtok)))
        out.append(("Cost per month", f"{fmt_money(mo.monthly_cost)}/month"))
    return out


def no_price_sentence(m: ModelReport) -> str | None:
    """Without a price: the figures are GPU-hours, and how to add one. None with a price."""
    if _priced(m.money):
        return None
    return ("No GPU price was given, so the figures are GPU-hours. Add "
            "--gpu-hour-price PRICE (per GPU-hour) to attnprof report to see costs.")


def money_table(m: ModelReport) -> Table:
    """Now and after each what-if: GPU-hours (and cost with a price) per 1M tokens and
    the monthly saving."""
    mo = m.money
    titles = {w.id: w.title for w in m.what_ifs}
    priced = _priced(mo)

    def scenario(w: WhatIf) -> str:
        alt = alternatives_text(w, titles)
        return f"{w.title} ({alt})" if alt else w.title

    def auto(w: WhatIf) -> list[str]:
        a = w.autoscaled
        if a is None:
            return [MISSING] * (2 if priced else 1)
        if a.monthly_gpu_hours_saved is None:  # the mean replicas unknown: per replica
            per = a.gpu_hours_saved_per_replica_month
            return ([MISSING] if priced else []) + [
                f"{fmt_gpu_hours(per)} per replica" if per is not None else MISSING]
        return ([fmt_money(a.monthly_saving)] if priced else []) + \
            [fmt_gpu_hours(a.monthly_gpu_hours_saved)]

    removed = [MISSING if w.replicas_removed is None else str(w.replicas_removed)
               for w in m.what_ifs]
    if priced:
        head = ["Scenario", "GPU-hours / 1M tokens", "Cost / 1M tokens", "Replicas removed",
                "Saving / month", "GPU-hours saved / month", "Autoscaled saving / month",
                "Autoscaled GPU-hours saved / month"]
        rows = [["now", fmt_gpu_hours(mo.gpu_hours_per_mtok), fmt_money(mo.cost_per_mtok),
                 MISSING, MISSING, MISSING, MISSING, MISSING]]
        rows += [[scenario(w), fmt_gpu_hours(w.gpu_hours_per_mtok_after),
                  fmt_money(w.cost_per_mtok_after), r, fmt_money(w.monthly_saving),
                  fmt_gpu_hours(w.monthly_gpu_hours_saved), *auto(w)]
                 for w, r in zip(m.what_ifs, removed, strict=True)]
        return head, rows
    head = ["Scenario", "GPU-hours / 1M tokens", "Replicas removed", "GPU-hours saved / month",
            "Autoscaled GPU-hours saved / month"]
    rows = [["now", fmt_gpu_hours(mo.gpu_hours_per_mtok), MISSING, MISSING, MISSING]]
    rows += [[scenario(w), fmt_gpu_hours(w.gpu_hours_per_mtok_after), r,
              fmt_gpu_hours(w.monthly_gpu_hours_saved), *auto(w)]
             for w, r in zip(m.what_ifs, removed, strict=True)]
    return head, rows


def money_basis_sentence(m: ModelReport) -> str:
    """Which figure is which, and which one ranks the savings."""
    ranked = ("the autoscaled figure (--autoscaled)" if m.ranked_by == "autoscaled"
              else "the fixed-fleet figure (attnprof report --autoscaled ranks by the other)")
    return ("Each saving is stated twice: at a fixed fleet (whole replicas removed from the "
            f"{m.money.replicas} counted, what the bill shows without autoscaling) and "
            "autoscaled (the fractional share of the fleet's mean replicas"
            + (f", {m.money.mean_replicas:,.2f}" if m.money.mean_replicas else
               ": not known, so per replica-month") + ", if replicas follow load). A "
            "measured saving banks the lower bound of its interval. Alternatives are "
            f"not additive. The savings are ranked by {ranked}.")


def version_rows(rep: Report) -> Table:
    """Versions the report was made with."""
    return ["Component", "Version"], [[k, v or MISSING] for k, v in rep.versions.items()]


def provenance_facts(p: Provenance) -> Facts:
    """The measured run's provenance: versions, hardware, model, git, command, time."""
    hw = p.hardware
    hw_text = hw.gpu_name or hw.cpu or hw.type
    if hw.compute_capability:
        hw_text += f" (sm {hw.compute_capability})"
    if hw.driver:
        hw_text += f", driver {hw.driver}"
    out = [("Hardware", hw_text),
           ("Model", p.model.name + (f" ({p.model.path})" if p.model.path else ""))]
    if p.model.config_sha256:
        out.append(("Config sha256", p.model.config_sha256[:16] + "…"))
    vers = ", ".join(f"{k} {v}" for k, v in (("attnprof", p.attnprof), ("python", p.python),
                                            ("torch", p.torch), ("vllm", p.vllm),
                                            ("transformers", p.transformers)) if v)
    out.append(("Versions", vers or MISSING))
    if p.git is not None:
        out.append(("Git", p.git.revision[:12] + (" (dirty)" if p.git.dirty else "")))
    if p.command:
        out.append(("Command", " ".join(p.command)))
    if p.time:
        out.append(("Measured at", p.time_iso or fmt_time(p.time)))
    return out


# ---------------------------------------------------------------------------------------
# Markdown


def input_text(v: float | str | None) -> str:
    """A formula input as given: integers exact with thousands separators (``131,072``),
    other numbers to four significant digits."""
    if v is None:
        return MISSING
    if isinstance(v, str):
        return v
    if not _ok(v):
        return MISSING
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:.4g}"
