"""The API server's live view: coverage per bucket and head stability from the workers'
strata deltas over successive refreshes (epochs), in the snapshot and on /metrics."""

from __future__ import annotations

from typing import Any

import pytest

from attnprof.aggregate.head_epochs import EpochRing
from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HeadStatsStrata
from attnprof.aggregate.requests import RequestAggregates
from attnprof.exporters import catalog as cat
from attnprof.exporters.samples import HistogramSample
from attnprof.host.vllm import runtime
from attnprof.host.vllm.stat_logger import request_samples
from tests.unit.analyze.test_coverage_stability import SAMPLE, VOTE, fold
from tests.unit.host.test_endpoint import KEY, FakeEngine, _answer, _app, _get, serving_state


@pytest.fixture()
def state(monkeypatch: pytest.MonkeyPatch) -> runtime.State:
    st = serving_state(monkeypatch, snapshot_max_age_s=0.0)
    st.requests = RequestAggregates(4096, min_tokens=256)
    for _ in range(4 * VOTE):
        st.requests.observe(256, 8, 0.1, 0.2)
    return st


def delta(kinds: list[str]) -> bytes:
    """One worker's strata delta: VOTE 256-token prompts folded in bucket 256 (the
    requests a view needs before it rates a head)."""
    st = HeadStatsStrata(HeadStatsAccumulator(1, 2, 1, sinks_grid=(0, 4),
                                              window_grid=(8, 16, 32, 64)))
    fold(st.get("prefill", 256), 0, 256, kinds, SAMPLE, times=VOTE)
    return st.take_bytes()


def test_a_head_that_changes_between_epochs_is_dynamic_in_the_live_snapshot(
        state: runtime.State) -> None:
    eng = FakeEngine([_answer(11, delta(["needle", "block"]))])
    app = _app(eng, [KEY])
    app.state.plugin.view.epochs = EpochRing(epoch_requests=VOTE)  # one delta per epoch
    (r,) = asyncio_get(app)
    cov = r.json()["coverage"]
    row = next(b for b in cov["buckets"] if (b["phase"], b["bucket"]) == ("prefill", 256))
    assert (row["folded_requests"], row["traffic_requests"]) == (VOTE, 4 * VOTE)
    assert cov["stability"]["dynamic_kv_heads"] == 0  # one epoch, one bucket: nothing moves
    eng.answers = [_answer(11, delta(["block", "block"]))]
    (r,) = asyncio_get(app)
    stab = r.json()["coverage"]["stability"]
    assert stab["views"] == ["epoch:0", "epoch:1", "prefill:256"]
    assert stab["layers"][0]["dynamic_kv_heads"] == [0]
    got = {(x.metric.name, x.labels): x.value for x in request_samples()
           if not isinstance(x, HistogramSample)}
    assert got[(cat.HEAD_DYNAMIC_KV_HEADS.name, (("model", "tiny"),))] == 1
    assert got[(cat.COVERAGE_FOLDED_REQUESTS.name,
                (("model", "tiny"), ("phase", "prefill"), ("bucket", "256")))] == 2 * VOTE
    assert got[(cat.CONTEXT_BUCKET_REQUESTS_TOTAL.name,
                (("model", "tiny"), ("bucket", "256")))] == 4 * VOTE


def asyncio_get(app: Any) -> list[Any]:
    import asyncio

    return list(asyncio.run(_get(app, "/attnprof/snapshot")))
