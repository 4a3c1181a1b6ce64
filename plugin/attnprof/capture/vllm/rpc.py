"""``collective_rpc`` to every engine, bounded on the engine's side too."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["rpc_all"]


async def rpc_all(engine_client: Any, method: str, *args: Any,
                  timeout: float | None = None) -> list[Any]:
    """``collective_rpc(method, *args)`` on every engine, every worker's answer in one list.

    vLLM's data-parallel client answers ``collective_rpc`` with the first engine's workers
    only, so each engine is asked. ``timeout`` is passed to the engine, whose executor stops
    waiting for its workers after it (vLLM's own ``check_health`` does the same with 10 s):
    a worker stuck in an attnprof method cannot hold the engine's loop longer than that.
    Callers bound their own wait with ``asyncio.wait_for`` as well."""
    core = getattr(engine_client, "engine_core", None)
    engines = getattr(core, "core_engines", None)
    one = getattr(core, "_call_utility_async", None)
    if engines and callable(one):
        # One engine failing must not lose the others' answers (their deltas are taken).
        got = await asyncio.gather(*(one("collective_rpc", method, timeout, args, None,
                                         engine=e) for e in engines),
                                   return_exceptions=True)
        ok = [g for g in got if not isinstance(g, BaseException)]
        if not ok and got:
            raise got[0] if isinstance(got[0], Exception) else RuntimeError(str(got[0]))
        return [w for ws in ok for w in (ws or [])]
    every = getattr(core, "call_utility_all_async", None)
    if callable(every):
        per_engine = await every("collective_rpc", method, timeout, args, None)
        return [w for ws in per_engine for w in (ws or [])]
    return list(await engine_client.collective_rpc(method, timeout=timeout, args=args))
