"""Sequence-length scaling: per-path micro-benchmarks, fits, and OOM prediction.

Time and memory of attention grow as ``a + b*L + c*L^2``: fused paths have c (time) from the
QK^T/PV FLOPs but no quadratic memory; unfused paths (math, eager) hold the score matrix, so
memory has a quadratic term too. :func:`fit_poly2` fits the three terms by least squares
(non-negative c); :func:`predict_max` inverts a fitted memory curve against a budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from attnprof.analyze.memory import measure_peak

__all__ = [
    "PATHS",
    "bench_path",
    "eval_poly2",
    "fit_poly2",
    "make_inputs",
    "predict_max",
    "run_path",
]

PATHS = ("flash_cpu", "math", "eager")


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


def fit_poly2(xs: Sequence[float], ys: Sequence[float], quadratic: bool = True
              ) -> dict[str, float]:
    """Least-squares ``y = a + b*x + c*x^2`` with ``a, b, c >= 0``.

    Fits every non-empty term subset and keeps the best one with non-negative terms: time
    and memory are never negative and never shrink with length, and a negative term would
    make extrapolation (the OOM prediction) and log-scale plots nonsense.
    """
    import itertools

    import numpy as np

    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    basis = {"a": np.ones_like(x), "b": x, "c": x * x}
    names = ["a", "b", "c"] if quadratic and len(x) >= 3 else ["a", "b"]
    best: tuple[float, dict[str, float]] | None = None
    for k in range(1, len(names) + 1):
        for terms in itertools.combinations(names, k):
            if len(terms) > len(x):
                continue
            coef = np.linalg.lstsq(np.stack([basis[t] for t in terms], axis=1), y,
                                   rcond=None)[0]
            fit = {"a": 0.0, "b": 0.0, "c": 0.0}
            for t, v in zip(terms, coef, strict=True):
                fit[t] = float(v)
            if min(fit.values()) < 0:
                continue
            pred = fit["a"] + fit["b"] * x + fit["c"] * x * x
            ss_res = float(((y - pred) ** 2).sum())
            # Prefer fewer terms unless more terms fit clearly better.
            if best is None or ss_res < best[0] * (1 - 1e-6):
                best = (ss_res, fit)
    if best is None:  # all-negative data: a flat zero line
        best = (float((y**2).sum()), {"a": 0.0, "b": 0.0, "c": 0.0})
    ss_tot = float(((y - y.mean()) ** 2).sum())
    best[1]["r2"] = 1.0 - best[0] / ss_tot if ss_tot > 0 else 1.0
    return best[1]


def eval_poly2(fit: dict[str, float], x: float) -> float:
    return fit["a"] + fit["b"] * x + fit["c"] * x * x


def predict_max(fit: dict[str, float], budget: float, lo: int = 1, hi: int = 1 << 24,
                f: Callable[[int], float] | None = None) -> int:
    """Largest integer x in [lo, hi] with f(x) <= budget (f defaults to the fit); 0 if none."""
    fn = f or (lambda x: eval_poly2(fit, x))
    if fn(lo) > budget:
        return 0
    if fn(hi) <= budget:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fn(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def doubling_ratio(fit: dict[str, float], x: float) -> float:
    """How much y grows when x doubles (2 = linear, 4 = quadratic)."""
    y1, y2 = eval_poly2(fit, x), eval_poly2(fit, 2 * x)
    return y2 / y1 if y1 > 0 else math.nan
