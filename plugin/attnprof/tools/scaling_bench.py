"""Micro-benchmarks of one causal prefill attention call per path (flash_cpu, math, eager)
with a model's layer shape: best-of-N seconds and the measured peak bytes, for
:mod:`attnprof.analyze.scaling` to fit. Runs torch: a tool, not analysis.
"""

from __future__ import annotations

import time
from typing import Any

from attnprof.analyze.scaling import PATHS
from attnprof.tools.memory_measure import measure_peak

__all__ = ["bench_path", "make_inputs", "run_path"]


def make_inputs(batch: int, num_heads: int, num_kv_heads: int, length: int, head_dim: int,
                dtype: Any, seed: int = 0) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, str(dtype).removeprefix("torch."))
    q = torch.randn(batch, num_heads, length, head_dim, generator=g).to(dt)
    k = torch.randn(batch, num_kv_heads, length, head_dim, generator=g).to(dt)
    v = torch.randn(batch, num_kv_heads, length, head_dim, generator=g).to(dt)
    return q, k, v


def run_path(path: str, q: Any, k: Any, v: Any) -> Any:
    """One causal prefill attention call on ``path``, as transformers would make it."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    if path == "flash_cpu":
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if path == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if path == "eager":
        # transformers' eager_attention_forward (llama): repeat_kv, matmul, +mask, fp32
        # softmax, matmul, transpose. The additive causal mask is built outside, as the model
        # builds it once per forward.
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        L = q.shape[-2]
        mask = _causal_mask(L, q.dtype)
        w = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
        w = w + mask
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v)
        return out.transpose(1, 2).contiguous()
    raise ValueError(f"unknown path {path!r} (one of {', '.join(PATHS)})")


_MASKS: dict[tuple[int, str], Any] = {}


def _causal_mask(length: int, dtype: Any) -> Any:
    import torch

    key = (length, str(dtype))
    if key not in _MASKS:
        _MASKS.clear()  # keep one: they are L^2
        m = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)
        _MASKS[key] = m[None, None]
    return _MASKS[key]


def bench_path(path: str, batch: int, num_heads: int, num_kv_heads: int, length: int,
               head_dim: int, dtype: Any, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds and measured peak bytes of one causal prefill call."""
    import torch

    q, k, v = make_inputs(batch, num_heads, num_kv_heads, length, head_dim, dtype)
    with torch.no_grad():
        run_path(path, q, k, v)  # warm-up (and the eager mask build, outside the peak)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_path(path, q, k, v)
            times.append(time.perf_counter() - t0)
        _out, peak = measure_peak(lambda: run_path(path, q, k, v))
    # min, not median: on a shared machine every slower sample is interference.
    return {"time_s": min(times), "peak_bytes": float(peak)}
