"""/metrics samples of the coverage table, head stability and the need-more-traffic verdict,
from the analysis' own outputs over statistics folded by the real ``head_rows.update``."""

from __future__ import annotations

from typing import Any

import pytest

from attnprof.aggregate.head_strata import HeadStatsStrata
from attnprof.aggregate.requests import RequestAggregates
from attnprof.analyze.sparsity.recommend import export_summary
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.analyze.sparsity.strata_advice import recommend_strata
from attnprof.analyze.window_advice import coverage_for
from attnprof.exporters import catalog as cat
from attnprof.exporters.samples import context_bucket_samples, coverage_samples
from attnprof.facts.shape import AttentionShape
from tests.unit.analyze.test_coverage_stability import TH, D, sink_strata, traffic


def by_name(samples: list[Any]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for x in samples:
        out.setdefault(x.metric.name, {})[x.labels] = x.value
    return out


def test_coverage_and_verdict_gauges() -> None:
    edges = [0, 256, 512, 1024, 2048]
    tr = traffic(edges, [0, 3000, 0, 12000, 0], [0, 50, 0, 50, 0], requests=[0, 10, 0, 10, 0])
    out = recommend_strata(LengthDistribution.from_lengths([300] * 10 + [1200] * 10),
                           AttentionShape(1, 1, 1, D, "float32"), sink_strata(10), tr,
                           thresholds=TH)
    assert out.coverage is not None
    adv = export_summary(out.recommendation).to_json()
    got = by_name(coverage_samples("m", out.coverage.to_json(), adv))
    folded = got[cat.COVERAGE_FOLDED_REQUESTS.name]
    assert folded[(("model", "m"), ("phase", "prefill"), ("bucket", "256"))] == 2
    assert folded[(("model", "m"), ("phase", "prefill"), ("bucket", "1024"))] == 1
    assert folded[(("model", "m"), ("phase", "prefill"), ("bucket", "2048"))] == 0
    # sampled queries stand for 20 x 2 of 3000 and 10 of 12000 prompt tokens
    share = got[cat.COVERAGE_QUERY_SHARE_RATIO.name]
    assert share[(("model", "m"), ("phase", "prefill"), ("bucket", "256"))] == \
        pytest.approx(40 / 3000, abs=1e-4)
    assert share[(("model", "m"), ("phase", "prefill"), ("bucket", "1024"))] == \
        pytest.approx(10 / 12000, abs=1e-4)
    assert got[cat.COVERAGE_TRAFFIC_SHARE_RATIO.name] == {
        (("model", "m"), ("phase", "prefill")): 1.0}
    assert got[cat.WINDOW_NEED_MORE_TRAFFIC_TOKENS.name] == {(("model", "m"),): 1024}
    assert got[cat.HEAD_DYNAMIC_KV_HEADS.name] == {(("model", "m"),): 0}
    # an error advice or no verdict: no need-more-traffic series
    assert cat.WINDOW_NEED_MORE_TRAFFIC_TOKENS.name not in by_name(
        coverage_samples("m", out.coverage.to_json(), {"error": "x"}))


def test_bucket_counters_carry_counts_never_token_sums() -> None:
    agg = RequestAggregates(4096, min_tokens=256)
    agg.observe(3777, 5, 0.5, 0.1)  # alone in its bucket
    got = by_name(context_bucket_samples("m", agg.context_buckets()))
    assert set(got) == {cat.CONTEXT_BUCKET_REQUESTS_TOTAL.name,
                        cat.CONTEXT_BUCKET_KV_BLOCK_SECONDS_TOTAL.name}
    assert got[cat.CONTEXT_BUCKET_REQUESTS_TOTAL.name][(("model", "m"), ("bucket", "2048"))] == 1
    assert all(v != 3777 for vals in got.values() for v in vals.values())


def test_coverage_without_a_model_checkpoint() -> None:
    agg = RequestAggregates(4096, min_tokens=256)
    agg.observe(300, 10)

    strata = HeadStatsStrata(next(iter(sink_strata(10).values())))
    for (phase, lo), acc in sink_strata(10).items():
        strata.get(phase, lo).merge(acc)
    cov = coverage_for(agg.summary(), strata)
    assert cov is not None and cov.stability is not None
    rows = {(r.phase, r.bucket): r for r in cov.buckets}
    assert rows[("prefill", 256)].traffic_requests == 1
    assert rows[("prefill", 1024)].folded_requests == 1
    assert rows[("prefill", 1024)].traffic_requests == 0


CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
          "head_dim": D, "hidden_size": D, "torch_dtype": "float32"}


def thin_snapshot() -> dict[str, Any]:
    """A live snapshot as JSON: 10 prompts of 300 and 10 of 1200 tokens finished (the 1024
    bucket holds 80% of the KV block-seconds), statistics folded from 2 short prompts and 1
    long one (10 sampled queries: undecided), in the strata's own wire format."""
    import json

    from attnprof.contracts.snapshot import Snapshot

    agg = RequestAggregates(4096, min_tokens=256)
    for _ in range(10):
        agg.observe(300, 1, 1.0, 0.0)
        agg.observe(1200, 1, 1.0, 0.0)
    strata = HeadStatsStrata(next(iter(sink_strata(10).values())))
    for (phase, lo), acc in sink_strata(10).items():
        strata.get(phase, lo).merge(acc)
    cov = coverage_for(agg.summary(), strata)
    snap = Snapshot(time=0.0, model="m", enabled=True, requests=agg.summary(),
                    coverage=cov).to_json()
    snap["head_stats"] = strata.to_dict()
    return dict(json.loads(json.dumps(snap)))


def test_a_snapshot_carries_coverage_to_the_advice_and_the_terminal(tmp_path: Any) -> None:
    """Through JSON as a live server writes it: the request statistics with their per-bucket
    counts, the strata's own wire format, the coverage section; the advice read back from it
    is the stratified one (need more traffic), and the terminal prints the table."""
    import json

    from attnprof.analyze.window_advice import recommend_from_snapshot
    from attnprof.exporters.terminal import render_snapshot
    from attnprof.exporters.terminal_suggest import render

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    snap = thin_snapshot()
    rec, acc = recommend_from_snapshot(snap, tmp_path)
    assert rec.coverage is not None and rec.coverage.need_more_traffic_above == 1024
    assert rec.best.layers == () and acc is not None and rec.coverage.corrected
    text = render(rec.to_json())
    assert "too little coverage at 1024-2047 tokens" in text
    assert "suggestion: none yet, need more traffic at > 1024 tokens" in text
    shown = render_snapshot(snap)
    assert "Head-statistics coverage by context bucket" in shown
    row = next(line for line in shown.splitlines() if line.startswith("prefill  1024-2047"))
    assert row.split()[2] == "1/10"  # folded/requests
