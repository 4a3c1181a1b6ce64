"""JSON that strict parsers accept: NaN and infinities become ``null``.

Python's ``json`` writes ``NaN``/``Infinity`` by default, which is not JSON; Starlette's
``JSONResponse`` refuses them (``allow_nan=False``), so one NaN in a statistic would turn
every later snapshot into a 500. Everything attnprof serves or writes goes through here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

__all__ = ["CHUNK_BYTES", "dumps", "dumps_chunks", "dumps_yielding", "finite"]

CHUNK_BYTES = 64 << 10
"""Target size of one piece from :func:`dumps_chunks`: one ``json.dumps`` call of ~64 KB
holds the GIL for at most a few milliseconds, even for lists of floats (whose repr is the
slow case: ~6,000 of them)."""


def finite(obj: Any) -> Any:
    """A copy of ``obj`` with every non-finite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` with ``allow_nan=False`` semantics that never fails on a NaN: the fast
    path serializes as is; only a document holding a non-finite float is walked."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False, **kw)


def dumps_yielding(obj: Any) -> str:
    """Like :func:`dumps`, for large documents serialized in a worker thread while an event
    loop runs in another: :func:`dumps_chunks` joined (one ``json.dumps`` of a multi-megabyte
    list holds the GIL for its whole duration: hundreds of milliseconds)."""
    return "".join(dumps_chunks(obj))


def dumps_chunks(obj: Any, target: int = CHUNK_BYTES) -> Iterator[str]:
    """:func:`dumps` of ``obj`` as consecutive pieces of about ``target`` characters each
    (joined, they are the document): long lists are encoded a group of items at a time, the
    group sized from the last one's output, so no single ``json.dumps`` call, and so no
    stretch holding the GIL, grows with the document. For bodies of tens of megabytes
    written from a thread while an event loop runs, and streamed as they come."""
    buf: list[str] = []
    size = 0
    for piece in _pieces(obj, max(64, target)):
        buf.append(piece)
        size += len(piece)
        if size >= target:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def _pieces(obj: Any, target: int) -> Iterator[str]:
    if isinstance(obj, dict):
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            yield (", " if i else "") + json.dumps(str(k)) + ": "
            yield from _pieces(v, target)
        yield "}"
    elif isinstance(obj, (list, tuple)) and len(obj) > 16:
        yield "["
        i, n, k = 0, len(obj), 16
        while i < n:
            piece = dumps(list(obj[i:i + k]))
            yield (", " if i else "") + piece[1:-1]
            i += k
            # The next group: as many items as make about ``target`` characters, growing
            # at most 2x a step (small items first, like metadata, must not size big ones).
            k = max(1, min(2 * k, int(k * target / max(1, len(piece)))))
        yield "]"
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        yield "["
        for i, v in enumerate(obj):
            if i:
                yield ", "
            yield from _pieces(v, target)
        yield "]"
    else:
        yield dumps(obj)
