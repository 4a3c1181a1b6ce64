"""KV-cache pressure over time, from the scheduler and iteration stats vLLM hands the stat
logger once per engine output batch (docs/kv-pressure.md).

Bounded memory: a time-weighted histogram of KV usage on fixed edges (0.9 is one, so the
time above 90% is exact), a few running totals, and block-seconds per request-length class.
Nothing per request is kept; no ids, no text.

Several engines (data parallelism: vLLM makes one stat logger per engine, each with its own
KV cache) feed one :class:`KvPressure`. Each engine's last stats batch is kept apart, so an
interval is always one engine's own; the histogram and totals are the engines' series summed
in time (``busy_seconds`` is engine-seconds), the peak is the highest usage any one engine's
cache reached, and ``current`` the fullest engine's latest usage.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from attnprof.contracts.snapshot import KvLayer, KvPressureStats
from attnprof.facts.kv import held_tokens

__all__ = ["CLASS_BOUNDS", "CLASS_NAMES", "HIGH_USAGE", "MAX_ENGINES", "USAGE_BOUNDS",
           "FinishedRequest", "KvPressure", "block_seconds"]

USAGE_BOUNDS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9,
                                   0.95, 0.98, 1.0)
"""Upper edges of the usage buckets; bucket 0 is usage exactly 0 (nothing cached)."""
HIGH_USAGE = 0.9
""""Above 90%": usage > 0.9, the buckets after this edge."""
CLASS_NAMES: tuple[str, ...] = ("short", "medium", "long")
CLASS_BOUNDS: tuple[int, ...] = (512, 2048)
"""Context length (prompt + generated tokens) classes: short <= 512 (chat turns),
medium 513-2048, long > 2048 (documents)."""
MAX_ENGINES = 1024
"""Engines tracked apart (bounded memory); further engine indices share one slot."""


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """The token counts and times of one finished request (vLLM's FinishedRequestStats)."""

    prompt_tokens: int
    generation_tokens: int
    prefill_time_s: float
    decode_time_s: float


def block_seconds(r: FinishedRequest, block_size: int, window: int | None = None) -> float:
    """Estimated KV block-seconds one finished request held: its prompt for the prefill
    time, then prompt plus half its generated tokens (they grow linearly) for the decode
    time, divided by the block size. ``window``: every layer keeps at most that many tokens.
    Queued time holds no blocks; a preempted request's recomputation is not counted."""
    tok_s = (held_tokens(float(r.prompt_tokens), window) * max(0.0, r.prefill_time_s)
             + held_tokens(r.prompt_tokens + r.generation_tokens / 2, window)
             * max(0.0, r.decode_time_s))
    return tok_s / max(1, block_size)


class KvPressure:
    """Thread-safe; :meth:`record` costs a few microseconds (one bisect, a few adds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = [0.0] * len(USAGE_BOUNDS)
        self.busy_s = 0.0
        self.peak: float | None = None
        self.current: float | None = None
        self.preemptions = 0
        self.waiting_s = 0.0
        self.waiting_high_s = 0.0
        self.saturated_s = 0.0
        self.running_req_s = 0.0
        self.class_requests = [0] * len(CLASS_NAMES)
        self.class_block_s = [0.0] * len(CLASS_NAMES)
        self.max_num_seqs: int | None = None
        self.block_size: int | None = None
        self.num_blocks: int | None = None
        self.kv_dtype: str | None = None
        self.layers: list[KvLayer] = []
        # engine index -> its last batch: t, usage, running, waiting
        self._last: dict[int, tuple[float, float, int, int]] = {}

    def configure(self, *, max_num_seqs: int | None = None, block_size: int | None = None,
                  num_blocks: int | None = None, kv_dtype: str | None = None,
                  layers: Sequence[KvLayer] | None = None) -> None:
        """Facts of the engine (set once known; None leaves a fact as it is)."""
        with self.lock:
            if max_num_seqs is not None:
                self.max_num_seqs = max_num_seqs
            if block_size is not None:
                self.block_size = block_size
            if num_blocks is not None:
                self.num_blocks = num_blocks
            if kv_dtype is not None:
                self.kv_dtype = kv_dtype
            if layers is not None:
                self.layers = list(layers)

    def _window(self) -> int | None:
        # Block-seconds honour a window only when every layer has one (vLLM then frees blocks
        # that slid out); a hybrid model's full layers hold the whole context.
        ws = [lay.window for lay in self.layers]
        return max(w for w in ws if w) if ws and all(ws) else None  # type: ignore[type-var]

    def record(self, now: float, usage: float | None, running: int, waiting: int,
               preempted: int, finished: Sequence[FinishedRequest] = (), engine: int = 0
               ) -> None:
        """One stats batch of engine ``engine`` at monotonic time ``now``: the time since that
        engine's previous batch is attributed to its previous state (usage, running,
        waiting)."""
        with self.lock:
            self.preemptions += max(0, preempted)
            if engine not in self._last and len(self._last) >= MAX_ENGINES:
                engine = -1
            last = self._last.get(engine)
            if last is not None:
                t0, u0, r0, w0 = last
                dt = max(0.0, now - t0)
                if r0 or w0:
                    self._busy(dt, u0, r0, w0)
                # else: idle, not counted (vLLM sends nothing while idle)
            if usage is not None:
                u = min(1.0, max(0.0, usage))
                self.peak = u if self.peak is None else max(self.peak, u)
                self._last[engine] = (now, u, running, waiting)
                self.current = max(x[1] for x in self._last.values())
            bs = self.block_size or 16
            win = self._window()
            for r in finished:
                c = bisect.bisect_left(CLASS_BOUNDS, r.prompt_tokens + r.generation_tokens)
                self.class_requests[c] += 1
                self.class_block_s[c] += block_seconds(r, bs, win)

    def _busy(self, dt: float, u: float, running: int, waiting: int) -> None:
        self.busy_s += dt
        self.seconds[bisect.bisect_left(USAGE_BOUNDS, u)] += dt
        self.running_req_s += running * dt
        if waiting:
            self.waiting_s += dt
            if u > HIGH_USAGE:
                self.waiting_high_s += dt
        if self.max_num_seqs and running >= self.max_num_seqs:
            self.saturated_s += dt

    def summary(self) -> KvPressureStats:
        """A copy of the running totals and facts (never raises)."""
        with self.lock:
            return KvPressureStats(
                usage_bounds=list(USAGE_BOUNDS), usage_seconds=list(self.seconds),
                busy_seconds=self.busy_s, peak=self.peak, current=self.current,
                preemptions=self.preemptions, waiting_seconds=self.waiting_s,
                waiting_kv_high_seconds=self.waiting_high_s,
                saturated_seconds=self.saturated_s, running_request_seconds=self.running_req_s,
                max_num_seqs=self.max_num_seqs, block_size=self.block_size,
                num_blocks=self.num_blocks, kv_dtype=self.kv_dtype, layers=list(self.layers),
                class_names=list(CLASS_NAMES), class_bounds=list(CLASS_BOUNDS),
                class_requests=list(self.class_requests),
                class_block_seconds=list(self.class_block_s))
