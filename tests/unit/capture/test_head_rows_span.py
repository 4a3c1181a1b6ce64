"""A prompt folded in pieces (chunked prefill, a prefix-cache hit's tail) folds exactly what the
prompt served whole folds: the whole prompt's sample plan, weights and detail queries,
restricted to each piece, and the request counted once over its pieces. Tiling the queries to
bound scratch changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.coverage import folded_requests
from attnprof.capture import head_rows

HKV, G, D, L = 2, 2, 16, 300


def _acc() -> HeadStatsAccumulator:
    return HeadStatsAccumulator(1, HKV, G, n_random=24, n_last=4, n_detail=3,
                                window_grid=(16, 64, 128))


def _qk() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(L, HKV * G, D, generator=g), torch.randn(L, HKV, D, generator=g)


def _fields(acc: HeadStatsAccumulator) -> dict[str, np.ndarray]:
    return {f: getattr(acc, f).copy() for f in (*HeadStatsAccumulator._SUM_FIELDS, "cov_min")}


def _assert_same(a: HeadStatsAccumulator, b: HeadStatsAccumulator) -> None:
    fa, fb = _fields(a), _fields(b)
    for f in fa:
        np.testing.assert_allclose(fa[f], fb[f], rtol=1e-6, atol=1e-9, err_msg=f)


def test_chunks_fold_what_the_whole_prompt_folds() -> None:
    q, k = _qk()
    whole = _acc()
    n_whole = head_rows.update(whole, 0, q, k, D ** -0.5, q_start=0)
    chunked = _acc()
    n = 0
    for a in range(0, L, 64):  # 64-token chunks, each against all earlier keys
        b = min(L, a + 64)
        n += head_rows.update_span(chunked, 0, q[a:b], k[:b], D ** -0.5, prompt_len=L,
                                   q_start=a)
    assert n == n_whole > 0
    _assert_same(chunked, whole)
    assert chunked.requests[0] == pytest.approx(1.0)  # once, not once per chunk
    assert chunked.requests_seen[0] == whole.requests_seen[0] == 1  # on the last chunk only
    assert chunked.detail_n[0, 0] == whole.detail_n[0, 0] == 3


def test_a_first_chunk_is_not_a_whole_prompt() -> None:
    q, k = _qk()
    first = _acc()
    head_rows.update_span(first, 0, q[:64], k[:64], D ** -0.5, prompt_len=L, q_start=0)
    short = _acc()  # what the old path did: the chunk taken for a 64-token prompt
    head_rows.update(short, 0, q[:64], k[:64], D ** -0.5, q_start=0)
    idx, wts = _acc().sample_plan(L, 0)
    assert first.requests[0] == pytest.approx(64 / L) and short.requests[0] == 1
    assert first.requests_seen[0] == 0  # its last position is still to come
    # the whole prompt's strata restricted to the chunk, not a 64-token prompt's plan
    assert first.queries[0, 0] == np.sum(idx < 64) != short.queries[0, 0]
    assert first.weight_sum[0, 0] == pytest.approx(wts[idx < 64].sum())


def test_prefix_cached_tail_folds_only_computed_positions() -> None:
    q, k = _qk()
    cached = 200
    tail = _acc()
    head_rows.update_span(tail, 0, q[cached:], k, D ** -0.5, prompt_len=L, q_start=cached)
    idx, wts = _acc().sample_plan(L, 0)
    assert tail.queries[0, 0] == np.sum(idx >= cached)
    assert tail.weight_sum[0, 0] == pytest.approx(wts[idx >= cached].sum())
    assert tail.requests[0] == pytest.approx((L - cached) / L)  # partial coverage
    # ... yet one request seen: "N requests folded" never rounds a cached prompt down to 0
    assert tail.requests_seen[0] == 1
    assert folded_requests(tail) == 1


def test_scratch_tiles_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = _qk()
    big = _acc()
    head_rows.update(big, 0, q, k, D ** -0.5, q_start=0)
    monkeypatch.setattr(head_rows, "SCRATCH_ELEMENTS", HKV * G * L)  # one query per tile
    small = _acc()
    head_rows.update(small, 0, q, k, D ** -0.5, q_start=0)
    _assert_same(small, big)


def test_too_few_keys_is_refused() -> None:
    q, k = _qk()
    with pytest.raises(ValueError):
        head_rows.update_span(_acc(), 0, q[100:], k[:150], D ** -0.5, prompt_len=L,
                              q_start=100)
