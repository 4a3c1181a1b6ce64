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
from dataclasses import dataclass, field

from attnprof.analyze.memory import rel_err
from attnprof.contracts.profile import Fit, LengthResult, PathResult, Scaling

__all__ = [
    "PATHS",
    "Bench",
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


@dataclass
class Bench:
    """The per-path micro-benchmarks (:mod:`attnprof.tools.scaling_bench`) at this model's
    layer shape: each path -> length -> value, in the order they ran."""

    time_s: dict[str, dict[int, float]] = field(default_factory=dict)
    peak_bytes: dict[str, dict[int, float]] = field(default_factory=dict)
    analytic_bytes: dict[str, dict[int, float]] = field(default_factory=dict)
    """The analytic model's peak, for every length tried (skipped ones included)."""
    skipped: dict[str, dict[int, str]] = field(default_factory=dict)
    """Why a length was not run (its modeled peak would not fit here)."""


def _fit(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    f = fit_poly2(xs, ys)
    return Fit(a=f["a"], b=f["b"], c=f["c"], r2=f["r2"])


def scaling_summary(runs: Sequence[LengthResult], bench: Bench) -> Scaling:
    """profile.json's ``scaling``: the model's runs per length (``runs``, any order) with
    fits of the whole-model peak, attention time and forward time over length (two lengths
    or more), and per path the micro-benchmarks' times, peaks, fits and how far the analytic
    model is from the measured peaks."""
    by_len = sorted(runs, key=lambda r: r.seq_len)
    Ls = [r.seq_len for r in by_len]
    fits: dict[str, Fit] = {}
    if len(Ls) >= 2:
        fits["model_peak_total_bytes"] = _fit(Ls, [r.peak_total_bytes for r in by_len])
        fits["attention_time_s"] = _fit(Ls, [r.attention_s for r in by_len])
        fits["forward_time_s"] = _fit(Ls, [r.forward_s for r in by_len])
    paths: dict[str, PathResult] = {}
    for path in sorted(set(bench.time_s) | set(bench.skipped)):
        t = bench.time_s.get(path, {})
        m = bench.peak_bytes.get(path, {})
        analytic = bench.analytic_bytes.get(path, {})
        entry = PathResult(
            time_s={str(k): float(t[k]) for k in sorted(t)},
            peak_bytes={str(k): float(m[k]) for k in sorted(m)},
            analytic_peak_bytes={str(k): float(v) for k, v in analytic.items()},
            skipped={str(k): v for k, v in bench.skipped.get(path, {}).items()})
        if len(t) >= 2:
            entry.time_fit = _fit(sorted(t), [t[k] for k in sorted(t)])
            entry.memory_fit = _fit(sorted(m), [m[k] for k in sorted(m)])
        agree = [rel_err(float(analytic[L]), m[L]) for L in m if m[L] > 0]
        entry.analytic_vs_measured_max_rel_error = round(max(agree), 4) if agree else None
        paths[path] = entry
    return Scaling(by_seq_len=by_len, paths=paths, fits=fits)
