"""profile.json, written by ``attnprof profile MODEL``: the model's attention kernels and why,
per-layer time and memory, scaling fits, an OOM prediction and advice. Sizes in bytes, times
in seconds.

``schema_version`` is ``"attnprof.profile/1.<minor>"``. 1.2 adds ``provenance`` (what
``attnprof diff`` reports as "what changed") and each layer's per-call times
(``timing.samples_s_by_seq_len``, what its statistical test runs on). 1.3 adds ``roofline``
and ``probe``, the OOM prediction's bounds and how sure it is (``analytic_max_seq_len``,
``extrapolation_factor``, ``extrapolation``, ``confidence``, ``attention_paths``,
``model_max_context``), layer ``stack``/``kind`` (encoder/decoder, self/cross) and per-call
``q_len``/``kv_len``. Deep leaves that vary by path or by torch version (SDPA arguments,
shape-class tags) stay free-form objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.base import Document, NonNegative, Record
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.roofline import MemoryProbe, Roofline

__all__ = [
    "ActivationRow",
    "BackendAdvice",
    "Device",
    "Environment",
    "ExpectedGain",
    "Fit",
    "LayerMemory",
    "LayerReport",
    "LayerTiming",
    "LengthResult",
    "OomPrediction",
    "PathResult",
    "PeakRow",
    "ProfileModel",
    "ProfileReport",
    "Reason",
    "RunInfo",
    "Scaling",
    "ShapeClass",
    "Validation",
    "WhatIf",
]


@dataclass
class ProfileModel(Record):
    """The checkpoint profiled and its attention shape (text config for multimodal models)."""

    name: str
    architecture: str
    attn_implementation: str
    dtype: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    static_bytes: NonNegative
    """Weights and buffers."""
    path: str = ""
    vocab_size: int = 0
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    layer_windows: list[int | None] | None = None
    """Sliding window per layer as attnprof.facts.shape reads the config (None: full)."""


@dataclass
class Device(Record):
    type: Literal["cpu", "cuda"]
    threads: int | None = None
    cpu: str | None = None
    cpu_flags: list[str] = field(default_factory=list)
    name: str | None = None
    compute_capability: str | None = None


@dataclass
class Environment(Record):
    """Versions and device the profile was measured with."""

    torch: str
    transformers: str | None
    vllm: str | None
    device: Device
    git_revision: str | None
    attnprof: str | None = None
    python: str | None = None
    platform: str | None = None


@dataclass
class RunInfo(Record):
    seq_lens: list[int]
    batch_size: int
    memory_budget_bytes: int
    repeats: int = 1
    paths: list[str] = field(default_factory=list)
    """Attention paths micro-benchmarked (flash_cpu, math, eager)."""
    inputs: str = ""
    wall_s: float | None = None
    train: bool = False
    """Profiled in training mode (dropout active; ``--train``, 1.2)."""
    attention_dropout: float | None = None
    """The attention dropout override (``--attention-dropout``, 1.2)."""


@dataclass
class Reason(Record):
    """Why a fused kernel was not used (code from the SDPA dispatcher's message)."""

    code: str
    message: str = ""
    backend: str | None = None


@dataclass
class ShapeClass(Record):
    phase: str
    mask: str
    length_bucket: int
    kernel: str
    fused: bool
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass
class LayerTiming(Record):
    calls: int
    total_s: float
    median_s_by_seq_len: dict[str, float]
    samples_s_by_seq_len: dict[str, list[float]] = field(default_factory=dict)
    """Every timed call's seconds, by sequence length (1.2)."""


@dataclass
class PeakRow(Record):
    seq_len: int
    measured_peak_bytes: int
    analytic_peak_bytes: int
    analytic_score_bytes: int = 0
    rel_error: float | None = None
    q_len: int | None = None
    """Query length of the call the analytic peak is for (the decoder's for cross-attention)."""
    kv_len: int | None = None
    """Key/value length of that call (the encoder's for cross-attention)."""


@dataclass
class LayerMemory(Record):
    kv_cache_bytes_per_token: float
    kv_cache_bytes_per_token_per_kv_head: float
    kv_cache_bytes_per_token_per_query_head: float
    attention_peak: list[PeakRow]


@dataclass
class LayerReport(Record):
    """One attention layer: the kernels that ran, why not fused, time and memory."""

    layer: int
    backend: str
    kernels: list[str]
    fused: bool
    reasons: list[Reason]
    timing: LayerTiming
    memory: LayerMemory
    sliding_window: int | None = None
    layer_type: str | None = None
    shape_classes: list[ShapeClass] = field(default_factory=list)
    stack: Literal["encoder", "decoder"] | None = None
    """"encoder"/"decoder" in encoder-decoder models (each numbers its layers from 0)."""
    kind: Literal["self", "cross"] = "self"
    """"cross" for cross-attention (keys/values from the encoder, no causal mask)."""


@dataclass
class ActivationRow(Record):
    """Kernel activation map: the kernel for one layer and shape class, and why."""

    layer_idx: int
    impl: str
    phase: str
    mask: str
    length_bucket: int
    dtype: str
    kernel: str
    fused: bool
    reasons: list[Reason]
    ops: list[str]
    """The first aten ops under the call (the ground truth)."""
    sdpa_args: dict[str, Any] | None = None
    calls: int = 0
    time_s: float = 0.0
    tags: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    stack: Literal["encoder", "decoder"] | None = None
    """"encoder"/"decoder" in encoder-decoder models, else None."""
    kind: Literal["self", "cross"] = "self"
    """"cross" for cross-attention, else "self"."""


@dataclass
class Fit(Record):
    """``y = a + b*L + c*L^2`` with non-negative terms, and its R^2."""

    a: float
    b: float
    c: float
    r2: float


@dataclass
class LengthResult(Record):
    """The whole model's forward at one length."""

    seq_len: int
    batch_size: int
    forward_s: float
    attention_s: float
    peak_total_bytes: int
    kv_cache_bytes_analytic: int
    peak_extra_bytes: int = 0
    kv_cache_bytes_measured: int | None = None
    attention_peak_total_bytes: int | None = None
    """Weights + everything held at the forward's highest attention call (its own peak
    included): the attention moment the OOM prediction extrapolates."""


@dataclass
class PathResult(Record):
    """One attention path (one layer call at this model's shape), by length."""

    time_s: dict[str, float]
    peak_bytes: dict[str, float]
    analytic_peak_bytes: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    time_fit: Fit | None = None
    memory_fit: Fit | None = None
    analytic_vs_measured_max_rel_error: float | None = None


@dataclass
class Scaling(Record):
    by_seq_len: list[LengthResult]
    paths: dict[str, PathResult]
    fits: dict[str, Fit]
    """model_peak_total_bytes, attention_time_s, forward_time_s (two lengths or more)."""


@dataclass
class Validation(Record):
    """A run at the predicted maximum length, when affordable here."""

    planned: bool
    estimated_forward_s: float | None = None
    skipped: str | None = None
    seq_len: int | None = None
    measured_peak_bytes: int | None = None
    predicted_peak_bytes: float | None = None
    rel_error: float | None = None
    fits_budget: bool | None = None
    seconds: float | None = None


@dataclass
class WhatIf(Record):
    max_seq_len: int | None
    extrapolation_factor: float | None = None
    """max_seq_len / the longest measured length."""
    extrapolation: bool | None = None
    """True beyond ``extrapolation_limit`` (the output then says it is an extrapolation)."""
    confidence: Literal["high", "medium", "low"] | None = None
    analytic_max_seq_len: int | None = None
    """The bound: the longest length the analytic memory model alone allows on this path."""
    predicted_peak_bytes_at_max: float | None = None


@dataclass
class OomPrediction(Record):
    memory_budget_bytes: int
    batch_size: int
    static_bytes: int = 0
    method: str = ""
    max_seq_len: int | None = None
    """Longest prefill that fits the budget (null: fewer than two lengths measured)."""
    note: str | None = None
    predicted_peak_bytes_at_max: float | None = None
    max_batch_by_seq_len: dict[str, int] = field(default_factory=dict)
    if_attention_path: dict[str, WhatIf] = field(default_factory=dict)
    """The same prediction if attention fell back to another path."""
    validation: Validation | None = None
    extrapolation_factor: float | None = None
    extrapolation: bool | None = None
    """True when extrapolation_factor exceeds extrapolation_limit: the prediction is an
    extrapolation and every output says so."""
    extrapolation_limit: float | None = None
    confidence: Literal["high", "medium", "low"] | None = None
    confidence_rule: str | None = None
    """How the confidence level is set (high/medium/low)."""
    attention_paths: dict[str, list[int]] = field(default_factory=dict)
    """The attention path each layer ran (kernel map) -> its layers: what max_seq_len is for."""
    analytic_max_seq_len: int | None = None
    """The bound: the longest length the analytic memory model (weights, KV cache, the run
    paths' attention peaks) allows; max_seq_len never exceeds it."""
    fit_max_seq_len: int | None = None
    """What a plain a + b*L + c*L^2 fit of the measured peaks alone would predict (shown for
    comparison; not used when it exceeds the bound)."""
    model_max_context: int | None = None
    """The model's ``max_position_embeddings``: a max_seq_len above it is what memory would
    allow, not a length the model serves (the terminal summary says so; with learned
    absolute position embeddings the validation run is then skipped, with that reason)."""
    attention_sites: dict[str, list[str]] = field(default_factory=dict)
    """Path -> the attention sites that ran it (``L3``; ``encoder.L0``, ``decoder.L0``,
    ``decoder.L0.cross`` in an encoder-decoder), one entry per site."""


@dataclass
class ExpectedGain(Record):
    at_seq_len: int
    source: str = ""
    speedup: float | None = None
    attention_peak_bytes_saved: int | None = None
    memory_ratio: float | None = None


@dataclass
class BackendAdvice(Record):
    """One change that activates a fused path, and its measured gain."""

    reason: str
    change: str
    layers: list[int]
    expected_gain: ExpectedGain | None
    message: str = ""
    kernel: str | None = None
    target: str | None = None


@dataclass
class ProfileReport(Document):
    """Output of ``attnprof profile MODEL``."""

    KIND = "attnprof.profile"
    VERSION = (1, 3)

    model: ProfileModel
    environment: Environment
    run: RunInfo
    layers: list[LayerReport]
    activation_map: list[ActivationRow]
    scaling: Scaling
    oom_prediction: OomPrediction
    advice: list[BackendAdvice]
    errors: list[str] = field(default_factory=list)
    """Errors the instrumentation counted and dropped during the run."""
    window_advice: WindowAdvice | None = None
    """Sliding-window suggestion for the traffic given with --lengths (null without)."""
    outputs: dict[str, str] = field(default_factory=dict)
    """The files written next to it (profile, trace, plot)."""
    provenance: Provenance | None = None
    """Versions, hardware, model hashes, git revision, command line, time (1.2)."""
    roofline: Roofline | None = None
    """Prefill and decode attention against the probed bandwidth and matmul peak."""
    probe: MemoryProbe | None = None
    """The peaks the roofline is drawn with (``attnprof probe``)."""
