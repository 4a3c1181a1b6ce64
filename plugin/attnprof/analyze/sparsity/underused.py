"""Underused heads from :class:`HeadStatsAccumulator` statistics: dormant, near-uniform and
redundant query heads, each with the share of the model's KV cache it holds.

Rules (docs/sparsity.md, "Underused heads"), per query head of a layer:

* ``dormant``: at least ``dormant_share`` of the sampled queries that see >= 4 s keys put
  >= ``dormant_mass`` of their attention on the first s = ``sinks`` keys (a share of
  queries, not a mean: one early query with all its mass on the sinks does not make a head
  dormant, nor does a head that is dormant only on half the prompt), with at least
  ``min_queries`` such queries.
* ``near_uniform``: mean normalized entropy H / log(keys seen) >= ``near_uniform_entropy``
  over at least ``min_detail`` detail queries.
* ``redundant``: another query head of the same layer (its ``twin``) whose attention rows,
  on the detail queries, are at a mean Jensen-Shannon distance (base 2, in [0, 1]) <=
  ``redundant_js``, with at most ``redundant_far_share`` of those queries farther apart than
  :data:`~attnprof.aggregate.head_stats.JS_FAR`. A head already found dormant or
  near-uniform is not paired (those heads all look alike), and a twin is always a head that
  is kept (the lowest-numbered head of each group of look-alikes).

A finding says what the statistics show, never that dropping the head is harmless: ``safe``
stays false until ``attnprof validate-heads`` replays the model with the head's output
replaced (mean output for dormant and near-uniform heads, the twin's output for redundant
ones) and meets its agreement and KL targets.

KV share: the KV cache is stored per KV head, so a KV head's share is its layer's KV bytes
per KV head over the whole model's KV bytes (layers with a native sliding window hold
min(T, w) tokens; weighted by the traffic's context lengths when given, else every layer
counts the same). A query head owns no KV of its own: its ``kv_share`` is its KV head's
share divided evenly among the ``group_size`` query heads that read it (dropping one query
head of a group frees nothing until the whole group goes; ``kv_head_share`` says what
the group holds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from attnprof.aggregate.head_stats import JS_FAR, SINK_MASS_EDGES, HeadStatsAccumulator
from attnprof.analyze.sparsity.confidence import wilson_low as _wilson_low
from attnprof.analyze.sparsity.savings import LengthDistribution, kv_tokens
from attnprof.facts.shape import AttentionShape

__all__ = ["KINDS", "UnderusedThresholds", "find_underused", "kv_shares"]

KINDS = ("dormant", "near_uniform", "redundant")
_MAX_FINDINGS = 256  # bound exports; the counts stay exact


@dataclass(frozen=True)
class UnderusedThresholds:
    sinks: int = 4
    """The "first token(s)": mass on the first s keys (a positive value of the sinks grid)."""
    dormant_mass: float = 0.9
    """A query is sink-bound when >= this share of its mass is on the first s keys."""
    dormant_share: float = 0.95
    """A head is dormant when >= this share of its eligible sampled queries are sink-bound."""
    min_queries: int = 16
    """Eligible sampled queries a dormant finding needs."""
    near_uniform_entropy: float = 0.9
    """Mean normalized entropy (1.0: uniform over the keys seen) of a near-uniform head."""
    redundant_js: float = 0.05
    """Mean Jensen-Shannon distance (base 2) to the twin at most this."""
    redundant_far_share: float = 0.05
    """Share of detail queries where the pair is farther apart than JS_FAR, at most this."""
    min_detail: int = 4
    """Detail queries a near-uniform or redundant finding needs."""

    def validate(self, acc: HeadStatsAccumulator | None = None) -> UnderusedThresholds:
        if self.dormant_mass not in SINK_MASS_EDGES:
            raise ValueError(f"dormant_mass must be one of {SINK_MASS_EDGES}")
        if not 0 < self.dormant_share <= 1 or not 0 <= self.redundant_js <= 1 \
                or not 0 <= self.redundant_far_share <= 1 \
                or not 0 < self.near_uniform_entropy <= 1:
            raise ValueError("shares, entropy and JS thresholds must be in [0, 1]")
        if self.min_queries < 1 or self.min_detail < 1:
            raise ValueError("min_queries and min_detail must be >= 1")
        if acc is not None and (self.sinks <= 0 or self.sinks not in acc.sinks_grid):
            raise ValueError(f"sinks={self.sinks} is not a positive value of the statistics' "
                             f"grid {acc.sinks_grid}")
        return self


def kv_shares(num_layers: int, num_kv_heads: int, shape: AttentionShape | None = None,
              dist: LengthDistribution | None = None) -> tuple[Any, str]:
    """(share of the model's KV bytes held by one KV head of each layer [layers], basis).

    ``shape`` gives the native windows; ``dist`` the traffic's context lengths. Head dim
    and KV dtype are the same in every layer, so they cancel out of the share."""
    tokens = np.ones(num_layers)
    basis = "every layer holds the same KV per head (full attention everywhere)"
    if shape is not None and shape.hybrid:
        if dist is not None:
            tokens = np.asarray([dist.expect(kv_tokens(dist.t, shape.window(x)))
                                 for x in range(num_layers)])
            basis = ("expected KV tokens per layer over the traffic's context lengths "
                     "(sliding layers hold min(T, w))")
        else:
            basis = "no traffic lengths: every layer counted the same (sliding layers hold " \
                    "less on long requests)"
    elif dist is not None:
        basis = "every layer holds the same KV per head (full attention, any traffic)"
    total = tokens.sum() * num_kv_heads
    return tokens / total if total > 0 else np.full(num_layers, math.nan), basis


def find_underused(acc: HeadStatsAccumulator, th: UnderusedThresholds | None = None, *,
                   shape: AttentionShape | None = None, dist: LengthDistribution | None = None,
                   layers: Sequence[int] | None = None) -> dict[str, Any]:
    """Dormant, near-uniform and redundant query heads with their KV shares.

    Returns ``{"thresholds", "kv_share_basis", "counts", "findings", "heads_checked"}``;
    each finding has ``kind, layer, head, kv_head, twin, kv_share, kv_head_share, queries,
    evidence, confidence, safe (False: not replayed)``."""
    th = (th or UnderusedThresholds()).validate(acc)
    g = acc.group_size
    share, basis = kv_shares(acc.num_layers, acc.num_kv_heads, shape, dist)
    frac, n_elig = acc.sink_share_at_least(th.dormant_mass, th.sinks)
    means = acc.per_head_means()
    ent = means["entropy"]
    js = acc.js_mean()
    pair_w = acc.js_n + acc.js_n.transpose(0, 2, 1)  # weighted (all-query estimates)
    far = acc.js_far + acc.js_far.transpose(0, 2, 1)
    pair_k = acc.js_k + acc.js_k.transpose(0, 2, 1)  # detail queries behind them
    with np.errstate(invalid="ignore", divide="ignore"):
        far_share = far / np.maximum(pair_w, 1e-300)
        close = (pair_k >= th.min_detail) & (js <= th.redundant_js) \
            & (far_share <= th.redundant_far_share)  # NaN compares False
    findings: list[dict[str, Any]] = []
    checked = 0
    for layer in (range(acc.num_layers) if layers is None else layers):
        if acc.queries[layer].sum() <= 0:
            continue
        taken: set[int] = set()
        for h in range(acc.num_q_heads):
            checked += 1
            base = {"layer": layer, "head": h, "kv_head": h // g, "twin": None,
                    "kv_share": _r(share[layer] / g, 8), "kv_head_share": _r(share[layer], 8),
                    "safe": False}
            n = float(n_elig[layer, h])
            if n >= th.min_queries and frac[layer, h] >= th.dormant_share:
                low = _wilson_low(float(frac[layer, h]) * n, n)
                findings.append(base | {
                    "kind": "dormant", "queries": int(n),
                    "evidence": {"sink_bound_share": _r(float(frac[layer, h])),
                                 "sinks": th.sinks, "mass": th.dormant_mass,
                                 "sink_mass_mean": _r(float(means["sink_mass"][
                                     layer, h, acc.sinks_grid.index(th.sinks)]))},
                    "confidence": f"{float(frac[layer, h]):.1%} of prompt positions (estimated "
                                  f"from {int(n)} sampled queries) sink-bound; 95% lower "
                                  f"bound {low:.1%}"})
                taken.add(h)
                continue
            nd = float(acc.detail_n[layer, h])
            if nd >= th.min_detail and ent[layer, h] >= th.near_uniform_entropy:
                findings.append(base | {
                    "kind": "near_uniform", "queries": int(nd),
                    "evidence": {"entropy": _r(float(ent[layer, h]))},
                    "confidence": f"mean normalized entropy over {int(nd)} detail queries"})
                taken.add(h)
        kept_set: set[int] = set()
        for b in range(acc.num_q_heads):
            if b in taken:
                continue
            cands = [a for a in np.flatnonzero(close[layer, :, b]) if a in kept_set]
            if not cands:
                kept_set.add(b)
                continue
            a = int(min(cands, key=lambda x: js[layer, x, b]))
            d, nab, fs = float(js[layer, a, b]), float(pair_k[layer, a, b]), \
                float(far_share[layer, a, b])
            findings.append({
                "layer": layer, "head": b, "kv_head": b // g, "twin": a,
                "kv_share": _r(share[layer] / g, 8), "kv_head_share": _r(share[layer], 8),
                "safe": False, "kind": "redundant", "queries": int(nab),
                "evidence": {"js_distance": _r(d, 6),
                             "far_share": _r(fs),
                             "same_kv_head": a // g == b // g},
                "confidence": f"mean JS distance over {int(nab)} detail queries (> {JS_FAR:g} "
                              f"on {fs:.0%} of prompt positions, estimated)"})
    counts = {k: sum(f["kind"] == k for f in findings) for k in KINDS}
    return {"thresholds": asdict(th), "kv_share_basis": basis, "heads_checked": checked,
            "counts": counts,
            "kv_share_total": _r(sum(f["kv_share"] or 0.0 for f in findings), 8),
            "findings": findings[:_MAX_FINDINGS]}


def _r(x: float, nd: int = 4) -> float | None:
    return None if math.isnan(x) else round(x, nd)
