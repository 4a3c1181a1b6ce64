"""A pull's drain and a slow statistics' worker: the drain waits for the folds handed over
before its swap as long as the worker lives (a loaded machine starves the nice-19 worker for
longer than any fixed timeout), never throwing the half away or counting load as an error;
a worker that is gone ends the wait, and what did land is still delivered."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate import head_stats_buffer
from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
from attnprof.aggregate.head_strata import HeadStatsStrata
from attnprof.capture import head_rows
from attnprof.capture.head_worker import HeadStatsWorker
from tests.unit.capture.test_head_worker import drained_buffer


def _job(acc: HeadStatsAccumulator, positions: tuple[int, ...]) -> head_rows.Prepared:
    return head_rows.prepare(acc, 0, torch.randn(8, 4, 16), torch.randn(8, 2, 16), 0.25, 0,
                             positions, [1.0] * len(positions), {}, copy=True)


def _until(cond: Any, limit_s: float = 60.0) -> bool:
    """Wait (bounded, for a loaded machine) until ``cond()``; no timing is asserted."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def _collect(buf: HeadStatsDoubleBuffer) -> list[bytes]:
    got: list[bytes] = []

    def finish(chunks: list[Any]) -> bytes:
        got.append(b"".join(chunks))
        return b"done"

    assert buf.swap(finish)
    return got


def test_a_drain_outwaits_a_starved_worker_and_loses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_stats_buffer, "DRAIN_WAIT_S", 0.001)  # many checks, no wait
    gate = threading.Event()
    w = HeadStatsWorker(lambda exc: None)
    buf, acc = drained_buffer(w)
    head_rows.run(acc, _job(acc, (1, 2))).apply()  # landed before the swap
    assert w.submit(lambda: gate.wait(300), 0)  # the worker is starved: the fold waits
    late = _job(acc, (3, 7))
    assert w.submit(lambda: head_rows.run(acc, late).apply(), late.nbytes)
    got = _collect(buf)
    assert _until(lambda: buf.slow_drains >= 3)  # the drain went past several waits ...
    assert buf.draining and not got and not buf.errors  # ... holding on, nothing counted
    gate.set()
    assert buf.wait(60) and len(got) == 1 and not buf.errors
    delta = HeadStatsStrata.from_bytes(got[0]).get("prefill", 0)
    assert delta.queries.sum() == 4 * 4  # both folds: four queries, four heads
    assert buf.take_ready() == [b"done"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_drain_whose_worker_is_gone_delivers_what_landed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_stats_buffer, "DRAIN_WAIT_S", 0.001)
    w = HeadStatsWorker(lambda exc: None)

    def die() -> None:
        raise SystemExit  # not an Exception: the worker's thread ends

    assert w.submit(die, 0) and _until(lambda: not w.alive)
    buf, acc = drained_buffer(w)
    head_rows.run(acc, _job(acc, (1, 2))).apply()
    lost = _job(acc, (5,))
    assert w.submit(lambda: head_rows.run(acc, lost).apply(), lost.nbytes)  # never runs
    got = _collect(buf)
    assert buf.wait(60) and len(got) == 1
    delta = HeadStatsStrata.from_bytes(got[0]).get("prefill", 0)
    assert delta.queries.sum() == 2 * 4  # what landed; the dead worker's fold is not there
    assert np.all(delta.queries[0] == 2)
    assert len(buf.errors) == 1 and "worker is gone" in buf.errors[0]
