"""A real Prometheus scrapes the vLLM server's /metrics and sees attnprof's series."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from attnprof.tools.http import get_text, post_json
from tests.conftest import get_snapshot

pytestmark = [pytest.mark.vllm, pytest.mark.prometheus]


def test_promtool_accepts_the_exposition(tiny_server: Any) -> None:
    post_json(tiny_server.base_url + "/v1/completions",
                   {"model": "tiny", "prompt": "the model", "max_tokens": 2, "temperature": 0})
    # promtool passes an empty exposition: first, attnprof's series must be there, from the
    # API server (request histograms, liveness) and from the worker (per-layer capture),
    # once the export loops (a second apart) have written them.
    want = {"attnprof_request_context_tokens", "attnprof_plugin_processes",
            "attnprof_layer_info", "attnprof_steps_total"}
    deadline = time.monotonic() + 30
    while True:
        text = get_text(tiny_server.base_url + "/metrics")
        ours = "\n".join(ln for ln in text.splitlines() if "attnprof_" in ln) + "\n"
        families = {ln.split()[2] for ln in ours.splitlines() if ln.startswith("# TYPE ")}
        if want <= families or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert want <= families, sorted(families)
    r = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True,
                       text=True)
    # promtool exits 1 on lint findings; there must be none for attnprof's series.
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_scrapes_worker_and_api_server_series(tiny_server: Any,
                                                         prometheus: Any) -> None:
    post_json(tiny_server.base_url + "/v1/completions",
                   {"model": "tiny", "prompt": "the model request", "max_tokens": 3,
                    "temperature": 0})
    # API-server side (stat logger) and worker side (per-layer capture) on one target.
    ctx = prometheus.wait_for("sum(attnprof_request_context_tokens_count)")
    assert float(ctx[0]["value"][1]) >= 1
    layers = prometheus.wait_for(
        'count by (backend) (attnprof_layer_info{fused="true"})')
    assert layers[0]["metric"]["backend"] == "CPU_ATTN" and layers[0]["value"][1] == "2"
    roles = prometheus.wait_for("sum by (role) (attnprof_plugin_processes)")
    assert {r["metric"]["role"] for r in roles} == {"api_server", "engine_core", "worker"}
    share = prometheus.wait_for(
        'sum(attnprof_step_attention_time_seconds_total{phase="decode"})'
        ' / sum(attnprof_step_time_seconds_total{phase="decode"})')
    assert 0 < float(share[0]["value"][1]) < 1


def test_suggest_window_reads_the_fleet_from_real_prometheus(tiny_server: Any, prometheus: Any,
                                                             tiny_model: Any) -> None:
    import json
    import sys

    for n in (1, 3, 6):
        post_json(tiny_server.base_url + "/v1/completions",
                       {"model": "tiny", "prompt": "the model request " * n, "max_tokens": 2,
                        "temperature": 0})
    snap = get_snapshot(tiny_server.base_url)
    total = snap["requests"]["requests"]
    # Wait until Prometheus has scraped every finished request.
    prometheus.wait_for(f"sum(attnprof_request_context_tokens_count) >= {total}")
    r = subprocess.run([sys.executable, "-m", "attnprof.cli", "suggest-window",
                        "--prometheus", prometheus.url, "--model", str(tiny_model),
                        "--window", "16", "--sinks", "4", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["window"] == 16 and out["sinks"] == 4
    assert out["traffic"]["requests"] == total
    for key in ("attention_flop_saving", "kv_memory_saving", "exact_request_fraction"):
        assert 0.0 <= out[key] <= 1.0
