"""vLLM endpoint plugin (API server): ``GET /attnprof/snapshot``.

Loaded by vLLM only when ``attnprof_http`` is named in ``VLLM_PLUGINS`` (``attnprof serve``
does that). The worker-side profile comes over ``collective_rpc`` from every worker; the
window advice is computed in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from attnprof.capture.vllm import runtime, start
from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
from attnprof.contracts.snapshot import Snapshot, SnapshotErrors, WorkerSnapshot

__all__ = ["SCHEMA_VERSION", "AttnProfEndpoint", "build_snapshot"]

SCHEMA_VERSION = Snapshot.version_tag()


async def build_snapshot(engine_client: Any, advice: bool = True) -> Snapshot:
    st = runtime.STATE
    workers: list[Any] = []
    error: str | None = None
    if engine_client is not None:
        try:
            workers = list(await engine_client.collective_rpc("attnprof_snapshot"))
        except Exception as exc:  # the engine may not be ours to query
            error = f"{type(exc).__name__}: {exc}"
    notes = await asyncio.to_thread(runtime.processes_from_run_dir, st.config)
    parsed: list[WorkerSnapshot] = []
    for w in workers:
        if isinstance(w, dict):
            try:
                parsed.append(WorkerSnapshot.from_json(w))
            except Exception as exc:
                st.errors.record("snapshot", exc)
    snap = Snapshot(
        time=time.time(), model=st.model_label, enabled=st.enabled,
        processes=notes,
        roles_here=sorted(st.roles), workers=parsed,
        requests=st.requests.summary() if st.requests is not None else None,
        errors=SnapshotErrors(api_server=dict(st.errors.by_place), collective_rpc=error))
    if advice:
        snap.window_advice = await _advice(snap)
    # Workers flushed when they answered; flush here too so /metrics agrees with this
    # snapshot right away (file writes: off the event loop).
    await asyncio.to_thread(st.flush)
    return snap


async def _advice(snap: Snapshot) -> WindowAdvice | AdviceUnavailable:
    """Recommendation from the snapshot, computed in a thread (never on the event loop)."""
    st = runtime.STATE
    try:
        from attnprof.analyze.window_advice import advise_snapshot

        adv = await asyncio.to_thread(advise_snapshot, snap.to_json(), st.model_path)
        st.advice = adv.to_json()  # the export loop renders it as gauges
        return adv
    except Exception as exc:
        st.errors.record("window_advice", exc)
        return AdviceUnavailable(f"{type(exc).__name__}: {exc}")


async def _advice_loop(engine_client: Any, interval: float) -> None:
    """Keep the advice gauges current for Prometheus and alerts."""
    while True:
        await asyncio.sleep(interval)
        try:
            await build_snapshot(engine_client)
        except Exception as exc:
            runtime.STATE.errors.record("window_advice", exc)


class AttnProfEndpoint:
    name = "attnprof_http"
    required_tasks = None

    def __init__(self) -> None:
        self.engine_client: Any = None
        self._task: asyncio.Task[None] | None = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        plugin = self

        @app.get("/attnprof/snapshot")  # type: ignore[untyped-decorator]
        async def attnprof_snapshot() -> Any:
            snap = await build_snapshot(plugin.engine_client)
            # Serialization of a large snapshot (head statistics) stays off the event loop.
            body = await asyncio.to_thread(snap.to_json)
            return JSONResponse(body)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client
        cfg, otlp = runtime.config_from_env()
        if cfg.enabled:
            start(cfg, otlp)
            if cfg.advice_interval_s > 0 and engine_client is not None:
                self._task = asyncio.get_running_loop().create_task(
                    _advice_loop(engine_client, cfg.advice_interval_s))
