"""The /attnprof/* routes tried as an attacker would, on a real FastAPI app over fake engines:
the sampling switch (one in flight, one a second, bounded body, every bad body a 400 with
one line, timeouts that never trip the read-only routes' breaker) and the live trace (the
key as for the sampling switch, ranges bounded per worker and in all, taken in pages, a
second trace told how long to wait)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnprof.aggregate.trace import LayerRange, StepTrace, TraceBuffer
from attnprof.config import Config
from attnprof.exporters.chrome_trace import check_trace
from attnprof.host.vllm import endpoint, live_trace, runtime
from attnprof.host.vllm.endpoint import SAMPLING_MAX_BODY, sampling_body
from tests.unit.host.test_endpoint import FakeEngine, _app, serving_state

KEY = "hardening-key"


@pytest.fixture()
def state(monkeypatch: pytest.MonkeyPatch) -> runtime.State:
    monkeypatch.setattr(live_trace, "TRACE_POLL_S", 0.01)
    return serving_state(monkeypatch, snapshot_max_age_s=60.0)  # RPC timeout 30 s


async def _requests(app: Any, *reqs: tuple[str, str, Any], key: str | None = KEY,
                    concurrent: bool = False) -> list[Any]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        def one(method: str, path: str, body: Any) -> Any:
            if isinstance(body, (bytes, str)):
                return c.request(method, path, headers=headers, content=body)
            return c.request(method, path, headers=headers, json=body)

        if concurrent:
            return list(await asyncio.gather(*(one(*r) for r in reqs)))
        return [await one(*r) for r in reqs]


# ----------------------------------------------------------------- the sampling body
BAD_BODIES: list[tuple[bytes, str]] = [
    (b"", "a JSON object"),
    (b"not json", "a JSON object"),
    (b"\xff\xfe", "UTF-8"),
    (b"[0.5]", "a JSON object"),
    (b"0.5", "a JSON object"),
    (b"null", "a JSON object"),
    (b"{}", "at least one of"),
    (b'{"sample_rate": true}', "got True"),
    (b'{"sample_rate": false}', "got False"),
    (b'{"sample_rate": NaN}', "NaN is not a number"),
    (b'{"sample_rate": Infinity}', "Infinity is not a number"),
    (b'{"head_stats_rate": -Infinity}', "-Infinity is not a number"),
    (b'{"sample_rate": 1e999}', "got inf"),
    (b'{"sample_rate": -0.1}', "got -0.1"),
    (b'{"sample_rate": 1.0000001}', "got 1.0000001"),
    (b'{"sample_rate": 2}', "got 2"),
    (b'{"sample_rate": ' + b"9" * 400 + b"}", "got 999"),
    (b'{"sample_rate": "0.5"}', "got str"),
    (b'{"sample_rate": null}', "got None"),
    (b'{"sample_rate": [0.5]}', "got list"),
    (b'{"sample_rate": {"v": 0.5}}', "got dict"),
    (b'{"sample_rate": 0.5, "sample_rate": 0.1}', "given twice"),
    (b'{"sample_rate": 0.5, "extra": 1}', "unknown key"),
    (b'{"rate": 0.5}', "unknown key"),
    (b'{"sample_rate": 0.5, "__proto__": {}}', "unknown key"),
    (b"[" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize(("raw", "says"), BAD_BODIES, ids=[r[:24].decode("latin-1")
                                                            for r, _ in BAD_BODIES])
def test_every_bad_sampling_body_is_one_line(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError) as err:
        sampling_body(raw)
    msg = str(err.value)
    assert says in msg and "\n" not in msg and len(msg) < 200


def test_good_sampling_bodies() -> None:
    assert sampling_body(b'{"sample_rate": 0.5}') == (0.5, None)
    assert sampling_body(b'{"head_stats_rate": 0}') == (None, 0.0)
    assert sampling_body(b'{"sample_rate": 1, "head_stats_rate": 0.25}') == (1.0, 0.25)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
                    | st.integers() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.sampled_from(["sample_rate", "head_stats_rate", "x"]),
                                      kids, max_size=3), max_leaves=8))
def test_any_json_body_is_either_two_rates_in_range_or_one_line(doc: Any) -> None:
    raw = json.dumps(doc).encode()
    try:
        rate, hs = sampling_body(raw)
    except ValueError as err:
        assert "\n" not in str(err) and str(err)
        return
    assert isinstance(doc, dict) and set(doc) <= {"sample_rate", "head_stats_rate"} and doc
    for v in (rate, hs):
        assert v is None or (isinstance(v, float) and 0.0 <= v <= 1.0)


# ----------------------------------------------------------------- the sampling route
class SlowEngine(FakeEngine):
    """Answers the sampling switch after ``delay`` seconds (or never: a hung engine)."""


@pytest.mark.slow
def test_switches_are_one_in_flight_and_one_a_second(state: runtime.State,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    eng = FakeEngine(delay=0.2)
    app = _app(eng, [KEY])
    body = {"sample_rate": 0.5}
    # Five at once: one reaches the engine, the others are told to wait.
    got = asyncio.run(_requests(app, *[("POST", "/attnprof/sampling", body)] * 5,
                                concurrent=True))
    codes = sorted(r.status_code for r in got)
    assert codes == [200, 429, 429, 429, 429]
    assert eng.max_in_flight == 1 and len(eng.calls) == 1
    late = [r for r in got if r.status_code == 429]
    assert all(0 < r.json()["retry_after_s"] <= 1.0 and r.headers["retry-after"] == "1"
               for r in late)
    # Right after it: still inside the second.
    (again,) = asyncio.run(_requests(app, ("POST", "/attnprof/sampling", body)))
    assert again.status_code == 429 and len(eng.calls) == 1
    # A second later the next switch goes through.
    app.state.plugin.gate._last -= 1.0
    (later,) = asyncio.run(_requests(app, ("POST", "/attnprof/sampling", body)))
    assert later.status_code == 200 and len(eng.calls) == 2


def test_bad_bodies_do_not_use_up_the_switch_or_reach_the_engine(state: runtime.State) -> None:
    eng = FakeEngine()
    app = _app(eng, [KEY])
    bad = [("POST", "/attnprof/sampling", raw) for raw, _ in BAD_BODIES]
    got = asyncio.run(_requests(app, *bad, ("POST", "/attnprof/sampling", {"sample_rate": 0.1})))
    # (the deeply nested one is also over the size bound: 413, before it is parsed)
    assert [r.status_code for r in got[:-1]] == [
        413 if len(raw) > SAMPLING_MAX_BODY else 400 for raw, _ in BAD_BODIES]
    assert all(r.json()["error"].startswith("attnprof: ") for r in got[:-1])
    assert got[-1].status_code == 200 and eng.calls == [("attnprof_set_sampling", (0.1, None))]


def test_a_body_over_the_bound_is_refused_without_buffering_it(state: runtime.State) -> None:
    eng = FakeEngine()
    app = _app(eng, [KEY])
    pad = b'{"sample_rate": 0.5' + b" " * SAMPLING_MAX_BODY + b"}"
    got = asyncio.run(_requests(app, ("POST", "/attnprof/sampling", pad)))
    assert got[0].status_code == 413 and eng.calls == []

    # Streamed without a Content-Length: refused as soon as the bound is passed.
    async def chunked() -> Any:
        import httpx

        sent = [0]

        async def body() -> Any:
            for _ in range(1000):
                sent[0] += 1
                yield b" " * 512

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            r = await c.post("/attnprof/sampling", content=body(),
                             headers={"Authorization": f"Bearer {KEY}"})
        return r, sent[0]

    r, sent = asyncio.run(chunked())
    assert r.status_code == 413 and eng.calls == []
    assert sent < 10  # refused after the bound, not after the 512 kB the client had


def test_unauthenticated_and_unkeyed_switches_never_touch_the_limit(state: runtime.State
                                                                    ) -> None:
    eng = FakeEngine()
    app = _app(eng, [KEY])
    flood = [("POST", "/attnprof/sampling", {"sample_rate": 0.5})] * 20
    got = asyncio.run(_requests(app, *flood, key="wrong"))
    assert {r.status_code for r in got} == {401}
    (ok,) = asyncio.run(_requests(app, ("POST", "/attnprof/sampling", {"sample_rate": 0.5})))
    assert ok.status_code == 200  # the attacker's 401s did not take the operator's second
    no_key = _app(FakeEngine(), [])
    (r,) = asyncio.run(_requests(no_key, ("POST", "/attnprof/sampling", {"sample_rate": 0.5}),
                                 key=None))
    assert r.status_code == 403


@pytest.mark.slow
def test_a_flood_of_timed_out_switches_never_trips_the_read_only_routes(
        state: runtime.State) -> None:
    from attnprof._safety import ErrorBook

    state.errors = ErrorBook(max_errors=3)
    state.config = dataclasses.replace(state.config, rpc_timeout_s=0.5)
    eng = FakeEngine(delay=5.0)  # the workers never answer within ATTNPROF_RPC_TIMEOUT_S
    app = _app(eng, [KEY])
    plugin = app.state.plugin
    codes = []
    for _ in range(6):
        plugin.gate._last = -math.inf  # every switch allowed: the worst case for a breaker
        (r,) = asyncio.run(_requests(app, ("POST", "/attnprof/sampling", {"sample_rate": 1})))
        codes.append(r.status_code)
    assert codes == [504] * 6
    assert state.errors.by_place["sampling_timeout"] == 6
    assert not state.errors.is_off("endpoint")
    fast = _app(FakeEngine(), [KEY])
    fast.state.plugin.view.engine_client = FakeEngine()
    (snap,) = asyncio.run(_requests(fast, ("GET", "/attnprof/snapshot", None)))
    assert snap.status_code == 200


# ----------------------------------------------------------------- the live trace
def test_trace_needs_a_configured_key_unless_opened(state: runtime.State,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.host.test_trace import TraceEngine

    eng = TraceEngine()
    app = _app(eng, [])  # no key anywhere
    (r,) = asyncio.run(_requests(app, ("GET", "/attnprof/trace?steps=2", None), key=None))
    assert r.status_code == 403 and "ATTNPROF_TRACE_OPEN" in r.json()["error"]
    assert eng.ops == []
    monkeypatch.setattr(state, "config", Config(enabled=True, rpc_timeout_s=30.0,
                                                advice_interval_s=0.0, trace_open=True))
    (r,) = asyncio.run(_requests(app, ("GET", "/attnprof/trace?steps=2", None), key=None))
    assert r.status_code == 200 and check_trace(r.json()) == []
    # With a key configured, ATTNPROF_TRACE_OPEN opens nothing: the key is required.
    keyed = _app(TraceEngine(), [KEY])
    (r,) = asyncio.run(_requests(keyed, ("GET", "/attnprof/trace?steps=2", None), key=None))
    assert r.status_code == 401


def _steps(n: int, layers: int, t0: int = 1_700_000_000_000_000_000) -> list[StepTrace]:
    return [StepTrace(t0 + k * 10_000_000, 9_000_000, "decode", "sampled", 1.0, 8, 8, 64, 32.0,
                      [LayerRange(i, "CPU_ATTN", "k", 1000 + i * 10_000, 9_000, "decode", 8, 8,
                                  64, 32.0) for i in range(layers)]) for k in range(n)]


class Workers:
    """``collective_rpc("attnprof_trace")`` over real :class:`TraceBuffer`s, one per worker,
    answering each op as a worker does; every step is available at once."""

    def __init__(self, n: int, steps: int, layers: int) -> None:
        self.buffers = [TraceBuffer() for _ in range(n)]
        self.steps, self.layers = steps, layers
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.page_ranges: list[int] = []

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        op, trace_id, *rest = args
        self.calls.append((op, tuple(rest)))
        out = []
        for pid, buf in enumerate(self.buffers, start=100):
            if op == "arm":
                buf.arm(rest[0], rest[1], trace_id, rest[2])
                for s in _steps(self.steps, self.layers):
                    if buf.wanted:
                        buf.add(s)
                out.append({"pid": pid, "armed": True, "rank": {"tp_rank": pid - 100}})
            elif op == "count":
                out.append({"pid": pid, "steps": buf.count(trace_id),
                            "recording": buf.recording})
            elif op == "take":
                got, truncated, more = buf.take(trace_id, rest[2])
                n = sum(len(s.layers) for s in got)
                self.page_ranges.append(n)
                out.append({"pid": pid, "rank": {"tp_rank": pid - 100}, "more": more,
                            "truncated": truncated, "steps": [s.to_json() for s in got]})
            elif op == "drop":
                buf.take(trace_id)
                out.append({"pid": pid, "dropped": True})
        return out


@pytest.mark.slow
def test_trace_ranges_are_bounded_per_worker_and_in_all_and_taken_in_pages(
        state: runtime.State, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_trace, "TRACE_PAGE_RANGES", 500)
    monkeypatch.setattr(state, "config", Config(
        enabled=True, rpc_timeout_s=30.0, advice_interval_s=0.0, trace_max_ranges=6000,
        trace_max_ranges_per_worker=2400))
    eng = Workers(n=4, steps=1000, layers=80)
    app = _app(eng, [KEY])
    (r,) = asyncio.run(_requests(app, ("GET", "/attnprof/trace?steps=1000&timeout=5", None)))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert check_trace(doc) == []
    info = doc["otherData"]["attnprof"]
    arm = next(a for op, a in eng.calls if op == "arm")
    assert arm[2] == 2400  # each worker's own bound
    # Each worker kept 2400 ranges (30 steps of 80 layers) and said it stopped early.
    ranges = sum(e.get("cat") == "attention" for e in doc["traceEvents"])
    assert ranges <= 6000 and ranges > 6000 - 4 * 80
    assert "ATTNPROF_TRACE_MAX_RANGES=6000" in info["truncated"]
    # Pages: no worker answered more than a page's worth (whole steps of 80 layers).
    assert max(eng.page_ranges) <= 500 and info["pages"] > 1
    assert eng.calls[-1][0] == "drop"  # what was left over is freed in the workers
    assert not app.state.plugin.trace.busy


def test_a_worker_at_its_bound_stops_recording_and_says_so() -> None:
    buf = TraceBuffer()
    buf.arm(100, 60.0, "t", max_ranges=10)
    for s in _steps(5, 4):
        if buf.wanted:
            buf.add(s)
    assert buf.count("t") == 2 and not buf.recording and buf.truncated
    page, truncated, more = buf.take("t", 4)
    assert len(page) == 1 and truncated and more
    page, truncated, more = buf.take("t", 4)
    assert len(page) == 1 and not more and buf.count() == 0  # forgotten once taken


@pytest.mark.slow
def test_the_default_bounds_keep_an_80_layer_8_rank_trace_under_64_mb() -> None:
    """At the default ATTNPROF_TRACE_MAX_RANGES, a trace of an 80-layer model on 8
    tensor-parallel ranks with the largest realistic values in every field stays under the
    64 MB the issue sets (and under the default ATTNPROF_SNAPSHOT_MAX_BYTES, so nothing is
    cut for size)."""
    from attnprof.exporters.chrome_trace import render_live_trace

    cfg = Config()
    per_rank = cfg.trace_max_ranges // 8
    t0 = 1_700_000_000_000_000_000
    steps = [StepTrace(t0 + k * 30_000_000, 25_000_000, "mixed", "sampled_long", 0.0123456789,
                       65536, 1024, 131072, 65432.17, [
                           LayerRange(i, "FLASHINFER", "flash_attn_varlen_func[FA3]+paged",
                                      100_000 + i * 300_000, 250_000, "mixed", 65536, 1024,
                                      131072, 65432.17) for i in range(80)]).to_json()
             for k in range(per_rank // 80)]
    taken = [{"pid": 4_000_000 + r, "process": f"VllmWorker TP{r}",
              "rank": {"tp_rank": r, "tp_size": 8}, "steps": steps} for r in range(8)]
    chunks = render_live_trace(taken, [(t0, 0.5)], {"model": "m" * 64, "requested_steps": 1000,
                                                    "api_pid": 1}, cfg.snapshot_max_bytes)
    size = sum(len(c) for c in chunks)
    doc = json.loads(b"".join(chunks))
    assert doc["otherData"]["attnprof"]["truncated"] is None  # nothing cut for size
    assert sum(e.get("cat") == "attention" for e in doc["traceEvents"]) == 8 * len(steps) * 80
    assert size < 64 * 2**20 and size <= cfg.snapshot_max_bytes
    # Streamed in pieces, none of them large (the JSON is written a few hundred kB at a time).
    from attnprof.contracts.jsonsafe import CHUNK_BYTES

    assert len(chunks) > 200 and max(len(c) for c in chunks) <= 2 * CHUNK_BYTES + 4096


def test_json_chunks_join_to_the_document_and_stay_small() -> None:
    from attnprof.contracts.jsonsafe import dumps, dumps_chunks

    doc = {"a": [{"x": i, "y": float("nan") if i == 5 else i / 3, "s": "é" * (i % 7)}
                 for i in range(20000)], "b": {"c": [1, 2, 3], "d": None}, "e": []}
    pieces = list(dumps_chunks(doc, target=4096))
    assert json.loads("".join(pieces)) == json.loads(dumps(doc))
    assert max(len(p) for p in pieces) <= 2 * 4096 + 200 and len(pieces) > 50


def test_endpoint_module_has_no_trace_code_left() -> None:
    # The route lives in endpoint, the recording in live_trace, the rendering in exporters.
    assert not hasattr(endpoint, "LiveTrace") or endpoint.LiveTrace is live_trace.LiveTrace


# ----------------------------------------------------------------- engine-side timeouts
class TimeoutSeen:
    """An engine client that answers every attnprof RPC and notes the timeout each carried
    to the engine (vLLM's executor would stop waiting for its workers after it, and its
    workers' late answer would become the next model step's output)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float | None]] = []

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        self.seen.append((method, timeout))
        return self.answer(method)

    @staticmethod
    def answer(method: str) -> list[Any]:
        if method == "attnprof_trace":
            return [{"pid": 1, "armed": True, "steps": 5, "recording": False, "more": False}]
        return [{"snapshot": {"pid": 1}, "head_stats": {"deltas": [], "pending": False},
                 "old": {}, "new": {}}]


def test_no_attnprof_rpc_hands_the_engine_a_timeout(state: runtime.State) -> None:
    """Issue 30, point 1: vLLM's MultiprocExecutor reads answers in order with no id, so an
    executor timeout kills the EngineCore when the answer comes late. Every route's RPC and
    the offline API pass none (the API server bounds its own wait instead)."""
    eng = TimeoutSeen()
    app = _app(eng, [KEY])
    asyncio.run(_requests(app, ("GET", "/attnprof/snapshot?head_stats=1", None),
                          ("POST", "/attnprof/sampling", {"sample_rate": 0.5}),
                          ("GET", "/attnprof/trace?steps=1&timeout=1", None)))
    methods = {m for m, _ in eng.seen}
    assert methods == {"attnprof_poll", "attnprof_set_sampling", "attnprof_trace"}
    assert {t for _, t in eng.seen} == {None}

    # Offline (a vllm.LLM's collective_rpc): no timeout either.
    import attnprof

    class Llm:
        def __init__(self) -> None:
            self.timeouts: list[float | None] = []

        def collective_rpc(self, method: str, timeout: float | None = None,
                           args: tuple[Any, ...] = ()) -> list[Any]:
            self.timeouts.append(timeout)
            return [{"old": {}, "new": {}}]

    llm = Llm()
    attnprof.set_sampling(0.5, llm=llm)
    assert llm.timeouts == [None]


def test_through_vllms_own_utility_path_the_executor_gets_no_timeout(
        state: runtime.State) -> None:
    """The same through what vLLM 0.32's API server really uses (``rpc_all``'s first
    branch): ``AsyncMPClient``'s utility call to each engine, its msgpack codec, and
    ``EngineCore``'s dispatch into ``collective_rpc(method, timeout, args, kwargs)``. Only the
    sockets and the executor are stood in: a reordered vLLM signature, or a timeout slipped
    into the utility call, lands in the executor's ``timeout`` here."""
    from vllm.v1.engine import UtilityOutput
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.engine.core_client import AsyncMPClient, _process_utility_output
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from attnprof.capture.vllm.deltas import host_id

    seen: list[tuple[bytes, str, float | None, tuple[Any, ...]]] = []

    def engine_core(identity: bytes) -> Any:
        class Executor:
            def collective_rpc(self, method: str, timeout: float | None = None,
                               args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
                seen.append((identity, method, timeout, tuple(args)))
                return TimeoutSeen.answer(method)

        core = object.__new__(EngineCore)
        core.model_executor = Executor()
        return core

    client = object.__new__(AsyncMPClient)
    client.core_engines = [b"\x00\x00", b"\x01\x00"]  # two data-parallel engines
    client.client_index = 0
    client.utility_results = {}
    client.encoder = MsgpackEncoder()
    decoder = MsgpackDecoder()
    client._ensure_output_queue_task = lambda: None

    async def send(message: tuple[Any, ...], engine: bytes) -> None:
        """What EngineCoreProc does with a UTILITY request, its output handed back."""
        _, call_id, name, args = decoder.decode(message[1:])
        method = getattr(engine_core(engine), name)
        out = UtilityOutput(call_id)
        EngineCoreProc._invoke_utility_method(
            name, lambda: method(*EngineCoreProc._convert_msgspec_args(method, args)), out,
            lambda o: asyncio.get_running_loop().call_soon(
                _process_utility_output, o, client.utility_results))

    client._send_input_message = send

    class Llm:
        engine_core = client

    app = _app(Llm(), [KEY])
    got = asyncio.run(_requests(app, ("GET", "/attnprof/snapshot?head_stats=1", None),
                                ("POST", "/attnprof/sampling", {"sample_rate": 0.5}),
                                ("GET", "/attnprof/trace?steps=1&timeout=1", None)))
    # (The trace's pages are not this stand-in's to answer: only its RPCs are checked.)
    assert [r.status_code for r in got[:2]] == [200, 200], [r.text for r in got]
    assert {m for _, m, _, _ in seen} == {"attnprof_poll", "attnprof_set_sampling",
                                          "attnprof_trace"}
    assert {t for _, _, t, _ in seen} == {None}
    for method in ("attnprof_poll", "attnprof_set_sampling"):  # every engine was asked
        assert sorted(e for e, m, _, _ in seen if m == method) == client.core_engines
    # The poll's arguments reach the worker method as it reads them (head statistics wanted,
    # the API server's host, no scale to carry yet); both engines' workers are folded.
    assert next(a for _, m, _, a in seen if m == "attnprof_poll") == (True, host_id(), None)
    assert len(got[0].json()["workers"]) == 2
