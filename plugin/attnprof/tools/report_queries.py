"""The PromQL behind ``attnprof report --prometheus`` and its recording rules (one list).

Each query is a template with two holes: ``{sel}``, the label matchers inside a selector's
braces (``model="m"`` or empty), and ``{r}``, the range (``24h``; ``5m`` in the recording
rules). ``grafana/generate.py`` writes ``grafana/recording/attnprof-report-rules.yaml`` from
this list (a test checks the committed file is current and promtool-tests it), so a Thanos or
Mimir fleet can downsample what the report reads. Three ratios in the list are not read by
the report, which divides its own totals over the range instead: ``gpu_hours_per_mtok`` (the
dashboard's Cost row), ``attention_share`` and ``kv_above_90_ratio`` (recording rules only).
Pure data: no I/O.

Totals (requests, tokens) are counter differences over the range, not ``increase()``:
``increase`` extrapolates to the range's edges, and a fleet report's totals must equal the sum
of each replica's own ``/metrics``. A series younger than the range counts from zero (the
counter started there); a replica restarted inside the range is undercounted by what it had
before the restart (documented in docs/report.md). Ratios divide by ``(... > 0)``: an idle
model records no sample rather than NaN or +Inf, which would skew a downsampled average.
``workers`` assumes one model per scrape target (vLLM serves one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["QUERIES", "ReportQuery", "by_name", "render", "render_since_start", "total"]


@dataclass(frozen=True)
class ReportQuery:
    name: str
    """Key the report reads the answer under."""
    expr: str
    """PromQL with ``{sel}`` and ``{r}`` holes."""
    help: str
    record: str | None = None
    """Recording-rule name (``level:metric:operations``); None: not worth a rule (a total
    over the report's own range, or a per-layer breakdown)."""


def total(metric: str, by: str = "model", hole: str = "sel") -> str:
    """Exact counter difference over ``{r}`` summed ``by`` (a series younger than the range
    counts from zero; a reset inside the range counts from zero too, never negative).
    ``+ 0`` drops the metric name so ``or`` matches on labels only."""
    m = metric + "{{{" + hole + "}}}"
    return f"sum by ({by}) (clamp_min({m} - {m} offset {{r}}, 0) or ({m} + 0))"


# Worker processes (one per GPU) per model: plugin_processes has no model label, so each
# target's count is joined to the model that target serves.
_WORKERS = ("sum by (model) (sum by (instance) (attnprof_plugin_processes{{role=\"worker\"}})"
            " * on (instance) group_left (model) (count by (model, instance) "
            "(attnprof_request_context_tokens_count{{{sel}}}) * 0 + 1))")
_TOKEN_RATE = ("sum by (model) (rate(attnprof_request_prompt_tokens_sum{{{sel}}}[{r}]))"
               " + sum by (model) (rate(attnprof_request_generation_tokens_sum{{{sel}}}[{r}]))")

QUERIES: tuple[ReportQuery, ...] = (
    # --- traffic ---
    ReportQuery("requests_total", total("attnprof_request_context_tokens_count"),
                "Finished requests in the range."),
    ReportQuery("prompt_tokens_total", total("attnprof_request_prompt_tokens_sum"),
                "Prompt tokens of finished requests in the range."),
    ReportQuery("generation_tokens_total", total("attnprof_request_generation_tokens_sum"),
                "Generated tokens of finished requests in the range."),
    ReportQuery("context_tokens_total", total("attnprof_request_context_tokens_sum"),
                "Context tokens of finished requests in the range (mean = this / requests)."),
    ReportQuery("context_buckets", total("attnprof_request_context_tokens_bucket",
                                         "model, le"),
                "Context-length histogram of finished requests in the range (cumulative)."),
    ReportQuery("request_rate",
                "sum by (model) (rate(attnprof_request_context_tokens_count{{{sel}}}[{r}]))",
                "Finished requests per second.", "model:attnprof_requests:rate5m"),
    ReportQuery("token_rate", _TOKEN_RATE,
                "Prompt + generated tokens per second of finished requests.",
                "model:attnprof_tokens:rate5m"),
    ReportQuery("max_model_len", "max by (model) (attnprof_max_model_len_tokens{{{sel}}})",
                "The servers' max_model_len.", "model:attnprof_max_model_len_tokens:max"),
    ReportQuery("replicas",
                "count by (model) (count by (model, instance) "
                "(attnprof_request_context_tokens_count{{{sel}}}))",
                "Replicas (scrape targets) serving the model.", "model:attnprof_replicas:count"),
    ReportQuery("workers", _WORKERS,
                "Model-runner workers (one per GPU) serving the model.",
                "model:attnprof_workers:count"),
    ReportQuery("gpu_hours_per_mtok", f"({_WORKERS} / 3600) / (({_TOKEN_RATE}) / 1e6 > 0)",
                "GPU-hours (worker-hours) per million tokens at the current rate.",
                "model:attnprof_gpu_hours_per_mtok:rate5m"),
    # --- where time goes ---
    ReportQuery("attention_share",
                "sum by (model, phase) (rate(attnprof_step_attention_time_seconds_total"
                "{{{sel}}}[{r}])) / (sum by (model, phase) "
                "(rate(attnprof_step_time_seconds_total{{{sel}}}[{r}])) > 0)",
                "Attention's share of sampled model time, by phase.",
                "model_phase:attnprof_attention_share:ratio_rate5m"),
    ReportQuery("step_time", total("attnprof_step_time_seconds_total", "model, phase"),
                "Sampled model time by phase in the range."),
    ReportQuery("step_attention_time",
                total("attnprof_step_attention_time_seconds_total", "model, phase"),
                "Sampled attention time by phase in the range (the report's share: this over "
                "step_time)."),
    ReportQuery("attention_time_backend",
                total("attnprof_attention_time_seconds_total", "model, backend, phase"),
                "Sampled attention time by backend and phase in the range."),
    ReportQuery("attention_time_layer",
                total("attnprof_attention_time_seconds_total", "model, layer"),
                "Sampled attention time per layer in the range."),
    ReportQuery("layer_info",
                "max by (model, layer, backend, impl, fused) (attnprof_layer_info{{{sel}}})",
                "Backend of each attention layer and whether it is fused."),
    # --- KV memory ---
    ReportQuery("kv_bytes_per_token",
                "max by (model) (sum by (model, instance) (attnprof_kv_bytes_per_token{{{sel}}}))",
                "KV-cache bytes one token costs (all layers).",
                "model:attnprof_kv_bytes_per_token:sum"),
    ReportQuery("kv_dtype", "max by (model, kv_dtype) (attnprof_kv_cache_dtype_info{{{sel}}})",
                "The KV cache's dtype."),
    ReportQuery("kv_capacity_tokens",
                "sum by (model) (attnprof_kv_capacity_tokens{{{sel}}})",
                "KV-cache capacity in tokens, summed over replicas.",
                "model:attnprof_kv_capacity_tokens:sum"),
    ReportQuery("kv_capacity_sequences",
                "sum by (model, context) (attnprof_kv_capacity_sequences{{{sel}}})",
                "Concurrent sequences the replicas' KV caches hold at the p50/p99 context.",
                "model_context:attnprof_kv_capacity_sequences:sum"),
    ReportQuery("kv_usage_peak",
                "max by (model) (max_over_time(attnprof_kv_cache_usage_ratio{{{sel}}}[{r}]))",
                "Highest KV-cache usage any replica reported at a scrape.",
                "model:attnprof_kv_cache_usage:max5m"),
    ReportQuery("kv_held_peak_tokens",
                "max by (model) (max_over_time((sum by (model) ("
                "attnprof_kv_cache_usage_ratio{{{sel}}} * attnprof_kv_capacity_tokens{{{sel}}}"
                "))[{r}:]))",
                "KV tokens the fleet held at its busiest moment: each replica's usage x its "
                "capacity, summed over replicas at every evaluation step, then the maximum "
                "(the replicas' own peaks need not coincide)."),
    ReportQuery("kv_usage_p95",
                "max by (model) (quantile_over_time(0.95, "
                "attnprof_kv_cache_usage_ratio{{{sel}}}[{r}]))",
                "p95 of scraped KV-cache usage (worst replica).",
                "model:attnprof_kv_cache_usage:p95_5m"),
    ReportQuery("kv_busy_seconds", total("attnprof_kv_cache_busy_seconds_total"),
                "Busy seconds (requests running or waiting) in the range."),
    ReportQuery("kv_above_90_seconds", total("attnprof_kv_cache_above_90_seconds_total"),
                "Busy seconds above 90% KV usage in the range."),
    ReportQuery("kv_above_90_ratio",
                "sum by (model) (rate(attnprof_kv_cache_above_90_seconds_total{{{sel}}}[{r}]))"
                " / (sum by (model) (rate(attnprof_kv_cache_busy_seconds_total{{{sel}}}[{r}]))"
                " > 0)",
                "Share of busy time above 90% KV usage.",
                "model:attnprof_kv_above_90:ratio_rate5m"),
    ReportQuery("kv_preemptions", total("attnprof_kv_preemptions_total"),
                "Requests preempted for KV capacity in the range."),
    ReportQuery("kv_waiting_seconds", total("attnprof_kv_waiting_seconds_total"),
                "Busy seconds with requests waiting for capacity in the range."),
    ReportQuery("kv_verdict", "max by (model, verdict) (attnprof_kv_verdict{{{sel}}}) == 1",
                "KV-bound, compute-bound or neither (any replica's current verdict).",
                "model_verdict:attnprof_kv_verdict:max"),
    # vLLM's own series (label model_name), read when Prometheus has them.
    ReportQuery("vllm_preemptions", total("vllm:num_preemptions_total", "model_name", "vsel"),
                "vLLM's own preemption count in the range."),
    ReportQuery("vllm_running_peak",
                "sum by (model_name) (max_over_time(vllm:num_requests_running{{{vsel}}}[{r}]))",
                "Peak running requests (sum of each replica's peak: an upper bound)."),
    # --- window advice (the servers' live recommendation) ---
    ReportQuery("window_tokens", "max by (model) (attnprof_window_recommended_tokens{{{sel}}})",
                "Recommended sliding window (0: keep full attention)."),
    ReportQuery("window_sinks", "max by (model) (attnprof_window_sinks_tokens{{{sel}}})",
                "Sink tokens kept with the window."),
    ReportQuery("window_layers", "max by (model) (attnprof_window_layers{{{sel}}})",
                "Layers the window applies to."),
    ReportQuery("window_flop_saving",
                "min by (model) (attnprof_window_attention_flop_saving_ratio{{{sel}}})",
                "Attention-FLOP saving of the recommendation (most conservative replica).",
                "model:attnprof_window_flop_saving:min"),
    ReportQuery("window_kv_saving",
                "min by (model) (attnprof_window_kv_memory_saving_ratio{{{sel}}})",
                "KV-memory saving of the recommendation (most conservative replica).",
                "model:attnprof_window_kv_saving:min"),
    ReportQuery("window_exact_ratio",
                "min by (model) (attnprof_window_exact_request_ratio{{{sel}}})",
                "Share of requests the recommendation leaves exact."),
    ReportQuery("window_heads_at_risk",
                "max by (model) (attnprof_window_heads_at_risk{{{sel}}})",
                "KV heads below the coverage target at the recommended window."),
)

_BY_NAME = {q.name: q for q in QUERIES}


def by_name(name: str) -> ReportQuery:
    return _BY_NAME[name]


def render(q: ReportQuery, sel: str = "", r: str = "5m", vsel: str = "") -> str:
    """The query with its holes filled: ``sel`` attnprof's matchers (``model="m"``), ``vsel``
    vLLM's (``model_name="m"``), ``r`` the range."""
    return q.expr.format(sel=sel, r=r, vsel=vsel)


_TOTAL = re.compile(r"clamp_min\((?P<m>[^ ]+) - (?P=m) offset \{r\}, 0\) or \((?P=m) \+ 0\)")


def render_since_start(q: ReportQuery, sel: str = "", vsel: str = "") -> str:
    """A total as counted since each server started (the counter itself: what each replica's
    /metrics shows), for a report over all the data there is; other queries as
    :func:`render` over ``5m``."""
    return _TOTAL.sub(lambda m: m.group("m"), q.expr).format(sel=sel, r="5m", vsel=vsel)
