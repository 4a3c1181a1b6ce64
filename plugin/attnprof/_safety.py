"""Fail-open machinery: attnprof is a guest in someone else's server.

After start-up nothing attnprof does may raise into the host. Errors are counted by
place, logged at most once per place, and after ``max_errors`` of them in one *area*
(capture, stat_logger, endpoint, advice, export) that area switches itself off in this
process: a visible breaker (``attnprof_capture_disabled{place=<area>}``), never a silent one.

Fault injection (``ATTNPROF_FAULT_INJECT``, tests only) goes through :func:`fault_point`,
called at the top of each guarded region, so a test proves the guard that really wraps
the code rather than a ``raise`` placed inside it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["AREAS", "FAULT_PLACES", "ErrorBook", "Once", "area_of", "fault_point", "pid_alive",
           "set_faults"]

logger = logging.getLogger("attnprof")
T = TypeVar("T")

AREAS = ("capture", "stat_logger", "endpoint", "advice", "export")
"""What a breaker switches off: worker capture, the stat logger's request statistics, the
HTTP routes, the window-advice refresh, and the export loop's own sample code."""

FAULT_PLACES = ("capture", "step", "stat_logger", "endpoint", "advice", "flusher",
                "otlp_export")
"""Where ``ATTNPROF_FAULT_INJECT`` can raise (a comma-separated list of these)."""

# Error place -> area. A place not listed belongs to capture (worker-side bookkeeping).
_AREA_OF = {
    "stat_logger": "stat_logger", "stat_logger_init": "stat_logger",
    "export_source_requests": "stat_logger",
    "endpoint": "endpoint", "snapshot_parse": "endpoint", "sampling_switch": "endpoint",
    "window_advice": "advice",
    "export": "export", "flusher": "export", "run_dir": "export",
    "export_source_process": "export",
}


def area_of(place: str) -> str:
    return _AREA_OF.get(place, "capture")


_FAULTS: frozenset[str] = frozenset()


def set_faults(places: Iterable[str]) -> None:
    """Arm fault injection at these places (``ATTNPROF_FAULT_INJECT``); testing only."""
    global _FAULTS
    _FAULTS = frozenset(places)


def fault_point(place: str) -> None:
    """Raise here when a test armed this place; otherwise one set lookup."""
    if _FAULTS and place in _FAULTS:
        raise RuntimeError(f"attnprof fault injection (ATTNPROF_FAULT_INJECT={place})")


class ErrorBook:
    """Counts internal errors by place; trips an area's breaker after ``max_errors``."""

    def __init__(self, max_errors: int = 100) -> None:
        self.max_errors = max_errors
        self.by_place: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.tripped: set[str] = set()
        self._by_area: dict[str, int] = {}  # errors that count towards a breaker
        self._lock = threading.Lock()

    @property
    def disabled(self) -> bool:
        """Worker capture is off (its breaker tripped)."""
        return "capture" in self.tripped

    def is_off(self, area: str) -> bool:
        return area in self.tripped

    def record(self, place: str, exc: BaseException) -> None:
        """Count an internal error; ``max_errors`` in one area switch that area off."""
        try:
            if self._count(place, trips=True) == 1:
                logger.warning("attnprof: internal error in %s (counted, not raised): %r",
                               place, exc)
        except Exception:  # never let bookkeeping raise either
            pass

    def note(self, place: str, exc: BaseException) -> None:
        """Count an error of an exporter (endpoint down, refusing) without tripping a
        breaker: a broken collector must not switch off profiling."""
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
                area = area_of(place)
                k = self._by_area[area] = self._by_area.get(area, 0) + 1
                if k >= self.max_errors and area not in self.tripped:
                    self.tripped.add(area)
                    logger.error("attnprof: %d internal errors in %s; %s disabled in this "
                                 "process (attnprof_capture_disabled{place=%r} = 1)",
                                 k, area, area, area)
        return n

    def view(self) -> tuple[dict[str, int], dict[str, int], set[str]]:
        """Errors by place, drops and tripped areas, copied together under the lock: an
        export that read them one by one while another thread recorded could show a
        breaker tripped beside fewer errors than trip it."""
        with self._lock:
            return dict(self.by_place), dict(self.dropped), set(self.tripped)

    def drop(self, reason: str) -> None:
        with self._lock:
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


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (not Linux): kill(0) said it exists
