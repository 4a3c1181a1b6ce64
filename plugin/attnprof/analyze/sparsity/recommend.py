"""Window recommendations from traffic (+ head statistics when available).

``evaluate`` scores one (sinks, window) configuration (an :class:`Evaluation`); ``recommend``
scores a grid of windows, picks one and returns a :class:`Recommendation` with its Pareto
table; ``format_summary`` is the one-line demo sentence (over the ``suggest-window --json``
document) and ``export_summary`` the :class:`WindowAdvice` contract. The sentence stays here,
not in the exporters, because it is data: ``WindowAdvice.summary`` in snapshots and
profiles, filled by the live server's advice loop (:mod:`attnprof.analyze.window_advice`).
Savings are ratios of expectations over requests (cost-weighted), exactness is
P(T <= s + w). Each KV head's window decision is three-valued (:func:`.classify.window_decisions`):
heads at risk fail the coverage target, undecided heads are within sampling error of it
(never windowed: "need more traffic"), the rest pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import (
    Classification,
    Thresholds,
    classify,
    kv_decisions,
    window_decisions,
)
from attnprof.analyze.sparsity.results import (
    DynamicSparse,
    Evaluation,
    HeadEvidence,
    HeadRisk,
    NativeWindows,
    Recommendation,
    SlidingGroup,
)
from attnprof.analyze.sparsity.savings import (
    LengthDistribution,
    kv_tokens,
    pairs_full,
    pairs_window,
    workload_costs,
)
from attnprof.contracts.advice import (
    AdviceTraffic,
    HeadLevelSplit,
    LayerAdvice,
    ParetoPoint,
    ReplayEvidence,
    UnderusedHead,
    WindowAdvice,
)
from attnprof.facts.layers import ranges_text
from attnprof.facts.shape import AttentionShape

__all__ = [
    "DYNAMIC_SPARSE_MIN_TOKENS",
    "as_distribution",
    "evaluate",
    "export_summary",
    "format_summary",
    "kv_coverage",
    "recommend",
    "stands_on_phrases",
]

DYNAMIC_SPARSE_MIN_TOKENS = 32768
"""Dynamic sparse prefill only pays off above ~32-64K tokens (MInference measurements)."""
_MAX_LISTED_HEADS = 64  # bound the JSON: the count is always exact


def as_distribution(lengths: Any) -> LengthDistribution:
    """A LengthDistribution, a sequence of lengths, or cumulative (le, count) buckets."""
    if isinstance(lengths, LengthDistribution):
        return lengths
    items = list(lengths)
    if items and isinstance(items[0], (tuple, list)):
        from attnprof.analyze.sparsity.inputs import from_buckets

        return from_buckets([(float(a), float(b)) for a, b in items], "buckets")
    return LengthDistribution.from_lengths((int(x) for x in items), "lengths")


def kv_coverage(acc: HeadStatsAccumulator, th: Thresholds, sinks: int, window: int) -> Any:
    """Lower bound on the low-quantile coverage per [layer, KV head] for (sinks, window).

    Coverage only grows with s and w, so an off-grid configuration is bounded by the largest
    grid point below it. NaN: no sampled query long enough (or w below the grid).
    """
    s_ok = [s for s in acc.sinks_grid if s <= sinks]
    w_ok = [w for w in acc.window_grid if w <= window]
    shape = (acc.num_layers, acc.num_kv_heads)
    if not s_ok or not w_ok:
        return np.full(shape, np.nan)
    si, wi = acc.sinks_grid.index(max(s_ok)), acc.window_grid.index(max(w_ok))
    cq = acc.coverage_quantile(th.quantile, th.confidence_z)[:, :, si, wi]
    enough = acc.cov_n[:, :, si, wi] >= th.min_queries
    cq = np.where(enough, cq, np.nan).reshape(acc.num_layers, acc.num_kv_heads, acc.group_size)
    with np.errstate(invalid="ignore"):
        # a KV head serves its whole group: its coverage is the worst query head's
        return np.where(np.isnan(cq).any(-1), np.nan, np.nanmin(np.nan_to_num(cq, nan=1), -1))


def _kv_decision(acc: HeadStatsAccumulator, th: Thresholds, sinks: int, window: int) -> Any:
    """Three-valued decision per [layer, KV head] at the grid point :func:`kv_coverage`
    bounds (sinks, window) by (1 pass, 0 undecided, -1 fail, NaN no evidence)."""
    s_ok = [s for s in acc.sinks_grid if s <= sinks]
    w_ok = [w for w in acc.window_grid if w <= window]
    if not s_ok or not w_ok:
        return np.full((acc.num_layers, acc.num_kv_heads), np.nan)
    d = window_decisions(acc, th, max(s_ok))["decision"]
    return kv_decisions(d, acc.group_size)[:, :, acc.window_grid.index(max(w_ok))]


def _kv_n_eff(acc: HeadStatsAccumulator, sinks: int, window: int) -> Any:
    """Fewest effective sampled queries per [layer, KV head] behind :func:`kv_coverage`."""
    s_ok = [s for s in acc.sinks_grid if s <= sinks]
    w_ok = [w for w in acc.window_grid if w <= window]
    shape = (acc.num_layers, acc.num_kv_heads)
    if not s_ok or not w_ok:
        return np.zeros(shape)
    si, wi = acc.sinks_grid.index(max(s_ok)), acc.window_grid.index(max(w_ok))
    return acc.n_eff()[:, :, si, wi].reshape(*shape, acc.group_size).min(-1)


def _naive_mean(dist: LengthDistribution, shape: AttentionShape, window: int, sinks: int,
                layers: set[int]) -> float:
    t = dist.t
    full = np.zeros_like(t)
    win = np.zeros_like(t)
    for layer in range(shape.num_layers):
        nat = shape.window(layer)
        base = pairs_full(t) if nat is None else pairs_window(t, nat, 0)
        full += base
        win += np.minimum(base, pairs_window(t, window, sinks)) if layer in layers else base
    return dist.expect(1 - win / full)


def evaluate(lengths: Any, shape: AttentionShape, window: int, sinks: int, *,
             head_stats: HeadStatsAccumulator | None = None,
             thresholds: Thresholds | None = None,
             layers: Iterable[int] | None = None) -> Evaluation:
    """Score sinks + window on ``layers`` (default: every full-attention layer)."""
    if window < 1 or sinks < 0:
        raise ValueError("window must be >= 1 and sinks >= 0")
    dist = as_distribution(lengths)
    th = (thresholds or Thresholds()).validate()
    chosen = sorted(set(shape.full_layers if layers is None else layers))
    bad = [x for x in chosen if not 0 <= x < shape.num_layers]
    if bad:
        raise ValueError(f"layer {bad[0]} is outside 0..{shape.num_layers - 1}")
    c = workload_costs(dist, shape, window, sinks, chosen)
    attn_full = c.attention_flops_full
    share = None
    e2e = None
    saving = 1 - c.attention_flops_windowed / attn_full if attn_full else 0.0
    if shape.n_params:
        other = 2 * shape.n_params * c.tokens
        share = attn_full / (attn_full + other)
        e2e = saving * share
    return Evaluation(
        sinks=sinks, window=window, layers=tuple(chosen),
        attention_flop_saving=round(saving, 6),
        kv_memory_saving=round(1 - c.kv_bytes_windowed / c.kv_bytes_full, 6),
        exact_request_fraction=round(dist.fraction_at_most(window + sinks), 6),
        naive_mean_request_saving=round(_naive_mean(dist, shape, window, sinks, set(chosen)),
                                        6),
        attention_flops_full=attn_full, attention_flops_windowed=c.attention_flops_windowed,
        kv_bytes_full=c.kv_bytes_full, kv_bytes_windowed=c.kv_bytes_windowed,
        attention_flop_share=None if share is None else round(share, 6),
        end_to_end_flop_saving=None if e2e is None else round(e2e, 6),
        traffic=dist.summary(), shape=shape,
        evidence=None if head_stats is None
        else _evidence(head_stats, th, sinks, window, chosen))


def _evidence(acc: HeadStatsAccumulator, th: Thresholds, sinks: int, window: int,
              chosen: Sequence[int]) -> HeadEvidence:
    """Coverage of each chosen layer's KV heads at (sinks, window), three-valued."""
    cov = kv_coverage(acc, th, sinks, window)
    neff = _kv_n_eff(acc, sinks, window)
    dec = _kv_decision(acc, th, sinks, window)
    risk: list[HeadRisk] = []
    undecided: list[HeadRisk] = []
    unverified = 0
    for layer in chosen:
        for kv in range(acc.num_kv_heads):
            v, d = cov[layer, kv], dec[layer, kv]
            if math.isnan(d) or math.isnan(v):
                unverified += 1
            elif d < 1:  # fails, or within sampling error of the target: not covered
                (risk if d < 0 else undecided).append(HeadRisk(
                    layer, kv, round(float(v), 4), round(float(neff[layer, kv]), 1)))
    ok = [float(neff[x, kv]) for x in chosen for kv in range(acc.num_kv_heads)
          if np.isfinite(cov[x, kv])]
    return HeadEvidence(
        heads_at_risk=tuple(sorted(risk, key=lambda r: r.coverage_q)[:_MAX_LISTED_HEADS]),
        heads_at_risk_count=len(risk), heads_unverified_count=unverified,
        heads_undecided_count=len(undecided),
        heads_undecided=tuple(undecided[:_MAX_LISTED_HEADS]), thresholds=th,
        sampled_queries=int(acc.queries.max(initial=0)),
        # how sure: the weakest evidence behind a windowed layer's coverage
        min_n_eff=round(min(ok), 1) if ok else None)


def _candidate_windows(dist: LengthDistribution, acc: HeadStatsAccumulator | None
                       ) -> list[int]:
    if acc is not None:
        return list(acc.window_grid)
    top = max(64, 1 << math.ceil(math.log2(max(dist.lengths[-1], 2))))
    out, w = [], 64
    while w <= top:
        out.append(w)
        w *= 2
    return out


def _head_split(dist: LengthDistribution, shape: AttentionShape, cls: Classification,
                sinks: int) -> HeadLevelSplit:
    """Window only the KV heads whose own w* is known, the rest of their layer stays full."""
    t = dist.t
    full_p = full_kv = win_p = win_kv = 0.0
    split = 0
    for layer in cls.layers:
        nat = shape.window(layer.layer)
        base_p = dist.expect(pairs_full(t) if nat is None else pairs_window(t, nat, 0))
        base_kv = dist.expect(kv_tokens(t, nat))
        for kv in layer.kv_heads:
            full_p += base_p
            full_kv += base_kv
            w = kv.window
            if isinstance(w, int) and nat is None:
                split += 1
                win_p += dist.expect(pairs_window(t, w, sinks))
                win_kv += dist.expect(kv_tokens(t, w, sinks))
            else:
                win_p += base_p
                win_kv += base_kv
    return HeadLevelSplit(
        windowed_kv_heads=split,
        attention_flop_saving=round(1 - win_p / full_p, 6) if full_p else 0.0,
        kv_memory_saving=round(1 - win_kv / full_kv, 6) if full_kv else 0.0,
        note="each KV head at its own w* (needs per-head windows, e.g. DuoAttention-style "
             "streaming heads); heads without a window stay full")


def _dynamic_sparse(dist: LengthDistribution, shape: AttentionShape,
                    acc: HeadStatsAccumulator | None) -> DynamicSparse:
    t = dist.t
    big = t > DYNAMIC_SPARSE_MIN_TOKENS
    pf = pairs_full(t) * len(shape.full_layers)
    share = float((pf * big * dist.w).sum() / max((pf * dist.w).sum(), 1e-300))
    density = None
    if acc is not None and acc.detail_w.sum() > 0:
        # all-query mean over detail queries (weighted), averaged over heads
        density = float(acc.topk_frac_sum.sum() / acc.detail_w.sum())
    return DynamicSparse(
        min_tokens=DYNAMIC_SPARSE_MIN_TOKENS,
        request_fraction=round(float(dist.w[big].sum() / dist.total_weight), 6),
        attention_flop_share=round(share, 6),
        topk_mass_density=None if density is None else round(density, 4),
        expected_attention_flop_saving=None if density is None
        else round(share * (1 - density), 6))


def _native_windows(dist: LengthDistribution, shape: AttentionShape) -> NativeWindows | None:
    if not shape.hybrid:
        return None
    t = dist.t
    groups: dict[int, list[int]] = {}
    for layer in range(shape.num_layers):
        nat = shape.window(layer)
        if nat is not None:
            groups.setdefault(nat, []).append(layer)
    kv_all = sum(dist.expect(kv_tokens(t, shape.window(x))) for x in range(shape.num_layers))
    kv_global = sum(dist.expect(t) for _ in shape.full_layers)
    p_all = sum(dist.expect(pairs_full(t) if shape.window(x) is None
                            else pairs_window(t, shape.window(x) or 0, 0))
                for x in range(shape.num_layers))
    p_global = dist.expect(pairs_full(t)) * len(shape.full_layers)
    return NativeWindows(
        sliding=tuple(SlidingGroup(w, tuple(ls), round(1 - dist.fraction_at_most(w), 6))
                      for w, ls in sorted(groups.items())),
        global_layers=tuple(shape.full_layers),
        global_kv_share=round(kv_global / kv_all, 6) if kv_all else 0,
        global_attention_flop_share=round(p_global / p_all, 6) if p_all else 0)


def recommend(lengths: Any, shape: AttentionShape,
              head_stats: HeadStatsAccumulator | None = None, *,
              sinks: int | None = None, windows: Sequence[int] | None = None,
              thresholds: Thresholds | None = None, min_exact: float = 0.9,
              dynamic: Any = None) -> Recommendation:
    """Choose sinks + window for the traffic.

    With head statistics: for each grid window W, window the full-attention layers whose
    every KV head has w* <= W; pick the W with the largest cost-weighted attention-FLOP
    saving. Without: the smallest W that keeps ``min_exact`` of requests exact (coverage risk
    unknown, said so in ``basis``). ``dynamic``: bool [layer, KV head] of heads whose class
    changes across time windows or context buckets (:mod:`.stability`): never windowed.
    """
    dist = as_distribution(lengths)
    th = (thresholds or Thresholds()).validate()
    s = th.sinks if sinks is None else sinks
    if head_stats is not None and s in head_stats.sinks_grid:
        th = replace(th, sinks=s)  # classify at the sinks being recommended
    cls = classify(head_stats, th, dynamic) if head_stats is not None else None
    cands = list(windows) if windows else _candidate_windows(dist, head_stats)
    pareto: list[Evaluation] = []
    for w in cands:
        if cls is not None:
            layers = [x.layer for x in cls.layers
                      if shape.window(x.layer) is None
                      and isinstance(x.window, int) and x.window <= w]
        else:
            layers = shape.full_layers
        pareto.append(evaluate(dist, shape, w, s, head_stats=head_stats, thresholds=th,
                               layers=layers))
    if cls is not None:
        best = max(pareto, key=lambda e: (round(e.attention_flop_saving, 9), e.window))
        basis = (f"head statistics: layers whose every KV head keeps {th.quantile:g}-quantile "
                 f"coverage >= {th.tau:g} at s={s}")
    else:
        ok = [e for e in pareto if e.exact_request_fraction >= min_exact]
        best = min(ok, key=lambda e: e.window) if ok else pareto[-1]
        basis = (f"traffic only (no head statistics): smallest window keeping >= "
                 f"{min_exact:.0%} of requests exact; coverage risk unknown")
    # KV heads (full-attention layers) whose decision the sample cannot make, per window:
    # they keep their layer full until more queries (traffic, or offline refinement) decide
    undecided = None if cls is None else {
        w: n for w in cls.window_grid
        if (n := sum(k.decision.get(w) == "undecided" for x in cls.layers
                     if shape.window(x.layer) is None for k in x.kv_heads))}
    head_split = None if cls is None else _head_split(dist, shape, cls, s)
    dynamic = _dynamic_sparse(dist, shape, head_stats)
    native = _native_windows(dist, shape)
    return Recommendation(
        best=best, basis=basis, undecided=undecided,
        binds=best.exact_request_fraction < 1.0 and bool(best.layers),
        pareto=tuple(ParetoPoint(
            window=e.window, sinks=e.sinks, attention_flop_saving=e.attention_flop_saving,
            kv_memory_saving=e.kv_memory_saving,
            exact_request_fraction=e.exact_request_fraction,
            heads_at_risk_count=e.heads_at_risk_count, layers=len(e.layers),
            heads_undecided=None if undecided is None else undecided.get(e.window, 0))
            for e in pareto),
        classification=cls, head_level_split=head_split, dynamic_sparse_prefill=dynamic,
        native_windows=native, underused_heads=_underused(head_stats, shape, dist),
        advice=tuple(_advice(best, undecided, native, head_split, dynamic)))


def _underused(acc: HeadStatsAccumulator | None, shape: AttentionShape,
               dist: LengthDistribution) -> dict[str, Any] | None:
    """Underused heads (:mod:`.underused`) with KV shares weighted by this traffic; None
    without statistics or when the statistics' sinks grid lacks the default sinks."""
    from attnprof.analyze.sparsity.underused import UnderusedThresholds, find_underused

    if acc is None or UnderusedThresholds().sinks not in acc.sinks_grid:
        return None
    return find_underused(acc, shape=shape, dist=dist)


def _advice(best: Evaluation, undecided: Mapping[int, int] | None,
            nw: NativeWindows | None, hs: HeadLevelSplit | None,
            ds: DynamicSparse) -> list[str]:
    """Where something other than the chosen layer-wide window would save more."""
    out: list[str] = []
    und = _undecided_phrase(undecided)
    if und:
        out.append(und)
    if nw:
        for g in nw.sliding:
            if g.never_binds:
                out.append(f"the native window {g.window} never binds on this traffic: "
                           f"its {len(g.layers)} sliding layers save nothing")
        if nw.global_kv_share >= 0.5:
            out.append(f"global layers hold {nw.global_kv_share:.0%} of KV memory: window "
                       "or split heads there first")
    if hs and hs.attention_flop_saving > best.attention_flop_saving + 0.01:
        out.append(f"a head-level split ({hs.windowed_kv_heads} streaming/local KV heads at "
                   f"their own window, the rest full) would save "
                   f"{hs.attention_flop_saving:.1%} of attention FLOPs and "
                   f"{hs.kv_memory_saving:.1%} of KV memory vs "
                   f"{best.attention_flop_saving:.1%} / {best.kv_memory_saving:.1%}")
    if ds.request_fraction > 0:
        exp = ds.expected_attention_flop_saving
        out.append(f"{ds.request_fraction:.1%} of requests ({ds.attention_flop_share:.0%}"
                   f" of attention FLOPs) exceed {ds.min_tokens} tokens: dynamic sparse "
                   "prefill applies there" + (f", expected saving {exp:.1%} of attention "
                                              "FLOPs" if exp is not None else ""))
    return out


def _undecided_phrase(und: Mapping[Any, int] | None) -> str | None:
    """'3 KV heads undecided at w=1024, 1 at w=512: need more traffic' (None: none).
    ``und``: KV heads per window (int keys, or the JSON's string keys)."""
    if not und:
        return None
    items = sorted(((int(w), n) for w, n in und.items()), reverse=True)
    parts = [f"{n} KV head{'s' if n != 1 else ''} undecided at w={w}" if i == 0
             else f"{n} at w={w}" for i, (w, n) in enumerate(items)]
    return (", ".join(parts) + ": need more traffic (their sampled failing share is within "
            "sampling error of the target; undecided heads are never windowed)")


def format_summary(rec: Mapping[str, Any], replay: Mapping[str, Any] | None = None) -> str:
    """The demo sentence: traffic quantiles, suggestion, savings, exactness, replay evidence."""
    tr = rec["traffic"]
    n_layers = rec["model"]["num_layers"]
    layers = rec["layers"]
    parts = [f"your traffic: P50/P90/P99 = {tr['p50']}/{tr['p90']}/{tr['p99']} tokens"]
    cov = rec.get("coverage") or {}
    if cov.get("need_more_traffic_above") is not None:
        from attnprof.analyze.sparsity.coverage import need_more_traffic_phrase
        from attnprof.contracts.advice import UnderCoveredBucket

        under = [UnderCoveredBucket.from_json(u) for u in cov.get("under_covered") or []]
        parts.append("suggestion: none yet, " + (need_more_traffic_phrase(under, rec["window"])
                                                 if under else "need more traffic"))
        return "; ".join(parts + stands_on_phrases(cov))
    if not layers:
        native = rec["model"].get("layer_windows") or []
        if native and all(w is not None for w in native):
            parts.append(f"suggestion: none needed, every layer already slides (window "
                         f"{max(native)}); see where it binds")
        else:
            parts.append("suggestion: keep full attention (no layer has every KV head "
                         "covered by a window in the grid; see the head-level split)")
        phrase = _undecided_phrase(rec.get("undecided"))
        if phrase:
            parts.append(phrase.split(" (", 1)[0])
        return "; ".join(parts + stands_on_phrases(cov))
    parts += [f"suggestion: {rec['sinks']} sinks + {rec['window']} window on layers "
              f"{ranges_text(layers) or 'no layers'} ({len(layers)} of {n_layers})",
              f"saves {rec['attention_flop_saving']:.1%} attention FLOPs and "
              f"{rec['kv_memory_saving']:.1%} KV memory",
              f"{rec['exact_request_fraction']:.1%} of requests unchanged"]
    smp = rec.get("sampling")
    if smp and smp.get("min_n_eff") is not None:
        exact = (rec.get("classification") or {}).get("decided_exactly_kv_heads") or 0
        parts.append(f"coverage from sampled queries (effective n >= {smp['min_n_eff']:g} per "
                     "head, z = {:g} Wilson bound)".format(rec["coverage_target"]["confidence_z"])
                     + (f", {exact} KV heads decided on every query" if exact else ""))
    und = rec.get("undecided") or {}
    if und:
        w_show = str(rec["window"]) if str(rec["window"]) in und else max(und, key=int)
        n = und[w_show]
        parts.append(f"{n} KV head{'s' if n != 1 else ''} undecided at w={w_show}: need more "
                     "traffic")
    parts += stands_on_phrases(cov)
    if replay is None:
        parts.append("replay: not run (not validated)")
    else:
        verdict = "safe" if replay.get("safe") else "NOT safe"
        parts.append(f"replay agreement {replay['agreement']:.1%}, mean KL "
                     f"{replay['mean_kl']:.3g} -> {verdict} (target >= "
                     f"{replay['target_agreement']:.0%}, KL <= {replay['max_kl']:g})")
    return "; ".join(parts)


def stands_on_phrases(cov: Mapping[str, Any]) -> list[str]:
    """'stands on 4 of 20 requests (85% of prompt tokens, 90% of KV block-seconds,
    traffic-weighted)', 'dynamic heads: 2 of 48 KV heads (4.2%; 30 rated by two or more
    views), kept full' (empty without coverage)."""
    if not cov:
        return []
    n, total, share = (cov.get("folded_requests"), cov.get("traffic_requests"),
                       cov.get("traffic_share"))
    out = [f"stands on {n} of {total} requests" if total is not None
           else f"stands on {n} folded requests"]
    if share is not None:
        kv = cov.get("kv_share")
        out[0] += (f" ({share:.0%} of prompt tokens"
                   + (f", {kv:.0%} of KV block-seconds" if kv is not None else "")
                   + (", traffic-weighted)" if cov.get("corrected") else ", as sampled)"))
    if cov.get("dynamic_kv_heads") is not None:
        rated = cov.get("rated_kv_heads")
        out.append(f"dynamic heads: {cov['dynamic_kv_heads']} of {cov['kv_heads']} KV heads "
                   f"({cov['dynamic_share']:.1%}" + (f"; {rated} rated by two or more views"
                                                      if rated is not None else "")
                   + "), kept full")
    return out


def export_summary(rec: Recommendation, replay: Mapping[str, Any] | None = None
                   ) -> WindowAdvice:
    """Bounded view of a recommendation for metrics, snapshot JSON and profile.json.

    Size is O(layers x windows): per layer, the windowable-or-not decision, mean sink mass,
    KV-head class counts and the worst KV head's low-quantile coverage at each grid window.
    No lengths of individual requests, no text. Never raises on a ``recommend`` result.
    """
    best, cls = rec.best, rec.classification
    per_layer = None
    if cls:
        per_layer = []
        for x in cls.layers:
            cov: dict[str, float | None] = {}
            for w in cls.window_grid:
                vals = [v for k in x.kv_heads if (v := k.coverage_q.get(w)) is not None]
                cov[str(w)] = min(vals) if len(vals) == len(x.kv_heads) else None
            per_layer.append(LayerAdvice(
                layer=x.layer, window=x.window, windowed=x.layer in best.layers,
                sink_mass=x.sink_mass, classes=dict(x.classes), coverage_q=cov))
    tr = best.traffic
    return WindowAdvice(
        sinks=best.sinks, window=best.window, layers=list(best.layers),
        attention_flop_saving=best.attention_flop_saving,
        kv_memory_saving=best.kv_memory_saving,
        exact_request_fraction=best.exact_request_fraction,
        heads_at_risk_count=best.heads_at_risk_count,
        heads_undecided=None if rec.undecided is None
        else {str(w): n for w, n in rec.undecided.items()},
        coverage=rec.coverage,
        min_n_eff=best.min_n_eff,
        basis=rec.basis,
        traffic=AdviceTraffic(requests=tr.requests, p50=tr.p50, p90=tr.p90, p99=tr.p99,
                              max=tr.max),
        replay=None if replay is None else ReplayEvidence(
            agreement=replay["agreement"], mean_kl=replay["mean_kl"],
            positions=replay["positions"], safe=bool(replay["safe"]),
            verdict=replay["verdict"]),
        safe=bool(replay and replay.get("safe")),
        # the sentence renders the suggest-window document: the one text both print
        summary=format_summary(rec.to_json(), replay),
        per_layer=per_layer,
        underused_heads=None if not rec.underused_heads else [
            UnderusedHead(kind=f["kind"], layer=f["layer"], head=f["head"],
                          kv_head=f["kv_head"], twin=f["twin"], kv_share=f["kv_share"],
                          kv_head_share=f["kv_head_share"], queries=f["queries"],
                          evidence=dict(f["evidence"]), confidence=f["confidence"],
                          safe=bool(f.get("safe")))
            for f in rec.underused_heads["findings"]],
    )
