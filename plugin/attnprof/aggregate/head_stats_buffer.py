"""Head statistics in two halves, so a pull never makes the engine wait for serialization.

The engine folds sampled prompts into the *active* accumulator (a
:class:`~attnprof.aggregate.head_strata.HeadStatsStrata` in a worker: one accumulator per
(phase, context bucket); a plain accumulator works the same way). A pull (the API server's
poll, between two model steps) only swaps it with a zeroed *spare*: two attribute
assignments and a queue put, whatever the model's size. A background thread then turns the
swapped-out half into delta bytes (:meth:`HeadStatsAccumulator.take_chunks`, which zeroes it
in passing: 46 ms for an 80-layer, 64-head accumulator) in pieces, handing the GIL to the
engine's thread between two (:func:`~attnprof.aggregate.background.yield_gil`), hands them
to ``finish`` as a list of buffers never joined into one (it may write them to a file one
by one; ``b"".join`` is the delta) and returns the zeroed half as the next
spare. The result is collected by a later, equally cheap call (:meth:`take_ready`).

While a drain is still running there is no spare: a pull then swaps nothing (counted in
``skipped``) and the engine keeps folding into the active half, so nothing is lost and
memory stays at two accumulators.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from attnprof.aggregate.background import yield_gil
from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HeadStatsStrata

__all__ = ["DRAIN_WAIT_S", "FoldQueue", "HeadStatsDoubleBuffer"]

DRAIN_WAIT_S = 10.0
"""A drain checks every this many seconds that the worker it waits for is still alive."""


class FoldQueue(Protocol):
    """Folds on their way into the active half from another thread."""

    @property
    def pending(self) -> int:
        """Folds handed over and not done."""

    @property
    def alive(self) -> bool:
        """Folds handed over will still land (the folding thread runs)."""

    def barrier(self) -> Callable[[float], bool]:
        """A wait (timeout in seconds; False when it ran out) for the folds handed over
        until now."""


class HeadStatsDoubleBuffer:
    """``active`` is written by the engine thread, or by the one thread ``folds`` names
    (the statistics' worker, in submission order); ``swap`` and ``take_ready`` run on the
    engine thread (between steps); the drain runs on one daemon thread of its own and
    serializes a half only once the folds handed over before its swap have landed."""

    def __init__(self, active: HeadStatsAccumulator | HeadStatsStrata,
                 pause: Callable[[], None] = yield_gil) -> None:
        self.active = active
        self.pause = pause
        """Called by the drain between two pieces of a delta (hands over the GIL)."""
        self._spare: HeadStatsAccumulator | HeadStatsStrata | None = active.empty_like()
        self._ready: list[Any] = []
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[HeadStatsAccumulator | HeadStatsStrata,
                                            Callable[[list[Any]], Any],
                                            Callable[[float], bool] | None]] = queue.SimpleQueue()
        self.folds: FoldQueue | None = None
        """Where folds reach ``active`` from another thread (capture/head_worker.py): a swap
        takes its barrier, which the drain waits on before serializing the half."""
        self.swaps = 0
        self.skipped = 0
        """Pulls that found the previous drain still running (nothing swapped)."""
        self.drain_s = 0.0
        """Seconds the last drain took (off the engine's path)."""
        self.delta_bytes = 0
        """Size of the last delta."""
        self.slow_drains = 0
        """Times a drain waited another ``DRAIN_WAIT_S`` for the worker's pending folds."""
        self.errors: list[str] = []
        # Started now (the engine's first sampled prompt, charged to attnprof's budget), not
        # at the first pull: starting a thread takes ~0.1-0.5 ms.
        self._thread = threading.Thread(target=self._run, name="attnprof-head-stats",
                                        daemon=True)
        self._thread.start()

    @property
    def draining(self) -> bool:
        """A swapped-out half is still being serialized."""
        return self._spare is None

    def swap(self, finish: Callable[[list[Any]], Any]) -> bool:
        """Swap the active half for the spare and queue the old one for serialization;
        ``finish(delta_chunks)`` runs on the drain thread and its result is what
        :meth:`take_ready` hands out. O(1); False when there was nothing to swap (no data, or
        the previous drain still running)."""
        with self._lock:
            spare = self._spare
            if spare is None:
                self.skipped += 1
                return False
            if not _has_data(self.active) and not (self.folds is not None
                                                   and self.folds.pending):
                return False
            old, self.active, self._spare = self.active, spare, None
        self.swaps += 1
        self._jobs.put((old, finish, self.folds.barrier() if self.folds is not None else None))
        return True

    def settle(self, timeout: float = 10.0) -> bool:
        """Until the folds handed over so far are in ``active`` (the offline snapshot reads
        it whole); False on timeout."""
        return self.folds is None or self.folds.barrier()(timeout)

    def take_ready(self) -> list[Any]:
        """Every finished drain's result since the last call (O(1))."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def wait(self, timeout: float = 10.0) -> bool:
        """Until the drain in progress is done (tests, offline use); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.draining and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self.draining

    def _run(self) -> None:
        while True:
            old, finish, folded = self._jobs.get()
            t0 = time.perf_counter()
            result: Any = None
            try:
                # Off the engine's path, the drain waits as long as the folds take: a loaded
                # machine can starve the nice-19 worker for minutes, and giving up would throw
                # the whole half away and count a breaker error for load. Meanwhile pulls swap
                # nothing (``skipped``) and the engine folds into the active half: nothing is
                # lost. Only a worker that is gone ends the wait (its folds never land): what
                # did land is serialized, and that counts.
                while folded is not None and not folded(DRAIN_WAIT_S):
                    self.slow_drains += 1
                    if self.folds is not None and not self.folds.alive:
                        self.errors.append("RuntimeError: the head-statistics worker is gone "
                                           "with folds pending at a drain")
                        del self.errors[:-8]
                        break
                # zeroes ``old`` too (it is the next spare), in pieces
                data = old.take_chunks(self.pause)
                self.delta_bytes = sum(memoryview(c).nbytes for c in data)
                result = finish(data)
            except Exception as exc:  # a lost delta is counted by the caller's book
                self.errors.append(f"{type(exc).__name__}: {exc}")
                del self.errors[:-8]
                old = old.empty_like()
            self.drain_s = time.perf_counter() - t0
            with self._lock:
                if result is not None:
                    self._ready.append(result)
                self._spare = old


def _has_data(acc: HeadStatsAccumulator | HeadStatsStrata) -> bool:
    return acc.has_data() if isinstance(acc, HeadStatsStrata) else bool(acc.queries.any())
