"""Issue 30, point 3, through the real pieces: two tensor-parallel ranks' captures with the
file channel switched off (``ATTNPROF_RANK_SYNC=rpc``), their real ``attnprof_poll`` worker
methods, and the API server's real :class:`LiveView` polling them. The only stand-in is the
engine client, which delivers each poll to both workers between the same two steps (what
vLLM's executor does with a collective RPC)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from attnprof.capture.vllm.hooks import Capture
from attnprof.capture.vllm.model_info import sync_ranks
from attnprof.capture.vllm.rank_sync import RpcRate
from attnprof.config import Config
from attnprof.host.vllm import runtime
from attnprof.host.vllm.live_view import LiveView
from attnprof.host.vllm.worker_rpc import worker_methods


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Workers:
    """``collective_rpc`` over the ranks' real worker methods, one after the other."""

    def __init__(self, methods: list[dict[str, Any]]) -> None:
        self.methods = methods
        self.polls = 0

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        assert timeout is None  # never handed to vLLM's executor
        self.polls += method == "attnprof_poll"
        return [m[method](None, *args) for m in self.methods]


def _rank(tp_rank: int, clock: Clock) -> Capture:
    cfg = Config(enabled=True, sample_rate=1.0, seed=3, overhead_budget=0.01,
                 long_prefill_rate=0.0, rank_sync="rpc")
    cap = Capture(runtime.State(config=cfg))
    cap.rank.update(tp_rank=tp_rank, tp_size=2)
    cap.sampler._clock = clock
    cap.sampler._window_start = cap.sampler._t0 = 0.0
    sync_ranks(cap, "instance", None)
    return cap


@pytest.fixture()
def api_state(monkeypatch: pytest.MonkeyPatch) -> runtime.State:
    st = runtime.State(config=Config(enabled=True, rpc_timeout_s=5.0, advice_interval_s=0.0))
    monkeypatch.setattr(runtime, "STATE", st)
    return st


def test_ranks_sample_alike_through_the_api_servers_poll(api_state: runtime.State) -> None:
    clocks = [Clock(), Clock()]
    caps = [_rank(0, clocks[0]), _rank(1, clocks[1])]
    assert [type(c.sampler.sync) for c in caps] == [RpcRate, RpcRate]
    assert [c.sampler.sync_role for c in caps] == ["leader", "follower"]
    engine = Workers([worker_methods(c, c.state) for c in caps])
    view = LiveView(engine)
    picks: list[list[int]] = [[], []]

    async def serve() -> None:
        for i in range(6000):
            if i % 200 == 0:  # a snapshot GET (or the advice loop): one poll
                await view.refresh(5.0, advice=False, head_stats=False)
            for k, cap in enumerate(caps):
                clocks[k].t += 0.01
                if cap.sampler.tick():
                    picks[k].append(i)
                    cap.sampler.charge((0.003 if i < 2500 else 0.0) * (1 + 5 * k))
        if view._sync_timer is not None:
            view._sync_timer.cancel()

    asyncio.run(serve())
    s0, s1 = (c.sampler for c in caps)
    assert engine.polls >= 30 and view.rate_sync  # the leader's scale was carried
    assert s0.throttles > 0 and list(s0.rate_changes) == list(s1.rate_changes)
    assert picks[0] == picks[1] and 0 < len(picks[0]) < 6000
    assert s0.decisions_digest == s1.decisions_digest
    # Each poll's answer says which rank leads and what it wants; the follower adds nothing.
    assert [w.sampler.sync for w in view.workers] == ["leader", "follower"]


def test_the_first_poll_comes_soon_after_start_up_not_at_the_advice_loops_round(
        api_state: runtime.State, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GET, ranks on the RPC channel would throttle only from the advice loop's
    first round (60 s): the API server polls once soon after start-up; a server whose ranks
    share the file (no ``rate_sync`` in the answers) is polled no more."""
    import attnprof.host.vllm.live_view as lv

    monkeypatch.setattr(lv, "RATE_SYNC_IDLE_S", 0.01)
    monkeypatch.setattr(lv, "RATE_SYNC_PENDING_S", 0.01)
    on_rpc = [_rank(0, Clock()), _rank(1, Clock())]
    file_cfg = Config(enabled=True, sample_rate=1.0, seed=3)
    on_file = [Capture(runtime.State(config=file_cfg)) for _ in range(2)]

    async def run(caps: list[Capture], polls: int) -> tuple[Workers, LiveView]:
        engine = Workers([worker_methods(c, c.state) for c in caps])
        view = LiveView(engine)
        view.start_rate_sync()
        view.start_rate_sync()  # idempotent: one timer
        for _ in range(3000):  # until the polls came (a hang bound, not a speed check)
            if engine.polls >= polls:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # room for a poll that should not come
        if view._sync_timer is not None:
            view._sync_timer.cancel()
        return engine, view

    engine, view = asyncio.run(run(on_rpc, 2))
    assert engine.polls >= 2 and view.rate_sync  # the first poll, then the sync goes on
    engine, view = asyncio.run(run(on_file, 1))
    assert engine.polls == 1 and not view.rate_sync


def test_a_get_right_after_a_rate_sync_poll_still_catches_up(
        api_state: runtime.State) -> None:
    """On the RPC channel the API server polls every 1-5 s only to carry a scale; such a poll
    makes no catch-up pulls. A GET after it must still show the steps folded before it (what
    the catch-up exists for), not the sync poll's stale workers."""
    from attnprof.contracts.advice import AdviceUnavailable

    class Stale:
        calls = 0

        async def collective_rpc(self, method: str, timeout: float | None = None,
                                 args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
            self.calls += 1
            return [{"snapshot": {"pid": 1}, "snapshot_stale": {"age_s": 1e9},
                     "rate_sync": {"group": "0:0", "seq": 1, "scale": 0.5, "in_force": 1.0}}]

    async def go() -> int:
        eng = Stale()
        view = LiveView(eng)
        view.advice = AdviceUnavailable("the advice loop's")
        await view._sync_once()
        before = eng.calls
        await view.body(False, 2.0, 5.0, 1 << 20)  # a GET right after
        if view._sync_timer is not None:
            view._sync_timer.cancel()
        return eng.calls - before

    assert asyncio.run(go()) > 0  # the GET asked the workers again


def test_one_failed_rate_sync_poll_does_not_end_the_sync(
        api_state: runtime.State, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next sync poll was scheduled only from a poll's answers: one failed RPC ended the
    chain until a GET or an advice round came (never, with ATTNPROF_ADVICE_INTERVAL_S=0)."""
    import attnprof.host.vllm.live_view as lv

    monkeypatch.setattr(lv, "RATE_SYNC_IDLE_S", 0.01)
    monkeypatch.setattr(lv, "RATE_SYNC_PENDING_S", 0.01)

    class Flaky(Workers):
        async def collective_rpc(self, method: str, timeout: float | None = None,
                                 args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
            if self.polls == 1:  # the second poll fails
                self.polls += 1
                raise ConnectionError("engine busy restarting")
            return await super().collective_rpc(method, timeout, args, kwargs)

    async def run() -> Flaky:
        caps = [_rank(0, Clock()), _rank(1, Clock())]
        engine = Flaky([worker_methods(c, c.state) for c in caps])
        view = LiveView(engine)
        view.start_rate_sync()
        for _ in range(3000):  # a hang bound, not a speed check
            if engine.polls >= 4:
                break
            await asyncio.sleep(0.01)
        if view._sync_timer is not None:
            view._sync_timer.cancel()
        return engine

    assert asyncio.run(run()).polls >= 4  # polled again after the failure
