"""JSON that strict parsers accept: NaN and infinities become ``null``.

Python's ``json`` writes ``NaN``/``Infinity`` by default, which is not JSON; Starlette's
``JSONResponse`` refuses them (``allow_nan=False``), so one NaN in a statistic would turn
every later snapshot into a 500. Everything attnprof serves or writes goes through here.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite"]


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
