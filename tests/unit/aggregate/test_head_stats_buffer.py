"""Head statistics pulled without stalling the engine: the double buffer swaps in O(1) on the
caller's thread and serializes on its own; nothing folded is lost or counted twice, however
the pulls fall; deltas reach the API server as private files on one machine, inline across
machines, and a path that is not a delta file is never opened."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
from attnprof.capture.vllm.deltas import DeltaFiles, host_id, read_delta


def _fold(acc: HeadStatsAccumulator, seed: int) -> None:
    """Something to count: a few entries of several fields, as a prompt would leave."""
    rng = np.random.default_rng(seed)
    acc.queries[rng.integers(acc.num_layers), rng.integers(acc.num_q_heads)] += 1
    acc.sink_sum[0, 0, 1] += 0.5
    acc.cov_min[0, 0, 0, 0] = min(acc.cov_min[0, 0, 0, 0], 0.9 - seed * 1e-3)


def test_swap_serializes_on_the_drain_thread_not_the_callers() -> None:
    buf = HeadStatsDoubleBuffer(HeadStatsAccumulator(4, 2, 2))
    _fold(buf.active, 1)
    threads: list[str] = []

    def finish(chunks: list[Any]) -> bytes:
        threads.append(threading.current_thread().name)
        return b"".join(chunks)

    before = buf.active
    assert buf.swap(finish)
    assert buf.active is not before and not buf.active.queries.any()
    assert buf.wait(60)
    assert threads == ["attnprof-head-stats"]
    (delta,) = buf.take_ready()
    assert HeadStatsAccumulator.from_bytes(delta).queries.sum() == 1
    assert buf.take_ready() == []
    # The swapped-out half came back zeroed as the spare: memory stays at two halves.
    assert buf._spare is before and not before.queries.any() and buf.delta_bytes > 0


def test_nothing_is_lost_or_counted_twice_whatever_the_timing_of_pulls() -> None:
    buf = HeadStatsDoubleBuffer(HeadStatsAccumulator(3, 2, 2))
    gate = threading.Event()

    def slow(chunks: list[Any]) -> bytes:
        gate.wait(5.0)  # the drain is still running when the next pulls come
        return b"".join(chunks)

    merged = HeadStatsAccumulator(3, 2, 2)
    folded = 0
    for i in range(40):
        _fold(buf.active, i)
        folded += 1
        swapped = buf.swap(slow)
        if i % 7 == 3:
            gate.set()
            buf.wait(60)
            gate.clear()
        for d in buf.take_ready():
            merged.merge(HeadStatsAccumulator.from_bytes(d))
        assert swapped or buf.skipped > 0
    gate.set()
    buf.wait(60)
    for d in buf.take_ready():
        merged.merge(HeadStatsAccumulator.from_bytes(d))
    rest = buf.active
    assert merged.queries.sum() + rest.queries.sum() == folded
    assert merged.sink_sum[0, 0, 1] + rest.sink_sum[0, 0, 1] == pytest.approx(0.5 * folded)
    assert buf.skipped > 0  # pulls came while a drain ran, and swapped nothing


def test_an_empty_accumulator_is_not_swapped() -> None:
    buf = HeadStatsDoubleBuffer(HeadStatsAccumulator(2, 1, 1))
    assert not buf.swap(lambda d: d) and not buf.draining and buf.swaps == 0


def test_a_failing_finish_loses_that_delta_only_and_says_so() -> None:
    buf = HeadStatsDoubleBuffer(HeadStatsAccumulator(2, 1, 1))
    _fold(buf.active, 0)

    def broken(chunks: list[Any]) -> Any:
        raise OSError("disk full")

    assert buf.swap(broken) and buf.wait(60)
    assert buf.take_ready() == [] and buf.errors == ["OSError: disk full"]
    _fold(buf.active, 1)  # the next pull works again
    assert buf.swap(lambda d: d) and buf.wait(60) and len(buf.take_ready()) == 1


# ----------------------------------------------------------------- how deltas travel
def test_on_one_machine_a_delta_is_a_private_file_read_once(tmp_path: Path) -> None:
    files = DeltaFiles(tmp_path)
    handle = files.finish_for(host_id())([b"delta-", b"bytes"])
    assert set(handle) == {"path", "size"} and handle["size"] == 11
    path = Path(handle["path"])
    assert path.parent == tmp_path and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_delta(handle) == b"delta-bytes"
    assert not path.exists()  # read and removed
    with pytest.raises(ValueError, match="unreadable"):
        read_delta(handle)


def test_across_machines_a_delta_travels_in_the_answer(tmp_path: Path) -> None:
    files = DeltaFiles(tmp_path)
    for other in (None, "other-host/boot", host_id() + "x"):
        handle = files.finish_for(other)([b"a", b"bc"])
        assert handle == {"data": b"abc", "size": 3} and read_delta(handle) == b"abc"
    assert list(tmp_path.iterdir()) == []


def test_files_nobody_collected_are_removed_at_the_next_pull_and_at_exit(tmp_path: Path
                                                                         ) -> None:
    files = DeltaFiles(tmp_path)
    finish = files.finish_for(host_id())
    a, b = finish([b"a"]), finish([b"b"])
    files.hand([a])  # handed out, never read (the API server died)
    files.forget_handed()
    assert not Path(a["path"]).exists() and Path(b["path"]).exists()  # b not handed yet
    files.forget_all()
    assert list(tmp_path.iterdir()) == []


def test_a_handle_that_is_not_a_delta_file_is_never_opened(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    link = tmp_path / "attnprof-hs-abc.npz"
    os.symlink(secret, link)
    for bad in ({"path": str(secret)}, {"path": "/etc/passwd"}, {"path": str(link)},
                {"path": 3}, {"data": "str"}, [], None, {"path": str(tmp_path / "../x.npz")}):
        with pytest.raises(ValueError):
            read_delta(bad)
    assert secret.read_text() == "do not read"
