"""A short live soak on the session's tiny vLLM server (``benchmarks/soak.py`` runs the
10-minute one at attnprof's default rates): 40 s of varied loopback traffic with
``/attnprof/snapshot`` polled every second and ``/metrics`` scraped, then every counter
must agree with what the loop did, with no internal error anywhere. RSS is recorded, not
asserted: 40 s on a shared 2-core machine cannot tell a slope from noise."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import TINY_API_KEY

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

def _soak() -> Any:
    from tests.conftest import load_benchmark

    return load_benchmark("soak")


def test_short_live_soak_counters_agree_and_no_errors(tiny_server: Any) -> None:
    r = _soak().live_soak(duration=40, warmup=10, workers=2, poll_s=1.0, metrics_s=5.0,
                          rss_s=2.0, server=tiny_server, api_key=TINY_API_KEY,
                          min_polls=20)
    summary = json.dumps({k: r[k] for k in ("checks", "internal_errors", "steps_total_metric",
                                            "sampler", "requests_ok", "requests_snapshot",
                                            "requests_metric", "plugin_processes",
                                            "snapshot_poll_failures", "request_errors")},
                         indent=1, default=str)
    assert r["requests_ok"] > 0 and r["snapshot_polls"] >= 20, summary
    assert r["checks"] == dict.fromkeys(r["checks"], True), summary
    assert {"api_server", "engine_core", "worker"} <= set(r["rss"]), summary
