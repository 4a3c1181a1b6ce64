"""Window advice for a live server: traffic lengths (API server) + head statistics (workers).

Computed off the event loop (``asyncio.to_thread``) by the endpoint plugin, periodically and
on every snapshot, and exported as bounded gauges: per layer (sink mass, worst-KV-head
coverage per grid window, head classes) and per model (recommended window, savings).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
from attnprof.contracts.snapshot import Coverage
from attnprof.facts.shape import AttentionShape

if TYPE_CHECKING:
    from attnprof.analyze.sparsity.results import Recommendation

__all__ = [
    "advise",
    "advise_snapshot",
    "advise_strata",
    "coverage_for",
    "recommend_from_snapshot",
    "summarize",
]


@functools.lru_cache(maxsize=4)
def _shape(model_path: str) -> AttentionShape:
    return AttentionShape.from_model_dir(Path(model_path))


def recommend_from_snapshot(snap: dict[str, Any], model_path: str | Path
                            ) -> tuple[Recommendation, Any]:
    """Full recommendation and the head statistics it stands on, for a snapshot's traffic:
    with strata, post-stratified to the snapshot's per-bucket request counts, dynamic heads
    kept full and the need-more-traffic rule (:func:`.sparsity.strata_advice.
    recommend_strata`; the statistics returned are the corrected ones), else the plain merge.

    Raises ``InputError`` when the snapshot has no finished requests yet.
    """
    from attnprof.analyze.sparsity.inputs import from_snapshot, strata_from_snapshot
    from attnprof.analyze.sparsity.strata_advice import recommend_strata
    from attnprof.contracts.snapshot import ContextBuckets

    dist = from_snapshot(snap)
    strata = strata_from_snapshot(snap)
    raw = ((snap.get("requests") or {}).get("context_buckets")
           if isinstance(snap.get("requests"), dict) else None)
    try:
        buckets = ContextBuckets.from_json(raw) if raw else None
    except ValueError:
        buckets = None
    out = recommend_strata(dist, _shape(str(model_path)),
                           dict(strata.items()) if strata is not None else {}, buckets)
    return out.recommendation, out.corrected.acc


def summarize(rec: Recommendation, acc: Any, replay: dict[str, Any] | None = None
              ) -> WindowAdvice:
    """The bounded window advice (snapshot, demo report) with the head-statistics sample."""
    from attnprof.analyze.sparsity.coverage import folded_requests
    from attnprof.analyze.sparsity.recommend import export_summary

    out = export_summary(rec, replay)
    out.head_stats_requests = None if acc is None else folded_requests(acc)
    return out


def advise(requests: Any, acc: Any, model_path: str | None) -> WindowAdvice | AdviceUnavailable:
    """Window advice from the API server's own state: its request statistics (a
    ``RequestStats`` or None) and the head statistics merged from the workers (an accumulator
    or None). What a live server refreshes, without building a snapshot document first."""
    from attnprof.analyze.sparsity.inputs import InputError, from_sketch
    from attnprof.analyze.sparsity.recommend import recommend

    if not model_path or not (Path(model_path) / "config.json").is_file():
        return AdviceUnavailable("the model is not a local checkpoint; use `attnprof "
                                 "suggest-window --model PATH --url ...` instead")
    sketch = getattr(getattr(requests, "context_tokens", None), "sketch", None)
    if not isinstance(sketch, dict):
        return AdviceUnavailable("snapshot: no finished requests recorded yet "
                                 "(requests.context_tokens.sketch is missing)")
    try:
        rec = recommend(from_sketch(sketch, "snapshot"), _shape(str(model_path)), acc)
    except InputError as err:
        return AdviceUnavailable(str(err))
    return summarize(rec, acc)


def coverage_for(requests: Any, strata: Any, epochs: Sequence[Any] = ()) -> Coverage | None:
    """The snapshot's coverage table with head stability, without the model's shape: what
    a server with no local checkpoint still shows. ``strata``: a ``HeadStatsStrata`` (or
    None); ``requests``: a ``RequestStats`` (or None)."""
    from attnprof.analyze.sparsity.coverage import coverage_table
    from attnprof.analyze.sparsity.stability import stability, stability_views

    items = dict(strata.items()) if strata is not None else {}
    cov = coverage_table(items, getattr(requests, "context_buckets", None))
    if cov is not None:
        st = stability(stability_views(items, epochs))
        cov.stability = None if st is None else st.record
    return cov


def advise_strata(requests: Any, strata: Any, model_path: str | None,
                  epochs: Sequence[Any] = ()
                  ) -> tuple[WindowAdvice | AdviceUnavailable, Coverage | None]:
    """The live server's window advice over stratified statistics (post-stratified to the
    request statistics' context buckets, dynamic heads kept full, "need more traffic" when
    a heavy bucket cannot decide) and the snapshot's coverage section. ``strata``: the
    merged ``HeadStatsStrata`` (or None), ``epochs``: the epoch ring's accumulators."""
    from attnprof.analyze.sparsity.coverage import folded_requests
    from attnprof.analyze.sparsity.inputs import InputError, from_sketch
    from attnprof.analyze.sparsity.strata_advice import recommend_strata

    items = dict(strata.items()) if strata is not None else {}
    sketch = getattr(getattr(requests, "context_tokens", None), "sketch", None)
    if (not model_path or not (Path(model_path) / "config.json").is_file()
            or not isinstance(sketch, dict) or not items):
        adv = advise(requests, None if strata is None else strata.total("prefill"), model_path)
        return adv, coverage_for(requests, strata, epochs)
    try:
        out = recommend_strata(from_sketch(sketch, "snapshot"), _shape(str(model_path)), items,
                               getattr(requests, "context_buckets", None), epochs=epochs)
    except InputError as err:
        return AdviceUnavailable(str(err)), coverage_for(requests, strata, epochs)
    acc = out.corrected.acc
    adv = summarize(out.recommendation, acc)
    adv.head_stats_requests = sum(folded_requests(a) for (ph, _), a in items.items()
                                  if ph == "prefill")
    return adv, out.coverage


def advise_snapshot(snap: dict[str, Any], model_path: str | None
                    ) -> WindowAdvice | AdviceUnavailable:
    """Window advice for a live snapshot, or :class:`AdviceUnavailable` saying what is
    missing (no local checkpoint, no finished requests yet)."""
    from attnprof.analyze.sparsity.inputs import InputError

    if not model_path or not (Path(model_path) / "config.json").is_file():
        return AdviceUnavailable("the model is not a local checkpoint; use `attnprof "
                                 "suggest-window --model PATH --url ...` instead")
    try:
        rec, acc = recommend_from_snapshot(snap, model_path)
    except InputError as err:
        return AdviceUnavailable(str(err))
    return summarize(rec, acc)
