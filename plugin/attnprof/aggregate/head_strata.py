"""Head statistics split by stratum = (phase, context bucket), in bounded memory.

A stratum holds one :class:`~attnprof.aggregate.head_stats.HeadStatsAccumulator`:

* phase ``"prefill"`` (prompt queries: whole, chunked or prefix-cached prompts) or
  ``"decode"`` (one query per running sequence on sampled decode steps);
* context bucket: the request's context length at fold (prefill: the prompt's total length;
  decode: the sequence's context length), named by the bucket's lower edge in tokens. The
  edges come from :func:`context_bucket_edges` (the one definition: the worker, the coverage
  table and the exporters all call it); prompts shorter than the statistics' minimum are
  bucket ``0`` ("short").

Accumulators are created lazily (``template.empty_like()``), so memory grows only with the
strata that saw data: at most ``2 x len(context_bucket_edges(...))`` accumulators of the
template's size. The object offers the accumulator's own merge and wire API (double buffer,
deltas, the API server's merge) with the same semantics, stratum by stratum. Pure numpy.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from attnprof.aggregate.head_stats import TAKE_PIECE_ELEMENTS, HeadStatsAccumulator

__all__ = ["HEAD_STATS_MAX_TOKENS", "PHASES", "SCHEMA", "HeadStatsStrata", "context_bucket",
           "context_bucket_edges"]

HEAD_STATS_MAX_TOKENS = 32768
"""Longest context folded: bounds the fp32 copy of one request's keys (Lk x Hkv x D). No
traffic above it can ever be sampled, so the advice never asks for more of it."""

SCHEMA = "attnprof.head_strata/1"
PHASES = ("prefill", "decode")
_MAGIC = b"ATTNPROF-STRATA/1\n"  # delta bytes: magic, one JSON line, the strata's .npz bytes
_MIN_DOUBLING_EDGE = 64  # with no minimum, the first doubling bucket starts here


def context_bucket_edges(min_tokens: int, max_tokens: int = 1 << 20) -> tuple[int, ...]:
    """Lower edges of the context buckets: ``0`` (short: under ``min_tokens``), then
    ``min_tokens``, then every power of two above it up to ``max_tokens`` (the window grid's
    own steps, so "need more traffic at > N tokens" names a window-sized boundary)."""
    lo = max(0, int(min_tokens))
    edges = [0] if lo == 0 else [0, lo]
    p = 1 << max(lo, _MIN_DOUBLING_EDGE - 1).bit_length()  # smallest power of two above
    while p <= max_tokens:
        edges.append(p)
        p <<= 1
    return tuple(edges)


def context_bucket(tokens: int, edges: tuple[int, ...]) -> int:
    """The lower edge of the bucket holding a context of ``tokens`` tokens."""
    return edges[max(0, bisect.bisect_right(edges, int(tokens)) - 1)]


Key = tuple[str, int]


class HeadStatsStrata:
    """Per-(phase, bucket) accumulators shaped like ``template`` (which holds no data of its
    own: only its shape, grids and sampling settings are used)."""

    def __init__(self, template: HeadStatsAccumulator) -> None:
        self.template = template.empty_like()
        self._strata: dict[Key, HeadStatsAccumulator] = {}

    @classmethod
    def wrap(cls, acc: HeadStatsAccumulator) -> HeadStatsStrata:
        """``acc`` itself (not a copy) as the one stratum ("prefill", 0): how data of a
        version before strata is read."""
        out = cls(acc)
        out._strata[("prefill", 0)] = acc
        return out

    # ------------------------------------------------------------------ access
    def get(self, phase: str, bucket_lo: int) -> HeadStatsAccumulator:
        """The stratum's accumulator, created (zeroed) on first use."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
        key = (phase, int(bucket_lo))
        acc = self._strata.get(key)
        if acc is None:
            acc = self._strata[key] = self.template.empty_like()
        return acc

    def items(self) -> list[tuple[Key, HeadStatsAccumulator]]:
        """Every stratum created so far, sorted by (phase, bucket)."""
        return sorted(self._strata.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1]))

    def total(self, phase: str | None = None) -> HeadStatsAccumulator:
        """A merged copy of every stratum (or of one phase's)."""
        out = self.template.empty_like()
        for (p, _b), acc in self.items():
            if phase is None or p == phase:
                out.merge(acc)
        return out

    def has_data(self) -> bool:
        return any(acc.queries.any() for acc in self._strata.values())

    def layers_with_data(self) -> Iterable[int]:
        seen: set[int] = set()
        for _k, acc in self.items():
            seen.update(acc.layers_with_data())
        return iter(sorted(seen))

    @property
    def num_layers(self) -> int:
        return self.template.num_layers

    @property
    def num_q_heads(self) -> int:
        return self.template.num_q_heads

    # ------------------------------------------------------------------ merge
    def empty_like(self) -> HeadStatsStrata:
        return HeadStatsStrata(self.template)

    def merge(self, other: HeadStatsStrata) -> HeadStatsStrata:
        self.template._check_compatible(other.template)
        for (p, b), acc in other.items():
            self.get(p, b).merge(acc)
        return self

    def add_at(self, other: HeadStatsStrata, q_offset: int = 0,
               count_requests: bool = True) -> HeadStatsStrata:
        """:meth:`HeadStatsAccumulator.add_at` stratum by stratum."""
        for (p, b), acc in other.items():
            self.get(p, b).add_at(acc, q_offset, count_requests)
        return self

    # ------------------------------------------------------------------ serialize
    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "template": self.template.to_dict(),
                "strata": [{"phase": p, "bucket": b, "stats": acc.to_dict()}
                           for (p, b), acc in self.items()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HeadStatsStrata:
        """Strata data, or a plain accumulator's (read as the one stratum ("prefill", 0))."""
        if d.get("schema") != SCHEMA:
            return cls.wrap(HeadStatsAccumulator.from_dict(d))  # ValueError: neither
        out = cls(HeadStatsAccumulator.from_dict(d["template"]))
        for s in d.get("strata") or ():
            acc = HeadStatsAccumulator.from_dict(s["stats"])
            out.template._check_compatible(acc)
            out.get(str(s["phase"]), int(s["bucket"])).merge(acc)
        return out

    load = from_dict  # whichever of the two formats ``d`` is

    def take_chunks(self, pause: Callable[[], None] | None = None,
                    piece: int = TAKE_PIECE_ELEMENTS) -> list[Any]:
        """Everything gathered since the last take as a list of buffers (``_MAGIC``, a JSON
        line naming each stratum and its byte count, then each stratum's
        :meth:`HeadStatsAccumulator.take_chunks`), and restart from zero. Strata without data
        are left out (and kept, zeroed, for reuse: no allocation on the engine's path). The
        JSON line also carries the template's shape, so an empty delta still loads."""
        index: list[dict[str, Any]] = []
        parts: list[Any] = []
        for (p, b), acc in self.items():
            if not acc.queries.any():
                continue
            chunks = acc.take_chunks(pause, piece)
            index.append({"phase": p, "bucket": b, "size": _nbytes(chunks)})
            parts += chunks
        head = {"template": self.template._meta(), "strata": index}
        return [_MAGIC + json.dumps(head).encode() + b"\n", *parts]

    def take_bytes(self, pause: Callable[[], None] | None = None,
                   piece: int = TAKE_PIECE_ELEMENTS) -> bytes:
        return b"".join(self.take_chunks(pause, piece))

    @classmethod
    def from_bytes(cls, data: bytes) -> HeadStatsStrata:
        """What :meth:`take_chunks` wrote, or a plain accumulator's delta (read as the one
        stratum ("prefill", 0)). Raises ``ValueError`` for anything else."""
        mv = memoryview(data)
        if bytes(mv[:len(_MAGIC)]) != _MAGIC:
            return cls.wrap(HeadStatsAccumulator.from_bytes(data))
        end = bytes(mv[len(_MAGIC):len(_MAGIC) + (1 << 20)]).find(b"\n")
        if end < 0:
            raise ValueError("not a head-strata delta: no index line")
        try:
            head = json.loads(bytes(mv[len(_MAGIC):len(_MAGIC) + end]).decode())
            out = cls(HeadStatsAccumulator.from_dict({**head["template"], "arrays": {}}))
            pos = len(_MAGIC) + end + 1
            for e in head["strata"]:
                size = int(e["size"])
                if size < 0 or pos + size > len(mv):
                    raise ValueError("truncated")
                acc = HeadStatsAccumulator.from_bytes(bytes(mv[pos:pos + size]))
                pos += size
                out.template._check_compatible(acc)
                out.get(str(e["phase"]), int(e["bucket"])).merge(acc)
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"not a head-strata delta: {err!r}") from None
        if pos != len(mv):
            raise ValueError("not a head-strata delta: wrong length")
        return out


def _nbytes(chunks: list[Any]) -> int:
    return sum(memoryview(c).nbytes for c in chunks)
