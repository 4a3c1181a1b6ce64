"""Stable heads only: each KV head's class over disjoint views of the traffic (time windows,
context buckets, phases), an agreement score per layer, and the heads whose class changes.

A *view* is one accumulator of statistics over a disjoint part of the traffic: an epoch of
the API server's ring (``epoch:<i>``, compared only when there are two or more: a lone epoch
is the whole of the buckets it would be compared with) or a stratum (``<phase>:<bucket>``).

Views compare **roles** (:data:`ROLES`): ``sink``, ``streaming`` and ``local`` are one role,
``windowed`` (each is served by sinks + a window; how large a window is what the merged,
traffic-weighted statistics decide, and a head necessarily looks more local in short prompts,
where no large window can bind), beside ``near_uniform`` and ``retrieval`` (a head of a
windowed class that no window serves is kept full like one, and rates ``retrieval``).

**A view rates a KV head only when its sample decides the head's role** (otherwise the
head is not rated there; a class that sampling error alone could move is not a rating):

* the view stands on at least :data:`MIN_VIEW_REQUESTS` folded requests (decode: sequences):
  a bucket of one request does not vote like one of hundreds;
* every rule behind the role is decided at :data:`STABILITY_Z` standard errors: window
  decisions by their Wilson bounds (:func:`.classify.window_decisions` at that z); the
  sink-mass, entropy and far-top-1 rules by the mean's margin to its threshold against its
  standard error (sink mass: the bound sqrt(m (1 - m) / n_eff) of a [0, 1] quantity; entropy:
  the detail queries' spread; far top-1: Wilson). Where an outcome is within noise every
  outcome is tried (:func:`.classify.q_head_class`, so undecided windows below the first
  passing one too), and the head is rated only when all give one role;
* a window passes for the role only where the view also saw queries at the next grid window
  (its contexts reach at least twice as far); a pass in shorter contexts is undecided: in
  contexts of 200 tokens a window of 128 passes for almost any head, which says nothing
  about its role (on the demo, short chats "windowed" heads that every longer bucket keeps
  full; and a head served by w=512 in every bucket reads as retrieval in the 512-1023 one
  if its trivial pass at 512 is dropped instead).

* **dynamic**: a KV head rated with two different roles by two views (windowed in short
  prompts, retrieval in long ones; or a retrieval head only at some hours). Dynamic heads get
  no window (:func:`.classify.classify` ``dynamic=``: class ``dynamic``, window ``full``):
  the post-stratified merge would window a head whose retrieval behaviour sits in a bucket
  of little traffic.
* **agreement per layer**: Fleiss' kappa with subjects = the layer's KV heads, raters = the
  views that rate each one (a variable number per subject), categories = the roles. With
  n_ij the views rating head i as class j and n_i = sum_j n_ij (heads with n_i >= 2 only):
  P_i = sum_j n_ij (n_ij - 1) / (n_i (n_i - 1)), P-bar = mean_i P_i (observed agreement),
  p_j = sum_i n_ij / sum_i n_i, P_e = sum_j p_j^2 (chance agreement) and
  kappa = (P-bar - P_e) / (1 - P_e): 1 when every view agrees, 0 at chance level. With two
  views it is Scott's pi (Cohen's kappa with pooled marginals). Undefined (None) when fewer
  than one head is rated twice, or when P_e = 1 (one class everywhere: P-bar is then 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import (
    CLASSES,
    Thresholds,
    q_head_class,
    window_decisions,
)
from attnprof.analyze.sparsity.confidence import wilson_bounds
from attnprof.contracts.snapshot import HeadStability, LayerAgreement

__all__ = ["MIN_VIEW_REQUESTS", "ROLES", "STABILITY_Z", "StabilityResult", "fleiss_kappa",
           "rated_classes", "stability", "stability_views"]

ROLES = {"sink": "windowed", "streaming": "windowed", "local": "windowed",
         "near_uniform": "near_uniform", "retrieval": "retrieval"}
"""Class -> role compared across views (``unknown`` rates nothing)."""


def fleiss_kappa(counts: Any) -> tuple[float | None, float | None]:
    """(kappa, observed agreement P-bar) for ``counts`` [subjects, categories]: n_ij raters
    putting subject i in category j, any number of raters per subject (subjects rated by
    fewer than two are skipped). See the module docstring for the definition."""
    n = np.asarray(counts, dtype=np.float64)
    if n.ndim != 2:
        raise ValueError("counts must be [subjects, categories]")
    ni = n.sum(1)
    keep = ni >= 2
    if not keep.any():
        return None, None
    n, ni = n[keep], ni[keep]
    p_i = (n * (n - 1)).sum(1) / (ni * (ni - 1))
    p_bar = float(p_i.mean())
    p_j = n.sum(0) / ni.sum()
    p_e = float((p_j ** 2).sum())
    if p_e >= 1 - 1e-12:
        return None, p_bar
    return (p_bar - p_e) / (1 - p_e), p_bar


MIN_VIEW_REQUESTS = 8
"""Folded requests (decode: sequences) a view needs before it rates any head."""
STABILITY_Z = 2.0
"""Standard errors every rule behind a view's rating must clear (~97.7% one-sided)."""

_WINDOWED = frozenset(c for c, r in ROLES.items() if r == "windowed")
_SEVERITY = {c: i for i, c in enumerate(CLASSES)}


def _outcomes(value: float, se: float, threshold: float, z: float) -> tuple[bool, ...]:
    """The outcomes of ``value >= threshold`` the sampling error allows: one when the
    margin clears ``z`` standard errors, both otherwise (NaN: only False, as classify)."""
    if not math.isfinite(value):
        return (False,)
    if not math.isfinite(se):
        return (False, True)
    if value - z * se >= threshold:
        return (True,)
    if value + z * se < threshold:
        return (False,)
    return (False, True)


def _bound_outcomes(low: float, high: float, threshold: float) -> tuple[bool, ...]:
    """Outcomes of ``share >= threshold`` for a share with Wilson bounds (low, high)
    (NaN: no evidence, only False, as classify)."""
    if not math.isfinite(low) or not math.isfinite(high):
        return (False,)
    if low >= threshold:
        return (True,)
    if high < threshold:
        return (False,)
    return (False, True)


def _entropy_se(acc: HeadStatsAccumulator) -> Any:
    """Standard error of the mean normalized entropy per [layer, q head]: the detail
    queries' weighted spread from their histogram (plus the bins' own width) over the
    square root of their raw count."""
    h = acc.entropy_hist
    nb = h.shape[-1]
    mid = (np.arange(nb) + 0.5) / nb
    tot = h.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = (h * mid).sum(-1) / tot
        var = (h * (mid - m[..., None]) ** 2).sum(-1) / tot + 1 / (12 * nb * nb)
        return np.where(acc.detail_n >= 2, np.sqrt(var / np.maximum(acc.detail_n, 1)), np.inf)


def rated_classes(acc: HeadStatsAccumulator, th: Thresholds, z: float = STABILITY_Z,
                  min_requests: int = MIN_VIEW_REQUESTS) -> list[list[str | None]]:
    """Per [layer][KV head]: the view's role (:data:`ROLES`) where its sample decides it,
    else None (see the module docstring)."""
    L, kvh, g = acc.num_layers, acc.num_kv_heads, acc.group_size
    if float(acc.requests.max(initial=0)) < min_requests:
        return [[None] * kvh for _ in range(L)]
    tz = replace(th, confidence_z=max(th.confidence_z, z))
    si = acc.sinks_grid.index(tz.sinks) if tz.sinks in acc.sinks_grid else None
    if si is None:
        raise ValueError(f"sinks={tz.sinks} is not in the statistics' grid {acc.sinks_grid}")
    grid = list(acc.window_grid)
    dec = window_decisions(acc, tz)["decision"]  # [L, Hq, W]
    # a window passes for the role only where the view saw queries at the next grid window
    # too; a pass in contexts too short for that is undecided (a fail there is a fail)
    seen = acc.cov_n[:, :, si, :] >= tz.min_queries
    beyond = np.concatenate([seen[..., 1:], np.ones_like(seen[..., :1])], axis=-1)
    dec = np.where(beyond | (dec != 1), dec, 0.0)
    means = acc.per_head_means()
    neff = acc.n_eff()[:, :, si, :]
    ent_se = _entropy_se(acc)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = acc.top1_out[:, :, si, :] / np.maximum(acc.cov_w[:, :, si, :], 1e-300)
    far = wilson_bounds(share * neff, neff, z)  # far top-1 share's bounds [L, Hq, W]
    out: list[list[str | None]] = []
    for layer in range(L):
        norms = means["output_norm"][layer]
        norm_cut = (float(np.nanquantile(norms, tz.dormant_norm_quantile))
                    if np.isfinite(norms).all() else None)
        row: list[str | None] = []
        for kv in range(kvh):
            combos: set[tuple[str, str]] = {("sink", "finite")}  # the identity of the fold
            for h in range(kv * g, (kv + 1) * g):
                mine = _q_outcomes(tz, layer, h, dec[layer, h], grid, means, neff, ent_se,
                                   far, si, norm_cut, z)
                combos = {_fold(a, b) for a in combos for b in mine}
            roles = {_role(c, w) for c, w in combos}
            row.append(roles.pop() if len(roles) == 1 else None)
        out.append(row)
    return out


def _q_outcomes(th: Thresholds, layer: int, h: int, dec: Any, grid: list[int],
                means: dict[str, Any], neff: Any, ent_se: Any, far: tuple[Any, Any], si: int,
                norm_cut: float | None, z: float) -> set[tuple[str, str]]:
    """Every (class, window kind) one query head can have within its sampling error."""
    tested = np.flatnonzero(~np.isnan(dec))
    if not len(tested):
        return {("unknown", "nan")}
    passing = np.flatnonzero(dec == 1)
    first = int(passing[0]) if len(passing) else len(grid)
    # w* is the first passing window, or any undecided one before it (inf: none passes)
    cand = [i for i in tested if i < first and dec[i] == 0] + [first]
    m_sink = float(means["sink_mass"][layer, h, si])
    n0 = float(neff[layer, h, 0])
    se_sink = math.sqrt(max(m_sink * (1 - m_sink), 0.0) / n0) if n0 > 0 else math.inf
    dormant = norm_cut is None or means["output_norm"][layer, h] <= norm_cut
    sinks = tuple(o and bool(dormant) for o in _outcomes(m_sink, se_sink, th.sink_mass, z))
    uniform = _outcomes(float(means["entropy"][layer, h]), float(ent_se[layer, h]),
                        th.near_uniform_entropy, z)
    all_tested = len(tested) == len(grid)
    out: set[tuple[str, str]] = set()
    for i in cand:
        w = float(grid[i]) if i < len(grid) else math.inf
        at = i if i < len(grid) else int(tested[-1])
        fars = _bound_outcomes(float(far[0][layer, h, at]), float(far[1][layer, h, at]),
                               th.retrieval_top1_rate)
        for s_ in sinks:
            for u in uniform:
                for f in fars:
                    c, wq = q_head_class(w, sink=s_, uniform=u, far=f, all_tested=all_tested,
                                         th=th)
                    out.add((c, "nan" if math.isnan(wq) else "inf" if math.isinf(wq)
                             else "finite"))
    return out


def _fold(a: tuple[str, str], b: tuple[str, str]) -> tuple[str, str]:
    """A KV head's (class, window kind) from two of its query heads': the most severe
    class; the window full if either is, unknown if either is (as classify)."""
    c = min(a[0], b[0], key=_SEVERITY.__getitem__)
    w = "inf" if "inf" in (a[1], b[1]) else "nan" if "nan" in (a[1], b[1]) else "finite"
    return c, w


def _role(cls: str, window: str) -> str | None:
    if cls == "unknown":
        return None
    if cls in _WINDOWED and window != "finite":
        return "retrieval"  # no window serves it: kept full like a retrieval head
    return ROLES.get(cls)


@dataclass(frozen=True)
class StabilityResult:
    """:func:`stability`: the contract record and the mask classify takes."""

    record: HeadStability
    dynamic: Any
    """bool [layer, KV head]: rated with two different classes."""
    classes: dict[str, list[list[str | None]]]
    """Each view's rated roles (None: not rated)."""


def stability(views: Mapping[str, HeadStatsAccumulator], th: Thresholds | None = None, *,
              z: float = STABILITY_Z, min_requests: int = MIN_VIEW_REQUESTS
              ) -> StabilityResult | None:
    """Classes per view, dynamic KV heads and per-layer agreement; None without views.
    Views must share one shape (``ValueError`` otherwise). The record names the views that
    rate (those standing on ``min_requests`` requests); thinner ones are left out."""
    th = (th or Thresholds()).validate()
    items = [(k, a) for k, a in views.items() if a.queries.sum() > 0]
    if not items:
        return None
    first = items[0][1]
    shape = (first.num_layers, first.num_kv_heads)
    for _, a in items:
        if (a.num_layers, a.num_kv_heads, a.group_size) != (*shape, first.group_size):
            raise ValueError("stability views must share one model shape")
    items = [(k, a) for k, a in items if float(a.requests.max(initial=0)) >= min_requests]
    rated = {k: rated_classes(a, th, z, min_requests) for k, a in items}
    cats = tuple(dict.fromkeys(ROLES.values()))
    dynamic: Any = np.zeros(shape, dtype=bool)
    layers: list[LayerAgreement] = []
    for layer in range(shape[0]):
        counts = np.zeros((shape[1], len(cats)))
        for kv in range(shape[1]):
            seen = {r[layer][kv] for r in rated.values()} - {None}
            dynamic[layer, kv] = len(seen) > 1
            for r in rated.values():
                c = r[layer][kv]
                if c is not None:
                    counts[kv, cats.index(c)] += 1
        kappa, agree = fleiss_kappa(counts)
        layers.append(LayerAgreement(
            layer=layer, kappa=None if kappa is None else round(kappa, 4),
            agreement=None if agree is None else round(agree, 4),
            rated_kv_heads=int((counts.sum(1) >= 2).sum()),
            dynamic_kv_heads=[int(x) for x in np.flatnonzero(dynamic[layer])]))
    total = shape[0] * shape[1]
    n_dyn = int(dynamic.sum())
    rec = HeadStability(views=[k for k, _ in items], kv_heads=total, dynamic_kv_heads=n_dyn,
                        dynamic_share=round(n_dyn / total, 4), layers=layers)
    return StabilityResult(rec, dynamic, rated)


def stability_views(strata: Mapping[tuple[str, int], HeadStatsAccumulator],
                    epochs: Sequence[HeadStatsAccumulator] = (),
                    phases: Sequence[str] = ("prefill", "decode")
                    ) -> dict[str, HeadStatsAccumulator]:
    """The views :func:`stability` compares: each epoch (disjoint time windows, oldest
    first) and each stratum of ``phases`` (context buckets; decode beside prefill says
    whether generation attends like the prompt). Epochs of another shape than the strata
    (a model whose later pipeline stages reported late) are left out, and so is a lone
    epoch: it is the whole of the prefill buckets it would be compared with."""
    shapes = {(a.num_layers, a.num_kv_heads, a.group_size) for a in strata.values()}
    same = [a for a in epochs
            if not shapes or (a.num_layers, a.num_kv_heads, a.group_size) in shapes]
    out: dict[str, HeadStatsAccumulator] = (
        {f"epoch:{i}": a for i, a in enumerate(same)} if len(same) > 1 else {})
    for (phase, lo), a in sorted(strata.items(), key=lambda kv: (phases.index(kv[0][0])
                                                                 if kv[0][0] in phases else 9,
                                                                 kv[0][1])):
        if phase in phases:
            out[f"{phase}:{lo}"] = a
    return out
