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

from attnprof.contracts.base import Document, Fraction, Record
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.whatif import Validation

__all__ = [
    "Apply",
    "BackendTime",
    "ContextDistribution",
    "Drift",
    "Fallback",
    "KvMemory",
    "LayerTime",
    "ModelReport",
    "Money",
    "Report",
    "ReportSource",
    "TimeBreakdown",
    "Traffic",
    "UsagePoint",
    "WhatIf",
]


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
    """Tokens the KV cache holds (summed over replicas)."""
    capacity_sequences: dict[str, float]
    """Concurrent sequences at the observed p50 and p99 contexts (summed over replicas)."""
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
    """Sequences running at once at the peak (fleet-wide), and how it was obtained in
    ``peak_concurrency_basis``."""
    peak_concurrency_basis: str = ""
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
    """Replicas needed at the observed peak concurrency, now."""
    replicas_after: int | None
    time_saving: float | None
    """Share of model time saved (attention share x attention saving, per phase)."""
    gpu_hours_per_mtok_after: float | None
    cost_per_mtok_after: float | None
    monthly_saving: float | None
    """Money per month (with ``--gpu-hour-price``), else None."""
    monthly_gpu_hours_saved: float | None
    evidence: str
    """``replay``: a replay met its target (says which); ``estimated``: no replay."""
    confidence: str
    """``high``, ``medium`` or ``low``, with the reason in ``notes``."""
    apply: Apply
    notes: list[str] = field(default_factory=list)
    validation: Validation | None = None
    """The what-if measured on a real server (``attnprof whatif`` / ``report --validate``):
    predictions beside measurements, and whether any is off by more than its confidence."""


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


@dataclass
class ModelReport(Record):
    model: str
    traffic: Traffic
    time: TimeBreakdown
    kv: KvMemory
    what_ifs: list[WhatIf]
    money: Money
    savings: list[str] = field(default_factory=list)
    """The what-ifs with a saving, biggest first: one sentence each (what the demo prints)."""
    warnings: list[str] = field(default_factory=list)


@dataclass
class Report(Document):
    KIND = "attnprof.report"
    VERSION = (1, 0)

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
