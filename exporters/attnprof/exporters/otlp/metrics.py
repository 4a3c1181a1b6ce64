"""The OTLP metrics sink: catalog samples out through the OpenTelemetry SDK.

* counters are observable cumulative monotonic sums of the running totals, gauges observable
  gauges: ``export()`` only stores the latest values under a lock, and the SDK's callbacks
  read them once per export interval (no OTel API call per sample or per attention call);
* histograms are injected into each export batch as cumulative OTLP histogram points built
  from :class:`HistogramState`, so bounds, counts and sum are exactly Prometheus' (SDK 1.45
  has no MetricProducer; a wrapping MetricExporter is the public seam). With
  ``ATTNPROF_OTLP_HISTOGRAM=exponential`` they are converted to base-2 exponential
  histograms when that is exact (:func:`.histograms.exponential_buckets`), else stay
  explicit.

One MeterProvider per sink, built lazily in the process that exports (vLLM forks/spawns its
workers; a sink inherited across ``fork`` drops the parent's provider and state and builds its
own, with a fresh ``service.instance.id``). Export failures are counted in ``failures`` (and
``attnprof_otlp_export_failures_total``), reported to ``on_error`` and never raised.
State is keyed by the catalog's metric objects, never by names looked up per sample.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlparse

from attnprof._safety import fault_point
from attnprof.aggregate.histogram import HistogramState
from attnprof.exporters import catalog as cat
from attnprof.exporters.catalog import MetricSpec
from attnprof.exporters.otlp.config import Labels, OtlpConfig
from attnprof.exporters.otlp.histograms import exponential_buckets
from attnprof.exporters.otlp.resource import ROLES, SCOPE, attributes, build_resource, version
from attnprof.exporters.samples import HistogramSample, MetricSample

__all__ = ["OtlpExportError", "OtlpSink", "otlp_exporter"]

logger = logging.getLogger("attnprof")

FAILURES = cat.OTLP_EXPORT_FAILURES_TOTAL
# Histogram units whose observations are non-negative integers (counts of things).
_INTEGER_UNITS = {"tokens"}


class OtlpExportError(RuntimeError):
    """An OTLP export that did not succeed (passed to ``on_error``, never raised)."""


def otlp_exporter(signal: str, protocol: str, endpoint: str, config: OtlpConfig,
                  headers: Labels = ()) -> Any:
    """The OTel SDK's OTLP exporter for ``signal`` ("metric" or "trace") over ``protocol``
    (grpc or http/protobuf), with the sink's timeout. It reads the ``OTEL_EXPORTER_OTLP_*``
    headers itself; ``headers`` are extra ones."""
    transport = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{transport}."
                                     f"{signal}_exporter")
    cls = getattr(module, "OTLPMetricExporter" if signal == "metric" else "OTLPSpanExporter")
    kw: dict[str, Any] = {"endpoint": endpoint, "headers": dict(headers) or None,
                          "timeout": config.timeout_s}
    if transport == "grpc":
        kw["insecure"] = urlparse(endpoint).scheme == "http"
    return cls(**kw)


def _make_exporter(config: OtlpConfig) -> Any:
    return otlp_exporter("metric", config.protocol, config.endpoint, config, config.headers)


def _wrapping_exporter(inner: Any, sink: OtlpSink) -> Any:
    """A MetricExporter that adds attnprof's histograms to each batch, counts failures and
    drops batches of a provider inherited across fork (the SDK restarts its thread there)."""
    from opentelemetry.sdk.metrics import (
        Counter,
        Histogram,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
        UpDownCounter,
    )
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        MetricExporter,
        MetricExportResult,
    )

    cumulative = {k: AggregationTemporality.CUMULATIVE
                  for k in (Counter, UpDownCounter, Histogram, ObservableCounter,
                            ObservableUpDownCounter, ObservableGauge)}

    class _Exporter(MetricExporter):  # type: ignore[misc]
        def __init__(self) -> None:
            # Always cumulative: counters carry running totals, histograms cumulative states.
            super().__init__(preferred_temporality=cumulative)
            self.pid = os.getpid()

        def export(self, metrics_data: Any, timeout_millis: float = 10_000,
                   **kwargs: Any) -> Any:
            if os.getpid() != self.pid:
                return MetricExportResult.SUCCESS
            try:
                fault_point("otlp_export")
                result = inner.export(sink._with_histograms(metrics_data),
                                      timeout_millis=timeout_millis)
            except Exception as exc:
                sink._failed(exc)
                return MetricExportResult.FAILURE
            if result == MetricExportResult.SUCCESS:
                sink._succeeded()
            else:
                sink._failed(OtlpExportError(f"OTLP export to {sink.config.endpoint} failed"))
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return os.getpid() != self.pid or bool(inner.force_flush(timeout_millis))

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            if os.getpid() == self.pid:
                inner.shutdown(timeout_millis=timeout_millis)

    return _Exporter()


class OtlpSink:
    """Export-hub sink sending the samples as OTLP metrics (one MeterProvider per process).

    ``export()`` never raises and never waits on the network: it stores the latest values;
    the SDK's reader thread sends them every ``config.interval_s``. ``on_error(place, exc)``
    is called (from that thread) for each failed export.
    """

    name = "otlp"

    def __init__(self, config: OtlpConfig, role: str,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.config = config
        self.role = role
        self.on_error = on_error
        self.failures = 0
        """Failed exports in this process (also sent as attnprof_otlp_export_failures_total)."""
        self.successes = 0
        self.exponential_fallbacks: set[str] = set()
        """Histograms sent explicit although exponential was asked (not exactly convertible)."""
        self.instance_id = ""
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._reset_state()
        self._pid = os.getpid()
        self._provider: Any = None
        self._reader: Any = None
        self._scope: Any = None
        self._resource: Any = None
        self._instruments: dict[MetricSpec, Any] = {}
        self._closed = False
        # A weak reference: the exit hook must not keep every sink (and its provider's fork
        # hook) alive for the life of the process.
        ref = weakref.ref(self)

        def at_exit() -> None:
            sink = ref()
            if sink is not None:
                sink._at_exit()

        atexit.register(at_exit)

    def _reset_state(self) -> None:
        self._scalars: dict[MetricSpec, dict[Labels, float]] = {}
        self._hists: dict[MetricSpec, dict[Labels, HistogramState]] = {}
        self._starts: dict[tuple[MetricSpec, Labels], int] = {}
        self._failing = False

    # -- the hub's side ------------------------------------------------------------------
    def export(self, samples: Iterable[MetricSample]) -> None:
        try:
            if not self._ready():
                return
            now = time.time_ns()
            new: set[MetricSpec] = set()
            with self._lock:
                for smp in samples:
                    m = smp.metric
                    if m is FAILURES:  # the sink counts its own failures
                        continue
                    if isinstance(smp, HistogramSample):
                        self._hists.setdefault(m, {})[smp.labels] = smp.state
                        self._starts.setdefault((m, smp.labels), now)
                        continue
                    series = self._scalars.setdefault(m, {})
                    value = float(smp.value)  # one point type (as_double) per metric
                    if m.kind == "counter":
                        last = series.get(smp.labels)
                        if last is None or value > last:  # totals never go backwards
                            series[smp.labels] = value
                    else:
                        series[smp.labels] = value
                    if m not in self._instruments:
                        new.add(m)
            for m in sorted(new, key=lambda x: x.name):
                self._instrument(m)
        except Exception as exc:  # never into the host; the hub thread keeps going
            self._report(exc)

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Collect and send now (blocks up to the export timeout); True if it succeeded."""
        if self._provider is None or self._pid != os.getpid() or self._closed:
            return False
        before = self.failures
        try:
            self._reader.force_flush(
                timeout_millis=1000 * (timeout_s if timeout_s is not None
                                       else self.config.timeout_s + 1))
        except Exception as exc:
            self._report(exc)
            return False
        return self.failures == before

    def shutdown(self) -> None:
        """Send a last batch and stop the reader thread (bounded by the export timeout)."""
        if self._closed:
            return
        self._closed = True
        provider = self._provider
        if provider is None or self._pid != os.getpid():
            return
        try:
            provider.shutdown(timeout_millis=1000 * (self.config.timeout_s + 1))
        except Exception as exc:
            self._report(exc)

    def _at_exit(self) -> None:
        if self._pid == os.getpid():
            self.shutdown()

    # -- provider ------------------------------------------------------------------------
    def _ready(self) -> bool:
        if self._closed:
            return False
        if self._provider is not None and self._pid == os.getpid():
            return True
        with self._build_lock:
            if self._pid != os.getpid():
                self._forked()
            if self._provider is None:
                self._build()
        return True

    def _forked(self) -> None:
        # Inherited from the parent: its provider, values and failure counts are not ours.
        # The parent's reader thread restarted by the SDK in this child exports through our
        # wrapper, which drops everything in a foreign pid; stop it quietly.
        old = self._provider
        self._pid = os.getpid()
        self._provider = self._reader = None
        self._instruments = {}
        self._lock = threading.Lock()
        self._reset_state()
        self.failures = self.successes = 0
        if old is not None:
            try:
                old.shutdown(timeout_millis=1000)
            except Exception:
                pass

    def _build(self) -> None:
        # The SDK's MeterProvider registers an after-fork hook that submits to a
        # ThreadPoolExecutor in the child. concurrent.futures.thread re-initialises its global
        # lock in its own after-fork hook; if that module were imported after the provider was
        # built, its hook would run second and the child would deadlock on the lock its
        # before-fork hook took (seen in tests). Importing it first fixes the hook order.
        import concurrent.futures.thread  # noqa: F401

        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.instance_id = str(uuid.uuid4())
        self._resource = build_resource(self.config, self.role, self.instance_id)
        ver = version("attnprof")
        self._scope = InstrumentationScope(SCOPE, ver)
        exporter = _wrapping_exporter(_make_exporter(self.config), self)
        self._reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=1000 * self.config.interval_s,
            export_timeout_millis=1000 * self.config.timeout_s)
        # shutdown_on_exit=False: our own atexit hook shuts down only in the owning process.
        self._provider = MeterProvider(resource=self._resource, metric_readers=[self._reader],
                                       shutdown_on_exit=False)
        self._meter = self._provider.get_meter(SCOPE, ver)
        # Always one instrument, so the SDK never skips a collection that only has
        # (injected) histograms, and the failure count travels too.
        self._instrument(FAILURES)

    def _instrument(self, s: MetricSpec) -> None:
        from opentelemetry.metrics import Observation

        if s in self._instruments or s.kind == "histogram":
            return

        def observe(_options: Any) -> list[Any]:
            if s is FAILURES:
                return [Observation(float(self.failures), {})]  # as_double, like every sum
            with self._lock:
                series = list(self._scalars.get(s, {}).items())
            return [Observation(v, attributes(labels)) for labels, v in series]

        create = (self._meter.create_observable_counter if s.kind == "counter"
                  else self._meter.create_observable_gauge)
        self._instruments[s] = create(s.otel_name, callbacks=[observe], unit=s.otel_unit,
                                      description=s.help)

    # -- histograms ----------------------------------------------------------------------
    def _with_histograms(self, data: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics

        metrics = self._histogram_metrics()
        if not metrics:
            return data
        out = []
        for rm in data.resource_metrics:  # one: our provider's resource
            scopes = list(rm.scope_metrics)
            for i, sm in enumerate(scopes):
                if sm.scope.name == SCOPE:
                    scopes[i] = ScopeMetrics(sm.scope, [*sm.metrics, *metrics], sm.schema_url)
                    break
            else:
                scopes.append(ScopeMetrics(self._scope, metrics, ""))
            out.append(ResourceMetrics(rm.resource, scopes, rm.schema_url))
        if not out:
            out.append(ResourceMetrics(self._resource, [ScopeMetrics(self._scope, metrics, "")],
                                       ""))
        return MetricsData(out)

    def _histogram_metrics(self) -> list[Any]:
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            ExponentialHistogram,
            ExponentialHistogramDataPoint,
            Histogram,
            HistogramDataPoint,
            Metric,
        )
        from opentelemetry.sdk.metrics.export import Buckets as OtelBuckets

        now = time.time_ns()
        with self._lock:
            items = [(s, [(lab, st, self._starts[(s, lab)]) for lab, st in series.items()
                          if st.count > 0])  # no point before the first observation
                     for s, series in self._hists.items()]
        cum = AggregationTemporality.CUMULATIVE
        out = []
        for s, pts in items:
            if not pts:
                continue
            data: Any = None
            if self.config.histogram == "exponential" \
                    and s.name not in self.exponential_fallbacks:
                integer = s.unit in _INTEGER_UNITS
                expo = [(lab, st, start, exponential_buckets(st, integer))
                        for lab, st, start in pts]
                if all(e is not None for *_, e in expo):
                    data = ExponentialHistogram(data_points=[
                        ExponentialHistogramDataPoint(
                            attributes=attributes(lab), start_time_unix_nano=start,
                            time_unix_nano=now, count=st.count, sum=st.sum, scale=e.scale,
                            zero_count=e.zero_count,
                            positive=OtelBuckets(e.offset, list(e.counts)),
                            negative=OtelBuckets(0, []), flags=0, min=st.min, max=st.max)
                        for lab, st, start, e in expo if e is not None],
                        aggregation_temporality=cum)
                else:
                    # Sticky: a metric never flips between the two encodings in a process.
                    self.exponential_fallbacks.add(s.name)
                    logger.warning("attnprof: %s is sent as an explicit histogram: its buckets "
                                   "cannot be converted exactly to an exponential one "
                                   "(use pow2_buckets bounds)", s.otel_name)
            if data is None:
                data = Histogram(data_points=[
                    HistogramDataPoint(
                        attributes=attributes(lab), start_time_unix_nano=start,
                        time_unix_nano=now, count=st.count, sum=st.sum,
                        bucket_counts=list(st.counts), explicit_bounds=list(st.bounds),
                        min=st.min, max=st.max)
                    for lab, st, start in pts], aggregation_temporality=cum)
            out.append(Metric(name=s.otel_name, description=s.help, unit=s.otel_unit,
                              data=data))
        return out

    # -- outcomes ------------------------------------------------------------------------
    def _succeeded(self) -> None:
        self.successes += 1
        if self._failing:
            self._failing = False
            logger.info("attnprof: OTLP export to %s recovered", self.config.endpoint)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        if not self._failing:  # one warning per outage, not one per interval
            self._failing = True
            logger.warning("attnprof: OTLP export to %s failing (%s); counted in "
                           "attnprof_otlp_export_failures_total", self.config.endpoint, exc)
        self._report(exc)

    def _report(self, exc: BaseException) -> None:
        if self.on_error is not None:
            try:
                self.on_error("export_otlp", exc)
            except Exception:
                pass
