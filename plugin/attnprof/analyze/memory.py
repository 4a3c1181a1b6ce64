"""Per-head memory: the analytic models (the measurement they are checked against is
:mod:`attnprof.tools.memory_measure`).

Analytic (B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims, s bytes per element):
- KV cache per token per layer: ``2 * Hkv * D * s``; per KV head ``2 * D * s``; per query
  head ``2 * D * s / g`` with ``g = Hq / Hkv`` (GQA shares one KV head among g query heads).
- Materialized scores on unfused paths: ``B * Hq * Lq * Lk`` elements, times the path's bytes
  per element (below), plus the output; fused paths hold only the output, the log-sum-exp and
  per-thread tiles.

Pure arithmetic over shapes: nothing here runs a model, imports torch or allocates tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnprof.facts import kv as facts_kv
from attnprof.facts.dtypes import dtype_bytes

__all__ = [
    "PATH_BYTES_PER_SCORE",
    "AttnShape",
    "analytic_attention_peak",
    "kv_bytes_per_token",
    "model_mask_bytes",
    "rel_err",
]

# Bytes held per score element at the peak of each unfused path, read off the op sequence:
# math (torch _scaled_dot_product_attention_math, fp32 accumulation): QK^T scores (4) +
#   softmax output (4) + the bool isneginf mask of _safe_softmax (1).
# eager (transformers eager_attention_forward): matmul result (s) + its scaled copy (s) alive
#   together; for s < 4 the peak is at the fp32 softmax: its input (s), fp32 output (4), the
#   cast back (s) and the masked scores (s). Half-precision factors match measurements at
#   L >= 1024 only (fp32 upcast copies of q/k/v add linear terms not modeled here).
PATH_BYTES_PER_SCORE: dict[str, Callable[[int], float]] = {
    "math": lambda s: 9.0 if s >= 4 else 10.0,
    "eager": lambda s: 2 * s if s >= 4 else 4 + 3 * s,
}


@dataclass
class AttnShape:
    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    head_dim_v: int
    dtype: str = "float32"

    @property
    def bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def score_elements(self) -> int:
        return self.batch * self.num_heads * self.q_len * self.kv_len


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: Any, num_heads: int | None = None,
                       head_dim_v: int | None = None) -> dict[str, float]:
    """KV-cache bytes per token for one layer, per KV head and per query head (the one
    formula: :func:`attnprof.facts.kv.kv_bytes_per_token`)."""
    per_kv_head = facts_kv.kv_bytes_per_token(1, head_dim, dtype, head_dim_v)
    per_layer = facts_kv.kv_bytes_per_token(num_kv_heads, head_dim, dtype, head_dim_v)
    out: dict[str, float] = {"per_layer": per_layer, "per_kv_head": per_kv_head}
    if num_heads:
        out["per_query_head"] = per_layer / num_heads
    return out


def analytic_attention_peak(shape: AttnShape, path: str, *, masked: bool = False,
                            causal: bool = True, threads: int | None = None) -> dict[str, float]:
    """Modeled peak bytes held by one attention call on ``path`` (flash_cpu, math, eager).

    Returns ``{"total", "scores", "output", "other"}``; ``scores`` is the materialized score
    matrix part (0 on fused paths). ``threads``: the intra-op threads that ran the call
    (``torch.get_num_threads()`` there; each holds its own tiles), required on fused paths:
    ``ValueError`` without it.
    """
    s = shape.bytes
    out_b = shape.batch * shape.num_heads * shape.q_len * shape.head_dim_v * s
    el = shape.score_elements
    if path in ("flash_cpu", "flash", "efficient", "cudnn", "flex_attention"):
        # Output + fp32 log-sum-exp + per-thread tiles (q split x kv split scores, q split x D
        # accumulator) as in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp.
        if not threads:
            raise ValueError(f"{path}: the fused paths' tiles need the thread count")
        n = threads
        lq = shape.q_len
        q_split = 256 if lq >= 768 else (64 if lq >= 192 else 32)
        q_split = min(q_split, lq)
        kv_split = min(512, shape.kv_len)
        tiles = n * (q_split * kv_split * 4 + q_split * shape.head_dim_v * 4 + 2 * q_split * 4)
        lse = shape.batch * shape.num_heads * shape.q_len * 4
        return {"total": out_b + lse + tiles, "scores": 0.0, "output": out_b,
                "other": lse + tiles}
    if path not in PATH_BYTES_PER_SCORE:
        raise ValueError(f"unknown attention path {path!r}")
    scores = el * PATH_BYTES_PER_SCORE[path](s)
    other = 0.0
    if path == "math" and (masked or causal):
        other += 4.0 * shape.q_len * shape.kv_len  # the mask converted to an fp32 additive mask
    if path == "math" and shape.num_heads != shape.num_kv_heads:
        # enable_gqa on the math path expands K and V to Hq heads (eager's repeat_kv copies
        # are freed by the time the scores peak: measured).
        other += 2.0 * shape.batch * shape.num_heads * shape.kv_len * shape.head_dim * s
    if path == "eager":
        out_b *= 2  # attn_output and its transposed contiguous copy
    return {"total": scores + out_b + other, "scores": scores, "output": out_b, "other": other}


def model_mask_bytes(batch: int, q_len: int, kv_len: int, path: str, dtype: Any) -> float:
    """Bytes of the attention mask a transformers model builds once per forward and holds
    through every layer: eager gets a float additive ``B x 1 x Lq x Lk`` mask in the model's
    dtype; SDPA and fused paths get none for an unpadded causal prefill (is_causal instead)."""
    return float(batch * q_len * kv_len * dtype_bytes(dtype)) if path == "eager" else 0.0


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / b if b else math.inf
