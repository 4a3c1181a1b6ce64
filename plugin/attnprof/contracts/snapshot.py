"""The live snapshot (``GET /attnprof/snapshot``, ``attnprof snapshot --json``) and its parts:
per-layer profiles from each worker, request statistics from the API server.

Field names are those of snapshot version 1 (attnprof 0.1), so readers of 1.0 documents keep
working; 1.1 adds ``WorkerSnapshot.schema_version``-free typing and ``RequestStats.quantiles``;
1.2 types ``window_advice``: an ``attnprof.window_advice`` document (carrying its own
``schema_version``) or ``{"error": ...}``, as before; 1.3 adds ``KernelGroup.predicted``,
``flash_attn_version`` and ``note``, ``LayerFacts.has_sink`` and ``attn_type`` and
``SamplerStats.throttles``, and
``KernelGroup.source`` names where the verdicts came from (vLLM itself on this device, or the
matrix derived from vLLM's code) instead of the platform class; 1.4 adds the top-level
``head_stats`` (merged across tensor/pipeline-parallel ranks by global layer and head),
``age_s`` and ``truncated`` (the API server serves bounded, cached snapshots); 1.5 adds
``provenance``, ``window`` (set by ``attnprof record``: the aggregates cover that window
only), ``PhaseStats.recent_time_s`` (the last calls' seconds, what ``attnprof diff`` tests)
and ``RequestStats.context_histogram`` (bucket counts: subtractable over a window, and the
distribution ``attnprof diff`` measures a shift on); 1.6 adds ``RequestStats.kv_pressure``
(KV usage over time, preemptions, waiting, block-seconds by length class, bytes per token
per layer, per KV head), the top-level ``kv_pressure`` verdict, each worker's bandwidth/matmul
``probe`` and the top-level ``roofline`` (``ATTNPROF_PROBE=1``), and ``window_advice`` 1.1;
1.7 adds the sampler's agreement across tensor-parallel ranks (``SamplerStats.step_index``,
``sync``, ``late_changes``, ``unsynced``, ``decisions_digest``, ``rate_changes``) and each
worker's ``poll_cost``; 1.8 adds ``restricted``: set on the answer a server with no API key
gives anyone, which holds only what ``/metrics`` shows, and says how to read the rest;
1.9 adds ``RequestStats.context_buckets`` (exact counts per head-statistics context bucket)
and ``coverage`` (what the head statistics folded per phase and bucket against the traffic,
and the heads whose class changes across time windows and buckets), and each
``KernelGroup``'s vLLM KV-cache group (``kv_group``, ``kv_spec``, ``sliding_window``,
``kv_block_size``, ``kv_bytes_per_token``), each layer's ``kv_group``, and the sampled steps
by CUDA graph mode (``SamplerStats.graph_modes``, ``graph_steered``), and each worker's
model ``runner`` (vLLM's V1 or V2 model runner, or one attnprof does not know, and whether its
steps are hooked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
from attnprof.contracts.base import Document, Fraction, Record
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.roofline import MemoryProbe, Roofline

__all__ = [
    "ContextBuckets",
    "ContextHistogram",
    "Coverage",
    "CoverageBucket",
    "HeadStability",
    "KernelGroup",
    "KvAssessment",
    "KvLayer",
    "KvPressureStats",
    "LayerAgreement",
    "LayerFacts",
    "LayerProfile",
    "PhaseCoverage",
    "PhaseStats",
    "PollCost",
    "ProcessNote",
    "QuantileSummary",
    "RecordWindow",
    "RequestStats",
    "RunnerReport",
    "SamplerStats",
    "Snapshot",
    "SnapshotErrors",
    "StepPhaseStats",
    "WorkerSnapshot",
]


@dataclass
class PhaseStats(Record):
    """One layer's attention on sampled steps of one phase (prefill, decode, mixed)."""

    calls: int = 0
    time_s: float = 0.0
    mean_time_s: float = 0.0
    tokens: int = 0
    flops: int = 0
    bytes: int = 0
    mean_batch_requests: float = 0.0
    mean_seq_len: float = 0.0
    max_seq_len: int = 0
    recent_time_s: list[float] = field(default_factory=list)
    """The last sampled calls' seconds, oldest first (at most 64; added in 1.5)."""


@dataclass
class LayerFacts(Record):
    """Static facts of one attention layer, read once when the model is built (capture keeps
    them as :class:`attnprof.aggregate.layers.LayerInfo`, this same field list)."""

    name: str
    index: int
    backend: str
    impl: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    sliding_window: int | None
    dtype: str
    kv_cache_dtype: str
    fused: bool
    kv_cache_bytes: int = 0
    scale: float = 0.0
    kernel: str | None = None
    """Kernel variant actually used (CPU ISA, FlashAttention version), seen on first call."""
    has_sink: bool = False
    """Learned attention-sink logits (GPT-OSS style); added in snapshot 1.3."""
    attn_type: str = "decoder"
    """vLLM's attention type: decoder, encoder, encoder_only, encoder_decoder (cross); added
    in snapshot 1.3."""
    kv_group: int | None = None
    """vLLM's KV-cache group of the layer (index in ``kv_cache_config.kv_cache_groups``);
    None before the KV cache exists or outside vLLM (added in 1.9)."""


@dataclass
class LayerProfile(LayerFacts):
    """One attention layer as the worker saw it: static facts and per-phase aggregates."""

    phases: dict[str, PhaseStats] = field(default_factory=dict)


@dataclass
class KernelGroup(Record):
    """Layers of one shape: the backend that ran and why each other vLLM backend did not."""

    layers: list[int]
    backend: str
    kernel: str | None
    fused: bool
    valid_backends: list[str] | None = None
    rejected: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    error: str | None = None
    # Added in 1.3: vLLM's own pick without --attention-backend, the FlashAttention version
    # vLLM resolves for this shape (the kernel field has the one that actually ran), and why
    # the verdicts may be partial.
    predicted: str | None = None
    flash_attn_version: int | None = None
    note: str | None = None
    kv_group: int | None = None
    """vLLM's KV-cache group of these layers (index in ``kv_cache_config.kv_cache_groups``:
    layers sharing one block table and spec); None before the KV cache exists (added in 1.9)."""
    kv_spec: str | None = None
    """The group's KV-cache spec: ``FullAttentionSpec``, ``SlidingWindowSpec``, ... (1.9)."""
    sliding_window: int | None = None
    """The layers' sliding window in tokens; None: full attention (1.9)."""
    kv_block_size: int | None = None
    """Tokens per KV-cache block of the group (1.9)."""
    kv_bytes_per_token: int | None = None
    """KV-cache bytes one token holds in these layers together: the spec's page size over
    its block size, per layer, summed (1.9)."""


@dataclass
class StepPhaseStats(Record):
    steps: int
    model_time_s: float
    attention_time_s: float
    attention_share: float | None


@dataclass
class SamplerStats(Record):
    seen: int = 0
    sampled: int = 0
    sampled_long: int = 0
    blind: int = 0
    unsampled: int = 0
    base_rate: float = 0.0
    effective_rate: float = 0.0
    budget: float = 0.0
    self_time_s: float = 0.0
    self_time_fraction: float = 0.0
    throttles: int = 0
    """Times the overhead budget cut the rate (added in snapshot 1.3)."""
    step_index: int = 0
    """Model steps this worker's sampler has decided, warm-ups included (1.7)."""
    sync: str = "solo"
    """How the budget's scale is agreed with the other tensor-parallel ranks: ``solo`` (no
    other rank), ``leader`` (announces it) or ``follower`` (applies the leader's) (1.7)."""
    late_changes: int = 0
    """Announced scale changes read after their step, or never read (overwritten before a
    follower reached a boundary): the ranks' decisions may differ (1.7)."""
    unsynced: int = 0
    """Epoch boundaries at which a follower could not read the leader's announcements (1.7)."""
    decisions_digest: str = ""
    """Digest of every sampled step index: ranks that decided alike show the same (1.7)."""
    rate_changes: list[list[float]] = field(default_factory=list)
    """The last changes of the budget's scale: ``[step index, scale]`` (1.7)."""
    graph_modes: dict[str, int] = field(default_factory=dict)
    """Sampled steps on a runner that can replay full CUDA graphs, by the graph mode they
    ran in: ``PIECEWISE`` or ``NONE`` (attention seen), ``FULL`` (blind: vLLM allowed no
    other mode) (1.9)."""
    graph_steered: int = 0
    """Of those, the steps vLLM would have replayed as a full graph, moved off it so that
    attention runs outside the graph (1.9)."""


@dataclass
class HeadStatsCost(Record):
    steps: int = 0
    requests: int = 0
    queries: int = 0
    time_s: float = 0.0
    prefill_time_s: float = 0.0
    fraction_of_prefill: float | None = None


@dataclass
class PollCost(Record):
    """What the API server's pulls cost this worker's engine, which waits for each answer
    (added in 1.7): the worker snapshot, and the head statistics (an O(1) swap; their
    serialization runs on a thread of its own, ``drain_s``)."""

    polls: int = 0
    last_s: float = 0.0
    max_s: float = 0.0
    last_head_stats_s: float = 0.0
    max_head_stats_s: float = 0.0
    drain_s: float = 0.0
    """The last head-statistics delta's serialization, off the engine's path."""
    delta_bytes: int = 0
    """Size of the last head-statistics delta."""


@dataclass
class RunnerReport(Record):
    """Which vLLM model runner this worker runs and whether attnprof sees its steps (1.9).

    ``runner``: ``v1`` (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``), ``v2`` (Model
    Runner V2, ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``: vLLM 0.32's GPU default
    with Triton) or ``unknown``; ``runner_class``: the runner's class name (a vLLM or platform
    class, no user data); ``hooked``: its steps reach attnprof's step hook; ``note``: what is
    unverified or why nothing is hooked."""

    runner: str = "unknown"
    runner_class: str = ""
    hooked: bool = False
    note: str | None = None


@dataclass
class WorkerSnapshot(Record):
    """Everything one worker process captured (``error`` set when it could not answer)."""

    pid: int
    process: str = ""
    layers: list[LayerProfile] = field(default_factory=list)
    kernel_map: list[KernelGroup] = field(default_factory=list)
    steps: dict[str, StepPhaseStats] = field(default_factory=dict)
    sampler: SamplerStats = field(default_factory=SamplerStats)
    errors: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    disabled: bool = False
    head_stats_cost: HeadStatsCost = field(default_factory=HeadStatsCost)
    poll_cost: PollCost = field(default_factory=PollCost)
    """What the API server's pulls cost the engine (1.7)."""
    head_stats: dict[str, Any] | None = None
    """Mergeable per-(layer, head) statistics per (phase, context bucket)
    (``HeadStatsStrata.to_dict``; a plain ``HeadStatsAccumulator.to_dict`` before issue 31)."""
    error: str | None = None
    probe: MemoryProbe | None = None
    """This worker's peak bandwidth and matmul FLOP/s (``ATTNPROF_PROBE=1``; null until the
    start-up probe has run)."""
    runner: RunnerReport | None = None
    """The model runner and whether its steps are hooked (1.9; null until the worker built
    its runner, and outside vLLM)."""


@dataclass
class QuantileSummary(Record):
    """p50/p90/p99 by the one estimator (:mod:`attnprof.aggregate.quantiles`)."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    max: float | None = None
    count: int = 0
    exact: bool = True
    """True while the sample is small enough to be kept whole (quantiles are exact)."""
    sketch: dict[str, Any] | None = None
    """Mergeable state (``QuantileEstimator.to_dict``), for fleet-wide merges."""


@dataclass
class RequestStats(Record):
    """Finished requests seen by the API server's stat logger (token counts only)."""

    requests: int
    max_model_len: int
    context_tokens: QuantileSummary
    prompt_tokens: QuantileSummary
    generation_tokens: QuantileSummary
    kv_cache_usage: float | None = None
    context_histogram: ContextHistogram | None = None
    """Context lengths of finished requests as bucket counts (1.5)."""
    kv_pressure: KvPressureStats | None = None
    """KV-cache usage over time, preemptions, waiting and block-seconds (1.6)."""
    context_buckets: ContextBuckets | None = None
    """Exact counts per head-statistics context bucket (1.9)."""


@dataclass
class KvLayer(Record):
    """KV-cache bytes one token costs in one attention layer (facts of the model and its KV
    dtype; every KV head of a layer holds the same bytes)."""

    layer: int
    num_heads: int
    num_kv_heads: int
    window: int | None
    """Sliding window (tokens kept per sequence); None: full attention."""
    bytes_per_token: float
    per_kv_head: float
    """Bytes per token of one KV head, shared by its query-head group."""
    per_query_head: float


@dataclass
class KvPressureStats(Record):
    """What the API server's stat logger saw of KV-cache pressure (docs/kv-pressure.md).

    Seconds and counts are running totals (``attnprof record`` subtracts them); ``peak`` and
    ``current`` cannot be subtracted. Usage seconds are time-weighted over busy time (at
    least one request running or waiting): ``usage_seconds[i]`` seconds were spent at usage
    in ``(usage_bounds[i-1], usage_bounds[i]]`` (the first bucket holds exactly 0)."""

    usage_bounds: list[float] = field(default_factory=list)
    usage_seconds: list[float] = field(default_factory=list)
    busy_seconds: float = 0.0
    peak: float | None = None
    current: float | None = None
    preemptions: int = 0
    """Sum of vLLM's ``num_preempted_reqs`` (the same count as ``vllm:num_preemptions``)."""
    waiting_seconds: float = 0.0
    """Busy seconds with at least one request waiting for capacity (vLLM's
    ``num_waiting_reqs``, not deferred ones)."""
    waiting_kv_high_seconds: float = 0.0
    """Of ``waiting_seconds``, those with KV usage above 0.9."""
    saturated_seconds: float = 0.0
    """Busy seconds with ``max_num_seqs`` requests running (the batch is full)."""
    running_request_seconds: float = 0.0
    """Time integral of running requests (mean running batch = this / busy_seconds)."""
    max_num_seqs: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_dtype: str | None = None
    layers: list[KvLayer] = field(default_factory=list)
    class_names: list[str] = field(default_factory=list)
    class_bounds: list[int] = field(default_factory=list)
    """Upper context length of each class but the last (which is above the last bound)."""
    class_requests: list[int] = field(default_factory=list)
    class_block_seconds: list[float] = field(default_factory=list)
    """Estimated KV block-seconds held by finished requests of each class."""


@dataclass
class KvAssessment(Record):
    """Whether a server is KV-bound (analyze/kv_pressure.py: rules, thresholds, evidence)."""

    verdict: str
    """``kv_bound``, ``compute_bound`` or ``neither``."""
    confidence: str
    """``high`` (enough busy time and requests), ``low`` otherwise."""
    evidence: list[str] = field(default_factory=list)
    busy_seconds: float = 0.0
    peak: float | None = None
    p95: float | None = None
    above_90_seconds: float = 0.0
    above_90_fraction: float | None = None
    preemptions: int = 0
    waiting_fraction: float | None = None
    mean_running: float | None = None
    capacity_tokens: int | None = None
    capacity_sequences: dict[str, float] = field(default_factory=dict)
    """Maximum concurrent sequences at the observed p50 and p99 contexts (keys p50, p99)."""
    context_tokens: dict[str, float] = field(default_factory=dict)
    class_share: dict[str, float] = field(default_factory=dict)
    """Each request-length class's share of KV block-seconds."""
    top_layers: list[int] = field(default_factory=list)
    """Layers holding the most KV at the p99 context (full attention or larger windows)."""
    layer_share: dict[str, float] = field(default_factory=dict)
    """Share of the KV each layer holds at the p99 context (key: layer index)."""
    head_bytes_peak: dict[str, float] = field(default_factory=dict)
    """KV bytes each KV head (shared by its query-head group) of each layer held at peak
    usage, the cache split by layer shares at the p50 context (key: layer index)."""


@dataclass
class ContextHistogram(Record):
    """Cumulative-free bucket counts: ``counts[i]`` requests had a context length
    <= ``bounds[i]`` and > ``bounds[i-1]``; the last count is above the last bound."""

    bounds: list[float]
    counts: list[int]


@dataclass
class ContextBuckets(Record):
    """Exact per-context-bucket counts of the finished requests (the API server's stat
    logger), on the buckets the head statistics are stratified by (1.9). Bucket ``i`` holds
    contexts in [``edges[i]``, ``edges[i+1]``), the last one is open; bucket 0 ("short") is
    every context below the statistics' minimum ``min_tokens``."""

    edges: list[int]
    min_tokens: int
    requests: list[int]
    """Finished requests by prompt length."""
    kv_block_seconds: list[float]
    """Estimated KV block-seconds by context (:func:`attnprof.aggregate.requests.
    bucket_block_seconds`: the prompt over its prefill time, the growing context over the
    decode time)."""
    prompt_tokens: list[int] | None = None
    """Prompt tokens (prefill queries) by prompt length (withheld without a key: a bucket's
    sum is a lone request's length)."""
    decode_tokens: list[int] | None = None
    """Decode queries by the context each one sees (a request's generation split exactly
    across the buckets it passes through; withheld without a key)."""


@dataclass
class CoverageBucket(Record):
    """One (phase, context bucket): what the head statistics folded against the traffic."""

    phase: str
    """``prefill`` or ``decode``."""
    bucket: int
    """The bucket's lower edge in tokens (0: short prompts under the minimum)."""
    hi: int | None
    """Its upper edge (exclusive; null: open)."""
    traffic_requests: int
    """Finished requests whose prompt length falls in this bucket (on decode rows too: the
    decode queries themselves are ``traffic_queries``, by the context each saw)."""
    kv_share: float | None
    """Share of the traffic's KV block-seconds in this bucket (null: no times yet)."""
    folded_requests: int
    """Requests the statistics folded here (decode: as the worker counts its decode folds)."""
    sampled_queries: int
    """Queries whose softmax rows were recomputed (raw count)."""
    request_share: float | None
    """folded / traffic requests, prefill rows only (null: no traffic here)."""
    weight: float | None
    """Post-stratification factor applied to this stratum (traffic share / sampled share;
    null: not part of the corrected statistics)."""
    query_share: float | None = None
    """folded / traffic query tokens, at most 1 (null: no traffic here). The one token
    figure shown without a key: the two sums are a lone request's length."""
    traffic_queries: int | None = None
    """Query tokens the traffic had here: prompt tokens (prefill) or decode queries
    (withheld without a key)."""
    folded_queries: float | None = None
    """Query tokens the folded requests stand for (sum of the sample's weights; withheld
    without a key)."""


@dataclass
class PhaseCoverage(Record):
    """One phase's coverage in a line: what the corrected statistics stand on."""

    phase: str
    folded_requests: int
    traffic_requests: int
    traffic_query_share: float | None
    """Share of the phase's query tokens in buckets that have statistics: what the
    corrected statistics represent (null: no traffic counts)."""


@dataclass
class LayerAgreement(Record):
    """Agreement of one layer's KV-head classes across the stability views."""

    layer: int
    kappa: float | None
    """Fleiss' kappa over the views' classes (null: undefined, e.g. fewer than two rated
    views or a single class everywhere)."""
    agreement: float | None
    """Observed share of agreeing view pairs (Fleiss' P-bar)."""
    rated_kv_heads: int
    dynamic_kv_heads: list[int]


@dataclass
class HeadStability(Record):
    """Head classes over disjoint time windows and context buckets (1.9)."""

    views: list[str]
    """The views compared: ``epoch:<i>`` (time windows) and ``<phase>:<bucket>``."""
    kv_heads: int
    dynamic_kv_heads: int
    dynamic_share: Fraction
    """Dynamic KV heads over all KV heads: they get no window."""
    layers: list[LayerAgreement]


@dataclass
class Coverage(Record):
    """Coverage per context bucket and phase, and head stability (snapshot 1.9)."""

    min_tokens: int
    buckets: list[CoverageBucket]
    phases: list[PhaseCoverage]
    stability: HeadStability | None = None


@dataclass
class RecordWindow(Record):
    """What ``attnprof record`` measured: the server's aggregates between two snapshots."""

    start: float
    end: float
    duration_s: float
    requests: int = 0
    note: str = ""


@dataclass
class ProcessNote(Record):
    role: str
    pid: int
    process: str = ""
    started_at: float = 0.0
    alive: bool = False


@dataclass
class SnapshotErrors(Record):
    api_server: dict[str, int] = field(default_factory=dict)
    collective_rpc: str | None = None


@dataclass
class Snapshot(Document):
    """One live server: every worker's layers, the request statistics, window advice."""

    KIND = "attnprof.snapshot"
    VERSION = (1, 9)

    time: float
    model: str
    enabled: bool
    processes: list[ProcessNote] = field(default_factory=list)
    roles_here: list[str] = field(default_factory=list)
    workers: list[WorkerSnapshot] = field(default_factory=list)
    requests: RequestStats | None = None
    errors: SnapshotErrors = field(default_factory=SnapshotErrors)
    window_advice: WindowAdvice | AdviceUnavailable | None = None
    """Window advice for this traffic, or ``{"error": ...}`` saying what is missing."""
    head_stats: dict[str, Any] | None = None
    """Every worker's head statistics merged by global layer and head index (only when asked
    for: ``/attnprof/snapshot?head_stats=1``); added in snapshot 1.4. Since issue 31 one
    accumulator per (phase, context bucket), schema ``attnprof.head_strata/1``
    (``HeadStatsStrata.load`` also reads the single accumulator of earlier versions)."""
    age_s: float | None = None
    """Age of the workers' data when served from the API server's cache (1.4)."""
    truncated: str | None = None
    """Set when something was left out to keep the body bounded, saying what (1.4)."""
    provenance: Provenance | None = None
    """Versions, hardware, model hashes, git revision, command line, time (1.5)."""
    window: RecordWindow | None = None
    """Set by ``attnprof record``: counters cover this window only (1.5)."""
    kv_pressure: KvAssessment | None = None
    """KV-bound, compute-bound or neither, with the evidence (1.6)."""
    roofline: Roofline | None = None
    """Each phase's attention against the first worker's probed peaks (``ATTNPROF_PROBE=1``)."""
    restricted: str | None = None
    """Set when the server has no API key: this answer holds only what ``/metrics`` shows
    (no exact request lengths, per-step lengths or timings, head statistics, provenance or
    error text), and this says how to read the rest (1.8)."""
    coverage: Coverage | None = None
    """Head-statistics coverage per (phase, context bucket) against the traffic, and head
    stability across time windows and buckets (1.9)."""
