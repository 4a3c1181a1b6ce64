"""attnprof: an attention profiler that lives inside LLM serving processes."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real modules import torch lazily; the face does not load them
    from attnprof.capture.transformers import Profile
    from attnprof.capture.transformers_records import AttentionCallEvent
    from attnprof.config import Config
    from attnprof.contracts.snapshot import Snapshot

try:
    __version__ = version("attnprof")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "instrument", "profile", "set_sampling", "snapshot", "uninstrument"]

# attnprof.capture.transformers.DEFAULT_MAX_RECORDS, spelled here so that `import attnprof`
# loads no capture code; tests/unit/project/test_packaging.py keeps the two signatures equal.
_DEFAULT_MAX_RECORDS = 4096


def instrument(model: Any, on_call: Callable[[AttentionCallEvent], None] | None = None, *,
               explain: bool = True, keep_records: bool = True,
               max_records: int | None = _DEFAULT_MAX_RECORDS) -> Profile:
    """Wrap a transformers model's attention and return the installed
    :class:`~attnprof.capture.transformers.Profile` (undo with its ``uninstrument()``); see
    :func:`attnprof.capture.transformers.instrument` for the arguments. Imports torch on
    the first call, never at ``import attnprof``."""
    from attnprof.capture.transformers import instrument as impl

    return impl(model, on_call=on_call, explain=explain, keep_records=keep_records,
                max_records=max_records)


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


def profile(model: Any, on_call: Callable[[AttentionCallEvent], None] | None = None, *,
            explain: bool = True, keep_records: bool = True,
            max_records: int | None = _DEFAULT_MAX_RECORDS) -> Profile:
    """``with attnprof.profile(model) as prof: model(...)``: instrument for the block, then
    undo; the arguments are :func:`instrument`'s (see
    :func:`attnprof.capture.transformers.profile`)."""
    from attnprof.capture.transformers import profile as impl

    return impl(model, on_call=on_call, explain=explain, keep_records=keep_records,
                max_records=max_records)


def _config() -> Config:
    """attnprof's configuration as this process runs with it."""
    from attnprof.config import Config
    from attnprof.host.vllm.runtime import STATE

    return STATE.config or Config()


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
        # No timeout for vLLM's executor: a late answer would become a model step's output
        # (attnprof.host.vllm.rpc); attnprof's worker methods are short by themselves.
        out = list(llm.collective_rpc("attnprof_set_sampling", args=(rate, head_stats_rate)))
    else:
        from attnprof.host.vllm.runtime import STATE

        if STATE.capture is None:
            raise RuntimeError("no vLLM worker with attnprof enabled in this process; pass "
                               "llm= (a vllm.LLM) or use POST /attnprof/sampling")
        out = [STATE.capture.set_sampling(rate, head_stats_rate)]
    errors = [w["error"] for w in out if isinstance(w, dict) and "error" in w]
    if errors:
        raise RuntimeError(f"attnprof: sampling switch failed in a worker: {errors[0]}")
    return out


def snapshot(llm: Any) -> Snapshot:
    """The typed snapshot (with provenance) of an offline ``vllm.LLM``'s workers, as a live
    server's ``GET /attnprof/snapshot`` would serve it: save ``json.dump(snap.to_json(), f)``
    and compare two files with ``attnprof diff``. Raises ``RuntimeError`` when the workers
    do not answer (attnprof not enabled in them)."""
    import time

    from attnprof.contracts.snapshot import Snapshot, WorkerSnapshot
    from attnprof.facts.label import model_label
    from attnprof.tools.provenance import collect

    try:
        workers = [WorkerSnapshot.from_json(w) for w in
                   llm.collective_rpc("attnprof_snapshot", args=(False,))]
    except Exception as exc:
        raise RuntimeError(f"attnprof: the LLM's workers did not answer "
                           f"({type(exc).__name__}); is attnprof enabled in them?") from exc
    mc = llm.llm_engine.model_config
    label = _config().model_label or model_label(mc)  # the label the live metrics carry
    return Snapshot(time=time.time(), model=label, enabled=True, workers=workers,
                    provenance=collect(label, mc.model))
