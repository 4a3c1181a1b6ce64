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

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnprof.aggregate.quantiles import nearest_rank
from attnprof.facts.kv import held_tokens
from attnprof.facts.shape import AttentionShape

__all__ = [
    "Arch",
    "LengthDistribution",
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

    def summary(self) -> dict[str, Any]:
        return {"requests": round(self.total_weight, 3), "source": self.source,
                "exact_lengths": self.exact, "mean": round(self.expect(self.t), 1),
                "p50": self.quantile(0.5), "p90": self.quantile(0.9),
                "p99": self.quantile(0.99), "max": self.lengths[-1]}


@dataclass(frozen=True)
class Arch:
    """What the cost model needs from a model's config."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    layer_windows: tuple[int | None, ...] = field(default=())
    """Native sliding window per layer (None: full attention); empty means all full."""
    n_params: float | None = None
    """Parameter count, for attention's share of total FLOPs (~2*N per token elsewhere)."""
    name: str = ""

    def native_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.native_window(i) is None]

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_pair(self) -> int:
        return 4 * self.head_dim * self.num_q_heads

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers,
                "num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes,
                "layer_windows": list(self.layer_windows) or None, "n_params": self.n_params}

    @classmethod
    def from_shape(cls, shape: AttentionShape, name: str = "",
                   n_params: float | None = None) -> Arch:
        """The cost model's view of :class:`attnprof.facts.shape.AttentionShape`."""
        return cls(shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                   shape.dtype_bytes, shape.layer_windows, n_params, name)

    @classmethod
    def from_config(cls, cfg: Any, name: str = "", n_params: float | None = None) -> Arch:
        """From a config.json dict or a transformers config (text tower of multimodal
        models); ``ShapeError`` (a ``ValueError``) names a missing field."""
        return cls.from_shape(AttentionShape.from_config(cfg), name, n_params)

    @classmethod
    def from_model_dir(cls, path: Path, name: str = "") -> Arch:
        """From ``path/config.json`` (read by :class:`AttentionShape`, no transformers) and
        the parameter count in the safetensors headers."""
        return cls.from_shape(AttentionShape.from_model_dir(path), name or path.name,
                              _count_params(path))


def _count_params(path: Path) -> float | None:
    """Parameter count from safetensors headers (no weights are read)."""
    total = 0
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for k, v in header.items():
            if k != "__metadata__":
                total += math.prod(v["shape"])
    return float(total) if files else None


def workload_costs(dist: LengthDistribution, arch: Arch, window: int | None, sinks: int,
                   layers: Iterable[int]) -> dict[str, float]:
    """Expected attention FLOPs and peak KV bytes per request, full vs windowed.

    ``layers`` are the layers that get sinks + window; layers with a native window keep it.
    """
    t = dist.t
    chosen = set(layers)
    full_pairs = win_pairs = full_kv = win_kv = 0.0
    for layer in range(arch.num_layers):
        native = arch.native_window(layer)
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
    return {
        "attention_flops_full": full_pairs * arch.flops_per_pair,
        "attention_flops_windowed": win_pairs * arch.flops_per_pair,
        "kv_bytes_full": full_kv * arch.kv_bytes_per_token_layer,
        "kv_bytes_windowed": win_kv * arch.kv_bytes_per_token_layer,
        "tokens": dist.expect(t),
    }
