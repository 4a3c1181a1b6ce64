"""vLLM general plugin: loaded by vLLM in every process (API server, EngineCore, workers).

``register`` is the ``vllm.general_plugins`` entry point. It does nothing unless
``ATTNPROF_ENABLED`` is true, runs its set-up once per process however often it is
called, and raises only at start-up, for a bad ``ATTNPROF_*`` value, with one line.
The hooks (:mod:`attnprof.capture.vllm`) are installed with this room's RPC answers.
"""

from __future__ import annotations

import logging
from typing import Any

from attnprof.config import Config, ConfigError
from attnprof.host.vllm import runtime

__all__ = ["register", "start"]

logger = logging.getLogger("attnprof")


def register() -> None:
    try:
        cfg, otlp = runtime.config_from_env()
    except ConfigError as err:
        # SystemExit with a string prints one line and no traceback; vLLM does not catch
        # it around general plugins, so the process stops at start-up as it should.
        raise SystemExit(f"attnprof: invalid configuration: {err}") from None
    if not cfg.enabled:
        return
    start(cfg, otlp)


def start(cfg: Config, otlp: Any = None) -> None:
    """Set attnprof up in this vLLM process once: state, export loop, hooks."""
    runtime.start(cfg, _install, otlp)


def _install(state: runtime.State) -> Any:
    """The hooks, with this room's answers to the API server on vLLM's workers."""
    from attnprof.capture.vllm import install
    from attnprof.host.vllm.worker_rpc import worker_methods

    return install.install(state, worker_methods)
