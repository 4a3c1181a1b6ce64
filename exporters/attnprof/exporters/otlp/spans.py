"""Sampled steps as OTLP spans (``ATTNPROF_OTLP_SPANS=1``): one span per step, a child per
layer's attention call, built after the fact on the export hub's thread."""

from __future__ import annotations

import atexit
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from attnprof.exporters.otlp.config import OtlpConfig
from attnprof.exporters.otlp.metrics import OtlpExportError, otlp_exporter
from attnprof.exporters.otlp.resource import SCOPE, build_resource, version
from attnprof.exporters.samples import MetricSample

__all__ = ["SPAN_ATTENTION", "SPAN_STEP", "OtlpSpanSink", "layer_span_attributes",
           "step_span_attributes"]

SPAN_STEP = "attnprof.step"
SPAN_ATTENTION = "attnprof.attention"


def step_span_attributes(step: Any, model: str) -> dict[str, Any]:
    """A step span's attributes (the live trace's step args): shapes and rates only."""
    return {"gen_ai.request.model": model, "attnprof.phase": step.phase,
            "attnprof.outcome": step.outcome, "attnprof.tokens": step.tokens,
            "attnprof.num_requests": step.num_reqs, "attnprof.max_seq_len": step.max_seq_len,
            "attnprof.mean_seq_len": float(step.mean_seq_len),
            "attnprof.effective_sample_rate": float(step.effective_rate),
            "attnprof.layers": len(step.layers)}


def layer_span_attributes(r: Any) -> dict[str, Any]:
    """A layer's attention span attributes (the live trace's layer args)."""
    return {"attnprof.layer": r.layer, "attnprof.backend": r.backend,
            "attnprof.kernel": r.kernel, "attnprof.phase": r.phase,
            "attnprof.tokens": r.tokens, "attnprof.num_requests": r.num_reqs,
            "attnprof.max_seq_len": r.max_seq_len,
            "attnprof.mean_seq_len": float(r.mean_seq_len)}


def _make_span_exporter(config: OtlpConfig) -> Any:
    return otlp_exporter("trace", config.traces_protocol, config.traces_endpoint, config,
                         (*config.headers, *config.traces_headers))


class OtlpSpanSink:
    """Export-hub sink sending sampled steps as OTLP spans (``ATTNPROF_OTLP_SPANS=1``).

    The hub's thread calls :meth:`export` once a second: it drains ``take()`` (the worker's
    queue of :class:`~attnprof.aggregate.trace.StepTrace`) and builds, after the fact with
    their recorded start/end nanoseconds, one span per step and one child span per layer's
    attention call; the SDK's BatchSpanProcessor sends them from its own thread. Nothing here
    runs on the serving path; nothing raises (failures go to ``on_error``, never the host).
    """

    name = "otlp_spans"

    def __init__(self, config: OtlpConfig, role: str, take: Callable[[], list[Any]],
                 model: Callable[[], str] = lambda: "unknown",
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.config = config
        self.role = role
        self.take = take
        self.model = model
        self.on_error = on_error
        self.spans = 0
        """Spans handed to the SDK in this process."""
        self.failures = 0
        """Span batches the collector did not take."""
        self._pid = os.getpid()
        self._provider: Any = None
        self._tracer: Any = None
        self._closed = False
        ref = weakref.ref(self)

        def at_exit() -> None:
            sink = ref()
            if sink is not None and sink._pid == os.getpid():
                sink.shutdown()

        atexit.register(at_exit)

    def export(self, samples: Iterable[MetricSample] = ()) -> None:
        """Send the queued steps as spans (the metric samples are not this sink's). A flush
        from the main thread (a snapshot RPC between a worker's steps) leaves them queued for
        the export thread: building spans is never the engine's wait."""
        if threading.current_thread() is threading.main_thread():
            return
        self._drain()

    def _drain(self) -> None:
        try:
            if self._closed:
                return
            steps = self.take()
            if not steps:
                return
            if self._provider is None or self._pid != os.getpid():
                self._build()
            model = self.model()
            for step in steps:
                self._emit(step, model)
        except Exception as exc:
            self._report(exc)

    def _build(self) -> None:
        import concurrent.futures.thread  # noqa: F401  (fork-hook order, see OtlpSink._build)

        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self._pid = os.getpid()
        resource = build_resource(self.config, self.role, str(uuid.uuid4()))
        # ALWAYS_ON: attnprof's own sampler already chose these steps.
        provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(
            self._counting(_make_span_exporter(self.config)),
            export_timeout_millis=int(1000 * self.config.timeout_s)))
        self._provider = provider
        self._tracer = provider.get_tracer(SCOPE, version("attnprof"))

    def _counting(self, inner: Any) -> Any:
        """The SDK's exporter, with each failed batch reported (counted, never raised)."""
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        sink = self

        class _Exporter(SpanExporter):  # type: ignore[misc]
            def export(self, spans: Any) -> Any:
                try:
                    result = inner.export(spans)
                except Exception as exc:
                    sink._report(exc)
                    return SpanExportResult.FAILURE
                if result != SpanExportResult.SUCCESS:
                    sink.failures += 1
                    sink._report(OtlpExportError(
                        f"OTLP span export to {sink.config.traces_endpoint} failed"))
                return result

            def shutdown(self) -> None:
                inner.shutdown()

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return bool(inner.force_flush(timeout_millis))

        return _Exporter()

    def _emit(self, step: Any, model: str) -> None:
        from opentelemetry import trace

        end = step.start_ns + max(0, step.dur_ns)
        span = self._tracer.start_span(SPAN_STEP, start_time=step.start_ns,
                                       attributes=step_span_attributes(step, model))
        ctx = trace.set_span_in_context(span)
        for r in step.layers:
            c0 = min(step.start_ns + r.offset_ns, end)
            child = self._tracer.start_span(SPAN_ATTENTION, context=ctx, start_time=c0,
                                            attributes=layer_span_attributes(r))
            child.end(end_time=min(end, c0 + max(0, r.dur_ns)))
            self.spans += 1
        span.end(end_time=end)
        self.spans += 1

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Send what the SDK holds now; True when it did."""
        if self._provider is None or self._pid != os.getpid():
            return False
        try:
            wait = timeout_s if timeout_s is not None else self.config.timeout_s
            return bool(self._provider.force_flush(int(1000 * wait)))
        except Exception as exc:
            self._report(exc)
            return False

    def shutdown(self) -> None:
        """Send what is queued and stop the SDK's thread (bounded by the export timeout)."""
        if self._closed:
            return
        try:
            self._drain()  # at exit: what is still queued goes out too
        finally:
            self._closed = True
        if self._provider is None or self._pid != os.getpid():
            return
        try:
            self._provider.shutdown()
        except Exception as exc:
            self._report(exc)

    def _report(self, exc: BaseException) -> None:
        if isinstance(exc, Exception) and not isinstance(exc, OtlpExportError):
            self.failures += 1
        if self.on_error is not None:
            try:
                self.on_error("export_otlp_spans", exc)
            except Exception:
                pass
