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
from attnprof.exporters.catalog import spec

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

    name: str
    labels: Labels
    value: float


@dataclass(frozen=True, slots=True)
class HistogramSample:
    name: str
    labels: Labels
    state: HistogramState


MetricSample = Sample | HistogramSample
SampleSource = Callable[[], Iterable[MetricSample]]


def _labels(name: str, **labels: str) -> Labels:
    # Catalog order; a label the catalog does not declare is a bug, caught by tests.
    names = spec(name).labels
    return tuple((k, str(labels[k])) for k in names)


def s(name: str, value: float, **labels: str) -> Sample:
    return Sample(name, _labels(name, **labels), float(value))


def worker_samples(model: str, aggs: Any, sampler: Any, head_queries: int,
                   per_layer: bool = True, per_step: bool | None = None) -> list[MetricSample]:
    """Per-layer attention, step and sampler samples of one worker.

    ``aggs`` is an :class:`attnprof.aggregate.layers.WorkerAggregates`, ``sampler`` a
    :class:`attnprof.contracts.snapshot.SamplerStats`. ``per_layer=False`` (tensor-parallel
    ranks other than 0, which time the very same layers) leaves out the per-layer series
    and the head-statistics queries; ``per_step=False`` (default: ``per_layer``; also
    pipeline stages after the first, which see every step too) the per-step series, so
    sums over processes count each layer and step once.
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
            s("attnprof_attention_calls_total", calls, model=model, layer=lay, backend=backend,
              phase=phase),
            s("attnprof_attention_time_seconds_total", t, model=model, layer=lay,
              backend=backend, phase=phase),
            s("attnprof_attention_flops_total", flops, model=model, layer=lay, phase=phase),
            s("attnprof_attention_bytes_total", nbytes, model=model, layer=lay, phase=phase),
            s("attnprof_attention_tokens_total", tokens, model=model, layer=lay, phase=phase),
        ]
    for phase, model_t, attn_t in steps:
        out.append(s("attnprof_step_time_seconds_total", model_t, model=model, phase=phase))
        out.append(s("attnprof_step_attention_time_seconds_total", attn_t, model=model,
                     phase=phase))
    if per_step:  # every TP rank and PP stage sees every step
        for outcome in ("sampled", "sampled_long", "blind"):
            out.append(s("attnprof_steps_total", outcomes.get(outcome, 0), model=model,
                         outcome=outcome))
        out.append(s("attnprof_steps_total", sampler.unsampled, model=model,
                     outcome="unsampled"))
    out.append(s("attnprof_self_time_seconds_total", sampler.self_time_s, model=model))
    if per_layer:  # TP ranks fold the same queries (their own heads of them)
        out.append(s("attnprof_head_stats_queries_total", head_queries, model=model))
    out.append(s("attnprof_sample_rate_ratio", sampler.effective_rate, model=model))
    for info in infos:
        if per_layer:
            out.append(s("attnprof_layer_info", 1, model=model, layer=str(info.index),
                         backend=info.backend, impl=info.impl, fused=str(info.fused).lower()))
        # Every rank holds its own share of each layer's KV cache: summed (livesum).
        if info.kv_cache_bytes:
            out.append(s("attnprof_kv_cache_bytes", info.kv_cache_bytes, model=model,
                         layer=str(info.index)))
    return out


def request_samples(model: str, req: Any) -> list[MetricSample]:
    """Request histograms and KV-cache usage (``req``: ``RequestAggregates``)."""
    out: list[MetricSample] = []
    for q, state in req.histogram_states().items():
        name = f"attnprof_request_{q}_tokens"
        out.append(HistogramSample(name, _labels(name, model=model), state))
    out.append(s("attnprof_max_model_len_tokens", req.max_model_len, model=model))
    if req.kv_cache_usage is not None:
        out.append(s("attnprof_kv_cache_usage_ratio", req.kv_cache_usage, model=model))
    summary = req.summary(with_state=False)
    for q, summ in (("context", summary.context_tokens), ("prompt", summary.prompt_tokens),
                    ("generation", summary.generation_tokens)):
        for quant, v in (("0.5", summ.p50), ("0.9", summ.p90), ("0.99", summ.p99)):
            if v is not None:
                out.append(s("attnprof_request_tokens_quantile", v, model=model, quantity=q,
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
        s("attnprof_kv_cache_busy_seconds_total", st.busy_seconds, model=model),
        s("attnprof_kv_cache_above_90_seconds_total", a.above_90_seconds, model=model),
        s("attnprof_kv_preemptions_total", st.preemptions, model=model),
        s("attnprof_kv_waiting_seconds_total", st.waiting_kv_high_seconds, model=model,
          kv_usage="above_90"),
        s("attnprof_kv_waiting_seconds_total",
          max(0.0, st.waiting_seconds - st.waiting_kv_high_seconds), model=model,
          kv_usage="below_90"),
    ]
    if st.peak is not None:
        out.append(s("attnprof_kv_cache_usage_peak_ratio", st.peak, model=model))
    if a.p95 is not None:
        out.append(s("attnprof_kv_cache_usage_p95_ratio", a.p95, model=model))
    if a.capacity_tokens is not None:
        out.append(s("attnprof_kv_capacity_tokens", a.capacity_tokens, model=model))
    if st.kv_dtype:
        out.append(s("attnprof_kv_cache_dtype_info", 1.0, model=model, kv_dtype=st.kv_dtype))
    for name, bsec in zip(st.class_names, st.class_block_seconds, strict=False):
        out.append(s("attnprof_kv_block_seconds_total", bsec, model=model, length_class=name))
    for v in verdicts:
        out.append(s("attnprof_kv_verdict", 1.0 if v == a.verdict else 0.0, model=model,
                     verdict=v))
    for k, cap in a.capacity_sequences.items():
        out.append(s("attnprof_kv_capacity_sequences", cap, model=model, context=k))
    for lay in st.layers:
        out.append(s("attnprof_kv_bytes_per_token", lay.bytes_per_token, model=model,
                     layer=str(lay.layer)))
    for layer, b in head_bytes.items():
        out.append(s("attnprof_kv_head_bytes", b, model=model, layer=str(layer)))
    return out


def error_samples(model: str, errors: Mapping[str, int], dropped: Mapping[str, int],
                  roles: Iterable[str], tripped: Iterable[str] = (),
                  areas: Iterable[str] = ()) -> list[MetricSample]:
    """Self-observability of one process: errors by place, drops, its roles, and each
    breaker's state (``areas``: the ones this process runs; ``tripped``: those switched off)."""
    off = set(tripped)
    out: list[MetricSample] = [s("attnprof_internal_errors_total", n, model=model, place=p)
                               for p, n in list(errors.items())]
    out += [s("attnprof_capture_disabled", 1.0 if a in off else 0.0, model=model, place=a)
            for a in sorted(set(areas) | off)]
    out += [s("attnprof_dropped_samples_total", n, model=model, reason=r)
            for r, n in list(dropped.items())]
    out += [s("attnprof_plugin_processes", 1, role=r) for r in sorted(roles)]
    return out


def advice_samples(model: str, adv: Mapping[str, Any]) -> list[MetricSample]:
    """Window-advice gauges (nothing when the advice is an error)."""
    if "error" in adv:
        return []
    out: list[MetricSample] = [
        s("attnprof_window_recommended_tokens", adv["window"] if adv["layers"] else 0,
          model=model),
        s("attnprof_window_sinks_tokens", adv["sinks"], model=model),
        s("attnprof_window_layers", len(adv["layers"]), model=model),
        s("attnprof_window_attention_flop_saving_ratio", adv["attention_flop_saving"],
          model=model),
        s("attnprof_window_kv_memory_saving_ratio", adv["kv_memory_saving"], model=model),
        s("attnprof_window_exact_request_ratio", adv["exact_request_fraction"], model=model),
        s("attnprof_window_heads_at_risk", adv.get("heads_at_risk_count") or 0, model=model),
    ]
    for lay in adv.get("per_layer") or []:
        layer = str(lay["layer"])
        if lay.get("sink_mass") is not None:
            out.append(s("attnprof_head_sink_mass_ratio", lay["sink_mass"], model=model,
                         layer=layer))
        for w, c in (lay.get("coverage_q") or {}).items():
            if c is not None:
                out.append(s("attnprof_head_coverage_ratio", c, model=model, layer=layer,
                             window=str(w)))
        for cls, n in (lay.get("classes") or {}).items():
            out.append(s("attnprof_head_class_heads", n, model=model, layer=layer,
                         **{"class": cls}))
    return out


def roofline_samples(model: str, probe: Any, rl: Any) -> list[MetricSample]:
    """The probe's peaks and the roofline's headline ratios (``probe``: a
    :class:`attnprof.contracts.roofline.MemoryProbe`, ``rl``: a ``Roofline`` or None)."""
    if probe is None:
        return []
    out: list[MetricSample] = [
        s("attnprof_memory_bandwidth_peak_bytes_per_second", probe.bandwidth_bytes_per_second,
          model=model),
        s("attnprof_matmul_peak_flops_per_second", probe.matmul_flops_per_second, model=model)]
    if probe.spec is not None and probe.spec.bandwidth_ratio is not None:
        out.append(s("attnprof_memory_bandwidth_spec_ratio", probe.spec.bandwidth_ratio,
                     model=model))
    for phase, p in (rl.phases.items() if rl is not None else ()):
        if p.intensity_flops_per_byte is not None:
            out.append(s("attnprof_arithmetic_intensity_flops_per_byte",
                         p.intensity_flops_per_byte, model=model, phase=phase))
        if phase == "decode" and p.bandwidth_utilization is not None:
            out.append(s("attnprof_decode_attention_bandwidth_utilization_ratio",
                         p.bandwidth_utilization, model=model))
        if phase == "prefill" and p.compute_utilization is not None:
            out.append(s("attnprof_prefill_attention_compute_utilization_ratio",
                         p.compute_utilization, model=model))
    return out
