"""vLLM endpoint plugin (API server): ``GET /attnprof/snapshot``.

Loaded by vLLM only when ``attnprof_http`` is named in ``VLLM_PLUGINS`` (``attnprof serve``
does that). The worker-side profile comes over ``collective_rpc`` from every worker.
"""

from __future__ import annotations

import time
from typing import Any

from attnprof.plugin.config import Config
from attnprof.plugin.integrations.vllm import runtime

__all__ = ["SCHEMA_VERSION", "AttnProfEndpoint", "build_snapshot"]

SCHEMA_VERSION = "attnprof.snapshot/1"


async def build_snapshot(engine_client: Any) -> dict[str, Any]:
    st = runtime.STATE
    workers: list[Any] = []
    error: str | None = None
    if engine_client is not None:
        try:
            workers = list(await engine_client.collective_rpc("attnprof_snapshot"))
        except Exception as exc:  # the engine may not be ours to query
            error = f"{type(exc).__name__}: {exc}"
    return {
        "schema_version": SCHEMA_VERSION,
        "time": time.time(),
        "model": st.model_label,
        "enabled": st.enabled,
        "processes": runtime.processes_from_run_dir(st.config),
        "roles_here": sorted(st.roles),
        "workers": [w for w in workers if isinstance(w, dict)],
        "requests": st.requests.summary() if st.requests is not None else None,
        "errors": {"api_server": dict(st.errors.by_place), "collective_rpc": error},
    }


class AttnProfEndpoint:
    name = "attnprof_http"
    required_tasks = None

    def __init__(self) -> None:
        self.engine_client: Any = None

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
