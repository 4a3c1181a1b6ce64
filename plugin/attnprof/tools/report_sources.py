"""Read what ``attnprof report`` needs from a live server's snapshot or saved files
(snapshot, record, demo, profile), into :class:`~attnprof.analyze.cost.CostInputs` (one per
model); the maths over what they hold is :mod:`attnprof.analyze.cost_inputs`, a fleet's
Prometheus is :mod:`attnprof.tools.report_prometheus`. Reads files and asks the installed
vLLM: a tool. Every failure a user can cause is a :class:`ReportInputError` (one line).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprof.analyze import cost_inputs
from attnprof.analyze.advice_basis import advice_basis
from attnprof.analyze.cost import CostInputs, FlagChecks
from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.base import ContractError
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.redact import redact_value
from attnprof.contracts.report import ContextDistribution, ReportSource, Traffic
from attnprof.contracts.snapshot import Snapshot

__all__ = ["Gathered", "ReportInputError", "checkpoint_architecture", "flag_checks",
           "from_files", "from_live", "from_snapshot", "runner_warnings"]


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
        layer_types_detail=lt.detail,
        kv_cache_dtype_skip_layers=vf.engine_arg("--kv-cache-dtype-skip-layers").ok)


# --- snapshots (live server, `attnprof record`, `snapshot --json`, demo.json) ---------------

def checkpoint_architecture(model: str) -> tuple[str | None, int | None]:
    """(architecture, layers) from a local checkpoint's config.json, when ``model`` is one."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    archs = cfg.get("architectures") or [None]
    n = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    return (archs[0] if isinstance(archs[0], str) else None,
            int(n) if isinstance(n, int) else None)


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
    _start, dur = cost_inputs.snapshot_duration(snap)
    n = float(req.requests) if req is not None else 0.0
    prompt = (req.prompt_tokens.mean or 0.0) * req.prompt_tokens.count if req else 0.0
    gen = (req.generation_tokens.mean or 0.0) * req.generation_tokens.count if req else 0.0
    bounds = list(req.context_histogram.bounds) if req and req.context_histogram else []
    counts = [float(c) for c in req.context_histogram.counts] \
        if req and req.context_histogram else []
    p999, interp = cost_inputs.context_p999(req.context_tokens if req else None, bounds, counts)
    ctx = req.context_tokens if req is not None else None
    context = ContextDistribution(
        bounds=bounds, counts=counts, p50=ctx.p50 if ctx else None,
        p90=ctx.p90 if ctx else None, p99=ctx.p99 if ctx else None, p999=p999,
        max=ctx.max if ctx else None, mean=ctx.mean if ctx else None,
        estimated_from_buckets=interp)
    traffic = Traffic(
        requests=n, requests_per_s=cost_inputs.rate(n, dur),
        tokens_per_s=cost_inputs.rate(prompt + gen, dur), prompt_tokens=prompt,
        generation_tokens=gen, max_model_len=req.max_model_len if req else None,
        context=context, drift=None, scope="replica")  # one server's, whatever --replicas
    if advice is None and isinstance(snap.window_advice, WindowAdvice):
        advice = snap.window_advice
    if advice is None and profile is not None:
        advice = profile.window_advice
    arch, layers_n = checkpoint_architecture(snap.model)
    if arch is None and snap.provenance is not None and snap.provenance.model.path:
        arch, layers_n = checkpoint_architecture(snap.provenance.model.path)
    if arch is None and profile is not None:
        arch, layers_n = profile.model.architecture, profile.model.num_layers
    backends = sorted({lay.backend for w in snap.workers for lay in w.layers})
    if layers_n is None and snap.workers:
        layers_n = len(snap.workers[0].layers) or None
    warnings = []
    if dur is not None and cost_inputs.rate(1.0, dur) is None:
        warnings.append(f"the data covers {dur:.3g} s: too little time for a rate (no "
                        "per-token or per-second figure)")
    if snap.window is None and dur is not None:
        warnings.append(f"rates are averaged since the server started ({dur:,.0f} s ago), "
                        "idle time included; use attnprof record for a busy window")
    warnings += runner_warnings(snap)
    basis = advice_basis(snap.coverage, req.context_buckets if req is not None else None,
                         advice.coverage if advice is not None else None,
                         advice.window if advice is not None else None,
                         has_advice=advice is not None)
    shape = cost_inputs.attention_shape(snap)
    inp = CostInputs(
        model=_model_name(snap.model), traffic=traffic,
        time=cost_inputs.time_breakdown(snap, profile), kv=cost_inputs.kv_memory(snap),
        window=cost_inputs.window_inputs(advice), architecture=arch,
        num_layers=layers_n, replicas=replicas or 1,
        replicas_basis="--replicas" if replicas else "one server",
        gpus_per_replica=gpus_per_replica or float(max(1, len(snap.workers))),
        backends=backends, warnings=warnings, basis=basis,
        head_sizes=shape.head_sizes if shape is not None else [],
        sliding_layers=shape.sliding_layers if shape is not None else None)
    return inp, snap


def runner_warnings(snap: Snapshot) -> list[str]:
    """What the workers' model runner reports say the report's times stand on: a runner
    attnprof does not hook measured nothing; Model Runner V2 is hooked by construction only."""
    out: dict[str, None] = {}
    for w in snap.workers:
        r = w.runner
        if r is None:
            continue
        if not r.hooked:
            why = r.note or r.runner_class
            out[f"a worker runs a vLLM model runner attnprof does not hook ({why}): no step "
                "of it is sampled or timed"] = None
        elif r.runner == "v2":
            out[f"the workers run vLLM's Model Runner V2 ({r.note or 'hooked'}); a sampled "
                "step's time includes its input preparation"] = None
    return list(out)


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
    start, dur = cost_inputs.snapshot_duration(snap)
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
        elif kind == "attnprof.profile":
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
            inp.traffic.drift = cost_inputs.drift(first.traffic.context, inp.traffic.context)
        inputs.append(inp)
        prov = prov or snap.provenance
        s0, d0 = cost_inputs.snapshot_duration(snap)
        start, end, dur_total = s0, snap.time, d0
    src = ReportSource(kind="files", where=[str(p) for p in paths], start=start, end=end,
                       duration_s=dur_total)
    return Gathered(src, inputs, prov or (profile.provenance if profile else None))


def _time_of(raw: Mapping[str, Any]) -> float:
    t = raw.get("time")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else 0.0


