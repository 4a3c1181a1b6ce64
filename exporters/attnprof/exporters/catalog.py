"""The one catalog of attnprof metric names.

Every exporter, dashboard and alert rule takes names from here; tests check that every
metric queried in ``grafana/`` and ``deploy/`` exists in this catalog. Prometheus names
are ``attnprof_`` snake_case with base units; counters end in ``_total``. Labels are
bounded: model, layer index, backend, phase, and a few small enums. Never request ids,
lengths or text.

Each metric is a module constant (``ATTENTION_CALLS_TOTAL``), built once at import: code on
hot paths (building samples every flush, exporting them per collection) holds these objects
and never looks a name up; :func:`spec` is for tests and tools that start from a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CATALOG", "MetricSpec", "markdown_table", "spec"]

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, eq=False)
class MetricSpec:
    """One metric of the catalog. Compared and hashed by identity (each is built once), so
    a dict keyed by it costs a pointer hash, not a hash of every field, per sample."""

    name: str
    """Prometheus name as exposed (counters include ``_total``)."""
    kind: Kind
    help: str
    unit: str
    """Base unit: seconds, bytes, tokens, ratio, flops, steps, ..."""
    labels: tuple[str, ...] = ()
    multiprocess_mode: str = "livemostrecent"
    """For gauges under PROMETHEUS_MULTIPROC_DIR. Always a ``live*`` mode: a dead process's
    gauge files are removed (:meth:`PrometheusSink.sweep_dead`), so its last values stop
    counting, where ``max``/``mostrecent`` would keep them for ever."""

    @property
    def base_name(self) -> str:
        """Name given to prometheus_client (it appends ``_total`` to counters itself)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    @property
    def otel_name(self) -> str:
        """Dotted OpenTelemetry instrument name (units go in ``unit=``, not the name)."""
        n = self.base_name.removeprefix("attnprof_")
        for suffix in ("_seconds", "_bytes", "_tokens", "_ratio", "_flops"):
            # Keep the word when it is the quantity itself (attention_flops, attention_bytes):
            # stripping it would collapse distinct metrics into one name.
            if n.endswith(suffix) and "_" in n.removesuffix(suffix):
                n = n.removesuffix(suffix)
                break
        return "attnprof." + n.replace("_", ".")

    @property
    def otel_unit(self) -> str:
        """UCUM unit for OpenTelemetry (``s``, ``By``, ``1``, annotations like ``{token}``)."""
        return _UCUM[self.unit]


# Catalog unit -> UCUM. Counted things are dimensionless annotations ({token}); a unit missing
# here is a KeyError in tests, never a silent guess.
_UCUM = {
    "seconds": "s", "bytes": "By", "ratio": "1", "info": "1", "tokens": "{token}",
    "flops": "{flop}", "calls": "{call}", "steps": "{step}", "queries": "{query}",
    "heads": "{head}", "layers": "{layer}", "errors": "{error}", "samples": "{sample}",
    "processes": "{process}", "requests": "{request}", "sequences": "{sequence}",
    "block_seconds": "{block}.s", "bytes_per_second": "By/s", "flops_per_second": "{flop}/s",
    "flops_per_byte": "{flop}/By",
}


_M = "model"
# --- request-level context lengths (API server, stat logger) ---
REQUEST_CONTEXT_TOKENS = MetricSpec("attnprof_request_context_tokens", "histogram",
    "Final context length (prompt + generated tokens) of finished requests.",
    "tokens", (_M,))
REQUEST_PROMPT_TOKENS = MetricSpec("attnprof_request_prompt_tokens", "histogram",
    "Prompt tokens of finished requests.", "tokens", (_M,))
REQUEST_GENERATION_TOKENS = MetricSpec("attnprof_request_generation_tokens", "histogram",
    "Generated tokens of finished requests.", "tokens", (_M,))
# The level is label "q", not "quantile": Prometheus reserves "quantile" for summaries
# (promtool check metrics refuses it on a gauge).
REQUEST_TOKENS_QUANTILE = MetricSpec("attnprof_request_tokens_quantile", "gauge",
    "p50/p90/p99 (label q: 0.5, 0.9, 0.99) of finished requests' context, prompt "
    "and generated tokens, by the one quantile estimator (the same numbers as the "
    "snapshot, CLI and window advice).", "tokens", (_M, "quantity", "q"),
    "livemostrecent")
MAX_MODEL_LEN_TOKENS = MetricSpec("attnprof_max_model_len_tokens", "gauge",
    "The server's max_model_len (what the context-length distribution is read "
    "against; attnprof report).", "tokens", (_M,), "livemostrecent")
KV_CACHE_USAGE_RATIO = MetricSpec("attnprof_kv_cache_usage_ratio", "gauge",
    "KV-cache blocks in use, 0..1 (from vLLM's scheduler stats).", "ratio", (_M,),
    "livemostrecent")
# --- KV-cache pressure over time (API server, stat logger; docs/kv-pressure.md) ---
KV_CACHE_USAGE_PEAK_RATIO = MetricSpec("attnprof_kv_cache_usage_peak_ratio", "gauge",
    "Highest KV-cache usage seen, 0..1 (every stats batch, not a scrape sample).",
    "ratio", (_M,), "livemostrecent")
KV_CACHE_USAGE_P95_RATIO = MetricSpec("attnprof_kv_cache_usage_p95_ratio", "gauge",
    "p95 of KV-cache usage over busy time (time-weighted; a bucket's upper edge).",
    "ratio", (_M,), "livemostrecent")
KV_CACHE_BUSY_SECONDS_TOTAL = MetricSpec("attnprof_kv_cache_busy_seconds_total", "counter",
    "Seconds with at least one request running or waiting (the denominator of "
    "the time-weighted KV figures).", "seconds", (_M,))
KV_CACHE_ABOVE_90_SECONDS_TOTAL = MetricSpec("attnprof_kv_cache_above_90_seconds_total", "counter",
    "Busy seconds with KV-cache usage above 90%.", "seconds", (_M,))
KV_PREEMPTIONS_TOTAL = MetricSpec("attnprof_kv_preemptions_total", "counter",
    "Requests preempted by vLLM (their KV freed for lack of blocks); the same count "
    "as vllm:num_preemptions.", "requests", (_M,))
KV_WAITING_SECONDS_TOTAL = MetricSpec("attnprof_kv_waiting_seconds_total", "counter",
    "Busy seconds with requests waiting for capacity, by KV usage at the time "
    "(kv_usage: above_90, below_90).", "seconds", (_M, "kv_usage"))
KV_BLOCK_SECONDS_TOTAL = MetricSpec("attnprof_kv_block_seconds_total", "counter",
    "Estimated KV block-seconds held by finished requests, by context-length class "
    "(short <= 512, medium <= 2048, long).", "block_seconds", (_M, "length_class"))
KV_VERDICT = MetricSpec("attnprof_kv_verdict", "gauge",
    "1 for the current verdict (kv_bound, compute_bound, neither), 0 for the others; "
    "the evidence and its confidence are in the snapshot.", "info", (_M, "verdict"),
    "livemostrecent")
KV_CAPACITY_SEQUENCES = MetricSpec("attnprof_kv_capacity_sequences", "gauge",
    "Maximum concurrent sequences the KV cache holds at the observed p50 and p99 "
    "context (label context), windowed layers honoured.", "sequences",
    (_M, "context"), "livemostrecent")
KV_CAPACITY_TOKENS = MetricSpec("attnprof_kv_capacity_tokens", "gauge",
    "Tokens the KV cache holds in full-attention layers (usable blocks x block "
    "size).", "tokens", (_M,), "livemostrecent")
KV_CACHE_DTYPE_INFO = MetricSpec("attnprof_kv_cache_dtype_info", "gauge",
    "1, labelled with the KV cache's dtype (what an FP8 what-if starts from).",
    "info", (_M, "kv_dtype"), "livemostrecent")
KV_BYTES_PER_TOKEN = MetricSpec("attnprof_kv_bytes_per_token", "gauge",
    "KV-cache bytes one token costs in each layer, in the KV dtype.", "bytes",
    (_M, "layer"), "livemostrecent")
KV_HEAD_BYTES = MetricSpec("attnprof_kv_head_bytes", "gauge",
    "KV-cache bytes each KV head of a layer holds now (its query-head group shares "
    "them), windows honoured.", "bytes", (_M, "layer"), "livemostrecent")
# --- per-layer attention capture (worker, sampled steps) ---
LAYER_INFO = MetricSpec("attnprof_layer_info", "gauge",
    "1 per attention layer: backend, implementation class and whether it is fused.",
    "info", (_M, "layer", "backend", "impl", "fused"), "livemax")
RUNNER_INFO = MetricSpec("attnprof_runner_info", "gauge",
    "1 per vLLM model runner the workers run: which one (v1, v2, unknown) and whether "
    "attnprof hooks its steps (hooked=\"false\": nothing is sampled or timed there).",
    "info", (_M, "runner", "hooked"), "livemax")
ATTENTION_CALLS_TOTAL = MetricSpec("attnprof_attention_calls_total", "counter",
    "Attention calls captured on sampled steps.", "calls",
    (_M, "layer", "backend", "phase"))
ATTENTION_TIME_SECONDS_TOTAL = MetricSpec("attnprof_attention_time_seconds_total", "counter",
    "Attention time on sampled steps.", "seconds", (_M, "layer", "backend", "phase"))
ATTENTION_FLOPS_TOTAL = MetricSpec("attnprof_attention_flops_total", "counter",
    "Analytic attention FLOPs (2*Hq*(D+Dv) per query-key pair) on sampled steps.",
    "flops", (_M, "layer", "phase"))
ATTENTION_BYTES_TOTAL = MetricSpec("attnprof_attention_bytes_total", "counter",
    "Analytic bytes moved by attention (Q, K, V read, O written) on sampled steps.",
    "bytes", (_M, "layer", "phase"))
ATTENTION_TOKENS_TOTAL = MetricSpec("attnprof_attention_tokens_total", "counter",
    "Query tokens processed by attention on sampled steps.", "tokens",
    (_M, "layer", "phase"))
STEP_TIME_SECONDS_TOTAL = MetricSpec("attnprof_step_time_seconds_total", "counter",
    "Model forward time of sampled steps (denominator of attention's share).",
    "seconds", (_M, "phase"))
STEP_ATTENTION_TIME_SECONDS_TOTAL = MetricSpec(
    "attnprof_step_attention_time_seconds_total", "counter",
    "Attention time of sampled steps summed over layers.", "seconds", (_M, "phase"))
KV_CACHE_BYTES = MetricSpec("attnprof_kv_cache_bytes", "gauge",
    "KV-cache bytes allocated per attention layer.", "bytes", (_M, "layer"), "livesum")
# --- head statistics and window advice (API server, from workers' sampled prefills) ---
HEAD_STATS_QUERIES_TOTAL = MetricSpec("attnprof_head_stats_queries_total", "counter",
    "Sampled queries folded into the per-head attention statistics.", "queries",
    (_M,))
HEAD_SINK_MASS_RATIO = MetricSpec("attnprof_head_sink_mass_ratio", "gauge",
    "Mean attention mass on the first sink tokens, per layer (sampled prefills).",
    "ratio", (_M, "layer"), "livemostrecent")
HEAD_COVERAGE_RATIO = MetricSpec("attnprof_head_coverage_ratio", "gauge",
    "Low-quantile coverage C(sinks, window) of the worst KV head, per layer and "
    "grid window.", "ratio", (_M, "layer", "window"), "livemostrecent")
HEAD_CLASS_HEADS = MetricSpec("attnprof_head_class_heads", "gauge",
    "KV heads per class (sink, streaming, local, retrieval, near_uniform, unknown, "
    "dynamic), "
    "per layer.", "heads", (_M, "layer", "class"), "livemostrecent")
WINDOW_RECOMMENDED_TOKENS = MetricSpec("attnprof_window_recommended_tokens", "gauge",
    "Recommended sliding window for the observed traffic (0: keep full attention).",
    "tokens", (_M,), "livemostrecent")
WINDOW_SINKS_TOKENS = MetricSpec("attnprof_window_sinks_tokens", "gauge",
    "Sink tokens kept with the recommended window.", "tokens", (_M,), "livemostrecent")
WINDOW_LAYERS = MetricSpec("attnprof_window_layers", "gauge",
    "Layers the recommended window applies to.", "layers", (_M,), "livemostrecent")
WINDOW_ATTENTION_FLOP_SAVING_RATIO = MetricSpec(
    "attnprof_window_attention_flop_saving_ratio", "gauge",
    "Attention-FLOP saving of the recommendation, cost-weighted over the traffic.",
    "ratio", (_M,), "livemostrecent")
WINDOW_KV_MEMORY_SAVING_RATIO = MetricSpec("attnprof_window_kv_memory_saving_ratio", "gauge",
    "KV-memory saving of the recommendation, cost-weighted over the traffic.",
    "ratio", (_M,), "livemostrecent")
WINDOW_EXACT_REQUEST_RATIO = MetricSpec("attnprof_window_exact_request_ratio", "gauge",
    "Share of requests short enough to stay exact under the recommendation.",
    "ratio", (_M,), "livemostrecent")
WINDOW_HEADS_AT_RISK = MetricSpec("attnprof_window_heads_at_risk", "gauge",
    "KV heads whose coverage is below target at the recommended window.", "heads",
    (_M,), "livemostrecent")
# --- coverage per context bucket (API server: stat logger counters, live view's table) ---
CONTEXT_BUCKET_REQUESTS_TOTAL = MetricSpec("attnprof_context_bucket_requests_total", "counter",
    "Finished requests by the head-statistics context bucket of their prompt (label bucket: "
    "its lower edge in tokens; 0: prompts under ATTNPROF_HEAD_STATS_MIN_TOKENS).",
    "requests", (_M, "bucket"))
CONTEXT_BUCKET_KV_BLOCK_SECONDS_TOTAL = MetricSpec(
    "attnprof_context_bucket_kv_block_seconds_total", "counter",
    "Estimated KV block-seconds of finished requests by the context they held them at "
    "(the prompt over its prefill time, the growing context over its decode time).",
    "block_seconds", (_M, "bucket"))
COVERAGE_FOLDED_REQUESTS = MetricSpec("attnprof_coverage_folded_requests", "gauge",
    "Requests the head statistics folded, by phase and context bucket (against "
    "attnprof_context_bucket_requests_total: the coverage).", "requests",
    (_M, "phase", "bucket"), "livemostrecent")
COVERAGE_QUERY_SHARE_RATIO = MetricSpec("attnprof_coverage_query_share_ratio", "gauge",
    "Share of the traffic's query tokens in a phase and context bucket that the head "
    "statistics' folded requests stand for (their sample's weights; token sums are not "
    "exported: in a bucket of one request they are its length).", "ratio",
    (_M, "phase", "bucket"), "livemostrecent")
COVERAGE_TRAFFIC_SHARE_RATIO = MetricSpec("attnprof_coverage_traffic_share_ratio", "gauge",
    "Share of the phase's query tokens in context buckets that have head statistics: what "
    "the traffic-weighted (post-stratified) window advice stands on.", "ratio",
    (_M, "phase"), "livemostrecent")
WINDOW_NEED_MORE_TRAFFIC_TOKENS = MetricSpec("attnprof_window_need_more_traffic_tokens",
    "gauge", "Set when a context bucket holding >= 10% of the KV block-seconds cannot decide "
    "the window (its sampling error straddles the target): the advice windows nothing and "
    "needs more traffic above this many tokens (0 when the advice stands; absent before any "
    "advice with coverage).", "tokens", (_M,),
    "livemostrecent")
HEAD_DYNAMIC_KV_HEADS = MetricSpec("attnprof_head_dynamic_kv_heads", "gauge",
    "KV heads whose class changes across time windows or context buckets (dynamic: kept "
    "full, no window).", "heads", (_M,), "livemostrecent")
HEAD_DYNAMIC_RATIO = MetricSpec("attnprof_head_dynamic_ratio", "gauge",
    "Share of KV heads that are dynamic.", "ratio", (_M,), "livemostrecent")
HEAD_CLASS_KAPPA = MetricSpec("attnprof_head_class_kappa", "gauge",
    "Fleiss' kappa of a layer's KV-head classes across time windows and context buckets "
    "(1: stable, 0: chance agreement; absent when undefined).", "ratio", (_M, "layer"),
    "livemostrecent")
# --- roofline (worker, ATTNPROF_PROBE=1: probed once after start-up) ---
MEMORY_BANDWIDTH_PEAK_BYTES_PER_SECOND = MetricSpec(
    "attnprof_memory_bandwidth_peak_bytes_per_second", "gauge",
    "Peak memory bandwidth the start-up probe measured (a read-only stream).",
    "bytes_per_second", (_M,), "livemostrecent")
MATMUL_PEAK_FLOPS_PER_SECOND = MetricSpec("attnprof_matmul_peak_flops_per_second", "gauge",
    "Square-GEMM FLOP/s the start-up probe measured in the model's dtype.",
    "flops_per_second", (_M,), "livemostrecent")
MEMORY_BANDWIDTH_SPEC_RATIO = MetricSpec("attnprof_memory_bandwidth_spec_ratio", "gauge",
    "Probed bandwidth over the GPU datasheet's (absent for parts not in the table).",
    "ratio", (_M,), "livemostrecent")
DECODE_ATTENTION_BANDWIDTH_UTILIZATION_RATIO = MetricSpec(
    "attnprof_decode_attention_bandwidth_utilization_ratio", "gauge",
    "Decode attention's KV bytes read per second over the probed peak bandwidth "
    "(sampled steps, all layers).", "ratio", (_M,), "livemostrecent")
PREFILL_ATTENTION_COMPUTE_UTILIZATION_RATIO = MetricSpec(
    "attnprof_prefill_attention_compute_utilization_ratio", "gauge",
    "Prefill attention's analytic FLOP/s over the probed matmul peak (sampled "
    "steps, all layers).", "ratio", (_M,), "livemostrecent")
ARITHMETIC_INTENSITY_FLOPS_PER_BYTE = MetricSpec(
    "attnprof_arithmetic_intensity_flops_per_byte", "gauge",
    "Attention's analytic FLOPs per byte moved, by phase (its place on the "
    "roofline; the ridge is matmul peak / peak bandwidth).", "flops_per_byte",
    (_M, "phase"), "livemostrecent")
# --- self-observability ---
STEPS_TOTAL = MetricSpec("attnprof_steps_total", "counter",
    "Model steps seen by attnprof, by outcome (sampled, sampled_long, unsampled, "
    "blind: replayed as a full CUDA graph, invisible to Python).", "steps",
    (_M, "outcome"))
SELF_TIME_SECONDS_TOTAL = MetricSpec("attnprof_self_time_seconds_total", "counter",
    "attnprof's own time spent on sampled steps.", "seconds", (_M,))
SAMPLE_RATE_RATIO = MetricSpec("attnprof_sample_rate_ratio", "gauge",
    "Effective step sample rate after the overhead budget.", "ratio", (_M,),
    "livemostrecent")
INTERNAL_ERRORS_TOTAL = MetricSpec("attnprof_internal_errors_total", "counter",
    "Internal errors, counted and dropped (never raised into vLLM).", "errors",
    (_M, "place"))
DROPPED_SAMPLES_TOTAL = MetricSpec("attnprof_dropped_samples_total", "counter",
    "Samples dropped, by reason.", "samples", (_M, "reason"))
OTLP_EXPORT_FAILURES_TOTAL = MetricSpec("attnprof_otlp_export_failures_total", "counter",
    "OTLP metric exports that failed (endpoint down, refusing or slow); counted, "
    "never raised.", "errors", ())
CAPTURE_DISABLED = MetricSpec("attnprof_capture_disabled", "gauge",
    "1 where attnprof switched itself off after ATTNPROF_MAX_ERRORS internal errors, "
    "by place (capture, stat_logger, endpoint, advice, export); 0 while running.",
    "info", (_M, "place"), "livemax")
PLUGIN_PROCESSES = MetricSpec("attnprof_plugin_processes", "gauge",
    "Processes the attnprof plugin is live in, by role.", "processes", ("role",),
    "livesum")

CATALOG: tuple[MetricSpec, ...] = (
    REQUEST_CONTEXT_TOKENS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_TOKENS_QUANTILE,
    MAX_MODEL_LEN_TOKENS,
    KV_CACHE_USAGE_RATIO,
    KV_CACHE_USAGE_PEAK_RATIO,
    KV_CACHE_USAGE_P95_RATIO,
    KV_CACHE_BUSY_SECONDS_TOTAL,
    KV_CACHE_ABOVE_90_SECONDS_TOTAL,
    KV_PREEMPTIONS_TOTAL,
    KV_WAITING_SECONDS_TOTAL,
    KV_BLOCK_SECONDS_TOTAL,
    KV_VERDICT,
    KV_CAPACITY_SEQUENCES,
    KV_CAPACITY_TOKENS,
    KV_CACHE_DTYPE_INFO,
    KV_BYTES_PER_TOKEN,
    KV_HEAD_BYTES,
    LAYER_INFO,
    RUNNER_INFO,
    ATTENTION_CALLS_TOTAL,
    ATTENTION_TIME_SECONDS_TOTAL,
    ATTENTION_FLOPS_TOTAL,
    ATTENTION_BYTES_TOTAL,
    ATTENTION_TOKENS_TOTAL,
    STEP_TIME_SECONDS_TOTAL,
    STEP_ATTENTION_TIME_SECONDS_TOTAL,
    KV_CACHE_BYTES,
    HEAD_STATS_QUERIES_TOTAL,
    HEAD_SINK_MASS_RATIO,
    HEAD_COVERAGE_RATIO,
    HEAD_CLASS_HEADS,
    WINDOW_RECOMMENDED_TOKENS,
    WINDOW_SINKS_TOKENS,
    WINDOW_LAYERS,
    WINDOW_ATTENTION_FLOP_SAVING_RATIO,
    WINDOW_KV_MEMORY_SAVING_RATIO,
    WINDOW_EXACT_REQUEST_RATIO,
    WINDOW_HEADS_AT_RISK,
    CONTEXT_BUCKET_REQUESTS_TOTAL,
    CONTEXT_BUCKET_KV_BLOCK_SECONDS_TOTAL,
    COVERAGE_FOLDED_REQUESTS,
    COVERAGE_QUERY_SHARE_RATIO,
    COVERAGE_TRAFFIC_SHARE_RATIO,
    WINDOW_NEED_MORE_TRAFFIC_TOKENS,
    HEAD_DYNAMIC_KV_HEADS,
    HEAD_DYNAMIC_RATIO,
    HEAD_CLASS_KAPPA,
    MEMORY_BANDWIDTH_PEAK_BYTES_PER_SECOND,
    MATMUL_PEAK_FLOPS_PER_SECOND,
    MEMORY_BANDWIDTH_SPEC_RATIO,
    DECODE_ATTENTION_BANDWIDTH_UTILIZATION_RATIO,
    PREFILL_ATTENTION_COMPUTE_UTILIZATION_RATIO,
    ARITHMETIC_INTENSITY_FLOPS_PER_BYTE,
    STEPS_TOTAL,
    SELF_TIME_SECONDS_TOTAL,
    SAMPLE_RATE_RATIO,
    INTERNAL_ERRORS_TOTAL,
    DROPPED_SAMPLES_TOTAL,
    OTLP_EXPORT_FAILURES_TOTAL,
    CAPTURE_DISABLED,
    PLUGIN_PROCESSES,
)

_BY_NAME = {m.name: m for m in CATALOG}


def spec(name: str) -> MetricSpec:
    """Look a metric up by its exposed Prometheus name."""
    return _BY_NAME[name]


def markdown_table() -> str:
    """The metric reference table in docs/metrics.md (checked by a test)."""
    rows = ["| metric | OpenTelemetry name | type | unit | OTel unit | labels | meaning |",
            "|---|---|---|---|---|---|---|"]
    for m in CATALOG:
        rows.append(f"| `{m.name}` | `{m.otel_name}` | {m.kind} | {m.unit} | `{m.otel_unit}` "
                    f"| {', '.join(m.labels) or '-'} | {m.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
