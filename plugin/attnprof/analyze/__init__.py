"""analyze: pure functions over typed inputs. Kernel rules and the compatibility matrix,
backend advice, the memory model, scaling fits and OOM prediction (:mod:`.oom`), cost
what-ifs and their inputs (:mod:`.cost`, :mod:`.cost_inputs`), window maths
(:mod:`.sparsity`, :mod:`.window_advice`).

Nothing here installs hooks, opens sockets, runs a model, a benchmark or a profiler, or
imports torch: the measurements these models are checked against are in
:mod:`attnprof.tools.memory_measure` and :mod:`attnprof.tools.scaling_bench`. The one
exception left is :mod:`.vllm_backends`, which asks the installed vLLM live (inside a worker)
before it falls back to the derived matrix.
"""

from __future__ import annotations

from typing import Any

__all__ = ["vllm_backend_report"]


def vllm_backend_report(num_heads: int, num_kv_heads: int, head_size: int, dtype: Any,
                        kv_cache_dtype: str | None = "auto", sliding_window: int | None = None,
                        **kw: Any) -> dict[str, Any]:
    """Per-backend valid/invalid reasons for one vLLM attention layer; see
    :func:`attnprof.analyze.vllm_backends.vllm_backend_report`."""
    from attnprof.analyze.vllm_backends import vllm_backend_report as impl

    return impl(num_heads, num_kv_heads, head_size, dtype, kv_cache_dtype, sliding_window, **kw)
