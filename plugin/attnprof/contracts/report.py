"""The cost-optimization report (``attnprof report`` -> report.json; report.html and report.md
are renderings of this same document).

One :class:`ModelReport` per model: traffic, where attention time goes, KV memory, what-ifs
(each with its formula, inputs, evidence, confidence and how to apply it) and money. Every
number is either measured (from the source) or derived by a formula the appendix prints;
``None`` means the source does not have it, never zero. No prompt text, token ids or request
ids: only counts, rates, quantiles and histogram buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from attnprof.contracts.base import Document, Fraction, Record
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.whatif import CheckVerdict, Validation

__all__ = [
    "AdviceBasis",
    "Apply",
    "BackendTime",
    "BasisBucket",
    "BasisPhase",
    "ContextDistribution",
    "Drift",
    "Evidence",
    "Fallback",
    "FleetSaving",
    "KvMemory",
    "LayerTime",
    "MeasuredBeside",
    "ModelReport",
    "Money",
    "RankedBy",
    "Report",
    "ReportSource",
    "Scope",
    "TimeBreakdown",
    "Traffic",
    "UsagePoint",
    "WhatIf",
]


Evidence = Literal["measured", "replay", "estimated"]
"""What a what-if's numbers rest on: ``measured`` (attnprof timed both paths), ``replay`` (a
replay of real prompts through the change met its target), ``estimated`` (a model over the
measured inputs, nothing run with the change)."""

RankedBy = Literal["fixed_fleet", "autoscaled"]
"""Which money figure ranks the savings list: a fixed replica count (whole replicas
removed) or an autoscaled fleet (the fractional share, ``attnprof report --autoscaled``)."""

Scope = Literal["replica", "fleet"]
"""Whose figures a source measured: ``replica`` (one server: a live snapshot or saved files)
or ``fleet`` (summed over every replica: Prometheus)."""


@dataclass
class ReportSource(Record):
    kind: str
    """``live`` (a server's snapshot), ``prometheus`` (a fleet) or ``files``."""
    where: list[str]
    """URL(s) or file paths read (no credentials)."""
    start: float | None = None
    """Unix time the data window starts (None: since the server started)."""
    end: float | None = None
    duration_s: float | None = None
    """Seconds of data the rates are over."""
    range: str | None = None
    """The ``--range`` asked for (Prometheus)."""


@dataclass
class Drift(Record):
    """The context-length distribution in the first vs the second half of the window."""

    first_p50: float | None
    second_p50: float | None
    first_p99: float | None
    second_p99: float | None
    shift: str
    """One sentence: stable, or which way it moved and by how much."""


@dataclass
class ContextDistribution(Record):
    bounds: list[float]
    """Upper edges of the buckets (tokens); the last count is above the last edge."""
    counts: list[float]
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    p999: float | None = None
    max: float | None = None
    mean: float | None = None
    """Mean context (histogram sum / count: exact from either source)."""
    estimated_from_buckets: bool = False
    """True when the quantiles are interpolated in histogram buckets (Prometheus), False
    when they are the estimator's own (a live snapshot)."""


@dataclass
class Traffic(Record):
    requests: float
    """Finished requests in the window."""
    requests_per_s: float | None
    tokens_per_s: float | None
    """Prompt + generated tokens of finished requests per second."""
    prompt_tokens: float
    generation_tokens: float
    max_model_len: int | None
    context: ContextDistribution
    drift: Drift | None = None
    scope: Scope = "fleet"
    """Whose rates these are, and whose KV capacity and peak concurrency (``KvMemory``):
    ``replica`` (one server's: the fleet's are x replicas, assuming equally loaded
    replicas) or ``fleet`` (summed over the replicas counted)."""


@dataclass
class LayerTime(Record):
    layer: str
    backend: str
    fused: bool
    time_s: float
    share: Fraction
    """Share of all sampled attention time."""


@dataclass
class BackendTime(Record):
    backend: str
    phase: str
    time_s: float
    share: Fraction


@dataclass
class Fallback(Record):
    """Layers that ran an unfused path, the change that fixes it and what it gains."""

    layers: list[str]
    backend: str
    reason: str
    fix: str
    gain: str
    """Measured gain when the source measured both paths, else the analytic estimate,
    labelled as such."""


@dataclass
class TimeBreakdown(Record):
    attention_share: dict[str, float]
    """Attention's share of sampled model time, by phase."""
    model_time_s: dict[str, float]
    """Sampled model time by phase (the share's denominator)."""
    by_backend: list[BackendTime] = field(default_factory=list)
    per_layer: list[LayerTime] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    overall_share: float | None = None
    """Attention's share of all sampled model time."""


@dataclass
class UsagePoint(Record):
    t: float
    usage: Fraction


@dataclass
class KvMemory(Record):
    bytes_per_token: float | None
    kv_dtype: str | None
    capacity_tokens: float | None
    """Tokens the KV cache holds (summed over replicas, or one replica's: ``Traffic.scope``)."""
    capacity_sequences: dict[str, float]
    """Concurrent sequences at the observed p50 and p99 contexts (same scope)."""
    usage_p95: float | None
    usage_peak: float | None
    above_90_fraction: float | None
    preemptions: float | None
    waiting_fraction: float | None
    verdict: str | None
    verdict_evidence: list[str] = field(default_factory=list)
    source: str = "attnprof"
    """Where the usage and preemption figures come from: ``vllm`` (its own scheduler stats
    or ``vllm:*`` series) or ``attnprof``."""
    usage_over_time: list[UsagePoint] = field(default_factory=list)
    peak_concurrency: float | None = None
    """Sequences running at once at the peak (fleet-wide, or one replica's:
    ``Traffic.scope``), and how it was obtained in ``peak_concurrency_basis``."""
    peak_concurrency_basis: str = ""
    held_peak_tokens: float | None = None
    """KV tokens held at the busiest moment, summed over the replicas at the same instant
    (Prometheus; None elsewhere: one server's figure is ``usage_peak`` x capacity)."""
    mean_running: float | None = None
    """Mean requests running while the engine was busy (the stat logger's aggregate; None
    from Prometheus): the concurrency ``attnprof whatif`` replays."""


@dataclass
class Apply(Record):
    """How to apply a what-if, checked against the installed vLLM."""

    flags: list[str]
    """Exact vLLM command-line flags (or HF config overrides) to add."""
    supported: bool | None
    """True when the installed vLLM accepts these flags for this model family; None when it
    could not be checked (the family is unknown to the source, or vLLM is not installed)."""
    needs_change: str | None
    """Set when applying it needs a model or kernel change no flag gives (said plainly)."""
    checked_against: str
    """What the flags were checked against (e.g. ``vllm 0.32.0``, or why not checked)."""


@dataclass
class FleetSaving(Record):
    """A what-if's saving on an autoscaled fleet: GPU-hours follow load, so a fraction of a
    replica counts (what a fixed replica count can bank is on :class:`WhatIf` itself)."""

    share: Fraction
    """Share of GPU-hours saved: the KV saving s on a KV-bound fleet, else the time saving t
    (a measured one's lower bound; a KV saving capped by compute headroom)."""
    monthly_gpu_hours_saved: float | None
    """share x the fleet's MEAN replicas x GPUs per replica x hours; None when the mean
    replicas are not known (neither Prometheus nor ``--mean-replicas``): an autoscaled fleet
    is billed for the replicas it runs on average, never the counted fleet's size."""
    monthly_saving: float | None
    """Money per month (with ``--gpu-hour-price``), else None."""
    gpu_hours_per_mtok_after: float | None
    cost_per_mtok_after: float | None
    assumes: str
    """One sentence: what this figure assumes (which saving sizes the fleet, and why)."""
    gpu_hours_saved_per_replica_month: float | None = None
    """share x GPUs per replica x hours: the saving per replica running all month (what
    is known when the mean replicas are not)."""


@dataclass
class MeasuredBeside(Record):
    """A measurement that cannot be adopted as the what-if's money (another device, dtype
    or scheduler budget than the source's), shown beside the estimate."""

    time_saving: float
    time_saving_low: float | None
    time_saving_high: float | None
    kv_saving: float | None
    verdict: CheckVerdict | None
    detail: str
    mismatch: str
    """What differs from the source (e.g. ``cpu float32 vs cuda bfloat16``)."""


@dataclass
class WhatIf(Record):
    id: str
    """``window``, ``head_split``, ``fp8_kv``, ``max_model_len``, ``fallback``."""
    title: str
    formula: str
    """The formula the numbers come from (printed in the report)."""
    inputs: dict[str, float | str | None]
    attention_flop_saving: float | None
    kv_saving: float | None
    """Share of KV bytes per token freed."""
    kv_bytes_freed_per_token: float | None
    extra_sequences: float | None
    """Extra concurrent sequences at the observed mean context (fleet): capacity in tokens /
    mean KV tokens per sequence, before and after."""
    replicas_now: int | None
    """Replicas needed at the observed peak concurrency, now (may exceed those counted: the
    fleet is then short of KV capacity at its peak, and the notes say so)."""
    replicas_after: int | None
    time_saving: float | None
    """Share of model time saved (attention share x attention saving, per phase)."""
    gpu_hours_per_mtok_after: float | None
    """At a fixed fleet: the replicas counted minus ``replicas_removed``."""
    cost_per_mtok_after: float | None
    monthly_saving: float | None
    """Money per month at a fixed fleet (with ``--gpu-hour-price``), else None."""
    monthly_gpu_hours_saved: float | None
    """GPU-hours per month a fixed fleet saves: whole replicas removed (``replicas_removed``
    / replicas counted); None when it cannot be computed (the notes say why)."""
    evidence: Evidence
    confidence: str
    """``high``, ``medium`` or ``low``, with the reason in ``notes``."""
    apply: Apply
    notes: list[str] = field(default_factory=list)
    evidence_detail: str = ""
    """What the evidence is, in words (the replay's agreement, the measured speed-up)."""
    replicas_removed: int | None = None
    """Whole replicas a fixed fleet removes (never more than those counted); None when it
    cannot be computed (a KV-bound fleet without its peak concurrency)."""
    autoscaled: FleetSaving | None = None
    """The same saving on an autoscaled fleet (fractional replicas); None when the what-if
    has no figure (a fallback without a measured time saving)."""
    alternative_to: list[str] = field(default_factory=list)
    """Ids of what-ifs this one replaces (a layer window vs per-head windows): their savings
    are not additive."""
    validation: Validation | None = None
    """The what-if measured on a real server (``attnprof whatif`` / ``report --validate``):
    predictions beside measurements, and whether any is off by more than its confidence."""
    time_saving_low: float | None = None
    """95% interval of a measured time saving (None: an estimate, or no interval)."""
    time_saving_high: float | None = None
    banked_time_saving: float | None = None
    """The time saving the money figures use: the estimate's, or a measured one's lower
    bound (0 when its interval holds 0 or it has none)."""
    verdict: CheckVerdict | None = None
    """The measurement's verdict (None: not measured)."""
    ranked: bool = True
    """False: never ranked as a saving (``not_ranked`` says why: the variant could not
    start, its measured agreement is below the replay target, a quality check fails)."""
    not_ranked: str = ""
    compute_floor: int | None = None
    """Replicas the fleet's tokens/s needs (ceil(fleet tokens/s / one replica's maximum, or
    its observed rate)): a KV saving never takes the fleet below it."""
    measured_beside: MeasuredBeside | None = None
    """A measurement not comparable with the source, shown beside the estimate."""


@dataclass
class Money(Record):
    gpu_hour_price: float | None
    replicas: int
    replicas_basis: str
    """``--replicas``, ``counted from Prometheus`` or ``one server``."""
    gpus_per_replica: float
    gpu_hours_per_mtok: float | None
    """GPU-hours per million tokens at the observed rate (a replica's workers x hours)."""
    cost_per_mtok: float | None
    monthly_gpu_hours: float
    monthly_cost: float | None
    hours_per_month: float = 730.0
    note: str = ""
    mean_replicas: float | None = None
    """The fleet's mean replicas over the range (Prometheus) or ``--mean-replicas``: the
    autoscaled figures' base (None: not known, the autoscaled money is not computable)."""
    mean_replicas_basis: str = ""
    replica_max_tokens_per_s: float | None = None
    """One replica's tokens/s at saturation when known (else the observed per-replica rate
    caps KV savings: measure at saturation)."""


@dataclass
class BasisPhase(Record):
    """One phase of one context bucket: the traffic's queries against what the head
    statistics folded there."""

    traffic_queries: int | None
    """Query tokens the traffic had: prompt tokens (prefill) or decode queries (null:
    withheld, a server read without its key)."""
    folded_requests: int
    """Requests (decode: sequences) the statistics folded here."""
    folded_queries: float | None
    """Query tokens the folded requests stand for (the sample's sum of weights)."""
    query_share: float | None
    """folded / traffic query tokens, at most 1 (null: no traffic here)."""
    weight: float | None
    """The post-stratification factor the advice's statistics applied here (null: not part
    of the corrected statistics)."""


@dataclass
class BasisBucket(Record):
    """One context bucket of the traffic, prefill and decode side by side."""

    bucket: int
    """Lower edge in tokens (0: the short prompts under the statistics' minimum)."""
    hi: int | None
    """Upper edge (exclusive; null: open)."""
    traffic_requests: int
    """Finished requests whose prompt falls here."""
    kv_block_seconds: float | None
    """The traffic's KV block-seconds here (null: not known)."""
    kv_share: float | None
    """Share of all the traffic's KV block-seconds."""
    prefill: BasisPhase | None
    decode: BasisPhase | None
    """Null where the source has no decode coverage."""


@dataclass
class AdviceBasis(Record):
    """What the window advice stands on: the head statistics' coverage per context bucket
    against the traffic, the need-more-traffic verdict, and the dynamic heads kept full
    (issue 31, points 3 and 4). From a snapshot's ``coverage`` and the advice's own
    ``coverage``; counts and shares only."""

    available: bool
    """False: the source has no coverage (a snapshot from before 1.9, Prometheus, or no
    statistics and no per-bucket counts yet); ``stands_on`` then says so."""
    stands_on: str
    """One sentence: what share of the traffic the window advice stands on (or why it is
    not known)."""
    min_tokens: int | None = None
    """The statistics' minimum prompt length: bucket 0 holds the prompts below it."""
    buckets: list[BasisBucket] = field(default_factory=list)
    folded_requests: int | None = None
    """Requests whose prompts the statistics folded (all buckets)."""
    traffic_requests: int | None = None
    prefill_query_share: float | None = None
    """Share of the traffic's prompt tokens in buckets that have statistics."""
    decode_query_share: float | None = None
    """The same for decode queries (null: no decode statistics)."""
    kv_share: float | None = None
    """Share of the traffic's KV block-seconds in buckets that have statistics."""
    corrected: bool | None = None
    """The statistics were weighted to the traffic's buckets (post-stratified)."""
    need_more_traffic_above: int | None = None
    """Set when a bucket with >= 10% of the KV block-seconds is too little covered: the
    advice windows nothing and asks for more traffic above this many tokens."""
    need_more_traffic: str | None = None
    """The verdict in words, naming the bucket and its KV share."""
    dynamic_kv_heads: int | None = None
    """KV heads whose class changes across time windows or context buckets (kept full)."""
    kv_heads: int | None = None
    dynamic_share: float | None = None
    rated_kv_heads: int | None = None
    """KV heads two or more views decided (0 dynamic of 0 rated: too little traffic per
    view to tell, not stability)."""
    stability_views: int | None = None
    """Views (time windows, context buckets) the head classes were compared over."""


@dataclass
class ModelReport(Record):
    model: str
    traffic: Traffic
    time: TimeBreakdown
    kv: KvMemory
    what_ifs: list[WhatIf]
    money: Money
    savings: list[str] = field(default_factory=list)
    """The what-ifs with a saving, biggest first by ``ranked_by``: one sentence each, with
    both the fixed-fleet and the autoscaled figure (what the demo prints), rendered from the
    what-ifs by exporters/money.py (``ranking`` holds their ids)."""
    warnings: list[str] = field(default_factory=list)
    ranked_by: RankedBy = "fixed_fleet"
    """Which figure ranks ``savings``: the fixed fleet's, or the autoscaled one."""
    advice_basis: AdviceBasis | None = None
    """What the window advice stands on (2.1; null: a report from before it)."""
    ranking: list[str] = field(default_factory=list)
    """Ids of the what-ifs with a saving, biggest first (2.2): the typed order ``savings``
    is rendered in."""
    noise_floor: Validation | None = None
    """The measured run's A/A arm (2.2): a second baseline instance checked like a variant
    against a change of 0, its throughput interval the floor under every measured change."""


@dataclass
class Report(Document):
    KIND = "attnprof.report"
    VERSION = (2, 2)
    # 2.0: WhatIf.evidence is a kind (measured/replay/estimated; its text moved to
    # evidence_detail) and the top-level money fields are a fixed fleet's (whole replicas).
    # 2.1: ModelReport.advice_basis (coverage per context bucket, dynamic heads).
    # 2.2: WhatIf.validation carries three-state verdicts (Check/Validation.verdict:
    # confirmed/off/inconclusive), the band's basis and the run's MDE; money with its
    # interval (WhatIf.time_saving_low/high, banked_time_saving, verdict, ranked,
    # compute_floor, measured_beside; Money.mean_replicas; an autoscaled figure without
    # the mean replicas is null; ModelReport.ranking); ModelReport.noise_floor (the A/A).

    generated_at: float
    source: ReportSource
    models: list[ModelReport]
    formulas: dict[str, str]
    """Every formula the what-ifs use, by name (the appendix)."""
    versions: dict[str, str | None]
    """attnprof, vLLM, torch, transformers the report was made with (and the servers')."""
    provenance: Provenance | None = None
    """The measured run's provenance when the source carries it."""
    report_seconds: float | None = None
    """Wall time to build the report."""
