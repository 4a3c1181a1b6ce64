"""attnprof: an attention profiler that lives inside LLM serving processes."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("attnprof")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "instrument", "profile"]


def instrument(model: Any, on_call: Callable[[Any], None] | None = None, **kw: Any) -> Any:
    """Wrap a transformers model's attention; see
    :func:`attnprof.capture.transformers.instrument` (imports torch lazily)."""
    from attnprof.capture.transformers import instrument as impl

    return impl(model, on_call=on_call, **kw)


def profile(model: Any, on_call: Callable[[Any], None] | None = None, **kw: Any) -> Any:
    """``with attnprof.profile(model) as prof: model(...)``; see
    :func:`attnprof.capture.transformers.profile`."""
    from attnprof.capture.transformers import profile as impl

    return impl(model, on_call=on_call, **kw)
