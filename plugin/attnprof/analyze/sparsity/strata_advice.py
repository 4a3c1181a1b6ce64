"""Window advice from stratified head statistics: corrected, stable, and saying what it stands on.

:func:`recommend_strata` is :func:`.recommend.recommend` over the prefill statistics
post-stratified to the traffic's context buckets (:func:`.coverage.post_stratify`), with the
KV heads whose class changes across epochs and buckets kept full (:mod:`.stability`), and
one more rule: when a bucket holding >= 10% of the KV block-seconds cannot decide the chosen
window (:func:`.coverage.under_covered`), the advice windows nothing and says "need more
traffic at > N tokens" instead of a guess. The result carries
:class:`~attnprof.contracts.advice.AdviceCoverage` (what share of the traffic it stands on,
the dynamic-head share) and the coverage table for the snapshot. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import Thresholds
from attnprof.analyze.sparsity.coverage import (
    MIN_KV_SHARE,
    Corrected,
    coverage_table,
    folded_requests,
    need_more_traffic_phrase,
    post_stratify,
    under_covered,
)
from attnprof.analyze.sparsity.recommend import as_distribution, evaluate, recommend
from attnprof.analyze.sparsity.results import Recommendation
from attnprof.analyze.sparsity.stability import StabilityResult, stability, stability_views
from attnprof.contracts.advice import AdviceCoverage, UnderCoveredBucket
from attnprof.contracts.snapshot import ContextBuckets, Coverage
from attnprof.facts.shape import AttentionShape

__all__ = ["StrataAdvice", "recommend_strata"]


@dataclass(frozen=True)
class StrataAdvice:
    """:func:`recommend_strata`: the recommendation (its ``coverage`` set), the coverage
    table with stability for the snapshot, and the corrected statistics."""

    recommendation: Recommendation
    coverage: Coverage | None
    stability: StabilityResult | None
    corrected: Corrected


def recommend_strata(lengths: Any, shape: AttentionShape,
                     strata: Mapping[tuple[str, int], HeadStatsAccumulator],
                     buckets: ContextBuckets | None, *,
                     epochs: Sequence[HeadStatsAccumulator] = (),
                     thresholds: Thresholds | None = None, sinks: int | None = None,
                     min_kv_share: float = MIN_KV_SHARE) -> StrataAdvice:
    """Window advice over stratified statistics (see the module docstring). ``strata``:
    ``{(phase, bucket_lo): accumulator}``; ``buckets``: the traffic's exact per-bucket
    counts (None: an older server, the strata are merged as sampled); ``epochs``: disjoint
    time windows' statistics, oldest first (stability over time)."""
    th = (thresholds or Thresholds()).validate()
    dist = as_distribution(lengths)
    corr = post_stratify(strata, buckets, "prefill")
    stab = stability(stability_views(strata, epochs), th)
    rec = recommend(dist, shape, corr.acc, thresholds=th, sinks=sinks,
                    dynamic=None if stab is None or corr.acc is None else stab.dynamic)
    under: list[UnderCoveredBucket] = []
    if corr.acc is not None:
        best = rec.best
        layers = best.layers or tuple(shape.full_layers)
        under = under_covered(strata, buckets, layers, best.sinks, best.window, th,
                              min_kv_share=min_kv_share)
        if under:
            phrase = need_more_traffic_phrase(under, best.window)
            rec = replace(rec, best=evaluate(dist, shape, best.window, best.sinks,
                                             head_stats=corr.acc, thresholds=th, layers=[]),
                          basis=phrase + (f"; the statistics would window layers "
                                          f"{list(best.layers)} at w={best.window}: not "
                                          "advised on this evidence" if best.layers
                                          else "; no layer is windowed on this evidence"),
                          binds=False, advice=(phrase, *rec.advice))
    rec_stab = None if stab is None else stab.record
    cov = coverage_table(strata, buckets)
    if cov is not None:
        cov.stability = rec_stab
    folded = sum(folded_requests(a) for (ph, _), a in strata.items() if ph == "prefill")
    kv_total = float(sum(buckets.kv_block_seconds)) if buckets is not None else 0.0
    kv_covered = (sum(float(x) for lo, x in zip(buckets.edges, buckets.kv_block_seconds,
                                               strict=False) if lo in corr.weights)
                  if buckets is not None else 0.0)
    rec = replace(rec, coverage=AdviceCoverage(
        folded_requests=folded,
        traffic_requests=None if buckets is None else int(sum(buckets.requests)),
        traffic_share=None if corr.traffic_share is None else round(corr.traffic_share, 4),
        corrected=corr.corrected,
        need_more_traffic_above=min(u.bucket for u in under) if under else None,
        under_covered=list(under) or None,
        dynamic_kv_heads=None if rec_stab is None else rec_stab.dynamic_kv_heads,
        kv_heads=None if rec_stab is None else rec_stab.kv_heads,
        dynamic_share=None if rec_stab is None else rec_stab.dynamic_share,
        kv_share=round(kv_covered / kv_total, 4) if corr.corrected and kv_total > 0 else None,
        rated_kv_heads=None if rec_stab is None
        else sum(x.rated_kv_heads for x in rec_stab.layers)))
    return StrataAdvice(rec, cov, stab, corr)
