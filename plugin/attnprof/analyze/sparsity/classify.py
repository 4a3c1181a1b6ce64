"""Head classification and per-head windows from :class:`HeadStatsAccumulator` statistics.

Rules (docs/sparsity.md; defaults from the project's sparsity notes, section 3). For a query
head, with s = ``Thresholds.sinks`` and C_q the ``quantile`` low quantile of coverage over
sampled queries that see more than s + w keys:

* window w*(head) = min{ w in grid : C_q(s, w) >= tau, with >= ``min_queries`` queries }
* ``sink`` (sink/dormant): mean sink mass >= ``sink_mass`` (and, when value vectors were
  seen, output norm in the layer's bottom ``dormant_norm_quantile``)
* ``streaming``: w* <= ``streaming_max_window``: fine with sinks + a small window
* ``near_uniform``: mean normalized entropy >= ``near_uniform_entropy``
* ``retrieval`` (keep full): no grid window reaches tau although every grid window was
  tested, or the top-1 key lies outside sinks + window for >= ``retrieval_top1_rate`` of
  queries (at w*, or at the largest tested window)
* ``local``: needs a window between ``streaming_max_window`` and the largest grid window
* ``unknown``: the sampled queries were too short to test any window, or every window they
  could test fails while larger ones stay untested (and no far top-1 reads were seen)
* ``dynamic`` (KV heads, when ``classify(..., dynamic=mask)`` is given): the head's class
  changes across time windows or context buckets (:mod:`.stability`); it gets no window
  (``full``), whatever the merged statistics say

Window decisions are three-valued (:func:`window_decisions`): with p the estimated share of
eligible queries whose coverage is below tau and n the effective sample size, a window
*passes* when the one-sided Wilson upper bound of p (``confidence_z``) is <= ``quantile``,
*fails* when the lower bound is > ``quantile``, and is *undecided* otherwise (the sampling
error straddles the target). Undecided never passes. Rows marked exact (every query of the
prompts, :meth:`HeadStatsAccumulator.set_exact`) have no sampling error: pass iff p <= q.

Under GQA the KV cache is per KV head: a KV head takes the largest w* and the most severe
class of its query heads; a layer-wide window is the max over its KV heads. A KV head's
window decision is fail if any query head fails, else undecided if any is undecided.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.confidence import wilson_bounds

__all__ = ["CLASSES", "DECISIONS", "DYNAMIC", "Classification", "KvHeadClass", "LayerClass",
           "Thresholds", "Window", "by_window", "classify", "head_windows", "kv_decisions",
           "q_head_class", "window_decisions"]

DECISIONS = {1: "pass", 0: "undecided", -1: "fail"}
"""Codes of :func:`window_decisions` (NaN: no evidence, fewer than ``min_queries``)."""

# Most to least severe: a KV head gets the first class any of its query heads has.
CLASSES = ("unknown", "retrieval", "near_uniform", "local", "streaming", "sink")
DYNAMIC = "dynamic"
"""A KV head's class when its class changes across views (:mod:`.stability`)."""


@dataclass(frozen=True)
class Thresholds:
    tau: float = 0.9
    """Coverage target: a window is fine for a head when C_q(s, w) >= tau."""
    quantile: float = 0.05
    """Low quantile q of coverage over sampled queries (failures are rare far-back reads)."""
    sinks: int = 4
    """Sink tokens s assumed when deciding windows (StreamingLLM uses 4)."""
    streaming_max_window: int = 256
    """Largest w* for a ``streaming`` head."""
    sink_mass: float = 0.3
    """Mean mass on the first s keys for a ``sink`` head (Gu et al. epsilon)."""
    dormant_norm_quantile: float = 0.1
    """With value vectors: a sink head's output norm must be in this bottom share of its layer."""
    near_uniform_entropy: float = 0.9
    """Mean entropy / log(keys seen) for ``near_uniform``."""
    retrieval_top1_rate: float = 0.02
    """Share of queries whose top-1 key lies outside sinks + w* that marks ``retrieval``."""
    min_queries: int = 8
    """Sampled queries a (head, s, w) cell needs to count as evidence."""
    confidence_z: float = 1.0
    """One-sided Wilson bound (on the effective sample size) on the share of queries below
    tau: a window passes when the upper bound is <= ``quantile``, fails when the lower bound
    is above it, and is undecided otherwise."""

    def validate(self) -> Thresholds:
        if not 0 < self.tau <= 1 or not 0 <= self.quantile < 1:
            raise ValueError("tau must be in (0, 1] and quantile in [0, 1)")
        if self.sinks < 0 or self.min_queries < 1:
            raise ValueError("sinks must be >= 0 and min_queries >= 1")
        return self


Window = int | Literal["full"] | None
"""A window w*: the smallest grid window that passes ("full": none does; None: no evidence)."""


def by_window(d: Mapping[int, Any]) -> dict[str, Any]:
    """A per-window mapping as JSON writes it (window keys as strings)."""
    return {str(w): v for w, v in d.items()}


@dataclass(frozen=True)
class KvHeadClass:
    """One KV head: its class, window and the statistics behind them, per grid window."""

    kv_head: int
    cls: str
    window: Window
    coverage_q: dict[int, float | None]
    coverage_n_eff: dict[int, float]
    coverage_se: dict[int, float | None]
    sink_mass: float | None
    entropy: float | None
    topk_fraction: float | None
    q_head_classes: tuple[str, ...]
    decision: dict[int, str | None]
    """``pass``, ``undecided`` or ``fail`` (None: no evidence) per grid window."""
    fail_share: dict[int, float | None]
    fail_share_upper: dict[int, float | None]
    exact: bool

    def to_json(self) -> dict[str, Any]:
        return {"kv_head": self.kv_head, "class": self.cls, "window": self.window,
                "coverage_q": by_window(self.coverage_q),
                "coverage_n_eff": by_window(self.coverage_n_eff),
                "coverage_se": by_window(self.coverage_se),
                "sink_mass": self.sink_mass, "entropy": self.entropy,
                "topk_fraction": self.topk_fraction, "q_head_classes": list(self.q_head_classes),
                "decision": by_window(self.decision), "fail_share": by_window(self.fail_share),
                "fail_share_upper": by_window(self.fail_share_upper), "exact": self.exact}


@dataclass(frozen=True)
class LayerClass:
    layer: int
    queries: int
    window: Window
    """The layer-wide window: the largest of its KV heads'."""
    classes: dict[str, int]
    sink_mass: float | None
    kv_heads: tuple[KvHeadClass, ...]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "queries": self.queries, "window": self.window,
                "classes": dict(self.classes), "sink_mass": self.sink_mass,
                "kv_heads": [k.to_json() for k in self.kv_heads]}


@dataclass(frozen=True)
class Classification:
    """:func:`.classify.classify`: every layer's KV heads."""

    thresholds: Thresholds
    window_grid: tuple[int, ...]
    class_counts: dict[str, int]
    layers: tuple[LayerClass, ...]
    undecided: dict[int, int]
    """KV heads per window whose sampling error straddles the target (never passed)."""
    decided_exactly_kv_heads: int

    def to_json(self) -> dict[str, Any]:
        return {"thresholds": asdict(self.thresholds), "window_grid": list(self.window_grid),
                "class_counts": dict(self.class_counts),
                "layers": [x.to_json() for x in self.layers],
                "undecided": by_window(self.undecided),
                "decided_exactly_kv_heads": self.decided_exactly_kv_heads}


def _sink_index(acc: HeadStatsAccumulator, sinks: int) -> int:
    if sinks not in acc.sinks_grid:
        raise ValueError(f"sinks={sinks} is not in the statistics' grid {acc.sinks_grid}")
    return acc.sinks_grid.index(sinks)


def window_decisions(acc: HeadStatsAccumulator, th: Thresholds, sinks: int | None = None
                     ) -> dict[str, Any]:
    """Three-valued window decisions per [layer, query head, window] at ``sinks``.

    Returns ``decision`` (1 pass, 0 undecided, -1 fail, NaN no evidence), ``share`` (the
    estimated share of eligible queries with coverage below tau), its Wilson bounds
    ``low``/``high`` (equal to the share on exact rows) and ``n_eff``."""
    si = _sink_index(acc, th.sinks if sinks is None else sinks)
    sure, maybe = acc.fail_share_range(th.tau)
    sure, maybe = sure[:, :, si, :], maybe[:, :, si, :]
    neff = acc.n_eff()[:, :, si, :]
    low, _ = wilson_bounds(sure * neff, neff, th.confidence_z)
    _, high = wilson_bounds(maybe * neff, neff, th.confidence_z)
    exact = acc.exact[:, :, None] & np.isfinite(maybe)
    low, high = np.where(exact, sure, low), np.where(exact, maybe, high)
    enough = acc.cov_n[:, :, si, :] >= th.min_queries
    q = th.quantile * (1 + 1e-12)
    dec = np.where(high <= q, 1.0, np.where(low > q, -1.0, 0.0))
    return {"decision": np.where(enough & np.isfinite(high), dec, np.nan), "share": maybe,
            "low": low, "high": high, "n_eff": neff}


def kv_decisions(decision: Any, group_size: int) -> Any:
    """[layer, KV head, window] from [layer, query head, window] codes: no evidence if any
    query head has none, else fail if any fails, else undecided if any is undecided."""
    d = decision.reshape(decision.shape[0], -1, group_size, decision.shape[-1])
    with np.errstate(invalid="ignore"):
        worst = np.min(np.nan_to_num(d, nan=-2.0), axis=2)
    return np.where(np.isnan(d).any(2), np.nan, worst)


def head_windows(acc: HeadStatsAccumulator, th: Thresholds, sinks: int | None = None) -> Any:
    """w* per [layer, query head]: the smallest grid window that passes (inf: none passes;
    nan: no evidence). Undecided windows never pass."""
    dec = window_decisions(acc, th, sinks)["decision"]  # [L, Hq, W]
    enough = ~np.isnan(dec)
    ok = dec == 1
    grid = np.asarray(acc.window_grid, dtype=float)
    first = np.argmax(ok, axis=-1)
    w = np.where(ok.any(-1), grid[first], math.inf)
    return np.where(enough.any(-1), w, math.nan)


def q_head_class(w: float, *, sink: bool, uniform: bool, far: bool, all_tested: bool,
                 th: Thresholds) -> tuple[str, float]:
    """(class, w*) of one query head from its smallest passing window ``w`` (inf: none
    passes; nan: no evidence) and the rules' outcomes: mean sink mass at or above
    ``sink_mass`` (and dormant when value norms were seen), mean entropy at or above
    ``near_uniform_entropy``, far top-1 reads at or above ``retrieval_top1_rate`` (at w*, or
    at the largest window tested when none passes), every grid window tested. The one
    definition of the rules' order (module docstring); :mod:`.stability` also calls it with
    each outcome a test could have within its sampling error."""
    if math.isnan(w):
        return "unknown", w
    if sink:
        return "sink", w
    if w <= th.streaming_max_window:
        return "streaming", w
    if uniform:
        return "near_uniform", w
    if math.isinf(w):
        # fails at every window the sample could test: retrieval when every grid window was
        # tested or far top-1 reads are seen, else undetermined
        return ("retrieval", w) if all_tested or far else ("unknown", math.nan)
    if far:
        return "retrieval", math.inf
    return "local", w


def classify(acc: HeadStatsAccumulator, th: Thresholds | None = None,
             dynamic: Any = None) -> Classification:
    """Per layer and KV head: class, window w*, and the statistics behind the decision.
    ``dynamic``: optional bool [layer, KV head] mask of heads whose class changes across
    views (:func:`.stability.stability`): they are ``dynamic`` with window ``full``."""
    th = (th or Thresholds()).validate()
    dyn = (np.zeros((acc.num_layers, acc.num_kv_heads), dtype=bool) if dynamic is None
           else np.asarray(dynamic, dtype=bool))
    if dyn.shape != (acc.num_layers, acc.num_kv_heads):
        raise ValueError(f"dynamic mask must be [{acc.num_layers}, {acc.num_kv_heads}]")
    si = _sink_index(acc, th.sinks)
    means = acc.per_head_means()
    wq = head_windows(acc, th)
    enough = acc.cov_n[:, :, si, :] >= th.min_queries
    cq = acc.coverage_quantile(th.quantile, th.confidence_z)[:, :, si, :]
    neff = acc.n_eff()[:, :, si, :]
    with np.errstate(invalid="ignore"):
        cse = acc.coverage_se()[:, :, si, :]
    wd = window_decisions(acc, th)
    kvd = kv_decisions(wd["decision"], acc.group_size)  # [L, KV, W]
    grid = list(acc.window_grid)
    g = acc.group_size
    layers: list[LayerClass] = []
    totals = dict.fromkeys((*CLASSES, DYNAMIC), 0)
    for layer in range(acc.num_layers):
        norms = means["output_norm"][layer]
        norm_cut = (float(np.nanquantile(norms, th.dormant_norm_quantile))
                    if np.isfinite(norms).all() else None)
        qclass: list[str] = []
        for h in range(acc.num_q_heads):
            w = wq[layer, h]
            tested = np.flatnonzero(enough[layer, h])
            # far top-1 reads at w*, or at the largest window tested when none passes
            at = (grid.index(int(w)) if math.isfinite(w) else tested[-1]) if len(tested) \
                else 0
            c, wq[layer, h] = q_head_class(
                w, sink=(float(means["sink_mass"][layer, h, si]) >= th.sink_mass
                         and (norm_cut is None or norms[h] <= norm_cut)),
                uniform=float(means["entropy"][layer, h]) >= th.near_uniform_entropy,
                far=float(means["top1_outside"][layer, h, si, at]) >= th.retrieval_top1_rate,
                all_tested=len(tested) == len(grid), th=th)
            qclass.append(c)
        kv_heads: list[KvHeadClass] = []
        for kv in range(acc.num_kv_heads):
            hs = range(kv * g, (kv + 1) * g)
            cls_ = min((qclass[h] for h in hs), key=CLASSES.index)
            ws = [wq[layer, h] for h in hs]
            w_kv = (math.inf if any(math.isinf(x) for x in ws)
                    else math.nan if any(math.isnan(x) for x in ws) else max(ws))
            if dyn[layer, kv]:  # its class changes with time or context: keep it full
                cls_, w_kv = DYNAMIC, math.inf
            totals[cls_] += 1
            hl = list(hs)
            kv_heads.append(KvHeadClass(
                kv_head=kv, cls=cls_, window=_w(w_kv),
                coverage_q={w: _r(float(np.nanmin(cq[layer, hl, i])))
                            if np.isfinite(cq[layer, hl, i]).any() else None
                            for i, w in enumerate(grid)},
                # sampling error behind coverage_q: effective sample size (fewest of the
                # group) and the largest standard error of the group's mean coverage
                coverage_n_eff={w: round(float(neff[layer, hl, i].min()), 1)
                                for i, w in enumerate(grid)},
                coverage_se={w: _r(float(np.nanmax(cse[layer, hl, i])))
                             if np.isfinite(cse[layer, hl, i]).any() else None
                             for i, w in enumerate(grid)},
                sink_mass=_r(float(np.mean([means["sink_mass"][layer, h, si] for h in hs]))),
                entropy=_r(float(np.mean([means["entropy"][layer, h] for h in hs]))),
                topk_fraction=_r(float(np.mean([means["topk_fraction"][layer, h] for h in hs]))),
                q_head_classes=tuple(qclass[h] for h in hs),
                # three-valued decision per window and the failing share behind it (the
                # group's worst query head; upper: its Wilson bound, = share when exact)
                decision={w: _decision(kvd[layer, kv, i]) for i, w in enumerate(grid)},
                fail_share={w: _rmax(wd["share"][layer, hl, i]) for i, w in enumerate(grid)},
                fail_share_upper={w: _rmax(wd["high"][layer, hl, i])
                                  for i, w in enumerate(grid)},
                exact=bool(acc.exact[layer, hl].all()),
            ))
        layers.append(LayerClass(
            layer=layer,
            queries=int(acc.queries[layer].max()),
            window=_layer_window([k.window for k in kv_heads]),
            classes={c: sum(k.cls == c for k in kv_heads) for c in (*CLASSES, DYNAMIC)
                     if any(k.cls == c for k in kv_heads)},
            sink_mass=_r(float(means["sink_mass"][layer, :, si].mean())),
            kv_heads=tuple(kv_heads),
        ))
    undecided = {w: int((kvd[..., i] == 0).sum()) for i, w in enumerate(grid)}
    return Classification(
        thresholds=th, window_grid=tuple(grid),
        class_counts={c: n for c, n in totals.items() if n}, layers=tuple(layers),
        # KV heads per window whose sampling error straddles the target (never passed)
        undecided={w: n for w, n in undecided.items() if n},
        decided_exactly_kv_heads=int(acc.exact.reshape(acc.num_layers, -1,
                                                       acc.group_size).all(-1).sum()))


def _decision(code: float) -> str | None:
    return None if math.isnan(code) else DECISIONS[int(code)]


def _rmax(x: Any) -> float | None:
    x = np.asarray(x, dtype=float)
    return _r(float(np.nanmax(x))) if np.isfinite(x).any() else None


def _layer_window(ws: list[Window]) -> Window:
    if "full" in ws:
        return "full"
    ints = [w for w in ws if isinstance(w, int)]
    return max(ints) if ints and len(ints) == len(ws) else None


def _w(w: float) -> Window:
    if math.isnan(w):
        return None
    return "full" if math.isinf(w) else int(w)


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)
