"""trace.json of ``attnprof profile``: one range per model forward, each attention call a
nested range, written through the live trace's writer. Never reads token ids: records hold
shapes and times only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TRACE_PREFIX", "Forward", "write_trace"]

TRACE_PREFIX = "attn::"
"""The capture's record_function range names start with this (``attn::L3::sdpa``)."""


@dataclass(frozen=True)
class Forward:
    """One timed model forward: its label, perf_counter_ns bounds and its records' slice."""

    label: str
    start_ns: int
    end_ns: int
    first: int
    end: int


def write_trace(path: Path, records: Any, forwards: list[Forward], model_name: str) -> None:
    """Write trace.json through the live trace's writer: one range per forward, each
    attention call a nested range (the transformers capture's own records). Never reads
    token ids: records hold shapes and times only."""
    from attnprof.aggregate.trace import LayerRange, StepTrace
    from attnprof.contracts.jsonsafe import dumps
    from attnprof.exporters.chrome_trace import TraceProcess, render_steps

    wall = time.time_ns() - time.perf_counter_ns()  # perf_counter -> Unix time
    steps = []
    for f in forwards:
        ranges = [LayerRange(r.layer_idx, r.impl, r.kernel, r.start_ns - f.start_ns,
                             int(r.elapsed_s * 1e9), r.phase, r.batch * r.q_len, r.batch,
                             r.kv_len, float(r.kv_len))
                  for r in records[f.first:f.end] if r.start_ns]
        calls = records[f.first:f.end]
        phase = calls[0].phase if calls else "prefill"
        steps.append(StepTrace(
            f.start_ns + wall, f.end_ns - f.start_ns, phase, "sampled", 1.0,
            calls[0].batch * calls[0].q_len if calls else 0, calls[0].batch if calls else 0,
            calls[0].kv_len if calls else 0, float(calls[0].kv_len) if calls else 0.0,
            ranges, label=f.label))
    doc = render_steps([TraceProcess(os.getpid(), f"attnprof profile {model_name}", steps,
                                     thread_name="model forwards")],
                       other={"attnprof": {"kind": "attnprof.profile_trace",
                                           "model": model_name}},
                       sample_rate_counter=False)
    _label_sites(doc, [sorted((r for r in records[f.first:f.end] if r.start_ns),
                              key=lambda r: r.start_ns) for f in forwards])
    path.write_text(dumps(doc))


def _label_sites(doc: dict[str, Any], calls: list[list[Any]]) -> None:
    """Name encoder-decoder attention ranges by site (``attn::decoder.L0.cross::sdpa``, with
    ``stack``/``kind`` args), as the capture's own record_function ranges are: the shared
    trace writer knows layer indices only. ``calls`` are each forward's records in the
    order the writer emits their ranges (by start)."""
    flat = [r for step in calls for r in step]
    if not any(r.stack is not None or r.kind != "self" for r in flat):
        return
    events = [e for e in doc.get("traceEvents", []) if e.get("cat") == "attention"]
    if len(events) != len(flat):
        return  # not the shape this was written for: leave the indices
    for e, r in zip(events, flat, strict=True):
        e["name"] = f"attn::{r.label}::{r.impl}"
        e.setdefault("args", {}).update(stack=r.stack, kind=r.kind)
