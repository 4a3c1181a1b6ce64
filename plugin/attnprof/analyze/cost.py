"""What-ifs and money for the cost report: pure functions over measured inputs.

Takes what a source measured (traffic, where attention time goes, KV memory, the window
advice) and returns :class:`~attnprof.contracts.report.ModelReport`: each what-if with its
formula, inputs, evidence and how to apply it. Never opens a socket or reads a file; the
flag checks against the installed vLLM come in as :class:`FlagChecks` (tools/vllm_flags.py).

The model of money is deliberately simple and printed in full (``FORMULAS``): the fleet is
billed per GPU-hour whether busy or not; a KV-bound fleet is sized by memory (a KV saving s
lets each replica hold 1/(1-s) times the sequences), any other fleet by compute (a time
saving t needs 1-t of the GPU-hours for the same tokens). Each saving is stated twice: what
a fixed replica count banks (whole replicas removed, never more than those counted: the
headline) and what an autoscaled fleet would (the fractional share). A what-if never claims
more than its own saving, alternatives are never added, and a saving that a flag cannot
apply says what change it needs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from attnprof.analyze.advice_basis import advice_basis
from attnprof.contracts.advice import HeadLevelSplit, ReplayEvidence
from attnprof.contracts.report import (
    AdviceBasis,
    Apply,
    Evidence,
    FleetSaving,
    KvMemory,
    ModelReport,
    Money,
    TimeBreakdown,
    Traffic,
    WhatIf,
)
from attnprof.facts.dtypes import dtype_bytes

__all__ = ["FORMULAS", "CostInputs", "FlagChecks", "Measured", "Settings", "WindowInputs",
           "build_model_report", "rank_savings"]

HOURS_PER_MONTH = 730.0

FORMULAS: dict[str, str] = {
    "gpu_hours_per_mtok": "GPU-hours per 1M tokens = GPUs per replica / (tokens per second "
                          "of one replica x 3600) x 10^6 (= replicas x GPUs per replica / "
                          "(the fleet's tokens per second x 3600) x 10^6; a live server's or "
                          "a file's rate is one replica's, Prometheus' the fleet's)",
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
    "replicas_at_peak": "replicas needed now = ceil(peak concurrency / sequences one "
                        "replica holds at the mean context); after = ceil(peak concurrency / "
                        "(sequences one replica holds / (1 - s))); with one replica's "
                        "figures (a live server, files) the fleet's peak = replicas x it",
    "fixed_fleet": "replicas removed at a fixed replica count M: KV-bound fleet: max(0, "
                   "min(needed now, M) - needed after), and 0 when needed now > M (the fleet "
                   "is short at its observed peak: the change relieves the shortage first); "
                   "unknown without peak concurrency; any other fleet: M - ceil(M x (1 - t)); "
                   "share f = removed / M; GPU-hours per 1M tokens after = now x (1 - f); "
                   "monthly saving = monthly cost x f. The report's headline figure",
    "autoscaled": "share saved on an autoscaled fleet (fractional replicas) a = s when the "
                  "fleet is KV-bound (memory sizes it), else t (compute sizes it: a KV gain "
                  "saves nothing until memory binds); after = now x (1 - a); monthly saving "
                  "= monthly cost x a. Ranks the savings with attnprof report --autoscaled",
    "alternatives": "a layer window and per-head windows are alternatives: their savings "
                    "are never added",
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
class Measured:
    """A what-if measured on real servers (``attnprof whatif``): the savings its money is
    then computed from, in place of the estimate."""

    time_saving: float
    """1 - baseline tokens/s / variant tokens/s (negative: the variant is slower): the
    point estimate."""
    kv_saving: float | None
    """1 - baseline KV capacity / variant KV capacity, vLLM's own figures; None when a
    capacity line is missing (the KV figure then stays an estimate, never "measured")."""
    detail: str
    time_saving_low: float | None = None
    """95% interval of the time saving (None: no interval, e.g. one round): money banks the
    lower bound, and 0 when the interval holds 0."""
    time_saving_high: float | None = None
    verdict: str = "inconclusive"
    """``confirmed``, ``off`` or ``inconclusive`` (analyze/measure_stats.verdict)."""
    status: str = "measured"
    """``measured``, or ``could_not_start`` / ``failed``: such a variant is never ranked."""
    agreement_ok: bool | None = None
    """False: measured agreement below the replay target: not ranked as a saving."""
    comparable: bool = True
    """False: the measurement's hardware, dtype or scheduler budget differ from the
    source's: shown beside the estimate, never adopted as its money."""
    mismatch: str = ""
    """What differs, in words (when not ``comparable``)."""


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
    """Replicas counted (``--replicas``, Prometheus' targets, or 1): what a fixed fleet has.
    Whose figures ``traffic`` and ``kv`` are (one replica's or the fleet's) is
    ``traffic.scope``."""
    replicas_basis: str
    gpus_per_replica: float = 1.0
    backends: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    measured: dict[str, Measured] = field(default_factory=dict)
    """What-if id -> its measurement; the what-if's money then comes from it."""
    basis: AdviceBasis | None = None
    """What the window advice stands on (None: the source has no coverage)."""


@dataclass
class Settings:
    gpu_hour_price: float | None = None
    hours_per_month: float = HOURS_PER_MONTH
    autoscaled: bool = False
    """Rank the savings by the autoscaled figure (``--autoscaled``), not the fixed fleet's."""


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
    """Now-figures of one model's fleet (GPU-hours, cost, replicas at peak) and the two
    figures of a saving: whole replicas a fixed fleet removes, and an autoscaled share."""

    def __init__(self, inp: CostInputs, settings: Settings) -> None:
        self.inp = inp
        self.price = settings.gpu_hour_price
        self.hours = settings.hours_per_month
        self.counted = max(1, inp.replicas)
        self.gpus = inp.replicas * inp.gpus_per_replica
        # One server's figures (a live snapshot, files) stand for each of the replicas;
        # Prometheus' are already summed over them.
        self.one_replica = inp.traffic.scope == "replica"
        tps = inp.traffic.tokens_per_s
        fleet_tps = tps * self.counted if tps and self.one_replica else tps
        self.gpu_hours_per_mtok = (self.gpus / (fleet_tps * 3600.0) * 1e6
                                   if fleet_tps and fleet_tps > 0 else None)
        self.monthly_gpu_hours = self.gpus * self.hours
        kv = inp.kv
        mean = inp.traffic.context.mean
        # One basis throughout: sequences at the mean context (the window's KV saving is a
        # ratio of expectations, so it scales exactly this count).
        seqs = (kv.capacity_tokens / mean
                if kv.capacity_tokens and mean and mean > 0 else None)
        self.cap_per_replica = (seqs if self.one_replica else seqs / self.counted
                                if seqs is not None else None)
        self.cap_seqs = (self.cap_per_replica * self.counted
                         if self.cap_per_replica is not None else None)
        peak = kv.peak_concurrency
        self.peak = (peak * self.counted if self.one_replica and peak is not None else peak)
        self.kv_bound = kv.verdict == "kv_bound"

    def replicas_needed(self, kv_saving: float) -> int | None:
        if self.peak is None or not self.cap_per_replica:
            return None
        cap = self.cap_per_replica / max(1e-9, 1.0 - kv_saving)
        return max(1, math.ceil(self.peak / cap - 1e-9))

    def fixed(self, s: float, t: float, now: int | None, after: int | None
              ) -> tuple[int | None, list[str]]:
        """Whole replicas a fixed fleet removes (``FORMULAS['fixed_fleet']``) and the notes
        that say why; None when it cannot be computed."""
        m = self.counted
        if self.kv_bound:
            if now is None or after is None:
                return None, ["the fleet is KV-bound, but its peak concurrency is unknown: "
                              "the whole replicas a fixed fleet removes cannot be computed "
                              f"(the autoscaled figure assumes the KV saving {s:.0%})"]
            if now > m:
                return 0, [f"needs {now} replicas at the observed peak, has {m}; after: "
                           f"{after}: the change relieves a shortage and removes no replica"]
            removed = max(0, min(now, m) - after)
            return removed, [f"the fleet is KV-bound: memory sizes it; at the observed peak "
                             f"it needs {now} of its {m} replicas now and {after} after"]
        return m - math.ceil(m * (1.0 - t) - 1e-9), []

    def saving(self, share: float) -> tuple[float, float | None, float | None, float | None]:
        """(monthly GPU-hours saved, monthly money, GPU-hours and cost per 1M tokens after)
        for a share of GPU-hours saved."""
        gph = self.gpu_hours_per_mtok * (1 - share) if self.gpu_hours_per_mtok is not None \
            else None
        return (self.monthly_gpu_hours * share,
                self.monthly_gpu_hours * share * self.price if self.price is not None else None,
                gph, gph * self.price if gph is not None and self.price is not None else None)

    def autoscaled(self, s: float, t: float, has_kv_gain: bool) -> FleetSaving:
        if self.kv_bound:
            share, assumes = s, ("replicas follow load and memory sizes the fleet "
                                 "(KV-bound): the KV saving is the share of GPU-hours saved")
        elif has_kv_gain:
            share, assumes = t, ("replicas follow load and compute sizes the fleet: the time "
                                 "saving is what it saves; the KV capacity gain saves "
                                 "nothing until memory binds")
        else:
            share, assumes = t, ("replicas follow load and compute sizes the fleet: the time "
                                 "saving is the share of GPU-hours saved")
        gh, money, gph, cost = self.saving(share)
        return FleetSaving(share=share, monthly_gpu_hours_saved=gh, monthly_saving=money,
                           gpu_hours_per_mtok_after=gph, cost_per_mtok_after=cost,
                           assumes=assumes)

    def what_if(self, wid: str, title: str, formula: str, inputs: dict[str, float | str | None],
                flop: float | None, kv_saving: float | None, time_saving: float | None,
                evidence: Evidence, evidence_detail: str, confidence: str, apply: Apply,
                notes: list[str]) -> WhatIf:
        s = kv_saving or 0.0
        t = time_saving or 0.0
        bpt = self.inp.kv.bytes_per_token
        extra = None
        if self.cap_seqs is not None and s > 0:
            extra = self.cap_seqs * (1.0 / (1.0 - s) - 1.0)
        now, after = self.replicas_needed(0.0), self.replicas_needed(s)
        removed, why = self.fixed(s, t, now, after)
        notes = [*notes, *why]
        if self.one_replica and self.counted > 1 and self.kv_bound:
            notes.append(f"KV capacity and peak concurrency are one replica's: the fleet's "
                         f"are taken as {self.counted} x them (equally loaded replicas)")
        if not self.kv_bound and s > 0:
            notes.append(f"the fleet is not KV-bound ({self.inp.kv.verdict or 'no verdict'}):"
                         " the KV capacity gain saves nothing until memory binds; both "
                         "money figures come from the time saving")
        if self.inp.kv.verdict == "neither" and t > 0:
            notes.append("the fleet is neither KV- nor compute-bound (it has headroom): "
                         "the autoscaled saving is per token, realised when the fleet is "
                         "sized to its load")
        auto = self.autoscaled(s, t, s > 0)
        f = removed / self.counted if removed is not None else None
        gh, money, gph, cost = self.saving(f) if f is not None else (None, None, None, None)
        return WhatIf(
            id=wid, title=title, formula=formula, inputs=inputs,
            attention_flop_saving=flop, kv_saving=kv_saving,
            kv_bytes_freed_per_token=bpt * s if bpt is not None and kv_saving else None,
            extra_sequences=extra, replicas_now=now, replicas_after=after,
            time_saving=time_saving, gpu_hours_per_mtok_after=gph, cost_per_mtok_after=cost,
            monthly_saving=money, monthly_gpu_hours_saved=gh,
            evidence=evidence, evidence_detail=evidence_detail, confidence=confidence,
            apply=apply, notes=notes, replicas_removed=removed, autoscaled=auto)


def _window_what_ifs(inp: CostInputs, fleet: _Fleet, flags: FlagChecks) -> list[WhatIf]:
    w = inp.window
    if w is None or not w.layers or w.window <= 0:
        return []
    out: list[WhatIf] = []
    ts = _time_saving(inp.time, w.flop_saving, w.kv_saving)
    evidence: Evidence = "replay" if w.replay is not None else "estimated"
    detail = (f"{w.replay.agreement:.1%} greedy agreement, mean KL {w.replay.mean_kl:.3g} "
              f"over {w.replay.positions} positions ({w.replay.verdict})"
              if w.replay is not None else "no replay: the advice's estimate over the traffic")
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
    notes.append("vLLM admits a request by its worst case: a windowed layer reserves the "
                 "window plus max_num_batched_tokens (chunked prefill in flight), so vLLM's "
                 "own KV capacity figure (at max_model_len) grows less than the memory the "
                 "traffic holds shrinks (vLLM frees blocks outside the window); attnprof "
                 "whatif measures that figure")
    supported = (None if flags.layer_types is None and flags.hf_overrides
                 else bool(flags.hf_overrides and flags.layer_types))
    out.append(fleet.what_if(
        "window", f"{w.sinks} sinks + window {w.window} on {len(w.layers)} layers",
        FORMULAS["time_saving"] + "; " + FORMULAS["capacity"],
        {"sinks": w.sinks, "window": w.window, "layers": len(w.layers),
         "attention_flop_saving": w.flop_saving, "kv_saving": w.kv_saving,
         "exact_request_fraction": w.exact_fraction,
         "replay_agreement": w.replay.agreement if w.replay is not None else None,
         "num_layers": n},
        w.flop_saving, w.kv_saving, ts, evidence, detail, confidence,
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
            hs.attention_flop_saving, hs.kv_memory_saving, ts2, "estimated",
            "no replay: per-head coverage of the sampled attention statistics", "low",
            Apply([], False, "vLLM windows whole layers, not single KV heads: a head-level "
                  "split needs a kernel that takes a window per head (a model/kernel change)",
                  f"vllm {flags.version}"),
            [hs.note] if hs.note else []))
        # One or the other: per-head windows replace the layer window, never add to it.
        out[0].alternative_to.append("head_split")
        out[1].alternative_to.append("window")
    return out


def _fp8_what_if(inp: CostInputs, fleet: _Fleet, flags: FlagChecks) -> WhatIf | None:
    # 0 for an unknown or unset dtype (``auto``): nothing to compare FP8 with.
    size = float(dtype_bytes(inp.kv.kv_dtype, 0)) if inp.kv.kv_dtype else 0.0
    if size <= 1.0:
        return None
    s = 1.0 - 1.0 / size
    notes = ["FP8 quantizes K and V: outputs change slightly; check quality on an eval set "
             "before rolling out (attnprof whatif measures greedy agreement)"]
    ts = _time_saving(inp.time, 0.0, s)
    ok = flags.kv_cache_dtype and flags.fp8_values and flags.backend_fp8 is not False
    backend = ", ".join(inp.backends) or "the running backend"
    needs = None
    if flags.backend_fp8 is False:
        needs = f"{backend} does not accept an fp8 KV cache: it needs another attention backend"
    return fleet.what_if(
        "fp8_kv", f"FP8 KV cache (from {inp.kv.kv_dtype})", FORMULAS["fp8_kv"] + "; "
        + FORMULAS["capacity"], {"kv_dtype": inp.kv.kv_dtype, "bytes_per_element": size},
        0.0, s, ts, "estimated", "no replay: bytes per KV element, FP8 against the "
        f"current {inp.kv.kv_dtype}", "medium",
        Apply(["--kv-cache-dtype fp8"], ok, needs,
              f"vllm {flags.version}: --kv-cache-dtype "
              f"{'accepts' if flags.fp8_values else 'does not accept'} fp8; {backend} "
              + ("declares fp8" if flags.backend_fp8 else "declares no fp8"
                 if flags.backend_fp8 is False else "not checked")),
        notes)


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
    # Nothing observed was longer than the new cap: the buckets' linear spread would
    # invent refusals between the longest context and the bucket's edge.
    refused = (0.0 if ctx.max is not None and new >= ctx.max
               else _share_above(ctx.bounds, ctx.counts, float(new)))
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
        evidence="estimated",
        evidence_detail="the observed context distribution; no memory is freed",
        confidence="high" if inp.traffic.requests >= 1000 else "low",
        apply=Apply([f"--max-model-len {new}"], flags.max_model_len, None,
                    f"vllm {flags.version}: --max-model-len "
                    f"{'exists' if flags.max_model_len else 'missing'}"),
        notes=notes, replicas_removed=0, autoscaled=FleetSaving(
            share=0.0, monthly_gpu_hours_saved=0.0,
            monthly_saving=0.0 if fleet.price is not None else None,
            gpu_hours_per_mtok_after=fleet.gpu_hours_per_mtok,
            cost_per_mtok_after=(fleet.gpu_hours_per_mtok * fleet.price
                                 if fleet.gpu_hours_per_mtok is not None
                                 and fleet.price is not None else None),
            assumes="a cap on one request's length frees no KV memory: nothing to scale"))


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
            evidence_detail=fb.gain,
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


def _gpu_hours_text(gh: float, money: float | None, fmt: Callable[[float], str]) -> str:
    return (f"{fmt(money)}/month ({gh:,.0f} GPU-hours)" if money is not None
            else f"{gh:,.0f} GPU-hours/month")


def _saving_line(w: WhatIf, titles: dict[str, str], fmt: Callable[[float], str]) -> str:
    """One savings line: both money figures, what the what-if frees, its evidence, and the
    what-ifs it is an alternative to."""
    how = {"replay": "replay-validated"}.get(w.evidence, w.evidence)
    if w.monthly_gpu_hours_saved is None or w.replicas_removed is None:
        fixed = "fixed fleet: not computable (peak concurrency unknown)"
    else:
        n = w.replicas_removed
        fixed = (f"{_gpu_hours_text(w.monthly_gpu_hours_saved, w.monthly_saving, fmt)} at a "
                 f"fixed fleet ({n} replica{'' if n == 1 else 's'} removed)")
    a = w.autoscaled
    auto = (f"{_gpu_hours_text(a.monthly_gpu_hours_saved, a.monthly_saving, fmt)} autoscaled"
            if a is not None else "no autoscaled figure")
    parts = []
    if w.kv_saving:
        parts.append(f"{w.kv_saving:.0%} KV bytes per token")
    if w.attention_flop_saving:
        parts.append(f"{w.attention_flop_saving:.0%} attention FLOPs")
    if w.extra_sequences:
        parts.append(f"+{w.extra_sequences:,.0f} concurrent sequences")
    tail = " (needs a model/kernel change)" if w.apply.needs_change else ""
    tail += "".join(f"; alternative to {titles.get(x, x)}: not additive"
                    for x in w.alternative_to)
    return (f"{w.title}: {fixed}, {auto}; {', '.join(parts) or 'no direct saving'} "
            f"[{how}]{tail}")


def rank_savings(ws: list[WhatIf], autoscaled: bool) -> list[WhatIf]:
    """The what-ifs with a saving, biggest first. By the fixed fleet's figure: those whose
    fixed figure is 0 (or unknown) but whose autoscaled one is not come after, by it, so the
    information is not lost. With ``autoscaled``: by the autoscaled figure."""
    def fixed(w: WhatIf) -> float:
        return w.monthly_gpu_hours_saved or 0.0

    def auto(w: WhatIf) -> float:
        return w.autoscaled.monthly_gpu_hours_saved if w.autoscaled is not None else 0.0

    some = [w for w in ws if fixed(w) > 0 or auto(w) > 0]
    if autoscaled:
        return sorted(some, key=lambda w: (auto(w), fixed(w)), reverse=True)
    return sorted(some, key=lambda w: (fixed(w) > 0, fixed(w), auto(w)), reverse=True)


def _dollars(x: float) -> str:
    return f"${x:,.2f}" if abs(x) < 100 else f"${x:,.0f}"


def _measured_what_if(w: WhatIf, m: Measured, fleet: _Fleet) -> WhatIf:
    """``w`` with its money computed from what was measured on real servers (a capping
    what-if, which frees nothing, keeps its zero and only takes the evidence)."""
    if w.id == "max_model_len" or w.kv_saving is None:
        w.evidence, w.evidence_detail = "measured", m.detail
        return w
    notes = list(w.notes)
    t = m.time_saving
    if t < 0:
        notes.append(f"measured slower: {-t:.1%} more model time per token than the baseline "
                     "(the money figures count no time saving)")
    s = m.kv_saving if m.kv_saving is not None else w.kv_saving
    out = fleet.what_if(w.id, w.title, w.formula, w.inputs, w.attention_flop_saving, s,
                        max(0.0, t), "measured", m.detail, "high", w.apply, notes)
    out.alternative_to = list(w.alternative_to)
    return out


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
    ws = [_measured_what_if(w, inp.measured[w.id], fleet) if w.id in inp.measured else w
          for w in ws]

    titles = {w.id: w.title for w in ws}
    savings = [_saving_line(w, titles, _dollars)
               for w in rank_savings(ws, settings.autoscaled)]
    warnings = list(inp.warnings)
    if inp.traffic.requests <= 0:
        warnings.append("no finished requests in the window: traffic, capacity and money "
                        "figures are missing")
    return ModelReport(model=inp.model, traffic=inp.traffic, time=inp.time, kv=inp.kv,
                       what_ifs=ws, money=_money(inp, fleet), savings=savings,
                       warnings=warnings,
                       advice_basis=inp.basis or advice_basis(None, None, None),
                       ranked_by="autoscaled" if settings.autoscaled else "fixed_fleet")
