"""What-ifs and money for the cost report: pure functions over measured inputs.

Takes what a source measured (traffic, where attention time goes, KV memory, the window
advice) and returns :class:`~attnprof.contracts.report.ModelReport`: each what-if with its
formula, inputs, evidence and how to apply it. Never opens a socket or reads a file; the
flag checks against the installed vLLM come in as :class:`FlagChecks` (tools/vllm_flags.py).

The model of money is deliberately simple and printed in full (``FORMULAS``): the fleet is
billed per GPU-hour whether busy or not; a KV-bound fleet is sized by the memory it holds at
its peak (a KV saving s shrinks it to 1-s), never below the replicas its tokens/s need (the
compute floor), any other fleet by compute (a time saving t needs 1-t of the GPU-hours for
the same tokens). Each saving is stated twice: what a fixed replica count banks (whole
replicas removed, never more than those counted: the headline) and what an autoscaled fleet
would (the fractional share of its mean replicas; per replica-month when they are unknown).
A measured saving banks the lower bound of its interval. A what-if never claims more than
its own saving, alternatives are never added, a saving that a flag cannot apply says what
change it needs, and one whose quality is not shown (a variant that could not start,
agreement below target) is never ranked. The savings lines are rendered from the result by
exporters/money.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from attnprof.analyze.advice_basis import advice_basis
from attnprof.contracts.advice import HeadLevelSplit, ReplayEvidence
from attnprof.contracts.report import (
    AdviceBasis,
    Apply,
    Evidence,
    FleetSaving,
    KvMemory,
    MeasuredBeside,
    ModelReport,
    Money,
    TimeBreakdown,
    Traffic,
    WhatIf,
)
from attnprof.contracts.whatif import CheckVerdict
from attnprof.facts.dtypes import dtype_bytes

__all__ = ["FORMULAS", "CostInputs", "FlagChecks", "Measured", "Settings", "WindowInputs",
           "build_model_report", "rank_savings"]

HOURS_PER_MONTH = 730.0

FORMULAS: dict[str, str] = {
    "gpu_hours_per_mtok": "GPU-hours per 1M tokens = GPUs per replica / (tokens per second "
                          "of one replica x 3600) x 10^6; a live server's or a file's rate "
                          "is one replica's, Prometheus' is the sum over the replicas it "
                          "scraped (divided by their count, whatever --replicas says); no "
                          "rate from under 1 s of data",
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
    "replicas_at_peak": "memory held at the peak = peak KV usage x KV capacity (the "
                        "fleet's; with one replica's figures, x replicas); replicas needed "
                        "now = ceil(memory held / one replica's capacity); after = ceil("
                        "memory held x (1 - s) / one replica's capacity)",
    "compute_floor": "compute floor = ceil(the fleet's tokens/s / one replica's maximum "
                     "tokens/s), the fleet's tokens/s being its average over the range (a "
                     "fixed fleet serving a busier hour needs more: the floor is a lower "
                     "bound, so read a KV saving's replicas removed with it); without a "
                     "measured maximum, the observed tokens/s of one replica (so a KV "
                     "saving removes nothing until measured at saturation); a KV saving "
                     "never takes the fleet below it",
    "fixed_fleet": "replicas removed at a fixed replica count M: KV-bound fleet: max(0, "
                   "min(needed now, M) - max(needed after, compute floor)), and 0 when the "
                   "fleet ran out of KV at its peak (usage >= 95% and preemptions: the "
                   "change relieves the shortage first); any other fleet: M - ceil(M x "
                   "(1 - t)); share f = removed / M; GPU-hours per 1M tokens after = now x "
                   "(1 - f); monthly saving = monthly cost x f. The report's headline figure",
    "autoscaled": "share saved on an autoscaled fleet (fractional replicas) a = s capped at "
                  "1 - the fleet's tokens/s / (one replica's maximum x mean replicas) when "
                  "the fleet is KV-bound (memory sizes it), else t (compute sizes it: a KV "
                  "gain saves nothing until memory binds); monthly GPU-hours saved = a x "
                  "mean replicas x GPUs per replica x 730 h (the fleet's mean replicas over "
                  "the range, from Prometheus or --mean-replicas; unknown: per replica-month "
                  "only). Ranks the savings with attnprof report --autoscaled",
    "measured": "a measured time saving banks the lower bound of its 95% interval (0 when "
                "the interval holds 0, or without an interval) and prints the interval; a "
                "KV saving is measured only from vLLM's own capacity figures; a measurement "
                "on other hardware, dtype or scheduler budget is shown beside the estimate, "
                "never adopted; a variant that could not start, or whose agreement is below "
                "the replay target, is not ranked",
    "alternatives": "a layer window and per-head windows are alternatives: their savings "
                    "are never added",
    "fp8_kv": "KV saving s = 1 - 1 / (bytes per KV element now): FP8 stores 1 byte; x the "
              "share of full-attention layers when sliding-window layers are kept in their "
              "dtype (--kv-cache-dtype-skip-layers sliding_window)",
    "max_model_len": "suggested max_model_len = observed p99.9 context (from buckets: its "
                     "bucket's upper edge) rounded up to a multiple of 256; refused share = "
                     "requests longer than it; worst-case "
                     "KV of one sequence = max_model_len x KV bytes per token",
    "peak_concurrency": "peak concurrency (shown, not used to size the fleet) = vLLM's "
                        "peak running requests when the source has them, else peak KV "
                        "usage x KV capacity in tokens / mean context",
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
    kv_cache_dtype_skip_layers: bool | None = None
    """Whether vLLM has ``--kv-cache-dtype-skip-layers`` (None: not checked)."""


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
    scope_replicas: int | None = None
    """Replicas a fleet-scope source's sums are over (Prometheus' scrape targets); None:
    ``replicas``. ``--replicas`` sets what a fixed fleet is billed for, never what the
    measured rates are divided by."""
    mean_replicas: float | None = None
    """The fleet's mean replicas over the range (Prometheus, or ``--mean-replicas``): the
    autoscaled figures' base; None: the autoscaled money is per replica-month only."""
    mean_replicas_basis: str = ""
    replica_max_tokens_per_s: float | None = None
    """One replica's tokens/s at saturation when measured; without it the observed rate
    caps a KV saving (measure at saturation)."""
    head_sizes: list[int] = field(default_factory=list)
    """Distinct attention head sizes (empty: unknown): FP8 KV's known exceptions."""
    sliding_layers: list[int] | None = None
    """The model's own sliding-window layers (None: unknown)."""


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
    """Now-figures of one model's fleet (GPU-hours, cost, memory held at the peak, the
    compute floor) and the two figures of a saving: whole replicas a fixed fleet removes,
    and an autoscaled share of the fleet's mean replicas."""

    def __init__(self, inp: CostInputs, settings: Settings) -> None:
        self.inp = inp
        self.price = settings.gpu_hour_price
        self.hours = settings.hours_per_month
        self.counted = max(1, inp.replicas)
        self.gpr = inp.gpus_per_replica
        self.gpus = self.counted * self.gpr
        self.traffic = inp.traffic.requests > 0
        # Whose figures the source holds: one server's (a live snapshot, files: each of the
        # replicas is taken as loaded alike) or the sum over the replicas Prometheus
        # scraped; --replicas never multiplies (or divides) a sum over other replicas.
        self.one_replica = inp.traffic.scope == "replica"
        self.src = 1 if self.one_replica else max(1, inp.scope_replicas or self.counted)
        tps = inp.traffic.tokens_per_s if self.traffic else None
        self.replica_tps = tps / self.src if tps and tps > 0 else None
        """Observed tokens/s of one replica."""
        self.load_tps = (None if self.replica_tps is None else
                         self.replica_tps * self.counted if self.one_replica else tps)
        """The tokens/s the fleet serves."""
        self.gpu_hours_per_mtok = (self.gpr / (self.replica_tps * 3600.0) * 1e6
                                   if self.replica_tps else None)
        self.monthly_gpu_hours = self.gpus * self.hours
        self.mean = inp.mean_replicas if inp.mean_replicas and inp.mean_replicas > 0 else None
        kv = inp.kv
        mean_ctx = inp.traffic.context.mean
        # Sequences at the mean context: the window's KV saving is a ratio of expectations,
        # so it scales exactly this count (the extra sequences a saving makes room for).
        seqs = (kv.capacity_tokens / mean_ctx
                if kv.capacity_tokens and mean_ctx and mean_ctx > 0 else None)
        self.cap_seqs = (None if seqs is None else seqs * self.counted if self.one_replica
                         else seqs)
        # Memory held at the peak sizes a KV-bound fleet (not running peak x mean context:
        # the requests running at the peak are not of mean length).
        self.cap_replica = (kv.capacity_tokens / self.src
                            if kv.capacity_tokens and kv.capacity_tokens > 0 else None)
        self.held_peak = (kv.usage_peak * self.cap_replica * (self.counted if self.one_replica
                                                              else self.src)
                          if kv.usage_peak is not None and self.cap_replica else None)
        # A fleet's own sum at one instant when the source has it (Prometheus): the busiest
        # replica's peak x every replica's capacity assumes their peaks coincide.
        self.held_upper_bound = (not self.one_replica and self.src > 1
                                 and kv.held_peak_tokens is None)
        if not self.one_replica and kv.held_peak_tokens is not None and self.cap_replica:
            self.held_peak = kv.held_peak_tokens
        self.kv_bound = kv.verdict == "kv_bound"
        # Out of KV at the peak (full, and requests preempted): memory held is then a floor
        # of what the traffic wanted, not its size.
        self.short = bool(kv.usage_peak is not None and kv.usage_peak >= 0.95
                          and (kv.preemptions or 0) > 0)
        self.max_tps = (inp.replica_max_tokens_per_s
                        if inp.replica_max_tokens_per_s and inp.replica_max_tokens_per_s > 0
                        else None)
        rate = self.max_tps or self.replica_tps
        self.floor = (max(1, math.ceil(self.load_tps / rate - 1e-9))
                      if self.load_tps and rate else None)
        """Replicas the fleet's tokens/s needs (``FORMULAS['compute_floor']``)."""

    def floor_text(self) -> str:
        rate = self.max_tps or self.replica_tps or 0.0
        how = ("one replica's maximum" if self.max_tps else
               "one replica's observed rate: its maximum is unknown, measure at saturation")
        return (f"the fleet's {self.load_tps or 0:,.0f} tokens/s need {self.floor} "
                f"replica{'' if self.floor == 1 else 's'} at {rate:,.0f} tokens/s each ({how})")

    def replicas_needed(self, kv_saving: float) -> int | None:
        """Replicas the memory held at the peak needs after a KV saving (``FORMULAS[
        'replicas_at_peak']``); None without peak usage or capacity."""
        if self.held_peak is None or not self.cap_replica:
            return None
        return max(1, math.ceil(self.held_peak * (1.0 - kv_saving) / self.cap_replica - 1e-9))

    def fixed(self, s: float, t: float, now: int | None, after: int | None
              ) -> tuple[int | None, list[str]]:
        """Whole replicas a fixed fleet removes (``FORMULAS['fixed_fleet']``) and the notes
        that say why; None when it cannot be computed."""
        m = self.counted
        if not self.traffic:
            return None, []
        if self.kv_bound:
            if now is None or after is None:
                return None, ["the fleet is KV-bound, but the memory it held at its peak is "
                              "unknown (peak KV usage or capacity missing): the whole "
                              "replicas a fixed fleet removes cannot be computed"]
            if self.short:
                return 0, [f"the fleet ran out of KV memory at its peak (usage "
                           f"{self.inp.kv.usage_peak:.0%}, {self.inp.kv.preemptions:,.0f} "
                           "preemptions): the memory it held is less than the traffic "
                           "wanted, so the change relieves that shortage and removes no "
                           "replica"]
            if self.floor is None:
                return None, ["the fleet is KV-bound, but its token rate is unknown: the "
                              "compute headroom that caps a KV saving cannot be checked"]
            kept = max(after, self.floor)
            removed = max(0, min(now, m) - kept)
            notes = [f"the fleet is KV-bound: memory sizes it; the memory held at its peak "
                     f"needs {now} of its {m} replicas now and {after} after"]
            if self.floor > after:
                notes.append(f"capped by compute headroom: {self.floor_text()}, so "
                             f"{removed} replica{'' if removed == 1 else 's'} removed, not "
                             f"{max(0, min(now, m) - after)}")
            return removed, notes
        return m - math.ceil(m * (1.0 - t) - 1e-9), []

    def saving(self, share: float) -> tuple[float, float | None, float | None, float | None]:
        """(monthly GPU-hours saved, monthly money, GPU-hours and cost per 1M tokens after)
        for a share of the counted fleet's GPU-hours."""
        gph = self.gpu_hours_per_mtok * (1 - share) if self.gpu_hours_per_mtok is not None \
            else None
        return (self.monthly_gpu_hours * share,
                self.monthly_gpu_hours * share * self.price if self.price is not None else None,
                gph, gph * self.price if gph is not None and self.price is not None else None)

    def kv_share_cap(self) -> float | None:
        """The largest share of replicas an autoscaled fleet can drop and still serve its
        tokens/s (``FORMULAS['compute_floor']``); None without a token rate."""
        base = self.mean or self.counted
        if not self.load_tps or not base:
            return None
        rate = self.max_tps or self.load_tps / base
        return max(0.0, 1.0 - self.load_tps / rate / base)

    def autoscaled(self, s: float, t: float, has_kv_gain: bool) -> FleetSaving | None:
        if not self.traffic:
            return None
        if self.kv_bound:
            cap = self.kv_share_cap()
            share = min(s, cap) if cap is not None else 0.0
            assumes = ("replicas follow load and memory sizes the fleet (KV-bound): the KV "
                       "saving is the share of GPU-hours saved")
            if cap is None:
                assumes += ", but the token rate is unknown: compute headroom unchecked, 0"
            elif cap < s:
                assumes += (f", capped at {cap:.1%} by compute headroom (" +
                            ("one replica's maximum tokens/s)" if self.max_tps else
                             "the observed tokens/s per replica: measure at saturation)"))
        elif has_kv_gain:
            share, assumes = t, ("replicas follow load and compute sizes the fleet: the time "
                                 "saving is what it saves; the KV capacity gain saves "
                                 "nothing until memory binds")
        else:
            share, assumes = t, ("replicas follow load and compute sizes the fleet: the time "
                                 "saving is the share of GPU-hours saved")
        per_replica = share * self.gpr * self.hours
        if self.mean is not None:
            gh: float | None = per_replica * self.mean
            assumes += f"; base: {self.mean:,.2f} mean replicas ({self.inp.mean_replicas_basis})"
        else:
            gh = None
            assumes += ("; the fleet's mean replicas are unknown (Prometheus over a range, or "
                        "--mean-replicas): per replica-month only, never the counted fleet's "
                        "bill")
        gph = self.gpu_hours_per_mtok * (1 - share) if self.gpu_hours_per_mtok is not None \
            else None
        return FleetSaving(
            share=share, monthly_gpu_hours_saved=gh,
            monthly_saving=gh * self.price if gh is not None and self.price is not None
            else None,
            gpu_hours_per_mtok_after=gph,
            cost_per_mtok_after=gph * self.price if gph is not None and self.price is not None
            else None,
            assumes=assumes, gpu_hours_saved_per_replica_month=per_replica)

    def what_if(self, wid: str, title: str, formula: str, inputs: dict[str, float | str | None],
                flop: float | None, kv_saving: float | None, time_saving: float | None,
                evidence: Evidence, evidence_detail: str, confidence: str, apply: Apply,
                notes: list[str], banked: float | None = None) -> WhatIf:
        """A what-if with its money; ``banked``: the time saving the money uses (a measured
        one's lower bound), else ``time_saving``."""
        s = kv_saving or 0.0
        t = (time_saving if banked is None else banked) or 0.0
        bpt = self.inp.kv.bytes_per_token
        extra = None
        if self.cap_seqs is not None and s > 0:
            extra = self.cap_seqs * (1.0 / (1.0 - s) - 1.0)
        now, after = self.replicas_needed(0.0), self.replicas_needed(s)
        removed, why = self.fixed(s, t, now, after)
        notes = [*notes, *why]
        if not self.traffic:
            notes.append("no finished requests in the window: no money figure")
        if self.one_replica and self.counted > 1 and self.kv_bound:
            notes.append(f"KV capacity and peak usage are one replica's: the fleet's are "
                         f"taken as {self.counted} x them (equally loaded replicas)")
        if self.held_upper_bound and self.kv_bound and s > 0:
            # Prometheus' peak usage is the busiest replica's own peak: times the fleet's
            # capacity it assumes every replica peaked at once (an upper bound).
            notes.append(f"memory held at the peak is the busiest replica's peak usage x the "
                         f"capacity of all {self.src:g} scraped replicas, an upper bound (their "
                         f"peaks need not coincide): the replicas needed now, and so those "
                         f"removed, may be overstated")
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
            apply=apply, notes=notes, replicas_removed=removed, autoscaled=auto,
            banked_time_saving=t if time_saving is not None else None,
            compute_floor=self.floor if self.kv_bound else None)


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
    if w.replay is not None and not w.safe:
        # Quality before money: a replay below its target is not a saving to rank.
        out[0].ranked = False
        out[0].not_ranked = "the replay's agreement is below its target"
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
    confidence = "medium"
    flag_list = ["--kv-cache-dtype fp8"]
    needs = None
    # FP8 KV's known exceptions, checked before it is suggested (FORMULAS['fp8_kv']).
    sliding = inp.sliding_layers
    n = inp.num_layers
    if sliding and n:
        if flags.kv_cache_dtype_skip_layers:
            flag_list.append("--kv-cache-dtype-skip-layers sliding_window")
            full = max(0, n - len(sliding))
            s *= full / n
            notes.append(f"{len(sliding)} of {n} layers are sliding-window layers: vLLM "
                         f"{flags.version} quantizes every layer's KV unless "
                         "--kv-cache-dtype-skip-layers names it ('sliding_window' keeps "
                         f"every sliding-window layer in {inp.kv.kv_dtype}); the KV saving "
                         "counts the full-attention layers only (a lower bound: a sliding "
                         "layer holds at most its window)")
        else:
            confidence = "low"
            notes.append(f"{len(sliding)} of {n} layers are sliding-window layers and this "
                         "vLLM has no --kv-cache-dtype-skip-layers: FP8 would quantize them "
                         "too, a known quality exception; measure agreement first")
    elif sliding is None:
        notes.append("not known here whether the model has sliding-window layers (vLLM "
                     "quantizes them too unless --kv-cache-dtype-skip-layers sliding_window"
                     " is given): check its config before applying")
    if 256 in inp.head_sizes:
        confidence = "low"
        notes.append("head size 256: a known FP8 exception in prefill. vLLM "
                     f"{flags.version} takes an fp8 KV cache on FLASH_ATTN only with FA3 on "
                     "SM90 or FA4 on SM100 (fa_utils.flash_attn_supports_kv_cache_dtype), "
                     "and FlashInfer on SM90/SM100 then quantizes the prefill queries to "
                     "FP8 too (FlashInferMetadataBuilder.get_q_data_type; vLLM's "
                     "attention-config disable_flashinfer_q_quantization keeps them in the "
                     "model dtype): measure agreement (attnprof whatif) before relying on it")
    ts = _time_saving(inp.time, 0.0, s)
    ok = flags.kv_cache_dtype and flags.fp8_values and flags.backend_fp8 is not False
    backend = ", ".join(inp.backends) or "the running backend"
    if flags.backend_fp8 is False:
        needs = f"{backend} does not accept an fp8 KV cache: it needs another attention backend"
    return fleet.what_if(
        "fp8_kv", f"FP8 KV cache (from {inp.kv.kv_dtype})", FORMULAS["fp8_kv"] + "; "
        + FORMULAS["capacity"], {"kv_dtype": inp.kv.kv_dtype, "bytes_per_element": size,
                                 "sliding_layers": len(sliding) if sliding is not None
                                 else None},
        0.0, s, ts, "estimated", "no replay: bytes per KV element, FP8 against the "
        f"current {inp.kv.kv_dtype}", confidence,
        Apply(flag_list, ok, needs,
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
    if not fleet.traffic:
        note = "no finished requests in the window: no per-token figures"
    elif fleet.replica_tps is None:
        note = "no token rate (under 1 s of data, or none): no per-token figures"
    return Money(
        gpu_hour_price=fleet.price, replicas=inp.replicas, replicas_basis=inp.replicas_basis,
        gpus_per_replica=inp.gpus_per_replica, gpu_hours_per_mtok=fleet.gpu_hours_per_mtok,
        cost_per_mtok=(fleet.gpu_hours_per_mtok * fleet.price
                       if fleet.gpu_hours_per_mtok is not None and fleet.price is not None
                       else None),
        monthly_gpu_hours=fleet.monthly_gpu_hours,
        monthly_cost=fleet.monthly_gpu_hours * fleet.price if fleet.price is not None else None,
        hours_per_month=fleet.hours, note=note, mean_replicas=fleet.mean,
        mean_replicas_basis=inp.mean_replicas_basis if fleet.mean is not None else "",
        replica_max_tokens_per_s=fleet.max_tps)


def rank_savings(ws: list[WhatIf], autoscaled: bool) -> list[WhatIf]:
    """The ranked what-ifs with a saving, biggest first. By the fixed fleet's figure: those
    whose fixed figure is 0 (or unknown) but whose autoscaled one is not come after, by it,
    so the information is not lost. With ``autoscaled``: by the autoscaled figure (per
    replica-month when the mean replicas are unknown: the same base for every what-if)."""
    def fixed(w: WhatIf) -> float:
        return w.monthly_gpu_hours_saved or 0.0

    def auto(w: WhatIf) -> float:
        a = w.autoscaled
        if a is None:
            return 0.0
        return (a.monthly_gpu_hours_saved if a.monthly_gpu_hours_saved is not None
                else a.gpu_hours_saved_per_replica_month or 0.0)

    some = [w for w in ws if w.ranked and (fixed(w) > 0 or auto(w) > 0)]
    if autoscaled:
        return sorted(some, key=lambda w: (auto(w), fixed(w)), reverse=True)
    return sorted(some, key=lambda w: (fixed(w) > 0, fixed(w), auto(w)), reverse=True)


_CONFIDENCE = {"confirmed": "high", "inconclusive": "medium", "off": "low"}


def _measured_what_if(w: WhatIf, m: Measured, fleet: _Fleet) -> WhatIf:
    """``w`` with its money computed from what was measured on real servers
    (``FORMULAS['measured']``): the time saving's lower bound, vLLM's own KV figures. A
    capping what-if, which frees nothing, keeps its zero and only takes the evidence; a
    measurement that cannot be adopted is put beside the estimate."""
    if m.status != "measured":
        w.ranked = False
        w.not_ranked = f"the variant {m.status.replace('_', ' ')}: nothing was measured"
        w.apply.supported = False
        w.apply.needs_change = (w.apply.needs_change + "; " if w.apply.needs_change else ""
                                ) + f"vLLM did not serve with these flags ({m.detail})"
        w.notes = [*w.notes, w.not_ranked]
        return w
    if not m.comparable:
        w.measured_beside = MeasuredBeside(
            time_saving=m.time_saving, time_saving_low=m.time_saving_low,
            time_saving_high=m.time_saving_high, kv_saving=m.kv_saving,
            verdict=_verdict(m.verdict), detail=m.detail, mismatch=m.mismatch)
        w.notes = [*w.notes, f"measured on another setup ({m.mismatch or 'not comparable'}):"
                   " shown beside the estimate, never adopted as its money"]
        return w
    verdict = _verdict(m.verdict)
    if w.id == "max_model_len" or w.kv_saving is None:
        w.evidence, w.evidence_detail, w.verdict = "measured", m.detail, verdict
        return w
    notes = list(w.notes)
    t, lo, hi = m.time_saving, m.time_saving_low, m.time_saving_high
    banked = max(0.0, lo) if lo is not None else 0.0
    if lo is None:
        notes.append(f"measured time saving {t:+.1%} has no interval (one round): the money "
                     "banks none of it")
    elif lo <= 0 <= (hi if hi is not None else lo):
        notes.append(f"the measured time saving's interval [{lo:+.1%}, {hi or lo:+.1%}] holds "
                     "0: the money banks none of it")
    elif lo > 0:
        notes.append(f"the money banks the interval's lower bound {lo:.1%} (point {t:.1%})")
    if t < 0:
        notes.append(f"measured slower: {-t:.1%} more model time per token than the baseline "
                     "(the money figures count no time saving)")
    evidence: Evidence = "measured"
    detail = m.detail
    s = w.kv_saving
    if m.kv_saving is not None:
        s = m.kv_saving
    elif w.kv_saving:
        # vLLM's capacity line is missing: the KV figure stays the estimate, and so does
        # the what-if's evidence.
        evidence = "estimated"
        detail = (f"KV saving estimated ({w.kv_saving:.0%}): vLLM's capacity line was "
                  f"missing; time measured: {m.detail}")
        notes.append("the KV saving is the estimate: vLLM's KV capacity figure was missing "
                     "from the measured run")
    if m.agreement_ok is False:
        notes.append("measured agreement is below the replay target: not ranked as a saving")
    out = fleet.what_if(w.id, w.title, w.formula, w.inputs, w.attention_flop_saving, s,
                        t, evidence, detail, _CONFIDENCE.get(verdict or "", "medium"),
                        w.apply, notes, banked=banked)
    out.alternative_to = list(w.alternative_to)
    out.validation = w.validation
    out.time_saving_low, out.time_saving_high, out.verdict = lo, hi, verdict
    if m.agreement_ok is False:
        out.ranked, out.not_ranked = False, "measured agreement below the replay target"
    return out


def _verdict(v: str) -> CheckVerdict | None:
    return v if v in ("confirmed", "off", "inconclusive") else None  # type: ignore[return-value]


def build_model_report(inp: CostInputs, settings: Settings, flags: FlagChecks) -> ModelReport:
    """The report section of one model: what-ifs ranked (``ranking``: their ids) and money.
    The savings lines are rendered from it by exporters/money.py."""
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
    warnings = list(inp.warnings)
    if inp.traffic.requests <= 0:
        warnings.append("no finished requests in the window: traffic, capacity and money "
                        "figures are missing")
    return ModelReport(model=inp.model, traffic=inp.traffic, time=inp.time, kv=inp.kv,
                       what_ifs=ws, money=_money(inp, fleet), warnings=warnings,
                       advice_basis=inp.basis or advice_basis(None, None, None),
                       ranked_by="autoscaled" if settings.autoscaled else "fixed_fleet",
                       ranking=[w.id for w in rank_savings(ws, settings.autoscaled)])
