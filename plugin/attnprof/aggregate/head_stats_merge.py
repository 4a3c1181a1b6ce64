"""The API server's global head statistics, merged from every rank's deltas (pure numpy).

Each tensor-parallel rank holds its own share of the query heads; each pipeline stage its own
layers. :func:`global_for` grows the global accumulator when a later stage reports more
layers, and :func:`add_rank_delta` places one rank's delta at its global layers and heads.
Both take plain accumulators or :class:`HeadStatsStrata` (stratum by stratum).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HeadStatsStrata

__all__ = ["add_rank_delta", "global_for"]


Stats = HeadStatsAccumulator | HeadStatsStrata


def global_for(acc: Stats | None, part: Stats, rank: Mapping[str, Any],
               total_kv_heads: int | None = None, total_layers: int | None = None) -> Stats:
    """The global accumulator one rank's delta ``part`` fits in: ``acc`` itself, or (None,
    or too few layers) a new one holding ``acc``'s data. ``rank``: the worker's placement
    (``tp_size``); ``total_kv_heads``/``total_layers``: the model's, as the worker read them.
    Raises ``ValueError`` when the heads do not split. Strata come back as strata (a plain
    ``acc`` is kept as the stratum ("prefill", 0))."""
    if isinstance(part, HeadStatsStrata) or isinstance(acc, HeadStatsStrata):
        shape = part.template if isinstance(part, HeadStatsStrata) else part
        tmpl = global_for(None, shape, rank, total_kv_heads, total_layers)
        assert isinstance(tmpl, HeadStatsAccumulator)
        if isinstance(acc, HeadStatsStrata) and acc.num_layers >= tmpl.num_layers:
            return acc
        out = HeadStatsStrata(tmpl)
        if acc is not None:
            out.add_at(_strata(acc))
        return out
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


def add_rank_delta(acc: Stats, part: Stats, rank: Mapping[str, Any]) -> None:
    """Add one rank's delta at its global heads (``tp_rank`` x its head count) and layers;
    shapes are checked, never broadcast (``ValueError``)."""
    tp_rank = int(rank.get("tp_rank", 0))
    # Only the first tensor-parallel rank counts requests: every rank saw each prompt.
    off, first = tp_rank * part.num_q_heads, tp_rank == 0
    if isinstance(acc, HeadStatsStrata):
        acc.add_at(_strata(part), q_offset=off, count_requests=first)
    elif isinstance(part, HeadStatsAccumulator):
        acc.add_at(part, q_offset=off, count_requests=first)
    else:
        raise ValueError("strata cannot join a plain accumulator (global_for makes strata)")


def _strata(x: Stats) -> HeadStatsStrata:
    return x if isinstance(x, HeadStatsStrata) else HeadStatsStrata.wrap(x)
