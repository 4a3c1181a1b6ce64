"""Request-level statistics of the API server: context, prompt and generated token counts
of finished requests, and KV-cache usage (now, and over time in :mod:`attnprof.aggregate.kv`).
Token counts only: never ids or text.

One object per process, shared by every engine's stat logger; bounded memory (a quantile
estimator per quantity and fixed-bucket histograms up to ``max_model_len``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from attnprof.aggregate.histogram import BucketHistogram, HistogramState, log_buckets
from attnprof.aggregate.kv import KvPressure
from attnprof.aggregate.quantiles import QuantileEstimator
from attnprof.contracts.snapshot import ContextHistogram, QuantileSummary
from attnprof.contracts.snapshot import RequestStats as RequestStatsDoc

__all__ = ["QUANTITIES", "RequestAggregates"]

QUANTITIES = ("context", "prompt", "generation")


def _summary(est: QuantileEstimator, with_state: bool) -> QuantileSummary:
    s = est.summary()
    return QuantileSummary(p50=s["p50"], p90=s["p90"], p99=s["p99"], mean=s["mean"],
                           max=s["max"], count=s["count"], exact=s["exact"],
                           sketch=est.to_dict() if with_state else None)


class RequestAggregates:
    def __init__(self, max_model_len: int, buckets: Sequence[float] | None = None) -> None:
        """``buckets``: histogram edges (default 1-2-5 up to max_model_len; pass
        ``pow2_buckets(max_model_len)`` when OTLP exponential histograms are wanted)."""
        self.max_model_len = max_model_len
        self.buckets = list(buckets) if buckets is not None else log_buckets(max(1, max_model_len))
        self.quantiles = {q: QuantileEstimator() for q in QUANTITIES}
        self.histograms = {q: BucketHistogram(self.buckets) for q in QUANTITIES}
        self.kv_cache_usage: float | None = None
        self.requests = 0
        self.kv = KvPressure()  # its own lock: record() runs per engine step
        self.lock = threading.Lock()

    def observe(self, prompt: int, generated: int) -> None:
        """One finished request (called by the stat logger; a few microseconds)."""
        with self.lock:
            self.requests += 1
            for q, v in (("prompt", prompt), ("generation", generated),
                         ("context", prompt + generated)):
                self.quantiles[q].add(v)
                self.histograms[q].observe(v)

    def set_kv_usage(self, usage: float) -> None:
        self.kv_cache_usage = usage

    def histogram_states(self) -> dict[str, HistogramState]:
        with self.lock:
            return {q: h.state() for q, h in self.histograms.items()}

    def summary(self, with_state: bool = True) -> RequestStatsDoc:
        """Quantiles of each quantity; ``with_state`` adds the context estimator's mergeable
        state (snapshots need it for fleet merges; the once-a-second export does not)."""
        with self.lock:
            ctx = self.histograms["context"].state()
            return RequestStatsDoc(
                requests=self.requests, max_model_len=self.max_model_len,
                context_tokens=_summary(self.quantiles["context"], with_state),
                prompt_tokens=_summary(self.quantiles["prompt"], False),
                generation_tokens=_summary(self.quantiles["generation"], False),
                kv_cache_usage=self.kv_cache_usage,
                context_histogram=ContextHistogram(bounds=list(ctx.bounds),
                                                   counts=list(ctx.counts)),
                kv_pressure=self.kv.summary())
