"""Issue 30, point 1: vLLM's executor waits for an attnprof worker method with no timeout
(a timed-out answer would become the next model step's output), so each method must return
by itself: none may wait on a lock another thread can hold for long. The export hub's lock is
such a lock (an OTLP export over the network holds it for the exporter's timeout); the
snapshot RPC used to flush the exporters under it."""

from __future__ import annotations

import threading
from typing import Any

from attnprof.capture.vllm.hooks import Capture
from attnprof.config import Config
from attnprof.exporters.hub import ExportHub
from attnprof.host.vllm import runtime
from attnprof.host.vllm.worker_rpc import worker_methods


def test_no_worker_method_waits_for_an_export_in_progress() -> None:
    state = runtime.State(config=Config(enabled=True, sample_rate=1.0, seed=0))
    state.hub = ExportHub(on_error=state.errors.record)
    cap = Capture(state)
    methods = worker_methods(cap, state)
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("attnprof_snapshot", (True,)), ("attnprof_snapshot", (False,)),
        ("attnprof_poll", (True, None, {"0:0": [1, 0.5]})), ("attnprof_head_stats", ()),
        ("attnprof_set_sampling", (0.5, None)), ("attnprof_trace", ("arm", "t", 1, 1.0)),
        ("attnprof_trace", ("count", "t")), ("attnprof_trace", ("take", "t")),
        ("attnprof_trace", ("drop", "t"))]
    answers: dict[int, Any] = {}

    def run() -> None:
        for i, (name, args) in enumerate(calls):
            answers[i] = methods[name](None, *args)

    # An exporter is sending (say, to an OTLP collector that does not answer).
    with state.hub._lock:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        # Generous: a deadlock detector, not a timing (the calls take milliseconds).
        t.join(timeout=120)
        assert not t.is_alive(), f"blocked in {calls[len(answers)][0]}"
    assert len(answers) == len(calls)
    failed = {calls[i][0]: a["error"] for i, a in answers.items() if a.get("error")}
    assert not failed, failed
