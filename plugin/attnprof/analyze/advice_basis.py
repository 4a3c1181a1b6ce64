"""What the cost report's window advice stands on: coverage per bucket, dynamic heads.

Issue 31, points 3 and 4: the head statistics' coverage per context bucket against the
traffic (prefill and decode side by side), the need-more-traffic verdict, and the dynamic
KV heads kept full, as :class:`~attnprof.contracts.report.AdviceBasis`. Pure: from a
snapshot's ``coverage`` (the live table,
:func:`attnprof.analyze.sparsity.coverage.coverage_table`), its request statistics'
per-bucket counts and the advice's own ``coverage``; the phrases are the advice summary's
(:func:`~attnprof.analyze.sparsity.recommend.stands_on_phrases`), so the report and the
summary say the same.
"""

from __future__ import annotations

from typing import Any

from attnprof.analyze.sparsity.coverage import need_more_traffic_phrase
from attnprof.analyze.sparsity.recommend import stands_on_phrases
from attnprof.contracts.advice import AdviceCoverage
from attnprof.contracts.report import AdviceBasis, BasisBucket, BasisPhase
from attnprof.contracts.snapshot import ContextBuckets, Coverage, CoverageBucket

__all__ = ["NO_COVERAGE", "advice_basis"]

NO_COVERAGE = ("No coverage data: the source has no head-statistics coverage per context "
               "bucket (a snapshot from before attnprof 1.9, a fleet read from Prometheus, or "
               "a server that has neither folded statistics nor finished a request yet), so "
               "what share of the traffic the window advice stands on is not known.")
"""What the report says where it cannot say what the advice stands on."""


def _phase(row: CoverageBucket | None) -> BasisPhase | None:
    if row is None:
        return None
    return BasisPhase(traffic_queries=row.traffic_queries, folded_requests=row.folded_requests,
                      folded_queries=row.folded_queries, query_share=row.query_share,
                      weight=row.weight)


def _buckets(cov: Coverage, counts: ContextBuckets | None) -> list[BasisBucket]:
    rows: dict[int, dict[str, CoverageBucket]] = {}
    for r in cov.buckets:
        rows.setdefault(r.bucket, {})[r.phase] = r
    edges = list(counts.edges) if counts is not None else []
    out = []
    for lo in sorted(rows):
        by = rows[lo]
        first = by.get("prefill") or by["decode"]
        bs = (float(counts.kv_block_seconds[edges.index(lo)])
              if counts is not None and lo in edges
              and edges.index(lo) < len(counts.kv_block_seconds) else None)
        out.append(BasisBucket(bucket=lo, hi=first.hi, traffic_requests=first.traffic_requests,
                               kv_block_seconds=bs, kv_share=first.kv_share,
                               prefill=_phase(by.get("prefill")),
                               decode=_phase(by.get("decode"))))
    return out


def _kv_covered(buckets: list[BasisBucket]) -> float | None:
    """Share of the traffic's KV block-seconds in buckets whose prefill has statistics."""
    total = sum(b.kv_block_seconds or 0.0 for b in buckets)
    if total <= 0:
        return None
    seen = sum(b.kv_block_seconds or 0.0 for b in buckets
               if b.prefill is not None and b.prefill.folded_requests > 0)
    return round(seen / total, 4)


def advice_basis(coverage: Coverage | None, counts: ContextBuckets | None,
                 advice: AdviceCoverage | None, window: int | None = None,
                 has_advice: bool = True) -> AdviceBasis:
    """The report's :class:`AdviceBasis`. ``coverage``: the snapshot's table (None: an older
    snapshot, or one with neither statistics nor traffic counts); ``counts``: its request
    statistics' per-bucket counts (the KV block-seconds in absolute terms); ``advice``: the
    window advice's coverage, which the sentence and the verdict come from when there is one
    (its copy of the statistics lags the table by the advice interval); ``window``: the
    advice's window, named by the verdict; ``has_advice``: whether the source carries a
    window advice at all (the sentence then speaks of the statistics, not of advice)."""
    if coverage is None and advice is None:
        return AdviceBasis(available=False, stands_on=NO_COVERAGE)
    buckets = _buckets(coverage, counts) if coverage is not None else []
    phases = {p.phase: p for p in coverage.phases} if coverage is not None else {}
    stab = coverage.stability if coverage is not None else None
    pre, dec = phases.get("prefill"), phases.get("decode")
    facts: dict[str, Any]
    if advice is not None:
        facts = advice.to_json()
    else:
        facts = {"folded_requests": pre.folded_requests if pre is not None else 0,
                 "traffic_requests": pre.traffic_requests if pre is not None and counts
                 is not None else None,
                 "traffic_share": pre.traffic_query_share if pre is not None else None,
                 "kv_share": _kv_covered(buckets), "corrected": counts is not None}
        if stab is not None:
            facts.update(dynamic_kv_heads=stab.dynamic_kv_heads, kv_heads=stab.kv_heads,
                         dynamic_share=stab.dynamic_share,
                         rated_kv_heads=sum(x.rated_kv_heads for x in stab.layers))
    under = advice.under_covered if advice is not None else None
    need = (need_more_traffic_phrase(under, window) if under and window is not None
            else f"need more traffic at > {facts['need_more_traffic_above']} tokens"
            if facts.get("need_more_traffic_above") is not None else None)
    parts = stands_on_phrases(facts)
    sentence = (f"The window advice {parts[0]}" if has_advice else
                "No window advice yet; the head statistics so far "
                + parts[0].replace("stands on", "stand on", 1))
    sentence += "".join(f"; {p}" for p in parts[1:])
    if need is not None:
        sentence += f"; it windows nothing: {need}"
    if facts.get("dynamic_kv_heads") is None:
        sentence += "; dynamic heads: not rated yet (no stability views)"
    if coverage is None:
        sentence += ("; no per-bucket table: the source has the advice's coverage only (an "
                     "older snapshot, or a record window, which leaves the table out: the "
                     "statistics' folds are not windowed)")
    return AdviceBasis(
        available=True, stands_on=sentence + ".",
        min_tokens=coverage.min_tokens if coverage is not None else None, buckets=buckets,
        folded_requests=facts.get("folded_requests"),
        traffic_requests=facts.get("traffic_requests"),
        prefill_query_share=pre.traffic_query_share if pre is not None
        else facts.get("traffic_share"),
        decode_query_share=dec.traffic_query_share if dec is not None else None,
        kv_share=facts.get("kv_share"), corrected=facts.get("corrected"),
        need_more_traffic_above=facts.get("need_more_traffic_above"), need_more_traffic=need,
        dynamic_kv_heads=facts.get("dynamic_kv_heads"), kv_heads=facts.get("kv_heads"),
        dynamic_share=facts.get("dynamic_share"), rated_kv_heads=facts.get("rated_kv_heads"),
        stability_views=len(stab.views) if stab is not None else None)
