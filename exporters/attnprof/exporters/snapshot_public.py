"""The snapshot a server with no API key answers to anyone: what ``/metrics`` already shows,
plus operational facts it has no series for (processes' pids and names, the kernel map's
reasons, the sampler's, pulls' and probe's counters).

``GET /attnprof/snapshot`` where no key is configured gets this cut of the snapshot document,
rendered by the live view as a cached variant of its own.

An allow-list over the rendered document, not a deny-list: a field added to the contract
later stays out of this answer until it is named here
(``tests/unit/exporters/test_snapshot_public.py`` makes every new field a decision).

Kept: the model label, ``enabled``, processes and roles, per layer the static facts (its KV-
cache group too) and the counters ``/metrics`` exports (calls, time, tokens, FLOPs, bytes, KV-
cache bytes), the kernel map (with each group's KV spec, window, block size and bytes per
token: model facts), per-phase step totals, sampler (sampled steps by CUDA graph mode too) and
poll-cost counters, each worker's model runner (V1/V2, its vLLM class name, whether hooked),
error and drop counts by place, request counts, p50/p90/p99 and mean (``/metrics`` has the
quantile gauges and the histograms' sums and counts), the context-length histogram (the same
buckets as ``attnprof_request_context_tokens``), KV-pressure aggregates and verdict, probe and
roofline, the per-bucket request and KV block-second counts (``attnprof_context_bucket_*``) and
the head statistics' coverage and head stability (``attnprof_coverage_*``,
``attnprof_head_dynamic_*``, ``attnprof_head_class_kappa``): counts and shares. Withheld: the
per-bucket token sums (traffic's and folded), a lone request's exact length.

Withheld: the exact context lengths (the quantile sketch, which holds every finished
request's length while fewer than 2048 have finished, and each quantity's ``max``); per-layer
mean and max sequence lengths, mean batch sizes and the last calls' seconds (with one request
in a batch, one user's length and timing: why the trace route is closed by default); the
head statistics and the window-advice document built from them (its recommendation is on
``/metrics`` as ``attnprof_window_*``); the provenance (command line, paths, hashes); a
record's window; and every error's text (only its exception type stays).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["KEPT_WHOLE", "PUBLIC", "WITHHELD", "public_snapshot"]

Rule = Any
"""``True``: keep the value whole; a dict: keep only the keys it names, each by its rule;
a 1-tuple ``(rule,)``: a list or a str-keyed dict of values, each by ``rule``; a callable:
the value replaced by what it returns."""


def error_kind(text: Any) -> str | None:
    """The exception type that starts an error text (``"TimeoutError: ..."`` gives
    ``"TimeoutError"``; a name ending in Error, Exception, Warning or Exit), else ``"error"``:
    the message itself may quote a path, a URL, a length or a key (a one-word text is not
    taken for a type), so it stays behind the key."""
    if text is None:
        return None
    m = re.match(r"[A-Za-z_][\w.]{0,80}(?:Error|Exception|Warning|Exit)(?=:|$)", str(text))
    return m.group(0) if m else "error"


_QUANTILES = {k: True for k in ("p50", "p90", "p99", "mean", "count", "exact")}
_PHASE = {k: True for k in ("calls", "time_s", "mean_time_s", "tokens", "flops", "bytes")}
_LAYER_FACTS = ("name", "index", "backend", "impl", "num_heads", "num_kv_heads", "head_size",
                "head_size_v", "sliding_window", "dtype", "kv_cache_dtype", "fused",
                "kv_cache_bytes", "scale", "kernel", "has_sink", "attn_type", "kv_group")
_KERNEL_GROUP = {**{k: True for k in ("layers", "backend", "kernel", "fused", "valid_backends",
                                      "rejected", "source", "predicted",
                                      "flash_attn_version", "note", "kv_group", "kv_spec",
                                      "sliding_window", "kv_block_size",
                                      "kv_bytes_per_token")},
                 "error": error_kind}
_WORKER = {
    **{k: True for k in ("pid", "process", "steps", "sampler", "errors", "dropped", "disabled",
                         "head_stats_cost", "poll_cost", "probe", "runner")},
    "layers": ({**{k: True for k in _LAYER_FACTS}, "phases": (_PHASE,)},),
    "kernel_map": (_KERNEL_GROUP,),
    "error": error_kind,
}
_REQUESTS = {
    **{k: True for k in ("requests", "max_model_len", "kv_cache_usage", "context_histogram",
                         "kv_pressure")},
    "context_buckets": {k: True for k in ("edges", "min_tokens", "requests",
                                          "kv_block_seconds")},
    **{k: _QUANTILES for k in ("context_tokens", "prompt_tokens", "generation_tokens")},
}

PUBLIC: dict[str, Rule] = {
    **{k: True for k in ("schema_version", "time", "model", "enabled", "processes",
                         "roles_here", "age_s", "truncated", "kv_pressure", "roofline")},
    "coverage": {"min_tokens": True, "phases": True, "stability": True,
                 "buckets": ({k: True for k in ("phase", "bucket", "hi", "traffic_requests",
                                                "kv_share", "folded_requests",
                                                "sampled_queries", "request_share", "weight",
                                                "query_share")},)},
    "workers": (_WORKER,),
    "requests": _REQUESTS,
    "errors": {"api_server": True, "collective_rpc": error_kind},
}
"""What the answer without a key keeps, field by field (the rules above)."""

WITHHELD: dict[str, tuple[str, ...]] = {
    "Snapshot": ("head_stats", "provenance", "window", "window_advice", "restricted"),
    "WorkerSnapshot": ("head_stats",),
    "PhaseStats": ("mean_batch_requests", "mean_seq_len", "max_seq_len", "recent_time_s"),
    "QuantileSummary": ("max", "sketch"),
    "ContextBuckets": ("prompt_tokens", "decode_tokens"),
    "CoverageBucket": ("traffic_queries", "folded_queries"),
}
"""Fields left out on purpose, by contract class (``restricted`` and ``window_advice`` are
set anew by :func:`public_snapshot`)."""


KEPT_WHOLE: dict[str, tuple[str, ...]] = {
    "ContextHistogram": ("bounds", "counts"),
    "HeadStability": ("views", "kv_heads", "dynamic_kv_heads", "dynamic_share", "layers"),
    "LayerAgreement": ("layer", "kappa", "agreement", "rated_kv_heads", "dynamic_kv_heads"),
    "HeadStatsCost": ("steps", "requests", "queries", "time_s", "prefill_time_s",
        "fraction_of_prefill"),
    "KvAssessment": ("verdict", "confidence", "evidence", "busy_seconds", "peak", "p95",
        "above_90_seconds", "above_90_fraction", "preemptions", "waiting_fraction", "mean_running",
        "capacity_tokens", "capacity_sequences", "context_tokens", "class_share", "top_layers",
        "layer_share", "head_bytes_peak"),
    "KvLayer": ("layer", "num_heads", "num_kv_heads", "window", "bytes_per_token", "per_kv_head",
        "per_query_head"),
    "KvPressureStats": ("usage_bounds", "usage_seconds", "busy_seconds", "peak", "current",
        "preemptions", "waiting_seconds", "waiting_kv_high_seconds", "saturated_seconds",
        "running_request_seconds", "max_num_seqs", "block_size", "num_blocks", "kv_dtype", "layers",
        "class_names", "class_bounds", "class_requests", "class_block_seconds"),
    "PhaseCoverage": ("phase", "folded_requests", "traffic_requests", "traffic_query_share"),
    "MemoryProbe": ("device", "bandwidth_bytes_per_second", "matmul_flops_per_second", "kernels",
        "device_name", "threads", "seconds", "time", "spec", "note"),
    "PollCost": ("polls", "last_s", "max_s", "last_head_stats_s", "max_head_stats_s", "drain_s",
        "delta_bytes"),
    "ProbeKernel": ("name", "median", "low", "high", "runs", "size", "dtype"),
    "ProcessNote": ("role", "pid", "process", "started_at", "alive"),
    "Roofline": ("peak_bandwidth_bytes_per_second", "peak_flops_per_second",
        "ridge_flops_per_byte", "phases", "layers", "device", "note"),
    "RooflinePoint": ("phase", "calls", "time_s", "flops", "bytes", "kv_bytes",
        "intensity_flops_per_byte", "achieved_flops_per_second", "achieved_bytes_per_second",
        "kv_bytes_per_second", "bandwidth_utilization", "compute_utilization", "bound", "layer",
        "site"),
    "RunnerReport": ("runner", "runner_class", "hooked", "note"),
    "SamplerStats": ("seen", "sampled", "sampled_long", "blind", "unsampled", "base_rate",
        "effective_rate", "budget", "self_time_s", "self_time_fraction", "throttles", "step_index",
        "sync", "late_changes", "unsynced", "decisions_digest", "rate_changes", "graph_modes",
        "graph_steered"),
    "SpecCheck": ("part", "bandwidth_bytes_per_second", "flops_per_second", "source",
        "bandwidth_ratio", "flops_ratio"),
    "StepPhaseStats": ("steps", "model_time_s", "attention_time_s", "attention_share"),
}

"""Contract classes kept whole (a ``True`` rule over them, at any depth), with the fields
they have today: a field added to one of them later is a decision too (the test compares)."""


def _apply(value: Any, rule: Rule) -> Any:
    if rule is True or value is None:
        return value
    if callable(rule):
        fn: Callable[[Any], Any] = rule
        return fn(value)
    if isinstance(rule, tuple):
        (each,) = rule
        if isinstance(value, list):
            return [_apply(v, each) for v in value]
        if isinstance(value, dict):
            return {k: _apply(v, each) for k, v in value.items()}
        return None
    if isinstance(value, dict):
        return {k: _apply(value[k], r) for k, r in rule.items() if k in value}
    return None


def public_snapshot(doc: dict[str, Any], restricted: str) -> dict[str, Any]:
    """``doc`` (a rendered ``attnprof.snapshot``, as JSON) cut to what ``/metrics`` shows,
    with ``restricted`` saying how to read the rest; the window advice becomes an
    ``{"error": ...}`` pointing at its gauges. ``doc`` is not changed."""
    out: dict[str, Any] = _apply(doc, PUBLIC)
    if doc.get("window_advice") is not None:
        out["window_advice"] = {
            "error": "withheld without an API key (built from head statistics); the "
                     "recommendation is on /metrics as attnprof_window_*"}
    out["restricted"] = restricted
    return out
