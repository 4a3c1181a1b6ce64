"""A measured what-if (``attnprof whatif`` -> whatif.json) and the check of a prediction
against it, as the cost report carries it.

A run starts a baseline vLLM server and, one at a time, a variant server with a what-if's flag
beside it, replays one traffic shape on both in alternating paired rounds and records what each
arm measured. Every change is relative to the baseline and carries a 95% interval over the
paired rounds. 1.1 adds what the statistics of :mod:`attnprof.analyze.measure_stats` need
(per-request latencies paired by round and index, the instance that served each round, the
first-divergence position per agreement prompt), an A/A control arm, and the run's own
hardware and provenance. No prompt or completion text, token ids or request ids: counts, rates,
latencies and agreement shares only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from attnprof.contracts.base import Document, Record
from attnprof.contracts.provenance import Provenance

__all__ = [
    "Agreement",
    "ArmStats",
    "Check",
    "CheckVerdict",
    "Interval",
    "RunHardware",
    "TrafficShape",
    "Validation",
    "VariantResult",
    "VariantStatus",
    "WhatifRun",
]

VariantStatus = Literal["measured", "could_not_start", "failed"]
CheckVerdict = Literal["confirmed", "off", "inconclusive"]
"""confirmed: the 95% interval lies inside the prediction's band; off: wholly outside it;
inconclusive: anything else (it straddles an edge, there is no interval, one round)."""


@dataclass
class Interval(Record):
    """A relative change (variant / baseline - 1) with its 95% interval: throughput from the
    paired rounds' log-ratios (with the instance floor), a latency quantile from the pooled
    per-request values' paired bootstrap (1.0 files: a Student-t interval of the per-round
    changes); low = high = mean with one round."""

    mean: float
    low: float
    high: float
    rounds: int


@dataclass
class TrafficShape(Record):
    """The traffic both arms replay, drawn from what attnprof recorded."""

    source: str
    """Where the shape came from (a file path or URL, no credentials)."""
    concurrency: int
    """Requests kept in flight (closed loop)."""
    concurrency_basis: str
    prompt_quantiles: dict[str, float]
    """Prompt tokens at the quantiles the record has (``p50``, ``p90``, ``p99``, ``max``)."""
    output_tokens: int
    """Tokens generated per request (the recorded mean; EOS ignored so both arms match)."""
    max_prompt_tokens: int
    """Longest prompt replayed (the baseline's max_model_len minus the output)."""


@dataclass
class ArmStats(Record):
    """What one arm measured over all its rounds."""

    requests: int
    refused: int
    """Requests the server refused (HTTP 400: longer than its max_model_len)."""
    tokens_per_s: list[float | None]
    """Prompt + generated tokens per second of wall time, one value per round (None: the
    round had nothing to measure, every request refused)."""
    ttft_p50_s: list[float | None]
    ttft_p99_s: list[float | None]
    itl_p50_s: list[float | None]
    itl_p99_s: list[float | None]
    preemptions: float | None
    """vLLM's ``vllm:num_preemptions_total`` increase over the rounds (None: not exported)."""
    ttft_per_request_s: list[list[float | None]] = field(default_factory=list)
    """Per round, each request's time to first token in the round's request order (None:
    refused or failed). Both arms of a pair replay the same requests in the same order, so
    (round, index) pairs a request across arms (1.1; empty in older files)."""
    itl_per_request_s: list[list[float | None]] = field(default_factory=list)
    """Per round, each request's mean inter-token gap, paired like ``ttft_per_request_s``."""
    instances: list[int] = field(default_factory=list)
    """Per round, which server instance of this arm served it (0-based; empty: one)."""


@dataclass
class Agreement(Record):
    """Greedy agreement and KL of the variant against the baseline on a held-out sample."""

    samples: int
    positions: int
    """Generated positions compared: each sample up to and including its first
    disagreement (after it the two continuations have different prefixes)."""
    greedy_agreement: float
    mean_kl: float | None
    """Mean KL(baseline || variant) over the compared positions, on the top-k log-probs
    vLLM returns (the rest of each distribution lumped into one bucket): a lower bound."""
    top_k: int
    diverged_at: list[int | None] = field(default_factory=list)
    """Per prompt, the index of the first generated token that differs (None: none within
    ``compared_tokens``); 1.1, empty in older files."""
    compared_tokens: int = 0
    """Generated tokens compared per prompt."""


@dataclass
class VariantResult(Record):
    what_if: str
    """The what-if's id in the report (``fp8_kv``, ``max_model_len``, ``window``...) or
    ``custom`` for a ``--variant``."""
    flags: list[str]
    status: VariantStatus
    reason: str | None = None
    """One line: vLLM's reason when the variant could not start or a round failed."""
    kv_capacity_tokens: int | None = None
    """vLLM's own figure from the variant's log ("KV cache size: N tokens")."""
    baseline_kv_capacity_tokens: int | None = None
    rounds: int = 0
    baseline: ArmStats | None = None
    variant: ArmStats | None = None
    changes: dict[str, Interval] = field(default_factory=dict)
    """Relative change per metric: ``tokens_per_s``, ``ttft_p50``, ``ttft_p99``,
    ``itl_p50``, ``itl_p99`` (a quantile of too few requests is absent:
    :func:`attnprof.analyze.whatif.measured_changes`)."""
    agreement: Agreement | None = None
    seconds: float = 0.0
    control: bool = False
    """True for the A/A arm (``what_if`` ``aa``, no flags): a second baseline instance
    measured exactly like a variant. Every prediction for it is 0: its interval is the run's
    noise floor."""
    instances: int = 1
    """Instance pairs this variant's rounds ran on (a fresh pair per instance)."""


@dataclass
class RunHardware(Record):
    """What the run itself measured on (not the record's machine)."""

    device: str
    """``cpu`` or ``cuda``."""
    name: str | None = None
    """The CPU model or the GPU's name."""
    count: int = 1
    dtype: str | None = None
    """The dtype the servers served in."""
    vllm: str | None = None
    """The vLLM version the servers ran."""


@dataclass
class WhatifRun(Document):
    KIND = "attnprof.whatif"
    VERSION = (1, 1)
    # 1.1: per-request latencies, instances, the A/A arm (VariantResult.control), agreement
    # divergence positions, the run's own hardware/provenance beside the record's.

    time: float
    model: str
    baseline_flags: list[str]
    traffic: TrafficShape
    rounds: int
    duration_s: float
    """Seconds of traffic per arm per round."""
    variants: list[VariantResult]
    provenance: Provenance | None = None
    """The run's own provenance (1.0 files: the record's)."""
    seconds: float = 0.0
    max_model_len: int | None = None
    """Both servers' max_model_len (the variant's own when it sets one)."""
    in_flight_tokens: int | None = None
    """vLLM's max_num_batched_tokens for both servers (the flag when given, else the
    installed vLLM's default): a windowed layer reserves it on top of the window."""
    block_size: int | None = None
    """vLLM's KV block size for both servers (the flag when given, else its default)."""
    hardware: RunHardware | None = None
    """What the run measured on (1.1)."""
    source_provenance: Provenance | None = None
    """The recorded server's provenance (what the baseline's flags came from)."""
    baseline_basis: str = ""
    """Where the baseline's flags came from (the record's provenance, or defaults)."""
    mde: float | None = None
    """The minimum detectable throughput change asked for (``--mde``), as a share."""
    instances: int = 1
    """Instance pairs per arm (a fresh baseline beside each variant instance)."""
    device_plan: str = "side_by_side"
    """``side_by_side`` (both servers up at once: CPU) or ``turns`` (one server on the device
    at a time: a GPU)."""


@dataclass
class Check(Record):
    """One prediction of the report against what the run measured."""

    metric: str
    """``tokens_per_s``, ``itl_p50``, ``itl_p99``, ``kv_capacity``, ``refused_share`` or
    ``greedy_agreement``."""
    predicted: float | None
    """None: measured only (nothing predicts FP8's greedy agreement)."""
    band: float
    """The prediction's tolerance (absolute, in the metric's unit: a share of change or a
    share of requests): how accurate this kind of prediction has proven
    (``analyze/data/prediction_accuracy.json``; 1.0 files: from the what-if's confidence)."""
    measured: float | None
    low: float | None
    high: float | None
    """The measurement's 95% interval (equal to it for exact figures such as vLLM's KV
    capacity)."""
    off: bool
    """True when the interval lies wholly outside predicted +/- band (``verdict == "off"``)."""
    verdict: CheckVerdict = "inconclusive"
    """confirmed (the interval inside predicted +/- band), off (wholly outside), else
    inconclusive (and always with one round or no interval)."""
    note: str = ""
    """Why there is no interval or verdict, in words (``too few requests for p99``)."""
    band_basis: str = ""
    """Where the band came from, in words."""

    def __post_init__(self) -> None:
        # A file from before verdicts (report 2.1) carries only ``off``: it reads as off.
        if self.off:
            self.verdict = "off"


@dataclass
class Validation(Record):
    """A what-if measured on a real server: the report's predictions beside the run."""

    status: VariantStatus
    flags: list[str]
    reason: str | None
    checks: list[Check]
    off: bool
    """True when any check is off (``verdict == "off"``)."""
    rounds: int
    source: str
    """The whatif.json it came from, or ``this run``."""
    verdict: CheckVerdict = "inconclusive"
    """The what-if's own: off when any check is off; confirmed when every money metric it
    predicts (throughput, KV capacity) is confirmed and none is off; else inconclusive."""
    mde: float | None = None
    """The smallest throughput change this run could detect (alpha 0.05, power 0.8), as a
    share: "could detect changes of +/-X% or larger"."""
    control: bool = False
    """The A/A arm's check (every prediction 0)."""

    def __post_init__(self) -> None:
        if self.off:
            self.verdict = "off"
