"""``attnprof report --prometheus`` over two ``attnprof serve`` replicas scraped by one real
Prometheus: the report's totals equal the sum of each replica's own /metrics, replicas are
counted, and the Prometheus-side bad inputs are one line and exit 2 with nothing written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof.tools.http import HttpError, get_text, post_json
from tests.conftest import PrometheusServer, free_port, metric_value, poll_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.prometheus]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnprof: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def _serve(model: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``attnprof serve`` as a user runs it (its own process group, stopped with SIGTERM)."""
    env = {**os.environ, "ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
           "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnprof.cli", "serve", "--model", str(model), "--port",
             str(port), "--eager", "--", "--max-model-len", "512", "--kv-cache-memory-bytes",
             str(64 << 20), "--no-enable-prefix-caching"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(HttpError):  # not listening yet
            if "attnprof_" in get_text(base + "/metrics"):
                return
        time.sleep(1.0)
    raise AssertionError("attnprof serve was not ready: " + log.read_text()[-2000:])


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    work = tmp_path_factory.mktemp("fleet")
    ports = [free_port(), free_port()]
    with _serve(tiny_model, ports[0], work / "a.log") as a, \
            _serve(tiny_model, ports[1], work / "b.log") as b:
        bases = [f"http://127.0.0.1:{p}" for p in ports]
        for base, proc, log in zip(bases, (a, b), ("a.log", "b.log"), strict=True):
            _wait_ready(base, proc, work / log)
        (work / "prom").mkdir()
        prom = PrometheusServer([f"127.0.0.1:{p}" for p in ports], work / "prom")
        try:
            yield bases, prom, work
        finally:
            prom.stop()


def _model_label(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("attnprof_request_context_tokens_count{"):
            return line.split('model="', 1)[1].split('"', 1)[0]
    raise AssertionError("no attnprof_request_context_tokens_count on /metrics")


def test_fleet_report_totals_equal_the_sum_of_each_replica(fleet: Any, tiny_model: Path,
                                                           tmp_path: Path) -> None:
    bases, prom, _ = fleet
    served = json.loads(get_text(bases[0] + "/v1/models"))["data"][0]["id"]
    # Different traffic per replica, so a report reading one replica twice would be wrong.
    for base, n in ((bases[0], 3), (bases[1], 5)):
        for i in range(n):
            r = post_json(base + "/v1/completions",
                               {"model": served, "prompt": "the model request " * (2 + 3 * i),
                                "max_tokens": 3, "temperature": 0})
            assert r["choices"], r
    # Each replica's own /metrics, once its stat logger has flushed every request.
    def counted(text: str) -> float:
        return metric_value(text, "attnprof_request_context_tokens_count",
                            model=_model_label(text)) or 0

    texts = []
    for base, n in ((bases[0], 3), (bases[1], 5)):
        # polled; the timeout only bounds a hang (a busy box flushes late)
        text = poll_metrics(base, lambda t, n=n: counted(t) >= n, timeout=120)
        assert counted(text) >= n, (base, counted(text), n)
        texts.append(text)
    label = _model_label(texts[0])
    want = {name: sum(metric_value(t, name, model=label) or 0.0 for t in texts)
            for name in ("attnprof_request_context_tokens_count",
                         "attnprof_request_prompt_tokens_sum",
                         "attnprof_request_generation_tokens_sum")}
    assert want["attnprof_request_context_tokens_count"] == 8
    # Prometheus has scraped the final values of both replicas.
    prom.wait_for(f"sum(attnprof_request_prompt_tokens_sum) == "
                  f"{want['attnprof_request_prompt_tokens_sum']}", timeout=60)
    prom.wait_for("count(count by (instance) (attnprof_request_context_tokens_count)) == 2")
    # A few more scrapes, so rates over the range have points to work with: three more
    # samples of every series, counted in Prometheus, not assumed from a 3 s sleep (a busy
    # box scrapes late; issue 30, point 10).
    points = "min(count_over_time(attnprof_request_context_tokens_count[1h]))"
    (now,) = prom.query(points)
    prom.wait_for(f"{points} >= {int(now['value'][1]) + 3}", timeout=60)  # type: ignore[index]
    out = tmp_path / "report"
    t0 = time.monotonic()
    r = _cli("report", "--prometheus", prom.url, "--gpu-hour-price", "2.5", "--out", str(out))
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    print(f"report from Prometheus: {elapsed:.1f} s")
    doc = json.loads((out / "report.json").read_text())
    assert doc["schema_version"] == "attnprof.report/2.2" and doc["source"]["kind"] == "prometheus"
    (m,) = doc["models"]
    assert m["model"] == label
    assert m["traffic"]["requests"] == want["attnprof_request_context_tokens_count"]
    assert m["traffic"]["prompt_tokens"] == want["attnprof_request_prompt_tokens_sum"]
    assert m["traffic"]["generation_tokens"] == want["attnprof_request_generation_tokens_sum"]
    # The context histogram sums to the requests, and replicas are counted, not assumed.
    assert sum(m["traffic"]["context"]["counts"]) == 8
    assert m["money"]["replicas"] == 2 and "counted" in m["money"]["replicas_basis"]
    assert m["money"]["monthly_cost"] == pytest.approx(2 * 1.0 * 730 * 2.5)
    # The autoscaled base: the replica count averaged over the range (both served all of
    # it, scraped from its first step: 2, or a little under when a step missed a scrape).
    assert 1.5 <= m["money"]["mean_replicas"] <= 2.0
    assert m["money"]["mean_replicas_basis"].startswith("mean of Prometheus' replica count")
    assert m["traffic"]["max_model_len"] == 512
    assert 0 < m["time"]["attention_share"]["decode"] < 1
    assert m["kv"]["bytes_per_token"] > 0 and m["kv"]["kv_dtype"]
    # vLLM's own series, where Prometheus has them (model_name is the same served name).
    assert m["kv"]["source"] == "vllm:* series" and m["kv"]["preemptions"] == 0
    assert m["kv"]["peak_concurrency_basis"].startswith("vLLM's peak running requests")
    assert m["kv"]["usage_over_time"], "the fleet's KV usage over the range"
    # Memory held at the busiest instant, summed over both replicas at that instant: never
    # more than the busiest replica's own peak x both replicas' capacity (the upper bound
    # the report used to take). The product matches each replica's two gauges by their
    # labels: a mismatch would leave no series (None). Short requests leave the scrapes at
    # 0% usage here, so both read 0; test_prometheus_held_peak checks the sum on known,
    # non-zero peaks that do not coincide.
    held = m["kv"]["held_peak_tokens"]
    assert held is not None
    assert 0 <= held <= m["kv"]["usage_peak"] * m["kv"]["capacity_tokens"] + 1e-6
    for name in ("report.html", "report.md"):
        assert (out / name).stat().st_size > 1000
    # --replicas 8 bills 8 replicas but never multiplies Prometheus' sum over the 2 it
    # scraped: GPU-hours per 1M tokens stay the scraped replicas' own. Two more requests
    # once Prometheus holds the series, so its rate over the range is not 0 (a series is
    # born with its first requests already in it).
    for i in range(2):
        assert post_json(bases[0] + "/v1/completions",
                         {"model": served, "prompt": "one more request " * (2 + i),
                          "max_tokens": 3, "temperature": 0})["choices"]
    prom.wait_for("sum(attnprof_request_context_tokens_count) >= 10", timeout=60)
    r = _cli("report", "--prometheus", prom.url, "--replicas", "8", "--out",
             str(tmp_path / "eight"))
    assert r.returncode == 0, r.stderr
    (m8,) = json.loads((tmp_path / "eight" / "report.json").read_text())["models"]
    assert m8["money"]["replicas"] == 8 and m8["money"]["monthly_gpu_hours"] == 8 * 730.0
    assert m8["money"]["gpu_hours_per_mtok"] == pytest.approx(
        2 * m8["money"]["gpus_per_replica"] / (m8["traffic"]["tokens_per_s"] * 3600) * 1e6)
    # `--model` names it, and `--range` within the data works too (once Prometheus holds
    # more than the range: 8 of 10 one-second scrapes of every series).
    prom.wait_for("min(count_over_time(attnprof_request_context_tokens_count[10s])) >= 8",
                  timeout=60)
    r = _cli("report", "--prometheus", prom.url, "--model", label, "--range", "5s",
             "--out", str(tmp_path / "ranged"))
    assert r.returncode == 0, r.stderr


def test_prometheus_bad_inputs_are_one_line(fleet: Any, tiny_model: Path,
                                            tmp_path: Path) -> None:
    _bases, prom, work = fleet
    prom.wait_for("sum(attnprof_request_context_tokens_count) > 0", timeout=120)
    out = tmp_path / "never"
    line = _one_line_error(_cli("report", "--prometheus", prom.url, "--model", "no-such",
                                "--out", str(out)), "no-such", "models there:")
    assert tiny_model.name in line or "tiny" in line
    _one_line_error(_cli("report", "--prometheus", prom.url, "--range", "24h",
                         "--out", str(out)), "--range 24h is longer than the data")
    _one_line_error(_cli("report", "--prometheus", prom.url, "--range", "1x",
                         "--out", str(out)), "not a duration")
    # A Prometheus that scrapes no attnprof server at all.
    (work / "empty").mkdir()
    empty = PrometheusServer([f"127.0.0.1:{free_port()}"], work / "empty")
    try:
        empty.wait_for("up", timeout=60)
        _one_line_error(_cli("report", "--prometheus", empty.url, "--out", str(out)),
                        "no attnprof series")
    finally:
        empty.stop()
    _one_line_error(_cli("report", "--prometheus", f"http://127.0.0.1:{free_port()}",
                         "--out", str(out)))
    assert not out.exists()
