"""Typed results of the sparsity pipeline: classification, evaluation, recommendation.

The pipeline (:mod:`.classify`, :mod:`.recommend`) passes these frozen dataclasses, keyed by
int window. JSON is written only at the boundary: ``to_json()`` is the document
``attnprof suggest-window --json`` prints (window keys as strings, keys in its order), and
:func:`.recommend.export_summary` turns a :class:`Recommendation` into the
:class:`~attnprof.contracts.advice.WindowAdvice` contract.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from attnprof.analyze.sparsity.classify import Classification, Thresholds, Window, by_window
from attnprof.contracts.advice import AdviceCoverage, HeadLevelSplit, ParetoPoint
from attnprof.facts.shape import AttentionShape

__all__ = [
    "DynamicSparse",
    "Evaluation",
    "HeadEvidence",
    "HeadRisk",
    "LayerWindow",
    "NativeWindows",
    "Recommendation",
    "SlidingGroup",
    "TrafficSummary",
]

@dataclass(frozen=True)
class TrafficSummary:
    """What a :class:`~.savings.LengthDistribution` weighs savings by."""

    requests: float
    source: str
    exact_lengths: bool
    mean: float
    p50: int
    p90: int
    p99: int
    max: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HeadRisk:
    """A KV head the window does not cover (at risk) or cannot yet decide (undecided)."""

    layer: int
    kv_head: int
    coverage_q: float
    n_eff: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HeadEvidence:
    """What head statistics say about one (sinks, window) on the chosen layers."""

    heads_at_risk: tuple[HeadRisk, ...]
    """Worst coverage first, at most 64 (the count is exact)."""
    heads_at_risk_count: int
    heads_unverified_count: int
    heads_undecided_count: int
    heads_undecided: tuple[HeadRisk, ...]
    thresholds: Thresholds
    sampled_queries: int
    min_n_eff: float | None
    """Fewest effective sampled queries behind a windowed layer's KV head."""


def _model_json(shape: AttentionShape) -> dict[str, Any]:
    return {"name": shape.name, "num_layers": shape.num_layers, "num_q_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "dtype_bytes": shape.dtype_bytes, "layer_windows": list(shape.layer_windows) or None,
            "n_params": shape.n_params}


@dataclass(frozen=True)
class Evaluation:
    """:func:`.recommend.evaluate`: one (sinks, window) on some layers, scored on traffic."""

    sinks: int
    window: int
    layers: tuple[int, ...]
    attention_flop_saving: float
    kv_memory_saving: float
    exact_request_fraction: float
    naive_mean_request_saving: float
    attention_flops_full: float
    attention_flops_windowed: float
    kv_bytes_full: float
    kv_bytes_windowed: float
    attention_flop_share: float | None
    end_to_end_flop_saving: float | None
    traffic: TrafficSummary
    shape: AttentionShape
    evidence: HeadEvidence | None
    """None without head statistics."""

    @property
    def heads_at_risk_count(self) -> int | None:
        return None if self.evidence is None else self.evidence.heads_at_risk_count

    @property
    def min_n_eff(self) -> float | None:
        return None if self.evidence is None else self.evidence.min_n_eff

    def to_json(self) -> dict[str, Any]:
        ev = self.evidence
        out: dict[str, Any] = {
            "sinks": self.sinks, "window": self.window, "layers": list(self.layers),
            "attention_flop_saving": self.attention_flop_saving,
            "kv_memory_saving": self.kv_memory_saving,
            "exact_request_fraction": self.exact_request_fraction,
            "naive_mean_request_saving": self.naive_mean_request_saving,
            "attention_flops_per_request": {"full": self.attention_flops_full,
                                            "windowed": self.attention_flops_windowed},
            "kv_bytes_per_request": {"full": self.kv_bytes_full,
                                     "windowed": self.kv_bytes_windowed},
            "attention_flop_share": self.attention_flop_share,
            "end_to_end_flop_saving": self.end_to_end_flop_saving,
            "traffic": self.traffic.to_json(), "model": _model_json(self.shape),
            "head_stats": ev is not None,
            "heads_at_risk": None if ev is None else [r.to_json() for r in ev.heads_at_risk],
            "heads_at_risk_count": None if ev is None else ev.heads_at_risk_count,
            "heads_unverified_count": None if ev is None else ev.heads_unverified_count,
            "heads_undecided_count": None if ev is None else ev.heads_undecided_count,
        }
        if ev is not None:
            th = ev.thresholds
            out["heads_undecided"] = [r.to_json() for r in ev.heads_undecided]
            out["coverage_target"] = {"tau": th.tau, "quantile": th.quantile,
                                      "confidence_z": th.confidence_z}
            out["sampling"] = {"sampled_queries": ev.sampled_queries,
                               "min_n_eff": ev.min_n_eff}
        return out


@dataclass(frozen=True)
class SlidingGroup:
    """The layers sharing one native sliding window, and whether the traffic reaches it."""

    window: int
    layers: tuple[int, ...]
    binding_request_fraction: float

    @property
    def never_binds(self) -> bool:
        return self.binding_request_fraction == 0.0

    def to_json(self) -> dict[str, Any]:
        return {"window": self.window, "layers": list(self.layers),
                "binding_request_fraction": self.binding_request_fraction,
                "never_binds": self.never_binds,
                "note": "traffic shorter than the window: no saving from it"
                if self.never_binds else "window binds for longer requests"}


@dataclass(frozen=True)
class NativeWindows:
    """A hybrid model's own sliding layers on this traffic, and its global layers' share."""

    sliding: tuple[SlidingGroup, ...]
    global_layers: tuple[int, ...]
    global_kv_share: float
    global_attention_flop_share: float

    def to_json(self) -> dict[str, Any]:
        return {"sliding": [g.to_json() for g in self.sliding],
                "global_layers": list(self.global_layers),
                "global_kv_share": self.global_kv_share,
                "global_attention_flop_share": self.global_attention_flop_share}


@dataclass(frozen=True)
class DynamicSparse:
    """Where dynamic sparse prefill would apply (requests past ``min_tokens``)."""

    min_tokens: int
    request_fraction: float
    attention_flop_share: float
    topk_mass_density: float | None
    expected_attention_flop_saving: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LayerWindow:
    """A layer's window w*, classes and sink mass (the recommendation's per-layer view)."""

    layer: int
    window: Window
    classes: dict[str, int]
    sink_mass: float | None

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "window": self.window, "classes": dict(self.classes),
                "sink_mass": self.sink_mass}


@dataclass(frozen=True)
class Recommendation:
    """:func:`.recommend.recommend`: the chosen evaluation and everything it was chosen from."""

    best: Evaluation
    basis: str
    undecided: dict[int, int] | None
    """KV heads of full-attention layers undecided per grid window (None: no statistics)."""
    binds: bool
    pareto: tuple[ParetoPoint, ...]
    classification: Classification | None
    head_level_split: HeadLevelSplit | None
    dynamic_sparse_prefill: DynamicSparse
    native_windows: NativeWindows | None
    underused_heads: dict[str, Any] | None
    """:func:`.underused.find_underused` (None: no statistics, or no default sinks)."""
    advice: tuple[str, ...]
    coverage: AdviceCoverage | None = None
    """What the advice stands on (:func:`.strata_advice.recommend_strata`; None: the
    statistics were not split by context bucket)."""

    @property
    def per_layer(self) -> list[LayerWindow] | None:
        cls = self.classification
        return None if cls is None else [LayerWindow(x.layer, x.window, x.classes, x.sink_mass)
                                         for x in cls.layers]

    def to_json(self) -> dict[str, Any]:
        per_layer = self.per_layer
        return self.best.to_json() | {
            "basis": self.basis,
            "undecided": None if self.undecided is None else by_window(self.undecided),
            "binds": self.binds,
            "pareto": [p.to_json() for p in self.pareto],
            "per_layer": None if per_layer is None else [x.to_json() for x in per_layer],
            "classification": None if self.classification is None
            else self.classification.to_json(),
            "head_level_split": None if self.head_level_split is None
            else self.head_level_split.to_json(),
            "dynamic_sparse_prefill": self.dynamic_sparse_prefill.to_json(),
            "native_windows": None if self.native_windows is None
            else self.native_windows.to_json(),
            "underused_heads": self.underused_heads,
            "advice": list(self.advice),
            "coverage": None if self.coverage is None else self.coverage.to_json(),
        }
