"""A window of a live server: the difference of two of its snapshots (``attnprof record``).

Counters (calls, time, tokens, steps, sampler and error counts, request histograms) are
subtracted; what cannot be subtracted is taken from the end snapshot and said so in
``window.note``: maxima, rates, window advice. The last calls' times (``recent_time_s``)
keep only the window's own calls (at most 64 per layer and phase). A worker that restarted
in between (another pid, or a counter that went down) counts from its start; so does the
API server's request count.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TypeVar

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.analyze.kv_pressure import assess
from attnprof.contracts.snapshot import (
    ContextHistogram,
    KvPressureStats,
    LayerProfile,
    PhaseStats,
    QuantileSummary,
    RecordWindow,
    RequestStats,
    Snapshot,
    StepPhaseStats,
    WorkerSnapshot,
)

__all__ = ["restarted", "window_between"]

_SAMPLER_COUNTS = ("seen", "sampled", "sampled_long", "blind", "unsampled", "throttles")


def _phase(a: PhaseStats | None, b: PhaseStats) -> PhaseStats:
    if a is None:
        return b
    calls = max(0, b.calls - a.calls)
    reqs_b, reqs_a = b.mean_batch_requests * b.calls, a.mean_batch_requests * a.calls
    reqs = max(0.0, reqs_b - reqs_a)
    kv = max(0.0, b.mean_seq_len * reqs_b - a.mean_seq_len * reqs_a)
    t = max(0.0, b.time_s - a.time_s)
    return PhaseStats(calls=calls, time_s=t, mean_time_s=t / calls if calls else 0.0,
                      tokens=max(0, b.tokens - a.tokens), flops=max(0, b.flops - a.flops),
                      bytes=max(0, b.bytes - a.bytes),
                      mean_batch_requests=reqs / calls if calls else 0.0,
                      mean_seq_len=kv / reqs if reqs else 0.0, max_seq_len=b.max_seq_len,
                      # Only the window's own calls: the ring also holds earlier ones.
                      recent_time_s=list(b.recent_time_s[-calls:]) if calls else [])


def _layer(a: LayerProfile | None, b: LayerProfile) -> LayerProfile:
    out = copy.copy(b)
    prev = a.phases if a is not None else {}
    phases = {p: _phase(prev.get(p), st) for p, st in b.phases.items()}
    out.phases = {p: st for p, st in phases.items() if st.calls}
    return out


def restarted(a: WorkerSnapshot | None, b: WorkerSnapshot) -> bool:
    """No earlier read of this worker, or a counter went down (the same pid reused by a new
    process, or its aggregates reset): its counts start inside the window."""
    return a is None or b.sampler.seen < a.sampler.seen or any(
        b.steps.get(p) is None or b.steps[p].steps < st.steps for p, st in a.steps.items())


def _worker(a: WorkerSnapshot | None, b: WorkerSnapshot) -> WorkerSnapshot:
    if a is None or restarted(a, b):
        return b
    out = copy.copy(b)
    before = {lay.index: lay for lay in a.layers}
    out.layers = [_layer(before.get(lay.index), lay) for lay in b.layers]
    steps = {}
    for p, st in b.steps.items():
        sa = a.steps.get(p)
        n = st.steps - (sa.steps if sa else 0)
        if n <= 0:
            continue
        mt = max(0.0, st.model_time_s - (sa.model_time_s if sa else 0.0))
        at = max(0.0, st.attention_time_s - (sa.attention_time_s if sa else 0.0))
        steps[p] = StepPhaseStats(steps=n, model_time_s=mt, attention_time_s=at,
                                  attention_share=at / mt if mt > 0 else None)
    out.steps = steps
    s = dataclasses.replace(b.sampler)
    for k in _SAMPLER_COUNTS:
        setattr(s, k, max(0, getattr(b.sampler, k) - getattr(a.sampler, k)))
    s.self_time_s = max(0.0, b.sampler.self_time_s - a.sampler.self_time_s)
    out.sampler = s
    out.errors = {k: v - a.errors.get(k, 0) for k, v in b.errors.items()
                  if v - a.errors.get(k, 0) > 0}
    out.dropped = {k: v - a.dropped.get(k, 0) for k, v in b.dropped.items()
                   if v - a.dropped.get(k, 0) > 0}
    hc = dataclasses.replace(b.head_stats_cost)
    for k in ("steps", "requests", "queries"):
        setattr(hc, k, max(0, getattr(b.head_stats_cost, k) - getattr(a.head_stats_cost, k)))
    for k in ("time_s", "prefill_time_s"):
        setattr(hc, k, max(0.0, getattr(b.head_stats_cost, k) - getattr(a.head_stats_cost, k)))
    hc.fraction_of_prefill = hc.time_s / hc.prefill_time_s if hc.prefill_time_s > 0 else None
    out.head_stats_cost = hc
    out.head_stats = None
    return out


def _quantiles(bounds: list[float], counts: list[int]) -> QuantileSummary:
    """p50/p90/p99 of a histogram as bucket upper bounds (not exact: ``exact`` False)."""
    return QuantileSummary(count=sum(counts), exact=False,
                           p50=bucket_quantile(bounds, counts, 0.5),
                           p90=bucket_quantile(bounds, counts, 0.9),
                           p99=bucket_quantile(bounds, counts, 0.99))


_N = TypeVar("_N", int, float)


def _sub(a: list[_N] | None, b: list[_N] | None) -> list[_N] | None:
    """``b - a`` per entry, never below 0 (None when either is missing)."""
    if a is None or b is None or len(a) != len(b):
        return None
    return [max(y - x, y - y) for x, y in zip(a, b, strict=True)]


def _requests(a: RequestStats | None, b: RequestStats | None) -> tuple[RequestStats | None,
                                                                        int]:
    if b is None:
        return None, 0
    if a is None or b.requests < a.requests:  # the API server restarted in the window
        return b, b.requests
    n = b.requests - a.requests
    out = dataclasses.replace(b, requests=n)
    ha, hb = a.context_histogram, b.context_histogram
    if ha is not None and hb is not None and ha.bounds == hb.bounds \
            and len(ha.counts) == len(hb.counts):
        counts = [max(0, y - x) for x, y in zip(ha.counts, hb.counts, strict=True)]
        out.context_histogram = ContextHistogram(bounds=list(hb.bounds), counts=counts)
        out.context_tokens = _quantiles(list(hb.bounds), counts)
    # Token sums subtract (mean x count): the window's mean and count; its quantiles stay the
    # end's (a quantile does not subtract).
    for name in ("prompt_tokens", "generation_tokens"):
        qa, qb = getattr(a, name), getattr(b, name)
        if qa.mean is not None and qb.mean is not None and qb.count >= qa.count:
            cnt = qb.count - qa.count
            total = max(0.0, qb.mean * qb.count - qa.mean * qa.count)
            setattr(out, name, dataclasses.replace(qb, count=cnt,
                                                   mean=total / cnt if cnt else None))
    if a.kv_pressure is not None and b.kv_pressure is not None:
        out.kv_pressure = _kv(a.kv_pressure, b.kv_pressure)
    ca, cb = a.context_buckets, b.context_buckets
    if cb is not None:  # per-bucket counters subtract like the histogram (else: dropped)
        out.context_buckets = None
        if ca is not None and ca.edges == cb.edges:
            out.context_buckets = dataclasses.replace(
                cb, requests=_sub(ca.requests, cb.requests) or [],
                kv_block_seconds=_sub(ca.kv_block_seconds, cb.kv_block_seconds) or [],
                prompt_tokens=_sub(ca.prompt_tokens, cb.prompt_tokens),
                decode_tokens=_sub(ca.decode_tokens, cb.decode_tokens))
    return out, n


def _kv_restarted(a: KvPressureStats, b: KvPressureStats) -> bool:
    """A running total went down: the API server (and its stat logger) restarted in between,
    whatever its request count says."""
    return (b.busy_seconds < a.busy_seconds or b.preemptions < a.preemptions
            or (len(a.usage_seconds) == len(b.usage_seconds)
                and any(y < x for x, y in zip(a.usage_seconds, b.usage_seconds, strict=True)))
            or (len(a.class_requests) == len(b.class_requests)
                and any(y < x for x, y in zip(a.class_requests, b.class_requests,
                                              strict=True))))


def _kv(a: KvPressureStats, b: KvPressureStats) -> KvPressureStats:
    """KV pressure inside the window: seconds, preemptions and block-seconds subtracted; the
    peak is the end's, capped by the highest usage bucket the window spent time in, and None
    when the window had no busy time (nothing ran: the lifetime peak is not the window's).
    After a restart the totals are the new server's, taken as they are."""
    if _kv_restarted(a, b):
        return dataclasses.replace(b)

    def sub(x: float, y: float) -> float:
        return max(0.0, y - x)

    out = dataclasses.replace(b)
    if a.usage_bounds == b.usage_bounds and len(a.usage_seconds) == len(b.usage_seconds):
        out.usage_seconds = [sub(x, y) for x, y in zip(a.usage_seconds, b.usage_seconds,
                                                       strict=True)]
        top = [bd for bd, t in zip(b.usage_bounds, out.usage_seconds, strict=False) if t > 0]
        out.peak = min(b.peak, top[-1]) if top and b.peak is not None else None
    for k in ("busy_seconds", "waiting_seconds", "waiting_kv_high_seconds",
              "saturated_seconds", "running_request_seconds"):
        setattr(out, k, sub(getattr(a, k), getattr(b, k)))
    if out.busy_seconds <= 0:
        out.peak = None
    out.preemptions = max(0, b.preemptions - a.preemptions)
    if a.class_names == b.class_names and len(a.class_requests) == len(b.class_requests):
        out.class_requests = [max(0, y - x) for x, y in zip(a.class_requests, b.class_requests,
                                                            strict=True)]
        out.class_block_seconds = [sub(x, y) for x, y in zip(a.class_block_seconds,
                                                             b.class_block_seconds, strict=True)]
    return out


def window_between(start: Snapshot, end: Snapshot) -> Snapshot:
    """``end`` with its counters reduced to what happened after ``start`` (see the module
    docstring for what is taken from ``end`` as is); ``window`` says which."""
    out = copy.copy(end)
    before = {(w.pid, w.process): w for w in start.workers}
    out.workers = [_worker(before.get((w.pid, w.process)), w) for w in end.workers]
    n_restarted = sum(1 for w in end.workers
                      if restarted(before.get((w.pid, w.process)), w))
    out.requests, n = _requests(start.requests, end.requests)
    out.kv_pressure = assess(out.requests)
    out.head_stats = None
    out.coverage = None  # the statistics' folds since the start are not in the snapshots
    notes = ["maxima, rates, prompt/generation quantiles and window advice are the end "
             "snapshot's (the KV peak is capped by the window's highest usage bucket)"]
    if out.requests is not None and out.requests.context_histogram is not None \
            and start.requests is not None:
        notes.append("context quantiles are bucket bounds of the window's histogram")
    if n_restarted:
        notes.append(f"{n_restarted} worker(s) started inside the window: counted from "
                     f"their start")
    if end.requests is not None and start.requests is not None \
            and end.requests.requests < start.requests.requests:
        notes.append("the API server restarted inside the window: requests counted from its "
                     "start")
    if any(0 < len(st.recent_time_s) < 6 for w in out.workers for lay in w.layers
           for st in lay.phases.values()):
        notes.append("few calls in the window: per-layer time tests have little to go on")
    out.window = RecordWindow(start=start.time, end=end.time,
                              duration_s=round(max(0.0, end.time - start.time), 3),
                              requests=n, note="; ".join(notes))
    return out
