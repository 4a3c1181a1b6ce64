"""Work a worker does off the engine's thread, in pieces that leave it the GIL.

A background thread running pure Python (or numpy copies that keep the GIL) holds the GIL
until the interpreter forces a switch, 5 ms by default (``sys.getswitchinterval``): the
engine's thread, which needs the GIL between its kernels, waits that long. Work done here is
cut into pieces of well under a millisecond, and :func:`yield_gil` after each piece sleeps
briefly, which hands the GIL to a waiting thread (a zero sleep does not: the sleeper takes
the GIL back before the woken waiter gets to it).

:class:`LatestBuild` keeps the latest result of such a build (the worker snapshot) and
rebuilds it on its own thread when its source changed, so the engine's thread only reads a
reference.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["YIELD_S", "LatestBuild", "yield_gil"]

YIELD_S = 0.0001
"""Sleep between two pieces of background work: long enough for a thread waiting for the
GIL to wake and take it."""


_GONE_CHECK_S = 30.0
"""How often an idle builder thread checks that its source still exists."""


def yield_gil() -> None:
    """Give the GIL to any thread waiting for it (call between two pieces of work)."""
    time.sleep(YIELD_S)


class LatestBuild:
    """The latest ``build()`` result, rebuilt on a daemon thread of its own whenever
    ``version()`` changed and someone asked (:meth:`get` found it stale, or :meth:`wake`):
    nothing is built that nobody reads, so a server nobody polls pays nothing for it.

    ``version`` is called on both threads and must be O(1); ``build`` runs on the thread
    only (it may pause between pieces with :func:`yield_gil`). Never raises: a failing
    build keeps the previous result and is handed to ``on_error``. The thread ends once
    ``version()`` returns :attr:`GONE` (its source no longer exists).
    """

    GONE: Hashable = ("attnprof: source gone",)

    def __init__(self, build: Callable[[], Any], version: Callable[[], Hashable],
                 name: str = "attnprof-snapshot",
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._build = build
        self._version = version
        self.name = name
        self.on_error = on_error
        # One tuple, replaced whole: a reader on another thread sees an old or a new build,
        # never half of one. (value, version it was built from, monotonic time it was built)
        self._latest: tuple[Any, Hashable, float] | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._starting = False  # start_soon's helper is starting the thread
        self.builds = 0
        self.errors = 0

    def start(self) -> None:
        """Start the thread (once: by the first pull, a thread start takes ~0.1-0.5 ms), or
        wake it where it runs; either way it checks its source right away."""
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def start_soon(self) -> None:
        """:meth:`start`, from a helper OS thread: ``Thread.start`` waits until the new
        thread runs, which on a loaded machine is the scheduler's delay (6 ms measured on
        vLLM-CPU's engine thread at load 9); creating the helper does not wait. O(1): a
        thread already running, or being started, is only woken."""
        self._wake.set()
        if self._starting or (self._thread is not None and self._thread.is_alive()):
            return
        self._starting = True
        try:
            _thread.start_new_thread(self._start_off_caller, ())
        except Exception:
            self._starting = False
            raise

    def _start_off_caller(self) -> None:
        try:
            self.start()
        except Exception as exc:  # a helper thread: nobody would see it raise
            self._note(exc)
        finally:
            self._starting = False

    def get(self) -> tuple[Any, bool, float, Hashable]:
        """(the latest build or None, whether it is current, its age in seconds, the
        version it was built from). O(1), one read of the build; wakes nothing: a reader
        that finds the build stale or missing calls :meth:`wake` once it is done, so the
        thread does not compete with it meanwhile."""
        latest = self._latest
        if latest is None:
            return None, False, 0.0, None
        value, version, at = latest
        return value, version == self._version(), time.monotonic() - at, version

    def wake(self) -> None:
        """Have the thread check its source now (O(1))."""
        self._wake.set()

    def build_now(self) -> Any:
        """Build on the calling thread and keep the result (the thread, and tests); raises
        what ``build`` raises."""
        version = self._version()
        value = self._build()
        self.keep(value, version)
        return value

    def keep(self, value: Any, version: Hashable) -> None:
        """Keep ``value``, built from ``version`` elsewhere (a reader that found no build
        at all and made one itself)."""
        self._latest = (value, version, time.monotonic())
        self.builds += 1

    def wait_current(self, timeout: float = 10.0) -> bool:
        """Until the latest build is current (tests, offline use); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            latest = self._latest
            if latest is not None and latest[1] == self._version():
                return True
            self._wake.set()
            time.sleep(0.002)
        return False

    def _run(self) -> None:
        while True:
            # a timeout only checks that the source still exists
            woken = self._wake.wait(_GONE_CHECK_S)
            self._wake.clear()
            try:
                version = self._version()
                if version == self.GONE:
                    return
                if not woken and self._latest is not None:
                    continue
                latest = self._latest
                if latest is None or latest[1] != version:
                    # The thread that woke this one (a pull, on the engine's thread) gets
                    # the GIL back first: the build's first piece would hold it up to the
                    # switch interval (5 ms) before its first pause.
                    yield_gil()
                    self.build_now()
            except Exception as exc:  # kept: the previous build stays served
                self._note(exc)

    def _note(self, exc: BaseException) -> None:
        """Count a failure and hand it to ``on_error`` (which must not raise either)."""
        self.errors += 1
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:
                pass
