"""Read what ``attnprof report`` needs for a fleet from a Prometheus that scrapes the vLLM
servers' /metrics: every query of :mod:`attnprof.tools.report_queries` over a range, into
:class:`~attnprof.analyze.cost.CostInputs` (one per model). Opens sockets: a tool. Every
failure a user can cause is a :class:`~attnprof.tools.report_sources.ReportInputError`.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from collections import defaultdict
from typing import Any

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.analyze import cost_inputs
from attnprof.analyze.cost import CostInputs, WindowInputs
from attnprof.contracts.redact import redact_value
from attnprof.contracts.report import (
    BackendTime,
    ContextDistribution,
    Fallback,
    KvMemory,
    LayerTime,
    ReportSource,
    TimeBreakdown,
    Traffic,
    UsagePoint,
)
from attnprof.facts import durations
from attnprof.tools import http
from attnprof.tools.prometheus_query import _label_value
from attnprof.tools.report_queries import by_name, render, render_since_start
from attnprof.tools.report_sources import Gathered, ReportInputError, checkpoint_architecture

__all__ = ["from_prometheus", "range_seconds"]

def range_seconds(text: str, flag: str = "--range") -> float:
    """A PromQL range in seconds (:func:`attnprof.facts.durations.promql_seconds`);
    :class:`ReportInputError` otherwise."""
    try:
        return durations.promql_seconds(text, flag)
    except durations.DurationError as err:
        raise ReportInputError(str(err)) from None


class _Prom:
    def __init__(self, url: str, timeout: float) -> None:
        try:
            http.check_url(url, "--prometheus")
        except http.HttpError as err:
            raise ReportInputError(str(err)) from None
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> Any:
        full = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            body = http.get(full, timeout=self.timeout)
            obj = http.parse_json(body, self.url, " (is it a Prometheus server?)")
        except http.HttpError as err:
            raise ReportInputError(str(err).replace(full, self.url + path)) from None
        if not isinstance(obj, dict) or obj.get("status") != "success" \
                or not isinstance(obj.get("data"), dict):
            why = obj.get("error") if isinstance(obj, dict) else obj
            raise ReportInputError(f"{self.url}: not a Prometheus query answer "
                                   f"({str(why)[:200]})")
        return obj["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        res = self._get("/api/v1/query", {"query": expr, "time": f"{at:.3f}"}).get("result")
        return res if isinstance(res, list) else []

    def query_range(self, expr: str, start: float, end: float, step: float
                    ) -> list[dict[str, Any]]:
        res = self._get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                 "end": f"{end:.3f}", "step": f"{step:.3f}"}
                        ).get("result")
        return res if isinstance(res, list) else []


def _num(v: Any) -> float | None:
    try:
        x = float(v[1])
    except (TypeError, ValueError, IndexError):
        return None
    return x if math.isfinite(x) else None


def _by(results: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    out = {}
    for r in results:
        m = r.get("metric") or {}
        x = _num(r.get("value"))
        if x is not None:
            out[tuple(str(m.get(k, "")) for k in labels)] = x
    return out


def _hist(results: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Cumulative ``le`` buckets -> (bounds, per-bucket counts; the last above the last bound)."""
    cum = sorted(((float(r["metric"]["le"]), _num(r.get("value")) or 0.0) for r in results
                  if "le" in (r.get("metric") or {})), key=lambda t: t[0])
    bounds, counts, prev = [], [], 0.0
    for le, c in cum:
        if math.isinf(le):
            counts.append(max(0.0, c - prev))
            break
        bounds.append(le)
        counts.append(max(0.0, c - prev))
        prev = c
    return bounds, counts


def from_prometheus(url: str, model: str | None, range_: str | None, replicas: int | None,
                    gpus_per_replica: float | None, timeout: float = 30.0,
                    now: float | None = None) -> Gathered:
    """A fleet: every query of :mod:`attnprof.tools.report_queries` over ``range_``."""
    prom = _Prom(url, timeout)
    seconds = range_seconds(range_) if range_ is not None else None
    end = time.time() if now is None else now
    models = _by(prom.query("count by (model) (attnprof_request_context_tokens_count)", end),
                 "model")
    if not models:
        anything = prom.query("count({__name__=~\"attnprof_.+\"})", end)
        if not anything:
            raise ReportInputError(f"{url} has no attnprof series: is it scraping the vLLM "
                                   "servers' /metrics with attnprof enabled?")
        raise ReportInputError(f"{url} has attnprof series but no finished requests yet "
                               "(attnprof_request_context_tokens_count)")
    names = sorted(k[0] for k in models)
    if model is not None and model not in names:
        raise ReportInputError(f"--model {model!r} is not in {url}; models there: "
                               + ", ".join(names))
    try:
        sel = f"model={_label_value(model, '--model')}" if model else ""
        vsel = f"model_name={_label_value(model, '--model')}" if model else ""
    except ValueError as err:
        raise ReportInputError(str(err)) from None
    explicit = seconds is not None
    if seconds is None:  # all the data there is, at most a day
        day = prom.query_range(f"count(attnprof_request_context_tokens_count{{{sel}}})",
                               end - 86400, end, 10.0)
        first0 = min((float(v[0]) for r in day for v in r.get("values") or []), default=end)
        seconds = float(max(2, int(end - first0)))
        range_ = f"{int(seconds)}s"
    start = end - seconds
    # The range must be covered by data: its first sample within one step of the start.
    step = max(1.0, seconds / 240.0)
    cover = prom.query_range(f"count(attnprof_request_context_tokens_count{{{sel}}})",
                             start, end, step)
    first = min((float(v[0]) for r in cover for v in r.get("values") or []), default=None)
    if first is None or (explicit and first > start + max(2 * step, 0.02 * seconds)):
        have = end - first if first is not None else 0.0
        raise ReportInputError(f"--range {range_} is longer than the data in {url} "
                               f"(it holds {_human_s(have)} of attnprof series); "
                               f"use --range {max(1, int(have * 0.9))}s or less")

    def q(name: str, r: str = f"{int(seconds)}s", at: float = end,
          since_start: bool = not explicit) -> list[dict[str, Any]]:
        # Without --range, totals are the counters themselves (each replica's /metrics):
        # a difference from the first scrape would miss what happened before Prometheus
        # first saw the server.
        query = by_name(name)
        if since_start and "offset {r}" in query.expr:
            return prom.query(render_since_start(query, sel=sel, vsel=vsel), at)
        return prom.query(render(query, sel=sel, r=r, vsel=vsel), at)

    rs = f"{int(seconds)}s"
    half = f"{max(1, int(seconds / 2))}s"
    got: dict[str, Any] = {}
    for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total",
                 "max_model_len", "replicas", "workers", "step_attention_time", "step_time",
                 "attention_time_backend", "attention_time_layer", "layer_info",
                 "kv_bytes_per_token", "kv_dtype", "kv_capacity_tokens",
                 "kv_capacity_sequences", "kv_usage_peak", "kv_held_peak_tokens",
                 "kv_usage_p95", "kv_busy_seconds",
                 "kv_above_90_seconds", "kv_preemptions", "kv_waiting_seconds", "kv_verdict",
                 "vllm_preemptions", "vllm_running_peak", "window_tokens", "window_sinks",
                 "window_layers", "window_flop_saving", "window_kv_saving",
                 "window_exact_ratio", "window_heads_at_risk", "context_buckets"):
        got[name] = q(name, rs)
    got["context_tokens_total"] = q("context_tokens_total", rs)
    # Per-second figures are Prometheus' own rates over the range (what it saw happen);
    # totals without --range are the counters since each server started.
    got["request_rate"] = q("request_rate", rs)
    got["token_rate"] = q("token_rate", rs)
    first_half = q("context_buckets", half, end - seconds / 2, since_start=False)
    second_half = q("context_buckets", half, end, since_start=False)
    usage_series = prom.query_range(
        f"max by (model) (attnprof_kv_cache_usage_ratio{{{sel}}})", start, end, step)
    # The replicas serving at each step: their mean is what an autoscaled fleet is billed.
    replica_series = prom.query_range(render(by_name("replicas"), sel=sel, r=rs, vsel=vsel),
                                      start, end, step)
    inputs = []
    for name in names if model is None else [model]:
        inputs.append(_prom_inputs(name, got, first_half, second_half, usage_series,
                                   replica_series, start, seconds, step, replicas,
                                   gpus_per_replica))
    src = ReportSource(kind="prometheus", where=[redact_value(url)], start=start, end=end,
                       duration_s=seconds, range=range_)
    return Gathered(src, inputs)


def _interp(bounds: list[float], counts: list[float], q: float) -> float | None:
    """Prometheus' ``histogram_quantile`` of what its buckets held."""
    return bucket_quantile(bounds, counts, q, interpolate=True)


def _human_s(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 7200 else f"{s / 60:.1f} min" if s >= 120 else \
        f"{s:.0f} s"


def _for(results: list[dict[str, Any]], model: str, key: str = "model") -> list[dict[str, Any]]:
    return [r for r in results if (r.get("metric") or {}).get(key) == model]


def _one(results: list[dict[str, Any]], model: str, key: str = "model") -> float | None:
    vals = [_num(r.get("value")) for r in _for(results, model, key)]
    vals = [v for v in vals if v is not None]
    return vals[0] if vals else None


def _prom_inputs(model: str, got: dict[str, Any], first_half: list[dict[str, Any]],
                 second_half: list[dict[str, Any]], usage_series: list[dict[str, Any]],
                 replica_series: list[dict[str, Any]], start: float, seconds: float,
                 step: float, replicas_flag: int | None,
                 gpus_flag: float | None) -> CostInputs:
    reqs = _one(got["requests_total"], model) or 0.0
    prompt = _one(got["prompt_tokens_total"], model) or 0.0
    gen = _one(got["generation_tokens_total"], model) or 0.0
    bounds, counts = _hist(_for(got["context_buckets"], model))
    q = {k: _interp(bounds, counts, v) for k, v in
         (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))}
    mx = max((b for b, c in zip(bounds, counts, strict=False) if c > 0), default=None)
    ctx_sum = _one(got["context_tokens_total"], model)
    context = ContextDistribution(bounds=bounds, counts=counts, p50=q["p50"], p90=q["p90"],
                                  p99=q["p99"], p999=q["p999"], max=mx,
                                  mean=ctx_sum / reqs if ctx_sum and reqs else None,
                                  estimated_from_buckets=True)
    fb, fc = _hist(_for(first_half, model))
    sb, sc = _hist(_for(second_half, model))
    d = cost_inputs.drift(ContextDistribution(fb, fc, p50=_interp(fb, fc, 0.5),
                                  p99=_interp(fb, fc, 0.99)),
              ContextDistribution(sb, sc, p50=_interp(sb, sc, 0.5),
                                  p99=_interp(sb, sc, 0.99)))
    mml = _one(got["max_model_len"], model)
    traffic = Traffic(requests=reqs, requests_per_s=_one(got["request_rate"], model) or 0.0,
                      tokens_per_s=_one(got["token_rate"], model) or 0.0, prompt_tokens=prompt,
                      generation_tokens=gen, max_model_len=int(mml) if mml else None,
                      context=context, drift=d, scope="fleet")  # summed over the replicas
    # Where time goes.
    step_t = {k[1]: v for k, v in _by(_for(got["step_time"], model), "model", "phase").items()}
    att_t = {k[1]: v for k, v in _by(_for(got["step_attention_time"], model),
                                     "model", "phase").items()}
    share, overall = cost_inputs.attention_shares(step_t, att_t)
    bt = _by(_for(got["attention_time_backend"], model), "backend", "phase")
    lt = _by(_for(got["attention_time_layer"], model), "layer")
    info = {(str((r.get("metric") or {}).get("layer"))): r.get("metric") or {}
            for r in _for(got["layer_info"], model)}
    total = sum(lt.values())
    per_layer = sorted(
        (LayerTime(layer=k[0], backend=str(info.get(k[0], {}).get("backend", "")),
                   fused=info.get(k[0], {}).get("fused") == "true", time_s=v,
                   share=v / total if total else 0.0) for k, v in lt.items()),
        key=lambda x: int(x.layer) if x.layer.isdigit() else 0)
    unfused: dict[str, list[str]] = defaultdict(list)
    for lay, m in info.items():
        if m.get("fused") == "false":
            unfused[str(m.get("backend"))].append(lay)
    fallbacks = [Fallback(layers=sorted(v, key=lambda s: int(s) if s.isdigit() else 0),
                          backend=b, reason="the backend that ran is not fused "
                          "(attnprof_layer_info fused=\"false\")",
                          fix="see `attnprof snapshot` on one replica for the reason per "
                          "backend, and --attention-backend to pick a fused one",
                          gain="not measured here (attnprof profile measures it)")
                 for b, v in sorted(unfused.items())]
    time_b = TimeBreakdown(
        attention_share=share, model_time_s=step_t,
        by_backend=[BackendTime(backend=b, phase=p, time_s=t,
                                share=t / sum(bt.values()) if sum(bt.values()) else 0.0)
                    for (b, p), t in sorted(bt.items())],
        per_layer=per_layer, fallbacks=fallbacks, overall_share=overall)
    # KV memory.
    verdicts = [str((r.get("metric") or {}).get("verdict")) for r in _for(got["kv_verdict"],
                                                                           model)]
    verdict = ("kv_bound" if "kv_bound" in verdicts else "compute_bound"
               if "compute_bound" in verdicts else verdicts[0] if verdicts else None)
    busy = _one(got["kv_busy_seconds"], model)
    above = _one(got["kv_above_90_seconds"], model)
    waiting = sum(v for v in _by(_for(got["kv_waiting_seconds"], model), "model").values())
    vllm_pre = _one(got["vllm_preemptions"], model, "model_name")
    pre = vllm_pre if vllm_pre is not None else _one(got["kv_preemptions"], model)
    caps = {k[1]: v for k, v in _by(_for(got["kv_capacity_sequences"], model),
                                    "model", "context").items()}
    cap_tokens = _one(got["kv_capacity_tokens"], model)
    peak = _one(got["kv_usage_peak"], model)
    vllm_run = _one(got["vllm_running_peak"], model, "model_name")
    conc, basis = cost_inputs.peak_concurrency(peak, cap_tokens, context.mean, vllm_run)
    dtypes = [str((r.get("metric") or {}).get("kv_dtype")) for r in _for(got["kv_dtype"],
                                                                           model)]
    points = []
    for r in _for(usage_series, model):
        for t, v in r.get("values") or []:
            x = _num((t, v))
            if x is not None:
                points.append(UsagePoint(t=float(t), usage=min(1.0, max(0.0, x))))
    kv = KvMemory(
        bytes_per_token=_one(got["kv_bytes_per_token"], model),
        kv_dtype=dtypes[0] if dtypes else None, capacity_tokens=cap_tokens,
        capacity_sequences=caps, usage_p95=_one(got["kv_usage_p95"], model), usage_peak=peak,
        above_90_fraction=above / busy if busy and above is not None else None,
        preemptions=pre, waiting_fraction=waiting / busy if busy else None, verdict=verdict,
        verdict_evidence=[f"verdict of the replicas' stat loggers: {', '.join(verdicts)}"]
        if verdicts else [],
        source="vllm:* series" if vllm_pre is not None else
        "attnprof_kv_* series (vLLM's scheduler stats)",
        usage_over_time=points, peak_concurrency=conc, peak_concurrency_basis=basis,
        held_peak_tokens=_one(got["kv_held_peak_tokens"], model))
    win = _one(got["window_tokens"], model)
    layers_n = _one(got["window_layers"], model)
    window = None
    if win and layers_n:
        window = WindowInputs(
            sinks=int(_one(got["window_sinks"], model) or 0), window=int(win),
            layers=list(range(int(layers_n))),
            flop_saving=_one(got["window_flop_saving"], model) or 0.0,
            kv_saving=_one(got["window_kv_saving"], model) or 0.0,
            exact_fraction=_one(got["window_exact_ratio"], model),
            heads_at_risk=(int(h) if (h := _one(got["window_heads_at_risk"], model))
                           is not None else None),
            replay=None, safe=False, layers_known=False,
            summary="the replicas' live recommendation (Prometheus carries no replay: "
                    "validate with attnprof validate-window)")
    counted = int(_one(got["replicas"], model) or 1)
    workers = _one(got["workers"], model)
    arch, n_layers = checkpoint_architecture(model)
    warnings = []
    if window is not None and n_layers is None:
        warnings.append("the window's layers are not named in Prometheus (only their count)"
                        ": run attnprof snapshot on one replica for the exact override")
    live: list[tuple[float, float]] = [
        (float(t), x) for r in _for(replica_series, model)
        for t, v in r.get("values") or [] if (x := _num((t, v))) is not None]
    mean_n = cost_inputs.mean_over_range(live, start, start + seconds, step)
    return CostInputs(
        model=model, traffic=traffic, time=time_b, kv=kv, window=window, architecture=arch,
        num_layers=n_layers, replicas=replicas_flag or counted, scope_replicas=counted,
        mean_replicas=mean_n,
        mean_replicas_basis=(f"mean of Prometheus' replica count over the range "
                             f"({_human_s(seconds)})" if mean_n is not None else ""),
        replicas_basis="--replicas" if replicas_flag else
        f"counted from Prometheus ({counted} scrape targets)",
        gpus_per_replica=gpus_flag or (workers / counted if workers else 1.0),
        backends=sorted({lay.backend for lay in per_layer if lay.backend}),
        warnings=warnings)
