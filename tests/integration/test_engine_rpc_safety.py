"""Issue 30, point 1: an attnprof RPC whose answer comes later than the API server waits for
it never kills or wedges vLLM's EngineCore.

vLLM-CPU's default executor is the real ``MultiprocExecutor``, which reads its workers'
answers in order with no request id. Before the fix attnprof handed it
``ATTNPROF_RPC_TIMEOUT_S``: the executor gave up, the late answer became the next model step's
output, and the EngineCore died (``AttributeError: 'dict' object has no attribute
'sampled_token_ids'``; the next completion answered 500 and ``/health`` went away). Here
every attnprof worker method is forced slower than the API server's wait
(``ATTNPROF_FAULT_DELAY_S`` 1.5 s against ``ATTNPROF_RPC_TIMEOUT_S`` 0.1 s) and each route
that makes an RPC is called: every completion after it succeeds and ``/health`` stays up.
Nothing here depends on timing beyond the 15x gap between the two knobs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof.tools.http import HttpError, get, get_text, parse_json, post_json
from attnprof.tools.server import VllmServer
from tests.conftest import running_tiny_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY = "rpc-safety-monitoring-key"


@pytest.fixture(scope="module")
def slow_rpc_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[VllmServer]:
    with running_tiny_server(tiny_model, tmp_path_factory, "slow-rpc.log",
                             {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_API_KEY": KEY,
                              "ATTNPROF_RPC_TIMEOUT_S": "0.1",
                              "ATTNPROF_FAULT_DELAY_S": "1.5",
                              "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0",
                              "ATTNPROF_ADVICE_INTERVAL_S": "0"},
                             max_model_len=256, kv_bytes=32 << 20) as srv:
        yield srv


def _call(srv: VllmServer, method: str, path: str, body: dict[str, Any] | None = None
          ) -> tuple[int, dict[str, Any]]:
    """(status, answer) of an attnprof route with the monitoring key (the project's client;
    an error status comes back with its one-line message)."""
    url = srv.base_url + path
    try:
        if method == "POST":
            return 200, dict(post_json(url, body or {}, timeout=120, api_key=KEY))
        return 200, dict(parse_json(get(url, timeout=120, api_key=KEY), url))
    except HttpError as err:
        return err.status or 0, {"error": str(err)}


def _completion_ok(srv: VllmServer, what: str) -> None:
    try:
        out: Any = post_json(srv.base_url + "/v1/completions",
                             {"model": "tiny", "prompt": "the model request cache token",
                              "max_tokens": 4, "ignore_eos": True, "temperature": 0.0},
                             timeout=120)
    except Exception as exc:
        raise AssertionError(f"completion after {what} failed: {exc}\n"
                             f"{srv.log_tail(40)}") from exc
    assert out["usage"]["completion_tokens"] == 4, out
    try:
        get_text(srv.base_url + "/health", timeout=30)
    except HttpError as err:
        raise AssertionError(f"/health after {what}: {err}") from None


def test_late_attnprof_answers_never_kill_the_engine(slow_rpc_server: VllmServer) -> None:
    srv = slow_rpc_server
    _completion_ok(srv, "start-up")

    # The snapshot: served within the API server's wait, saying the workers were late.
    code, snap = _call(srv, "GET", "/attnprof/snapshot")
    assert code == 200, snap
    assert "TimeoutError" in str((snap.get("errors") or {}).get("collective_rpc")), snap
    _completion_ok(srv, "a snapshot whose RPC outlived the API server's wait")

    # The sampling switch: 504 (not taken within the wait), yet every worker takes it later.
    code, body = _call(srv, "POST", "/attnprof/sampling", {"sample_rate": 0.5})
    assert code == 504, body
    _completion_ok(srv, "a sampling switch whose RPC outlived the API server's wait")

    # The live trace: its arm RPC is late too.
    code, body = _call(srv, "GET", "/attnprof/trace?steps=1&timeout=1")
    assert code in (200, 504), body
    _completion_ok(srv, "a trace whose RPCs outlived the API server's wait")

    # The late answers were not lost either: a later snapshot carries the workers (folded
    # when their answer came) with the switched rate. Each try is one more late poll; the
    # deadline only bounds a hang (each late answer takes 1.5 s, more on a busy box).
    workers: list[dict[str, Any]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        code, snap = _call(srv, "GET", "/attnprof/snapshot")
        workers = [w for w in snap.get("workers") or [] if not w.get("error")]
        if code == 200 and workers and all(
                (w.get("sampler") or {}).get("base_rate") == 0.5 for w in workers):
            break
        time.sleep(0.5)
    assert workers and all((w.get("sampler") or {}).get("base_rate") == 0.5
                           for w in workers), snap
    _completion_ok(srv, "the late answers were folded")
    assert "sampled_token_ids" not in srv.log_tail(400)
