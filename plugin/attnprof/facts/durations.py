"""Durations, written one way: one unit table and the two grammars attnprof reads.

- **Local durations** (``--duration``, ``--interval``): a decimal number and one unit of
  ``ms``, ``s``, ``m``/``min``, ``h`` (none: seconds), e.g. ``10s``, ``500ms``, ``1.5``;
  more than 0 and at most a week (:data:`MAX_SECONDS`).
- **PromQL ranges** (``--range``, ``--prometheus-range``): Prometheus' own grammar
  (``30m``, ``1d``, ``1h30m``: integers, units ``ms s m h d w y``). A range is pasted into
  a query, so nothing else may pass.

Errors are :class:`DurationError` (a ``ValueError``) with one line naming the flag; each room
converts it to its own error type.
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_SECONDS", "UNIT_SECONDS", "DurationError", "promql_range", "promql_seconds",
           "seconds"]

UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
                "w": 604800.0, "y": 31536000.0}
"""Seconds in each unit (PromQL's ``y`` is 365 days)."""
MAX_SECONDS = 7 * 86400.0
"""Longest local duration (a week): anything longer is a typo."""

_LOCAL = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|min|m|h|)\s*", flags=re.ASCII)
_PROMQL = re.compile(r"(?:[0-9]{1,9}(?:ms|s|m|h|d|w|y))+")
_PROMQL_PART = re.compile(r"([0-9]+)(ms|s|m|h|d|w|y)")


class DurationError(ValueError):
    """A duration that does not parse or is out of range (one line)."""


def seconds(text: str, flag: str) -> float:
    """A local duration in seconds; :class:`DurationError` for anything else, zero or more
    than :data:`MAX_SECONDS`."""
    m = _LOCAL.fullmatch(text.lower())
    if not m:
        raise DurationError(f"{flag} {text[:30]!r} is not a duration (e.g. 10s, 500ms, 2m)")
    secs = float(m.group(1)) * (UNIT_SECONDS[m.group(2)] if m.group(2) else 1.0)
    if not 0 < secs <= MAX_SECONDS or not math.isfinite(secs):
        raise DurationError(f"{flag} must be more than 0 and at most {MAX_SECONDS:.0f} s, "
                            f"got {text[:30]!r}")
    return secs


def promql_range(text: str, flag: str = "--prometheus-range") -> str:
    """A PromQL range as given; :class:`DurationError` for anything else."""
    if not _PROMQL.fullmatch(text):
        raise DurationError(f"{flag} {text[:60]!r} is not a duration "
                            "(e.g. 30m, 6h, 1d, 1h30m)")
    return text


def promql_seconds(text: str, flag: str = "--range") -> float:
    """A PromQL range in seconds, at least one; :class:`DurationError` otherwise."""
    promql_range(text, flag)
    secs = float(sum(int(n) * UNIT_SECONDS[u] for n, u in _PROMQL_PART.findall(text)))
    if secs < 1:
        raise DurationError(f"{flag} {text} is shorter than a second (e.g. 30m, 24h)")
    return secs
