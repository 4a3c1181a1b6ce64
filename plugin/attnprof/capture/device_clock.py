"""Timing one attention call on its device: wall time on the host, CUDA events on a GPU,
waiting for the device at most once per call (at its end)."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CudaClock", "HostClock", "clock"]


def _synchronize(event: Any) -> None:
    """The one place attnprof waits for a device (once per timed CUDA call, never on CPU)."""
    event.synchronize()


class HostClock:
    """Wall time of a CPU call: nothing to wait for."""

    __slots__ = ("t0",)

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self.t0


class CudaClock:
    """Device time between two events on the tensors' stream: one synchronize, at the end.

    Host-side timing would need a synchronize before the call too (else earlier queued work
    is counted); events need none there.
    """

    __slots__ = ("end", "start", "stream")

    def __init__(self, torch: Any, device: Any) -> None:
        self.stream = torch.cuda.current_stream(device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(self.stream)

    def stop(self) -> float:
        self.end.record(self.stream)
        _synchronize(self.end)
        return float(self.start.elapsed_time(self.end)) / 1000.0


def clock(torch: Any, query: Any) -> HostClock | CudaClock:
    """The clock for a call on ``query``'s device (started now)."""
    if bool(getattr(query, "is_cuda", False)):
        return CudaClock(torch, query.device)
    return HostClock()
