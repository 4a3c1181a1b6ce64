"""Live traces and spans without a server: the Chrome/Perfetto writer's nesting rules, arming
and taking step records in a Capture over fake vLLM objects (CPU clocks and late-read GPU
events), nothing recorded unarmed, the /attnprof/trace route on a real FastAPI app with a fake
engine, and OTLP spans decoded with the official protos."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from attnprof.aggregate.trace import MAX_STEPS, LayerRange, StepTrace, TraceBuffer
from attnprof.config import Config, ConfigError
from attnprof.exporters.chrome_trace import TraceProcess, check_trace, render_steps
from attnprof.host.vllm import runtime, worker_rpc
from attnprof.host.vllm.live_trace import LiveTrace
from tests.unit.aggregate.test_aggregate import _capture, _run_steps, _wrapped_layers, gpu_rig
from tests.unit.host.test_endpoint import _app, serving_state

KEY = "trace-key"


def _step(start: int, layers: int = 3, dur: int = 1000, phase: str = "decode") -> StepTrace:
    per = dur // (layers + 1)
    return StepTrace(start, dur, phase, "sampled", 0.5, 4, 4, 40, 25.0, [
        LayerRange(i, "CPU_ATTN", "cpu_attention_with_kv_cache[vec]", 10 + i * per, per - 5,
                   phase, 4, 4, 40, 25.0) for i in range(layers)])


def _x_by_track(doc: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X":
            out.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    return out


# ----- the writer -----
def test_writer_output_follows_the_nesting_rules() -> None:
    t0 = 1_700_000_000_000_000_000
    procs = [TraceProcess(101, "VllmWorker-0", [_step(t0 + k * 5000) for k in range(4)]),
             TraceProcess(102, "VllmWorker-1", [_step(t0 + 7, layers=2)])]
    doc = render_steps(procs, [(1, "KV cache usage", t0 + 3, {"usage": 0.25})],
                       {"attnprof": {"kind": "attnprof.trace"}})
    assert check_trace(doc) == []
    json.dumps(doc, allow_nan=False)  # strict JSON
    meta = {(e["pid"], e["name"]) for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {(101, "process_name"), (101, "thread_name"), (102, "process_name")} <= meta
    tracks = _x_by_track(doc)
    steps = [e for e in tracks[(101, 1)] if e["cat"] == "step"]
    assert len(steps) == 4
    for st in steps:  # every layer range strictly inside its step, same pid/tid
        kids = [e for e in tracks[(101, 1)] if e["cat"] == "attention"
                and st["ts"] <= e["ts"] and e["ts"] + e["dur"] <= st["ts"] + st["dur"]]
        assert [k["name"] for k in kids] == [f"attn::L{i}::CPU_ATTN" for i in range(3)]
        assert set(kids[0]["args"]) == {"layer", "backend", "kernel", "phase", "tokens",
                                        "num_requests", "max_seq_len", "mean_seq_len"}
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert {c["name"] for c in counters} == {"KV cache usage", "effective sample rate"}
    assert doc["otherData"]["origin_unix_ns"] == t0  # ts from the earliest event, in us
    assert min(e["ts"] for e in doc["traceEvents"] if "ts" in e) == 0


def test_writer_clamps_a_layer_that_pokes_out_of_its_step() -> None:
    bad = _step(1000, layers=2)
    bad.layers[1] = bad.layers[1]._replace(dur_ns=10_000)  # ends after the step (skew)
    overlap = _step(1500, layers=1)  # starts before the previous step ended
    doc = render_steps([TraceProcess(7, "w", [bad, overlap])])
    assert check_trace(doc) == []


def test_checker_catches_what_breaks_the_rules() -> None:
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
          {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5, "dur": 10},
          {"ph": "C", "name": "c", "pid": 2, "tid": 0, "ts": 0, "args": {"x": "high"}}]
    problems = check_trace({"traceEvents": ev})
    assert any("overlaps" in p for p in problems)
    assert any("process_name" in p for p in problems)
    assert any("thread_name" in p for p in problems)
    assert any("counter" in p for p in problems)
    assert check_trace([]) == ["not a JSON object with a traceEvents list"]


# ----- capture: arm, take, nothing unarmed -----
def test_nothing_is_recorded_unarmed() -> None:
    cap = _capture(1.0)
    layers = _wrapped_layers(cap, 2)
    calls: list[Any] = []
    cap.trace.add = lambda s: calls.append(s)  # type: ignore[method-assign]
    _run_steps(cap, layers, 10)
    assert cap.aggs.outcomes["sampled"] == 10
    assert calls == [] and cap.trace.steps == [] and not cap.trace.span_queue
    assert worker_rpc.trace_take(cap)["steps"] == []
    cap.state.hub.stop(final_flush=False)


def test_armed_capture_records_the_next_n_sampled_steps_then_stops() -> None:
    cap = _capture(1.0)
    layers = _wrapped_layers(cap, 3)
    _run_steps(cap, layers, 2)  # before arming: not recorded
    got = worker_rpc.trace_arm(cap, 4, timeout_s=60, trace_id="t1")
    assert got["armed"] and got["rank"]["tp_rank"] == 0
    _run_steps(cap, layers, 6)
    # full after 4: steps 5 and 6 not kept
    assert worker_rpc.trace_count(cap, "t1")["steps"] == 4
    assert worker_rpc.trace_count(cap, "other")["steps"] == -1
    out = worker_rpc.trace_take(cap, "t1")
    steps = [StepTrace.from_json(s) for s in json.loads(json.dumps(out["steps"]))]
    assert len(steps) == 4 and not out["truncated"]
    for s in steps:
        assert s.phase == "decode" and s.outcome == "sampled" and s.effective_rate == 1.0
        assert (s.tokens, s.num_reqs, s.max_seq_len, s.mean_seq_len) == (2, 2, 6, 5.5)
        assert [r.layer for r in s.layers] == [0, 1, 2]
        prev = 0
        for r in s.layers:  # each call inside the step, in order
            assert prev <= r.offset_ns and r.offset_ns + r.dur_ns <= s.dur_ns
            prev = r.offset_ns + r.dur_ns
    assert steps[0].start_ns < steps[-1].start_ns
    assert worker_rpc.trace_take(cap, "t1")["steps"] == []  # taken: gone, disarmed
    _run_steps(cap, layers, 3)
    assert cap.trace.steps == []
    doc = render_steps([TraceProcess(1, "w", steps)])
    assert check_trace(doc) == []
    cap.state.hub.stop(final_flush=False)


def test_an_armed_trace_nobody_takes_stops_recording_at_its_deadline() -> None:
    now = [0.0]
    buf = TraceBuffer(clock=lambda: now[0])
    buf.arm(MAX_STEPS, timeout_s=5)
    assert buf.wanted
    buf.add(_step(0))
    assert buf.count() == 1
    now[0] = 6.0
    assert not buf.wanted
    assert buf.count() == 0  # and its records are let go, not kept until the next trace
    # A trace that filled up but was never taken lets go at its deadline too.
    buf.arm(2, timeout_s=5)
    buf.add(_step(0))
    buf.add(_step(1))
    assert buf.count() == 2 and not buf.wanted
    now[0] = 12.0
    assert not buf.wanted and buf.count() == 0


def test_gpu_steps_are_traced_from_late_read_events_without_a_sync() -> None:
    cap = _capture(1.0)
    gpu, hook, cuda = gpu_rig(cap)
    worker_rpc.trace_arm(cap, 2, 60, "g")
    for _ in range(2):
        hook(cuda, input_ids=[0, 0])
    # events not complete: nothing read yet
    assert worker_rpc.trace_count(cap, "g")["steps"] == 0
    gpu.done_until = gpu.t
    out = worker_rpc.trace_take(cap, "g")  # folds the completed steps first, no sync
    assert gpu.syncs == 0 and len(out["steps"]) == 2
    s = StepTrace.from_json(out["steps"][0])
    # Fake events are 1 ms apart: step start, L0 start/end, L1 start/end, step end.
    assert s.dur_ns == 5_000_000
    assert [(r.offset_ns, r.dur_ns) for r in s.layers] == [(1_000_000, 1_000_000),
                                                           (3_000_000, 1_000_000)]
    cap.state.hub.stop(final_flush=False)


# ----- the route -----
class TraceEngine:
    """``collective_rpc`` answering attnprof_trace like one worker whose steps arrive over
    time (one per count poll)."""

    def __init__(self, per_poll: int = 2, delay: float = 0.0) -> None:
        self.have = 0
        self.per_poll = per_poll
        self.delay = delay
        self.ops: list[str] = []

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        assert method == "attnprof_trace"
        op = args[0]
        self.ops.append(op)
        await asyncio.sleep(self.delay)
        if op == "arm":
            self.want = args[2]
            return [{"pid": 4242, "process": "VllmWorker-0", "rank": {"tp_rank": 0},
                     "armed": True}]
        if op == "count":
            self.have = min(self.want, self.have + self.per_poll)
            return [{"pid": 4242, "steps": self.have}]
        t0 = 1_700_000_000_000_000_000
        return [{"pid": 4242, "process": "VllmWorker-0", "rank": {"tp_rank": 0},
                 "truncated": False,
                 "steps": [_step(t0 + k * 10_000, layers=2).to_json()
                           for k in range(self.have)]}]


@pytest.fixture()
def state(monkeypatch: pytest.MonkeyPatch) -> runtime.State:
    st = serving_state(monkeypatch)
    st.requests = SimpleNamespace(kv_cache_usage=0.125)
    monkeypatch.setattr("attnprof.host.vllm.live_trace.TRACE_POLL_S", 0.01)
    return st


async def _gets(app: Any, *paths: str, key: str | None = KEY) -> list[Any]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        return list(await asyncio.gather(*(c.get(p, headers=headers) for p in paths)))


def test_trace_route_wants_the_key_and_bounds_steps_and_timeout(state: runtime.State) -> None:
    eng = TraceEngine()
    app = _app(eng, [KEY])
    (r,) = asyncio.run(_gets(app, "/attnprof/trace?steps=4", key=None))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    (r,) = asyncio.run(_gets(app, "/attnprof/trace?steps=4", key="wrong"))
    assert r.status_code == 401
    for q in ("steps=0", f"steps={MAX_STEPS + 1}", "steps=10000000000", "steps=x",
              "steps=4&timeout=0", "steps=4&timeout=301", "steps=4&timeout=nan"):
        (r,) = asyncio.run(_gets(app, f"/attnprof/trace?{q}"))
        assert r.status_code == 400, q
        assert "attnprof:" in r.json()["error"]
    assert eng.ops == []  # refused before any RPC


def test_trace_route_returns_n_steps_with_nested_layers_and_counters(state: runtime.State
                                                                     ) -> None:
    eng = TraceEngine(per_poll=2)
    app = _app(eng, [KEY])
    (r,) = asyncio.run(_gets(app, "/attnprof/trace?steps=5&timeout=10"))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert check_trace(doc) == []
    info = doc["otherData"]["attnprof"]
    assert info["steps_per_worker"] == {"4242": 5} and info["complete"]
    assert not info["timed_out"] and info["model"] == "tiny"
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) == 5 and all(e["pid"] == 4242 for e in steps)
    assert sum(e.get("cat") == "attention" for e in doc["traceEvents"]) == 10
    kv = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "KV cache usage"]
    assert kv and kv[0]["args"] == {"usage": 0.125}
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert any(n.startswith("VllmWorker-0") for n in names) and "vLLM API server" in names
    assert eng.ops[0] == "arm" and eng.ops[-1] == "take"


def test_a_client_that_goes_away_frees_the_workers_and_the_slot(state: runtime.State
                                                                 ) -> None:
    eng = TraceEngine(per_poll=0, delay=0.0)  # the steps never come
    trace = LiveTrace(eng)
    polls = [0]

    async def gone() -> bool:
        polls[0] += 1
        return polls[0] >= 3

    body = asyncio.run(trace.record(5, timeout=60.0, rpc_timeout=30.0, max_bytes=1 << 20,
                                    gone=gone))
    assert body == [] and trace.abandoned == 1
    assert eng.ops[0] == "arm" and eng.ops[-1] == "drop"  # the records were freed at once
    assert not trace.busy  # the next trace is not refused with 409


@pytest.mark.slow
def test_trace_route_times_out_with_what_it_has_and_a_second_trace_gets_409(
        state: runtime.State) -> None:
    eng = TraceEngine(per_poll=0, delay=0.01)  # the steps never come
    app = _app(eng, [KEY])
    first, second = asyncio.run(_gets(app, "/attnprof/trace?steps=3&timeout=0.3",
                                      "/attnprof/trace?steps=3&timeout=0.3"))
    codes = sorted((first.status_code, second.status_code))
    assert codes == [200, 409]
    ok, busy = (first, second) if first.status_code == 200 else (second, first)
    info = ok.json()["otherData"]["attnprof"]
    assert info["timed_out"] and not info["complete"]
    assert eng.ops.count("arm") == 1
    # The 409 says how long the running trace may still take: its timeout plus the RPC
    # waits for its pages and render (0.3 + 3 x the RPC timeout), as a number and Retry-After.
    wait = busy.json()["retry_after_s"]
    assert 3 * state.config.rpc_timeout_s - 10 < wait <= 0.3 + 3 * state.config.rpc_timeout_s
    assert f"retry in {wait:.1f} s" in busy.json()["error"]
    assert busy.headers["retry-after"] == str(math.ceil(wait))


def test_trace_route_when_disabled_or_tripped(state: runtime.State,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    eng = TraceEngine()
    app = _app(eng, [KEY])
    monkeypatch.setattr(runtime, "STATE", runtime.State(config=Config(enabled=False)))
    (r,) = asyncio.run(_gets(app, "/attnprof/trace?steps=2"))
    assert r.status_code == 200 and r.json()["otherData"]["attnprof"]["enabled"] is False
    st = runtime.State(config=Config(enabled=True))
    st.errors.tripped.add("endpoint")
    monkeypatch.setattr(runtime, "STATE", st)
    (r,) = asyncio.run(_gets(app, "/attnprof/trace?steps=2"))
    assert r.status_code == 503
    assert eng.ops == []


def test_cli_trace_writes_the_trace(state: runtime.State, tmp_path: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from attnprof.cli import main
    from attnprof.tools import http

    app = _app(TraceEngine(), [KEY])
    seen: dict[str, Any] = {}

    def fake_get(url: str, **kw: Any) -> bytes:
        seen["url"], seen["key"] = url, kw.get("api_key")
        path = url.split("http://127.0.0.1:9", 1)[1]
        (r,) = asyncio.run(_gets(app, path))
        if r.status_code != 200:
            raise http.HttpError(f"{url}: HTTP {r.status_code}", status=r.status_code)
        return bytes(r.content)

    monkeypatch.setattr(http, "get", fake_get)
    out = tmp_path / "t" / "trace.json"
    rc = main(["trace", "--url", "http://127.0.0.1:9", "--steps", "3", "--api-key", KEY,
               "--out", str(out)])
    assert rc == 0 and seen["key"] == KEY and "steps=3" in seen["url"]
    assert check_trace(json.loads(out.read_text())) == []
    assert main(["trace", "--url", "http://127.0.0.1:9", "--steps", "0"]) == 2


# ----- OTLP spans -----
def test_spans_config_is_off_by_default_and_checked_at_start_up() -> None:
    from attnprof.exporters.otlp import otlp_config_from_env

    assert Config.from_env({}).otlp_spans is False
    with pytest.raises(ConfigError, match="ATTNPROF_OTLP_SPANS"):
        Config.from_env({"ATTNPROF_OTLP_SPANS": "maybe"})
    with pytest.raises(ConfigError, match="ATTNPROF_OTLP_SPANS=1 needs an OTLP endpoint"):
        otlp_config_from_env({"ATTNPROF_OTLP_SPANS": "1"})
    cfg = otlp_config_from_env({"ATTNPROF_OTLP_SPANS": "1",
                                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"})
    assert cfg is not None and cfg.spans and cfg.traces_endpoint == "http://c:4318/v1/traces"
    cfg = otlp_config_from_env({"ATTNPROF_OTLP_SPANS": "1",
                                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert cfg is not None and (cfg.traces_endpoint, cfg.traces_protocol) == ("http://c:4317",
                                                                              "grpc")
    off = otlp_config_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert off is not None and not off.spans


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_span_sink_sends_steps_with_layer_children(protocol: str) -> None:
    from attnprof.exporters.otlp import OtlpSpanSink, otlp_config_from_env
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver(protocol=protocol) as rx:
        cfg = otlp_config_from_env({"ATTNPROF_OTLP_SPANS": "1",
                                    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.endpoint,
                                    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": protocol})
        assert cfg is not None
        queue = [_step(1_700_000_000_000_000_000, layers=3)]
        sink = OtlpSpanSink(cfg, "worker", take=lambda: [queue.pop()] if queue else [],
                            model=lambda: "tiny")
        sink.export([])  # main thread: left queued (a snapshot RPC's flush)
        assert queue and sink.spans == 0
        t = threading.Thread(target=sink.export, args=([],))  # the export thread
        t.start()
        t.join()
        assert sink.force_flush(30.0)
        spans = rx.wait_for_spans(lambda s: len(s) >= 4)
        sink.shutdown()
    (step,) = [sp for _, sp in spans if sp.name == "attnprof.step"]
    kids = [sp for _, sp in spans if sp.name == "attnprof.attention"]
    assert len(kids) == 3 and all(k.parent_span_id == step.span_id for k in kids)
    assert all(k.trace_id == step.trace_id for k in kids)
    assert step.start_time_unix_nano == 1_700_000_000_000_000_000
    assert step.end_time_unix_nano - step.start_time_unix_nano == 1000
    for k in kids:
        assert step.start_time_unix_nano <= k.start_time_unix_nano
        assert k.end_time_unix_nano <= step.end_time_unix_nano
    attrs = {a.key for a in kids[0].attributes}
    assert {"attnprof.layer", "attnprof.backend", "attnprof.kernel", "attnprof.phase",
            "attnprof.tokens", "attnprof.max_seq_len"} <= attrs
    assert not any("prompt" in a or "token_id" in a or "request_id" in a for a in attrs)
    res = spans[0][0]
    assert res["attnprof.process.role"] == "worker"


# ----- the offline profile's trace: the same writer over the transformers capture -----
def test_profile_trace_nests_each_layer_call_inside_its_forward(tmp_path: Any) -> None:
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnprof.capture.transformers import instrument
    from attnprof.tools.profile_trace import Forward, write_trace

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")).eval()
    prof = instrument(model, max_records=None)
    forwards = []
    for L in (8, 16):
        f0, s0 = len(prof.records), time.perf_counter_ns()
        with torch.no_grad():
            model(input_ids=torch.randint(0, 64, (1, L)))
        forwards.append(Forward(f"forward L={L}", s0, time.perf_counter_ns(), f0,
                                 len(prof.records)))
    prof.uninstrument()
    out = tmp_path / "trace.json"
    write_trace(out, prof.records, forwards, "tiny")
    doc = json.loads(out.read_text())
    assert check_trace(doc) == []
    tracks = _x_by_track(doc)
    (events,) = tracks.values()
    fwd = [e for e in events if e["cat"] == "step"]
    assert [e["name"] for e in fwd] == ["forward L=8", "forward L=16"]
    for f in fwd:
        kids = [e for e in events if e["cat"] == "attention" and f["ts"] <= e["ts"]
                and e["ts"] + e["dur"] <= f["ts"] + f["dur"]]
        assert [k["name"] for k in kids] == [f"attn::L{i}::sdpa" for i in range(3)]
        assert kids[0]["args"]["max_seq_len"] == int(f["name"].split("=")[1])


@pytest.mark.slow
def test_a_refusing_collector_is_counted_never_raised() -> None:
    from attnprof.exporters.otlp import OtlpSpanSink, otlp_config_from_env
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver(mode="refusing") as rx:
        cfg = otlp_config_from_env({"ATTNPROF_OTLP_SPANS": "1",
                                    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.endpoint,
                                    "OTEL_METRIC_EXPORT_TIMEOUT": "1000"})
        assert cfg is not None
        errors: list[str] = []
        sink = OtlpSpanSink(cfg, "worker", take=lambda: [_step(1_000_000, layers=2)],
                            on_error=lambda place, exc: errors.append(place))
        t = threading.Thread(target=sink.export, args=([],))
        t.start()
        t.join()
        assert not sink.force_flush(5.0) or sink.failures >= 1
        sink.shutdown()
    assert sink.failures >= 1 and set(errors) == {"export_otlp_spans"}


def test_an_engine_failing_the_rpc_is_reported_not_a_breaker(state: runtime.State) -> None:
    class Broken:
        async def collective_rpc(self, method: str, timeout: float | None = None,
                                 args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
            raise RuntimeError("engine core died")

    app = _app(Broken(), [KEY])
    (r,) = asyncio.run(_gets(app, "/attnprof/trace?steps=2"))
    assert r.status_code == 200
    doc = r.json()
    info = doc["otherData"]["attnprof"]
    assert info["workers_armed"] == 0 and not info["complete"]
    assert info["errors"] == ["RuntimeError: engine core died"]
    assert check_trace(doc) == []
    assert state.errors.by_place.get("trace_rpc") == 1 and "endpoint" not in state.errors.by_place


def test_trace_pages_merge_per_worker_and_trim_to_the_bound() -> None:
    """Pages of two workers merge into one answer each (errors aside, strangers dropped);
    past the bound the largest answer loses its last steps, never its first."""
    from attnprof.aggregate.trace import TracePages

    def step(n: int) -> dict[str, Any]:
        return {"layers": n}

    pages = TracePages({1, 2})
    assert pages.add([{"pid": 1, "steps": [step(3), step(3)], "more": True},
                      {"pid": 2, "steps": [step(2)]}, {"pid": 9, "steps": [step(50)]},
                      {"error": "TimeoutError"}])
    assert not pages.add([{"pid": 1, "steps": [step(3)], "truncated": True}])
    assert pages.total == 11
    assert not pages.trim(11)
    assert pages.trim(6)
    got = pages.answers()
    assert [(a.get("pid"), len(a.get("steps", []))) for a in got] == [(1, 1), (2, 1), (None, 0)]
    assert got[0]["truncated"] and got[2] == {"error": "TimeoutError"}
