"""vLLM general plugin: loaded by vLLM in every process (API server, EngineCore, workers).

``register`` is the ``vllm.general_plugins`` entry point. It does nothing unless
``ATTNPROF_ENABLED`` is true, runs its set-up once per process however often it is
called, and raises only at start-up, for a bad ``ATTNPROF_*`` value, with one line.
"""

from __future__ import annotations

import logging
from typing import Any

from attnprof.capture.vllm import install, runtime
from attnprof.config import Config, ConfigError

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
    runtime.start(cfg, install.install, otlp)
