"""Per-head memory: analytic models and an honest CPU measurement.

Analytic (B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims, s bytes per element):
- KV cache per token per layer: ``2 * Hkv * D * s``; per KV head ``2 * D * s``; per query
  head ``2 * D * s / g`` with ``g = Hq / Hkv`` (GQA shares one KV head among g query heads).
- Materialized scores on unfused paths: ``B * Hq * Lq * Lk`` elements, times the path's bytes
  per element (below), plus the output; fused paths hold only the output, the log-sum-exp and
  per-thread tiles.

Measured: :func:`measure_peak` runs a callable under ``torch.profiler`` with
``profile_memory=True`` and replays the allocator's ``[memory]`` events (allocations and frees,
in order) to get the peak bytes held above the starting point. It sees every CPU allocation
made through torch's allocator, which is where attention tensors live; it does not see memory
oneDNN/OpenMP take outside it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from attnprof.facts.dtypes import dtype_bytes

__all__ = [
    "PATH_BYTES_PER_SCORE",
    "AttnShape",
    "analytic_attention_peak",
    "cache_bytes",
    "kv_bytes_per_token",
    "measure_peak",
    "memory_profile",
    "model_mask_bytes",
    "peak_in_ranges",
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
    """KV-cache bytes per token for one layer, per KV head and per query head."""
    s = dtype_bytes(dtype)
    dv = head_dim if head_dim_v is None else head_dim_v
    per_kv_head = (head_dim + dv) * s
    per_layer = num_kv_heads * per_kv_head
    out: dict[str, float] = {"per_layer": per_layer, "per_kv_head": per_kv_head}
    if num_heads:
        out["per_query_head"] = per_layer / num_heads
    return out


def analytic_attention_peak(shape: AttnShape, path: str, *, masked: bool = False,
                            causal: bool = True, threads: int | None = None) -> dict[str, float]:
    """Modeled peak bytes held by one attention call on ``path`` (flash_cpu, math, eager).

    Returns ``{"total", "scores", "output", "other"}``; ``scores`` is the materialized score
    matrix part (0 on fused paths).
    """
    s = shape.bytes
    out_b = shape.batch * shape.num_heads * shape.q_len * shape.head_dim_v * s
    el = shape.score_elements
    if path in ("flash_cpu", "flash", "efficient", "cudnn", "flex_attention"):
        # Output + fp32 log-sum-exp + per-thread tiles (q split x kv split scores, q split x D
        # accumulator) as in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp.
        import torch

        n = threads or torch.get_num_threads()
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


def cache_bytes(cache: Any) -> int:
    """Real bytes of a transformers cache (sum over its layers' key/value tensors)."""
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is not None and hasattr(t, "numel"):
                    total += int(t.numel() * t.element_size())
        return total
    for k, v in cache:  # legacy tuple-of-tuples
        total += int(k.numel() * k.element_size() + v.numel() * v.element_size())
    return total


def _memory_events(prof: Any) -> list[tuple[int, int]]:
    evs = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type().name == "CPU":
            evs.append((int(e.start_ns()), int(e.nbytes())))
    evs.sort()
    return evs


@contextlib.contextmanager
def _drop_usdt_lines() -> Iterator[None]:
    """Kineto prints a "USDT: ... profiler_start/stop" line on fd 2 at every profiler start and
    stop; capture fd 2 around those moments and pass every other line through."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


@contextlib.contextmanager
def memory_profile() -> Iterator[Any]:
    """``torch.profiler.profile(activities=[CPU], profile_memory=True)``, without Kineto's
    stderr chatter."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _drop_usdt_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _drop_usdt_lines():
            prof.__exit__(None, None, None)


def measure_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` and return ``(result, peak bytes allocated above the start)``."""
    with memory_profile() as prof:
        result = fn()
    cur = peak = 0
    for _t, nbytes in _memory_events(prof):
        cur += nbytes
        peak = max(peak, cur)
    return result, peak


def peak_in_ranges(prof: Any, prefix: str, absolute: bool = False
                   ) -> tuple[int, dict[str, list[int]]]:
    """Overall peak of a profiled region and, per ``record_function`` range whose name starts
    with ``prefix``, the peak bytes allocated above the level at the range's start (with
    ``absolute``: above the region's start, i.e. everything held at that range's peak)."""
    mem = _memory_events(prof)
    ranges = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name.startswith(prefix) and e.device_type().name == "CPU":
            ranges.append((int(e.start_ns()), int(e.end_ns()), name))
    ranges.sort()
    out: dict[str, list[int]] = {}
    cur = peak = 0
    levels = []
    before = [0]  # before[i]: bytes held just before event i
    for t, nb in mem:
        cur += nb
        peak = max(peak, cur)
        levels.append((t, nb))
        before.append(cur)
    i = 0
    for start, end, name in ranges:
        # Memory events are time-ordered: walk the ones inside [start, end].
        while i < len(levels) and levels[i][0] < start:
            i += 1
        base = before[i] if absolute else 0
        j, held, top = i, base, base
        while j < len(levels) and levels[j][0] <= end:
            held += levels[j][1]
            top = max(top, held)
            j += 1
        out.setdefault(name, []).append(top)
    return peak, out


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / b if b else math.inf
