"""The API server's global head statistics, merged from every rank's deltas (pure numpy).

Each tensor-parallel rank holds its own share of the query heads; each pipeline stage its own
layers. :func:`global_for` grows the global accumulator when a later stage reports more
layers, and :func:`add_rank_delta` places one rank's delta at its global layers and heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnprof.aggregate.head_stats import HeadStatsAccumulator

__all__ = ["add_rank_delta", "global_for"]


def global_for(acc: HeadStatsAccumulator | None, part: HeadStatsAccumulator,
               rank: Mapping[str, Any], total_kv_heads: int | None = None,
               total_layers: int | None = None) -> HeadStatsAccumulator:
    """The global accumulator one rank's delta ``part`` fits in: ``acc`` itself, or (None,
    or too few layers) a new one holding ``acc``'s data. ``rank``: the worker's placement
    (``tp_size``); ``total_kv_heads``/``total_layers``: the model's, as the worker read them.
    Raises ``ValueError`` when the heads do not split."""
    tp_size = int(rank.get("tp_size", 1))
    q_total = part.num_q_heads * tp_size
    kv_total = int(total_kv_heads or part.num_kv_heads * tp_size)
    layers = max(part.num_layers, int(total_layers or 0))
    if q_total % kv_total:
        raise ValueError(f"{q_total} query heads do not split into {kv_total} KV heads")
    if acc is None or acc.num_layers < layers:
        grown = HeadStatsAccumulator(layers, kv_total, q_total // kv_total,
                                     part.sinks_grid, part.window_grid,
                                     n_last=part.n_last, n_random=part.n_random,
                                     n_detail=part.n_detail, mass_gamma=part.mass_gamma)
        if acc is not None:
            grown.add_at(acc)
        acc = grown
    return acc


def add_rank_delta(acc: HeadStatsAccumulator, part: HeadStatsAccumulator,
                   rank: Mapping[str, Any]) -> None:
    """Add one rank's delta at its global heads (``tp_rank`` x its head count) and layers;
    shapes are checked, never broadcast (``ValueError``)."""
    tp_rank = int(rank.get("tp_rank", 0))
    # Only the first tensor-parallel rank counts requests: every rank saw each prompt.
    acc.add_at(part, q_offset=tp_rank * part.num_q_heads, count_requests=tp_rank == 0)
