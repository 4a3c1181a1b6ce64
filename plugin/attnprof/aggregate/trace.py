"""Per-step trace records of sampled steps, kept only while someone asked for them.

Capture hands a :class:`StepTrace` (the step's wall start, duration, phase, outcome,
effective sample rate and one :class:`LayerRange` per timed attention call) to a
:class:`TraceBuffer`, but only when :attr:`TraceBuffer.wanted` is true: a live trace was
armed (``GET /attnprof/trace``) and is not full or expired yet, or OpenTelemetry spans are on.
Unarmed, nothing is built and nothing is kept.

Bounded: an armed trace holds at most ``MAX_STEPS`` steps and the layer ranges the API server
allows each worker (``ATTNPROF_TRACE_MAX_RANGES_PER_WORKER``, at most ``MAX_RANGES``); the span
queue at most ``SPAN_QUEUE_MAX`` steps (the oldest are dropped and counted). The records leave
in pages (:meth:`TraceBuffer.take` with ``max_ranges``), so no single answer to the API server
is large. Records carry shapes and timings only: never prompt text, token ids or request ids;
but a step's request count and sequence lengths, with one request in the batch, are that one
request's length and timing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from attnprof.aggregate.layers import StepRecord
from attnprof.config import MAX_TRACE_RANGES_PER_WORKER

__all__ = ["MAX_RANGES", "MAX_STEPS", "SPAN_QUEUE_MAX", "LayerRange", "StepTrace", "TraceBuffer",
           "TracePages", "page_ranges", "step_trace"]

MAX_STEPS = 1000
"""Most steps one live trace may ask for (the route refuses more)."""
MAX_RANGES = MAX_TRACE_RANGES_PER_WORKER
"""Hard ceiling on the layer ranges one worker keeps for one trace, whatever it is asked
(the ceiling of ``ATTNPROF_TRACE_MAX_RANGES_PER_WORKER``: one definition, in config)."""
SPAN_QUEUE_MAX = 256
"""Sampled steps waiting for the span exporter; beyond this the oldest is dropped."""


class LayerRange(NamedTuple):
    """One attention call inside a step: offset from the step's start and duration (ns),
    with the batch facts its attention metadata gave. A tuple of atoms: a live trace holds
    150,000 of them, and the garbage collector does not walk such tuples (slotted objects it
    would, pausing the API server's event loop while it renders)."""

    layer: int
    backend: str
    kernel: str
    offset_ns: int
    dur_ns: int
    phase: str
    tokens: int
    num_reqs: int
    max_seq_len: int
    mean_seq_len: float

    def to_json(self) -> list[Any]:
        # Positional: thousands of these cross the RPC per trace.
        return list(self)

    @classmethod
    def from_json(cls, raw: list[Any]) -> LayerRange:
        (layer, backend, kernel, off, dur, phase, tokens, reqs, mx, mean) = raw
        return cls(int(layer), str(backend), str(kernel), int(off), int(dur), str(phase),
                   int(tokens), int(reqs), int(mx), float(mean))


@dataclass(slots=True)
class StepTrace:
    """One sampled step: wall-clock start (Unix ns), duration (ns) and its layer ranges."""

    start_ns: int
    dur_ns: int
    phase: str
    outcome: str
    effective_rate: float
    tokens: int = 0
    num_reqs: int = 0
    max_seq_len: int = 0
    mean_seq_len: float = 0.0
    layers: list[LayerRange] = field(default_factory=list)
    label: str = ""
    """Range name; empty: ``step (<phase>)``."""

    def to_json(self) -> dict[str, Any]:
        return {"start_ns": self.start_ns, "dur_ns": self.dur_ns, "phase": self.phase,
                "outcome": self.outcome, "effective_rate": self.effective_rate,
                "tokens": self.tokens, "num_reqs": self.num_reqs,
                "max_seq_len": self.max_seq_len, "mean_seq_len": self.mean_seq_len,
                "label": self.label, "layers": len(self.layers),
                # Every range's fields in one flat list: one object per step, not one per
                # range (150k lists in an API server are seconds of garbage collection).
                "ranges": [x for r in self.layers for x in r]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StepTrace:
        """Parse one record; raises ``KeyError``/``TypeError``/``ValueError`` when malformed."""
        return cls(int(raw["start_ns"]), int(raw["dur_ns"]), str(raw["phase"]),
                   str(raw["outcome"]), float(raw["effective_rate"]), int(raw["tokens"]),
                   int(raw["num_reqs"]), int(raw["max_seq_len"]), float(raw["mean_seq_len"]),
                   _ranges(raw["ranges"], int(raw["layers"])), str(raw.get("label", "")))


def step_trace(rec: StepRecord, offsets_ns: list[float], wall_ns: int, dur_ns: float,
               effective_rate: float) -> StepTrace:
    """The trace record of one sampled step: its wall start (Unix ns), duration (ns), and
    each timed call of ``rec`` at its offset from the step's start (``offsets_ns``, one per
    call, in order) with the batch facts of its attention metadata."""
    ranges = []
    for off, call in zip(offsets_ns, rec.calls, strict=True):
        info, sh = call.layer, call.shape
        ranges.append(LayerRange(
            info.index, info.backend, info.kernel or info.impl, int(off),
            int(call.time_s * 1e9), sh.phase, sh.num_tokens, sh.num_reqs, sh.max_seq_len,
            sh.kv_tokens / sh.num_reqs if sh.num_reqs else 0.0))
    first = rec.calls[0].shape
    return StepTrace(wall_ns, int(dur_ns), first.phase, rec.outcome, effective_rate,
                     first.num_tokens, first.num_reqs, first.max_seq_len,
                     first.kv_tokens / first.num_reqs if first.num_reqs else 0.0, ranges)


_FIELDS = len(LayerRange._fields)


def _ranges(flat: list[Any], n: int) -> list[LayerRange]:
    if not isinstance(flat, list) or len(flat) != n * _FIELDS:
        raise ValueError(f"{n} layer ranges need {n * _FIELDS} fields")
    return [LayerRange.from_json(flat[i:i + _FIELDS]) for i in range(0, len(flat), _FIELDS)]


class TraceBuffer:
    """Where a worker keeps step records: an armed live trace, and the span queue.

    ``wanted`` is read on sampled steps only (one attribute and, while armed, one clock
    read). ``arm``/``take`` run between steps (collective RPC); ``take_spans`` runs on the
    export thread; all three hold ``lock`` briefly. Never raises on ``add``'s inputs beyond
    what capture already guards.
    """

    def __init__(self, spans: bool = False, clock: Any = time.monotonic) -> None:
        self.spans = spans
        self.clock = clock
        self.lock = threading.Lock()
        self.target = 0
        self.deadline = 0.0
        self.steps: list[StepTrace] = []
        self.ranges = 0
        self.trace_id = ""
        self.span_queue: deque[StepTrace] = deque()
        self.span_dropped = 0
        self.truncated = False
        self.max_ranges = MAX_RANGES
        self._armed = False

    @property
    def wanted(self) -> bool:
        """True when the next sampled step should be recorded (armed and not full, or spans)."""
        if self.spans and not self.steps:
            return True
        if not self._armed and not self.steps:
            return False  # the common case: one attribute read each
        if self.clock() > self.deadline:
            # Nobody came back for it (armed, or full and never taken): stop recording and
            # let the records go (up to 200k layer ranges would otherwise stay).
            with self.lock:
                self._armed = False
                self.steps = []
                self.ranges = 0
            return self.spans
        return self._armed or self.spans

    def arm(self, steps: int, timeout_s: float, trace_id: str = "",
            max_ranges: int = MAX_RANGES) -> None:
        """Start a live trace of the next ``steps`` sampled steps (older records dropped),
        keeping at most ``max_ranges`` layer ranges; recording stops by itself after
        ``timeout_s`` even if nobody takes the records."""
        with self.lock:
            self.max_ranges = max(1, min(int(max_ranges), MAX_RANGES))
            self.target = max(1, min(int(steps), MAX_STEPS))
            self.deadline = self.clock() + max(0.0, float(timeout_s))
            self.steps = []
            self.ranges = 0
            self.trace_id = trace_id
            self.truncated = False
            self._armed = True

    def add(self, step: StepTrace) -> None:
        """Keep one step for the armed trace and/or the span queue."""
        with self.lock:
            if self._armed:
                if self.ranges + len(step.layers) > self.max_ranges:
                    self.truncated = True
                    self._armed = False
                else:
                    self.steps.append(step)
                    self.ranges += len(step.layers)
                    if len(self.steps) >= self.target:
                        self._armed = False  # full: nothing more is recorded
            if self.spans:
                if len(self.span_queue) >= SPAN_QUEUE_MAX:
                    self.span_queue.popleft()
                    self.span_dropped += 1
                self.span_queue.append(step)

    @property
    def recording(self) -> bool:
        """Armed and neither full nor cut short by its bound on layer ranges."""
        return self._armed

    def count(self, trace_id: str = "") -> int:
        """Steps recorded so far for the armed trace (-1: another trace armed since)."""
        with self.lock:
            if trace_id and trace_id != self.trace_id:
                return -1
            return len(self.steps)

    def take(self, trace_id: str = "", max_ranges: int | None = None
             ) -> tuple[list[StepTrace], bool, bool]:
        """The first recorded steps holding at most ``max_ranges`` layer ranges (at least one
        step; all of them when None), whether recording was cut short, and whether more are
        left. Taking stops the recording; the last page forgets the trace. A ``trace_id``
        that is not the armed one gets nothing (another trace replaced it)."""
        with self.lock:
            if trace_id and trace_id != self.trace_id:
                return [], False, False
            self._armed = False
            n, ranges = len(self.steps), 0
            if max_ranges is not None:
                n = 0
                for st in self.steps:
                    if n and ranges + len(st.layers) > max_ranges:
                        break
                    ranges += len(st.layers)
                    n += 1
            out, self.steps = self.steps[:n], self.steps[n:]
            more = bool(self.steps)
            truncated = self.truncated
            if not more:
                self.ranges, self.target, self.trace_id = 0, 0, ""
            return out, truncated, more

    def take_spans(self) -> list[StepTrace]:
        """Every step waiting for the span exporter (export thread)."""
        with self.lock:
            out = list(self.span_queue)
            self.span_queue.clear()
            return out


def page_ranges(answer: dict[str, Any]) -> int:
    """Layer ranges in one worker's trace answer (its steps' ``layers`` counts)."""
    return sum(int(s.get("layers") or 0) for s in answer.get("steps") or ()
               if isinstance(s, dict) and isinstance(s.get("layers"), int))


class TracePages:
    """The API server's side of a paged live trace: every worker's pages merged into one
    answer per worker (``pids``: the workers armed), RPC errors kept aside, and the layer
    ranges counted so the trace can be held to its bound."""

    def __init__(self, pids: set[Any]) -> None:
        self.pids = pids
        self.merged: dict[Any, dict[str, Any]] = {}
        self.errors: list[dict[str, Any]] = []
        self.total = 0

    def add(self, page: list[dict[str, Any]]) -> bool:
        """Fold one page (every worker's answer to one take); True when a worker has more."""
        more = False
        for a in page:
            if a.get("error"):
                self.errors.append(a)
                continue
            if a.get("pid") not in self.pids:
                continue
            have = self.merged.setdefault(a["pid"], {**a, "steps": []})
            have["steps"] += a.get("steps") or []
            have["truncated"] = have.get("truncated") or a.get("truncated")
            self.total += page_ranges(a)
            more |= bool(a.get("more"))
        return more

    def trim(self, max_ranges: int) -> bool:
        """Drop the last steps of the largest answers until at most ``max_ranges`` ranges
        are left (the last page's shares round up to whole steps; each worker keeps at least
        one step); True when anything was over."""
        if self.total <= max_ranges:
            return False
        over = self.total - max_ranges
        for a in sorted(self.merged.values(), key=lambda a: -page_ranges(a)):
            while over > 0 and len(a["steps"]) > 1:
                last = a["steps"].pop()
                over -= int(last.get("layers") or 0) if isinstance(last, dict) else 0
        return True

    def answers(self) -> list[dict[str, Any]]:
        """One merged answer per worker, then the RPC errors."""
        return [*self.merged.values(), *self.errors]
