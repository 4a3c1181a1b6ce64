"""Fleet-wide context lengths from a Prometheus server (opens a socket: a tool, not analysis)."""

from __future__ import annotations

import re
import urllib.parse

from attnprof.analyze.sparsity.inputs import InputError, from_prometheus_response
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.facts import durations
from attnprof.tools import http

__all__ = ["parse_duration", "parse_prometheus_answer", "query_prometheus", "query_url"]

_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def parse_duration(text: str, flag: str = "--prometheus-range") -> str:
    """A PromQL range (``5m``, ``1d``, ``1h30m``, :func:`attnprof.facts.durations.promql_range`)
    as given; :class:`InputError` for anything else (it is pasted into the query)."""
    try:
        return durations.promql_range(text, flag)
    except durations.DurationError as err:
        raise InputError(str(err)) from None


def _label_value(text: str, flag: str) -> str:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise InputError(f"{flag}: control characters are not allowed")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def query_url(url: str, model: str | None = None, range_: str | None = None,
              metric: str = "attnprof_request_context_tokens") -> str:
    """The ``/api/v1/query`` URL summing the histogram over every replica (one query for the
    fleet); :class:`InputError` for a bad URL, duration or label value."""
    try:
        http.check_url(url, "--prometheus")
    except http.HttpError as err:
        raise InputError(str(err)) from None
    if not _METRIC.fullmatch(metric):
        raise InputError(f"{metric!r} is not a metric name")
    selector = "{model=" + _label_value(model, "--prometheus-model") + "}" if model else ""
    series = f"{metric}_bucket{selector}"
    inner = f"increase({series}[{parse_duration(range_)}])" if range_ is not None else series
    query = f"sum by (le) ({inner})"
    return url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})


def parse_prometheus_answer(body: bytes, url: str) -> LengthDistribution:
    """A Prometheus answer's raw body -> distribution; :class:`InputError` (one line) for
    anything that is not a usable ``sum by (le)`` histogram result."""
    try:
        obj = http.parse_json(body, url, " (is it a Prometheus server?)")
    except http.HttpError as err:
        raise InputError(str(err)) from None
    try:
        return from_prometheus_response(obj, source=f"prometheus {url}")
    except InputError:
        raise
    except (ValueError, OverflowError, TypeError, AttributeError) as err:
        # A bucket edge or count no distribution can hold (huge, negative, not a number).
        raise InputError(f"prometheus {url}: unusable histogram ({type(err).__name__})"
                         ) from None


def query_prometheus(url: str, model: str | None = None, range_: str | None = None,
                     metric: str = "attnprof_request_context_tokens",
                     timeout: float = 30.0) -> LengthDistribution:
    """Fleet-wide distribution: one query summing the histogram over every replica."""
    full = query_url(url, model, range_, metric)
    try:
        body = http.get(full, timeout=timeout)
    except http.HttpError as err:
        raise InputError(str(err).replace(full, url)) from None
    return parse_prometheus_answer(body, url)
