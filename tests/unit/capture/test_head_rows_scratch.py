"""The statistics' scratch is bounded by the tile: a fold over a 32K-token context allocates
no more than :func:`head_rows.scratch_bytes` states (measured with torch's own memory
profiler, every allocation and free in order), and a smaller tile allocates less."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.capture import head_rows

HKV, G, D, N = 3, 3, 64, 32768  # SmolLM2's heads, the longest context folded


def _peak_bytes(fn: Any) -> int:
    """Most bytes held at once by the allocations ``fn`` makes (CPU), from the profiler's
    allocation and free events in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += ev.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def _fold(acc: HeadStatsAccumulator) -> Any:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(64, HKV * G, D, generator=g)  # the last 64 queries of a 32K prompt
    k = torch.randn(N, HKV, D, generator=g).bfloat16()  # a bf16 cache: the fp32 copy counts
    v = torch.randn(N, HKV, D, generator=g)

    def run() -> None:
        head_rows.update(acc, 0, q, k, D ** -0.5, q_start=N - 64, v=v,
                         sample=list(range(0, 64, 4)))

    return run


def test_a_32k_context_stays_under_the_stated_scratch() -> None:
    acc = HeadStatsAccumulator(1, HKV, G, n_detail=2)
    run = _fold(acc)
    run()  # warm: first-call allocations (index memo, lazy imports) are not scratch
    peak = _peak_bytes(run)
    bound = head_rows.scratch_bytes(HKV * G, HKV, D, N, values=True)
    assert acc.detail_n[0, 0] == 4  # detail queries (sort, pairwise distances) ran too
    tile_logits = 4 * HKV * G * N * acc.chunk_queries
    assert tile_logits <= peak <= bound, (peak, bound)


def test_a_smaller_tile_allocates_less(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _fold(HeadStatsAccumulator(1, HKV, G, n_detail=2))
    run()
    big = _peak_bytes(run)
    monkeypatch.setattr(head_rows, "SCRATCH_ELEMENTS", HKV * G * N)  # one query per tile
    run = _fold(HeadStatsAccumulator(1, HKV, G, n_detail=2))
    run()
    small = _peak_bytes(run)
    assert small <= head_rows.scratch_bytes(HKV * G, HKV, D, N, values=True)
    assert small < big / 2, (small, big)
