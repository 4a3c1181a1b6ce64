"""Cost model for sink + sliding-window attention over a context-length distribution.

Window semantics follow transformers (``masking_utils.sliding_window_overlay``): query i sees
the ``w`` most recent keys including itself, plus the first ``s`` keys (sinks). Keys seen by
query i (0-indexed)::

    n_i(w, s) = min(i+1, w) + min(s, max(0, i+1-w))

A request of total length T computes sum_{i<T} n_i (prefill + decode) query-key pairs instead of
T(T+1)/2, and keeps min(T, w+s) tokens of KV per windowed layer. Workload savings are ratios
of expectations over requests (long requests dominate), never means of per-request ratios.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnprof.aggregate.quantiles import nearest_rank
from attnprof.analyze.sparsity.results import TrafficSummary
from attnprof.facts.kv import held_tokens
from attnprof.facts.shape import AttentionShape

__all__ = [
    "LengthDistribution",
    "WorkloadCosts",
    "kv_tokens",
    "pairs_full",
    "pairs_window",
    "workload_costs",
]

def pairs_window(t: Any, w: int, s: int) -> Any:
    """sum_{i<T} n_i(w, s) in closed form; ``t`` may be an int or a numpy array."""
    t = np.asarray(t, dtype=np.float64)
    local = np.where(t <= w, t * (t + 1) / 2, w * (w + 1) / 2 + (t - w) * w)
    m = np.maximum(0.0, t - w)  # queries past the window see min(s, i+1-w) sinks
    sink = np.where(m <= s, m * (m + 1) / 2, s * (s + 1) / 2 + (m - s) * s)
    return local + sink


def pairs_full(t: Any) -> Any:
    t = np.asarray(t, dtype=np.float64)
    return t * (t + 1) / 2


def kv_tokens(t: Any, w: int | None, s: int = 0) -> Any:
    """KV tokens a layer with window ``w`` (None: full) and ``s`` sinks keeps for requests of
    ``t`` tokens (:func:`attnprof.facts.kv.held_tokens` over a numpy array)."""
    return held_tokens(np.asarray(t, dtype=np.float64), w, s)


@dataclass(frozen=True)
class LengthDistribution:
    """Weighted context lengths (prompt + generated tokens per request)."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]
    source: str = ""
    exact: bool = True
    """False when lengths were reconstructed from histogram buckets or a sketch."""

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], source: str = "",
                     weights: Iterable[float] | None = None, exact: bool = True
                     ) -> LengthDistribution:
        arr = np.asarray(list(lengths), dtype=np.int64)
        w = (np.ones(len(arr)) if weights is None
             else np.asarray(list(weights), dtype=np.float64))
        if len(arr) != len(w):
            raise ValueError("lengths and weights differ in size")
        keep = (w > 0) & (arr > 0)
        arr, w = arr[keep], w[keep]
        if len(arr) == 0:
            raise ValueError("the length distribution is empty")
        uniq, inv = np.unique(arr, return_inverse=True)
        agg = np.bincount(inv, weights=w)
        return cls(tuple(int(x) for x in uniq), tuple(float(x) for x in agg), source, exact)

    @property
    def t(self) -> Any:
        return np.asarray(self.lengths, dtype=np.float64)

    @property
    def w(self) -> Any:
        return np.asarray(self.weights, dtype=np.float64)

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights))

    def quantile(self, q: float) -> int:
        """Nearest-rank quantile, the one definition of :mod:`attnprof.aggregate.quantiles`
        (so it equals the live snapshot's p50/p90/p99 for the same requests)."""
        return int(nearest_rank(self.lengths, np.cumsum(self.w).tolist(), q))

    def fraction_at_most(self, n: float) -> float:
        return float(self.w[self.t <= n].sum() / self.total_weight)

    def expect(self, values: Any) -> float:
        return float((np.asarray(values) * self.w).sum() / self.total_weight)

    def summary(self) -> TrafficSummary:
        return TrafficSummary(requests=round(self.total_weight, 3), source=self.source,
                              exact_lengths=self.exact, mean=round(self.expect(self.t), 1),
                              p50=self.quantile(0.5), p90=self.quantile(0.9),
                              p99=self.quantile(0.99), max=self.lengths[-1])


@dataclass(frozen=True)
class WorkloadCosts:
    """Expected attention FLOPs and peak KV bytes per request, full vs windowed."""

    attention_flops_full: float
    attention_flops_windowed: float
    kv_bytes_full: float
    kv_bytes_windowed: float
    tokens: float
    """Expected request length."""


def workload_costs(dist: LengthDistribution, shape: AttentionShape, window: int | None,
                   sinks: int, layers: Iterable[int]) -> WorkloadCosts:
    """Expected attention FLOPs and peak KV bytes per request, full vs windowed.

    ``layers`` are the layers that get sinks + window; layers with a native window keep it.
    """
    t = dist.t
    chosen = set(layers)
    full_pairs = win_pairs = full_kv = win_kv = 0.0
    for layer in range(shape.num_layers):
        native = shape.window(layer)
        base_p = pairs_full(t) if native is None else pairs_window(t, native, 0)
        base_kv = kv_tokens(t, native)
        if layer in chosen and window is not None:
            cand_p = pairs_window(t, window, sinks)
            cand_kv = kv_tokens(t, window, sinks)
            # A configured window never makes a natively windowed layer costlier.
            new_p, new_kv = np.minimum(base_p, cand_p), np.minimum(base_kv, cand_kv)
        else:
            new_p, new_kv = base_p, base_kv
        full_pairs += dist.expect(base_p)
        win_pairs += dist.expect(new_p)
        full_kv += dist.expect(base_kv)
        win_kv += dist.expect(new_kv)
    return WorkloadCosts(
        attention_flops_full=full_pairs * shape.flops_per_pair,
        attention_flops_windowed=win_pairs * shape.flops_per_pair,
        kv_bytes_full=full_kv * shape.kv_bytes_per_token_layer,
        kv_bytes_windowed=win_kv * shape.kv_bytes_per_token_layer,
        tokens=dist.expect(t),
    )
