"""JSON that strict parsers accept: NaN and infinities become ``null``.

Python's ``json`` writes ``NaN``/``Infinity`` by default, which is not JSON; Starlette's
``JSONResponse`` refuses them (``allow_nan=False``), so one NaN in a statistic would turn
every later snapshot into a 500. Everything attnprof serves or writes goes through here.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "dumps_yielding", "finite"]


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


def dumps_yielding(obj: Any, chunk: int = 32768) -> str:
    """Like :func:`dumps`, for large documents serialized in a worker thread: long lists are
    encoded ``chunk`` items at a time, so the GIL is released between pieces and an event
    loop in another thread keeps running (one ``json.dumps`` of a multi-megabyte list holds
    the GIL for its whole duration: hundreds of milliseconds)."""
    parts: list[str] = []
    _emit(obj, parts, chunk)
    return "".join(parts)


def _emit(obj: Any, out: list[str], chunk: int) -> None:
    if isinstance(obj, dict):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            out.append((", " if i else "") + json.dumps(str(k)) + ": ")
            _emit(v, out, chunk)
        out.append("}")
    elif isinstance(obj, (list, tuple)) and len(obj) > chunk:
        out.append("[")
        for i in range(0, len(obj), chunk):
            piece = dumps(list(obj[i:i + chunk]))
            out.append((", " if i else "") + piece[1:-1])
        out.append("]")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        out.append("[")
        for i, v in enumerate(obj):
            out.append(", " if i else "")
            _emit(v, out, chunk)
        out.append("]")
    else:
        out.append(dumps(obj))
