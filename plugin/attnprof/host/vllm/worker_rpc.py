"""A vLLM worker's answers to the API server: snapshot, poll, head-statistics deltas, the live
trace's arm/count/take, and the export loop's samples and spans, read from a running
:class:`~attnprof.capture.vllm.hooks.Capture` (``cap``) through :class:`WorkerCapture`, what
these answers read of it and nothing more.

These run between model steps (collective RPC) or on the export thread, never inside one;
the snapshot itself is assembled in :mod:`attnprof.aggregate.worker_snapshot`.
:func:`worker_methods` are the functions installed on vLLM's ``WorkerBase``: each catches
its own errors (counted) and answers ``{"error": ...}``, never raising into vLLM's worker loop.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import time
from collections.abc import Callable, Sized
from typing import Any, Protocol, cast

from attnprof._safety import ErrorBook, fault_point
from attnprof.aggregate import worker_snapshot as ws
from attnprof.aggregate.background import LatestBuild
from attnprof.aggregate.layers import WorkerAggregates
from attnprof.aggregate.sampler import StepSampler
from attnprof.aggregate.trace import MAX_RANGES, TraceBuffer
from attnprof.capture.vllm.host_state import HostState
from attnprof.capture.vllm.model_info import BackendReports
from attnprof.contracts.snapshot import (
    HeadStatsCost,
    KernelGroup,
    PollCost,
    SamplerStats,
    WorkerSnapshot,
)

__all__ = ["WorkerCapture", "head_stats_take", "kernel_map", "poll", "sampler_stats", "samples",
           "slow_parts", "slow_version", "snapshot", "start_spans", "trace_arm", "trace_count",
           "trace_take", "warm_encoders", "worker_methods"]


class WorkerCapture(Protocol):
    """What the worker's answers read of its capture (:class:`~attnprof.capture.vllm.hooks.
    Capture` is one): the aggregates and counters they report, the buffers they take from,
    and the two calls they make. Read-only but for the two the answers set (``deltas``,
    ``hs_buffer``: made at the first pull where the hooks have not made them)."""

    hs_buffer: Any  # HeadStatsDoubleBuffer once a sampled prompt made it
    deltas: Any  # DeltaFiles: how the deltas reach the API server

    @property
    def state(self) -> HostState: ...
    @property
    def errors(self) -> ErrorBook: ...
    @property
    def sampler(self) -> StepSampler: ...
    @property
    def aggs(self) -> WorkerAggregates: ...
    @property
    def seen(self) -> int: ...
    @property
    def pending(self) -> Sized: ...
    @property
    def in_step(self) -> int: ...
    @property
    def hs(self) -> HeadStatsCost: ...
    @property
    def poll_cost(self) -> PollCost: ...
    @property
    def rank(self) -> dict[str, int]: ...
    @property
    def total_kv_heads(self) -> int | None: ...
    @property
    def total_layers(self) -> int | None: ...
    @property
    def reports(self) -> BackendReports: ...
    @property
    def snapshots(self) -> LatestBuild: ...
    @property
    def trace(self) -> TraceBuffer: ...

    def resolve_pending(self) -> None: ...

    def set_sampling(self, rate: float | None = None,
                     head_stats_rate: float | None = None) -> dict[str, Any]: ...


def start_spans(cap: WorkerCapture, get_hub: Callable[[], Any]) -> None:
    """Add the OTLP span sink to this worker's export loop (``get_hub()``; its thread builds
    the spans); a sink that cannot start is counted and spans stay off."""
    try:
        from attnprof.exporters.otlp import OtlpSpanSink

        hub = get_hub()
        hub.add_sink(OtlpSpanSink(cap.state.otlp, role="worker", take=cap.trace.take_spans,
                                  model=lambda: cap.state.model_label,
                                  on_error=cap.errors.note))
        hub.start()
    except Exception as exc:
        cap.errors.record("export", exc)
        cap.trace.spans = False


def sampler_stats(cap: WorkerCapture) -> SamplerStats:
    """The sampler's counters; a step in progress or a GPU step waiting for its events is
    not counted as unsampled."""
    return ws.sampler_stats(cap.sampler, cap.aggs.outcomes, cap.seen,
                             len(cap.pending) + cap.in_step, getattr(cap, "graphs", None))


def samples(cap: WorkerCapture) -> list[Any]:
    """This worker's metric samples for the export loop (its thread)."""
    from attnprof.exporters.samples import worker_samples

    # Under tensor parallelism every rank times the same layers: per-layer series come
    # from TP rank 0 only, or Prometheus' sum over processes would multiply them.
    first_tp = cap.rank["tp_rank"] == 0
    return worker_samples(cap.state.model_label, cap.aggs, sampler_stats(cap),
                          cap.hs.queries, per_layer=first_tp,
                          per_step=first_tp and cap.rank["pp_rank"] == 0,
                          runner=getattr(cap, "runner", None))


def kernel_map(cap: WorkerCapture) -> list[KernelGroup]:
    """The worker's kernel map (see :meth:`BackendReports.kernel_map`)."""
    return cap.reports.kernel_map(list(cap.aggs.layers.values()))  # type: ignore[no-any-return]


def snapshot(cap: WorkerCapture, include_head_stats: bool = True) -> WorkerSnapshot:
    """This worker's snapshot; GPU steps whose events completed are folded first. No
    export flush: it runs between model steps, and an export may hold the hub's lock for
    seconds (the export thread flushes every second)."""
    cap.resolve_pending()
    if cap.hs_buffer is not None and include_head_stats:
        cap.hs_buffer.settle()  # folds the statistics' worker still holds (capture/head_worker)
    return ws.worker_snapshot(
        os.getpid(), multiprocessing.current_process().name, cap.aggs, kernel_map(cap),
        sampler_stats(cap), cap.errors, ws.head_stats_cost(cap.hs),
        dataclasses.replace(cap.poll_cost),
        cap.hs_buffer.active.to_dict() if cap.hs_buffer is not None and include_head_stats
        else None, cap.state.probe, getattr(cap, "runner", None))


def poll(cap: WorkerCapture, with_head_stats: bool = True, api_host: str | None = None
         ) -> dict[str, Any]:
    """The API server's periodic pull (between model steps, so small and cheap): this
    worker's snapshot without head statistics, its parallel placement, and the head
    statistics: the deltas finished since the last pull, and a swap of the accumulator's
    halves whose delta a later :func:`head_stats_take` collects (serialized off the
    engine's path). ``api_host``: the API server's :func:`host_id`; on this machine the
    deltas travel as files, not in the answer.

    The engine's thread builds nothing here that grows with the model, not even once: the
    snapshot's layers come from the snapshot thread's latest build (``cap.snapshots``); when
    sampled steps were folded since, the answer carries ``snapshot_stale`` (the build's age)
    and the thread rebuilds for the next pull. Before its first build (the first pull starts
    the thread) the answer has no layers and ``snapshot_stale`` with ``built`` null."""
    fault_point("capture")
    t0 = time.perf_counter()
    # No export flush here: the export thread flushes every second, and a flush (file
    # writes) would lengthen the pause the engine takes for this poll.
    cap.resolve_pending()  # GPU steps whose events completed (never waits)
    # The layers, kernel map and step phases were built on the snapshot thread (milliseconds
    # on 80 layers, in pieces that leave the engine the GIL); only the counters every step
    # changes are read here. A build behind the aggregates is served as it is, and says so.
    slow, fresh, age, built = cap.snapshots.get()
    ready = slow is not None
    if not ready:
        # The first pull (or every build so far failed): the layers are built on the
        # snapshot thread, started below, never here (milliseconds on a large model, over
        # the 1 ms an engine-thread pause may take). This answer has the counters and no
        # layers yet, and says so; the API server asks again (LiveView._catch_up).
        slow = ws.not_built()
    snap = ws.join(ws.fast_snapshot(
        os.getpid(), multiprocessing.current_process().name, sampler_stats(cap), cap.errors,
        ws.head_stats_cost(cap.hs), cap.poll_cost, getattr(cap, "runner", None)), slow)
    t1 = time.perf_counter()
    out = _placement(cap)
    if with_head_stats:
        out["head_stats"] = _take_deltas(cap, api_host, swap=True)
    if not ready:  # after this pull's own work (the build would compete with it): start
        # the thread without waiting for it to run (start_soon); one already running
        # (builds so far failed) is woken to try again
        cap.snapshots.start_soon()
    t2 = time.perf_counter()
    # This pull's own cost, all but the pickling vLLM does with the answer.
    ws.note_poll(cap.poll_cost, t0, t1, t2, cap.hs_buffer)
    snap["poll_cost"] = cap.poll_cost.to_json()
    out["snapshot"] = snap
    if not ready:
        out["snapshot_stale"] = {"age_s": None, "built": None, "now": list(slow_version(cap)),
                                 "reason": "not built yet: the snapshot thread builds the "
                                           "layers; the next pull has them"}
    elif not fresh:
        # Sampled steps were folded since the build: they are in the counters (read now, at
        # the same step on every rank), not yet in the layers. Said so; the API server asks
        # again once the build it woke is done (LiveView._catch_up).
        # built/now: the versions (slow_version) the served build and this pull stand at;
        # the API server takes a later build once it covers "now" (LiveView._catch_up).
        built_at = cast("tuple[int, int, bool]", built)  # the builder's: slow_version's
        out["snapshot_stale"] = {"age_s": age, "built": list(built_at), "now": list(
            slow_version(cap)), "reason": "built before the last sampled steps; the next "
                                 "pull has them"}
        cap.snapshots.wake()  # now that this pull is done: the rebuild is for the next one
    return out


def slow_parts(cap: WorkerCapture, pieces: bool = True) -> dict[str, Any]:
    """The snapshot's parts that only sampled steps change (:func:`ws.slow_parts`); in
    pieces (:func:`~attnprof.aggregate.background.yield_gil`) as the snapshot thread builds
    them, or in one go (``pieces=False``: where nothing waits for the GIL, e.g. tests)."""
    from attnprof.aggregate.background import yield_gil

    return ws.slow_parts(cap.aggs, cap.reports.kernel_map, cap.state.probe,
                         yield_gil if pieces else None)


def slow_version(cap: WorkerCapture) -> tuple[int, int, bool]:
    """What :func:`slow_parts` depends on (:func:`ws.slow_version`), in O(1)."""
    return ws.slow_version(cap.aggs, cap.state.probe)


def head_stats_take(cap: WorkerCapture, api_host: str | None = None) -> dict[str, Any]:
    """The deltas finished since the last pull, with this worker's placement (tiny: the
    API server asks until none is pending)."""
    fault_point("capture")
    out = _placement(cap)
    out["head_stats"] = _take_deltas(cap, api_host, swap=False)
    return out


def _placement(cap: WorkerCapture) -> dict[str, Any]:
    return {"pid": os.getpid(), "rank": dict(cap.rank),
            "total_kv_heads": cap.total_kv_heads, "total_layers": cap.total_layers}


def _take_deltas(cap: WorkerCapture, api_host: str | None, swap: bool) -> dict[str, Any]:
    buf = cap.hs_buffer
    if buf is None:
        return {"deltas": [], "pending": False}
    if cap.deltas is None:  # a buffer set from outside (tests)
        from attnprof.capture.vllm.deltas import DeltaFiles

        cap.deltas = DeltaFiles()
    if swap:
        cap.deltas.forget_handed()  # a new pull: the last one's files were read
    # read before taking: a drain ending between the two reads is then still "pending" (the
    # caller asks once more) instead of neither handed out nor pending (left for a later pull)
    was_draining = buf.draining
    ready = buf.take_ready()
    if swap:
        buf.swap(cap.deltas.finish_for(api_host))
    cap.deltas.hand(ready)
    for e in buf.errors:
        cap.errors.record("head_stats", RuntimeError(e))
    buf.errors.clear()
    return {"deltas": ready, "pending": was_draining or buf.draining}


def trace_arm(cap: WorkerCapture, steps: int, timeout_s: float, trace_id: str = "",
              max_ranges: int = MAX_RANGES) -> dict[str, Any]:
    """Record the next ``steps`` sampled steps for a live trace, at most ``max_ranges``
    layer ranges (RPC, between steps); returns this worker's identity. Recording stops
    by itself after ``timeout_s``."""
    cap.trace.arm(steps, timeout_s, trace_id, max_ranges)
    return {"pid": os.getpid(), "process": multiprocessing.current_process().name,
            "rank": dict(cap.rank), "armed": True}


def trace_count(cap: WorkerCapture, trace_id: str = "") -> dict[str, Any]:
    """Steps recorded so far for the armed trace (tiny: the API server polls it)."""
    cap.resolve_pending()  # GPU steps whose events completed are recorded now
    return {"pid": os.getpid(), "steps": cap.trace.count(trace_id),
            "recording": cap.trace.recording}


def trace_take(cap: WorkerCapture, trace_id: str = "", page_ranges: int | None = None
               ) -> dict[str, Any]:
    """One page of the recorded steps (compact JSON, at most ``page_ranges`` layer ranges)
    and this worker's identity; ``more``: pages are left. Recording stops."""
    cap.resolve_pending()
    steps, truncated, more = cap.trace.take(trace_id, page_ranges)
    return {"pid": os.getpid(), "process": multiprocessing.current_process().name,
            "rank": dict(cap.rank), "truncated": truncated, "more": more,
            "steps": [s.to_json() for s in steps]}


def worker_methods(cap: WorkerCapture, state: Any
                   ) -> dict[str, Callable[..., dict[str, Any]]]:
    """The ``attnprof_*`` methods for vLLM's ``WorkerBase`` (``collective_rpc`` names).

    vLLM's executor waits for their answer with no timeout (a timed-out answer would become
    the next step's output: :mod:`attnprof.host.vllm.rpc`), so each is bounded by what it
    does: no export flush (its lock may be held by an exporter sending over the network), no
    waiting on another thread beyond a lock held for a few copies, no loop over more than
    what one pull or one page holds. One exception, never made by the API server:
    ``attnprof_snapshot`` with head statistics (an offline ``LLM``'s own call) first waits,
    up to 10 s, for the folds the statistics' worker still holds.
    ``ATTNPROF_FAULT_DELAY_S`` (tests only) slows each down on purpose."""
    from attnprof.capture.vllm.rank_sync import leader_answer, take_carried

    def attnprof_snapshot(self: Any, include_head_stats: bool = True) -> dict[str, Any]:
        try:
            # No flush: the export thread flushes every second.
            return snapshot(cap, include_head_stats).to_json()
        except Exception as exc:  # runs in vLLM's worker loop: never raise there
            state.errors.record("snapshot", exc)
            return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

    def attnprof_poll(self: Any, with_head_stats: bool = True,
                      api_host: str | None = None, rate_sync: Any = None) -> dict[str, Any]:
        """``rate_sync``: the leaders' scales the API server carries back (``{group: [seq,
        scale]}``), applied by every rank here, between the same two steps."""
        try:
            take_carried(cap.sampler, rate_sync)
            out = poll(cap, with_head_stats, api_host)
            rep = leader_answer(cap.sampler)
            if rep is not None:
                out["rate_sync"] = rep
            return out
        except Exception as exc:
            state.errors.record("snapshot", exc)
            return {"snapshot": {"pid": os.getpid(),
                                 "error": f"{type(exc).__name__}: {exc}"}}

    def attnprof_head_stats(self: Any, api_host: str | None = None) -> dict[str, Any]:
        try:
            return head_stats_take(cap, api_host)
        except Exception as exc:
            state.errors.record("snapshot", exc)
            return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

    def attnprof_set_sampling(self: Any, rate: float | None = None,
                              head_stats_rate: float | None = None) -> dict[str, Any]:
        try:
            return cap.set_sampling(rate, head_stats_rate)  # type: ignore[no-any-return]
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def attnprof_trace(self: Any, op: str, trace_id: str = "", steps: int = 0,
                       timeout_s: float = 0.0, max_ranges: int = MAX_RANGES
                       ) -> dict[str, Any]:
        """One RPC for the live trace: ``arm`` (``max_ranges``: this worker's bound),
        ``count``, ``take`` (one page of at most ``max_ranges`` ranges) or ``drop``."""
        try:
            fault_point("capture")
            if op == "arm":
                return trace_arm(cap, steps, timeout_s, trace_id, max_ranges)
            if op == "count":
                return trace_count(cap, trace_id)
            if op == "take":
                return trace_take(cap, trace_id, max_ranges)
            if op == "drop":
                cap.trace.take(trace_id)
                return {"pid": os.getpid(), "dropped": True}
            return {"pid": os.getpid(), "error": f"unknown trace op {op!r}"}
        except Exception as exc:
            state.errors.record("trace", exc)
            return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

    def delayed(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """``ATTNPROF_FAULT_DELAY_S`` (tests only): the method sleeps first."""
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            cfg = state.config
            if cfg is not None and cfg.fault_delay_s > 0:
                time.sleep(cfg.fault_delay_s)
            return fn(self, *args, **kwargs)
        return call

    warm_encoders(cap, state)
    return {fn.__name__: delayed(fn) for fn in (
        attnprof_snapshot, attnprof_trace, attnprof_poll, attnprof_head_stats,
        attnprof_set_sampling)}


def warm_encoders(cap: WorkerCapture, state: Any) -> None:
    """Encode a pull's counters once, at install (process start-up), off any pull: the
    first encoding fills Python's ABC caches (the encoder's isinstance checks against
    ``Mapping`` and friends, ~0.6 ms once), which the first pull on the engine's thread
    would otherwise pay. Errors are counted, never raised."""
    try:
        ws.fast_snapshot(os.getpid(), "", sampler_stats(cap), cap.errors,
                         ws.head_stats_cost(cap.hs), PollCost(), getattr(cap, "runner", None))
    except Exception as exc:
        state.errors.record("snapshot", exc)
