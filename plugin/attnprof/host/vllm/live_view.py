"""The API server's live view of its workers, behind ``GET /attnprof/snapshot``.

:class:`LiveView` keeps the workers' last snapshots, the head statistics merged from their
deltas (:mod:`attnprof.aggregate.head_stats_merge`), the window advice, and
the rendered bodies (:func:`attnprof.exporters.snapshot_json.snapshot_body`), refreshed at
most every ``ATTNPROF_SNAPSHOT_MAX_AGE_S`` by at most one collective RPC in flight (however
many clients); the API server waits for it at most ``ATTNPROF_RPC_TIMEOUT_S`` (the engine
is given no timeout: :mod:`attnprof.host.vllm.rpc`). Merges and renders run in threads,
never on the event loop. Where tensor-parallel ranks agree on the sampler's scale through the
API server (:class:`~attnprof.capture.vllm.rank_sync.RpcRate`), the view carries the leaders'
scales from one poll to the next, and polls again within ``RATE_SYNC_PENDING_S`` while a
change is pending (``RATE_SYNC_IDLE_S`` otherwise).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from attnprof._safety import fault_point
from attnprof.capture.vllm.deltas import host_id, read_delta
from attnprof.capture.vllm.rank_sync import carried_rates
from attnprof.config import Config
from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
from attnprof.contracts.jsonsafe import dumps
from attnprof.contracts.snapshot import Coverage, Snapshot, SnapshotErrors, WorkerSnapshot
from attnprof.host.vllm import runtime
from attnprof.host.vllm.rpc import rpc_all

__all__ = ["RATE_SYNC_IDLE_S", "RATE_SYNC_PENDING_S", "LiveView"]

CATCH_UP_TRIES = 10
"""Most extra pulls a refresh makes for snapshots built after it began (~0.65 s of growing
sleeps): each pauses the engine between two steps, so a builder that keeps failing must not
cost 20 of them every refresh."""
RATE_SYNC_PENDING_S = 1.0
"""With the RPC rate channel, the next poll while a leader's scale waits to be carried (the
budget measures once a second: a faster poll would carry nothing new)."""
RATE_SYNC_IDLE_S = 5.0
"""... and while none waits (how soon a new wish of a leader is first seen)."""


class LiveView:
    """The API server's view of its workers: their last snapshots, the head statistics
    merged from their deltas, the window advice, and the rendered bodies, all refreshed by
    at most one RPC at a time."""

    def __init__(self, engine_client: Any) -> None:
        self.engine_client = engine_client
        # With several API servers (vLLM's --api-server-count), each would take a disjoint
        # share of the workers' deltas: only the first keeps the head statistics and advice.
        index = getattr(getattr(engine_client, "engine_core", None), "client_index", 0)
        self.keeps_head_stats = not isinstance(index, int) or index == 0
        self.workers: list[WorkerSnapshot] = []
        self.head_stats: Any = None  # global HeadStatsStrata
        from attnprof.aggregate.head_epochs import EpochRing

        # disjoint time windows of the prefill statistics, for head stability (bounded)
        self.epochs = EpochRing()
        self.coverage: Coverage | None = None
        self.advice: WindowAdvice | AdviceUnavailable | None = None
        self.rpc_error: str | None = None
        self.refreshed_at = 0.0  # monotonic time of the last completed refresh
        self.rpcs = 0  # RPCs started (tests and the benchmark read it)
        self._task: asyncio.Future[None] | None = None
        # (advice, head statistics, catch-up) of the task in flight
        self._task_kind = (False, False, False)
        self._render_slots = asyncio.Semaphore(2)  # renders after a timeout are not shared
        # (head statistics?, the keyless note or None) -> (refresh it is of, its render)
        self._bodies: dict[tuple[bool, str | None], tuple[float, asyncio.Future[bytes]]] = {}
        # Merges (refresh thread) and renders of ?head_stats=1 (another thread) may overlap.
        self._hs_lock = threading.Lock()
        # Workers on this machine hand their deltas over as files (not through the engine).
        self.host = host_id()
        self.rate_sync: dict[str, list[Any]] = {}
        """The leaders' scales to carry in the next poll (``{group: [seq, scale]}``)."""
        self._sync_timer: asyncio.TimerHandle | None = None
        self._sync_task: asyncio.Future[None] | None = None

    # ----- refresh: one RPC in flight at most -----
    async def refresh(self, timeout: float, advice: bool = True,
                      head_stats: bool | None = None, catch_up: bool = True) -> None:
        """Start a refresh unless one is in flight, and wait for it up to ``timeout``.
        Raises ``TimeoutError``; the RPC goes on and its answer is still folded in.
        ``head_stats`` (default: ``advice``): also pull the workers' head-statistics deltas,
        the one large part of a poll, only when the advice or a ``?head_stats=1`` needs them.
        ``catch_up``: wait for workers' snapshots built from the steps this poll saw (a reader's
        need); without it the poll only carries the ranks' scales and leaves the view as
        it is (a rate-sync poll). A task in flight that does
        less than asked is waited for, then one more starts."""
        want = (advice, advice if head_stats is None else head_stats, catch_up)
        deadline = time.monotonic() + timeout
        task = self._task
        if task is not None and not task.done():
            covers = all(have or not need for have, need in zip(self._task_kind, want,
                                                                strict=True))
            await asyncio.wait_for(asyncio.shield(task), timeout)
            if covers:
                return
        if self._task is None or self._task.done():
            self._task_kind = want
            self._task = asyncio.ensure_future(self._refresh(*want))
        await asyncio.wait_for(asyncio.shield(self._task),
                               max(0.0, deadline - time.monotonic()))

    async def _refresh(self, advice: bool, head_stats: bool = True,
                       catch_up: bool = True) -> None:
        answers: list[Any] = []
        error = None
        timeout = (runtime.STATE.config or Config()).rpc_timeout_s
        deadline = time.monotonic() + timeout  # what a reader waits for this refresh
        want_hs = head_stats and self.keeps_head_stats
        if self.engine_client is not None:
            self.rpcs += 1
            try:
                answers = await rpc_all(self.engine_client, "attnprof_poll", want_hs,
                                        self.host, dict(self.rate_sync) or None)
            except Exception as exc:  # the engine may not be ours to query
                error = f"{type(exc).__name__}: {exc}"
        # A failed poll keeps the rate sync going at its idle pace (no answer: no new scale).
        self._sync_rates(answers if error is None else [])
        if not catch_up:
            # A rate-sync poll carries scales only: its answers (layers not caught up) never
            # become the view a GET within ATTNPROF_SNAPSHOT_MAX_AGE_S would serve.
            return
        if error is None:
            await self._catch_up(answers, deadline)
        await asyncio.to_thread(self._fold, answers)
        if want_hs and error is None:
            await self._collect_deltas(answers, timeout)
        self.rpc_error = error
        if advice:
            await self._advise()
        self.refreshed_at = time.monotonic()
        self._bodies.clear()
        # This process's exporters too (a thread, off the engine's path), so the request
        # metrics on /metrics agree with the snapshot right away; workers flush every second.
        await asyncio.to_thread(runtime.STATE.flush)

    async def _repolls(self, deadline: float, place: str, method: str,
                       *args: Any) -> AsyncIterator[list[Any]]:
        """``method``'s answers, asked again and again with growing short sleeps in between
        (5 ms up to 100 ms) until ``deadline`` or the caller stops; an RPC that fails ends
        it, noted under ``place`` (the engine's state, not attnprof's bug: no breaker)."""
        wait = 0.005
        while time.monotonic() < deadline:
            await asyncio.sleep(wait)
            wait = min(0.1, wait * 2)
            self.rpcs += 1
            try:
                got = await rpc_all(self.engine_client, method, *args)
            except Exception as exc:
                runtime.STATE.errors.note(place, exc)
                return
            yield got

    async def _catch_up(self, answers: list[Any], deadline: float) -> None:
        """A worker answers the snapshot its snapshot thread built last (built off the
        engine's path); one built before the last sampled steps says so (``snapshot_stale``)
        and the thread rebuilds. Then ask again (tiny pulls: no head statistics, nothing
        swapped) until the refresh's ``deadline`` (2 s at most) or one pull finds every
        worker's snapshot built from at least the steps its first answer stood at (build
        versions, not clocks: a build already running when the refresh began finishes after
        it without those steps); its snapshots replace all of ``answers``' (one collective
        pull: the ranks' counters stay of the same step). Otherwise
        ``answers`` stay as they are: counters current, layers behind (their
        ``snapshot_stale`` is not carried into the served snapshot)."""
        if not any(isinstance(a, dict) and a.get("snapshot_stale") for a in answers):
            return
        t0 = time.monotonic()
        tries = 0
        async for again in self._repolls(min(deadline, t0 + 2.0), "snapshot_rpc",
                                         "attnprof_poll", False, self.host):
            tries += 1
            later = _built_since(answers, again)
            if later is not None:
                for a, snap in zip(answers, later, strict=True):
                    if isinstance(a, dict):
                        a["snapshot"] = snap
                        a.pop("snapshot_stale", None)
                return
            if tries >= CATCH_UP_TRIES:  # a builder that cannot finish: no more pulls
                return

    async def _collect_deltas(self, answers: list[Any], timeout: float) -> None:
        """The poll swapped each worker's head statistics; their deltas are serialized on
        the workers' own threads. Ask (a tiny RPC, no swap) until none is pending; what is
        not ready within ``timeout`` comes with the next refresh."""
        if not _deltas_pending(answers):
            return
        async for answers in self._repolls(time.monotonic() + timeout, "head_stats_rpc",
                                           "attnprof_head_stats", self.host):
            await asyncio.to_thread(self._fold_deltas, answers)
            if not _deltas_pending(answers):
                return

    def _sync_rates(self, answers: list[Any]) -> None:
        """Keep the leaders' scales for the next poll and schedule it (RPC rate channel
        only: without a leader's report nothing is scheduled)."""
        try:
            pending = carried_rates(answers, self.rate_sync)
            if not self.rate_sync or not self.keeps_head_stats:
                return  # no RPC channel here, or another API server keeps it going
            if self._sync_timer is not None:
                self._sync_timer.cancel()
            self._sync_timer = asyncio.get_running_loop().call_later(
                RATE_SYNC_PENDING_S if pending else RATE_SYNC_IDLE_S, self._sync_poll)
        except Exception as exc:
            runtime.STATE.errors.note("rate_sync", exc)

    def start_rate_sync(self) -> None:
        """A first poll ``RATE_SYNC_IDLE_S`` after start-up (its answer says whether any rank
        is on the RPC channel; without one nothing more is scheduled), so ranks on other
        nodes throttle from then on, not from the advice loop's first round (60 s)."""
        if self.keeps_head_stats and self._sync_timer is None and self.engine_client is not None:
            self._sync_timer = asyncio.get_running_loop().call_later(RATE_SYNC_IDLE_S,
                                                                     self._sync_poll)

    def _sync_poll(self) -> None:
        self._sync_timer = None
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.ensure_future(self._sync_once())

    async def _sync_once(self) -> None:
        """One poll without head statistics or advice: carries the leaders' scales."""
        try:
            await self.refresh((runtime.STATE.config or Config()).rpc_timeout_s,
                               advice=False, head_stats=False, catch_up=False)
        except TimeoutError as exc:  # a slow engine is not attnprof's bug: no breaker
            runtime.STATE.errors.note("rate_sync_timeout", exc)
        except Exception as exc:
            runtime.STATE.errors.note("rate_sync", exc)

    def _fold(self, answers: list[Any]) -> None:
        """Parse worker answers and merge their head-statistics deltas (thread)."""
        st = runtime.STATE
        workers: list[WorkerSnapshot] = []
        for a in answers:
            if not isinstance(a, dict):
                continue
            try:
                workers.append(WorkerSnapshot.from_json(a.get("snapshot") or {}))
            except Exception as exc:
                st.errors.record("snapshot_parse", exc)
        self.workers = workers
        self._fold_deltas(answers)

    def _fold_deltas(self, answers: list[Any]) -> None:
        st = runtime.STATE
        for a in answers:
            if not isinstance(a, dict):
                continue
            for handle in (a.get("head_stats") or {}).get("deltas") or ():
                try:
                    delta = read_delta(handle)
                    with self._hs_lock:
                        self._merge_delta(a, delta)
                except Exception as exc:
                    st.errors.record("snapshot_parse", exc)

    def _merge_delta(self, answer: dict[str, Any], delta: bytes) -> None:
        """Place one rank's delta at its global layers and heads (shape-checked)."""
        from attnprof.aggregate.head_stats_merge import add_rank_delta, global_for
        from attnprof.aggregate.head_strata import HeadStatsStrata

        part = HeadStatsStrata.from_bytes(delta)  # strata, or an older worker's accumulator
        rank = answer.get("rank") or {}
        acc = self.head_stats = global_for(self.head_stats, part, rank,
                                           answer.get("total_kv_heads"),
                                           answer.get("total_layers"))
        add_rank_delta(acc, part, rank)
        self.epochs.add(part, rank, answer.get("total_kv_heads"), answer.get("total_layers"))

    async def _advise(self) -> None:
        st = runtime.STATE
        try:
            fault_point("advice")
            if not self.keeps_head_stats:
                self.advice = AdviceUnavailable("the window advice is kept by vLLM's first API "
                                                "server (this server runs several)")
                return
            if st.errors.is_off("advice"):
                self.advice = AdviceUnavailable("window advice disabled after internal errors "
                                                "(attnprof_capture_disabled{place=\"advice\"})")
                return
            from attnprof.analyze.window_advice import advise_strata

            requests = st.requests.summary() if st.requests is not None else None
            hs = self.head_stats  # strata: post-stratified to the requests' context buckets
            self.epochs.rotate()
            epochs = self.epochs.epochs()
            adv, cov = await asyncio.to_thread(
                lambda: advise_strata(requests, hs, st.model_path, epochs))
            st.advice = adv.to_json()  # the export loop renders it as gauges
            st.coverage = None if cov is None else cov.to_json()
            self.advice, self.coverage = adv, cov
        except Exception as exc:
            st.errors.record("window_advice", exc)
            self.advice = AdviceUnavailable(f"{type(exc).__name__}: {exc}")

    def _coverage(self, requests: Any) -> Coverage | None:
        """The coverage table as of now (the request counts of this render, the strata merged
        so far: the advice's copy lags by the advice interval), with the head stability the
        last advice refresh computed (it classifies every view: too slow per render)."""
        from attnprof.analyze.sparsity.coverage import coverage_table

        try:
            with self._hs_lock:  # not while a refresh merges into the strata
                items = dict(self.head_stats.items()) if self.head_stats is not None else {}
                cov = coverage_table(items, getattr(requests, "context_buckets", None))
        except Exception as exc:
            runtime.STATE.errors.record("snapshot_parse", exc)
            return self.coverage
        if cov is not None and self.coverage is not None:
            cov.stability = self.coverage.stability
        return cov

    # ----- answers -----
    async def body(self, with_head_stats: bool, max_age: float, timeout: float,
                   max_bytes: int, public: str | None = None) -> tuple[bytes, float]:
        """The snapshot body and its age in seconds, refreshing first when it is older than
        ``max_age``; on timeout the cached data is served, and says so. ``public``: the
        answer for a server with no key, cut to ``/metrics``' share and the operational
        facts :mod:`attnprof.exporters.snapshot_public` keeps, with this ``restricted``
        note."""
        st = runtime.STATE
        if not st.enabled:
            doc = Snapshot(time=time.time(), model=st.model_label, enabled=False).to_json()
            return dumps(doc if public is None else _public(doc, public)).encode(), 0.0
        timed_out = None
        if self.refreshed_at == 0.0 or time.monotonic() - self.refreshed_at > max_age:
            # The window advice is the advice loop's job (ATTNPROF_ADVICE_INTERVAL_S): a GET
            # recomputes it only without that loop, or before its first round.
            cfg = st.config
            advise = self.advice is None or cfg is None or cfg.advice_interval_s <= 0
            try:
                await self.refresh(timeout, advice=advise,
                                   head_stats=advise or with_head_stats)
            except TimeoutError:
                timed_out = (f"TimeoutError: workers did not answer within {timeout:g} s; "
                             "serving the last answer")
        age = time.monotonic() - self.refreshed_at if self.refreshed_at else 0.0
        if timed_out is not None:
            async with self._render_slots:  # a hung engine must not pile up renders
                body = await asyncio.to_thread(self._render, with_head_stats, age, timed_out,
                                               max_bytes, public)
            return body, age
        # One render per refresh and variant, shared by every client waiting for it.
        variant = (with_head_stats, public)
        cached = self._bodies.get(variant)
        if cached is None or cached[0] != self.refreshed_at:
            fut = asyncio.ensure_future(asyncio.to_thread(
                self._render, with_head_stats, age, None, max_bytes, public))
            cached = self._bodies[variant] = (self.refreshed_at, fut)
        try:
            return await asyncio.shield(cached[1]), age
        except Exception:
            self._bodies.pop(variant, None)  # a failed render is not cached
            raise

    def _render(self, with_head_stats: bool, age: float, timed_out: str | None,
                max_bytes: int, public: str | None = None) -> bytes:
        st = runtime.STATE
        snap = Snapshot(
            time=time.time(), model=st.model_label, enabled=st.enabled,
            processes=runtime.processes_from_run_dir(st.config),
            roles_here=sorted(st.roles), workers=list(self.workers),
            requests=st.requests.summary() if st.requests is not None else None,
            errors=SnapshotErrors(api_server=st.errors.view()[0],
                                  collective_rpc=timed_out or self.rpc_error),
            window_advice=self.advice, age_s=round(age, 3),
            provenance=_provenance(st.model_label, st.model_path))
        try:  # ATTNPROF_PROBE: each phase against the probed peaks (None without a probe)
            from attnprof.analyze.roofline import from_snapshot

            snap.roofline = from_snapshot(snap.workers)
        except Exception as exc:
            st.errors.record("snapshot_parse", exc)
        from attnprof.analyze.kv_pressure import assess

        snap.kv_pressure = assess(snap.requests)
        snap.coverage = self._coverage(snap.requests)
        if with_head_stats and not self.keeps_head_stats:
            snap.truncated = ("head_stats left out: they are kept by vLLM's first API server "
                              "(this server runs several); ask that one")
        if with_head_stats and self.head_stats is not None:
            with self._hs_lock:  # not while a refresh merges into it
                snap.head_stats = self.head_stats.to_dict()
        if public is not None:  # from the typed snapshot: nothing rendered to be re-parsed
            from attnprof.contracts.jsonsafe import dumps_yielding

            return dumps_yielding(_public(snap.to_json(), public)).encode()
        from attnprof.exporters.snapshot_json import snapshot_body

        return snapshot_body(snap, max_bytes)

    async def set_sampling(self, rate: float | None, head_stats_rate: float | None,
                           timeout: float) -> list[Any]:
        """Switch every worker's sampling (an RPC of its own: tiny, and operator-driven)."""
        if self.engine_client is None:
            return []
        return list(await asyncio.wait_for(
            rpc_all(self.engine_client, "attnprof_set_sampling", rate, head_stats_rate),
            timeout))


def _public(doc: dict[str, Any], note: str) -> dict[str, Any]:
    from attnprof.exporters.snapshot_public import public_snapshot

    return public_snapshot(doc, note)


def _deltas_pending(answers: list[Any]) -> bool:
    return any(isinstance(a, dict) and (a.get("head_stats") or {}).get("pending")
               for a in answers)


def _built_since(answers: list[Any], again: list[Any]) -> list[Any] | None:
    """``again``'s snapshots, one per answer of ``answers`` and in its order, when every one
    was built from at least what its first answer's pull stood at (``snapshot_stale``'s
    ``now``; a current build always is), else None. Matched by position (a collective RPC
    answers in rank order) and checked by pid: pids alone repeat across nodes and
    containers."""
    if len(again) != len(answers):
        return None
    out: list[Any] = []
    for a, b in zip(answers, again, strict=True):
        if not isinstance(a, dict):
            out.append(None)
            continue
        if not isinstance(b, dict) or not isinstance(b.get("snapshot"), dict) or \
                b["snapshot"].get("pid") != (a.get("snapshot") or {}).get("pid"):
            return None
        first, st = a.get("snapshot_stale"), b.get("snapshot_stale")
        # A worker current at the first pull: its latest build is at least that one.
        if first is not None and st is not None and not _covers(
                st.get("built"), first.get("now") if isinstance(first, dict) else None):
            return None  # still a build from before the steps the refresh's pull saw
        out.append(b["snapshot"])
    return out


def _covers(built: Any, want: Any) -> bool:
    """A build of version ``built`` has everything of version ``want`` (versions count up:
    sampled steps, layers, a probe); False for anything unreadable."""
    try:
        return len(built) == len(want) and all(
            float(b) >= float(w) for b, w in zip(built, want, strict=True))
    except (TypeError, ValueError):
        return False


_PROVENANCE: dict[tuple[str, str | None], Any] = {}


def _provenance(label: str, path: str | None) -> Any:
    """This server's provenance, taken once per model (git, config and header hashes: a few
    ms, in the render thread, never on the event loop); None if it cannot be taken."""
    key = (label, path)
    if key not in _PROVENANCE:
        try:
            from attnprof.tools.provenance import collect

            _PROVENANCE[key] = collect(label, path)
        except Exception:  # provenance is a nicety: never a reason to fail a snapshot
            _PROVENANCE[key] = None
    return _PROVENANCE[key]
