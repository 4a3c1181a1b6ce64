"""Sequence-length scaling: fits of time and memory against length, and their inversion.

Time and memory of attention grow as ``a + b*L + c*L^2``: fused paths have c (time) from the
QK^T/PV FLOPs but no quadratic memory; unfused paths (math, eager) hold the score matrix, so
memory has a quadratic term too. :func:`fit_poly2` fits the three terms by least squares
(non-negative c); :func:`predict_max` inverts a fitted memory curve against a budget;
:func:`scaling_summary` fits what ``attnprof profile`` measured. The micro-benchmarks that
measure the paths are :mod:`attnprof.tools.scaling_bench`; the OOM prediction, bounded by the
analytic memory model, is :mod:`attnprof.analyze.oom`. Pure: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from attnprof.analyze.memory import rel_err

__all__ = [
    "PATHS",
    "doubling_ratio",
    "eval_poly2",
    "fit_poly2",
    "predict_max",
    "scaling_summary",
]

PATHS = ("flash_cpu", "math", "eager")


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


def scaling_summary(per_len: dict[int, dict[str, Any]], bench: dict[str, Any]
                    ) -> dict[str, Any]:
    """profile.json's ``scaling``: the model's runs per length (``per_len``) with fits of the
    whole-model peak, attention time and forward time over length, and per path the
    micro-benchmarks' (``bench``: ``time_s``, ``peak_bytes``, ``analytic_bytes``,
    ``skipped``, each path -> str(length) -> value) times, peaks, fits and how far the
    analytic model is from the measured peaks."""
    Ls = sorted(per_len)
    res: dict[str, Any] = {"by_seq_len": [per_len[L] for L in Ls], "paths": {}, "fits": {}}
    if len(Ls) >= 2:
        res["fits"]["model_peak_total_bytes"] = fit_poly2(
            Ls, [per_len[L]["peak_total_bytes"] for L in Ls])
        res["fits"]["attention_time_s"] = fit_poly2(
            Ls, [per_len[L]["attention_s"] for L in Ls])
        res["fits"]["forward_time_s"] = fit_poly2(
            Ls, [per_len[L]["forward_s"] for L in Ls])
    for path in sorted(set(bench["time_s"]) | set(bench["skipped"])):
        t = {int(k): v for k, v in bench["time_s"].get(path, {}).items()}
        m = {int(k): v for k, v in bench["peak_bytes"].get(path, {}).items()}
        entry: dict[str, Any] = {
            "time_s": {str(k): v for k, v in sorted(t.items())},
            "peak_bytes": {str(k): v for k, v in sorted(m.items())},
            "analytic_peak_bytes": bench["analytic_bytes"].get(path, {}),
            "skipped": bench["skipped"].get(path, {}),
        }
        if len(t) >= 2:
            entry["time_fit"] = fit_poly2(sorted(t), [t[k] for k in sorted(t)])
            entry["memory_fit"] = fit_poly2(sorted(m), [m[k] for k in sorted(m)])
        agree = [rel_err(float(bench["analytic_bytes"][path][str(L)]), m[L])
                 for L in m if m[L] > 0]
        entry["analytic_vs_measured_max_rel_error"] = round(max(agree), 4) if agree else None
        res["paths"][path] = entry
    return res
