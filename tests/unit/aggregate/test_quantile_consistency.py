"""The same requests give the same p50/p90/p99 in the snapshot (RequestAggregates), the CLI
table, the Prometheus quantile gauge and the window advice (from_snapshot ->
LengthDistribution -> recommend -> format_summary), small sample or large."""

from __future__ import annotations

import json
import random
import re

import pytest

from attnprof.aggregate.requests import RequestAggregates
from attnprof.analyze.sparsity.inputs import from_snapshot
from attnprof.analyze.sparsity.recommend import format_summary, recommend
from attnprof.exporters.samples import Sample, request_samples
from attnprof.exporters.terminal import render_snapshot
from attnprof.facts.shape import AttentionShape

# The demo's mix: 16 short chats and 4 long documents (20 requests).
DEMO = [97, 120, 133, 141, 150, 160, 171, 186, 190, 201, 215, 230, 244, 260, 281, 305,
        642, 1244, 2019, 2893]


def _lengths(n: int) -> list[int]:
    if n == len(DEMO):
        return DEMO
    rng = random.Random(n)
    return [int(rng.lognormvariate(6.5, 1.0)) + 2 for _ in range(n)]


@pytest.mark.parametrize("n", [len(DEMO), 2048, 5000])
def test_same_quantiles_everywhere(n: int) -> None:
    lengths = _lengths(n)
    agg = RequestAggregates(max_model_len=65536)
    for t in lengths:
        agg.observe(prompt=t - 1, generated=1)
    doc = agg.summary()
    ctx = doc.context_tokens
    assert ctx.count == n and ctx.exact is (n <= 2048)
    snap = json.loads(json.dumps({"schema_version": "attnprof.snapshot/1.1",
                                  "requests": doc.to_json()}))
    table = (ctx.p50, ctx.p90, ctx.p99)
    # Window advice: snapshot -> distribution -> recommendation -> the printed sentence.
    dist = from_snapshot(snap)
    assert (dist.quantile(0.5), dist.quantile(0.9), dist.quantile(0.99)) == table
    rec = recommend(dist, AttentionShape(4, 4, 2, 16)).to_json()
    assert (rec["traffic"]["p50"], rec["traffic"]["p90"], rec["traffic"]["p99"]) == table
    m = re.search(r"P50/P90/P99 = (\d+)/(\d+)/(\d+)", format_summary(rec))
    assert m is not None and tuple(int(g) for g in m.groups()) == table
    # CLI table (render_snapshot) prints the same integers.
    row = next(line for line in render_snapshot(snap).splitlines()
               if line.startswith("context"))
    assert [int(x) for x in row.split()[1:4]] == list(table)
    # Prometheus gauge attnprof_request_tokens_quantile{quantity="context"}.
    gauge = {dict(s.labels)["q"]: s.value for s in request_samples("m", agg)
             if isinstance(s, Sample) and s.name == "attnprof_request_tokens_quantile"
             and dict(s.labels)["quantity"] == "context"}
    assert (gauge["0.5"], gauge["0.9"], gauge["0.99"]) == table
    if n == len(DEMO):  # exact: p99 of 20 requests is the largest one
        assert table == (201, 1244, 2893)
