"""attnprof: an attention profiler that lives inside LLM serving processes."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("attnprof")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "instrument", "profile", "set_sampling", "snapshot", "uninstrument"]


def instrument(model: Any, on_call: Callable[[Any], None] | None = None, **kw: Any) -> Any:
    """Wrap a transformers model's attention; see
    :func:`attnprof.capture.transformers.instrument` (imports torch lazily)."""
    from attnprof.capture.transformers import instrument as impl

    return impl(model, on_call=on_call, **kw)


def uninstrument() -> None:
    """Undo everything attnprof patched in this process: vLLM's classes (as the plugin's
    install left them) and every instrumented transformers model. Idempotent, and a no-op
    when nothing was instrumented (it then imports nothing)."""
    import sys

    vllm_install = sys.modules.get("attnprof.capture.vllm.install")
    if vllm_install is not None:
        vllm_install.uninstall()
    hf = sys.modules.get("attnprof.capture.transformers")
    if hf is not None:
        hf.uninstrument_all()


def profile(model: Any, on_call: Callable[[Any], None] | None = None, **kw: Any) -> Any:
    """``with attnprof.profile(model) as prof: model(...)``; see
    :func:`attnprof.capture.transformers.profile`."""
    from attnprof.capture.transformers import profile as impl

    return impl(model, on_call=on_call, **kw)


def _rpc_timeout() -> float:
    """``ATTNPROF_RPC_TIMEOUT_S`` as this process runs with it: the engine stops waiting for
    its workers after it, so no attnprof RPC holds the engine's loop longer."""
    from attnprof.capture.vllm.runtime import STATE
    from attnprof.config import Config

    return (STATE.config or Config()).rpc_timeout_s


def set_sampling(rate: float | None = None, head_stats_rate: float | None = None,
                 llm: Any = None) -> list[dict[str, Any]]:
    """Switch attnprof's step sample rate and/or head-statistics rate at run time, in every
    vLLM worker: those of ``llm`` (a ``vllm.LLM``, through its ``collective_rpc``), or those
    living in this process when ``llm`` is None. A live server has the same switch behind
    its authenticated route, ``POST /attnprof/sampling``. Returns each worker's old and new
    rates; raises ``ValueError`` for a rate outside [0, 1] and ``RuntimeError`` when no
    worker with attnprof enabled is reachable."""
    for name, value in (("rate", rate), ("head_stats_rate", head_stats_rate)):
        if value is not None and not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    if llm is not None:
        out = list(llm.collective_rpc("attnprof_set_sampling", timeout=_rpc_timeout(),
                                      args=(rate, head_stats_rate)))
    else:
        from attnprof.capture.vllm.runtime import STATE

        if STATE.capture is None:
            raise RuntimeError("no vLLM worker with attnprof enabled in this process; pass "
                               "llm= (a vllm.LLM) or use POST /attnprof/sampling")
        out = [STATE.capture.set_sampling(rate, head_stats_rate)]
    errors = [w["error"] for w in out if isinstance(w, dict) and "error" in w]
    if errors:
        raise RuntimeError(f"attnprof: sampling switch failed in a worker: {errors[0]}")
    return out


def snapshot(llm: Any) -> dict[str, Any]:
    """The attnprof snapshot document (``attnprof.snapshot``, with provenance) of an offline
    ``vllm.LLM``'s workers, as a live server's ``GET /attnprof/snapshot`` would serve it: save
    it with ``json.dump`` and compare two with ``attnprof diff``. Raises ``RuntimeError``
    when the workers do not answer (attnprof not enabled in them)."""
    import time

    from attnprof.contracts.snapshot import Snapshot, WorkerSnapshot
    from attnprof.tools.provenance import collect

    try:
        workers = [WorkerSnapshot.from_json(w) for w in
                   llm.collective_rpc("attnprof_snapshot", timeout=_rpc_timeout(),
                                      args=(False,))]
    except Exception as exc:
        raise RuntimeError(f"attnprof: the LLM's workers did not answer "
                           f"({type(exc).__name__}); is attnprof enabled in them?") from exc
    mc = llm.llm_engine.model_config
    label = str(getattr(mc, "served_model_name", None) or mc.model)
    return Snapshot(time=time.time(), model=label, enabled=True, workers=workers,
                    provenance=collect(label, mc.model)).to_json()
