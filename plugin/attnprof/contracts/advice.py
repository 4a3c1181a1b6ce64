"""Window advice: the bounded sliding-window suggestion for a model on its traffic.

Written into the live snapshot (``window_advice``), the demo report and profile.json (built
by :func:`attnprof.analyze.sparsity.recommend.export_summary`). Size is O(layers x grid
windows): no lengths of individual requests, no text.

When the advice cannot be computed (no local checkpoint, no finished requests yet) the live
snapshot carries :class:`AdviceUnavailable` instead, ``{"error": "..."}`` on the wire.

1.1 adds ``underused_heads`` (dormant / near-uniform / redundant heads with their KV share),
``heads_undecided`` and ``min_n_eff`` (the sampling error of the window decisions); 1.2 adds
``coverage``: the share of the traffic the advice stands on (statistics post-stratified to the
traffic's context buckets), the buckets too little covered to decide ("need more traffic at
> N tokens": the advice then windows nothing) and the dynamic KV heads kept full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from attnprof.contracts.base import Document, Fraction, NonNegative, Record

__all__ = [
    "AdviceCoverage",
    "AdviceTraffic",
    "AdviceUnavailable",
    "HeadLevelSplit",
    "LayerAdvice",
    "ParetoPoint",
    "ReplayEvidence",
    "UnderCoveredBucket",
    "UnderusedHead",
    "WindowAdvice",
]


@dataclass
class AdviceTraffic(Record):
    """The traffic the advice weighs savings by: request count and context-length quantiles."""

    requests: float
    """Requests (a weight: fractional when read from histogram buckets)."""
    p50: int
    p90: int
    p99: int
    max: int


@dataclass
class ReplayEvidence(Record):
    """Replay of prompts with the suggestion vs full attention (``validate-window``)."""

    agreement: Fraction
    """Greedy next-token agreement where the window binds."""
    mean_kl: float
    """Mean KL(full || windowed) in nats."""
    positions: NonNegative
    safe: bool
    verdict: str


@dataclass
class LayerAdvice(Record):
    """One layer: its window w*, whether the suggestion windows it, and head statistics."""

    layer: int
    window: int | Literal["full"] | None
    """Smallest grid window covering every KV head ("full": none does; null: no evidence)."""
    windowed: bool
    sink_mass: float | None
    classes: dict[str, int]
    """KV heads per class (sink, streaming, local, retrieval, ...)."""
    coverage_q: dict[str, float | None]
    """Worst KV head's low-quantile coverage per grid window (null: not every head sampled)."""


@dataclass
class ParetoPoint(Record):
    """One grid window as the recommendation scored it."""

    window: int
    sinks: int
    attention_flop_saving: Fraction
    kv_memory_saving: Fraction
    exact_request_fraction: Fraction
    heads_at_risk_count: int | None
    layers: int
    """Number of layers windowed at this window."""
    heads_undecided: int | None = None
    """KV heads undecided at this window (sampling error straddles the target)."""


@dataclass
class HeadLevelSplit(Record):
    """Savings if each KV head ran at its own window (streaming heads) and the rest full."""

    windowed_kv_heads: int
    attention_flop_saving: float
    kv_memory_saving: float
    note: str = ""


@dataclass
class UnderusedHead(Record):
    """A query head the head statistics find underused (docs/sparsity.md, "Underused
    heads"). Not a claim that it can go: ``safe`` is set only by an ``attnprof
    validate-heads`` replay, never by statistics alone."""

    kind: Literal["dormant", "near_uniform", "redundant"]
    layer: int
    head: int
    """Query head index in the layer."""
    kv_head: int
    twin: int | None
    """Redundant heads: the kept query head of the same layer whose attention it repeats."""
    kv_share: float | None
    """Share of the model's KV bytes this query head accounts for: its KV head's share
    divided evenly among the query heads that read that KV head."""
    kv_head_share: float | None
    """Share of the model's KV bytes its KV head holds (freed only when the whole group
    goes)."""
    queries: NonNegative
    """Sampled queries (dormant) or detail queries (near-uniform, redundant) behind it."""
    evidence: dict[str, float | bool | None]
    """The statistic against its threshold (sink-bound share, entropy, JS distance)."""
    confidence: str
    safe: bool = False


@dataclass
class UnderCoveredBucket(Record):
    """A context bucket holding a large share of the KV block-seconds whose own sample
    cannot decide the window for every KV head of the layers it would apply to."""

    bucket: int
    """Lower edge in tokens."""
    hi: int | None
    """Upper edge (exclusive; null: open)."""
    kv_share: Fraction
    undecided_kv_heads: NonNegative
    """KV heads whose sampling error (Wilson interval of the failing share) straddles the
    target here."""
    unmeasured_kv_heads: NonNegative
    """KV heads with too few eligible sampled queries here to count as evidence."""
    min_n_eff: float | None
    """Fewest effective sampled queries behind a decided KV head here."""


@dataclass
class AdviceCoverage(Record):
    """What the advice stands on: the traffic its statistics represent, and what they
    cannot decide."""

    folded_requests: NonNegative
    """Requests whose prompts the statistics folded."""
    traffic_requests: int | None
    """Finished requests of the traffic (null: no per-bucket counts)."""
    traffic_share: float | None
    """Share of the traffic's prompt tokens in context buckets that have statistics: what
    the corrected statistics stand for (null: no per-bucket counts)."""
    corrected: bool
    """Statistics weighted to the traffic's context buckets (post-stratified); false: the
    sample's own mix."""
    need_more_traffic_above: int | None = None
    """Set when a bucket holding >= 10% of the KV block-seconds is too little covered: the
    advice windows nothing and asks for more traffic above this many tokens."""
    under_covered: list[UnderCoveredBucket] | None = None
    dynamic_kv_heads: int | None = None
    """KV heads whose class changes across time windows or context buckets: kept full."""
    kv_heads: int | None = None
    dynamic_share: float | None = None
    kv_share: float | None = None
    """Share of the traffic's KV block-seconds in context buckets that have statistics
    (null: no per-bucket counts or times)."""
    rated_kv_heads: int | None = None
    """KV heads whose role two or more views decided (the evidence behind the dynamic
    count: 0 dynamic of 0 rated means too little traffic per view to tell)."""


@dataclass
class WindowAdvice(Document):
    """Sinks + sliding window suggested for the traffic, its savings and the evidence."""

    KIND = "attnprof.window_advice"
    VERSION = (1, 2)

    sinks: NonNegative
    window: int
    layers: list[int]
    """Layers the window applies to (empty: keep full attention)."""
    attention_flop_saving: Fraction
    """Cost-weighted share of attention FLOPs saved (ratio of expectations over requests)."""
    kv_memory_saving: Fraction
    exact_request_fraction: Fraction
    """Requests no longer than sinks + window: their output is unchanged."""
    heads_at_risk_count: int | None
    """KV heads whose coverage is below target (null: no head statistics)."""
    basis: str | None
    traffic: AdviceTraffic
    replay: ReplayEvidence | None
    safe: bool
    """True only when a replay met its target."""
    summary: str
    """The one-sentence suggestion printed by the demo and ``attnprof profile``."""
    per_layer: list[LayerAdvice] | None
    """Per layer (null without head statistics)."""
    head_stats_requests: int | None = None
    """Requests the head statistics were sampled from (live snapshot and demo)."""
    pareto: list[ParetoPoint] | None = None
    """Every grid window scored (demo report)."""
    head_level_split: HeadLevelSplit | None = None
    """Per-head windows instead of per-layer (demo report)."""
    underused_heads: list[UnderusedHead] | None = None
    """Dormant, near-uniform and redundant query heads found in the head statistics, with
    their KV shares (null: no head statistics; not replayed: ``safe`` is false)."""
    heads_undecided: dict[str, int] | None = None
    """KV heads of full-attention layers whose window decision the sample cannot make (the
    sampling error straddles the coverage target), per grid window; never windowed (null:
    no head statistics)."""
    min_n_eff: float | None = None
    """Fewest effective sampled queries behind a windowed layer's KV head (sampling error)."""
    coverage: AdviceCoverage | None = None
    """What share of the traffic the advice stands on, need-more-traffic buckets and the
    dynamic-head share (1.2; null: statistics not split by context bucket)."""


@dataclass
class AdviceUnavailable(Record):
    """Why there is no window advice yet (``{"error": ...}`` on the wire)."""

    error: str
