"""Work off the engine's thread goes in pieces that hand the GIL back (issue 30, point 2):
the head-statistics delta is scanned, zeroed and written a piece at a time, with a pause
between two pieces, into the very bytes ``np.savez`` writes; the latest-build cache serves a
reference and rebuilds on its own thread. Pieces are counted, never timed."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import numpy as np
import pytest

from attnprof.aggregate.background import LatestBuild
from attnprof.aggregate.head_stats import TAKE_PIECE_ELEMENTS, HeadStatsAccumulator
from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer


def _filled(layers: int = 3, kv: int = 2, group: int = 4, seed: int = 0
            ) -> HeadStatsAccumulator:
    """An accumulator with ~30% of every field's entries set (and a census row)."""
    acc = HeadStatsAccumulator(layers, kv, group)
    rng = np.random.default_rng(seed)
    for f in acc._SUM_FIELDS:
        a = getattr(acc, f)
        m = rng.random(a.shape) < 0.3
        a[m] = rng.random(int(m.sum()))
    acc.cov_min[0, 1] = 0.5
    acc.exact[1, 2] = True
    return acc


def _savez_take(acc: HeadStatsAccumulator) -> bytes:
    """The delta as it was written before the pieces: one ``np.savez`` of whole arrays."""
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(acc._meta()).encode(),
                                                    dtype=np.uint8)}
    for f in (*acc._SUM_FIELDS, "cov_min"):
        a = getattr(acc, f)
        nz = np.flatnonzero(a != (1.0 if f == "cov_min" else 0.0))
        arrays[f + ".i"] = nz.astype(np.uint32)
        arrays[f + ".v"] = a.ravel()[nz]
    arrays["exact.i"] = np.flatnonzero(acc.exact).astype(np.uint32)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_a_delta_in_pieces_is_np_savez_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1.7e9)  # the zip entries' date: one clock
    for piece in (7, 1000, TAKE_PIECE_ELEMENTS):
        acc = _filled()
        want = _savez_take(acc)
        got = acc.take_bytes(lambda: None, piece)
        assert got == want
        assert not acc.queries.any() and (acc.cov_min == 1).all() and not acc.exact.any()
        back = HeadStatsAccumulator.from_bytes(got)
        ref = _filled()
        for f in (*ref._SUM_FIELDS, "cov_min", "exact"):
            assert np.array_equal(getattr(back, f), getattr(ref, f)), f


def test_the_delta_pauses_between_every_two_pieces() -> None:
    acc = _filled()
    piece = 50
    # Scan: one piece per `piece` entries of each field; write: one per `piece` * 8 bytes
    # of each array (index and value arrays of every field, meta, exact rows).
    scan = sum(-(-getattr(acc, f).size // piece) for f in (*acc._SUM_FIELDS, "cov_min"))
    write = 0
    meta = len(json.dumps(acc._meta()).encode())
    for f in (*acc._SUM_FIELDS, "cov_min"):
        a = getattr(acc, f)
        n = int(np.count_nonzero(a != (1.0 if f == "cov_min" else 0.0)))
        for lo in range(0, a.size, piece):  # each scanned piece's part is written apart
            k = int(np.count_nonzero(a.reshape(-1)[lo:lo + piece]
                                     != (1.0 if f == "cov_min" else 0.0)))
            write += -(-k * 4 // (piece * 8)) + -(-k * 8 // (piece * 8))
        assert n > 0
    write += -(-meta // (piece * 8)) + 1  # meta; exact.i (one row: 4 bytes)
    pauses: list[str] = []
    acc.take_bytes(lambda: pauses.append(threading.current_thread().name), piece)
    assert len(pauses) == scan + write and scan > 20


def test_the_drain_hands_over_the_gil_unless_told_otherwise() -> None:
    from attnprof.aggregate.background import yield_gil

    assert HeadStatsDoubleBuffer(_filled()).pause is yield_gil


def test_the_drain_pauses_on_its_own_thread_never_the_callers() -> None:
    seen: list[str] = []
    buf = HeadStatsDoubleBuffer(_filled(), pause=lambda: seen.append(
        threading.current_thread().name))
    assert buf.swap(b"".join) and buf.wait(60)
    assert len(seen) > 1 and set(seen) == {"attnprof-head-stats"}
    (delta,) = buf.take_ready()
    assert HeadStatsAccumulator.from_bytes(delta).queries.sum() == _filled().queries.sum()


class _Source:
    def __init__(self) -> None:
        self.version = 0
        self.built_on: list[str] = []
        self.gate = threading.Event()  # cleared: a build waits (the test decides when)
        self.gate.set()

    def build(self) -> int:
        self.built_on.append(threading.current_thread().name)
        version = self.version
        assert self.gate.wait(60)
        return version


def test_the_latest_build_is_a_reference_rebuilt_on_its_own_thread() -> None:
    src = _Source()
    lb = LatestBuild(src.build, lambda: src.version, name="t-build")
    assert lb.get() == (None, False, 0.0, None)  # nothing yet: the reader builds nothing
    lb.start()
    assert lb.wait_current(60)
    value, fresh, _, _ = lb.get()
    assert (value, fresh) == (0, True) and set(src.built_on) == {"t-build"}
    src.gate.clear()  # a wake left from wait_current cannot finish a rebuild before get()
    src.version = 1  # the source changed: the reader gets the old build, marked stale,
    value, fresh, age, built = lb.get()  # and the thread, woken, rebuilds
    assert (value, fresh, built) == (0, False, 0) and age >= 0.0  # built from version 0
    lb.wake()
    src.gate.set()
    assert lb.wait_current(60) and lb.get()[:2] == (1, True)
    assert "MainThread" not in src.built_on


def test_a_failing_build_keeps_the_last_one_and_the_thread_ends_with_its_source() -> None:
    errors: list[BaseException] = []
    state = {"version": 0, "fail": False, "gone": False}

    def build() -> int:
        if state["fail"]:
            raise RuntimeError("boom")
        return int(state["version"])

    def version() -> Any:
        return LatestBuild.GONE if state["gone"] else state["version"]

    lb = LatestBuild(build, version, on_error=errors.append)
    lb.start()
    assert lb.wait_current(60)
    state.update(version=1, fail=True)
    assert not lb.wait_current(timeout=0.2)  # bounded wait, not a timing claim
    deadline = time.monotonic() + 60  # a hang bound: a busy box may try the build late
    while lb.errors < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lb.get()[0] == 0 and lb.errors >= 1 and isinstance(errors[0], RuntimeError)
    state["gone"] = True
    lb.wake()  # the thread sees its source gone
    thread = lb._thread
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive()
