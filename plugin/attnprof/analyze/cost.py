"""What-ifs and money for the cost report: pure functions over measured inputs.

Takes what a source measured (traffic, where attention time goes, KV memory, the window
advice) and returns :class:`~attnprof.contracts.report.ModelReport`: each what-if with its
formula, inputs, evidence and how to apply it. Never opens a socket or reads a file; the
flag checks against the installed vLLM come in as :class:`FlagChecks` (tools/vllm_flags.py).

The model of money is deliberately simple and printed in full (``FORMULAS``): the fleet is
billed per GPU-hour whether busy or not; a KV-bound fleet is sized by memory (a KV saving s
lets each replica hold 1/(1-s) times the sequences), any other fleet by compute (a time
saving t needs 1-t of the GPU-hours for the same tokens). A what-if never claims more than
its own saving, and a saving that a flag cannot apply says what change it needs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from attnprof.contracts.advice import HeadLevelSplit, ReplayEvidence
from attnprof.contracts.report import (
    Apply,
    KvMemory,
    ModelReport,
    Money,
    TimeBreakdown,
    Traffic,
    WhatIf,
)
from attnprof.facts.dtypes import dtype_bytes

__all__ = ["FORMULAS", "CostInputs", "FlagChecks", "Settings", "WindowInputs",
           "build_model_report"]

HOURS_PER_MONTH = 730.0

FORMULAS: dict[str, str] = {
    "gpu_hours_per_mtok": "GPU-hours per 1M tokens = replicas x GPUs per replica "
                          "/ (tokens per second x 3600) x 10^6",
    "cost_per_mtok": "cost per 1M tokens = GPU-hours per 1M tokens x GPU-hour price",
    "monthly": "monthly GPU-hours = replicas x GPUs per replica x 730 h; "
               "monthly cost = monthly GPU-hours x GPU-hour price",
    "time_saving": "time saved t = sum over phases of (model time of the phase / all model "
                   "time) x attention share of the phase x attention saving of the phase; "
                   "prefill saving = attention-FLOP saving; decode saving = share of KV bytes "
                   "read saved (decode attention is memory-bound: it reads the KV)",
    "capacity": "sequences held = KV capacity in tokens / mean context (the KV tokens a "
                "sequence holds on average); after a KV saving s (a ratio of expectations "
                "over the traffic): x 1 / (1 - s); extra sequences = sequences held x "
                "(1 / (1 - s) - 1)",
    "replicas_at_peak": "replicas needed = ceil(peak concurrency / sequences one replica "
                        "holds at the mean context)",
    "fleet_saving": "share of GPU-hours saved f = 1 - replicas needed after / replicas "
                    "needed now when the fleet is KV-bound (memory sizes it, in whole "
                    "replicas; the KV saving s when peak concurrency is unknown), else the "
                    "time saving t (compute sizes it); GPU-hours per 1M tokens after = now x "
                    "(1 - f); monthly saving = monthly cost x f",
    "fp8_kv": "KV saving s = 1 - 1 / (bytes per KV element now): FP8 stores 1 byte",
    "max_model_len": "suggested max_model_len = observed p99.9 context (from buckets: its "
                     "bucket's upper edge) rounded up to a multiple of 256; refused share = "
                     "requests longer than it; worst-case "
                     "KV of one sequence = max_model_len x KV bytes per token",
    "peak_concurrency": "peak concurrency = vLLM's peak running requests when the source "
                        "has them, else peak KV usage x KV capacity in tokens / mean context",
}


@dataclass
class WindowInputs:
    """The window advice the source carries (live, a profile or the demo's replayed one)."""

    sinks: int
    window: int
    layers: list[int]
    flop_saving: float
    kv_saving: float
    exact_fraction: float | None
    heads_at_risk: int | None
    replay: ReplayEvidence | None
    safe: bool
    summary: str
    head_split: HeadLevelSplit | None = None
    layers_known: bool = True
    """False when only the count of windowed layers is known (Prometheus)."""


@dataclass
class FlagChecks:
    """What the installed vLLM accepts (tools/vllm_flags.py fills it; tests build it)."""

    version: str
    kv_cache_dtype: bool
    fp8_values: bool
    backend_fp8: bool | None
    hf_overrides: bool
    max_model_len: bool
    layer_types: bool | None
    """Whether vLLM's implementation of the family reads layer_types (None: not checked)."""
    layer_types_detail: str


@dataclass
class CostInputs:
    model: str
    traffic: Traffic
    time: TimeBreakdown
    kv: KvMemory
    window: WindowInputs | None
    architecture: str | None
    num_layers: int | None
    replicas: int
    replicas_basis: str
    gpus_per_replica: float = 1.0
    backends: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Settings:
    gpu_hour_price: float | None = None
    hours_per_month: float = HOURS_PER_MONTH


def _share_above(bounds: list[float], counts: list[float], x: float) -> float:
    """Share of the distribution above ``x`` (linear inside a bucket)."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    above = 0.0
    lo = 0.0
    for i, c in enumerate(counts):
        hi = bounds[i] if i < len(bounds) else math.inf
        if lo >= x:
            above += c
        elif hi > x:
            above += c * ((hi - x) / (hi - lo) if math.isfinite(hi) else 1.0)
        lo = hi
    return above / total


def _time_saving(time: TimeBreakdown, prefill_saving: float, decode_saving: float) -> float | None:
    """Share of model time saved (``FORMULAS['time_saving']``); mixed steps take the mean of
    the two phases' savings (they run both)."""
    total = sum(time.model_time_s.values())
    if total <= 0:
        return None
    saving = {"prefill": prefill_saving, "decode": decode_saving,
              "mixed": (prefill_saving + decode_saving) / 2}
    t = 0.0
    for phase, mt in time.model_time_s.items():
        share = time.attention_share.get(phase)
        if share is None or not math.isfinite(share):
            continue
        t += mt / total * min(1.0, max(0.0, share)) * saving.get(phase, 0.0)
    return t


class _Fleet:
    """Now-figures of one model's fleet (GPU-hours, cost, replicas at peak)."""

    def __init__(self, inp: CostInputs, settings: Settings) -> None:
        self.inp = inp
        self.price = settings.gpu_hour_price
        self.hours = settings.hours_per_month
        self.gpus = inp.replicas * inp.gpus_per_replica
        tps = inp.traffic.tokens_per_s
        self.gpu_hours_per_mtok = (self.gpus / (tps * 3600.0) * 1e6
                                   if tps and tps > 0 else None)
        self.monthly_gpu_hours = self.gpus * self.hours
        kv = inp.kv
        mean = inp.traffic.context.mean
        # One basis throughout: sequences at the mean context (the window's KV saving is a
        # ratio of expectations, so it scales exactly this count).
        self.cap_seqs = (kv.capacity_tokens / mean
                         if kv.capacity_tokens and mean and mean > 0 else None)
        self.cap_per_replica = (self.cap_seqs / inp.replicas
                                if self.cap_seqs and inp.replicas else None)
        self.kv_bound = kv.verdict == "kv_bound"

    def replicas_needed(self, kv_saving: float) -> int | None:
        peak = self.inp.kv.peak_concurrency
        if peak is None or not self.cap_per_replica:
            return None
        cap = self.cap_per_replica / max(1e-9, 1.0 - kv_saving)
        return max(1, math.ceil(peak / cap - 1e-9))

    def what_if(self, wid: str, title: str, formula: str, inputs: dict[str, float | str | None],
                flop: float | None, kv_saving: float | None, time_saving: float | None,
                evidence: str, confidence: str, apply: Apply, notes: list[str]) -> WhatIf:
        s = kv_saving or 0.0
        bpt = self.inp.kv.bytes_per_token
        extra = None
        if self.cap_seqs is not None and s > 0:
            extra = self.cap_seqs * (1.0 / (1.0 - s) - 1.0)
        now, after = self.replicas_needed(0.0), self.replicas_needed(s)
        f = time_saving or 0.0
        if self.kv_bound:
            if now is not None and after is not None:
                # Whole replicas: a KV saving that does not free one saves nothing.
                f = max(0.0, 1.0 - after / now)
                notes = [*notes, f"the fleet is KV-bound: memory sizes it; at the observed "
                                 f"peak it needs {now} replicas now and {after} after"]
            else:
                f = s
                notes = [*notes, "the fleet is KV-bound: memory sizes it, so the KV saving is "
                                 "what it saves, realised in whole replicas (peak concurrency "
                                 "unknown here)"]
        elif self.inp.kv.verdict == "neither" and f > 0:
            notes = [*notes, "the fleet is neither KV- nor compute-bound (it has headroom): "
                             "the saving is per token, realised when the fleet is sized to "
                             "its load"]
        gph_after = (self.gpu_hours_per_mtok * (1 - f)
                     if self.gpu_hours_per_mtok is not None else None)
        return WhatIf(
            id=wid, title=title, formula=formula, inputs=inputs,
            attention_flop_saving=flop, kv_saving=kv_saving,
            kv_bytes_freed_per_token=bpt * s if bpt is not None and kv_saving else None,
            extra_sequences=extra,
            replicas_now=now, replicas_after=after,
            time_saving=time_saving,
            gpu_hours_per_mtok_after=gph_after,
            cost_per_mtok_after=gph_after * self.price if gph_after is not None and
            self.price is not None else None,
            monthly_saving=self.monthly_gpu_hours * f * self.price
            if self.price is not None else None,
            monthly_gpu_hours_saved=self.monthly_gpu_hours * f,
            evidence=evidence, confidence=confidence, apply=apply, notes=notes)


def _window_what_ifs(inp: CostInputs, fleet: _Fleet, flags: FlagChecks) -> list[WhatIf]:
    w = inp.window
    if w is None or not w.layers or w.window <= 0:
        return []
    out: list[WhatIf] = []
    ts = _time_saving(inp.time, w.flop_saving, w.kv_saving)
    evidence = (f"replay: {w.replay.agreement:.1%} greedy agreement, mean KL "
                f"{w.replay.mean_kl:.3g} over {w.replay.positions} positions "
                f"({w.replay.verdict})" if w.replay is not None else "estimated")
    confidence = ("high" if w.replay is not None and w.safe else
                  "low" if w.replay is not None else "medium")
    notes = [w.summary] if w.summary else []
    if w.replay is not None and not w.safe:
        notes.append("the replay did not meet its target: do not apply without a fix")
    if w.heads_at_risk:
        notes.append(f"{w.heads_at_risk} KV heads are below the coverage target")
    n = inp.num_layers
    if n and w.layers_known:
        types = ["sliding_attention" if i in set(w.layers) else "full_attention"
                 for i in range(n)]
        override = json.dumps({"sliding_window": w.window, "layer_types": types},
                              separators=(",", ":"))
        flag_list = [f"--hf-overrides '{override}'"]
    else:
        flag_list = [f"--hf-overrides '{{\"sliding_window\":{w.window},\"layer_types\":"
                     "[...one per layer...]}'"]
    needs = None
    if w.sinks > 0:
        needs = (f"vLLM's sliding window keeps no sink tokens: the suggestion (and its "
                 f"replay) keeps the first {w.sinks} tokens, which needs a kernel that "
                 "keeps them (StreamingLLM-style sinks). The flag applies the window "
                 "without sinks, which is not what was validated")
    if flags.layer_types is False:
        needs = (needs + "; " if needs else "") + (
            f"this model family's vLLM implementation does not read layer_types "
            f"({flags.layer_types_detail}): windowing it needs a model change")
    elif flags.layer_types is None:
        notes.append(f"not checked whether vLLM windows this family ({flags.layer_types_detail})"
                     ": run the report where the checkpoint is, or check its vLLM model file "
                     "reads layer_types")
    supported = (None if flags.layer_types is None and flags.hf_overrides
                 else bool(flags.hf_overrides and flags.layer_types))
    out.append(fleet.what_if(
        "window", f"{w.sinks} sinks + window {w.window} on {len(w.layers)} layers",
        FORMULAS["time_saving"] + "; " + FORMULAS["capacity"],
        {"sinks": w.sinks, "window": w.window, "layers": len(w.layers),
         "attention_flop_saving": w.flop_saving, "kv_saving": w.kv_saving,
         "exact_request_fraction": w.exact_fraction},
        w.flop_saving, w.kv_saving, ts, evidence, confidence,
        Apply(flag_list, supported, needs, f"vllm {flags.version}: "
              f"--hf-overrides {'accepted' if flags.hf_overrides else 'missing'}; "
              f"{flags.layer_types_detail}"), notes))
    hs = w.head_split
    if hs is not None and hs.windowed_kv_heads > 0 and hs.kv_memory_saving > w.kv_saving:
        ts2 = _time_saving(inp.time, hs.attention_flop_saving, hs.kv_memory_saving)
        out.append(fleet.what_if(
            "head_split", f"per-head windows on {hs.windowed_kv_heads} KV heads",
            FORMULAS["time_saving"] + "; " + FORMULAS["capacity"],
            {"windowed_kv_heads": hs.windowed_kv_heads,
             "attention_flop_saving": hs.attention_flop_saving,
             "kv_saving": hs.kv_memory_saving},
            hs.attention_flop_saving, hs.kv_memory_saving, ts2, "estimated", "low",
            Apply([], False, "vLLM windows whole layers, not single KV heads: a head-level "
                  "split needs a kernel that takes a window per head (a model/kernel change)",
                  f"vllm {flags.version}"),
            [hs.note] if hs.note else []))
    return out


def _fp8_what_if(inp: CostInputs, fleet: _Fleet, flags: FlagChecks) -> WhatIf | None:
    # 0 for an unknown or unset dtype (``auto``): nothing to compare FP8 with.
    size = float(dtype_bytes(inp.kv.kv_dtype, 0)) if inp.kv.kv_dtype else 0.0
    if size <= 1.0:
        return None
    s = 1.0 - 1.0 / size
    ts = _time_saving(inp.time, 0.0, s)
    ok = flags.kv_cache_dtype and flags.fp8_values and flags.backend_fp8 is not False
    backend = ", ".join(inp.backends) or "the running backend"
    needs = None
    if flags.backend_fp8 is False:
        needs = f"{backend} does not accept an fp8 KV cache: it needs another attention backend"
    return fleet.what_if(
        "fp8_kv", f"FP8 KV cache (from {inp.kv.kv_dtype})", FORMULAS["fp8_kv"] + "; "
        + FORMULAS["capacity"], {"kv_dtype": inp.kv.kv_dtype, "bytes_per_element": size},
        0.0, s, ts, "estimated", "medium",
        Apply(["--kv-cache-dtype fp8"], ok, needs,
              f"vllm {flags.version}: --kv-cache-dtype "
              f"{'accepts' if flags.fp8_values else 'does not accept'} fp8; {backend} "
              + ("declares fp8" if flags.backend_fp8 else "declares no fp8"
                 if flags.backend_fp8 is False else "not checked")),
        ["FP8 quantizes K and V: outputs change slightly; check quality on an eval set "
         "before rolling out (no replay here)"])


def _max_len_what_if(inp: CostInputs, fleet: _Fleet, flags: FlagChecks) -> WhatIf | None:
    ctx = inp.traffic.context
    cur = inp.traffic.max_model_len
    if ctx.p999 is None or cur is None or inp.traffic.requests <= 0:
        return None
    target = ctx.p999
    if ctx.estimated_from_buckets:
        # A bucketed p99.9 is an interpolation: round up to its bucket's upper edge, where
        # the share above is an exact count.
        target = min((b for b in ctx.bounds if b >= ctx.p999), default=ctx.p999)
    new = int(min(cur, math.ceil(target / 256.0) * 256))
    if new >= cur:
        return None
    refused = _share_above(ctx.bounds, ctx.counts, float(new))
    bpt = inp.kv.bytes_per_token
    notes = [
        "vLLM sizes its KV cache by --gpu-memory-utilization (--kv-cache-memory-bytes), not "
        "by max_model_len: this "
        "frees no memory and saves no money by itself; it caps what one request can hold "
        f"(worst case {new:,} instead of {cur:,} tokens of KV) and refuses requests longer "
        f"than {new:,} tokens (about {refused:.2%} of the observed ones)",
    ]
    if inp.traffic.requests < 1000:
        notes.append(f"p99.9 of {inp.traffic.requests:,.0f} requests is their maximum "
                     "region: collect more traffic before relying on it")
    return WhatIf(
        id="max_model_len", title=f"max_model_len {cur:,} -> {new:,} (observed p99.9)",
        formula=FORMULAS["max_model_len"],
        inputs={"max_model_len": cur, "p999": ctx.p999, "suggested": new,
                "refused_share": refused,
                "worst_case_kv_bytes_now": cur * bpt if bpt else None,
                "worst_case_kv_bytes_after": new * bpt if bpt else None},
        attention_flop_saving=0.0, kv_saving=0.0, kv_bytes_freed_per_token=None,
        extra_sequences=None, replicas_now=fleet.replicas_needed(0.0),
        replicas_after=fleet.replicas_needed(0.0), time_saving=0.0,
        gpu_hours_per_mtok_after=fleet.gpu_hours_per_mtok,
        cost_per_mtok_after=(fleet.gpu_hours_per_mtok * fleet.price
                             if fleet.gpu_hours_per_mtok is not None and fleet.price is not None
                             else None),
        monthly_saving=0.0 if fleet.price is not None else None, monthly_gpu_hours_saved=0.0,
        evidence="estimated", confidence="high" if inp.traffic.requests >= 1000 else "low",
        apply=Apply([f"--max-model-len {new}"], flags.max_model_len, None,
                    f"vllm {flags.version}: --max-model-len "
                    f"{'exists' if flags.max_model_len else 'missing'}"),
        notes=notes)


def _fallback_what_ifs(inp: CostInputs, fleet: _Fleet, flags: FlagChecks) -> list[WhatIf]:
    out = []
    for fb in inp.time.fallbacks:
        out.append(WhatIf(
            id="fallback", title=f"fused kernel for layers {', '.join(fb.layers)}",
            formula="gain measured by attnprof profile (fused vs unfused at the same length) "
                    "when present, else the analytic memory model",
            inputs={"backend": fb.backend, "reason": fb.reason},
            attention_flop_saving=None, kv_saving=None, kv_bytes_freed_per_token=None,
            extra_sequences=None, replicas_now=None, replicas_after=None, time_saving=None,
            gpu_hours_per_mtok_after=None, cost_per_mtok_after=None, monthly_saving=None,
            monthly_gpu_hours_saved=None,
            evidence="measured" if fb.gain.startswith("measured") else "estimated",
            confidence="medium", apply=Apply([], False, fb.fix, f"vllm {flags.version}"),
            notes=[fb.gain]))
    return out


def _money(inp: CostInputs, fleet: _Fleet) -> Money:
    note = ""
    if inp.traffic.tokens_per_s is None or not inp.traffic.tokens_per_s:
        note = "no finished requests in the window: no per-token figures"
    return Money(
        gpu_hour_price=fleet.price, replicas=inp.replicas, replicas_basis=inp.replicas_basis,
        gpus_per_replica=inp.gpus_per_replica, gpu_hours_per_mtok=fleet.gpu_hours_per_mtok,
        cost_per_mtok=(fleet.gpu_hours_per_mtok * fleet.price
                       if fleet.gpu_hours_per_mtok is not None and fleet.price is not None
                       else None),
        monthly_gpu_hours=fleet.monthly_gpu_hours,
        monthly_cost=fleet.monthly_gpu_hours * fleet.price if fleet.price is not None else None,
        hours_per_month=fleet.hours, note=note)


def _saving_line(w: WhatIf, fmt: Callable[[float], str]) -> str:
    how = "replay-validated" if w.evidence.startswith("replay") else w.evidence
    money = (f"{fmt(w.monthly_saving)}/month" if w.monthly_saving is not None
             else f"{w.monthly_gpu_hours_saved or 0:,.0f} GPU-hours/month")
    parts = []
    if w.kv_saving:
        parts.append(f"{w.kv_saving:.0%} KV bytes per token")
    if w.attention_flop_saving:
        parts.append(f"{w.attention_flop_saving:.0%} attention FLOPs")
    if w.extra_sequences:
        parts.append(f"+{w.extra_sequences:,.0f} concurrent sequences")
    tail = " (needs a model/kernel change)" if w.apply.needs_change else ""
    return f"{w.title}: {money}; {', '.join(parts) or 'no direct saving'} [{how}]{tail}"


def _dollars(x: float) -> str:
    return f"${x:,.2f}" if abs(x) < 100 else f"${x:,.0f}"


def build_model_report(inp: CostInputs, settings: Settings, flags: FlagChecks) -> ModelReport:
    """The report section of one model: what-ifs ranked, money, and the savings lines."""
    fleet = _Fleet(inp, settings)
    ws: list[WhatIf] = _window_what_ifs(inp, fleet, flags)
    fp8 = _fp8_what_if(inp, fleet, flags)
    if fp8 is not None:
        ws.append(fp8)
    ml = _max_len_what_if(inp, fleet, flags)
    if ml is not None:
        ws.append(ml)
    ws += _fallback_what_ifs(inp, fleet, flags)

    def size(w: WhatIf) -> float:
        return w.monthly_gpu_hours_saved or 0.0

    ranked = sorted((w for w in ws if size(w) > 0), key=size, reverse=True)
    savings = [_saving_line(w, _dollars) for w in ranked]
    warnings = list(inp.warnings)
    if inp.traffic.requests <= 0:
        warnings.append("no finished requests in the window: traffic, capacity and money "
                        "figures are missing")
    return ModelReport(model=inp.model, traffic=inp.traffic, time=inp.time, kv=inp.kv,
                       what_ifs=ws, money=_money(inp, fleet), savings=savings,
                       warnings=warnings)
