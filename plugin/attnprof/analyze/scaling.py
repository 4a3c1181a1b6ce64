"""Sequence-length scaling: per-path micro-benchmarks, fits, and OOM prediction.

Time and memory of attention grow as ``a + b*L + c*L^2``: fused paths have c (time) from the
QK^T/PV FLOPs but no quadratic memory; unfused paths (math, eager) hold the score matrix, so
memory has a quadratic term too. :func:`fit_poly2` fits the three terms by least squares
(non-negative c); :func:`predict_max` inverts a fitted memory curve against a budget.

OOM predictions (:func:`predict_oom`) never rest on the fit alone. A fit through a few short
lengths cannot see the score matrices an unfused path must hold at long lengths (two points
give no L^2 term at all), so the analytic memory model (:mod:`attnprof.analyze.memory`) sets a
floor under the predicted peak: weights + the KV cache held up to each layer + that layer's
modeled attention peak on the path it actually ran (+ eager's model-level mask). The predicted
peak is ``max(floor(L) + R(L), F(L))``: ``R`` fits what the measured attention-moment peaks hold
beyond the floor (hidden states; non-negative, so never below the floor), ``F`` fits the
whole forward's peak linearly (logits and MLP activations, which grow with L only). The
prediction is thus never past the analytic bound (the largest L the floor alone allows).
Each prediction carries its extrapolation factor and a confidence (:func:`confidence`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attnprof.analyze.memory import (
    AttnShape,
    analytic_attention_peak,
    kv_bytes_per_token,
    measure_peak,
    model_mask_bytes,
)

__all__ = [
    "CONFIDENCE_RULE",
    "EXTRAPOLATION_LIMIT",
    "PATHS",
    "analytic_path",
    "bench_path",
    "confidence",
    "eval_poly2",
    "fit_poly2",
    "forward_floor",
    "make_inputs",
    "predict_max",
    "predict_oom",
    "run_path",
    "run_paths",
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


# --- OOM prediction bounded by the analytic memory model -----------------------------------

EXTRAPOLATION_LIMIT = 4.0
"""Beyond this extrapolation factor (predicted length / longest measured length) every output
says the prediction is an extrapolation. Its confidence is then low unless a run at the
predicted length validated it (measured peak within 5%, under the budget): a validated
prediction is high at any factor (see :data:`CONFIDENCE_RULE`)."""

CONFIDENCE_RULE = (
    "high: validated by a run at the predicted length (measured peak within 5% and under the "
    "budget), or at most 2x the longest measured length; medium: at most "
    f"{EXTRAPOLATION_LIMIT:g}x; low: beyond {EXTRAPOLATION_LIMIT:g}x (an extrapolation), or "
    "no length fits the budget; one level lower when the analytic attention model misses the "
    "measured attention peaks by more than 10%")

def analytic_path(kernel: str | None) -> str:
    """The memory model's path for a kernel-map kernel: eager, math, or flash_cpu (every
    fused kernel holds no score matrix; the CPU tiles bound the GPU ones from above)."""
    if kernel in ("eager", "math"):
        return str(kernel)
    return "flash_cpu"


def run_paths(activation_map: Sequence[dict[str, Any]], num_layers: int) -> list[str]:
    """The attention path each layer ran for an unpadded prefill (the calls the scaling runs
    make), from the kernel map; the longest length bucket wins (the dispatcher may change
    kernel with length). Layers without such a row take their costliest kernel seen."""
    best: dict[int, tuple[int, str]] = {}
    seen: dict[int, set[str]] = {}
    for r in activation_map:
        i = int(r["layer_idx"])
        seen.setdefault(i, set()).add(analytic_path(r.get("kernel")))
        if r.get("phase") == "prefill" and r.get("mask") == "none":
            b = int(r.get("length_bucket") or 0)
            if i not in best or b >= best[i][0]:
                best[i] = (b, analytic_path(r.get("kernel")))
    order = {"eager": 0, "math": 1, "flash_cpu": 2}
    out = []
    for i in range(num_layers):
        if i in best:
            out.append(best[i][1])
        else:
            out.append(min(seen.get(i, {"flash_cpu"}), key=order.__getitem__))
    return out


def run_sites(activation_map: Sequence[dict[str, Any]], num_layers: int
              ) -> list[dict[str, Any]]:
    """Each attention site's path (as :func:`run_paths`), in model order: ``stack``,
    ``layer``, ``kind``, ``label`` and ``path``. Sites are told apart by (stack, layer,
    kind), so an encoder-decoder's encoder.L0, decoder.L0 and decoder.L0.cross are three
    sites; a single-stack model without rows for some layers gets them as plain sites."""
    from attnprof.facts.shape import layer_label, site_order

    best: dict[tuple[Any, ...], tuple[int, str]] = {}
    seen: dict[tuple[Any, ...], set[str]] = {}
    for r in activation_map:
        key = (r.get("stack"), int(r["layer_idx"]), r.get("kind") or "self")
        seen.setdefault(key, set()).add(analytic_path(r.get("kernel")))
        if r.get("phase") == "prefill" and r.get("mask") == "none":
            b = int(r.get("length_bucket") or 0)
            if key not in best or b >= best[key][0]:
                best[key] = (b, analytic_path(r.get("kernel")))
    if not any(k[0] is not None for k in seen):
        for i in range(num_layers):
            seen.setdefault((None, i, "self"), set())
    order = {"eager": 0, "math": 1, "flash_cpu": 2}
    out = []
    for key in sorted(seen, key=lambda k: site_order(k[0], k[1], k[2])):
        stack, i, kind = key
        path = best[key][1] if key in best else min(seen[key] or {"flash_cpu"},
                                                    key=order.__getitem__)
        out.append({"stack": stack, "layer": i, "kind": kind,
                    "label": layer_label(i, stack, kind), "path": path})
    return out


@dataclass(frozen=True)
class FloorSite:
    """One attention site of a prefill forward, in execution order, for
    :func:`forward_floor`: the path it runs, its own mask, whether it writes a KV cache
    (decoder self- and cross-attention do; encoder layers hold none), whether its queries
    are an encoder-decoder's decoder (``decoder_len(L)`` of them) and its keys the
    encoder's (cross-attention), and its sliding window."""

    path: str
    causal: bool = True
    keeps_kv: bool = True
    decoder: bool = False
    cross: bool = False
    window: int | None = None


def forward_floor(L: int, *, static_bytes: float, batch: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, dtype: str, layer_paths: Sequence[str] = (),
                  layer_windows: Sequence[int | None] | None = None,
                  threads: int | None = None, sites: Sequence[FloorSite] | None = None,
                  decoder_len: Callable[[int], int] | None = None) -> float:
    """Analytic lower bound of a length-L prefill forward's peak: weights + max over sites
    of (KV cache written up to that site + its modeled attention peak) + eager's mask.

    ``sites`` (default: ``layer_paths``/``layer_windows`` as causal decoder layers) say each
    site's mask and KV: an encoder's self-attention is dense and keeps no KV, a decoder's
    self-attention over ``decoder_len(L)`` tokens keeps that many, cross-attention keeps the
    encoder's ``L``."""
    if sites is None:
        wins = list(layer_windows or [])
        sites = [FloorSite(p, window=wins[i] if i < len(wins) else None)
                 for i, p in enumerate(layer_paths)]
    per_tok = kv_bytes_per_token(num_kv_heads, head_dim, dtype)["per_layer"] * batch
    dec = decoder_len(L) if decoder_len is not None else L
    attn: dict[tuple[str, int, int, bool], float] = {}
    kv = top = mask = 0.0
    for s in sites:
        q = dec if s.decoder else L
        k = L if s.cross else q
        if s.keeps_kv:
            kv += per_tok * (k if s.window is None else min(k, int(s.window)))
        key = (s.path, q, k, s.causal)
        if key not in attn:
            attn[key] = analytic_attention_peak(
                AttnShape(batch, num_heads, num_kv_heads, q, k, head_dim, head_dim, dtype),
                s.path, causal=s.causal, threads=threads)["total"]
        top = max(top, kv + attn[key])
        if s.causal:  # eager's model-level float mask for a causal prefill
            mask = max(mask, model_mask_bytes(batch, q, k, s.path, dtype))
    return float(static_bytes) + top + mask


def confidence(factor: float | None, *, validated: bool = False,
               model_error: float | None = None) -> str:
    """high / medium / low by :data:`CONFIDENCE_RULE`."""
    if factor is None or factor <= 0:
        return "low"
    if validated:
        return "high"
    levels = ["low", "medium", "high"]
    i = 2 if factor <= 2 else (1 if factor <= EXTRAPOLATION_LIMIT else 0)
    if model_error is not None and model_error > 0.10:
        i = max(0, i - 1)
    return levels[i]


def predict_oom(lengths: Sequence[int], peaks: Sequence[float], budget: float,
                floor: Callable[[int], float], *,
                attention_peaks: Sequence[float] | None = None,
                model_error: float | None = None, hi: int = 1 << 24) -> dict[str, Any]:
    """The longest length whose predicted peak fits ``budget``, never past what the analytic
    ``floor`` allows.

    ``peaks``: measured peak bytes per length (whole forward, or one call); ``attention_peaks``:
    what was held at the highest attention call of each forward (default ``peaks``). Returns
    ``max_seq_len``, ``predicted_peak_bytes_at_max``, ``analytic_max_seq_len`` (the bound),
    ``fit_max_seq_len`` (the plain ``a + b*L + c*L^2`` fit's answer, for comparison),
    ``extrapolation_factor``, ``extrapolation``, ``confidence`` and a ``note``.
    """
    xs = [int(x) for x in lengths]
    att = list(attention_peaks) if attention_peaks is not None else list(peaks)
    # What the attention moment holds beyond the floor (non-negative terms; c only with 3+
    # lengths); the rest of the forward grows linearly with L.
    rest = fit_poly2(xs, [a - floor(x) for x, a in zip(xs, att, strict=True)])
    lin = fit_poly2(xs, list(peaks), quadratic=False)

    def est(x: int) -> float:
        return max(floor(x) + eval_poly2(rest, x), eval_poly2(lin, x))

    plain = fit_poly2(xs, list(peaks))
    L = predict_max(rest, budget, hi=hi, f=est)
    bound = predict_max(rest, budget, hi=hi, f=floor)
    fit_only = predict_max(plain, budget, hi=hi)
    longest = max(xs)
    factor = round(L / longest, 2) if L else None
    out: dict[str, Any] = {
        "max_seq_len": L, "predicted_peak_bytes_at_max": est(L) if L else None,
        "analytic_max_seq_len": bound, "fit_max_seq_len": fit_only,
        "extrapolation_factor": factor,
        "extrapolation": bool(factor is not None and factor > EXTRAPOLATION_LIMIT),
        "confidence": confidence(factor, model_error=model_error), "note": None,
    }
    if fit_only > bound:
        c_need = (floor(2 * longest) - 2 * floor(longest) + floor(0)) / (2.0 * longest**2)
        out["note"] = (
            f"the fit of the measured peaks alone (L^2 term {plain['c']:.1f} B/token^2 from "
            f"{len(xs)} lengths) would allow {fit_only:,} tokens, which the analytic model "
            f"rules out: the attention path must hold ~{c_need:.1f} B/token^2")
    return out

