"""Read what ``attnprof report`` needs from a live server, a Prometheus, or saved files, into
:class:`~attnprof.analyze.cost.CostInputs` (one per model). Opens sockets and reads files: a
tool. Every failure a user can cause is a :class:`ReportInputError` (one line).
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprof.analyze.cost import (
    CostInputs,
    FlagChecks,
    WindowInputs,
    quantile_from_buckets,
)
from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.base import ContractError
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.redact import redact_value
from attnprof.contracts.report import (
    BackendTime,
    ContextDistribution,
    Drift,
    Fallback,
    KvMemory,
    LayerTime,
    ReportSource,
    TimeBreakdown,
    Traffic,
    UsagePoint,
)
from attnprof.contracts.snapshot import Snapshot
from attnprof.tools import http
from attnprof.tools.report_queries import by_name, render, render_since_start

__all__ = ["Gathered", "ReportInputError", "flag_checks", "from_files", "from_live",
           "from_prometheus", "from_snapshot"]


class ReportInputError(ValueError):
    """A source that cannot be read or has nothing to report (one line)."""


@dataclass
class Gathered:
    source: ReportSource
    inputs: list[CostInputs]
    provenance: Provenance | None = None
    server_versions: dict[str, str | None] = field(default_factory=dict)


def flag_checks(backends: list[str], architecture: str | None) -> FlagChecks:
    """The installed vLLM's answers for the flags the report may suggest."""
    from attnprof.tools import vllm_flags as vf

    fp8_backends = [vf.backend_kv_dtypes(b) for b in backends]
    known = [d for d in fp8_backends if d is not None]
    backend_fp8 = (all("fp8" in d for d in known) if known else None)
    lt = vf.arch_honours_layer_types(architecture)
    return FlagChecks(
        version=vf.vllm_version() or "not installed",
        kv_cache_dtype=vf.engine_arg("--kv-cache-dtype").ok,
        fp8_values="fp8" in vf.kv_cache_dtypes(),
        backend_fp8=backend_fp8,
        hf_overrides=vf.engine_arg("--hf-overrides").ok,
        max_model_len=vf.engine_arg("--max-model-len").ok,
        layer_types=lt.ok if architecture and "not installed" not in lt.detail else None,
        layer_types_detail=lt.detail)


# --- snapshots (live server, `attnprof record`, `snapshot --json`, demo.json) ---------------

def _architecture(model: str) -> tuple[str | None, int | None]:
    """(architecture, layers) from a local checkpoint's config.json, when ``model`` is one."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    archs = cfg.get("architectures") or [None]
    n = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    return (archs[0] if isinstance(archs[0], str) else None,
            int(n) if isinstance(n, int) else None)


def _window_inputs(adv: WindowAdvice | None) -> WindowInputs | None:
    if adv is None:
        return None
    return WindowInputs(
        sinks=adv.sinks, window=adv.window, layers=list(adv.layers),
        flop_saving=adv.attention_flop_saving, kv_saving=adv.kv_memory_saving,
        exact_fraction=adv.exact_request_fraction, heads_at_risk=adv.heads_at_risk_count,
        replay=adv.replay, safe=adv.safe, summary=adv.summary,
        head_split=adv.head_level_split)


def _p999(summary: Any, bounds: list[float], counts: list[float]) -> tuple[float | None, bool]:
    from attnprof.aggregate.quantiles import QuantileEstimator

    if summary is not None and summary.sketch:
        try:
            v = QuantileEstimator.from_dict(summary.sketch).quantile(0.999)
            if v is not None:
                return float(v), False
        except (ValueError, KeyError, TypeError):
            pass
    return quantile_from_buckets(bounds, counts, 0.999), True


def _duration(snap: Snapshot) -> tuple[float | None, float | None]:
    """(start, seconds) the snapshot's counters cover: a record window, else since the API
    server started."""
    if snap.window is not None:
        return snap.window.start, snap.window.duration_s
    starts = [p.started_at for p in snap.processes if p.role == "api_server" and p.started_at]
    if starts:
        return min(starts), max(1e-9, snap.time - min(starts))
    return None, None


def _time_breakdown(snap: Snapshot, profile: ProfileReport | None) -> TimeBreakdown:
    worker = next((w for w in snap.workers if w.steps), None)
    model_t: dict[str, float] = {}
    shares: dict[str, float] = {}
    if worker is not None:
        for phase, st in worker.steps.items():
            model_t[phase] = st.model_time_s
            if st.model_time_s > 0:
                shares[phase] = st.attention_time_s / st.model_time_s
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
        fallbacks += _profile_fallbacks(profile)
    all_model = sum(model_t.values())
    overall = (sum(model_t[p] * shares.get(p, 0.0) for p in model_t) / all_model
               if all_model > 0 else None)
    return TimeBreakdown(attention_share=shares, model_time_s=model_t, by_backend=by_backend,
                         per_layer=per_layer, fallbacks=fallbacks, overall_share=overall)


def _profile_fallbacks(profile: ProfileReport) -> list[Fallback]:
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


def _kv_memory(snap: Snapshot) -> KvMemory:
    req = snap.requests
    st = req.kv_pressure if req is not None else None
    a = snap.kv_pressure
    bpt = sum(lay.bytes_per_token for lay in st.layers) if st is not None and st.layers else None
    cap_tokens = a.capacity_tokens if a is not None else None
    peak = (a.peak if a is not None else None) or (st.peak if st is not None else None)
    mean_ctx = req.context_tokens.mean if req is not None else None
    conc = None
    basis = ""
    if peak is not None and cap_tokens and mean_ctx:
        conc = peak * cap_tokens / mean_ctx
        basis = ("estimated: peak KV usage x capacity in tokens / mean context "
                 f"({peak:.1%} x {cap_tokens:,} / {mean_ctx:,.0f})")
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
        peak_concurrency=conc, peak_concurrency_basis=basis)


def from_snapshot(raw: Mapping[str, Any], where: str, *, replicas: int | None = None,
                  advice: WindowAdvice | None = None, profile: ProfileReport | None = None,
                  gpus_per_replica: float | None = None) -> tuple[CostInputs, Snapshot]:
    """One model's inputs from a snapshot document (``advice``: a replayed window advice
    that replaces the snapshot's own)."""
    try:
        snap = Snapshot.from_json(raw)
    except ContractError as err:
        raise ReportInputError(f"{where}: not an attnprof snapshot: {err}") from None
    req = snap.requests
    _start, dur = _duration(snap)
    n = float(req.requests) if req is not None else 0.0
    prompt = (req.prompt_tokens.mean or 0.0) * req.prompt_tokens.count if req else 0.0
    gen = (req.generation_tokens.mean or 0.0) * req.generation_tokens.count if req else 0.0
    bounds = list(req.context_histogram.bounds) if req and req.context_histogram else []
    counts = [float(c) for c in req.context_histogram.counts] \
        if req and req.context_histogram else []
    p999, interp = _p999(req.context_tokens if req else None, bounds, counts)
    ctx = req.context_tokens if req is not None else None
    context = ContextDistribution(
        bounds=bounds, counts=counts, p50=ctx.p50 if ctx else None,
        p90=ctx.p90 if ctx else None, p99=ctx.p99 if ctx else None, p999=p999,
        max=ctx.max if ctx else None, mean=ctx.mean if ctx else None,
        estimated_from_buckets=interp)
    traffic = Traffic(
        requests=n, requests_per_s=n / dur if dur else None,
        tokens_per_s=(prompt + gen) / dur if dur else None, prompt_tokens=prompt,
        generation_tokens=gen, max_model_len=req.max_model_len if req else None,
        context=context, drift=None)
    if advice is None and isinstance(snap.window_advice, WindowAdvice):
        advice = snap.window_advice
    if advice is None and profile is not None:
        advice = profile.window_advice
    arch, layers_n = _architecture(snap.model)
    if arch is None and snap.provenance is not None and snap.provenance.model.path:
        arch, layers_n = _architecture(snap.provenance.model.path)
    if arch is None and profile is not None:
        arch, layers_n = profile.model.architecture, profile.model.num_layers
    backends = sorted({lay.backend for w in snap.workers for lay in w.layers})
    if layers_n is None and snap.workers:
        layers_n = len(snap.workers[0].layers) or None
    warnings = []
    if snap.window is None and dur is not None:
        warnings.append(f"rates are averaged since the server started ({dur:,.0f} s ago), "
                        "idle time included; use attnprof record for a busy window")
    inp = CostInputs(
        model=_model_name(snap.model), traffic=traffic, time=_time_breakdown(snap, profile),
        kv=_kv_memory(snap), window=_window_inputs(advice), architecture=arch,
        num_layers=layers_n, replicas=replicas or 1,
        replicas_basis="--replicas" if replicas else "one server",
        gpus_per_replica=gpus_per_replica or float(max(1, len(snap.workers))),
        backends=backends, warnings=warnings)
    return inp, snap


def _model_name(model: str) -> str:
    p = Path(model)
    return p.name if p.is_absolute() and p.name else model


def from_live(raw: Mapping[str, Any], url: str, *, replicas: int | None = None,
              gpus_per_replica: float | None = None,
              advice: WindowAdvice | None = None) -> Gathered:
    """The report source of a snapshot just read from the live server at ``url`` (the
    caller fetches it: ``attnprof report --url`` and the demo); ``advice`` replaces the
    snapshot's own window advice (the demo's replayed one)."""
    inp, snap = from_snapshot(raw, url, replicas=replicas, advice=advice,
                              gpus_per_replica=gpus_per_replica)
    start, dur = _duration(snap)
    src = ReportSource(kind="live", where=[redact_value(url)], start=start, end=snap.time,
                       duration_s=dur)
    return Gathered(src, [inp], snap.provenance)


def from_files(paths: list[Path], replicas: int | None,
               gpus_per_replica: float | None) -> Gathered:
    """Snapshot / record / demo.json files (one model each; several records of one model:
    the latest is the report, the first and last give the drift) plus at most one profile."""
    snaps: list[tuple[Path, dict[str, Any], WindowAdvice | None]] = []
    profile: ProfileReport | None = None
    for p in paths:
        try:
            data = json.loads(p.read_text())
        except OSError as err:
            raise ReportInputError(f"{p}: cannot read: {err.strerror or err}") from None
        except ValueError as err:
            raise ReportInputError(f"{p}: not JSON: {err}") from None
        tag = data.get("schema_version") if isinstance(data, dict) else None
        kind = str(tag).split("/")[0] if tag is not None else ""
        if kind == "attnprof.demo":
            adv = data.get("window_advice")
            wa = None
            if isinstance(adv, dict) and "error" not in adv:
                try:
                    wa = WindowAdvice.from_json(adv)
                except ContractError as err:
                    raise ReportInputError(f"{p}: window_advice: {err}") from None
            if not isinstance(data.get("snapshot"), dict):
                raise ReportInputError(f"{p}: a demo report without its snapshot")
            snaps.append((p, data["snapshot"], wa))
        elif kind == "attnprof.snapshot":
            snaps.append((p, data, None))
        elif kind == "attnprof.profile" or (isinstance(data, dict) and tag == 1):
            if profile is not None:
                raise ReportInputError(f"{p}: a second profile (give at most one)")
            try:
                profile = ProfileReport.from_json(data)
            except ContractError as err:
                raise ReportInputError(f"{p}: {err}") from None
        else:
            raise ReportInputError(f"{p}: not an attnprof snapshot, record, demo or profile "
                                   f"file (schema_version {str(tag)[:60]!r})")
    if not snaps:
        if profile is None:
            raise ReportInputError("no input files")
        raise ReportInputError("a profile alone has no traffic: add a snapshot or record "
                               "file of the same model (attnprof record --out FILE)")
    by_model: dict[str, list[tuple[Path, dict[str, Any], WindowAdvice | None]]] = \
        defaultdict(list)
    for s in snaps:
        by_model[str(s[1].get("model"))].append(s)
    inputs = []
    prov = None
    start = end = None
    dur_total = None
    for items in by_model.values():
        items.sort(key=lambda s: _time_of(s[1]))
        path, raw, adv = items[-1]
        inp, snap = from_snapshot(raw, str(path), replicas=replicas, advice=adv,
                                  profile=profile, gpus_per_replica=gpus_per_replica)
        if len(items) > 1:
            first, _ = from_snapshot(items[0][1], str(items[0][0]))
            inp.traffic.drift = drift(first.traffic.context, inp.traffic.context)
        inputs.append(inp)
        prov = prov or snap.provenance
        s0, d0 = _duration(snap)
        start, end, dur_total = s0, snap.time, d0
    src = ReportSource(kind="files", where=[str(p) for p in paths], start=start, end=end,
                       duration_s=dur_total)
    return Gathered(src, inputs, prov or (profile.provenance if profile else None))


def _time_of(raw: Mapping[str, Any]) -> float:
    t = raw.get("time")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else 0.0


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


# --- Prometheus (a fleet) ----------------------------------------------------------------

_RANGE_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800,
                "y": 31536000}


def range_seconds(text: str, flag: str = "--range") -> float:
    import re

    from attnprof.tools.prometheus_query import parse_duration

    try:
        parse_duration(text, flag)
    except ValueError as err:
        raise ReportInputError(str(err)) from None
    seconds = float(sum(int(n) * _RANGE_UNITS[u]
                        for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", text)))
    if seconds < 1:
        raise ReportInputError(f"{flag} {text} is shorter than a second (e.g. 30m, 24h)")
    return seconds


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
    from attnprof.tools.prometheus_query import _label_value

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
                 "kv_capacity_sequences", "kv_usage_peak", "kv_usage_p95", "kv_busy_seconds",
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
    inputs = []
    for name in names if model is None else [model]:
        inputs.append(_prom_inputs(name, got, first_half, second_half, usage_series,
                                   seconds, replicas, gpus_per_replica))
    src = ReportSource(kind="prometheus", where=[redact_value(url)], start=start, end=end,
                       duration_s=seconds, range=range_)
    return Gathered(src, inputs)


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
                 seconds: float, replicas_flag: int | None,
                 gpus_flag: float | None) -> CostInputs:
    reqs = _one(got["requests_total"], model) or 0.0
    prompt = _one(got["prompt_tokens_total"], model) or 0.0
    gen = _one(got["generation_tokens_total"], model) or 0.0
    bounds, counts = _hist(_for(got["context_buckets"], model))
    q = {k: quantile_from_buckets(bounds, counts, v) for k, v in
         (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))}
    mx = max((b for b, c in zip(bounds, counts, strict=False) if c > 0), default=None)
    ctx_sum = _one(got["context_tokens_total"], model)
    context = ContextDistribution(bounds=bounds, counts=counts, p50=q["p50"], p90=q["p90"],
                                  p99=q["p99"], p999=q["p999"], max=mx,
                                  mean=ctx_sum / reqs if ctx_sum and reqs else None,
                                  estimated_from_buckets=True)
    fb, fc = _hist(_for(first_half, model))
    sb, sc = _hist(_for(second_half, model))
    d = drift(ContextDistribution(fb, fc, p50=quantile_from_buckets(fb, fc, 0.5),
                                  p99=quantile_from_buckets(fb, fc, 0.99)),
              ContextDistribution(sb, sc, p50=quantile_from_buckets(sb, sc, 0.5),
                                  p99=quantile_from_buckets(sb, sc, 0.99)))
    mml = _one(got["max_model_len"], model)
    traffic = Traffic(requests=reqs, requests_per_s=_one(got["request_rate"], model) or 0.0,
                      tokens_per_s=_one(got["token_rate"], model) or 0.0, prompt_tokens=prompt,
                      generation_tokens=gen, max_model_len=int(mml) if mml else None,
                      context=context, drift=d)
    # Where time goes.
    step_t = {k[1]: v for k, v in _by(_for(got["step_time"], model), "model", "phase").items()}
    att_t = {k[1]: v for k, v in _by(_for(got["step_attention_time"], model),
                                     "model", "phase").items()}
    share = {p: att_t.get(p, 0.0) / t for p, t in step_t.items() if t > 0}
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
    all_model = sum(step_t.values())
    time_b = TimeBreakdown(
        attention_share=share, model_time_s=step_t,
        by_backend=[BackendTime(backend=b, phase=p, time_s=t,
                                share=t / sum(bt.values()) if sum(bt.values()) else 0.0)
                    for (b, p), t in sorted(bt.items())],
        per_layer=per_layer, fallbacks=fallbacks,
        overall_share=(sum(step_t[p] * share.get(p, 0.0) for p in step_t) / all_model
                       if all_model else None))
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
    mean_ctx = context.mean
    if vllm_run is not None:
        conc, basis = vllm_run, ("vLLM's peak running requests (sum of each replica's peak "
                                 "over the range: an upper bound)")
    elif peak is not None and cap_tokens and mean_ctx:
        conc = peak * cap_tokens / mean_ctx
        basis = "estimated: peak KV usage x capacity in tokens / mean context"
    else:
        conc, basis = None, ""
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
        usage_over_time=points, peak_concurrency=conc, peak_concurrency_basis=basis)
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
    arch, n_layers = _architecture(model)
    warnings = []
    if window is not None and n_layers is None:
        warnings.append("the window's layers are not named in Prometheus (only their count)"
                        ": run attnprof snapshot on one replica for the exact override")
    return CostInputs(
        model=model, traffic=traffic, time=time_b, kv=kv, window=window, architecture=arch,
        num_layers=n_layers, replicas=replicas_flag or counted,
        replicas_basis="--replicas" if replicas_flag else
        f"counted from Prometheus ({counted} scrape targets)",
        gpus_per_replica=gpus_flag or (workers / counted if workers else 1.0),
        backends=sorted({lay.backend for lay in per_layer if lay.backend}),
        warnings=warnings)
