"""vLLM endpoint plugin (API server): ``GET /attnprof/snapshot``.

Loaded by vLLM only when ``attnprof_http`` is named in ``VLLM_PLUGINS`` (``attnprof serve``
does that). The worker-side profile comes over ``collective_rpc`` from every worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from attnprof.capture.vllm import runtime
from attnprof.config import Config

__all__ = ["SCHEMA_VERSION", "AttnProfEndpoint", "build_snapshot"]

SCHEMA_VERSION = "attnprof.snapshot/1"


async def build_snapshot(engine_client: Any, advice: bool = True) -> dict[str, Any]:
    st = runtime.STATE
    workers: list[Any] = []
    error: str | None = None
    if engine_client is not None:
        try:
            workers = list(await engine_client.collective_rpc("attnprof_snapshot"))
        except Exception as exc:  # the engine may not be ours to query
            error = f"{type(exc).__name__}: {exc}"
    snap = {
        "schema_version": SCHEMA_VERSION,
        "time": time.time(),
        "model": st.model_label,
        "enabled": st.enabled,
        "processes": await asyncio.to_thread(runtime.processes_from_run_dir, st.config),
        "roles_here": sorted(st.roles),
        "workers": [w for w in workers if isinstance(w, dict)],
        "requests": st.requests.summary() if st.requests is not None else None,
        "errors": {"api_server": dict(st.errors.by_place), "collective_rpc": error},
    }
    if advice:
        snap["window_advice"] = await _advice(snap)
    st.export_errors()  # the API server has no flusher thread of its own
    return snap


async def _advice(snap: dict[str, Any]) -> dict[str, Any]:
    """Recommendation from the snapshot, computed in a thread (never on the event loop)."""
    st = runtime.STATE
    try:
        from attnprof.analyze.window_advice import compute_advice, export_advice

        adv = await asyncio.to_thread(compute_advice, snap, st.model_path)
        export_advice(st.get_sink(), st.model_label, adv)
        return adv
    except Exception as exc:
        st.errors.record("window_advice", exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


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
            return JSONResponse(await build_snapshot(plugin.engine_client))

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client
        cfg = Config.from_env()
        if cfg.enabled:
            runtime.start(cfg)
            if cfg.advice_interval_s > 0 and engine_client is not None:
                self._task = asyncio.get_running_loop().create_task(
                    _advice_loop(engine_client, cfg.advice_interval_s))
