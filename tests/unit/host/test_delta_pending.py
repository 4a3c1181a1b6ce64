"""A head-statistics delta whose drain ends while the worker answers is either handed out or
reported pending, never neither: the caller (the API server's catch-up, a test's collection
loop) stops asking once nothing is pending, so a delta in neither state waited for a later
pull. The interleaving is forced: the drain finishes between the answer's read of the
finished deltas and its read of the drain state."""

from __future__ import annotations

import threading
from typing import Any

import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
from attnprof.aggregate.head_strata import HeadStatsStrata
from attnprof.capture import head_rows
from attnprof.capture.vllm.hooks import Capture
from attnprof.config import Config
from attnprof.host.vllm import runtime
from attnprof.host.vllm.worker_rpc import head_stats_take, poll


def test_a_drain_ending_mid_answer_is_pending_or_handed_out() -> None:
    cap = Capture(runtime.State(config=Config(enabled=True, sample_rate=1.0, seed=0)))
    gate = threading.Event()  # the drain waits here (between two pieces) until released

    def held() -> None:
        gate.wait(60)

    strata = HeadStatsStrata(HeadStatsAccumulator(1, 1, 2))
    buf = HeadStatsDoubleBuffer(strata, pause=held)
    cap.hs_buffer = buf
    g = torch.Generator().manual_seed(0)
    head_rows.update(strata.get("prefill", 0), 0, torch.randn(20, 2, 8, generator=g),
                     torch.randn(20, 1, 8, generator=g), 8 ** -0.5, q_start=0)
    poll(cap, with_head_stats=True)  # swaps: the drain starts on its own thread
    take = buf.take_ready

    def late() -> list[Any]:
        got = take()  # the drain is still held: nothing finished yet
        gate.set()
        assert buf.wait(60)  # ... and now it ends, before the answer reads the drain's state
        return got

    buf.take_ready = late  # type: ignore[method-assign]
    first = head_stats_take(cap)["head_stats"]
    buf.take_ready = take  # type: ignore[method-assign]
    assert first["deltas"] == [] and first["pending"]
    second = head_stats_take(cap)["head_stats"]
    assert len(first["deltas"]) + len(second["deltas"]) == 1
    assert not second["pending"]
