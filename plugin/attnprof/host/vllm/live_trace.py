"""``GET /attnprof/trace``: record the next N sampled steps of every worker, bounded.

The API server arms every worker (each keeps at most ``ATTNPROF_TRACE_MAX_RANGES_PER_WORKER``
layer ranges), waits with asyncio sleeps (never blocking the loop) until each has its steps or
the timeout passes, then takes the records **in pages** (each worker answers at most
``TRACE_PAGE_RANGES`` ranges per RPC, so no single pause of the engine carries the whole
trace) until ``ATTNPROF_TRACE_MAX_RANGES`` ranges in all, and drops the rest. The body is
rendered in a thread (:func:`attnprof.exporters.chrome_trace.render_live_trace`) as byte
chunks that are streamed. One trace at a time per API server: a second request gets
:class:`TraceBusy` (409) with the time the running one may still take.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from attnprof.aggregate.trace import TracePages
from attnprof.host.vllm import runtime
from attnprof.host.vllm.rpc import rpc_all

__all__ = ["TRACE_DEFAULT_STEPS", "TRACE_DEFAULT_TIMEOUT_S", "TRACE_MAX_TIMEOUT_S",
           "TRACE_PAGE_RANGES", "LiveTrace", "TraceBusy", "trace_params"]

TRACE_DEFAULT_STEPS = 8
TRACE_DEFAULT_TIMEOUT_S = 30.0
TRACE_MAX_TIMEOUT_S = 300.0
TRACE_POLL_S = 0.2
"""How often the trace route asks the workers how many steps they have (a tiny RPC)."""
TRACE_PAGE_RANGES = 4096
"""Layer ranges one worker answers per page (about 1 MB of compact JSON, a few ms)."""


class TraceBusy(RuntimeError):
    """A live trace is already being recorded by this API server (the route answers 409)."""

    def __init__(self, remaining_s: float) -> None:
        super().__init__(f"a trace is already being recorded (at most {remaining_s:.1f} s "
                         "more)")
        self.remaining_s = remaining_s


def trace_params(query: Any) -> tuple[int, float]:
    """``steps`` (1..1000, default 8) and ``timeout`` seconds ((0, 300], default 30) from the
    query string; ``ValueError`` with a one-line message otherwise."""
    from attnprof.aggregate.trace import MAX_STEPS

    raw = query.get("steps")
    try:
        steps = TRACE_DEFAULT_STEPS if raw is None else int(raw)
    except ValueError:
        raise ValueError(f"steps must be an integer in [1, {MAX_STEPS}], got {raw!r}") from None
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer in [1, {MAX_STEPS}], got {raw!r}")
    raw_t = query.get("timeout")
    try:
        timeout = TRACE_DEFAULT_TIMEOUT_S if raw_t is None else float(raw_t)
    except ValueError:
        timeout = -1.0
    if not 0.0 < timeout <= TRACE_MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be seconds in (0, {TRACE_MAX_TIMEOUT_S:g}], "
                         f"got {raw_t!r}")
    return steps, timeout


class LiveTrace:
    """One API server's live traces (see the module docstring)."""

    def __init__(self, engine_client: Any) -> None:
        self.engine_client = engine_client
        self._busy_until: float | None = None  # monotonic time the running trace may end
        self.served = 0
        self.abandoned = 0
        """Traces stopped early because the client disconnected."""
        self.pages = 0
        """Page RPCs of the last trace (tests and the benchmark read it)."""

    @property
    def busy(self) -> bool:
        return self._busy_until is not None

    async def record(self, steps: int, timeout: float, rpc_timeout: float, max_bytes: int,
                     gone: Callable[[], Awaitable[bool]] | None = None,
                     max_ranges: int = 150_000, max_ranges_per_worker: int = 40_000
                     ) -> list[bytes]:
        """The trace body as byte chunks (empty when the client went away). Raises
        :class:`TraceBusy`, ``TimeoutError`` (a worker RPC did not answer within
        ``rpc_timeout``), or the RPC's own error. ``gone``: an async callable, true once the
        client has disconnected (the trace then stops, frees the workers' records and the
        slot, and renders nothing)."""
        now = time.monotonic()
        if self._busy_until is not None:
            raise TraceBusy(max(0.0, self._busy_until - now))
        # Recording, then at most a few RPC waits for the pages and the render.
        self._busy_until = now + timeout + 3 * rpc_timeout
        try:
            return await self._record(steps, timeout, rpc_timeout, max_bytes, gone,
                                      max_ranges, max_ranges_per_worker)
        finally:
            self._busy_until = None

    async def _rpc(self, rpc_timeout: float, *args: Any) -> list[dict[str, Any]]:
        """Every worker's answer to one trace op. An engine that fails the RPC (dead, not
        ours) is the host's state, not attnprof's bug: counted without tripping a breaker,
        and the trace goes on with the answers there are. ``TimeoutError`` passes (504)."""
        if self.engine_client is None:
            return []
        try:
            # The engine is given no timeout (a late answer would become a model step's
            # output); only this wait is bounded, and a late answer is dropped by vLLM's
            # client. A late "arm" stops by itself at the workers' own deadline.
            got = await asyncio.wait_for(rpc_all(self.engine_client, "attnprof_trace", *args),
                                         rpc_timeout)
        except TimeoutError:
            raise
        except Exception as exc:
            runtime.STATE.errors.note("trace_rpc", exc)
            return [{"error": f"{type(exc).__name__}: {exc}"}]
        return [a for a in got if isinstance(a, dict)]

    async def _record(self, steps: int, timeout: float, rpc_timeout: float, max_bytes: int,
                      gone: Callable[[], Awaitable[bool]] | None, max_ranges: int,
                      per_worker: int) -> list[bytes]:
        st = runtime.STATE
        trace_id = secrets.token_hex(8)
        kv: list[tuple[int, float]] = []
        t_start = time.monotonic()
        self._kv_sample(kv)
        # Workers stop recording by themselves a little after our deadline.
        armed = await self._rpc(rpc_timeout, "arm", trace_id, steps, timeout + rpc_timeout,
                                min(per_worker, max_ranges))
        pids = {a.get("pid") for a in armed if a.get("armed")}
        deadline = time.monotonic() + timeout
        timed_out = False
        poll = TRACE_POLL_S / 8
        while pids:
            # Short first waits (a busy server fills N steps in tens of ms), then every
            # TRACE_POLL_S: a handful of tiny RPCs per trace.
            await asyncio.sleep(poll)
            poll = min(TRACE_POLL_S, 2 * poll)
            self._kv_sample(kv)
            counts = await self._rpc(rpc_timeout, "count", trace_id)
            # -1: another API server armed a trace since (ours lost those workers); not
            # recording: that worker is full (its bound on ranges) and will add nothing.
            if all(c.get("steps", 0) >= steps or c.get("steps", 0) < 0
                   or c.get("recording") is False for c in counts if c.get("pid") in pids):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            if gone is not None and await gone():
                # Nobody to answer: free the workers' records and the one-trace slot now
                # rather than at the deadline (up to 300 s of 409s for everyone else).
                await self._rpc(rpc_timeout, "drop", trace_id)
                self.abandoned += 1
                return []
        taken, cut = await self._take_pages(pids, trace_id, rpc_timeout, max_ranges) \
            if pids else ([], None)
        self._kv_sample(kv)
        meta = {"model": st.model_label, "requested_steps": steps, "timed_out": timed_out,
                "timeout_s": timeout, "wall_s": round(time.monotonic() - t_start, 3),
                "workers_armed": len(pids), "pages": self.pages, "api_pid": os.getpid(),
                "truncated": cut,
                "errors": [a["error"] for a in (*armed, *taken) if a.get("error")]}
        from attnprof.exporters.chrome_trace import render_live_trace

        def bad(exc: Exception) -> None:
            st.errors.record("snapshot_parse", exc)

        body = await asyncio.to_thread(render_live_trace, taken, kv, meta, max_bytes, bad)
        self.served += 1
        return body

    async def _take_pages(self, pids: set[Any], trace_id: str, rpc_timeout: float,
                          max_ranges: int) -> tuple[list[dict[str, Any]], str | None]:
        """Every worker's records, a page per RPC, until ``max_ranges`` in all; the rest is
        dropped in the workers. Returns one merged answer per worker (and RPC errors as
        ``{"error": ...}``) and why records were left out, if they were."""
        pages = TracePages(pids)
        self.pages = 0
        more = True
        while more and pages.total < max_ranges:
            share = max(1, min(TRACE_PAGE_RANGES,
                               (max_ranges - pages.total) // max(1, len(pids))))
            page = await self._rpc(rpc_timeout, "take", trace_id, 0, 0.0, share)
            self.pages += 1
            more = pages.add(page)
        cut = None
        if more:
            await self._rpc(rpc_timeout, "drop", trace_id)
            cut = (f"later steps left out: the trace reached ATTNPROF_TRACE_MAX_RANGES="
                   f"{max_ranges} layer ranges")
        if pages.trim(max_ranges):  # the last page's shares rounded up to whole steps
            cut = cut or (f"later steps left out: the trace reached "
                          f"ATTNPROF_TRACE_MAX_RANGES={max_ranges} layer ranges")
        return pages.answers(), cut

    @staticmethod
    def _kv_sample(out: list[tuple[int, float]]) -> None:
        # The stat logger's latest scheduler KV usage, as of now (API server only).
        req = runtime.STATE.requests
        usage = getattr(req, "kv_cache_usage", None) if req is not None else None
        if isinstance(usage, (int, float)):
            out.append((time.time_ns(), float(usage)))
