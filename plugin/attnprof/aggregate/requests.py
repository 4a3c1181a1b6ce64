"""Request-level statistics of the API server: context, prompt and generated token counts
of finished requests, and KV-cache usage (now, and over time in :mod:`attnprof.aggregate.kv`).
Token counts only: never ids or text.

One object per process, shared by every engine's stat logger; bounded memory (a quantile
estimator per quantity, fixed-bucket histograms up to ``max_model_len``, and exact counters
per head-statistics context bucket: requests, prompt tokens, decode queries and estimated KV
block-seconds, on the buckets of :func:`attnprof.aggregate.head_strata.context_bucket_edges`
so the coverage table lines up with the statistics' strata).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from attnprof.aggregate.head_strata import context_bucket_edges
from attnprof.aggregate.histogram import BucketHistogram, HistogramState, log_buckets
from attnprof.aggregate.kv import FinishedRequest, KvPressure, block_seconds
from attnprof.aggregate.quantiles import QuantileEstimator
from attnprof.contracts.snapshot import ContextBuckets, ContextHistogram, QuantileSummary
from attnprof.contracts.snapshot import RequestStats as RequestStatsDoc
from attnprof.facts.kv import held_tokens

__all__ = ["QUANTITIES", "RequestAggregates", "bucket_block_seconds", "decode_queries_by_bucket"]

QUANTITIES = ("context", "prompt", "generation")


def _summary(est: QuantileEstimator, with_state: bool) -> QuantileSummary:
    s = est.summary()
    return QuantileSummary(p50=s["p50"], p90=s["p90"], p99=s["p99"], mean=s["mean"],
                           max=s["max"], count=s["count"], exact=s["exact"],
                           sketch=est.to_dict() if with_state else None)


def _held_integral(a: float, b: float, window: int | None) -> float:
    """Integral of ``held_tokens(c, window)`` over contexts c in [a, b]."""
    def f(x: float) -> float:
        if not window or x <= window:
            return x * x / 2
        return window * window / 2 + window * (x - window)
    return f(b) - f(a) if b > a else 0.0


def bucket_block_seconds(r: FinishedRequest, edges: Sequence[int], block_size: int,
                         window: int | None = None) -> list[float]:
    """:func:`attnprof.aggregate.kv.block_seconds` of one finished request split by context
    bucket (``edges``: lower edges, the last bucket open); the parts sum to it exactly.

    Estimate (from what vLLM's ``FinishedRequestStats`` carries: prompt and generated
    tokens, prefill and decode times): the prompt P is held for the prefill time, in the
    prompt's bucket: ``held(P) * prefill_time / block_size``; then the context grows linearly
    from P to P + G over the decode time, so the decode part, ``held(P + G/2) * decode_time /
    block_size``, is shared among the buckets the context passes through in proportion to
    the integral of ``held(c)`` over each bucket's stretch of [P, P + G] (without a window:
    exactly the block-seconds held while the context was in that bucket)."""
    out = [0.0] * len(edges)
    p, g = float(r.prompt_tokens), float(r.generation_tokens)
    bs = max(1, block_size)
    b = max(0, bisect.bisect_right(edges, int(p)) - 1)
    out[b] += held_tokens(p, window) * max(0.0, r.prefill_time_s) / bs
    decode = block_seconds(FinishedRequest(r.prompt_tokens, r.generation_tokens, 0.0,
                                           r.decode_time_s), block_size, window)
    if decode <= 0 or g <= 0:
        return out
    whole = _held_integral(p, p + g, window)
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else float("inf")
        part = _held_integral(max(p, lo), min(p + g, hi), window)
        if part > 0:
            out[i] += decode * part / whole
    return out


def decode_queries_by_bucket(prompt: int, generated: int, edges: Sequence[int]) -> list[int]:
    """Decode queries of one request per context bucket: a request of ``generated`` tokens
    runs ``generated - 1`` decode steps (the first token comes from the prefill), whose
    queries see contexts P + 1 .. P + G - 1 (the sequence length at that step, what the
    worker buckets a decode query by)."""
    out = [0] * len(edges)
    first, last = prompt + 1, prompt + generated - 1
    for i, lo in enumerate(edges):
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else last
        n = min(last, hi) - max(first, lo) + 1
        if n > 0:
            out[i] = n
    return out


class RequestAggregates:
    def __init__(self, max_model_len: int, buckets: Sequence[float] | None = None,
                 min_tokens: int = 256) -> None:
        """``buckets``: histogram edges (default 1-2-5 up to max_model_len; pass
        ``pow2_buckets(max_model_len)`` when OTLP exponential histograms are wanted).
        ``min_tokens``: the head statistics' minimum prompt (``ATTNPROF_HEAD_STATS_MIN_TOKENS``),
        the upper edge of the context buckets' "short" bucket."""
        self.max_model_len = max_model_len
        self.min_tokens = int(min_tokens)
        self.context_edges = context_bucket_edges(self.min_tokens, max(1, max_model_len))
        n = len(self.context_edges)
        self.bucket_requests = [0] * n
        self.bucket_prompt = [0] * n
        self.bucket_decode = [0] * n
        self.bucket_block_s = [0.0] * n
        self.buckets = list(buckets) if buckets is not None else log_buckets(max(1, max_model_len))
        self.quantiles = {q: QuantileEstimator() for q in QUANTITIES}
        self.histograms = {q: BucketHistogram(self.buckets) for q in QUANTITIES}
        self.kv_cache_usage: float | None = None
        self.requests = 0
        self.kv = KvPressure()  # its own lock: record() runs per engine step
        self.lock = threading.Lock()

    def observe(self, prompt: int, generated: int, prefill_time_s: float = 0.0,
                decode_time_s: float = 0.0) -> None:
        """One finished request (called by the stat logger; a few microseconds): its token
        counts, and its prefill and decode times for the KV block-seconds per bucket."""
        edges = self.context_edges
        kv_s = bucket_block_seconds(
            FinishedRequest(prompt, generated, prefill_time_s, decode_time_s), edges,
            self.kv.block_size or 16, self.kv._window())  # as its class_block_seconds
        dec = decode_queries_by_bucket(prompt, generated, edges)
        with self.lock:
            self.requests += 1
            for q, v in (("prompt", prompt), ("generation", generated),
                         ("context", prompt + generated)):
                self.quantiles[q].add(v)
                self.histograms[q].observe(v)
            b = max(0, bisect.bisect_right(edges, prompt) - 1)
            self.bucket_requests[b] += 1
            self.bucket_prompt[b] += prompt
            for i in range(len(edges)):
                self.bucket_decode[i] += dec[i]
                self.bucket_block_s[i] += kv_s[i]

    def context_buckets(self) -> ContextBuckets:
        """A copy of the per-bucket counters."""
        with self.lock:
            return self._context_buckets()

    def _context_buckets(self) -> ContextBuckets:
        return ContextBuckets(edges=list(self.context_edges), min_tokens=self.min_tokens,
                              requests=list(self.bucket_requests),
                              prompt_tokens=list(self.bucket_prompt),
                              decode_tokens=list(self.bucket_decode),
                              kv_block_seconds=list(self.bucket_block_s))

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
                kv_pressure=self.kv.summary(), context_buckets=self._context_buckets())
