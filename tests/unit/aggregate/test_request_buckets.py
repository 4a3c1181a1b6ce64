"""Exact per-context-bucket traffic counters of the API server (the coverage table's
denominator): requests, prompt tokens, decode queries and KV block-seconds."""

from __future__ import annotations

import pytest

from attnprof.aggregate.head_strata import context_bucket, context_bucket_edges
from attnprof.aggregate.kv import FinishedRequest, block_seconds
from attnprof.aggregate.requests import (
    RequestAggregates,
    bucket_block_seconds,
    decode_queries_by_bucket,
)
from attnprof.contracts.snapshot import RequestStats

EDGES = (0, 256, 512, 1024)


def test_block_seconds_split_by_the_context_the_request_passes_through() -> None:
    r = FinishedRequest(300, 400, 1.0, 2.0)
    parts = bucket_block_seconds(r, EDGES, 16)
    # prefill: 300 tokens for 1 s in the 256 bucket; decode: (300 + 400/2) x 2 s = 62.5
    # block-seconds, the context growing 300 -> 700: int c dc over [300, 512] and [512, 700]
    whole = (700 ** 2 - 300 ** 2) / 2
    assert parts[0] == 0 and parts[3] == 0
    assert parts[1] == pytest.approx(300 / 16 + 62.5 * (512 ** 2 - 300 ** 2) / 2 / whole)
    assert parts[2] == pytest.approx(62.5 * (700 ** 2 - 512 ** 2) / 2 / whole)
    assert sum(parts) == pytest.approx(block_seconds(r, 16))
    # with a window every layer honours, the parts still sum to kv.block_seconds' estimate
    assert sum(bucket_block_seconds(r, EDGES, 16, 400)) == pytest.approx(
        block_seconds(r, 16, 400))
    # no generation: only the prompt's bucket
    assert bucket_block_seconds(FinishedRequest(2000, 0, 0.5, 0.0), EDGES, 16) == \
        [0, 0, 0, pytest.approx(2000 * 0.5 / 16)]


def test_decode_queries_are_split_exactly_by_context() -> None:
    # 400 generated tokens: 399 decode steps, contexts 301 .. 699
    assert decode_queries_by_bucket(300, 400, EDGES) == [0, 211, 188, 0]
    assert decode_queries_by_bucket(300, 1, EDGES) == [0, 0, 0, 0]
    assert decode_queries_by_bucket(1000, 100, EDGES) == [0, 0, 23, 76]


def test_observe_counts_per_bucket_and_lines_up_with_the_workers_strata() -> None:
    agg = RequestAggregates(4096, min_tokens=256)
    # the worker's edges (capture: context_bucket_edges(min, 32768)) below max_model_len
    worker = context_bucket_edges(256, 32768)
    assert list(agg.context_edges) == [e for e in worker if e <= 4096]
    agg.observe(100, 20, 0.1, 0.2)  # a short chat: bucket 0
    agg.observe(300, 400, 1.0, 2.0)
    agg.observe(5000, 10, 1.0, 0.1)  # above the last edge: the open bucket
    cb = agg.summary().context_buckets
    assert cb is not None and cb.min_tokens == 256
    i = {e: n for n, e in enumerate(cb.edges)}
    assert cb.requests[i[0]] == 1 and cb.requests[i[256]] == 1 and cb.requests[i[4096]] == 1
    assert sum(cb.requests) == 3
    assert cb.prompt_tokens[i[context_bucket(300, worker)]] == 300
    assert sum(cb.prompt_tokens) == 5400
    assert sum(cb.decode_tokens) == 19 + 399 + 9
    total = sum(block_seconds(FinishedRequest(*x), 16) for x in
                ((100, 20, 0.1, 0.2), (300, 400, 1.0, 2.0), (5000, 10, 1.0, 0.1)))
    assert sum(cb.kv_block_seconds) == pytest.approx(total)
    back = RequestStats.from_json(agg.summary().to_json())
    assert back.context_buckets == cb


def test_a_record_window_counts_only_the_requests_inside_it() -> None:
    from attnprof.analyze.window import window_between
    from attnprof.contracts.snapshot import Coverage, Snapshot

    agg = RequestAggregates(4096, min_tokens=256)
    agg.observe(300, 10, 1.0, 1.0)
    start = Snapshot(time=0.0, model="m", enabled=True, requests=agg.summary())
    agg.observe(300, 10, 1.0, 1.0)
    agg.observe(1200, 10, 1.0, 1.0)
    end = Snapshot(time=1.0, model="m", enabled=True, requests=agg.summary(),
                   coverage=Coverage(min_tokens=256, buckets=[], phases=[]))
    win = window_between(start, end)
    assert win.requests is not None and win.requests.context_buckets is not None
    cb, whole = win.requests.context_buckets, agg.context_buckets()
    i = {e: n for n, e in enumerate(cb.edges)}
    assert cb.requests[i[256]] == 1 and cb.requests[i[1024]] == 1 and sum(cb.requests) == 2
    assert cb.prompt_tokens is not None and sum(cb.prompt_tokens) == 1500
    assert sum(cb.kv_block_seconds) == pytest.approx(
        sum(whole.kv_block_seconds) - block_seconds(FinishedRequest(300, 10, 1.0, 1.0), 16))
    assert win.coverage is None  # the statistics' folds in the window are not known
