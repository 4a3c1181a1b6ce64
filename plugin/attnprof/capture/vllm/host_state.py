"""What the hooks need from the process hosting them, as a ``Protocol``.

The plugin host's per-process state (:class:`attnprof.host.vllm.runtime.State`) satisfies
it; capture types against this and never imports the host, which owns the export loop,
the routes and the answers to the API server.
"""

from __future__ import annotations

from typing import Any, Protocol

from attnprof._safety import ErrorBook
from attnprof.config import Config

__all__ = ["HostState"]


class HostState(Protocol):
    config: Config | None
    errors: ErrorBook
    otlp: Any  # set when OTLP export is configured: the hooks then keep spans
    capture: Any  # the process's hooks (set by install, cleared by uninstall)
    model_label: str  # learnt at model build unless the config names it
    probe: Any  # the start-up probe's result, once it ran (read by the snapshot)

    def backend_fallback(self, out: dict[str, Any], cc: tuple[int, int], lay: Any,
                         installed: str | None) -> None:
        """Fill a backend report vLLM cannot answer here (a pinned backend) from the derived
        matrix (:data:`attnprof.capture.vllm.backends.Fallback`)."""

    def worker_live(self, cap: Any, start_spans: bool) -> None:
        """A layer was wrapped in this process: it is a worker; export its samples (and,
        with ``start_spans``, its OTLP spans). Called once per layer; never raises."""
