"""Measured memory of torch calls on CPU, for the analytic models of
:mod:`attnprof.analyze.memory` to be checked against.

:func:`measure_peak` runs a callable under ``torch.profiler`` with ``profile_memory=True`` and
replays the allocator's ``[memory]`` events (allocations and frees, in order) to get the peak
bytes held above the starting point. It sees every CPU allocation made through torch's
allocator, which is where attention tensors live; it does not see memory oneDNN/OpenMP take
outside it. Runs the profiler and redirects fd 2 around it: a tool, not analysis.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["cache_bytes", "measure_peak", "memory_profile", "peak_in_ranges"]


def cache_bytes(cache: Any) -> int:
    """Real bytes of a transformers cache (sum over its layers' key/value tensors)."""
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is not None and hasattr(t, "numel"):
                    total += int(t.numel() * t.element_size())
        return total
    for k, v in cache:  # legacy tuple-of-tuples
        total += int(k.numel() * k.element_size() + v.numel() * v.element_size())
    return total


def _memory_events(prof: Any) -> list[tuple[int, int]]:
    evs = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type().name == "CPU":
            evs.append((int(e.start_ns()), int(e.nbytes())))
    evs.sort()
    return evs


@contextlib.contextmanager
def _drop_usdt_lines() -> Iterator[None]:
    """Kineto prints a "USDT: ... profiler_start/stop" line on fd 2 at every profiler start and
    stop; capture fd 2 around those moments and pass every other line through."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


@contextlib.contextmanager
def memory_profile() -> Iterator[Any]:
    """``torch.profiler.profile(activities=[CPU], profile_memory=True)``, without Kineto's
    stderr chatter."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _drop_usdt_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _drop_usdt_lines():
            prof.__exit__(None, None, None)


def measure_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` and return ``(result, peak bytes allocated above the start)``."""
    with memory_profile() as prof:
        result = fn()
    cur = peak = 0
    for _t, nbytes in _memory_events(prof):
        cur += nbytes
        peak = max(peak, cur)
    return result, peak


def peak_in_ranges(prof: Any, prefix: str, absolute: bool = False
                   ) -> tuple[int, dict[str, list[int]]]:
    """Overall peak of a profiled region and, per ``record_function`` range whose name starts
    with ``prefix``, the peak bytes allocated above the level at the range's start (with
    ``absolute``: above the region's start, i.e. everything held at that range's peak)."""
    mem = _memory_events(prof)
    ranges = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name.startswith(prefix) and e.device_type().name == "CPU":
            ranges.append((int(e.start_ns()), int(e.end_ns()), name))
    ranges.sort()
    out: dict[str, list[int]] = {}
    cur = peak = 0
    levels = []
    before = [0]  # before[i]: bytes held just before event i
    for t, nb in mem:
        cur += nb
        peak = max(peak, cur)
        levels.append((t, nb))
        before.append(cur)
    i = 0
    for start, end, name in ranges:
        # Memory events are time-ordered: walk the ones inside [start, end].
        while i < len(levels) and levels[i][0] < start:
            i += 1
        base = before[i] if absolute else 0
        j, held, top = i, base, base
        while j < len(levels) and levels[j][0] <= end:
            held += levels[j][1]
            top = max(top, held)
            j += 1
        out.setdefault(name, []).append(top)
    return peak, out
