"""A measured what-if (``attnprof whatif`` -> whatif.json) and the check of a prediction
against it, as the cost report carries it.

A run starts a baseline vLLM server and, one at a time, a variant server with a what-if's flag
beside it, replays one traffic shape on both in alternating paired rounds and records what each
arm measured. Every change is relative to the baseline and carries a 95% interval over the
paired rounds. No prompt or completion text, token ids or request ids: counts, rates,
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
    "Interval",
    "TrafficShape",
    "Validation",
    "VariantResult",
    "VariantStatus",
    "WhatifRun",
]

VariantStatus = Literal["measured", "could_not_start", "failed"]


@dataclass
class Interval(Record):
    """A relative change (variant / baseline - 1) over paired rounds: the mean and a 95%
    Student-t interval of the per-round changes (low = high = mean with one round)."""

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
    ``itl_p50``, ``itl_p99``."""
    agreement: Agreement | None = None
    seconds: float = 0.0


@dataclass
class WhatifRun(Document):
    KIND = "attnprof.whatif"
    VERSION = (1, 0)

    time: float
    model: str
    baseline_flags: list[str]
    traffic: TrafficShape
    rounds: int
    duration_s: float
    """Seconds of traffic per arm per round."""
    variants: list[VariantResult]
    provenance: Provenance | None = None
    seconds: float = 0.0
    max_model_len: int | None = None
    """Both servers' max_model_len (the variant's own when it sets one)."""
    in_flight_tokens: int | None = None
    """vLLM's max_num_batched_tokens for both servers (the flag when given, else the
    installed vLLM's default): a windowed layer reserves it on top of the window."""
    block_size: int | None = None
    """vLLM's KV block size for both servers (the flag when given, else its default)."""


@dataclass
class Check(Record):
    """One prediction of the report against what the run measured."""

    metric: str
    """``tokens_per_s``, ``itl_p50``, ``itl_p99``, ``kv_capacity``, ``refused_share`` or
    ``greedy_agreement``."""
    predicted: float | None
    """None: measured only (nothing predicts FP8's greedy agreement)."""
    band: float
    """The prediction's stated tolerance (absolute, in the metric's unit: a share of change
    or a share of requests), from its confidence."""
    measured: float | None
    low: float | None
    high: float | None
    """The measurement's 95% interval (equal to it for exact figures such as vLLM's KV
    capacity)."""
    off: bool
    """True when the interval lies wholly outside predicted +/- band."""


@dataclass
class Validation(Record):
    """A what-if measured on a real server: the report's predictions beside the run."""

    status: VariantStatus
    flags: list[str]
    reason: str | None
    checks: list[Check]
    off: bool
    """True when any check is off by more than its stated confidence."""
    rounds: int
    source: str
    """The whatif.json it came from, or ``this run``."""
