"""A vLLM worker's snapshot, assembled from its aggregates (pure Python, no torch or vLLM).

Capture keeps the live state (the sampler, :class:`WorkerAggregates`, the backend reports it
asked vLLM for at model build); these functions turn it into the typed records of
:mod:`attnprof.contracts.snapshot`: the sampler's counters, the kernel map (identical layers
grouped, each group with vLLM's verdict on every backend), the head-statistics cost, the
poll's own cost, and the :class:`WorkerSnapshot` that holds them.

For the API server's periodic pull the snapshot comes in two halves: the parts that change
only on sampled steps (layers, kernel map, step phases, probe: :func:`slow_parts`, built off
the engine's thread in pieces, milliseconds on 80 layers) and the counters that change on
every step (:func:`fast_snapshot`, microseconds), joined by :func:`join`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from attnprof.aggregate.layers import LayerInfo, WorkerAggregates
from attnprof.aggregate.sampler import StepSampler
from attnprof.contracts.snapshot import (
    HeadStatsCost,
    KernelGroup,
    PollCost,
    RunnerReport,
    SamplerStats,
    WorkerSnapshot,
)

__all__ = ["SLOW_FIELDS", "fast_snapshot", "head_stats_cost", "join", "kernel_groups",
           "not_built", "note_poll", "sampler_stats", "slow_parts", "slow_version",
           "worker_snapshot"]

SLOW_FIELDS = ("layers", "kernel_map", "steps", "probe")
"""The :class:`WorkerSnapshot` fields :func:`slow_parts` builds."""


def not_built() -> dict[str, Any]:
    """The :data:`SLOW_FIELDS` empty: what a pull joins before the snapshot thread's first
    build (fresh objects: the answer is the caller's to change)."""
    return {"layers": [], "kernel_map": [], "steps": {}, "probe": None}


def sampler_stats(sampler: StepSampler, outcomes: Mapping[str, int], seen: int,
                  in_flight: int, graphs: Any = None) -> SamplerStats:
    """The sampler's counters. ``seen``: steps the hook saw; ``in_flight``: sampled steps
    not recorded yet (GPU steps waiting for their events, the step running now): they are
    not unsampled, and counting them so would overshoot an exported counter that cannot
    come back down. ``graphs``: sampled steps by CUDA graph mode (``modes``, ``steered``:
    capture's ``GraphSteer``)."""
    s = sampler
    o = outcomes
    return SamplerStats(
        seen=seen, sampled=o["sampled"], sampled_long=o["sampled_long"], blind=o["blind"],
        unsampled=max(0, seen - sum(o.values()) - in_flight),
        base_rate=s.base_rate,
        effective_rate=s.rate, budget=s.budget, self_time_s=s.self_time,
        self_time_fraction=s.self_time_fraction(), throttles=s.throttles,
        step_index=s.step + 1, sync=s.sync_role, late_changes=s.late_changes,
        unsynced=getattr(s.sync, "unread", 0), decisions_digest=s.decisions_digest,
        rate_changes=[[st, sc] for st, sc in s.rate_changes],
        graph_modes=dict(graphs.modes) if graphs is not None else {},
        graph_steered=int(graphs.steered) if graphs is not None else 0)


def kernel_groups(layers: Iterable[LayerInfo], report_key: Callable[[LayerInfo], Any],
                  reports: Mapping[Any, dict[str, Any]]) -> list[KernelGroup]:
    """Per group of identical layers (same vLLM KV-cache group, backend, kernel and report
    key), in layer order: the KV-cache group (its spec, window, block size and the bytes a
    token holds in these layers), the backend that ran, the kernel variant, and why each
    other vLLM backend is not valid (``reports[report_key(info)]``, vLLM's own answer; see
    :mod:`attnprof.capture.vllm.backends`)."""
    groups: dict[tuple[Any, ...], list[LayerInfo]] = {}
    for info in sorted(layers, key=lambda i: i.index):
        groups.setdefault((info.kv_group, info.backend, info.kernel, report_key(info)),
                          []).append(info)
    out = []
    for (_, _, _, key), infos in groups.items():
        rep = reports[key]
        first = infos[0]
        known = first.kv_group is not None
        out.append(KernelGroup(
            layers=[i.index for i in infos], backend=first.backend, kernel=first.kernel,
            fused=first.fused, valid_backends=rep.get("valid"),
            rejected={name: b.get("reasons") for name, b in
                      (rep.get("backends") or {}).items() if not b.get("valid")},
            source=rep.get("source"), error=rep.get("error"),
            predicted=rep.get("predicted"),
            flash_attn_version=rep.get("flash_attn_version"), note=rep.get("note"),
            kv_group=first.kv_group, kv_spec=first.kv_spec, sliding_window=first.sliding_window,
            kv_block_size=first.kv_block_size if known else None,
            kv_bytes_per_token=sum(i.kv_bytes_per_token for i in infos) if known else None))
    return out


def head_stats_cost(hs: HeadStatsCost) -> HeadStatsCost:
    """A copy of the running head-statistics cost with its share of the prefill time."""
    out = HeadStatsCost(**{k: getattr(hs, k) for k in
                           ("steps", "requests", "queries", "time_s", "prefill_time_s")})
    out.fraction_of_prefill = (out.time_s / out.prefill_time_s if out.prefill_time_s > 0
                               else None)
    return out


def note_poll(pc: PollCost, t0: float, t1: float, t2: float, buffer: Any = None) -> None:
    """Record one poll's own cost in ``pc``: the snapshot from ``t0`` to ``t1``, the head
    statistics from ``t1`` to ``t2`` (clock readings in seconds); ``buffer``: the
    head-statistics double buffer, whose last drain time and delta size it carries."""
    pc.polls += 1
    pc.last_head_stats_s = t2 - t1
    pc.max_head_stats_s = max(pc.max_head_stats_s, pc.last_head_stats_s)
    pc.last_s = t2 - t0
    pc.max_s = max(pc.max_s, pc.last_s)
    if buffer is not None:
        pc.drain_s, pc.delta_bytes = buffer.drain_s, buffer.delta_bytes


def worker_snapshot(pid: int, process: str, aggs: WorkerAggregates, kernel_map: list[KernelGroup],
                    sampler: SamplerStats, errors: Any, hs_cost: HeadStatsCost,
                    poll_cost: PollCost, head_stats: dict[str, Any] | None,
                    probe: Any = None, runner: RunnerReport | None = None) -> WorkerSnapshot:
    """One worker's :class:`WorkerSnapshot`; ``errors``: its ``ErrorBook`` (copied);
    ``runner``: the model runner it hooks (capture's report)."""
    layers, steps = aggs.cut()
    return dataclasses.replace(
        _counters(pid, process, sampler, errors, hs_cost, poll_cost, runner), layers=layers,
        kernel_map=kernel_map, steps=steps, head_stats=head_stats, probe=probe)


def slow_version(aggs: WorkerAggregates, probe: Any = None) -> tuple[int, int, bool]:
    """What :func:`slow_parts` depends on, in O(1): sampled steps folded (a blind step,
    replayed from a full CUDA graph, changes no layer), layers known, a probe."""
    o = aggs.outcomes
    return (o["sampled"] + o["sampled_long"], len(aggs.layers), probe is not None)


def slow_parts(aggs: WorkerAggregates, kernel_map: Callable[[list[LayerInfo]], list[KernelGroup]],
               probe: Any = None, pause: Callable[[], None] | None = None) -> dict[str, Any]:
    """The snapshot's :data:`SLOW_FIELDS` as JSON: what only sampled steps change. The
    layers and step phases are one cut (read under the aggregates' lock, as the export
    thread reads them); each layer's JSON is then one piece, ``pause()`` runs between two
    (the builder's thread hands the GIL to the engine's there)."""
    def step() -> None:
        if pause is not None:
            pause()

    profiles, steps = aggs.cut(pause)
    layers = []
    for lp in profiles:
        layers.append(lp.to_json())
        step()
    groups = [g.to_json() for g in kernel_map(list(aggs.layers.values()))]
    step()
    return {"layers": layers, "kernel_map": groups,
            "steps": {k: v.to_json() for k, v in steps.items()},
            "probe": probe.to_json() if probe is not None else None}


def fast_snapshot(pid: int, process: str, sampler: SamplerStats, errors: Any,
                  hs_cost: HeadStatsCost, poll_cost: PollCost,
                  runner: RunnerReport | None = None) -> dict[str, Any]:
    """A :class:`WorkerSnapshot`'s JSON without its :data:`SLOW_FIELDS` (left empty): the
    counters of every step, microseconds to build."""
    return _counters(pid, process, sampler, errors, hs_cost, poll_cost, runner).to_json()


def _counters(pid: int, process: str, sampler: SamplerStats, errors: Any,
              hs_cost: HeadStatsCost, poll_cost: PollCost,
              runner: RunnerReport | None = None) -> WorkerSnapshot:
    """The snapshot's per-step counters (both builds start from it: one list of fields)."""
    # One copy under the book's lock: the snapshot thread reads while serving threads record.
    by_place, dropped, tripped = errors.view()
    return WorkerSnapshot(
        pid=pid, process=process, sampler=sampler, errors=by_place, dropped=dropped,
        disabled="capture" in tripped, head_stats_cost=hs_cost, poll_cost=poll_cost,
        runner=runner)


def join(fast: dict[str, Any], slow: Mapping[str, Any]) -> dict[str, Any]:
    """``fast`` (:func:`fast_snapshot`) with ``slow``'s fields in place (O(1): references)."""
    for k in SLOW_FIELDS:
        fast[k] = slow[k]
    return fast
