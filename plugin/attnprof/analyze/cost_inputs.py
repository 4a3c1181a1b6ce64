"""What a snapshot says about cost, as :mod:`attnprof.analyze.cost` takes it: where
attention time goes (per phase, backend and layer, and the unfused layers with what would fix
them), KV memory and peak concurrency, the context distribution's p99.9 and its drift, and the
window advice. Pure functions over typed snapshots and profiles; the sources that read them
are :mod:`attnprof.tools.report_sources` and :mod:`attnprof.tools.report_prometheus`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.aggregate.quantiles import QuantileEstimator
from attnprof.analyze.cost import WindowInputs
from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.report import (
    BackendTime,
    ContextDistribution,
    Drift,
    Fallback,
    KvMemory,
    LayerTime,
    TimeBreakdown,
)
from attnprof.contracts.snapshot import Snapshot

__all__ = ["MIN_RATE_SECONDS", "AttentionShape", "attention_shape", "attention_shares",
           "context_p999", "drift", "kv_memory", "mean_over_range", "peak_concurrency",
           "profile_fallbacks", "rate", "snapshot_duration", "time_breakdown",
           "window_inputs"]

MIN_RATE_SECONDS = 1.0
"""A rate needs at least this much time under it: a 0-second window (a snapshot taken as
the server started) has no rate, never 2,000 tokens / 1e-9 s."""


def rate(total: float, seconds: float | None) -> float | None:
    """``total / seconds``; None when less than :data:`MIN_RATE_SECONDS` lie under it."""
    if seconds is None or not seconds >= MIN_RATE_SECONDS:
        return None
    return total / seconds


def attention_shares(model_time_s: dict[str, float], attention_time_s: dict[str, float]
                     ) -> tuple[dict[str, float], float | None]:
    """(attention's share of each phase's model time, its share of all model time): one
    definition for a snapshot's steps and Prometheus' step counters."""
    shares = {p: attention_time_s.get(p, 0.0) / t for p, t in model_time_s.items() if t > 0}
    total = sum(model_time_s.values())
    overall = (sum(t * shares.get(p, 0.0) for p, t in model_time_s.items()) / total
               if total > 0 else None)
    return shares, overall


def peak_concurrency(usage_peak: float | None, capacity_tokens: float | None,
                     mean_context: float | None, running_peak: float | None = None
                     ) -> tuple[float | None, str]:
    """(sequences running at the peak, how it was obtained): vLLM's peak running requests
    when the source has them, else peak KV usage x capacity in tokens / mean context
    (``FORMULAS['peak_concurrency']``). Shown, never used to size the fleet: replicas are
    sized by the memory held at the peak (usage x capacity), which needs no mean."""
    if running_peak is not None:
        return running_peak, ("vLLM's peak running requests (sum of each replica's peak "
                              "over the range: an upper bound)")
    if usage_peak is not None and capacity_tokens and mean_context:
        return (usage_peak * capacity_tokens / mean_context,
                "estimated: peak KV usage x capacity in tokens / mean context "
                f"({usage_peak:.1%} x {capacity_tokens:,.0f} / {mean_context:,.0f})")
    return None, ""


def mean_over_range(points: list[tuple[float, float]], start: float, end: float,
                    step: float) -> float | None:
    """Mean of a count sampled every ``step`` seconds over [start, end] (Prometheus'
    range query): a step without a point counts 0 (no replica served then), so a fleet
    that scaled to zero is billed for none. None without a point or a range."""
    if not points or end <= start or step <= 0:
        return None
    steps = int((end - start) // step) + 1
    return sum(v for _, v in points) / max(steps, len(points))


@dataclass
class AttentionShape:
    """What FP8 KV's known exceptions turn on, from the layers a snapshot reports."""

    head_sizes: list[int]
    """Distinct head sizes of the attention layers (empty: not known)."""
    sliding_layers: list[int] | None
    """Indices of the model's own sliding-window layers (None: not known)."""
    layers: int


def attention_shape(snap: Snapshot) -> AttentionShape | None:
    """The head sizes and sliding-window layers of the first worker that reports layers
    (None: none does)."""
    layers = next((w.layers for w in snap.workers if w.layers), None)
    if not layers:
        return None
    return AttentionShape(head_sizes=sorted({lay.head_size for lay in layers}),
                          sliding_layers=sorted(lay.index for lay in layers
                                                if lay.sliding_window),
                          layers=len(layers))


def window_inputs(adv: WindowAdvice | None) -> WindowInputs | None:
    """The cost report's view of a window advice (None without one)."""
    if adv is None:
        return None
    return WindowInputs(
        sinks=adv.sinks, window=adv.window, layers=list(adv.layers),
        flop_saving=adv.attention_flop_saving, kv_saving=adv.kv_memory_saving,
        exact_fraction=adv.exact_request_fraction, heads_at_risk=adv.heads_at_risk_count,
        replay=adv.replay, safe=adv.safe, summary=adv.summary,
        head_split=adv.head_level_split)


def context_p999(summary: Any, bounds: list[float], counts: list[float]
                 ) -> tuple[float | None, bool]:
    """(p99.9 context, whether it was interpolated in the buckets): from the summary's
    quantile sketch when it has a readable one, else Prometheus' rule over the histogram."""
    if summary is not None and summary.sketch:
        try:
            v = QuantileEstimator.from_dict(summary.sketch).quantile(0.999)
            if v is not None:
                return float(v), False
        except (ValueError, KeyError, TypeError):
            pass
    return bucket_quantile(bounds, counts, 0.999, interpolate=True), True


def snapshot_duration(snap: Snapshot) -> tuple[float | None, float | None]:
    """(start, seconds) the snapshot's counters cover: a record window, else since the API
    server started."""
    if snap.window is not None:
        return snap.window.start, snap.window.duration_s
    starts = [p.started_at for p in snap.processes if p.role == "api_server" and p.started_at]
    if starts:
        return min(starts), max(0.0, snap.time - min(starts))
    return None, None


def time_breakdown(snap: Snapshot, profile: ProfileReport | None) -> TimeBreakdown:
    """Where attention time goes in a snapshot: the attention share of each phase's model
    time, time per backend and phase and per layer, and the unfused layers with what would
    fix them (with a profile: its advice and measured gains too)."""
    worker = next((w for w in snap.workers if w.steps), None)
    steps = worker.steps if worker is not None else {}
    model_t = {phase: st.model_time_s for phase, st in steps.items()}
    shares, overall = attention_shares(
        model_t, {phase: st.attention_time_s for phase, st in steps.items()})
    layers = worker.layers if worker is not None else (snap.workers[0].layers
                                                       if snap.workers else [])
    total = sum(ph.time_s for lay in layers for ph in lay.phases.values())
    per_layer = [LayerTime(layer=str(lay.index), backend=lay.backend, fused=lay.fused,
                           time_s=sum(ph.time_s for ph in lay.phases.values()),
                           share=(sum(ph.time_s for ph in lay.phases.values()) / total
                                  if total > 0 else 0.0))
                 for lay in layers]
    by: dict[tuple[str, str], float] = defaultdict(float)
    for lay in layers:
        for phase, ph in lay.phases.items():
            by[(lay.backend, phase)] += ph.time_s
    by_backend = [BackendTime(backend=b, phase=p, time_s=t, share=t / total if total else 0.0)
                  for (b, p), t in sorted(by.items())]
    fallbacks = []
    for g in (worker.kernel_map if worker is not None else []):
        if g.fused:
            continue
        why = g.note or "; ".join(f"{k}: {v}" for k, v in list(g.rejected.items())[:3]) \
            or "the backend that ran is not a fused kernel"
        fallbacks.append(Fallback(layers=[str(i) for i in g.layers], backend=g.backend,
                                  reason=why, fix=f"run a fused backend (--attention-backend "
                                  f"{g.predicted or 'FLASH_ATTN'})" if g.predicted !=
                                  g.backend else "see the kernel map's rejected reasons",
                                  gain="not measured (profile the model offline with "
                                  "attnprof profile to measure fused vs unfused)"))
    if profile is not None:
        fallbacks += profile_fallbacks(profile)
    return TimeBreakdown(attention_share=shares, model_time_s=model_t, by_backend=by_backend,
                         per_layer=per_layer, fallbacks=fallbacks, overall_share=overall)


def profile_fallbacks(profile: ProfileReport) -> list[Fallback]:
    """A profile's backend advice as fallbacks, with its measured or estimated gain."""
    out = []
    for a in profile.advice:
        g = a.expected_gain
        if g is not None and g.speedup is not None:
            gain = (f"measured: {g.speedup:.2f}x faster attention at {g.at_seq_len:,} tokens"
                    + (f", {g.attention_peak_bytes_saved / 2**20:,.0f} MiB less peak memory"
                       if g.attention_peak_bytes_saved else "") + f" ({g.source})")
        elif g is not None and g.attention_peak_bytes_saved:
            gain = (f"estimated: {g.attention_peak_bytes_saved / 2**20:,.0f} MiB less peak "
                    f"memory at {g.at_seq_len:,} tokens ({g.source or 'analytic model'})")
        else:
            gain = "not measured"
        out.append(Fallback(layers=[str(i) for i in a.layers], backend=a.kernel or "",
                            reason=a.reason, fix=a.change, gain=gain))
    return out


def kv_memory(snap: Snapshot) -> KvMemory:
    """KV memory of a snapshot: bytes per token, capacity, usage, the verdict, and the peak
    concurrency estimated as peak usage x capacity in tokens / mean context."""
    req = snap.requests
    st = req.kv_pressure if req is not None else None
    a = snap.kv_pressure
    bpt = sum(lay.bytes_per_token for lay in st.layers) if st is not None and st.layers else None
    cap_tokens = a.capacity_tokens if a is not None else None
    # The aggregate's peak (what the terminal prints), the stat logger's only without one: a
    # measured 0% is a peak, not a missing one.
    peak = a.peak if a is not None and a.peak is not None else (
        st.peak if st is not None else None)
    mean_ctx = req.context_tokens.mean if req is not None else None
    conc, basis = peak_concurrency(peak, cap_tokens, mean_ctx)
    return KvMemory(
        bytes_per_token=bpt, kv_dtype=st.kv_dtype if st is not None else None,
        capacity_tokens=float(cap_tokens) if cap_tokens is not None else None,
        capacity_sequences=dict(a.capacity_sequences) if a is not None else {},
        usage_p95=a.p95 if a is not None else None, usage_peak=peak,
        above_90_fraction=a.above_90_fraction if a is not None else None,
        preemptions=float(st.preemptions) if st is not None else None,
        waiting_fraction=a.waiting_fraction if a is not None else None,
        verdict=a.verdict if a is not None else None,
        verdict_evidence=list(a.evidence) if a is not None else [],
        source="vllm scheduler stats (attnprof's stat logger)" if st is not None else "none",
        peak_concurrency=conc, peak_concurrency_basis=basis,
        mean_running=a.mean_running if a is not None else None)


def drift(first: ContextDistribution, second: ContextDistribution) -> Drift:
    """How the context distribution moved between two halves (or two files)."""
    a50, b50, a99, b99 = first.p50, second.p50, first.p99, second.p99
    if None in (a50, b50, a99, b99) or not a50 or not a99:
        return Drift(a50, b50, a99, b99, "not enough requests in both halves to compare")
    d50 = (b50 or 0) / a50 - 1
    d99 = (b99 or 0) / a99 - 1
    if abs(d50) < 0.1 and abs(d99) < 0.1:
        text = f"stable: p50 {a50:,.0f} -> {b50:,.0f}, p99 {a99:,.0f} -> {b99:,.0f} tokens"
    else:
        text = (f"moved: p50 {a50:,.0f} -> {b50:,.0f} ({d50:+.0%}), p99 {a99:,.0f} -> "
                f"{b99:,.0f} ({d99:+.0%}) tokens")
    return Drift(a50, b50, a99, b99, text)
