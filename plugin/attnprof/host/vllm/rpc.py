"""``collective_rpc`` to every engine, with no timeout handed to vLLM's executor.

vLLM's ``MultiprocExecutor`` (vLLM-CPU's default, and every multi-GPU server) reads its
workers' answers from a queue in order, with no request id: when its own timeout expires, the
late attnprof answer stays in the queue and becomes the *next* model step's output, and the
EngineCore dies (``AttributeError: 'dict' object has no attribute 'sampled_token_ids'``).
``UniProcExecutor`` ignores the timeout altogether. So the executor is never given one: the
engine waits for the answer, and attnprof's worker methods are what is bounded (each does
short, non-blocking work: :func:`attnprof.host.vllm.worker_rpc.worker_methods`). The API
server's wait is bounded by the caller (``asyncio.wait_for``): vLLM's utility calls between
the API server and the EngineCore carry a call id, so an answer that comes after the caller
stopped waiting is dropped there, harmlessly.
"""

from __future__ import annotations

import asyncio
from typing import Any

from attnprof.host.vllm import runtime

__all__ = ["rpc_all"]


async def rpc_all(engine_client: Any, method: str, *args: Any) -> list[Any]:
    """``collective_rpc(method, *args)`` on every engine, every worker's answer in one list.

    vLLM's data-parallel client answers ``collective_rpc`` with the first engine's workers
    only, so each engine is asked: a utility call per engine (every ``AsyncMPClient`` of
    vLLM 0.32 has them); any other client, its ``collective_rpc``. Never passes a timeout to
    the engine (see the module docstring); callers bound their own wait with
    ``asyncio.wait_for``."""
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
        for g in got:  # the answer lacks these engines' workers: counted, so it shows
            if isinstance(g, Exception):
                runtime.STATE.errors.note("engine_rpc", g)
        return [w for ws in ok for w in (ws or [])]
    return list(await engine_client.collective_rpc(method, timeout=None, args=args))
