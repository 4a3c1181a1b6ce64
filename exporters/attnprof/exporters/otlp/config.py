"""OTLP settings: what attnprof reads of the standard ``OTEL_*`` variables, and its start-up
checks of the ones the OpenTelemetry SDK reads itself.

attnprof reads what it decides with: whether OTLP is on and where metrics and spans go
(the endpoints, which it also logs and derives the spans' collector from), the protocol
(the SDK's exporters do not choose their transport), and the export interval and timeout
(bounded: faster than 10 exports a second only burns CPU, and the SDK's timer thread
overflowed on 1e300; the timeout defaults to 5 s, not the spec's 30 s, because it bounds
every export and shutdown, which attnprof waits for). The SDK reads the headers
(``OTEL_EXPORTER_OTLP_*HEADERS``) and the resource (``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_SERVICE_NAME``) itself, from the process's environment; attnprof only checks them, so
a bad value stops start-up instead of being dropped with a warning in each process.

Every bad value is a :class:`~attnprof.config.ConfigError` whose message is one line naming
the variable (header values are credentials: named by position, never shown; URL
credentials are redacted).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from attnprof.config import ConfigError, otlp_histogram, otlp_spans
from attnprof.contracts.redact import redact_value

__all__ = ["DEFAULT_INTERVAL_MS", "DEFAULT_TIMEOUT_MS", "INTERVAL_MS", "PROTOCOLS", "TIMEOUT_MS",
           "OtlpConfig", "otlp_config_from_env"]

PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_INTERVAL_MS = 60000.0  # the OTel spec default
# The spec says 30000 ms; attnprof bounds every export (and so shutdown) to a few seconds.
DEFAULT_TIMEOUT_MS = 5000.0
INTERVAL_MS = (100.0, 86_400_000.0)
"""Accepted OTEL_METRIC_EXPORT_INTERVAL: faster than 10 exports a second only burns the
server's CPU; more than a day is a typo (and 1e300 overflowed the SDK's timer thread)."""
TIMEOUT_MS = (1.0, 3_600_000.0)
"""Accepted OTEL_METRIC_EXPORT_TIMEOUT: at most an hour, which is how long shutdown may wait."""

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class OtlpConfig:
    endpoint: str
    """http/protobuf: full URL incl. ``/v1/metrics``; grpc: ``http(s)://host:port``."""
    protocol: str = "http/protobuf"
    headers: Labels = ()
    """Headers beside those the SDK reads from ``OTEL_EXPORTER_OTLP_*HEADERS``."""
    interval_s: float = DEFAULT_INTERVAL_MS / 1000
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000
    service_name: str | None = None
    """None: ``OTEL_SERVICE_NAME`` or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` (read
    by the SDK), else ``attnprof``."""
    resource_attributes: Labels = ()
    """Resource attributes over those the SDK reads from ``OTEL_RESOURCE_ATTRIBUTES``."""
    histogram: str = "explicit"
    """``explicit`` or ``exponential`` (``ATTNPROF_OTLP_HISTOGRAM``)."""
    spans: bool = False
    """Send sampled steps as spans (``ATTNPROF_OTLP_SPANS``)."""
    traces_endpoint: str = ""
    """Where spans go: http/protobuf a full URL incl. ``/v1/traces``; grpc ``host:port`` URL."""
    traces_protocol: str = "http/protobuf"
    traces_headers: Labels = ()
    """Spans sent to the metrics' collector carry its ``OTEL_EXPORTER_OTLP_METRICS_HEADERS``
    (the SDK's span exporter reads only the traces' and the generic headers)."""


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


def _check_pairs(name: str, raw: str) -> None:
    """``OTEL_RESOURCE_ATTRIBUTES`` is ``k1=v1,k2=v2`` (W3C-baggage-like, percent-encoded
    values): the SDK reads it, and drops a malformed item with a warning; refuse it here."""
    for item in raw.split(","):
        key, sep, _ = item.partition("=")
        if item.strip() and (not sep or not key.strip()):
            raise ConfigError(f"{name}={raw!r} is malformed at {item.strip()!r} "
                              "(expected key=value pairs separated by commas)")


def _check_headers(name: str, raw: str) -> None:
    """``k1=v1,k2=v2`` with percent-encoded values, which the SDK reads; the values are
    credentials (``Authorization=Bearer%20...``): an error names the item by its position and
    key, never its text. A value must be printable ASCII once decoded, as an HTTP header or
    gRPC metadata carries it (``%0A`` would split the request)."""
    for i, item in enumerate((x for x in raw.split(",") if x.strip()), 1):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not _HEADER_KEY.match(key):
            raise ConfigError(f"{name} is malformed at its item {i} (expected key=value "
                              "pairs separated by commas; values are not shown)")
        if not all(0x20 <= ord(c) < 0x7F for c in unquote(val.strip())):
            raise ConfigError(f"{name}: the value of {key!r} (item {i}) holds control or "
                              "non-ASCII characters once percent-decoded, which a header "
                              "cannot carry (the value is not shown)")


def _endpoint(name: str, raw: str, example: str) -> None:
    """An http(s) URL with a host, a port in 1..65535 if any, no space or control character;
    :class:`ConfigError` naming ``name`` otherwise (credentials in the URL not shown)."""
    shown = redact_value(raw)
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
    # Checked, not kept: the SDK's exporters and Resource read these themselves.
    for name in ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        if (env.get(name) or "").strip():
            _check_headers(name, env[name])
    if (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").strip():
        _check_pairs("OTEL_RESOURCE_ATTRIBUTES", env["OTEL_RESOURCE_ATTRIBUTES"])
    interval = _ms(env, "OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_INTERVAL_MS, *INTERVAL_MS)
    timeout = _ms(env, "OTEL_METRIC_EXPORT_TIMEOUT", DEFAULT_TIMEOUT_MS, *TIMEOUT_MS)
    histogram = otlp_histogram(env)
    _require("opentelemetry.sdk.metrics", ep_var, "opentelemetry-sdk")
    if protocol == "grpc":
        _require("opentelemetry.exporter.otlp.proto.grpc", ep_var,
                 "opentelemetry-exporter-otlp-proto-grpc", "otel-grpc")
    else:
        _require("opentelemetry.exporter.otlp.proto.http", ep_var,
                 "opentelemetry-exporter-otlp-proto-http")
    traces_endpoint, traces_protocol, traces_headers = "", protocol, ()
    if spans:
        traces_endpoint, traces_protocol = _traces_endpoint(env, ep_var, raw_ep, protocol)
        _require("opentelemetry.sdk.trace", "ATTNPROF_OTLP_SPANS", "opentelemetry-sdk")
        own_headers = _first(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        if own_headers is not None:
            _check_headers(*own_headers)
        shared = _first(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") is None
        if shared and own_headers is None \
                and (env.get("OTEL_EXPORTER_OTLP_METRICS_HEADERS") or "").strip():
            from opentelemetry.util.re import parse_env_headers

            traces_headers = tuple(parse_env_headers(
                env["OTEL_EXPORTER_OTLP_METRICS_HEADERS"], liberal=True).items())
    return OtlpConfig(endpoint=endpoint, protocol=protocol, interval_s=interval / 1000,
                      timeout_s=timeout / 1000, histogram=histogram, spans=spans,
                      traces_endpoint=traces_endpoint, traces_protocol=traces_protocol,
                      traces_headers=traces_headers)


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
