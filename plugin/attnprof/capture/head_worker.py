"""The head statistics' worker: one thread that folds sampled layer calls off the engine's.

A sampled layer call's statistics are milliseconds of work (recomputing softmax rows against
every earlier key). On the engine's thread that is a stall of the serving loop; so the
engine's thread only reads what the work needs (:func:`attnprof.capture.head_rows.prepare`:
a copy of the sampled queries and of the keys up to the last of them, since the engine
overwrites its buffers and the paged cache once the call returns) and hands it here. On a
GPU the work itself is enqueued on the device by the engine's thread (no copy, no wait) and
only the host-side fold comes here, after its event completes.

Bounded: at most ``max_jobs`` jobs and ``max_bytes`` bytes of copies wait at once; a job
that does not fit is dropped (the caller counts it), never waited for. One thread, jobs in
submission order, so the accumulator sees the same folds in the same order as inline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["LAG_JOBS", "MAX_BYTES", "MAX_JOBS", "HeadStatsWorker", "quiet_thread"]

MAX_JOBS = 4096
"""Jobs (layer folds) waiting at most: a step admitted while the worker keeps up is never
cut short by the count (80 layers x a prefill and 4 decode folds is 400)."""
LAG_JOBS = 128
"""Jobs waiting from which the worker is behind (:attr:`HeadStatsWorker.lagging`): a new
sampled step's statistics are then left out, so the backlog, which a pull's delta waits for,
stays about one step's work."""
MAX_BYTES = 64 << 20
"""Bytes of copied queries and keys waiting at most (beyond them a job is dropped)."""


class HeadStatsWorker:
    """``submit`` runs on the engine's thread and never waits; jobs run on one daemon
    thread. ``on_error(exc)`` is called there when a job raises (the job is lost, the
    thread goes on)."""

    def __init__(self, on_error: Callable[[BaseException], None],
                 max_jobs: int = MAX_JOBS, max_bytes: int = MAX_BYTES, lag_jobs: int = LAG_JOBS,
                 setup: Callable[[], None] | None = None,
                 on_setup_error: Callable[[BaseException], None] | None = None) -> None:
        self.on_error = on_error
        self.on_setup_error = on_setup_error or on_error
        self.setup = setup
        """Run first on the thread (``quiet_thread``: yield the cores to the engine)."""
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.lag_jobs = max(1, min(lag_jobs, max_jobs // 2))
        self._jobs: deque[tuple[Callable[[], Any], int]] = deque()
        self._cv = threading.Condition()
        self.bytes = 0
        """Bytes of the jobs waiting or running."""
        self.peak_bytes = 0
        self.submitted = 0
        self.done = 0
        self.dropped = 0
        self.busy_s = 0.0
        """CPU seconds of the thread's jobs (work the engine's thread did not do; CPU time,
        not wall: at nice 19 on a busy machine the thread waits, and waiting costs nothing)."""
        self._taken_busy = 0.0
        self._thread = threading.Thread(target=self._run, name="attnprof-head-fold",
                                        daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self.submitted - self.done

    @property
    def alive(self) -> bool:
        """The thread runs: folds handed over will still land (a drain may wait for them)."""
        return self._thread.is_alive()

    @property
    def lagging(self) -> bool:
        """``lag_jobs`` jobs or half the byte bound or more still waiting: a new sampled
        step's statistics would make the backlog (and the next pull's wait) grow, or likely
        not fit whole (the caller then leaves the step out)."""
        return (self.submitted - self.done >= self.lag_jobs
                or self.bytes >= self.max_bytes // 2)

    def fits(self, nbytes: int) -> bool:
        """``nbytes`` more would fit now (a read without the lock: the engine's thread sizes
        its copies before making them; :meth:`submit` decides under the lock)."""
        return (self.submitted - self.done < self.max_jobs
                and self.bytes + nbytes <= self.max_bytes)

    def submit(self, job: Callable[[], Any], nbytes: int) -> bool:
        """Queue ``job`` holding ``nbytes``; False (nothing queued) when it does not fit."""
        with self._cv:
            if (self.submitted - self.done >= self.max_jobs
                    or self.bytes + nbytes > self.max_bytes):
                self.dropped += 1
                return False
            self._jobs.append((job, nbytes))
            self.submitted += 1
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self._cv.notify()
        return True

    def barrier(self) -> Callable[[float], bool]:
        """A wait for every job submitted until now (to be called later, off the engine's
        thread): True once they are done, False on timeout."""
        mark = self.submitted

        def wait(timeout: float = 10.0) -> bool:
            return self.wait_done(mark, timeout)

        return wait

    def wait_done(self, mark: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.done < mark:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Until every job submitted so far is done (tests, the offline snapshot)."""
        return self.wait_done(self.submitted, timeout)

    def take_busy(self) -> float:
        """The thread's job time since the last call (charged to attnprof's budget)."""
        busy = self.busy_s
        out, self._taken_busy = busy - self._taken_busy, busy
        return out

    def _run(self) -> None:
        if self.setup is not None:
            try:
                self.setup()
            except Exception as exc:  # the folds still run, at the engine's priority
                self.on_setup_error(exc)
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job, nbytes = self._jobs.popleft()
            t0 = time.thread_time()
            try:
                job()
            except Exception as exc:
                try:
                    self.on_error(exc)
                except Exception:
                    pass
            finally:
                del job  # its copies go now, before the count says so
                dt = time.thread_time() - t0
                with self._cv:
                    self.busy_s += dt
                    self.bytes -= nbytes
                    self.done += 1
                    self._cv.notify_all()


def quiet_thread(nice: int = 19) -> None:
    """Make the calling thread (the worker) give way to the engine: one intra-op thread for
    its torch ops (the engine's OpenMP team keeps the cores; vLLM-CPU replaces
    ``torch.set_num_threads`` with a no-op after binding its threads, so torch's own setter
    is called: it sets this thread's OpenMP team size, and the default of threads that have
    not run a parallel op yet) and, on Linux, the lowest CPU priority for this thread alone
    (``nice`` per thread id). Torch's setter also stores the default every thread started
    later takes (a host thread running ``generate`` would get one thread): a short helper
    thread puts the process's default back, which leaves this thread's own team at one."""
    import os

    import torch

    prev = torch.get_num_threads()  # this thread's own OpenMP setup first (the default)
    torch._C.set_num_threads(1)
    if prev != 1:
        helper = threading.Thread(target=torch._C.set_num_threads, args=(prev,),
                                  name="attnprof-thread-default", daemon=True)
        helper.start()
        helper.join()
    if nice and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
