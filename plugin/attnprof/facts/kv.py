"""KV-cache facts every room needs, defined once: the bytes one token's keys and values take
in one layer, the dtype a cache of ``kv_cache_dtype`` holds (vLLM's ``auto`` is the model's
dtype), the tokens a (windowed) layer keeps for one sequence, and the paged blocks vLLM
allocates for them.

Pure Python (works on floats and, for :func:`held_tokens`, on numpy arrays without
importing numpy).
"""

from __future__ import annotations

import math
from typing import Any, overload

from attnprof.facts.dtypes import dtype_bytes, dtype_name, normalize

__all__ = ["AUTO", "blocks_held", "held_tokens", "kv_bytes_per_token", "kv_cache_dtype",
           "kv_element_bytes"]

AUTO = frozenset({"auto", "", "none"})
"""``kv_cache_dtype`` values that mean "the model's dtype"."""


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: object,
                       head_dim_v: int | None = None, default: int | None = None) -> int:
    """Bytes of one token's keys and values in one layer: ``Hkv * (D + Dv) * s`` (``2 * Hkv *
    D * s`` when ``head_dim_v`` is None). ``default``: element bytes for an unknown dtype
    (``ValueError`` when None), as :func:`attnprof.facts.dtypes.dtype_bytes`."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return num_kv_heads * (head_dim + dv) * dtype_bytes(dtype, default)


def kv_cache_dtype(cache_dtype: object, model_dtype: object) -> str:
    """The dtype a KV cache holds, as a canonical short name (``fp8_e4m3`` -> ``fp8``):
    ``auto`` (or unset) means the model's dtype. The raw name when unknown."""
    src = model_dtype if dtype_name(cache_dtype) in AUTO else cache_dtype
    try:
        return normalize(src)
    except ValueError:
        return dtype_name(src)


def kv_element_bytes(cache_dtype: object, model_dtype: object, default: int = 2) -> int:
    """Bytes per KV-cache element (:func:`kv_cache_dtype`'s); for an unknown cache dtype,
    the model's element size; ``default`` when neither is known."""
    return dtype_bytes(kv_cache_dtype(cache_dtype, model_dtype),
                       dtype_bytes(model_dtype, default))


@overload
def held_tokens(context: float, window: int | None, sinks: int = 0) -> float: ...
@overload
def held_tokens(context: Any, window: int | None, sinks: int = 0) -> Any: ...
def held_tokens(context: Any, window: int | None, sinks: int = 0) -> Any:
    """Tokens of KV one layer keeps for a sequence of ``context`` tokens: all of them for
    full attention (``window`` None or 0), else at most ``window + sinks`` (transformers'
    sliding-window overlay: the ``window`` most recent keys, the current one included, plus
    ``sinks`` first keys). ``context`` may be a number or a numpy array."""
    if not window:
        return context
    cap = window + sinks
    return context.clip(max=cap) if hasattr(context, "clip") else min(context, cap)


def blocks_held(context: float, window: int | None, block_size: int) -> int:
    """Paged KV blocks of ``block_size`` tokens one layer holds for a sequence of ``context``
    tokens in vLLM: whole blocks, ``ceil(held / block_size)``; a window that has slid past the
    start may straddle a block edge, so it takes one more (vLLM's sliding-window admission
    cap, ``cdiv(window, block_size) + 1`` in decode). 0 for an empty sequence."""
    bs = max(1, int(block_size))
    if context <= 0:
        return 0
    n = -(-math.ceil(held_tokens(float(context), window)) // bs)  # ceil(held / bs)
    return n + 1 if window and context > window else n
