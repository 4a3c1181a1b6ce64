"""Generate grafana/dashboards/attnprof.json and grafana/recording/attnprof-report-rules.yaml
(pure Python, stdlib only, plus attnprof's pure query list).

    python grafana/generate.py          # rewrite both committed files
    python grafana/generate.py --check  # exit 1 if either committed file is stale

Metric names come from the catalog (``attnprof.exporters.catalog``); a test checks that every
name queried here exists there and that the committed files equal this script's output.
Panel ids are fixed in the panel list below, so they stay stable when panels move. The
recording rules and the Cost row come from ``attnprof.tools.report_queries``, the one list
``attnprof report --prometheus`` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# The checkout's own query list, so a bare `python3 grafana/generate.py` works (no install).
_PLUGIN = str(Path(__file__).resolve().parents[1] / "plugin")
if _PLUGIN not in sys.path:
    sys.path.insert(0, _PLUGIN)
from attnprof.tools import report_queries as rq  # noqa: E402

OUT = Path(__file__).resolve().parent / "dashboards" / "attnprof.json"
RULES_OUT = Path(__file__).resolve().parent / "recording" / "attnprof-report-rules.yaml"
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
RI = "$__rate_interval"

Json = dict[str, Any]


def target(expr: str, ref: str = "A", legend: str = "", *, instant: bool = False,
           fmt: str = "time_series") -> Json:
    t: Json = {"datasource": DS, "expr": expr, "refId": ref, "format": fmt,
               "legendFormat": legend or "__auto", "range": not instant, "instant": instant}
    return t


def panel(pid: int, title: str, kind: str, unit: str, targets: list[Json], *,
          description: str = "", w: int = 12, h: int = 8, options: Json | None = None,
          custom: Json | None = None, minmax: tuple[float | None, float | None] = (None, None),
          transformations: list[Json] | None = None) -> Json:
    defaults: Json = {"unit": unit}
    if minmax[0] is not None:
        defaults["min"] = minmax[0]
    if minmax[1] is not None:
        defaults["max"] = minmax[1]
    if custom:
        defaults["custom"] = custom
    p: Json = {
        "id": pid, "type": kind, "title": title, "description": description,
        "datasource": DS, "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options or {},
        "gridPos": {"w": w, "h": h},
    }
    if transformations:
        p["transformations"] = transformations
    return p


def timeseries(pid: int, title: str, unit: str, targets: list[Json], **kw: Any) -> Json:
    kw.setdefault("options", {"legend": {"showLegend": True, "displayMode": "list",
                                         "placement": "bottom"},
                              "tooltip": {"mode": "multi", "sort": "desc"}})
    return panel(pid, title, "timeseries", unit, targets, **kw)


def stat(pid: int, title: str, unit: str, expr: str, description: str) -> Json:
    return panel(pid, title, "stat", unit, [target(expr, legend="{{model}}")],
                 description=description, w=6, h=4,
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                            "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto"})


def report(name: str) -> str:
    """A report query as the dashboard runs it: filtered by $model, over the rate interval
    (the raw expression, so the panel works without the recording rules loaded)."""
    return rq.render(rq.by_name(name), sel=M, r=RI)


def table(pid: int, title: str, expr: str, description: str, columns: list[str]) -> Json:
    keep = {c: True for c in columns}
    return panel(pid, title, "table", "short",
                 [target(expr, instant=True, fmt="table")], description=description,
                 options={"showHeader": True, "cellHeight": "sm"},
                 transformations=[{"id": "filterFieldsByName",
                                   "options": {"include": {"names": columns}}},
                                  {"id": "organize", "options": {"indexByName": {
                                      c: i for i, c in enumerate(keep)}}}])


def heatmap(pid: int, title: str, unit: str, expr: str, description: str) -> Json:
    return panel(pid, title, "heatmap", unit,
                 [target(expr, legend="{{le}}", fmt="heatmap")], description=description,
                 options={"calculate": False, "cellGap": 1,
                          "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                          "yAxis": {"unit": unit}, "tooltip": {"show": True, "yHistogram": True},
                          "rowsFrame": {"layout": "auto"}})


def row(pid: int, title: str) -> Json:
    return {"id": pid, "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"w": 24, "h": 1}}


def ratio(num: str, den: str) -> str:
    """``a / (b > 0)``: no NaN/Inf when the denominator is zero."""
    return f"{num}\n  / ({den} > 0)"


def per_call(phase: str) -> str:
    sel = f'{M}, phase="{phase}"'
    return ratio(f"sum by (layer) (rate(attnprof_attention_time_seconds_total{{{sel}}}[{RI}]))",
                 f"sum by (layer) (rate(attnprof_attention_calls_total{{{sel}}}[{RI}]))")


def quantile(q: float) -> str:
    return (f"histogram_quantile({q}, sum by (le) "
            f"(rate(attnprof_request_context_tokens_bucket{{{M}}}[{RI}])))")


BLIND = ratio(f'sum(rate(attnprof_steps_total{{{M}, outcome="blind"}}[{RI}]))',
              f'sum(rate(attnprof_steps_total{{{M}, outcome=~"sampled|sampled_long|blind"}}'
              f"[{RI}]))")


def panels() -> list[Json]:
    return [
        row(111, "Cost"),
        stat(80, "GPU-hours per million tokens", "short", report("gpu_hours_per_mtok"),
             "Model-runner workers (one per GPU) x 1 h over the millions of tokens (prompt + "
             "generated, finished requests) served in that hour at the current rate; what "
             "attnprof report calls cost per token."),
        panel(81, "KV-bound vs compute-bound", "stat", "short",
              [target(report("kv_verdict"), legend="{{model}}: {{verdict}}", instant=True)],
              description="Current KV verdict per model (any replica's; rules: "
                          "docs/kv-pressure.md). KV-bound: buy KV memory (fp8 KV, a window, "
                          "more GPUs); compute-bound: KV savings will not raise throughput.",
              w=6, h=4, options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                                   "values": False},
                                 "colorMode": "none", "graphMode": "none", "textMode": "name"}),
        timeseries(82, "Window savings", "percentunit", [
            target(report("window_flop_saving"), "A", "attention FLOP {{model}}"),
            target(report("window_kv_saving"), "B", "KV memory {{model}}")],
            description="Attention-FLOP and KV-memory saving of the recommended sliding "
                        "window, cost-weighted over the traffic (most conservative replica).",
            minmax=(0, 1)),
        row(100, "Attention time"),
        timeseries(1, "Attention share of model time by phase", "percentunit", [target(ratio(
            f"sum by (phase) (rate(attnprof_step_attention_time_seconds_total{{{M}}}[{RI}]))",
            f"sum by (phase) (rate(attnprof_step_time_seconds_total{{{M}}}[{RI}]))"),
            legend="{{phase}}")],
            description="Attention time / model forward time on sampled steps.",
            w=24, minmax=(0, 1)),
        timeseries(2, "Mean attention time per call by layer (decode)", "s",
                   [target(per_call("decode"), legend="layer {{layer}}")],
                   description="Attention seconds / attention calls, decode steps."),
        timeseries(3, "Mean attention time per call by layer (prefill)", "s",
                   [target(per_call("prefill"), legend="layer {{layer}}")],
                   description="Attention seconds / attention calls, prefill steps."),
        row(101, "Kernels"),
        table(4, "Layers not on a fused kernel",
              f'attnprof_layer_info{{{M}, fused="false"}}',
              "Layers whose attention runs unfused (e.g. a fallback path); should be empty.",
              ["model", "layer", "backend", "impl", "fused"]),
        table(5, "Attention backend per layer",
              f"max by (model, layer, backend, impl, fused) (attnprof_layer_info{{{M}}})",
              "Backend, implementation class and fused flag of every attention layer.",
              ["model", "layer", "backend", "impl", "fused"]),
        row(102, "Context lengths"),
        timeseries(6, "Context length p50 / p90 / p99", "short", [
            target(quantile(0.5), "A", "p50"), target(quantile(0.9), "B", "p90"),
            target(quantile(0.99), "C", "p99")],
            description="Final context (prompt + generated tokens) of finished requests."),
        heatmap(7, "Context length distribution", "short",
                f"sum by (le) (rate(attnprof_request_context_tokens_bucket{{{M}}}[{RI}]))",
                "Finished requests per second by context-length bucket (tokens)."),
        row(103, "KV cache"),
        timeseries(8, "KV-cache usage", "percentunit",
                   [target(f"attnprof_kv_cache_usage_ratio{{{M}}}", legend="{{model}}")],
                   description="KV-cache blocks in use (vLLM scheduler stats).", minmax=(0, 1)),
        timeseries(9, "KV-cache bytes per layer", "bytes",
                   [target(f"sum by (layer) (attnprof_kv_cache_bytes{{{M}}})",
                           legend="layer {{layer}}")],
                   description="KV-cache bytes allocated per attention layer."),
        table(40, "KV verdict", f"attnprof_kv_verdict{{{M}}} == 1",
              "KV-bound, compute-bound or neither (rules: docs/kv-pressure.md); the evidence "
              "is in GET /attnprof/snapshot and attnprof snapshot.", ["model", "verdict"]),
        timeseries(41, "KV-cache usage peak and p95", "percentunit", [
            target(f"attnprof_kv_cache_usage_peak_ratio{{{M}}}", "A", "peak {{model}}"),
            target(f"attnprof_kv_cache_usage_p95_ratio{{{M}}}", "B", "p95 {{model}}")],
            description="Highest usage seen (every scheduler stats batch) and the p95 of "
                        "usage over busy time, since the server started.", minmax=(0, 1)),
        timeseries(42, "Busy time with KV above 90%", "percentunit", [target(ratio(
            f"sum(rate(attnprof_kv_cache_above_90_seconds_total{{{M}}}[{RI}]))",
            f"sum(rate(attnprof_kv_cache_busy_seconds_total{{{M}}}[{RI}]))"), legend="above 90%")],
            description="Share of busy time (a request running or waiting) with KV usage "
                        "above 90%; 10% or more is KV-bound.", minmax=(0, 1)),
        timeseries(43, "Preemptions", "ops",
                   [target(f"sum(rate(attnprof_kv_preemptions_total{{{M}}}[{RI}]))",
                           legend="preemptions/s")],
                   description="Requests preempted per second for lack of KV blocks "
                               "(vLLM's num_preempted_reqs)."),
        timeseries(44, "Waiting for capacity", "percentunit", [
            target(ratio(f'sum(rate(attnprof_kv_waiting_seconds_total{{{M}, '
                         f'kv_usage="above_90"}}[{RI}]))',
                         f"sum(rate(attnprof_kv_cache_busy_seconds_total{{{M}}}[{RI}]))"),
                   "A", "KV above 90%"),
            target(ratio(f'sum(rate(attnprof_kv_waiting_seconds_total{{{M}, '
                         f'kv_usage="below_90"}}[{RI}]))',
                         f"sum(rate(attnprof_kv_cache_busy_seconds_total{{{M}}}[{RI}]))"),
                   "B", "KV below 90%")],
            description="Share of busy time with requests waiting, by KV usage: waiting at "
                        "high KV is KV-bound, waiting at low KV is compute-bound.",
            minmax=(0, 1)),
        timeseries(45, "KV block-seconds by request length", "short", [target(
            f"sum by (length_class) (rate(attnprof_kv_block_seconds_total{{{M}}}[{RI}]))",
            legend="{{length_class}}")],
            description="KV block-seconds per second of finished requests by context-length "
                        "class (short <= 512, medium <= 2048, long), stacked as shares.",
            custom={"stacking": {"mode": "percent", "group": "A"}, "fillOpacity": 60}),
        timeseries(46, "Max concurrent sequences at p50 / p99 context", "short",
                   [target(f"max by (context) (attnprof_kv_capacity_sequences{{{M}}})",
                           legend="{{context}} context")],
                   description="KV capacity (vLLM's blocks x block size) over one sequence's KV "
                               "at the observed context, windowed layers honoured."),
        timeseries(47, "KV bytes held per KV head by layer", "bytes",
                   [target(f"max by (layer) (attnprof_kv_head_bytes{{{M}}})",
                           legend="layer {{layer}}")],
                   description="Live KV bytes each KV head of a layer holds (its query-head "
                               "group shares them); full-attention layers hold the most."),
        timeseries(48, "KV bytes per token by layer", "bytes",
                   [target(f"max by (layer) (attnprof_kv_bytes_per_token{{{M}}})",
                           legend="layer {{layer}}")],
                   description="KV-cache bytes one token costs in each layer, in the KV dtype."),
        row(110, "Roofline (ATTNPROF_PROBE=1)"),
        timeseries(70, "Attention utilisation of the probed peaks", "percentunit", [
            target(f"max(attnprof_decode_attention_bandwidth_utilization_ratio{{{M}}})",
                   "A", "decode: KV bytes/s of peak bandwidth"),
            target(f"max(attnprof_prefill_attention_compute_utilization_ratio{{{M}}})",
                   "B", "prefill: FLOP/s of matmul peak")],
            description="Decode attention's KV read rate over the probed memory bandwidth, "
                        "and prefill attention's FLOP/s over the probed matmul peak "
                        "(sampled steps, all layers; docs/roofline.md)."),
        timeseries(71, "Arithmetic intensity by phase", "short",
                   [target(f"max by (phase) (attnprof_arithmetic_intensity_flops_per_byte"
                           f"{{{M}}})", legend="{{phase}}")],
                   description="Attention FLOPs per byte moved: below the ridge (matmul peak "
                               "/ bandwidth) a phase is memory-bound."),
        stat(72, "Probed peak bandwidth", "Bps",
             f"max(attnprof_memory_bandwidth_peak_bytes_per_second{{{M}}})",
             "Memory bandwidth the worker's start-up probe measured (a read-only stream)."),
        stat(73, "Probed matmul peak", "short",
             f"max(attnprof_matmul_peak_flops_per_second{{{M}}})",
             "Square-GEMM FLOP/s in the model's dtype, measured by the start-up probe."),
        row(104, "Window advice"),
        stat(10, "Recommended window", "short",
             f"attnprof_window_recommended_tokens{{{M}}}",
             "Recommended sliding window in tokens (0: keep full attention)."),
        stat(11, "Sink tokens", "short", f"attnprof_window_sinks_tokens{{{M}}}",
             "Sink tokens kept with the recommended window."),
        stat(12, "Layers windowed", "short", f"attnprof_window_layers{{{M}}}",
             "Layers the recommended window applies to."),
        stat(13, "KV heads at risk", "short", f"attnprof_window_heads_at_risk{{{M}}}",
             "KV heads whose coverage is below target at the recommended window."),
        stat(14, "Attention-FLOP saving", "percentunit",
             f"attnprof_window_attention_flop_saving_ratio{{{M}}}",
             "Attention-FLOP saving of the recommendation, cost-weighted over the traffic."),
        stat(15, "KV-memory saving", "percentunit",
             f"attnprof_window_kv_memory_saving_ratio{{{M}}}",
             "KV-memory saving of the recommendation, cost-weighted over the traffic."),
        stat(16, "Requests exact under window", "percentunit",
             f"attnprof_window_exact_request_ratio{{{M}}}",
             "Share of requests short enough to stay exact under the recommendation."),
        stat(17, "Head-stat queries / s", "short",
             f"sum(rate(attnprof_head_stats_queries_total{{{M}}}[{RI}]))",
             "Sampled queries folded into the per-head statistics per second."),
        timeseries(18, "Sink mass per layer", "percentunit",
                   [target(f"max by (layer) (attnprof_head_sink_mass_ratio{{{M}}})",
                           legend="layer {{layer}}")],
                   description="Mean attention mass on the first sink tokens (sampled prefills).",
                   minmax=(0, 1)),
        timeseries(19, "Worst-head coverage per layer and window", "percentunit",
                   [target(f"min by (layer, window) (attnprof_head_coverage_ratio{{{M}}})",
                           legend="layer {{layer}} window {{window}}")],
                   description="Low-quantile coverage C(sinks, window) of the worst KV head.",
                   minmax=(0, 1)),
        timeseries(20, "KV heads per class", "short",
                   [target(f"sum by (class) (attnprof_head_class_heads{{{M}}})",
                           legend="{{class}}")],
                   description="KV heads per attention class, summed over layers.", w=24),
        stat(90, "Advice stands on", "percentunit",
             f'attnprof_coverage_traffic_share_ratio{{{M},phase="prefill"}}',
             "Share of the traffic's prompt tokens in context buckets that have head "
             "statistics: what the traffic-weighted window advice represents."),
        stat(91, "Need more traffic above", "short",
             f"attnprof_window_need_more_traffic_tokens{{{M}}}",
             "Set when a context bucket holding >= 10% of the KV block-seconds cannot decide "
             "the window: the advice windows nothing until traffic above this many tokens is "
             "sampled (0: the advice stands; empty: no advice yet)."),
        stat(92, "Dynamic KV heads", "percentunit", f"attnprof_head_dynamic_ratio{{{M}}}",
             "Share of KV heads whose class changes across time windows or context buckets "
             "(kept full, no window)."),
        timeseries(93, "Head-statistics coverage by context bucket", "percentunit",
                   [target(f'sum by (bucket) (attnprof_coverage_folded_requests{{{M},'
                           f'phase="prefill"}}) / (sum by (bucket) '
                           f"(attnprof_context_bucket_requests_total{{{M}}}) > 0)",
                           legend="prompts >= {{bucket}} tokens")],
                   description="Requests the head statistics folded over finished requests, "
                               "per prompt-length bucket (bucket 0: under the statistics' "
                               "minimum). A bucket near 0 is advised on without evidence.",
                   minmax=(0, None)),
        timeseries(94, "KV block-seconds by context bucket", "short",
                   [target(f"sum by (bucket) (rate(attnprof_context_bucket_kv_block_seconds_total"
                           f"{{{M}}}[{RI}]))", legend="{{bucket}}+ tokens")],
                   description="Where the KV cache is spent, by context: the buckets the "
                               "advice must be covered in."),
        row(105, "attnprof self-observability"),
        timeseries(21, "Steps by outcome", "ops",
                   [target(f"sum by (outcome) (rate(attnprof_steps_total{{{M}}}[{RI}]))",
                           legend="{{outcome}}")],
                   description="Model steps per second seen by attnprof, by outcome."),
        timeseries(22, "Blind share of sampled steps", "percentunit",
                   [target(BLIND, legend="blind")],
                   description="Steps replayed as a full CUDA graph (invisible to Python) / "
                               "steps attnprof tried to sample.", minmax=(0, 1)),
        timeseries(23, "Effective sample rate", "percentunit",
                   [target(f"attnprof_sample_rate_ratio{{{M}}}", legend="{{model}}")],
                   description="Step sample rate after the overhead budget.", minmax=(0, 1)),
        timeseries(24, "attnprof self time", "percentunit", [
            target(f"sum(rate(attnprof_self_time_seconds_total{{{M}}}[{RI}]))", "A",
                   "self seconds per wall second"),
            target(ratio(f"sum(rate(attnprof_self_time_seconds_total{{{M}}}[{RI}]))",
                         f"sum(rate(attnprof_step_time_seconds_total{{{M}}}[{RI}]))"),
                   "B", "self time / sampled model time")],
            description="attnprof's own time on sampled steps."),
        timeseries(25, "Internal errors by place", "ops",
                   [target(f"sum by (place) (rate(attnprof_internal_errors_total{{{M}}}[{RI}]))",
                           legend="{{place}}")],
                   description="Internal errors per second (counted and dropped, never raised)."),
        timeseries(26, "Dropped samples by reason", "ops",
                   [target(f"sum by (reason) (rate(attnprof_dropped_samples_total{{{M}}}[{RI}]))",
                           legend="{{reason}}")],
                   description="Samples dropped per second, by reason."),
        timeseries(27, "Plugin processes by role", "short",
                   [target("sum by (role) (attnprof_plugin_processes)", legend="{{role}}")],
                   description="Processes the plugin is live in (api_server, engine_core, "
                               "worker); no model label. Worker 0 means nothing is captured.",
                   w=24),
    ]


def layout(ps: list[Json]) -> list[Json]:
    """Fill gridPos x/y left to right, top to bottom, on Grafana's 24-column grid."""
    x = y = row_h = 0
    for p in ps:
        g = p["gridPos"]
        if x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g["x"], g["y"] = x, y
        x += g["w"]
        row_h = max(row_h, g["h"])
    return ps


def dashboard() -> Json:
    return {
        "uid": "attnprof",
        "title": "attnprof: attention profiler",
        "description": "Attention time, kernels, context lengths, KV cache, window advice and "
                       "attnprof's own health. Metric names: docs/metrics.md.",
        "tags": ["attnprof", "vllm", "attention"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1,
             "includeAll": False, "multi": False, "options": [], "regex": ""},
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "definition": "label_values(attnprof_layer_info, model)",
             "query": {"query": "label_values(attnprof_layer_info, model)",
                       "refId": "PrometheusVariableQueryEditor-VariableQuery"},
             "current": {}, "hide": 0, "refresh": 2, "includeAll": True, "multi": True,
             "allValue": ".*", "options": [], "regex": "", "sort": 1},
        ]},
        "panels": layout(panels()),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def render_rules() -> str:
    """Prometheus rule file: one recording rule per report query with a ``record`` name, over
    5m and every model (plain YAML written by hand: the generator is stdlib only)."""
    lines = [
        "# Generated by grafana/generate.py from plugin/attnprof/tools/report_queries.py: do not",
        "# edit. Recording rules for exactly what `attnprof report --prometheus` reads, so a",
        "# Thanos or Mimir fleet can downsample them (grafana/README.md). Tests:",
        "# attnprof-report-rules.test.yaml (`promtool test rules`).",
        "groups:",
        "  - name: attnprof-report",
        "    interval: 1m",
        "    rules:",
    ]
    for q in rq.QUERIES:
        if q.record is None:
            continue
        lines += [f"      # {q.name}: {q.help}",
                  f"      - record: {q.record}",
                  "        expr: |-"]
        lines += [f"          {ln}" for ln in rq.render(q, sel="", r="5m", vsel="").splitlines()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = ap.parse_args(argv)
    outputs = [(OUT, render()), (RULES_OUT, render_rules())]
    if args.check:
        stale = [p for p, text in outputs if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p} is stale: run python grafana/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for p, text in outputs:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
