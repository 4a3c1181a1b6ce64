"""One export loop per process: sample sources in, every configured sink out.

Sources are callables registered by the rooms that own state (worker aggregates, request
statistics, window advice, error counts); sinks are exporters (Prometheus, OTLP). A daemon
thread flushes every ``interval`` seconds, off the serving path; ``flush()`` may also be
called directly (snapshots). A failing source is reported to ``on_error`` (attnprof's own
code failed), a failing sink to ``on_sink_error`` (an exporter: endpoint down, disk full;
``on_error`` when not given), and skipped: nothing here raises into the host. After
``fork`` the child starts its own thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from attnprof._safety import fault_point
from attnprof.exporters.samples import MetricSample, SampleSource

__all__ = ["ESSENTIAL", "ExportHub", "Sink"]

ESSENTIAL = "process"
"""The source name of each process's errors, breakers and liveness samples."""

logger = logging.getLogger("attnprof")


class Sink(Protocol):
    name: str

    def export(self, samples: list[MetricSample]) -> None: ...


class ExportHub:
    def __init__(self, interval: float = 1.0,
                 on_error: Callable[[str, BaseException], None] | None = None,
                 on_sink_error: Callable[[str, BaseException], None] | None = None,
                 degraded: Callable[[], bool] | None = None) -> None:
        self.interval = interval
        # True once the export loop's own breaker tripped: only the ESSENTIAL source (errors,
        # breakers, liveness) is still exported, so the switch-off itself stays visible.
        self.degraded = degraded
        self.on_error = on_error
        self.on_sink_error = on_sink_error or on_error
        self.sources: dict[str, SampleSource] = {}
        self.sinks: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add_source(self, name: str, fn: SampleSource) -> None:
        self.sources[name] = fn

    def add_sink(self, sink: Any) -> None:
        if all(s is not sink for s in self.sinks):
            self.sinks.append(sink)

    def sink(self, name: str) -> Any:
        return next((s for s in self.sinks if getattr(s, "name", "") == name), None)

    def _error(self, place: str, exc: BaseException) -> None:
        self._report(self.on_error, place, exc)

    def _sink_error(self, sink: Any, exc: BaseException) -> None:
        self._report(self.on_sink_error, f"export_{getattr(sink, 'name', 'sink')}", exc)

    @staticmethod
    def _report(fn: Callable[[str, BaseException], None] | None, place: str,
                exc: BaseException) -> None:
        if fn is not None:
            try:
                fn(place, exc)
            except Exception:
                pass

    def collect(self) -> list[MetricSample]:
        out: list[MetricSample] = []
        for name, fn in list(self.sources.items()):
            try:
                out.extend(fn())
            except Exception as exc:
                self._error(f"export_source_{name}", exc)
        return out

    def flush(self) -> None:
        """Collect every source once and hand the samples to every sink (never raises)."""
        try:
            if self.degraded is not None and self.degraded():
                self._export_essentials()
                return
            with self._lock:
                fault_point("flusher")
                self._export(self.collect())
        except Exception as exc:  # the loop itself: counted; the thread must not die
            self._error("flusher", exc)
            self._export_essentials()

    def _export(self, samples: list[MetricSample]) -> None:
        for sink in list(self.sinks):
            try:
                sink.export(samples)
            except Exception as exc:
                self._sink_error(sink, exc)

    def _export_essentials(self) -> None:
        """Only the self-observability source (errors, breakers, liveness): what must stay
        visible when the rest of the export path fails."""
        fn = self.sources.get(ESSENTIAL)
        if fn is None:
            return
        try:
            samples = list(fn())
            with self._lock:
                self._export(samples)
        except Exception as exc:
            self._error("flusher", exc)

    def start(self) -> None:
        """Start the flush thread once per process (a forked child starts its own)."""
        if self._pid != os.getpid():  # inherited across fork: that thread is not ours
            self._pid = os.getpid()
            self._thread = None
            self._stop = threading.Event()
            self._lock = threading.Lock()
        if self._thread is not None and self._thread.is_alive():
            return

        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.flush()

        self._thread = threading.Thread(target=loop, name="attnprof-export", daemon=True)
        self._thread.start()

    def stop(self, final_flush: bool = True) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2 * self.interval + 1)
        self._thread = None
        if final_flush:
            self.flush()
        for sink in list(self.sinks):
            close = getattr(sink, "shutdown", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:
                    self._sink_error(sink, exc)
