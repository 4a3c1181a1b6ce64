"""Errors inside attnprof never fail a request; they are counted on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof.tools.server import VllmServer, http_post_json
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
        out: Any = http_post_json(faulty_server.base_url + "/v1/completions",
                                  {"model": "tiny", "prompt": "the model request " * (i + 1),
                                   "max_tokens": 4, "ignore_eos": True, "temperature": 0.0})
        assert out["usage"]["completion_tokens"] == 4
    # Worker metrics are flushed by a background thread about once a second: poll.
    metrics = poll_metrics(faulty_server.base_url, lambda t: (metric_value(
        t, "attnprof_internal_errors_total", place="capture") or 0) > 0, timeout=15)
    errors = metric_value(metrics, "attnprof_internal_errors_total", place="capture")
    assert errors is not None and errors > 0
    assert metric_value(metrics, "attnprof_dropped_samples_total", reason="capture_error")
