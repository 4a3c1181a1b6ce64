"""Layer indices written as runs (``0-2,5``, ``layers 0-2, 5``): the one definition every
finding, table and report uses."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["format_layers", "format_sites", "ranges_text", "runs"]


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
    return _join(runs(values), sep, dash, prefix)


def _join(rs: list[tuple[int, int]], sep: str = ",", dash: str = "-", prefix: str = "") -> str:
    return sep.join(f"{prefix}{a}{dash}{prefix}{b}" if b > a else f"{prefix}{a}" for a, b in rs)


def format_layers(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"`` (``"layer 3"`` for one)."""
    rs = runs(layers)
    if not rs:
        return "no layers"
    # The runs once: ``layers`` may be a one-shot iterator.
    return ("layer " if len(rs) == 1 and rs[0][0] == rs[0][1] else "layers ") + _join(rs, ", ")


_PLAIN = re.compile(r"L(\d+)")


def format_sites(labels: Iterable[str]) -> str:
    """Site labels (:func:`attnprof.facts.shape.layer_label`, in model order): plain
    one-stack layers as ranges, every other site by its label, in the order given:
    ``["L0", "L1", "L2", "L5"]`` -> ``"layers 0-2, 5"``; ``["encoder.L0",
    "decoder.L0.cross"]`` -> ``"encoder.L0, decoder.L0.cross"``."""
    xs = list(dict.fromkeys(labels))
    plain = [int(m.group(1)) for x in xs if (m := _PLAIN.fullmatch(x))]
    parts = ([format_layers(plain)] if plain else []) + \
        [x for x in xs if not _PLAIN.fullmatch(x)]
    return ", ".join(parts) if parts else "no layers"
