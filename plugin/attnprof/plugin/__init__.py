"""Deprecated alias kept for scripts written against attnprof 0.1 (``import attnprof.plugin
as attnprof``): use ``import attnprof``. Re-exports the same objects, no second copy."""

from attnprof import __version__, instrument, profile

__all__ = ["__version__", "instrument", "profile"]
