"""vLLM endpoint plugin (API server): the ``/attnprof/*`` routes.

Loaded by vLLM only when ``attnprof_http`` is named in ``VLLM_PLUGINS`` (``attnprof serve``
does that). Every route is a guest on the host's port, so:

- **authenticated like the host:** a bearer token, vLLM's own ``--api-key`` (or
  ``VLLM_API_KEY``) or ``ATTNPROF_API_KEY`` (:func:`attnprof.config.api_tokens`); vLLM's
  middleware guards only ``/v1``-style prefixes, so attnprof checks its own routes;
- **never stalls the engine on demand:** answers come from :class:`LiveView`, a cache
  refreshed at most every ``ATTNPROF_SNAPSHOT_MAX_AGE_S``, with at most one collective RPC
  in flight (however many clients), a timeout, and a bounded body. A disabled attnprof
  answers without any RPC;
- **nothing large on the event loop:** workers send compact head-statistics deltas
  (:meth:`HeadStatsAccumulator.take_bytes`), merged here in a thread; rendering and JSON
  (NaN-safe) happen in a thread too;
- **fail-open with a visible breaker:** errors are counted under ``endpoint`` / ``advice``;
  past ``ATTNPROF_MAX_ERRORS`` the route answers 503 and the advice loop stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import secrets
import threading
import time
from typing import Any

# FastAPI resolves the handlers' ``Request`` annotation by name in this module's globals
# (annotations are strings here), so it is imported at module level; this module is loaded
# only inside vLLM's API server, which has FastAPI.
from fastapi import Request

from attnprof._safety import fault_point
from attnprof.capture.vllm import runtime, start
from attnprof.config import Config, api_tokens
from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
from attnprof.contracts.jsonsafe import dumps, dumps_yielding
from attnprof.contracts.snapshot import Snapshot, SnapshotErrors, WorkerSnapshot

__all__ = ["SCHEMA_VERSION", "AttnProfEndpoint", "LiveTrace", "LiveView", "TokenCheck"]

logger = logging.getLogger("attnprof")
SCHEMA_VERSION = Snapshot.version_tag()


class TokenCheck:
    """Bearer-token check, as vLLM's ``AuthenticationMiddleware`` does it (sha256 digests
    compared in constant time). No tokens configured: every request passes."""

    def __init__(self, tokens: list[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def ok(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        scheme, _, param = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        got = hashlib.sha256(param.strip().encode()).digest()
        match = False
        for d in self._digests:
            match |= secrets.compare_digest(got, d)
        return match


async def rpc_all(engine_client: Any, method: str, *args: Any) -> list[Any]:
    """``collective_rpc`` on every engine: vLLM's data-parallel client answers
    ``collective_rpc`` with the first engine's workers only, so ask each engine."""
    core = getattr(engine_client, "engine_core", None)
    engines = getattr(core, "core_engines", None)
    one = getattr(core, "_call_utility_async", None)
    if engines and callable(one):
        # One engine failing must not lose the others' answers (their deltas are taken).
        got = await asyncio.gather(*(one("collective_rpc", method, None, args, None,
                                         engine=e) for e in engines),
                                   return_exceptions=True)
        ok = [g for g in got if not isinstance(g, BaseException)]
        if not ok and got:
            raise got[0] if isinstance(got[0], Exception) else RuntimeError(str(got[0]))
        return [w for ws in ok for w in (ws or [])]
    every = getattr(core, "call_utility_all_async", None)
    if callable(every):
        per_engine = await every("collective_rpc", method, None, args, None)
        return [w for ws in per_engine for w in (ws or [])]
    return list(await engine_client.collective_rpc(method, args=args))


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
        self.head_stats: Any = None  # global HeadStatsAccumulator
        self.advice: WindowAdvice | AdviceUnavailable | None = None
        self.rpc_error: str | None = None
        self.refreshed_at = 0.0  # monotonic time of the last completed refresh
        self.rpcs = 0  # RPCs started (tests and the benchmark read it)
        self._task: asyncio.Future[None] | None = None
        self._task_kind = (False, False)  # (advice, head statistics) of the task in flight
        self._render_slots = asyncio.Semaphore(2)  # renders after a timeout are not shared
        self._bodies: dict[bool, tuple[float, asyncio.Future[bytes]]] = {}
        # Merges (refresh thread) and renders of ?head_stats=1 (another thread) may overlap.
        self._hs_lock = threading.Lock()

    # ----- refresh: one RPC in flight at most -----
    async def refresh(self, timeout: float, advice: bool = True,
                      head_stats: bool | None = None) -> None:
        """Start a refresh unless one is in flight, and wait for it up to ``timeout``.
        Raises ``TimeoutError``; the RPC goes on and its answer is still folded in.
        ``head_stats`` (default: ``advice``): also pull the workers' head-statistics deltas,
        the one large part of a poll, only when the advice or a ``?head_stats=1`` needs them.
        A task in flight that does less than asked is waited for, then one more starts."""
        want = (advice, advice if head_stats is None else head_stats)
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

    async def _refresh(self, advice: bool, head_stats: bool = True) -> None:
        answers: list[Any] = []
        error = None
        if self.engine_client is not None:
            self.rpcs += 1
            try:
                answers = await rpc_all(self.engine_client, "attnprof_poll",
                                        head_stats and self.keeps_head_stats)
            except Exception as exc:  # the engine may not be ours to query
                error = f"{type(exc).__name__}: {exc}"
        await asyncio.to_thread(self._fold, answers)
        self.rpc_error = error
        if advice:
            await self._advise()
        self.refreshed_at = time.monotonic()
        self._bodies.clear()
        # This process's exporters too (a thread, off the engine's path), so the request
        # metrics on /metrics agree with the snapshot right away; workers flush every second.
        await asyncio.to_thread(runtime.STATE.flush)

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
            delta = a.get("head_stats_delta")
            if delta:
                try:
                    with self._hs_lock:
                        self._merge_delta(a, delta)
                except Exception as exc:
                    st.errors.record("snapshot_parse", exc)
        self.workers = workers

    def _merge_delta(self, answer: dict[str, Any], delta: bytes) -> None:
        """Place one rank's delta at its global layers and heads (shape-checked)."""
        from attnprof.aggregate.head_stats import HeadStatsAccumulator

        part = HeadStatsAccumulator.from_bytes(delta)
        rank = answer.get("rank") or {}
        tp_rank, tp_size = int(rank.get("tp_rank", 0)), int(rank.get("tp_size", 1))
        q_total = part.num_q_heads * tp_size
        kv_total = int(answer.get("total_kv_heads") or part.num_kv_heads * tp_size)
        layers = max(part.num_layers, int(answer.get("total_layers") or 0))
        if q_total % kv_total:
            raise ValueError(f"{q_total} query heads do not split into {kv_total} KV heads")
        acc = self.head_stats
        if acc is None or acc.num_layers < layers:
            grown = HeadStatsAccumulator(layers, kv_total, q_total // kv_total,
                                         part.sinks_grid, part.window_grid,
                                         n_last=part.n_last, n_random=part.n_random,
                                         n_detail=part.n_detail, mass_gamma=part.mass_gamma)
            if acc is not None:
                grown.add_at(acc)
            acc = self.head_stats = grown
        # Only the first tensor-parallel rank counts requests: every rank saw each prompt.
        acc.add_at(part, q_offset=tp_rank * part.num_q_heads, count_requests=tp_rank == 0)

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
            from attnprof.analyze.window_advice import advise

            requests = st.requests.summary() if st.requests is not None else None
            adv = await asyncio.to_thread(advise, requests, self.head_stats, st.model_path)
            st.advice = adv.to_json()  # the export loop renders it as gauges
            self.advice = adv
        except Exception as exc:
            st.errors.record("window_advice", exc)
            self.advice = AdviceUnavailable(f"{type(exc).__name__}: {exc}")

    # ----- answers -----
    async def body(self, with_head_stats: bool, max_age: float, timeout: float,
                   max_bytes: int) -> tuple[bytes, float]:
        """The snapshot body and its age in seconds, refreshing first when it is older than
        ``max_age``; on timeout the cached data is served, and says so."""
        st = runtime.STATE
        if not st.enabled:
            snap = Snapshot(time=time.time(), model=st.model_label, enabled=False)
            return dumps(snap.to_json()).encode(), 0.0
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
                                               max_bytes)
            return body, age
        # One render per refresh and variant, shared by every client waiting for it.
        cached = self._bodies.get(with_head_stats)
        if cached is None or cached[0] != self.refreshed_at:
            fut = asyncio.ensure_future(asyncio.to_thread(
                self._render, with_head_stats, age, None, max_bytes))
            cached = self._bodies[with_head_stats] = (self.refreshed_at, fut)
        try:
            return await asyncio.shield(cached[1]), age
        except Exception:
            self._bodies.pop(with_head_stats, None)  # a failed render is not cached
            raise

    def _render(self, with_head_stats: bool, age: float, timed_out: str | None,
                max_bytes: int) -> bytes:
        st = runtime.STATE
        snap = Snapshot(
            time=time.time(), model=st.model_label, enabled=st.enabled,
            processes=runtime.processes_from_run_dir(st.config),
            roles_here=sorted(st.roles), workers=list(self.workers),
            requests=st.requests.summary() if st.requests is not None else None,
            errors=SnapshotErrors(api_server=dict(st.errors.by_place),
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
        if with_head_stats and not self.keeps_head_stats:
            snap.truncated = ("head_stats left out: they are kept by vLLM's first API server "
                              "(this server runs several); ask that one")
        if with_head_stats and self.head_stats is not None:
            with self._hs_lock:  # not while a refresh merges into it
                snap.head_stats = self.head_stats.to_dict()
        # Megabytes of head statistics: encoded in pieces so the event loop keeps the GIL.
        body = dumps_yielding(snap.to_json()).encode()
        if len(body) > max_bytes and snap.head_stats is not None:
            snap.head_stats = None
            snap.truncated = (f"head_stats left out: the body would be {len(body)} bytes, "
                              f"over ATTNPROF_SNAPSHOT_MAX_BYTES={max_bytes}")
            body = dumps(snap.to_json()).encode()
        if len(body) > max_bytes:
            # Copies: the cached worker snapshots serve later (smaller) answers too.
            snap.workers = [dataclasses.replace(w, layers=[], kernel_map=[])
                            for w in snap.workers]
            snap.truncated = (f"per-layer data left out: the body would be over "
                              f"ATTNPROF_SNAPSHOT_MAX_BYTES={max_bytes}")
            body = dumps(snap.to_json()).encode()
        return body

    async def set_sampling(self, rate: float | None, head_stats_rate: float | None,
                           timeout: float) -> list[Any]:
        """Switch every worker's sampling (an RPC of its own: tiny, and operator-driven)."""
        if self.engine_client is None:
            return []
        return list(await asyncio.wait_for(
            rpc_all(self.engine_client, "attnprof_set_sampling", rate, head_stats_rate),
            timeout))


TRACE_DEFAULT_STEPS = 8
TRACE_DEFAULT_TIMEOUT_S = 30.0
TRACE_MAX_TIMEOUT_S = 300.0
TRACE_POLL_S = 0.2
"""How often the trace route asks the workers how many steps they have (a tiny RPC)."""


class TraceBusy(RuntimeError):
    """A live trace is already being recorded by this API server (the route answers 409)."""


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
    """``GET /attnprof/trace``: arm every worker, wait (asyncio sleeps, never blocking the
    loop) until each has recorded the next N sampled steps or the timeout passes, take the
    records, render them as a Chrome/Perfetto trace in a thread. One trace at a time per API
    server: a second request while one records gets :class:`TraceBusy` (409)."""

    def __init__(self, engine_client: Any) -> None:
        self.engine_client = engine_client
        self._busy = False
        self.served = 0
        self.abandoned = 0
        """Traces stopped early because the client disconnected."""

    async def record(self, steps: int, timeout: float, rpc_timeout: float,
                     max_bytes: int, gone: Any = None) -> bytes:
        """The trace body (JSON bytes). Raises :class:`TraceBusy`, ``TimeoutError`` (a worker
        RPC did not answer within ``rpc_timeout``), or the RPC's own error. ``gone``: an
        async callable, true once the client has disconnected (the trace then stops, frees
        the workers' records and the slot, and renders nothing)."""
        if self._busy:
            raise TraceBusy("a trace is already being recorded")
        self._busy = True
        try:
            return await self._record(steps, timeout, rpc_timeout, max_bytes, gone)
        finally:
            self._busy = False

    async def _rpc(self, rpc_timeout: float, *args: Any) -> list[dict[str, Any]]:
        """Every worker's answer to one trace op. An engine that fails the RPC (dead, not
        ours) is the host's state, not attnprof's bug: counted without tripping a breaker,
        and the trace goes on with the answers there are. ``TimeoutError`` passes (504)."""
        if self.engine_client is None:
            return []
        try:
            got = await asyncio.wait_for(rpc_all(self.engine_client, "attnprof_trace", *args),
                                         rpc_timeout)
        except TimeoutError:
            raise
        except Exception as exc:
            runtime.STATE.errors.note("trace_rpc", exc)
            return [{"error": f"{type(exc).__name__}: {exc}"}]
        return [a for a in got if isinstance(a, dict)]

    async def _record(self, steps: int, timeout: float, rpc_timeout: float,
                      max_bytes: int, gone: Any = None) -> bytes:
        st = runtime.STATE
        trace_id = secrets.token_hex(8)
        kv: list[tuple[int, float]] = []
        t_start = time.monotonic()
        self._kv_sample(kv)
        # Workers stop recording by themselves a little after our deadline.
        armed = await self._rpc(rpc_timeout, "arm", trace_id, steps, timeout + rpc_timeout)
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
            # -1: another API server armed a trace since (ours lost those workers).
            if all(c.get("steps", 0) >= steps or c.get("steps", 0) < 0 for c in counts
                   if c.get("pid") in pids):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            if gone is not None and await gone():
                # Nobody to answer: free the workers' records and the one-trace slot now
                # rather than at the deadline (up to 300 s of 409s for everyone else).
                await self._rpc(rpc_timeout, "take", trace_id)
                self.abandoned += 1
                return b""
        taken = await self._rpc(rpc_timeout, "take", trace_id) if pids else []
        self._kv_sample(kv)
        meta = {"model": st.model_label, "requested_steps": steps, "timed_out": timed_out,
                "timeout_s": timeout, "wall_s": round(time.monotonic() - t_start, 3),
                "workers_armed": len(pids),
                "errors": [a["error"] for a in (*armed, *taken) if a.get("error")]}
        body = await asyncio.to_thread(_render_trace, taken, kv, meta, max_bytes)
        self.served += 1
        return body

    @staticmethod
    def _kv_sample(out: list[tuple[int, float]]) -> None:
        # The stat logger's latest scheduler KV usage, as of now (API server only).
        req = runtime.STATE.requests
        usage = getattr(req, "kv_cache_usage", None) if req is not None else None
        if isinstance(usage, (int, float)):
            out.append((time.time_ns(), float(usage)))


def _render_trace(taken: list[dict[str, Any]], kv: list[tuple[int, float]],
                  meta: dict[str, Any], max_bytes: int) -> bytes:
    """Workers' records -> trace JSON bytes (thread). Over ``max_bytes``, the later steps of
    each worker are left out (``otherData.attnprof.truncated`` says so)."""
    from attnprof.aggregate.trace import StepTrace
    from attnprof.exporters.chrome_trace import TraceProcess, render_steps

    st = runtime.STATE
    procs: list[TraceProcess] = []
    per_worker: dict[str, int] = {}
    truncated: str | None = None
    answers = [a for a in taken if "error" not in a]  # errors are listed in meta
    for i, a in enumerate(sorted(answers, key=lambda a: (a.get("rank") or {}).get("tp_rank",
                                                                                 0))):
        steps = []
        for raw in a.get("steps") or []:
            try:
                steps.append(StepTrace.from_json(raw))
            except (KeyError, TypeError, ValueError) as exc:
                st.errors.record("snapshot_parse", exc)
        r = a.get("rank") or {}
        pid = int(a.get("pid") or 0)
        name = (f"{a.get('process') or 'vLLM worker'} (tp {r.get('tp_rank', 0)}/"
                f"{r.get('tp_size', 1)}, pp {r.get('pp_rank', 0)}, dp {r.get('dp_rank', 0)})")
        procs.append(TraceProcess(pid, name, steps, sort_index=i + 1))
        per_worker[str(pid)] = len(steps)
        if a.get("truncated"):
            truncated = "a worker reached its bound on layer ranges"
    api = os.getpid()
    procs.append(TraceProcess(api, "vLLM API server", [], thread_name="scheduler",
                              sort_index=0))
    counters = [(api, "KV cache usage", t, {"usage": u}) for t, u in kv]
    keep = None
    while True:
        if keep is not None:
            for p in procs:
                p.steps = p.steps[:keep]
        doc = render_steps(procs, counters, {"attnprof": {
            **meta, "kind": "attnprof.trace", "steps_per_worker": per_worker,
            "complete": bool(per_worker) and all(n >= meta["requested_steps"]
                                                 for n in per_worker.values()),
            "truncated": truncated}})
        body = dumps_yielding(doc).encode()
        most = max((len(p.steps) for p in procs), default=0)
        if len(body) <= max_bytes or most <= 1:
            return body
        keep = max(1, int(most * max_bytes / len(body) * 0.9))
        truncated = (f"steps after the first {keep} per worker left out: the body would be "
                     f"over ATTNPROF_SNAPSHOT_MAX_BYTES={max_bytes}")


def _rate(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
        raise ValueError(f"{key} must be a number in [0, 1], got {v!r}")
    return float(v)


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


class AttnProfEndpoint:
    name = "attnprof_http"
    required_tasks = None

    def __init__(self) -> None:
        self.engine_client: Any = None
        self.view = LiveView(None)
        self.trace = LiveTrace(None)
        self.auth = TokenCheck(api_tokens())
        self._task: asyncio.Task[None] | None = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse, Response

        plugin = self

        def refuse(request: Request) -> Any:
            if plugin.auth.ok(request.headers.get("authorization")):
                return None
            return JSONResponse({"error": "attnprof: a bearer token is required (vLLM's "
                                          "--api-key or ATTNPROF_API_KEY)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})

        def tripped() -> Any:
            st = runtime.STATE
            if not st.errors.is_off("endpoint"):
                return None
            return JSONResponse({"error": "attnprof: routes disabled after internal errors "
                                          "(attnprof_capture_disabled{place=\"endpoint\"})"},
                                status_code=503)

        def failed(exc: Exception) -> Any:
            # Counted against the endpoint's breaker; the client sees the type, not details.
            runtime.STATE.errors.record("endpoint", exc)
            return JSONResponse({"error": f"attnprof: internal error (counted): "
                                          f"{type(exc).__name__}"}, status_code=500)

        @app.get("/attnprof/snapshot")  # type: ignore[untyped-decorator]
        async def attnprof_snapshot(request: Request) -> Any:
            if (denied := refuse(request)) is not None:
                return denied
            if (off := tripped()) is not None:
                return off
            st = runtime.STATE
            try:
                fault_point("endpoint")
                cfg = st.config or Config()
                want = request.query_params.get("head_stats", "") in ("1", "true", "yes")
                body, age = await plugin.view.body(want, cfg.snapshot_max_age_s,
                                                   cfg.rpc_timeout_s, cfg.snapshot_max_bytes)
                return Response(body, media_type="application/json",
                                headers={"Age": str(int(age)), "Cache-Control": "no-store"})
            except Exception as exc:
                return failed(exc)

        @app.get("/attnprof/trace")  # type: ignore[untyped-decorator]
        async def attnprof_trace(request: Request) -> Any:
            """The next ``steps`` sampled steps of every worker as a Chrome/Perfetto trace,
            waiting at most ``timeout`` seconds (``?steps=8&timeout=30``)."""
            if (denied := refuse(request)) is not None:
                return denied
            if (off := tripped()) is not None:
                return off
            try:
                steps, timeout = trace_params(request.query_params)
            except ValueError as err:
                return JSONResponse({"error": f"attnprof: {err}"}, status_code=400)
            st = runtime.STATE
            if not st.enabled:
                return JSONResponse({"traceEvents": [], "otherData": {"attnprof": {
                    "kind": "attnprof.trace", "enabled": False, "model": st.model_label}}})
            cfg = st.config or Config()
            try:
                fault_point("endpoint")
                body = await plugin.trace.record(steps, timeout, cfg.rpc_timeout_s,
                                                 cfg.snapshot_max_bytes, request.is_disconnected)
                return Response(body, media_type="application/json",
                                headers={"Cache-Control": "no-store"})
            except TraceBusy:
                return JSONResponse({"error": "attnprof: a trace is already being recorded "
                                              "on this server; retry when it is done"},
                                    status_code=409)
            except TimeoutError as exc:  # slow workers are not attnprof's bug: no breaker
                st.errors.note("trace_timeout", exc)
                return JSONResponse({"error": "attnprof: the workers did not answer the trace "
                                              "RPC within ATTNPROF_RPC_TIMEOUT_S"},
                                    status_code=504)
            except Exception as exc:
                return failed(exc)

        @app.post("/attnprof/sampling")  # type: ignore[untyped-decorator]
        async def attnprof_sampling(request: Request) -> Any:
            """Switch the step sample rate and/or head-statistics rate in every worker:
            ``{"sample_rate": 0.05, "head_stats_rate": 0.1}`` (either key may be left out)."""
            if (denied := refuse(request)) is not None:
                return denied
            if not plugin.auth.required:
                # The one route that raises attnprof's cost: never open to anyone who can
                # reach the port, even where vLLM's own routes are.
                return JSONResponse({"error": "attnprof: the sampling switch needs an API key "
                                              "(vLLM's --api-key or ATTNPROF_API_KEY)"},
                                    status_code=403)
            if (off := tripped()) is not None:
                return off
            st = runtime.STATE
            if not st.enabled:
                return JSONResponse({"error": "attnprof is disabled (ATTNPROF_ENABLED)"},
                                    status_code=409)
            try:
                raw = await request.json()
                if not isinstance(raw, dict):
                    raise ValueError("the body must be a JSON object")
                rate, hs = _rate(raw, "sample_rate"), _rate(raw, "head_stats_rate")
            except ValueError as err:
                return JSONResponse({"error": f"attnprof: {err}"}, status_code=400)
            try:
                fault_point("endpoint")
                timeout = (st.config or Config()).rpc_timeout_s
                workers = await plugin.view.set_sampling(rate, hs, timeout)
                return JSONResponse({"workers": workers})
            except Exception as exc:
                st.errors.record("sampling_switch", exc)
                return JSONResponse({"error": f"attnprof: sampling switch failed: "
                                              f"{type(exc).__name__}"}, status_code=500)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client
        self.view = LiveView(engine_client)
        self.trace = LiveTrace(engine_client)
        self.auth = TokenCheck(api_tokens(vllm_api_key=getattr(args, "api_key", None)))
        cfg, otlp = runtime.config_from_env()
        if cfg.enabled:
            start(cfg, otlp)
            if cfg.advice_interval_s > 0 and engine_client is not None:
                self._task = asyncio.get_running_loop().create_task(
                    _advice_loop(self.view, cfg.advice_interval_s, cfg.rpc_timeout_s))


async def _advice_loop(view: LiveView, interval: float, timeout: float) -> None:
    """Keep the advice gauges current for Prometheus and alerts (stops when its breaker
    trips)."""
    st = runtime.STATE
    while not st.errors.is_off("advice"):
        await asyncio.sleep(interval)
        try:
            await view.refresh(timeout)
        except TimeoutError as exc:  # slow workers are not attnprof's bug: no breaker
            st.errors.note("window_advice_timeout", exc)
        except Exception as exc:
            st.errors.record("window_advice", exc)
