"""Errors inside attnprof never fail a request; they are counted on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof.tools.http import post_json
from attnprof.tools.server import VllmServer
from tests.conftest import metric_value, poll_metrics, running_tiny_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def faulty_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[VllmServer]:
    with running_tiny_server(tiny_model, tmp_path_factory, "faulty.log",
                             {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_FAULT_INJECT": "capture",
                              "ATTNPROF_MAX_ERRORS": "1000000"},
                             max_model_len=256, kv_bytes=32 << 20) as srv:
        yield srv


def test_exception_in_capture_path_is_counted_not_raised(faulty_server: VllmServer) -> None:
    for i in range(3):
        out: Any = post_json(faulty_server.base_url + "/v1/completions",
                                  {"model": "tiny", "prompt": "the model request " * (i + 1),
                                   "max_tokens": 4, "ignore_eos": True, "temperature": 0.0})
        assert out["usage"]["completion_tokens"] == 4
    # Worker metrics are flushed by a background thread about once a second: poll.
    metrics = poll_metrics(faulty_server.base_url, lambda t: (metric_value(
        t, "attnprof_internal_errors_total", place="capture") or 0) > 0)
    errors = metric_value(metrics, "attnprof_internal_errors_total", place="capture")
    assert errors is not None and errors > 0
    assert metric_value(metrics, "attnprof_dropped_samples_total", reason="capture_error")


ALL_PLACES = "capture,step,stat_logger,endpoint,advice,flusher,otlp_export"


@pytest.fixture(scope="module")
def every_fault_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[VllmServer]:
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as rx, running_tiny_server(
            tiny_model, tmp_path_factory, "every-fault.log",
            {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_HEAD_STATS_RATE": "1.0",
             "ATTNPROF_HEAD_STATS_MIN_TOKENS": "8", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
             "ATTNPROF_FAULT_INJECT": ALL_PLACES, "ATTNPROF_MAX_ERRORS": "3",
             "ATTNPROF_ADVICE_INTERVAL_S": "0.5", "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0",
             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.endpoint,
             "OTEL_METRIC_EXPORT_INTERVAL": "500"},
            max_model_len=256, kv_bytes=32 << 20) as srv:
        yield srv


def _greedy(srv: VllmServer, prompt: str) -> str:
    out: Any = post_json(srv.base_url + "/v1/completions",
                              {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                               "ignore_eos": True, "temperature": 0.0})
    return str(out["choices"][0]["text"])


def test_faults_at_every_place_trip_visible_breakers_and_never_touch_outputs(
        every_fault_server: VllmServer, tiny_server: Any) -> None:
    import urllib.error
    import urllib.request

    srv = every_fault_server
    prompts = [("the model request cache token " * k).strip() for k in (1, 3, 5, 7)]
    # Outputs equal those of the fault-free server on the same model (greedy).
    assert [_greedy(srv, p) for p in prompts] == [_greedy(tiny_server, p) for p in prompts]
    codes = []
    for _ in range(4):
        try:
            with urllib.request.urlopen(srv.base_url + "/attnprof/snapshot", timeout=30) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as err:
            codes.append(err.code)
    assert codes == [500, 500, 500, 503]  # counted, then the endpoint's breaker answers

    def tripped(text: str) -> set[str]:
        return {p for p in ("capture", "stat_logger", "endpoint", "advice", "export")
                if (metric_value(text, "attnprof_capture_disabled", place=p) or 0) >= 1}

    metrics = poll_metrics(srv.base_url, lambda t: len(tripped(t)) == 5 and (metric_value(
        t, "attnprof_internal_errors_total", place="export_otlp") or 0) > 0)
    assert tripped(metrics) == {"capture", "stat_logger", "endpoint", "advice", "export"}
    def errors(*places: str) -> float:
        return sum(metric_value(metrics, "attnprof_internal_errors_total", place=p) or 0
                   for p in places)

    # Each area tripped at ATTNPROF_MAX_ERRORS=3 of its own errors (capture's come from the
    # layer wrapper and the step's end alike).
    assert errors("capture", "step_end") >= 3 and errors("capture") > 0
    assert errors("step_end") > 0
    for place in ("stat_logger", "endpoint", "window_advice", "flusher"):
        assert errors(place) >= 3, place
    # OTLP export failures are the collector's business: counted, never a breaker.
    assert errors("export_otlp") > 0
    # The host kept serving throughout, and still does.
    assert _greedy(srv, prompts[0]) == _greedy(tiny_server, prompts[0])
