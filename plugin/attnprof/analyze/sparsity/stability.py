"""Stable heads only: each KV head's class over disjoint views of the traffic (time windows,
context buckets, phases), an agreement score per layer, and the heads whose class changes.

A *view* is one accumulator of statistics over a disjoint part of the traffic: an epoch of
the API server's ring (``epoch:<i>``) or a stratum (``<phase>:<bucket>``). Each view is
classified on its own (:func:`.classify.classify`). A view *rates* a KV head only when its
sample decides that head: the head's class is not ``unknown`` and none of the grid windows
the view could test for it is undecided (no Wilson interval of the failing share straddles
the target). A class that sampling error alone could still move is not a rating, so a thin
epoch does not make a head look dynamic.

Views compare **roles** (:data:`ROLES`): ``sink``, ``streaming`` and ``local`` are one role,
``windowed`` (each is served by sinks + a window; how large a window is what the merged,
traffic-weighted statistics decide, and a head necessarily looks more local in short prompts,
where no large window can bind), beside ``near_uniform`` and ``retrieval``.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import Thresholds, classify
from attnprof.contracts.snapshot import HeadStability, LayerAgreement

__all__ = ["ROLES", "StabilityResult", "fleiss_kappa", "rated_classes", "stability",
           "stability_views"]

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


def rated_classes(acc: HeadStatsAccumulator, th: Thresholds) -> list[list[str | None]]:
    """Per [layer][KV head]: the view's role (:data:`ROLES`) where its sample decides it,
    else None."""
    cls = classify(acc, th)
    out: list[list[str | None]] = []
    for layer in cls.layers:
        row: list[str | None] = []
        for kv in layer.kv_heads:
            undecided = any(d == "undecided" for d in kv.decision.values())
            row.append(None if undecided else ROLES.get(kv.cls))
        out.append(row)
    return out


@dataclass(frozen=True)
class StabilityResult:
    """:func:`stability`: the contract record and the mask classify takes."""

    record: HeadStability
    dynamic: Any
    """bool [layer, KV head]: rated with two different classes."""
    classes: dict[str, list[list[str | None]]]
    """Each view's rated roles (None: not rated)."""


def stability(views: Mapping[str, HeadStatsAccumulator], th: Thresholds | None = None
              ) -> StabilityResult | None:
    """Classes per view, dynamic KV heads and per-layer agreement; None without views.
    Views must share one shape (``ValueError`` otherwise)."""
    th = (th or Thresholds()).validate()
    items = [(k, a) for k, a in views.items() if a.queries.sum() > 0]
    if not items:
        return None
    first = items[0][1]
    shape = (first.num_layers, first.num_kv_heads)
    for _, a in items:
        if (a.num_layers, a.num_kv_heads, a.group_size) != (*shape, first.group_size):
            raise ValueError("stability views must share one model shape")
    rated = {k: rated_classes(a, th) for k, a in items}
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
    (a model whose later pipeline stages reported late) are left out."""
    shapes = {(a.num_layers, a.num_kv_heads, a.group_size) for a in strata.values()}
    out: dict[str, HeadStatsAccumulator] = {
        f"epoch:{i}": a for i, a in enumerate(epochs)
        if not shapes or (a.num_layers, a.num_kv_heads, a.group_size) in shapes}
    for (phase, lo), a in sorted(strata.items(), key=lambda kv: (phases.index(kv[0][0])
                                                                 if kv[0][0] in phases else 9,
                                                                 kv[0][1])):
        if phase in phases:
            out[f"{phase}:{lo}"] = a
    return out
