"""Attention diagnostics: which kernel ran and why, compatibility rules, advice, memory, scaling.

Submodules import torch lazily (only :mod:`sdpa`, :mod:`memory` and :mod:`scaling` need it),
so ``attnprof compat`` and the rule port work on machines without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["vllm_backend_report"]


def vllm_backend_report(num_heads: int, num_kv_heads: int, head_size: int, dtype: Any,
                        kv_cache_dtype: str | None = "auto", sliding_window: int | None = None,
                        **kw: Any) -> dict[str, Any]:
    """Per-backend valid/invalid reasons for one vLLM attention layer; see
    :func:`attnprof.plugin.diagnostics.vllm.vllm_backend_report`."""
    from attnprof.plugin.diagnostics.vllm import vllm_backend_report as impl

    return impl(num_heads, num_kv_heads, head_size, dtype, kv_cache_dtype, sliding_window, **kw)
