"""The /attnprof/* routes on a real FastAPI app with a fake engine client: authentication,
one RPC in flight, the cache, timeouts, bounded bodies, NaN-safe JSON, the sampling switch,
and head statistics merged from tensor-parallel ranks by global head index."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HeadStatsStrata
from attnprof.capture import head_rows
from attnprof.config import Config, ConfigError, api_tokens
from attnprof.contracts.snapshot import WorkerSnapshot
from attnprof.host.vllm import endpoint, runtime
from attnprof.host.vllm.endpoint import AttnProfEndpoint, TokenCheck
from attnprof.host.vllm.live_view import LiveView

KEY = "s3cret-token"


class FakeEngine:
    """``collective_rpc`` as vLLM's async client offers it, answering from a script."""

    def __init__(self, answers: list[dict[str, Any]] | None = None, delay: float = 0.0) -> None:
        self.answers = answers if answers is not None else [_answer()]
        self.delay = delay
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        self.calls.append((method, args))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if method == "attnprof_set_sampling":
                return [{"old": {}, "new": {"sample_rate": args[0]}}]
            return [dict(a) for a in self.answers]
        finally:
            self.in_flight -= 1


def _answer(pid: int = 11, delta: bytes | None = None, rank: dict[str, int] | None = None,
            **extra: Any) -> dict[str, Any]:
    """A worker's poll answer; ``delta`` travels inline (a worker on another machine)."""
    return {"snapshot": WorkerSnapshot(pid=pid, process="VllmWorker").to_json(),
            "rank": rank or {"tp_rank": 0, "tp_size": 1},
            "head_stats": {"deltas": [{"data": delta}] if delta else [], "pending": False},
            **extra}


def serving_state(monkeypatch: pytest.MonkeyPatch, **config: Any) -> runtime.State:
    """An enabled API server's state (model "tiny", the window advice computed on every
    snapshot, ``config`` on top) in place of ``runtime.STATE`` for the test: the host
    route tests' one set-up. The fake engines answer, so the RPC timeout is long (30 s): a
    busy box never turns a slow answer into a timeout; a hung-engine test sets a short one,
    well under its delay."""
    config.setdefault("rpc_timeout_s", 30.0)
    st = runtime.State(config=Config(enabled=True, advice_interval_s=0.0, **config))
    st.model_label = "tiny"
    monkeypatch.setattr(runtime, "STATE", st)
    return st


@pytest.fixture()
def state(monkeypatch: pytest.MonkeyPatch) -> runtime.State:
    return serving_state(monkeypatch, snapshot_max_age_s=60.0)


def _app(engine: Any, tokens: list[str]) -> Any:
    """The real FastAPI app with attnprof's routes over a fake engine (snapshot, sampling
    and trace routes all answer from ``engine``)."""
    from fastapi import FastAPI

    from attnprof.host.vllm.endpoint import LiveTrace

    app = FastAPI()
    plugin = AttnProfEndpoint()
    plugin.attach_router(app)
    plugin.view = LiveView(engine)
    plugin.trace = LiveTrace(engine)
    plugin.auth = TokenCheck(tokens)
    app.state.plugin = plugin
    return app


async def _get(app: Any, path: str, n: int = 1, key: str | None = KEY) -> list[Any]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        return list(await asyncio.gather(*(c.get(path, headers=headers) for _ in range(n))))


def test_every_route_wants_the_token_when_one_is_configured(state: runtime.State) -> None:
    app = _app(FakeEngine(), [KEY])

    async def go() -> None:
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            for path, method in (("/attnprof/snapshot", "GET"), ("/attnprof/sampling", "POST")):
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": f"Basic {KEY}"}):
                    r = await c.request(method, path, headers=headers, json={})
                    assert r.status_code == 401, (path, headers)
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert KEY not in r.text
            ok = await c.get("/attnprof/snapshot", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200 and ok.json()["model"] == "tiny"

    asyncio.run(go())
    assert [m for m, _ in app.state.plugin.view.engine_client.calls] == ["attnprof_poll"]


def test_tokens_come_from_vllms_api_key_or_attnprof_api_key() -> None:
    assert api_tokens({}, None) == []
    # Without ATTNPROF_API_KEY, vLLM's keys are the fallback (a start-up warning says so).
    assert api_tokens({"VLLM_API_KEY": "v"}, None) == ["v"]
    assert api_tokens({"VLLM_API_KEY": "v"}, ["a", "b"]) == ["a", "b"]  # the flag wins
    # ATTNPROF_API_KEY set: it alone opens the routes, whatever keys vLLM has.
    assert api_tokens({"ATTNPROF_API_KEY": "p"}, "a") == ["p"]
    assert api_tokens({"ATTNPROF_API_KEY": "p", "VLLM_API_KEY": "v"}, None) == ["p"]
    check = TokenCheck(api_tokens({"ATTNPROF_API_KEY": "p"}, ["a"]))
    assert check.ok("bearer p") and not check.ok("Bearer a") and not check.ok("Bearer ap")
    assert not check.ok(None) and TokenCheck([]).ok(None)
    # A key no bearer header can carry (a key file's newline) fails at start-up, one line.
    for bad in ("p\n", "p q", "p\x00", "clé"):
        with pytest.raises(ConfigError, match=r"^ATTNPROF_API_KEY holds") as err:
            api_tokens({"ATTNPROF_API_KEY": bad})
        assert "\n" not in str(err.value) and bad not in str(err.value)


TENANT = "tenant-inference-key"


def test_only_the_monitoring_key_opens_the_routes_when_it_is_set(state: runtime.State) -> None:
    """One tenant's inference key must not read another's lengths or start RPCs: with
    ATTNPROF_API_KEY set, vLLM's keys (flag or variable) get 401 on every route."""
    tokens = api_tokens({"ATTNPROF_API_KEY": KEY, "VLLM_API_KEY": "env-tenant"},
                        [TENANT, "other-tenant"])
    eng = FakeEngine()
    app = _app(eng, tokens)

    async def go() -> list[tuple[str, str, int]]:
        import httpx

        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            for key in (TENANT, "other-tenant", "env-tenant", KEY):
                for method, path in (("GET", "/attnprof/snapshot"),
                                     ("GET", "/attnprof/snapshot?head_stats=1"),
                                     ("GET", "/attnprof/trace?steps=1&timeout=0.1"),
                                     ("POST", "/attnprof/sampling")):
                    r = await c.request(method, path, json={"sample_rate": 0.5},
                                        headers={"Authorization": f"Bearer {key}"})
                    out.append((key, path, r.status_code))
                    assert TENANT not in r.text and KEY not in r.text
        return out

    got = asyncio.run(go())
    assert {code for key, _, code in got if key != KEY} == {401}
    assert all(code != 401 for key, _, code in got if key == KEY)
    assert ("attnprof_set_sampling", (0.5, None)) in eng.calls  # only the monitoring key's


@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", f"Basic {KEY}", f"Token {KEY}", f"ApiKey {KEY}", KEY,
    f"Bearer {KEY.upper()}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer x{KEY}",
    f"Bearer\t{KEY}", f"Bearer {KEY} {KEY}", f"Bearer {TENANT}",
])
def test_an_attacker_gets_401_without_the_exact_key(state: runtime.State,
                                                    header: str | None) -> None:
    """No key, an empty or other scheme, the key changed by one character or in case, the
    key without a scheme, a tenant's key: 401 on the snapshot, no RPC, the key never echoed."""
    eng = FakeEngine()
    app = _app(eng, api_tokens({"ATTNPROF_API_KEY": KEY}, [TENANT]))

    async def go() -> Any:
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            h = {} if header is None else {"Authorization": header}
            return await c.get(f"/attnprof/snapshot?api_key={KEY}&token={KEY}", headers=h)

    r = asyncio.run(go())
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text and eng.calls == []


def test_the_scheme_is_case_insensitive_and_spaces_around_the_key_are_ignored(
        state: runtime.State) -> None:
    check = TokenCheck([KEY])
    assert all(check.ok(h) for h in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}",
                                      f"Bearer  {KEY} "))


def test_every_configured_key_is_compared_in_constant_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check compares SHA-256 digests (one length whatever the key) with
    ``hmac.compare_digest``, against every configured key, with no early exit on a match or
    on a mismatch at the first key: a plain ``got == digest`` fails this test."""
    import hashlib
    import hmac

    seen: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return hmac.compare_digest(a, b)

    monkeypatch.setattr(endpoint, "compare_digest", spy)
    keys = ["k-one", "k-two", "k-three"]
    check = TokenCheck(keys)
    digests = [hashlib.sha256(k.encode()).digest() for k in keys]
    for header, want in (("Bearer k-one", True), ("Bearer k-three", True),
                         ("Bearer x-one", False), ("Bearer a-much-longer-wrong-key", False)):
        seen.clear()
        assert check.ok(header) is want
        assert [b for _, b in seen] == digests, header  # every key, in order, no early exit
        got = hashlib.sha256(header.split(" ", 1)[1].encode()).digest()
        assert all(a == got and len(a) == len(b) == 32 for a, b in seen)


def test_twenty_concurrent_gets_start_one_rpc_and_later_ones_hit_the_cache(
        state: runtime.State) -> None:
    eng = FakeEngine(delay=0.2)
    app = _app(eng, [KEY])
    rs = asyncio.run(_get(app, "/attnprof/snapshot", n=20))
    assert {r.status_code for r in rs} == {200}
    assert eng.max_in_flight == 1 and len(eng.calls) == 1
    assert len({r.content for r in rs}) == 1  # all from the one refresh
    asyncio.run(_get(app, "/attnprof/snapshot", n=5))
    assert len(eng.calls) == 1  # younger than ATTNPROF_SNAPSHOT_MAX_AGE_S: no RPC


def test_a_stale_cache_refreshes_once(state: runtime.State, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    monkeypatch.setattr(runtime, "STATE", runtime.State(config=Config(
        enabled=True, snapshot_max_age_s=0.0, rpc_timeout_s=30.0)))
    eng = FakeEngine()
    app = _app(eng, [])
    asyncio.run(_get(app, "/attnprof/snapshot", key=None))
    asyncio.run(_get(app, "/attnprof/snapshot", key=None))
    assert len(eng.calls) == 2


@pytest.mark.slow
def test_a_hung_engine_times_out_and_never_gets_a_second_rpc(state: runtime.State) -> None:
    state.config = dataclasses.replace(state.config, rpc_timeout_s=1.0)
    eng = FakeEngine(delay=5.0)  # far past ATTNPROF_RPC_TIMEOUT_S = 1
    app = _app(eng, [KEY])

    async def go() -> tuple[Any, Any]:
        first = (await _get(app, "/attnprof/snapshot"))[0]
        second = (await _get(app, "/attnprof/snapshot"))[0]
        return first, second

    first, second = asyncio.run(go())
    for r in (first, second):
        assert r.status_code == 200
        assert "TimeoutError" in r.json()["errors"]["collective_rpc"]
    assert len(eng.calls) == 1  # the second GET waited on the same RPC


def test_disabled_attnprof_answers_without_an_rpc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "STATE", runtime.State(config=Config(enabled=False)))
    eng = FakeEngine()
    (r,) = asyncio.run(_get(_app(eng, []), "/attnprof/snapshot", key=None))
    assert r.status_code == 200 and r.json()["enabled"] is False
    assert eng.calls == []


def test_nan_in_any_statistic_is_served_as_null(state: runtime.State) -> None:
    ws = WorkerSnapshot(pid=3).to_json()
    ws["sampler"]["self_time_fraction"] = math.nan
    ws["head_stats_cost"]["time_s"] = math.inf
    eng = FakeEngine([{"snapshot": ws}])
    (r,) = asyncio.run(_get(_app(eng, [KEY]), "/attnprof/snapshot"))
    assert r.status_code == 200
    body = json.loads(r.text)  # strict JSON: no NaN / Infinity tokens
    assert "NaN" not in r.text and "Infinity" not in r.text
    assert body["workers"][0]["sampler"]["self_time_fraction"] is None


def _acc_with_data(layers: int, kv: int, group: int, seed: int) -> HeadStatsAccumulator:
    acc = HeadStatsAccumulator(layers, kv, group, window_grid=(16, 32))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(64, kv * group, 8, generator=g)
    k = torch.randn(64, kv, 8, generator=g)
    for lay in range(layers):
        head_rows.update(acc, lay, q, k, 8 ** -0.5, q_start=0)
    return acc


@pytest.mark.slow
def test_tensor_parallel_ranks_merge_by_global_head_index(state: runtime.State) -> None:
    # 2 layers, 4 KV heads x 2 query heads in all, split over 2 TP ranks (2 KV heads each).
    r0, r1 = _acc_with_data(2, 2, 2, seed=1), _acc_with_data(2, 2, 2, seed=2)
    want0, want1 = r0.queries.copy(), r1.sink_sum.copy()
    ans = [_answer(11, r0.take_bytes(), {"tp_rank": 0, "tp_size": 2}, total_kv_heads=4),
           _answer(12, r1.take_bytes(), {"tp_rank": 1, "tp_size": 2}, total_kv_heads=4)]
    app = _app(FakeEngine(ans), [KEY])
    (r,) = asyncio.run(_get(app, "/attnprof/snapshot?head_stats=1"))
    merged = HeadStatsStrata.load(r.json()["head_stats"]).total()
    assert (merged.num_layers, merged.num_kv_heads, merged.group_size) == (2, 4, 2)
    assert np.array_equal(merged.queries[:, :4], want0)
    assert np.array_equal(merged.sink_sum[:, 4:], want1)  # rank 1's heads at offset 4
    assert np.array_equal(merged.requests, [1, 1])  # each prompt counted once, not per rank
    # Without ?head_stats=1 the body stays small.
    (plain,) = asyncio.run(_get(app, "/attnprof/snapshot"))
    assert plain.json()["head_stats"] is None and len(plain.content) < len(r.content)


def test_a_rank_whose_heads_do_not_fit_is_counted_not_merged(state: runtime.State) -> None:
    bad = _acc_with_data(2, 2, 2, seed=1).take_bytes()
    ans = [_answer(11, bad, {"tp_rank": 3, "tp_size": 2}, total_kv_heads=4)]  # offset 12 > 8
    asyncio.run(_get(_app(FakeEngine(ans), [KEY]), "/attnprof/snapshot?head_stats=1"))
    assert state.errors.by_place.get("snapshot_parse") == 1


def test_deltas_accumulate_across_refreshes(state: runtime.State,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "config", Config(enabled=True, snapshot_max_age_s=0.0))
    acc = _acc_with_data(1, 1, 2, seed=3)
    d1 = acc.take_bytes()
    acc2 = _acc_with_data(1, 1, 2, seed=4)
    d2 = acc2.take_bytes()
    eng = FakeEngine([_answer(1, d1)])
    app = _app(eng, [KEY])
    asyncio.run(_get(app, "/attnprof/snapshot"))
    eng.answers = [_answer(1, d2)]
    (r,) = asyncio.run(_get(app, "/attnprof/snapshot?head_stats=1"))
    merged = HeadStatsStrata.load(r.json()["head_stats"]).total()
    assert merged.requests[0] == 2 and merged.queries.sum() == 2 * 64 * 2


def test_data_parallel_engines_are_all_asked(state: runtime.State) -> None:
    class Core:  # vLLM's AsyncMPClient: one utility call per engine
        core_engines = [b"\x00\x00", b"\x01\x00"]

        async def _call_utility_async(self, method: str, *args: Any, engine: bytes
                                      ) -> list[Any]:
            assert (method, args[0]) == ("collective_rpc", "attnprof_poll")
            assert args[1] is None  # no timeout for vLLM's executor (issue 30, point 1)
            return [_answer(21 + self.core_engines.index(engine))]

    class Client:
        engine_core = Core()

    (r,) = asyncio.run(_get(_app(Client(), [KEY]), "/attnprof/snapshot"))
    assert sorted(w["pid"] for w in r.json()["workers"]) == [21, 22]
    assert "engine_rpc" not in state.errors.by_place

    class HalfDown(Core):  # one engine failing: the other's workers, the failure counted
        async def _call_utility_async(self, method: str, *args: Any, engine: bytes
                                      ) -> list[Any]:
            if engine == self.core_engines[1]:
                raise ConnectionError("engine 1 gone")
            return await super()._call_utility_async(method, *args, engine=engine)

    Client.engine_core = HalfDown()
    (r,) = asyncio.run(_get(_app(Client(), [KEY]), "/attnprof/snapshot"))
    assert [w["pid"] for w in r.json()["workers"]] == [21]
    assert state.errors.by_place["engine_rpc"] >= 1


def test_body_over_the_bound_drops_head_statistics_and_says_so(
        state: runtime.State, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "config", Config(enabled=True, snapshot_max_bytes=4096))
    delta = _acc_with_data(2, 2, 2, seed=1).take_bytes()
    (r,) = asyncio.run(_get(_app(FakeEngine([_answer(1, delta)]), [KEY]),
                            "/attnprof/snapshot?head_stats=1"))
    body = r.json()
    assert len(r.content) <= 4096 and body["head_stats"] is None
    assert "ATTNPROF_SNAPSHOT_MAX_BYTES=4096" in body["truncated"]


def test_sampling_switch_validates_and_reaches_every_worker(state: runtime.State) -> None:
    eng = FakeEngine()
    app = _app(eng, [KEY])

    async def go() -> list[Any]:
        import httpx

        h = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return [await c.post("/attnprof/sampling", headers=h, json=b)
                    for b in ({"sample_rate": 2}, {"sample_rate": "x"}, [1],
                              {"sample_rate": 0.5, "head_stats_rate": 0.0})]

    bad1, bad2, bad3, ok = asyncio.run(go())
    assert {bad1.status_code, bad2.status_code, bad3.status_code} == {400}
    assert ok.status_code == 200 and ok.json()["workers"][0]["new"]["sample_rate"] == 0.5
    assert eng.calls == [("attnprof_set_sampling", (0.5, 0.0))]


def test_tripped_endpoint_breaker_answers_503_without_an_rpc(state: runtime.State) -> None:
    from attnprof._safety import ErrorBook, set_faults

    state.errors = ErrorBook(max_errors=2)
    eng = FakeEngine()
    app = _app(eng, [KEY])
    set_faults(("endpoint",))
    try:
        codes = [r.status_code for r in asyncio.run(_get(app, "/attnprof/snapshot", n=1))
                 + asyncio.run(_get(app, "/attnprof/snapshot", n=1))
                 + asyncio.run(_get(app, "/attnprof/snapshot", n=1))]
    finally:
        set_faults(())
    assert codes == [500, 500, 503]
    assert state.errors.by_place["endpoint"] == 2 and state.errors.is_off("endpoint")
    assert eng.calls == []  # the fault fired before any RPC; the breaker stops them all


def test_endpoint_module_exports_the_contract_tag() -> None:
    assert endpoint.SCHEMA_VERSION.startswith("attnprof.snapshot/1.")


def test_piecewise_json_is_the_same_document_and_nan_safe() -> None:
    from attnprof.contracts.jsonsafe import dumps, dumps_yielding

    doc = {"a": [1, 2.5, math.nan] * 3000, "b": {"c": [{"x": math.inf}, [1, 2]], "d": "s"},
           "e": [], "f": (1, 2)}
    text = dumps_yielding(doc)
    assert json.loads(text) == json.loads(dumps(doc))
    assert "NaN" not in text and "Infinity" not in text


def test_a_truncated_answer_leaves_the_cached_workers_whole(state: runtime.State) -> None:
    from attnprof.contracts.snapshot import KernelGroup

    view = LiveView(None)
    ws = WorkerSnapshot(pid=5, kernel_map=[KernelGroup(layers=list(range(3000)), backend="X",
                                                       kernel="k" * 50, fused=True)])
    view.workers = [ws]
    small = json.loads(view._render(False, 0.0, None, max_bytes=4096))
    assert "per-layer data left out" in small["truncated"]
    assert small["workers"][0]["kernel_map"] == []
    full = json.loads(view._render(False, 0.0, None, max_bytes=1 << 20))
    assert full["truncated"] is None and len(full["workers"][0]["kernel_map"]) == 1


def test_plain_gets_leave_the_head_statistics_on_the_workers(
        state: runtime.State, monkeypatch: pytest.MonkeyPatch) -> None:
    from attnprof.contracts.advice import AdviceUnavailable

    # With the advice loop running, a plain GET neither recomputes advice nor pulls the
    # (large) head-statistics deltas; ?head_stats=1 does pull them.
    monkeypatch.setattr(state, "config", Config(enabled=True, snapshot_max_age_s=0.0,
                                                advice_interval_s=60.0))
    eng = FakeEngine()
    app = _app(eng, [KEY])
    app.state.plugin.view.advice = AdviceUnavailable("from the loop")
    asyncio.run(_get(app, "/attnprof/snapshot"))
    asyncio.run(_get(app, "/attnprof/snapshot?head_stats=1"))
    assert [(m, a[0]) for m, a in eng.calls] == [("attnprof_poll", False),
                                                  ("attnprof_poll", True)]


def test_the_sampling_switch_is_refused_when_no_key_is_configured(state: runtime.State) -> None:
    eng = FakeEngine()
    app = _app(eng, [])  # vLLM without --api-key, no ATTNPROF_API_KEY

    async def go() -> Any:
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.post("/attnprof/sampling", json={"sample_rate": 1.0})

    r = asyncio.run(go())
    assert r.status_code == 403 and "API key" in r.json()["error"]
    assert eng.calls == []


def test_only_the_first_of_several_api_servers_takes_head_statistics(
        state: runtime.State) -> None:
    class Core:
        client_index = 1  # vLLM's second API server

    eng = FakeEngine()
    eng.engine_core = Core()  # type: ignore[attr-defined]
    app = _app(eng, [KEY])
    (r,) = asyncio.run(_get(app, "/attnprof/snapshot?head_stats=1"))
    body = r.json()
    # deltas stay for API server 0
    assert [(m, a[0]) for m, a in eng.calls] == [("attnprof_poll", False)]
    assert body["head_stats"] is None and "first API server" in body["truncated"]
    assert "first API server" in body["window_advice"]["error"]


CANARY_LEN = 3777  # one request's exact context length: above every quantile, in no bucket name


def _canary_answer() -> dict[str, Any]:
    """A worker answer holding every kind of value the keyless snapshot must withhold."""
    from attnprof.contracts.snapshot import KernelGroup, LayerProfile, PhaseStats

    phase = PhaseStats(calls=4, time_s=0.5, mean_time_s=0.125, tokens=64, flops=10, bytes=20,
                       mean_batch_requests=1.0, mean_seq_len=3777.5, max_seq_len=CANARY_LEN,
                       recent_time_s=[0.0123456789])
    layer = LayerProfile(name="model.layers.0.self_attn.attn", index=0, backend="CPU_ATTN",
                         impl="CPUAttentionBackendImpl", num_heads=4, num_kv_heads=2,
                         head_size=8, head_size_v=8, sliding_window=None, dtype="float32",
                         kv_cache_dtype="auto", fused=True, kv_cache_bytes=4096,
                         phases={"prefill": phase})
    ws = WorkerSnapshot(pid=11, process="VllmWorker", layers=[layer],
                        kernel_map=[KernelGroup(layers=[0], backend="CPU_ATTN", kernel=None,
                                                fused=True, error="ValueError: /srv/tenant-a")],
                        error="RuntimeError: /home/tenant-b/secret.txt")
    return {**_answer(), "snapshot": ws.to_json()}


def test_without_a_key_the_snapshot_holds_only_what_metrics_shows(
        state: runtime.State, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed by default: with no key configured anywhere, anyone on the port gets the
    counters /metrics already shows and a line saying how to read the rest; never the exact
    request lengths, per-step lengths and timings, provenance (the command line), head
    statistics or error text. The same server with a key serves them all to its holder."""
    import sys

    import jsonschema

    from attnprof.aggregate.requests import RequestAggregates
    from attnprof.contracts.snapshot import Snapshot
    from attnprof.host.vllm import live_view
    from tests.conftest import REPO

    monkeypatch.setattr(live_view, "_PROVENANCE", {})
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "--served-model-name", "argv-canary"])
    reqs = RequestAggregates(max_model_len=4096)
    for n in range(100, 300):
        reqs.observe(n, 0)
    reqs.observe(CANARY_LEN, 0)
    state.requests = reqs
    withheld = (str(CANARY_LEN), "0.0123456789", "argv-canary", "/srv/tenant-a",
                "/home/tenant-b")

    def snap(tokens: list[str], path: str = "/attnprof/snapshot") -> Any:
        eng = FakeEngine([_canary_answer()])
        (r,) = asyncio.run(_get(_app(eng, tokens), path, key=tokens[0] if tokens else None))
        return r, eng

    full, _ = snap([KEY])
    assert all(w in full.text for w in withheld)  # the canaries are there to be withheld
    assert full.json()["restricted"] is None

    r, eng = snap([])
    assert r.status_code == 200
    body = r.json()
    assert [w for w in withheld if w in r.text] == []
    assert "ATTNPROF_API_KEY" in body["restricted"] and "/metrics" in body["restricted"]
    assert not {"provenance", "head_stats", "window"} & set(body)
    # Kept: what /metrics has (per-layer counters, request count and quantiles, histogram).
    (layer,) = body["workers"][0]["layers"]
    assert layer["backend"] == "CPU_ATTN" and layer["kv_cache_bytes"] == 4096
    assert layer["phases"]["prefill"]["calls"] == 4
    assert layer["phases"]["prefill"]["time_s"] == 0.5
    ctx = body["requests"]["context_tokens"]
    assert body["requests"]["requests"] == 201 and ctx["p99"] == 298
    assert "max" not in ctx and "sketch" not in ctx
    assert sum(body["requests"]["context_histogram"]["counts"]) == 201
    # Errors by type only.
    assert body["workers"][0]["error"] == "RuntimeError"
    assert body["workers"][0]["kernel_map"][0]["error"] == "ValueError"
    assert "withheld" in body["window_advice"]["error"]
    # Still a snapshot every reader takes, and the schema accepts it.
    typed = Snapshot.from_json(body)
    assert typed.restricted == body["restricted"] and typed.workers[0].layers[0].index == 0
    schema = json.loads((REPO / "docs/schema/snapshot.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(body)
    # The head statistics: 403 with the same hint, and no RPC pulls them.
    hs, eng = snap([], "/attnprof/snapshot?head_stats=1")
    assert hs.status_code == 403 and "ATTNPROF_API_KEY" in hs.json()["restricted"]
    assert eng.calls == []


def test_a_keyless_answer_is_cut_once_per_refresh(state: runtime.State) -> None:
    eng = FakeEngine([_canary_answer()])
    app = _app(eng, [])
    first = asyncio.run(_get(app, "/attnprof/snapshot", n=5, key=None))
    again = asyncio.run(_get(app, "/attnprof/snapshot", n=2, key=None))
    assert len({r.content for r in first + again}) == 1 and len(eng.calls) == 1
    from attnprof.host.vllm.endpoint import PUBLIC_NOTE

    cut = app.state.plugin.view._bodies[(False, PUBLIC_NOTE)]  # the keyless render
    asyncio.run(_get(app, "/attnprof/snapshot", key=None))
    assert app.state.plugin.view._bodies[(False, PUBLIC_NOTE)] is cut  # not cut again


def test_the_start_up_log_says_who_can_open_the_routes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Through the endpoint's real start-up (init_state): vLLM's keys as the fallback log a
    one-line warning that tenants' keys open attnprof's routes; ATTNPROF_API_KEY set, they
    are refused and nothing is logged; no key at all, one line says how to open the rest."""
    import logging
    from types import SimpleNamespace

    monkeypatch.delenv("ATTNPROF_ENABLED", raising=False)

    def start(env_key: str | None, vllm_keys: list[str] | None) -> AttnProfEndpoint:
        if env_key is None:
            monkeypatch.delenv("ATTNPROF_API_KEY", raising=False)
        else:
            monkeypatch.setenv("ATTNPROF_API_KEY", env_key)
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        caplog.clear()
        plugin = AttnProfEndpoint()
        with caplog.at_level(logging.INFO, logger="attnprof"):
            asyncio.run(plugin.init_state(None, None, SimpleNamespace(api_key=vllm_keys)))
        return plugin

    plugin = start(None, [TENANT])
    (warn,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "ATTNPROF_API_KEY is not set" in warn.message and "\n" not in warn.message
    assert TENANT not in caplog.text and plugin.auth.ok(f"Bearer {TENANT}")
    plugin = start(KEY, [TENANT])
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert plugin.auth.ok(f"Bearer {KEY}") and not plugin.auth.ok(f"Bearer {TENANT}")
    plugin = start(None, None)
    (info,) = caplog.records
    assert "ATTNPROF_API_KEY" in info.message and not plugin.auth.required
    # The monitoring key set to a tenant's inference key: the separation does not hold.
    plugin = start(TENANT, [TENANT, "other"])
    (warn,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "also one of vLLM's inference keys" in warn.message and TENANT not in caplog.text


def test_a_fifo_planted_in_the_run_dir_never_hangs_the_snapshot(tmp_path: Any) -> None:
    """The liveness notes are read in every snapshot render (a thread of the API server);
    a planted link is refused (_private_files), and so must a planted FIFO be: opened for
    reading, it blocks until someone writes, and every later render joins it."""
    import os
    import threading

    fifo = tmp_path / "worker-1.json"
    os.mkfifo(fifo)
    t = threading.Thread(target=runtime.processes_from_run_dir,
                         args=(Config(run_dir=tmp_path),), daemon=True)
    t.start()
    t.join(timeout=60)  # a hang detector, not a speed (the read takes microseconds)
    hung = t.is_alive()
    if hung:  # release the reader: a writer that opens and closes at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=60)
    assert not hung


def test_only_a_server_whose_ranks_may_span_nodes_polls_for_the_rate_sync(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first rate-sync poll starts every worker's snapshot thread; a one-node server
    (ranks on the file channel, ``auto``) is not polled, so a server nobody reads pays
    nothing. Through the endpoint's real start-up (init_state)."""
    from types import SimpleNamespace

    import attnprof.host.vllm.endpoint as ep

    monkeypatch.setattr(ep, "start", lambda cfg, otlp: None)  # no process-wide start here
    monkeypatch.setenv("ATTNPROF_ENABLED", "1")
    monkeypatch.setenv("ATTNPROF_ADVICE_INTERVAL_S", "0")
    monkeypatch.delenv("ATTNPROF_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    from vllm.config import ParallelConfig

    def polls(mode: str, nnodes: int) -> bool:
        monkeypatch.setenv("ATTNPROF_RANK_SYNC", mode)
        # The engine client's own parallel config (AsyncLLM.vllm_config), as vLLM builds it.
        pc = ParallelConfig(nnodes=nnodes, tensor_parallel_size=2,
                            distributed_executor_backend="mp")
        client = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=pc))

        async def go() -> bool:
            plugin = AttnProfEndpoint()
            await plugin.init_state(client, None, SimpleNamespace(api_key=None))
            timer = plugin.view._sync_timer
            if timer is not None:
                timer.cancel()
            return timer is not None

        return asyncio.run(go())

    assert [polls("auto", 1), polls("file", 4)] == [False, False]
    assert [polls("auto", 2), polls("rpc", 1)] == [True, True]
