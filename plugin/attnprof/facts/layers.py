"""Layer indices written as runs (``0-2,5``): the one definition every finding, table and
report uses."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ranges_text", "runs"]


def runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """``[5, 0, 1, 2]`` -> ``[(0, 2), (5, 5)]``: distinct values as runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for x in sorted(set(values)):
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


def ranges_text(values: Iterable[int], sep: str = ",", dash: str = "-",
                prefix: str = "") -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (``sep``, ``dash`` and a ``prefix`` before each bound,
    e.g. ``L0``, en dash, ``L2`` for the report); ``""`` for none."""
    return sep.join(f"{prefix}{a}{dash}{prefix}{b}" if b > a else f"{prefix}{a}"
                    for a, b in runs(values))
