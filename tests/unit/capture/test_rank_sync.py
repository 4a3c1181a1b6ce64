"""The tensor-parallel ranks' channel for the budget's scale, through a real file: the leader
announces ahead, a follower reads what it wrote, samplers on both sides then decide the same
steps; a stale file is replaced, and a file anyone else could write is not obeyed. Without
the file (ranks on other nodes), the RPC channel: the leader's scale rides the API server's
poll and every rank applies it at that RPC."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from attnprof.aggregate.sampler import StepSampler
from attnprof.capture.vllm.rank_sync import (
    LEAD_EPOCHS,
    SLOTS,
    RateChannel,
    RpcRate,
    carried_rates,
    channel_path,
    group_key,
    leader_answer,
    multi_node,
    take_carried,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_path_is_per_instance_and_group(tmp_path: Path) -> None:
    a = channel_path("inst-1", 0, 0, tmp_path)
    assert a.parent == tmp_path and a.name.startswith("attnprof-rate-")
    assert len({a, channel_path("inst-2", 0, 0, tmp_path), channel_path("inst-1", 1, 0, tmp_path),
                channel_path("inst-1", 0, 1, tmp_path)}) == 4


def test_leader_announces_ahead_and_the_follower_reads_it(tmp_path: Path) -> None:
    path = channel_path("i", 0, 0, tmp_path)
    follower = RateChannel(path, leader=False, epoch=64)
    assert follower(0, 1.0) == [] and follower.unread == 1  # no leader yet
    leader = RateChannel(path, leader=True, epoch=64)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == SLOTS * 32 == 256  # what SECURITY.md says it holds
    first = leader(64, 1.0)
    assert first == [(1, 64 + LEAD_EPOCHS * 64, 1.0)]
    got = leader(128, 0.25)
    assert got == [(2, 128 + LEAD_EPOCHS * 64, 0.25)]
    # Both announcements, oldest first: the follower missed the boundary of the first.
    assert follower(128, 1.0) == first + got
    assert leader(192, 0.25) == []  # unchanged: nothing new announced
    leader.close()
    assert not path.exists()


def test_samplers_over_the_file_decide_the_same_steps_while_throttled(tmp_path: Path) -> None:
    path = channel_path("j", 0, 0, tmp_path)
    clocks = [Clock(), Clock()]
    ranks = [StepSampler(1.0, budget=0.01, seed=3, clock=c) for c in clocks]
    ranks[0].sync, ranks[0].sync_role = RateChannel(path, True, 64), "leader"
    ranks[1].sync, ranks[1].sync_role = RateChannel(path, False, 64), "follower"
    picks: list[list[int]] = [[], []]
    for i in range(8000):
        for k, r in enumerate(ranks):
            clocks[k].t += 0.01
            if r.tick():
                picks[k].append(i)
                r.charge((0.003 if i < 3000 else 0.0) * (1 + 5 * k))
    assert picks[0] == picks[1] and len(picks[0]) < 8000
    assert ranks[0].throttles > 0 and list(ranks[0].rate_changes) == list(ranks[1].rate_changes)
    assert ranks[0].decisions_digest == ranks[1].decisions_digest
    assert ranks[1].late_changes == 0


def test_a_follower_that_reads_before_then_after_the_leader_misses_nothing(
        tmp_path: Path) -> None:
    """The follower reaches one boundary just before the leader and the next one just after
    it, while the leader changes its scale at both: the follower finds two new announcements
    at once, and both must reach it at their steps (a one-slot channel kept only the second,
    and the ranks sampled different steps between the two: CI's failure)."""
    path = channel_path("n", 0, 0, tmp_path)
    clocks = [Clock(), Clock()]
    ranks = [StepSampler(0.5, budget=0.01, seed=5, clock=c) for c in clocks]
    ranks[0].sync, ranks[0].sync_role = RateChannel(path, True, 64), "leader"
    ranks[1].sync, ranks[1].sync_role = RateChannel(path, False, 64), "follower"
    picks: list[list[int]] = [[], []]
    wants = {64: 0.5, 128: 0.25, 192: 0.1}  # the leader's budget wants a new cut at each
    for i in range(1000):
        for k in ((1, 0) if i < 100 else (0, 1)):  # the follower first, then second
            if k == 0 and i in wants:
                ranks[0]._want(wants[i])
            if ranks[k].tick():
                picks[k].append(i)
    assert list(ranks[0].rate_changes) == [(192, 0.5), (256, 0.25), (320, 0.1)]
    assert list(ranks[1].rate_changes) == list(ranks[0].rate_changes)
    assert picks[0] == picks[1] and ranks[1].late_changes == 0


def test_a_follower_counts_announcements_it_never_saw(tmp_path: Path) -> None:
    path = channel_path("o", 0, 0, tmp_path)
    leader = RateChannel(path, leader=True, epoch=64)
    follower = StepSampler(1.0, seed=1)
    follower.sync, follower.sync_role = RateChannel(path, False, 64), "follower"
    for n in range(SLOTS + 2):  # more announcements than the file keeps
        leader(64 * n, 1.0 / (n + 2))
    follower.tick()  # step 0: a boundary, where the follower reads the file
    assert follower.late_changes >= 1  # the two overwritten ones are not silently skipped


def test_a_stale_file_is_replaced_by_a_new_leader(tmp_path: Path) -> None:
    path = channel_path("k", 0, 0, tmp_path)
    old = RateChannel(path, leader=True, epoch=64)
    old(0, 0.001)
    old._mm = None  # killed: its file stays behind
    new = RateChannel(path, leader=True, epoch=64)
    follower = RateChannel(path, leader=False, epoch=64)
    assert follower(64, 1.0) == []  # the stale announcement is gone
    assert new(64, 0.5) == [(1, 64 + 128, 0.5)] and follower(128, 1.0) == [(1, 192, 0.5)]


def test_a_file_others_could_write_is_not_obeyed(tmp_path: Path) -> None:
    path = channel_path("m", 0, 0, tmp_path)
    leader = RateChannel(path, leader=True, epoch=64)
    leader(0, 0.5)
    os.chmod(path, 0o666)  # planted or tampered with: writable by anyone
    follower = RateChannel(path, leader=False, epoch=64)
    assert follower(64, 1.0) == [] and follower.unread == 1
    link = tmp_path / "attnprof-rate-link.bin"
    os.symlink(path, link)
    assert RateChannel(link, leader=False, epoch=64)(64, 1.0) == []  # no symlinks either


# ----------------------------------------------------------------- the RPC channel (issue 30.3)
def _poll(ranks: list[StepSampler], known: dict[str, list[Any]]) -> None:
    """One collective RPC: every rank runs it between the same two steps, takes what the API
    server carries, and the leader reports its wish; the API server keeps it for the next."""
    carried = dict(known) or None
    answers = []
    for r in ranks:
        take_carried(r, carried)
        rep = leader_answer(r)
        answers.append({"rate_sync": rep} if rep is not None else {})
    carried_rates(answers, known)


def _throttled_run(ranks: list[StepSampler], clocks: list[Clock], poll_every: int | None
                   ) -> list[list[int]]:
    known: dict[str, list[Any]] = {}
    picks: list[list[int]] = [[] for _ in ranks]
    for i in range(8000):
        if poll_every and i % poll_every == 0:
            _poll(ranks, known)
        for k, r in enumerate(ranks):
            clocks[k].t += 0.01
            if r.tick():
                picks[k].append(i)
                # the ranks' own times differ, and only the leader's decides
                r.charge((0.003 if i < 3000 else 0.0) * (1 + 5 * k))
    return picks


def test_ranks_without_the_file_decide_the_same_steps_through_the_poll(
        tmp_path: Path) -> None:
    """Ranks on two nodes (the file channel off): the leader's scale travels in its poll
    answer, the next poll carries it, and every rank applies it at that RPC, so the sampled
    steps stay identical while the budget throttles and recovers."""
    clocks = [Clock(), Clock()]
    ranks = [StepSampler(1.0, budget=0.01, seed=3, clock=c) for c in clocks]
    for k, r in enumerate(ranks):
        r.sync, r.sync_role = RpcRate(group_key(0, 0), k == 0), ("leader", "follower")[k]
    picks = _throttled_run(ranks, clocks, poll_every=150)
    assert picks[0] == picks[1] and 0 < len(picks[0]) < 8000
    assert ranks[0].throttles > 0 and list(ranks[0].rate_changes) == list(ranks[1].rate_changes)
    assert ranks[0].decisions_digest == ranks[1].decisions_digest
    assert ranks[0].scale == ranks[1].scale == 1.0  # recovered once the load went away
    assert ranks[1].sync.unread == 0 and ranks[1].late_changes == 0

    # The control (the same scenario on the file channel the follower cannot read, as a rank
    # on another node): it keeps its scale and samples other steps than its leader.
    clocks = [Clock(), Clock()]
    ranks = [StepSampler(1.0, budget=0.01, seed=3, clock=c) for c in clocks]
    path = channel_path("other-node", 0, 0, tmp_path)
    ranks[0].sync, ranks[0].sync_role = RateChannel(path, True, 64), "leader"
    ranks[1].sync, ranks[1].sync_role = (
        RateChannel(tmp_path / "elsewhere" / path.name, False, 64), "follower")
    picks = _throttled_run(ranks, clocks, poll_every=None)
    assert picks[0] != picks[1] and ranks[1].sync.unread > 0


def test_a_carried_rate_is_taken_once_and_only_by_its_group() -> None:
    s = StepSampler(1.0, seed=1)
    s.sync, s.sync_role = RpcRate(group_key(0, 1), False), "follower"
    for _ in range(10):
        s.tick()
    take_carried(s, {"0:0": [5, 0.25]})  # another pipeline stage's leader
    assert s.scale == 1.0
    take_carried(s, {"0:1": [5, 0.25]})
    assert s.scale == 0.25 and list(s.rate_changes) == [(10, 0.25)]  # from the next step
    take_carried(s, {"0:1": [4, 0.5]})  # older than the one taken (another API server)
    assert s.scale == 0.25
    take_carried(s, {"0:1": ["x", None]})  # unreadable: counted, not obeyed
    assert s.scale == 0.25 and s.sync.unread == 1
    solo = StepSampler(1.0, seed=1)  # not on the RPC channel: carried rates do nothing
    take_carried(solo, {"0:0": [1, 0.1]})
    assert solo.scale == 1.0 and leader_answer(solo) is None


def test_the_leader_reports_a_new_announcement_only_when_its_wish_changes() -> None:
    s = StepSampler(1.0, seed=1)
    s.sync, s.sync_role = RpcRate("0:0", True), "leader"
    first = leader_answer(s)
    assert first == {"group": "0:0", "seq": 1, "scale": 1.0, "in_force": 1.0}
    assert leader_answer(s) == first
    s._want(0.5)  # the budget asks for less; nothing applies until a poll carries it
    assert s.scale == 1.0
    known: dict[str, list[Any]] = {}
    assert carried_rates([{"rate_sync": leader_answer(s)}], known) is True  # pending
    assert known == {"0:0": [2, 0.5]}
    take_carried(s, known)
    assert s.scale == 0.5
    assert carried_rates([{"rate_sync": leader_answer(s)}], known) is False


def test_sync_ranks_chooses_the_channel_from_vllms_parallel_config(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from attnprof.capture.vllm.model_info import sync_ranks
    from attnprof.config import Config

    def cap(mode: str, tp_rank: int = 1) -> Any:
        return SimpleNamespace(
            rank={"tp_rank": tp_rank, "tp_size": 2, "pp_rank": 0, "dp_rank": 0},
            sampler=StepSampler(1.0, seed=1),
            state=SimpleNamespace(config=Config(rank_sync=mode, run_dir=tmp_path)))

    two_nodes = ParallelConfig(nnodes=2, tensor_parallel_size=2,
                               distributed_executor_backend="mp")
    one_node = ParallelConfig(tensor_parallel_size=2)
    assert multi_node(two_nodes) and not multi_node(one_node) and not multi_node(None)
    for mode, pc, kind in (("auto", two_nodes, RpcRate), ("auto", one_node, RateChannel),
                           ("rpc", one_node, RpcRate), ("file", two_nodes, RateChannel)):
        c = cap(mode)
        sync_ranks(c, "inst", pc)
        assert isinstance(c.sampler.sync, kind), (mode, pc)
        assert c.sampler.sync_role == "follower"
