"""Prometheus rendering of the catalog.

Metrics are created per process by a :class:`PrometheusSink` (never at module level).
Under ``PROMETHEUS_MULTIPROC_DIR`` (set by ``attnprof serve``) prometheus_client writes
values to per-process files that vLLM's own ``/metrics`` merges, so worker-side metrics
appear on the API server's endpoint. Without it, metrics go to the given registry
(default: the global one, which vLLM serves in single-process mode).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from attnprof.exporters.catalog import CATALOG, MetricSpec, spec

__all__ = ["PrometheusSink", "multiprocess_enabled"]


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class PrometheusSink:
    def __init__(self, registry: Any = "default",
                 buckets: dict[str, Sequence[float]] | None = None) -> None:
        import prometheus_client

        self._pc = prometheus_client
        if registry == "default":
            # In multiprocess mode the values live in files; registering in the global
            # registry too would only duplicate them on single-process scrapes.
            registry = None if multiprocess_enabled() else prometheus_client.REGISTRY
        self.registry = registry
        self.buckets = dict(buckets or {})
        self._metrics: dict[str, Any] = {}
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._totals_lock = threading.Lock()

    def metric(self, name: str) -> Any:
        m = self._metrics.get(name)
        if m is None:
            m = self._create(spec(name))
            self._metrics[name] = m
        return m

    def inc_to(self, name: str, total: float, **labels: str) -> None:
        """Advance a counter to ``total``, a running total kept by the caller.

        attnprof aggregates in plain Python numbers on the serving path and exports later;
        this turns those totals into counter increments exactly once, whoever calls it
        (a flusher thread, a snapshot, an error path). Totals never go backwards.
        """
        key = (name, tuple(sorted(labels.items())))
        with self._totals_lock:
            last = self._totals.get(key, 0.0)
            if total > last:
                self.metric(name).labels(**labels).inc(total - last)
                self._totals[key] = total

    def _create(self, s: MetricSpec) -> Any:
        pc = self._pc
        kw: dict[str, Any] = {"labelnames": s.labels, "registry": self.registry}
        if s.kind == "counter":
            return self._register(pc.Counter, s.base_name, s.help, kw)
        if s.kind == "gauge":
            kw["multiprocess_mode"] = s.multiprocess_mode
            return self._register(pc.Gauge, s.base_name, s.help, kw)
        if s.name in self.buckets:
            kw["buckets"] = list(self.buckets[s.name])
        return self._register(pc.Histogram, s.base_name, s.help, kw)

    def _register(self, cls: Any, name: str, help_: str, kw: dict[str, Any]) -> Any:
        try:
            return cls(name, help_, **kw)
        except ValueError:
            # Already registered (plugin loaded twice in one process): reuse it.
            reg = kw.get("registry")
            existing = getattr(reg, "_names_to_collectors", {}).get(name) if reg else None
            if existing is None:
                raise
            return existing

    def create_all(self) -> None:
        """Create every catalog metric so they show up (at zero) before any traffic."""
        for s in CATALOG:
            if not s.labels:
                self.metric(s.name)
