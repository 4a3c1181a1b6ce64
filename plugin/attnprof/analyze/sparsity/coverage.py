"""Coverage of the head statistics per (phase, context bucket), post-stratification to the
traffic, and the need-more-traffic verdict. Pure numpy over typed inputs.

Inputs: the statistics split by stratum (``Mapping[(phase, bucket_lo), accumulator]``, what
``HeadStatsStrata.items()`` yields) and the traffic's exact per-bucket counts
(:class:`~attnprof.contracts.snapshot.ContextBuckets`, from the API server's stat logger).

* **Coverage** (:func:`coverage_table`): per stratum, the requests and query tokens the
  statistics folded against the traffic's (prompt tokens for prefill, decode queries for
  decode), and the bucket's share of the traffic's KV block-seconds.
* **Post-stratification** (:func:`post_stratify`): each stratum's accumulator scaled by
  f_b = (T_b / T) / (S_b / S), T_b the traffic's query tokens in bucket b and S_b the query
  tokens its statistics stand for (their sum of weights), sums over the buckets that have
  both. The merge then weights every statistic as the traffic does (a sample skewed to short
  prompts no longer pulls long-context coverage towards the short prompts'); its effective
  sample size is Kish's for the reweighted sample (see
  :meth:`~attnprof.aggregate.head_stats.HeadStatsAccumulator.scaled`). Buckets with traffic
  and no statistics cannot be represented: the share of the traffic the corrected
  statistics stand on is T (covered) / T (all), stated beside the advice.
* **Need more traffic** (:func:`under_covered`): a bucket holding >= ``MIN_KV_SHARE`` of the
  KV block-seconds is *too little covered* at a window when its own sample cannot decide
  that window for every KV head of the layers the advice would window: some head's one-sided
  Wilson interval of the failing share (on the bucket's Kish effective sample size, z =
  ``Thresholds.confidence_z``) straddles the target quantile, or the bucket has fewer than
  ``Thresholds.min_queries`` eligible queries (no statistics). The width of that interval is
  the statistics' own sampling error (~ 1/sqrt(n_eff)), so how much traffic is "enough"
  depends on how close the head is to the target, not on a fixed count. Buckets whose
  contexts all fit in sinks + window are exact under the window and never need coverage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HEAD_STATS_MAX_TOKENS
from attnprof.analyze.sparsity.classify import Thresholds, kv_decisions, window_decisions
from attnprof.contracts.advice import UnderCoveredBucket
from attnprof.contracts.snapshot import (
    ContextBuckets,
    Coverage,
    CoverageBucket,
    PhaseCoverage,
)

__all__ = [
    "MIN_KV_SHARE",
    "PHASES",
    "Corrected",
    "coverage_table",
    "folded_queries",
    "folded_requests",
    "need_more_traffic_phrase",
    "post_stratify",
    "stratum_weights",
    "traffic_queries",
    "under_covered",
]

PHASES = ("prefill", "decode")
MIN_KV_SHARE = 0.10
"""A bucket holding at least this share of the KV block-seconds must be covered."""

Strata = Mapping[tuple[str, int], HeadStatsAccumulator]


def _index(buckets: ContextBuckets, lo: int) -> int | None:
    return buckets.edges.index(lo) if lo in buckets.edges else None


def traffic_queries(buckets: ContextBuckets, phase: str, lo: int) -> int:
    """The traffic's query tokens of ``phase`` in bucket ``lo`` (0: not a bucket edge)."""
    i = _index(buckets, lo)
    if i is None:
        return 0
    tokens = buckets.prompt_tokens if phase == "prefill" else buckets.decode_tokens
    return int(tokens[i]) if tokens is not None else 0


def folded_requests(acc: HeadStatsAccumulator) -> int:
    """Requests folded, each counted once whole (a prompt whose cached head or earlier chunks
    were not computed here still counts one; the layer that saw the most: pipeline stages may
    lag). Statistics written before requests were counted whole: their shares, rounded."""
    seen = int(acc.requests_seen.max(initial=0))
    return seen if seen else round(float(acc.requests.max(initial=0)))


def folded_queries(acc: HeadStatsAccumulator) -> float:
    """Query tokens the folded requests stand for: the sample's sum of weights (every
    query head of a layer carries the same weights; the layer that saw the most)."""
    return float(acc.weight_sum.max(initial=0.0))


def _kv_shares(buckets: ContextBuckets) -> list[float | None]:
    total = float(sum(buckets.kv_block_seconds))
    return [float(x) / total if total > 0 else None for x in buckets.kv_block_seconds]


@dataclass(frozen=True)
class Corrected:
    """:func:`post_stratify`: the traffic-weighted statistics of one phase."""

    phase: str
    acc: HeadStatsAccumulator | None
    """The post-stratified merge (None: no stratum has both statistics and traffic)."""
    weights: dict[int, float]
    """Factor applied per bucket (lower edge)."""
    traffic_share: float | None
    """Share of the phase's traffic query tokens in the buckets represented (None: no
    traffic counts, the merge is then unweighted)."""
    corrected: bool
    """False when there were no traffic counts: a plain merge, the sample's own mix."""


def stratum_weights(strata: Strata, buckets: ContextBuckets | None, phase: str = "prefill"
                    ) -> tuple[dict[int, float], float | None, bool]:
    """(post-stratification factor per bucket, share of the phase's traffic query tokens
    the weighted buckets hold, whether the weights come from traffic counts). Numbers only:
    cheap enough for every snapshot render. See :func:`post_stratify`."""
    if buckets is not None and (buckets.prompt_tokens if phase == "prefill"
                                else buckets.decode_tokens) is None:
        buckets = None  # token counts withheld (a keyless snapshot): merge as sampled
    mine = sorted((lo, folded_queries(a)) for (ph, lo), a in strata.items()
                  if ph == phase and folded_queries(a) > 0)
    if buckets is None:
        return {lo: 1.0 for lo, _ in mine}, None, False
    t = {lo: traffic_queries(buckets, phase, lo) for lo, _ in mine}
    both = [(lo, sq) for lo, sq in mine if t[lo] > 0]
    t_all = float(sum((buckets.prompt_tokens if phase == "prefill" else buckets.decode_tokens)
                      or ()))
    if not both:
        return {}, 0.0, True
    t_cov = float(sum(t[lo] for lo, _ in both))
    s_cov = float(sum(sq for _, sq in both))
    weights = {lo: (t[lo] / t_cov) / (sq / s_cov) for lo, sq in both}
    return weights, (t_cov / t_all if t_all > 0 else None), True


def post_stratify(strata: Strata, buckets: ContextBuckets | None,
                  phase: str = "prefill") -> Corrected:
    """Merge ``phase``'s strata weighted to the traffic's query tokens per bucket.

    Strata without traffic in their bucket get weight 0 (left out); buckets with traffic
    and no statistics are what ``traffic_share`` leaves out. Without traffic token counts (an
    older snapshot, or one read without a key) the strata are merged as sampled and
    ``corrected`` is False."""
    weights, share, corrected = stratum_weights(strata, buckets, phase)
    if not weights:
        return Corrected(phase, None, {}, share, corrected)
    parts = [(lo, a) for (ph, lo), a in sorted(strata.items())
             if ph == phase and lo in weights]
    acc = parts[0][1].empty_like()
    for lo, a in parts:
        acc.merge(a.scaled(weights[lo]) if corrected else a)
    return Corrected(phase, acc, weights, share, corrected)


def coverage_table(strata: Strata, buckets: ContextBuckets | None) -> Coverage | None:
    """Coverage per (phase, bucket): every bucket of the traffic (with or without
    statistics) and every stratum with statistics (with or without traffic), with the
    post-stratification weight :func:`post_stratify` gives it; None when there are neither
    traffic counts nor statistics. Counts and numbers only (no accumulator is merged): the
    live view renders it fresh for every snapshot."""
    if buckets is None and not strata:
        return None
    weighted = {p: stratum_weights(strata, buckets, p) for p in PHASES}
    edges = list(buckets.edges) if buckets is not None else []
    kv = _kv_shares(buckets) if buckets is not None else []
    rows: list[CoverageBucket] = []
    phases: list[PhaseCoverage] = []
    for phase in PHASES:
        los = set(edges) | {lo for (ph, lo) in strata if ph == phase}
        if phase == "decode" and not any(ph == "decode" for ph, _ in strata) and (
                buckets is None or not any(buckets.decode_tokens or ())):
            continue
        fold_r = traffic_r = 0
        for lo in sorted(los):
            acc = strata.get((phase, lo))
            i = edges.index(lo) if lo in edges else None
            t_req = int(buckets.requests[i]) if buckets is not None and i is not None else 0
            t_q = traffic_queries(buckets, phase, lo) if buckets is not None else 0
            f_req = folded_requests(acc) if acc is not None else 0
            w = weighted[phase][0].get(lo)
            rows.append(CoverageBucket(
                phase=phase, bucket=lo,
                hi=(edges[i + 1] if i is not None and i + 1 < len(edges) else None),
                traffic_requests=t_req, traffic_queries=t_q,
                kv_share=_r(kv[i]) if i is not None and kv[i] is not None else None,
                folded_requests=f_req,
                folded_queries=round(folded_queries(acc), 1) if acc is not None else 0.0,
                sampled_queries=int(acc.queries.max(initial=0)) if acc is not None else 0,
                request_share=_r(f_req / t_req) if t_req > 0 and phase == "prefill" else None,
                weight=None if w is None else _r(w),
                query_share=_r(min(1.0, folded_queries(acc) / t_q))
                if acc is not None and t_q > 0 else (0.0 if t_q > 0 else None)))
            fold_r += f_req
            traffic_r += t_req
        share = weighted[phase][1]
        phases.append(PhaseCoverage(
            phase=phase, folded_requests=fold_r,
            traffic_requests=traffic_r if buckets is not None else 0,
            traffic_query_share=None if share is None else _r(share)))
    return Coverage(min_tokens=buckets.min_tokens if buckets is not None else 0,
                    buckets=rows, phases=phases)


def under_covered(strata: Strata, buckets: ContextBuckets | None, layers: Sequence[int],
                  sinks: int, window: int, th: Thresholds | None = None,
                  phase: str = "prefill", min_kv_share: float = MIN_KV_SHARE
                  ) -> list[UnderCoveredBucket]:
    """Buckets holding >= ``min_kv_share`` of the KV block-seconds whose own sample cannot
    decide (``sinks``, ``window``) for every KV head of ``layers`` (see the module
    docstring), lowest bucket first. Empty without traffic counts or block-seconds, or when
    ``layers`` is empty. The decision is read at the grid point below (sinks, window), as the
    advice's evidence is."""
    th = (th or Thresholds()).validate()
    if buckets is None or not layers:
        return []
    shares = _kv_shares(buckets)
    kv_per_layer = next((a.num_kv_heads for a in strata.values()), 1)
    out: list[UnderCoveredBucket] = []
    for i, lo in enumerate(buckets.edges):
        share = shares[i]
        if share is None or share < min_kv_share:
            continue
        hi = buckets.edges[i + 1] if i + 1 < len(buckets.edges) else None
        # every context here is < hi: a query sees at most hi - 1 keys, and only queries
        # that see more than sinks + window keys are changed by the window
        if hi is not None and hi - 1 <= sinks + window:
            continue
        acc = strata.get((phase, lo))
        n_kv = len(layers) * kv_per_layer
        if acc is None or folded_queries(acc) <= 0:
            out.append(UnderCoveredBucket(lo, hi, _r(share) or 0.0, 0, n_kv, None))
            continue
        s_ok = [s for s in acc.sinks_grid if s <= sinks]
        w_ok = [w for w in acc.window_grid if w <= window]
        if not s_ok or not w_ok:
            out.append(UnderCoveredBucket(lo, hi, _r(share) or 0.0, 0, n_kv, None))
            continue
        si, wi = max(s_ok), acc.window_grid.index(max(w_ok))
        dec = kv_decisions(window_decisions(acc, th, si)["decision"], acc.group_size)[..., wi]
        neff = acc.n_eff()[:, :, acc.sinks_grid.index(si), wi].reshape(
            acc.num_layers, acc.num_kv_heads, acc.group_size).min(-1)
        ls = [x for x in layers if 0 <= x < acc.num_layers]
        d = dec[ls]
        und, miss = int((d == 0).sum()), int(np.isnan(d).sum())
        if und or miss:
            decided = neff[ls][~np.isnan(d)]
            out.append(UnderCoveredBucket(lo, hi, _r(share) or 0.0, und, miss,
                                    round(float(decided.min()), 1) if decided.size else None))
    return out


def need_more_traffic_phrase(under: Sequence[UnderCoveredBucket], window: int) -> str:
    """'need more traffic at > 1024 tokens (the 1024-2048 bucket holds 40% of the KV
    block-seconds; its sample cannot decide w=512 for 3 KV heads)'."""
    u = min(under, key=lambda b: b.bucket)
    span = f"{u.bucket}+" if u.hi is None else f"{u.bucket}-{u.hi}"
    if u.bucket >= HEAD_STATS_MAX_TOKENS:  # more traffic there would never be sampled
        return (f"contexts over {HEAD_STATS_MAX_TOKENS} tokens are never sampled for head "
                f"statistics (the {span} bucket holds {u.kv_share:.0%} of the KV "
                f"block-seconds): no window can be shown safe for them")
    heads = u.undecided_kv_heads + u.unmeasured_kv_heads
    more = f" and {len(under) - 1} more bucket{'s' if len(under) > 2 else ''}" \
        if len(under) > 1 else ""
    return (f"need more traffic at > {u.bucket} tokens (the {span} bucket holds "
            f"{u.kv_share:.0%} of the KV block-seconds{more}; its sample cannot decide "
            f"w={window} for {heads} KV head{'s' if heads != 1 else ''})")


def _r(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(float(x), 4)
