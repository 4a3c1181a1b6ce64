"""Fail-open machinery: attnprof is a guest in someone else's server.

After start-up nothing attnprof does may raise into the host. Errors are counted by
place, logged at most once per place, and after ``max_errors`` capture disables itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ErrorBook", "Once"]

logger = logging.getLogger("attnprof")
T = TypeVar("T")


class ErrorBook:
    """Counts internal errors by place; trips ``disabled`` after ``max_errors``."""

    def __init__(self, max_errors: int = 100) -> None:
        self.max_errors = max_errors
        self.by_place: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.disabled = False
        self._tripping = 0  # errors that count towards the breaker (not exporter errors)
        self._lock = threading.Lock()

    def record(self, place: str, exc: BaseException) -> None:
        """Count an internal error; ``max_errors`` of them disable capture in this process."""
        try:
            if self._count(place, trips=True) == 1:
                logger.warning("attnprof: internal error in %s (counted, not raised): %r",
                               place, exc)
        except Exception:  # never let bookkeeping raise either
            pass

    def note(self, place: str, exc: BaseException) -> None:
        """Count an error of an exporter (endpoint down, refusing) without tripping the
        capture breaker: a broken collector must not switch off profiling."""
        try:
            if self._count(place, trips=False) == 1:
                logger.warning("attnprof: %s failed (counted, not raised; further failures "
                               "counted silently): %r", place, exc)
        except Exception:
            pass

    def _count(self, place: str, trips: bool) -> int:
        with self._lock:
            n = self.by_place.get(place, 0) + 1
            self.by_place[place] = n
            if trips:
                self._tripping += 1
                if self._tripping >= self.max_errors and not self.disabled:
                    self.disabled = True
                    logger.error("attnprof: %d internal errors; capture disabled in this "
                                 "process", self._tripping)
        return n

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


class Once:
    """Run a function at most once per process (idempotent plugin loading)."""

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()

    def do(self, fn: Callable[[], T]) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
        fn()
        return True

    @property
    def done(self) -> bool:
        return self._done
