"""Prometheus rendering of the export boundary's samples.

Metrics are created per process by a :class:`PrometheusSink` (never at module level), from
the catalog. Under ``PROMETHEUS_MULTIPROC_DIR`` (set by ``attnprof serve``) prometheus_client
writes values to per-process files that vLLM's own ``/metrics`` merges, so worker-side
metrics appear on the API server's endpoint. Without it, metrics go to the given registry
(default: the global one, which vLLM serves in single-process mode).
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

from attnprof._safety import pid_alive
from attnprof.exporters.catalog import CATALOG, MetricSpec, spec
from attnprof.exporters.samples import HistogramSample, MetricSample, Sample

__all__ = ["PrometheusSink", "multiprocess_enabled", "sweep_dead"]

SWEEP_INTERVAL_S = 5.0
_LIVE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db$")


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def sweep_dead(path: str | None = None) -> list[int]:
    """Drop the live-gauge files of processes that are gone, and return their pids.

    vLLM's worker and engine processes end with ``os._exit``, so no ``atexit`` hook ever
    marks them dead: without this sweep, ``attnprof_plugin_processes`` would count them for
    ever and their last gauge values would keep alerts firing. Counters stay (a dead
    process's work still happened). Any process may sweep; a race only finds a file gone."""
    from prometheus_client import multiprocess

    path = path or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return []
    pids = set()
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        m = _LIVE_FILE.search(f)
        if m:
            pids.add(int(m.group(1)))
    dead = sorted(p for p in pids if p != os.getpid() and not pid_alive(p))
    for pid in dead:
        try:
            multiprocess.mark_process_dead(pid, path)
        except OSError:
            pass  # another process swept it first
    return dead


class PrometheusSink:
    """Renders samples: counter totals become increments (exactly once, whoever calls),
    gauges are set, histogram bucket counts and sums advance by their deltas."""

    name = "prometheus"

    def __init__(self, registry: Any = "default") -> None:
        import prometheus_client

        self._pc = prometheus_client
        if registry == "default":
            # In multiprocess mode the values live in files; registering in the global
            # registry too would only duplicate them on single-process scrapes.
            registry = None if multiprocess_enabled() else prometheus_client.REGISTRY
        self.registry = registry
        self._metrics: dict[str, Any] = {}
        self._buckets: dict[str, tuple[float, ...]] = {}
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._swept = 0.0

    def export(self, samples: Iterable[MetricSample]) -> None:
        if self._pid != os.getpid():
            self._forked()
        now = time.monotonic()
        if now - self._swept >= SWEEP_INTERVAL_S and multiprocess_enabled():
            self._swept = now
            sweep_dead()
        with self._lock:
            for smp in samples:
                if isinstance(smp, HistogramSample):
                    self._histogram(smp)
                else:
                    self._scalar(smp)

    def _forked(self) -> None:
        """A forked child: its multiprocess values live in its own, empty files, so a gauge
        equal to the parent's last value must still be written (the livesum would miss this
        process). Counter and histogram baselines stay: the child's sources inherited the
        parent's totals, and only what it adds after the fork is its own. The lock may have
        been held by a parent thread at the fork."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._totals = {k: v for k, v in self._totals.items() if spec(k[0]).kind != "gauge"}

    def _scalar(self, smp: Sample) -> None:
        # Most series do not change between flushes: compare first, touch prometheus_client
        # (label lookup, file write in multiprocess mode) only for the ones that did.
        key = (smp.name, smp.labels)
        last = self._totals.get(key)
        counter = spec(smp.name).kind == "counter"
        if last is not None and (smp.value <= last if counter else smp.value == last):
            return  # unchanged (counters: running totals never go backwards)
        m = self._metric(smp.name)
        child = m.labels(**dict(smp.labels)) if smp.labels else m
        if counter:
            child.inc(smp.value - (last or 0.0))
        else:
            child.set(smp.value)
        self._totals[key] = smp.value

    def _histogram(self, smp: HistogramSample) -> None:
        st = smp.state
        key = (smp.name, smp.labels)
        last = self._totals.get(key)
        if last is not None and last.count == st.count:
            return  # unchanged: as for scalars, no label lookup or file write
        m = self._metric(smp.name, st.bounds)
        child = m.labels(**dict(smp.labels)) if smp.labels else m
        prev_counts = last.counts if last is not None else (0,) * len(st.counts)
        # prometheus_client keeps non-cumulative per-bucket values (bounds + +Inf), exactly
        # our layout: advance each by its delta and the sum by its delta.
        for i, (new, old) in enumerate(zip(st.counts, prev_counts, strict=True)):
            if new > old:
                child._buckets[i].inc(new - old)
        child._sum.inc(st.sum - (last.sum if last is not None else 0.0))
        self._totals[key] = st

    def _metric(self, name: str, buckets: tuple[float, ...] | None = None) -> Any:
        m = self._metrics.get(name)
        if m is None:
            m = self._metrics[name] = self._create(spec(name), buckets)
        return m

    def _create(self, s: MetricSpec, buckets: tuple[float, ...] | None) -> Any:
        pc = self._pc
        kw: dict[str, Any] = {"labelnames": s.labels, "registry": self.registry}
        if s.kind == "counter":
            return self._register(pc.Counter, s.base_name, s.help, kw)
        if s.kind == "gauge":
            kw["multiprocess_mode"] = s.multiprocess_mode
            return self._register(pc.Gauge, s.base_name, s.help, kw)
        if buckets is not None:
            kw["buckets"] = list(buckets)
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
        """Create every label-free catalog metric so it shows up (at zero) before traffic."""
        for s in CATALOG:
            if not s.labels:
                self._metric(s.name)

    def mark_process_dead(self, pid: int) -> None:
        """Drop a leaving process's live gauges (multiprocess mode only)."""
        if multiprocess_enabled():
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)
