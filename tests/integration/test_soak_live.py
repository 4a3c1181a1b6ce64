"""A short live soak on the session's tiny vLLM server (``benchmarks/soak.py`` runs the
10-minute one at attnprof's default rates): 40 s of varied loopback traffic with
``/attnprof/snapshot`` polled every second and ``/metrics`` scraped, then every counter
must agree with what the loop did, with no internal error anywhere. RSS is recorded, not
asserted: 40 s on a shared 2-core machine cannot tell a slope from noise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_API_KEY

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _soak() -> Any:
    spec = importlib.util.spec_from_file_location("attnprof_bench_soak",
                                                  ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_short_live_soak_counters_agree_and_no_errors(tiny_server: Any) -> None:
    r = _soak().live_soak(duration=40, warmup=10, workers=2, poll_s=1.0, metrics_s=5.0,
                          rss_s=2.0, server=tiny_server, api_key=TINY_API_KEY)
    summary = json.dumps({k: r[k] for k in ("checks", "internal_errors", "steps_total_metric",
                                            "sampler", "requests_ok", "requests_snapshot",
                                            "requests_metric", "plugin_processes",
                                            "snapshot_poll_failures", "request_errors")},
                         indent=1, default=str)
    assert r["requests_ok"] > 0 and r["snapshot_polls"] >= 20, summary
    assert r["checks"] == dict.fromkeys(r["checks"], True), summary
    assert {"api_server", "engine_core", "worker"} <= set(r["rss"]), summary
