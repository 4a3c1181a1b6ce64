"""The export boundary: aggregates in, catalog-named samples out.

Every exporter (Prometheus, OTLP) renders the same :class:`Sample` / :class:`HistogramSample`
lists, built here from the aggregate room's state. Counter samples carry running totals
(exporters turn them into increments or cumulative points), gauges the current value,
histograms a consistent bucket copy. Labels are the catalog's, nothing else: no request ids,
no text, no lengths as labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from attnprof.aggregate.histogram import HistogramState
from attnprof.exporters import catalog as cat
from attnprof.exporters.catalog import MetricSpec

__all__ = [
    "HistogramSample",
    "MetricSample",
    "Sample",
    "SampleSource",
    "advice_samples",
    "error_samples",
    "kv_samples",
    "request_samples",
    "roofline_samples",
    "worker_samples",
]

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """A counter's running total or a gauge's value for one label set."""

    metric: MetricSpec
    labels: Labels
    value: float

    @property
    def name(self) -> str:
        return self.metric.name


@dataclass(frozen=True, slots=True)
class HistogramSample:
    metric: MetricSpec
    labels: Labels
    state: HistogramState

    @property
    def name(self) -> str:
        return self.metric.name


MetricSample = Sample | HistogramSample
SampleSource = Callable[[], Iterable[MetricSample]]


def _labels(metric: MetricSpec, **labels: str) -> Labels:
    # Catalog order; a label the catalog does not declare is a bug, caught by tests.
    return tuple((k, str(labels[k])) for k in metric.labels)


def s(metric: MetricSpec, value: float, **labels: str) -> Sample:
    """A sample of a catalog metric (one of the :mod:`~attnprof.exporters.catalog`
    constants, never a name looked up here)."""
    return Sample(metric, _labels(metric, **labels), float(value))


def worker_samples(model: str, aggs: Any, sampler: Any, head_queries: int,
                   per_layer: bool = True, per_step: bool | None = None,
                   runner: Any = None) -> list[MetricSample]:
    """Per-layer attention, step and sampler samples of one worker.

    ``aggs`` is an :class:`attnprof.aggregate.layers.WorkerAggregates`, ``sampler`` a
    :class:`attnprof.contracts.snapshot.SamplerStats`. ``per_layer=False`` (tensor-parallel
    ranks other than 0, which time the very same layers) leaves out the per-layer series
    and the head-statistics queries; ``per_step=False`` (default: ``per_layer``; also
    pipeline stages after the first, which see every step too) the per-step series, so
    sums over processes count each layer and step once. ``runner``: the worker's
    :class:`~attnprof.contracts.snapshot.RunnerReport` (None until vLLM built its runner).
    """
    per_step = per_layer if per_step is None else per_step
    out: list[MetricSample] = []
    with aggs.lock:
        infos = list(aggs.layers.values())
        rows = [(idx, phase, a.calls, a.time_s, a.flops, a.bytes, a.tokens)
                for (idx, phase), a in aggs.agg.items()]
        steps = [(p, v[1], v[2]) for p, v in aggs.steps.items()]
        outcomes = dict(aggs.outcomes)
    if not per_layer:
        rows = []
    if not per_step:
        steps = []
    by_index = {i.index: i for i in infos}
    for idx, phase, calls, t, flops, nbytes, tokens in rows:
        info = by_index.get(idx)
        backend = info.backend if info else "unknown"
        lay = str(idx)
        out += [
            s(cat.ATTENTION_CALLS_TOTAL, calls, model=model, layer=lay, backend=backend,
              phase=phase),
            s(cat.ATTENTION_TIME_SECONDS_TOTAL, t, model=model, layer=lay,
              backend=backend, phase=phase),
            s(cat.ATTENTION_FLOPS_TOTAL, flops, model=model, layer=lay, phase=phase),
            s(cat.ATTENTION_BYTES_TOTAL, nbytes, model=model, layer=lay, phase=phase),
            s(cat.ATTENTION_TOKENS_TOTAL, tokens, model=model, layer=lay, phase=phase),
        ]
    for phase, model_t, attn_t in steps:
        out.append(s(cat.STEP_TIME_SECONDS_TOTAL, model_t, model=model, phase=phase))
        out.append(s(cat.STEP_ATTENTION_TIME_SECONDS_TOTAL, attn_t, model=model,
                     phase=phase))
    if per_step:  # every TP rank and PP stage sees every step
        for outcome in ("sampled", "sampled_long", "blind"):
            out.append(s(cat.STEPS_TOTAL, outcomes.get(outcome, 0), model=model,
                         outcome=outcome))
        out.append(s(cat.STEPS_TOTAL, sampler.unsampled, model=model,
                     outcome="unsampled"))
    out.append(s(cat.SELF_TIME_SECONDS_TOTAL, sampler.self_time_s, model=model))
    if per_layer:  # TP ranks fold the same queries (their own heads of them)
        out.append(s(cat.HEAD_STATS_QUERIES_TOTAL, head_queries, model=model))
    out.append(s(cat.SAMPLE_RATE_RATIO, sampler.effective_rate, model=model))
    if runner is not None:
        out.append(s(cat.RUNNER_INFO, 1, model=model, runner=runner.runner,
                     hooked=str(bool(runner.hooked)).lower()))
    for info in infos:
        if per_layer:
            out.append(s(cat.LAYER_INFO, 1, model=model, layer=str(info.index),
                         backend=info.backend, impl=info.impl, fused=str(info.fused).lower()))
        # Every rank holds its own share of each layer's KV cache: summed (livesum).
        if info.kv_cache_bytes:
            out.append(s(cat.KV_CACHE_BYTES, info.kv_cache_bytes, model=model,
                         layer=str(info.index)))
    return out


_REQUEST_HISTOGRAMS = {"context": cat.REQUEST_CONTEXT_TOKENS, "prompt": cat.REQUEST_PROMPT_TOKENS,
                       "generation": cat.REQUEST_GENERATION_TOKENS}


def request_samples(model: str, req: Any) -> list[MetricSample]:
    """Request histograms and KV-cache usage (``req``: ``RequestAggregates``)."""
    out: list[MetricSample] = []
    for q, state in req.histogram_states().items():
        metric = _REQUEST_HISTOGRAMS[q]
        out.append(HistogramSample(metric, _labels(metric, model=model), state))
    out.append(s(cat.MAX_MODEL_LEN_TOKENS, req.max_model_len, model=model))
    if req.kv_cache_usage is not None:
        out.append(s(cat.KV_CACHE_USAGE_RATIO, req.kv_cache_usage, model=model))
    summary = req.summary(with_state=False)
    for q, summ in (("context", summary.context_tokens), ("prompt", summary.prompt_tokens),
                    ("generation", summary.generation_tokens)):
        for quant, v in (("0.5", summ.p50), ("0.9", summ.p90), ("0.99", summ.p99)):
            if v is not None:
                out.append(s(cat.REQUEST_TOKENS_QUANTILE, v, model=model, quantity=q,
                             q=quant))
    return out


def kv_samples(model: str, st: Any, a: Any, head_bytes: Mapping[int, float],
               verdicts: Iterable[str]) -> list[MetricSample]:
    """KV-pressure samples: ``st`` a :class:`~attnprof.contracts.snapshot.KvPressureStats`
    (usage over time, preemptions, waiting, block-seconds by length class, bytes per layer),
    ``a`` its :class:`~attnprof.contracts.snapshot.KvAssessment` (verdict, p95, capacity),
    ``head_bytes`` the bytes each KV head of a layer holds now, ``verdicts`` every verdict
    (the current one is 1, the others 0)."""
    out: list[MetricSample] = [
        s(cat.KV_CACHE_BUSY_SECONDS_TOTAL, st.busy_seconds, model=model),
        s(cat.KV_CACHE_ABOVE_90_SECONDS_TOTAL, a.above_90_seconds, model=model),
        s(cat.KV_PREEMPTIONS_TOTAL, st.preemptions, model=model),
        s(cat.KV_WAITING_SECONDS_TOTAL, st.waiting_kv_high_seconds, model=model,
          kv_usage="above_90"),
        s(cat.KV_WAITING_SECONDS_TOTAL,
          max(0.0, st.waiting_seconds - st.waiting_kv_high_seconds), model=model,
          kv_usage="below_90"),
    ]
    if st.peak is not None:
        out.append(s(cat.KV_CACHE_USAGE_PEAK_RATIO, st.peak, model=model))
    if a.p95 is not None:
        out.append(s(cat.KV_CACHE_USAGE_P95_RATIO, a.p95, model=model))
    if a.capacity_tokens is not None:
        out.append(s(cat.KV_CAPACITY_TOKENS, a.capacity_tokens, model=model))
    if st.kv_dtype:
        out.append(s(cat.KV_CACHE_DTYPE_INFO, 1.0, model=model, kv_dtype=st.kv_dtype))
    for name, bsec in zip(st.class_names, st.class_block_seconds, strict=False):
        out.append(s(cat.KV_BLOCK_SECONDS_TOTAL, bsec, model=model, length_class=name))
    for v in verdicts:
        out.append(s(cat.KV_VERDICT, 1.0 if v == a.verdict else 0.0, model=model,
                     verdict=v))
    for k, cap in a.capacity_sequences.items():
        out.append(s(cat.KV_CAPACITY_SEQUENCES, cap, model=model, context=k))
    for lay in st.layers:
        out.append(s(cat.KV_BYTES_PER_TOKEN, lay.bytes_per_token, model=model,
                     layer=str(lay.layer)))
    for layer, b in head_bytes.items():
        out.append(s(cat.KV_HEAD_BYTES, b, model=model, layer=str(layer)))
    return out


def error_samples(model: str, errors: Mapping[str, int], dropped: Mapping[str, int],
                  roles: Iterable[str], tripped: Iterable[str] = (),
                  areas: Iterable[str] = ()) -> list[MetricSample]:
    """Self-observability of one process: errors by place, drops, its roles, and each
    breaker's state (``areas``: the ones this process runs; ``tripped``: those switched off)."""
    off = set(tripped)
    out: list[MetricSample] = [s(cat.INTERNAL_ERRORS_TOTAL, n, model=model, place=p)
                               for p, n in list(errors.items())]
    out += [s(cat.CAPTURE_DISABLED, 1.0 if a in off else 0.0, model=model, place=a)
            for a in sorted(set(areas) | off)]
    out += [s(cat.DROPPED_SAMPLES_TOTAL, n, model=model, reason=r)
            for r, n in list(dropped.items())]
    out += [s(cat.PLUGIN_PROCESSES, 1, role=r) for r in sorted(roles)]
    return out


def advice_samples(model: str, adv: Mapping[str, Any]) -> list[MetricSample]:
    """Window-advice gauges (nothing when the advice is an error)."""
    if "error" in adv:
        return []
    out: list[MetricSample] = [
        s(cat.WINDOW_RECOMMENDED_TOKENS, adv["window"] if adv["layers"] else 0,
          model=model),
        s(cat.WINDOW_SINKS_TOKENS, adv["sinks"], model=model),
        s(cat.WINDOW_LAYERS, len(adv["layers"]), model=model),
        s(cat.WINDOW_ATTENTION_FLOP_SAVING_RATIO, adv["attention_flop_saving"],
          model=model),
        s(cat.WINDOW_KV_MEMORY_SAVING_RATIO, adv["kv_memory_saving"], model=model),
        s(cat.WINDOW_EXACT_REQUEST_RATIO, adv["exact_request_fraction"], model=model),
        s(cat.WINDOW_HEADS_AT_RISK, adv.get("heads_at_risk_count") or 0, model=model),
    ]
    for lay in adv.get("per_layer") or []:
        layer = str(lay["layer"])
        if lay.get("sink_mass") is not None:
            out.append(s(cat.HEAD_SINK_MASS_RATIO, lay["sink_mass"], model=model,
                         layer=layer))
        for w, c in (lay.get("coverage_q") or {}).items():
            if c is not None:
                out.append(s(cat.HEAD_COVERAGE_RATIO, c, model=model, layer=layer,
                             window=str(w)))
        for cls, n in (lay.get("classes") or {}).items():
            out.append(s(cat.HEAD_CLASS_HEADS, n, model=model, layer=layer,
                         **{"class": cls}))
    return out


def context_bucket_samples(model: str, cb: Any) -> list[MetricSample]:
    """Per-bucket traffic counters: requests and KV block-seconds (``cb``: a
    :class:`~attnprof.contracts.snapshot.ContextBuckets`, or None)."""
    if cb is None:
        return []
    out: list[MetricSample] = []
    for i, lo in enumerate(cb.edges):
        b = str(lo)
        # counts and block-seconds only: a bucket's token sum is a lone request's length
        out += [s(cat.CONTEXT_BUCKET_REQUESTS_TOTAL, cb.requests[i], model=model, bucket=b),
                s(cat.CONTEXT_BUCKET_KV_BLOCK_SECONDS_TOTAL, cb.kv_block_seconds[i],
                  model=model, bucket=b)]
    return out


def coverage_samples(model: str, cov: Mapping[str, Any] | None,
                     adv: Mapping[str, Any] | None) -> list[MetricSample]:
    """Coverage gauges from the snapshot's coverage section (``Coverage.to_json()``) and the
    window advice's (``WindowAdvice.to_json()``; either may be None)."""
    out: list[MetricSample] = []
    for row in (cov or {}).get("buckets") or []:
        lab = {"model": model, "phase": str(row["phase"]), "bucket": str(row["bucket"])}
        out.append(s(cat.COVERAGE_FOLDED_REQUESTS, row["folded_requests"], **lab))
        if row.get("query_share") is not None:
            out.append(s(cat.COVERAGE_QUERY_SHARE_RATIO, row["query_share"], **lab))
    for ph in (cov or {}).get("phases") or []:
        if ph.get("traffic_query_share") is not None:
            out.append(s(cat.COVERAGE_TRAFFIC_SHARE_RATIO, ph["traffic_query_share"],
                         model=model, phase=str(ph["phase"])))
    stab = (cov or {}).get("stability")
    if stab:
        out += [s(cat.HEAD_DYNAMIC_KV_HEADS, stab["dynamic_kv_heads"], model=model),
                s(cat.HEAD_DYNAMIC_RATIO, stab["dynamic_share"], model=model)]
        for lay in stab.get("layers") or []:
            if lay.get("kappa") is not None:
                out.append(s(cat.HEAD_CLASS_KAPPA, lay["kappa"], model=model,
                             layer=str(lay["layer"])))
    # 0 once an advice with coverage stands (no bucket short of traffic), not absent: an
    # alert or panel then tells "advice stands" from "no advice yet" (absent).
    adv_cov = (adv or {}).get("coverage")
    if isinstance(adv_cov, Mapping) and "error" not in (adv or {}):
        need = adv_cov.get("need_more_traffic_above")
        out.append(s(cat.WINDOW_NEED_MORE_TRAFFIC_TOKENS, need or 0, model=model))
    return out


def roofline_samples(model: str, probe: Any, rl: Any) -> list[MetricSample]:
    """The probe's peaks and the roofline's headline ratios (``probe``: a
    :class:`attnprof.contracts.roofline.MemoryProbe`, ``rl``: a ``Roofline`` or None)."""
    if probe is None:
        return []
    out: list[MetricSample] = [
        s(cat.MEMORY_BANDWIDTH_PEAK_BYTES_PER_SECOND, probe.bandwidth_bytes_per_second,
          model=model),
        s(cat.MATMUL_PEAK_FLOPS_PER_SECOND, probe.matmul_flops_per_second, model=model)]
    if probe.spec is not None and probe.spec.bandwidth_ratio is not None:
        out.append(s(cat.MEMORY_BANDWIDTH_SPEC_RATIO, probe.spec.bandwidth_ratio,
                     model=model))
    for phase, p in (rl.phases.items() if rl is not None else ()):
        if p.intensity_flops_per_byte is not None:
            out.append(s(cat.ARITHMETIC_INTENSITY_FLOPS_PER_BYTE,
                         p.intensity_flops_per_byte, model=model, phase=phase))
        if phase == "decode" and p.bandwidth_utilization is not None:
            out.append(s(cat.DECODE_ATTENTION_BANDWIDTH_UTILIZATION_RATIO,
                         p.bandwidth_utilization, model=model))
        if phase == "prefill" and p.compute_utilization is not None:
            out.append(s(cat.PREFILL_ATTENTION_COMPUTE_UTILIZATION_RATIO,
                         p.compute_utilization, model=model))
    return out
