"""What the cost report's window advice stands on (issue 31, points 3 and 4): the report
carries the snapshot's coverage per context bucket (prefill and decode side by side) against
the traffic's requests, query tokens and KV block-seconds, the need-more-traffic verdict and
the dynamic-head share; an old snapshot without coverage says so instead of crashing.

The snapshot is the golden demo's (a real run's, from before coverage existed) with a
coverage section made by the live view's own function (``coverage_table``) over real
accumulators; every expected number below is one of the inputs written here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.advice_basis import NO_COVERAGE, advice_basis
from attnprof.analyze.cost import Settings, build_model_report
from attnprof.analyze.sparsity.coverage import coverage_table
from attnprof.contracts.advice import AdviceCoverage, UnderCoveredBucket, WindowAdvice
from attnprof.contracts.report import ModelReport, Report
from attnprof.contracts.snapshot import ContextBuckets, HeadStability, LayerAgreement
from attnprof.tools.report_sources import from_snapshot
from tests.unit.analyze.test_cost_report import FLAGS

DEMO = Path(__file__).parents[2] / "data" / "demo.json"

# The traffic: 16 short chats, 3 prompts of 256-511 tokens, 1 of 512-1023 (60% of the KV
# block-seconds, and no statistics there).
BUCKETS = ContextBuckets(edges=[0, 256, 512, 1024], min_tokens=256, requests=[16, 3, 1, 0],
                         kv_block_seconds=[10.0, 30.0, 60.0, 0.0],
                         prompt_tokens=[1600, 900, 700, 0], decode_tokens=[300, 60, 20, 0])


def _acc(requests: int, weight: float, sampled: int) -> HeadStatsAccumulator:
    acc = HeadStatsAccumulator(2, 2, 2)
    acc.requests[:] = requests
    acc.weight_sum[:] = weight
    acc.queries[:] = sampled
    return acc


def _strata() -> dict[tuple[str, int], HeadStatsAccumulator]:
    return {("prefill", 0): _acc(16, 1600.0, 64), ("prefill", 256): _acc(3, 900.0, 64),
            ("decode", 0): _acc(4, 80.0, 12)}


ADVICE_COVERAGE = AdviceCoverage(
    folded_requests=19, traffic_requests=20, traffic_share=0.7812, corrected=True,
    need_more_traffic_above=512,
    under_covered=[UnderCoveredBucket(bucket=512, hi=1024, kv_share=0.6,
                                      undecided_kv_heads=0, unmeasured_kv_heads=4,
                                      min_n_eff=None)],
    dynamic_kv_heads=1, kv_heads=4, dynamic_share=0.25, kv_share=0.4, rated_kv_heads=3)

STABILITY = HeadStability(
    views=["epoch:0", "epoch:1", "prefill:0", "prefill:256"], kv_heads=4, dynamic_kv_heads=1,
    dynamic_share=0.25,
    layers=[LayerAgreement(layer=0, kappa=0.5, agreement=0.8, rated_kv_heads=2,
                           dynamic_kv_heads=[1]),
            LayerAgreement(layer=1, kappa=1.0, agreement=1.0, rated_kv_heads=1,
                           dynamic_kv_heads=[])])


def _demo(coverage: bool = True, advice: bool = True) -> tuple[dict[str, Any], Any]:
    """(the demo's snapshot JSON, its window advice), with coverage added when asked."""
    from attnprof.contracts.snapshot import Snapshot

    demo = json.loads(DEMO.read_text())
    snap = Snapshot.from_json(demo["snapshot"])
    wa = WindowAdvice.from_json(demo["window_advice"]) if advice else None
    if coverage:
        assert snap.requests is not None
        snap.requests.context_buckets = BUCKETS
        snap.coverage = coverage_table(_strata(), BUCKETS)
        assert snap.coverage is not None
        snap.coverage.stability = STABILITY
        if wa is not None:
            wa.coverage = ADVICE_COVERAGE
    return snap.to_json(), wa


def _model(coverage: bool = True, advice: bool = True) -> ModelReport:
    raw, wa = _demo(coverage, advice)
    if not advice:
        raw["window_advice"] = {"error": "no local checkpoint"}
    inp, _ = from_snapshot(raw, "demo.json", advice=wa)
    return build_model_report(inp, Settings(), FLAGS)


def test_the_report_carries_coverage_per_bucket_prefill_and_decode_side_by_side() -> None:
    b = _model().advice_basis
    assert b is not None and b.available and b.min_tokens == 256
    rows = {x.bucket: x for x in b.buckets}
    assert sorted(rows) == [0, 256, 512, 1024]
    assert [rows[lo].traffic_requests for lo in (0, 256, 512, 1024)] == [16, 3, 1, 0]
    assert [rows[lo].kv_block_seconds for lo in (0, 256, 512, 1024)] == [10.0, 30.0, 60.0, 0.0]
    assert rows[512].kv_share == 0.6 and rows[512].hi == 1024 and rows[1024].hi is None
    short, mid, long_ = rows[0], rows[256], rows[512]
    assert short.prefill is not None and short.decode is not None
    assert (short.prefill.folded_requests, short.prefill.folded_queries,
            short.prefill.traffic_queries) == (16, 1600.0, 1600)
    assert (short.decode.folded_requests, short.decode.folded_queries,
            short.decode.traffic_queries) == (4, 80.0, 300)
    assert mid.prefill is not None and mid.prefill.folded_requests == 3
    assert mid.prefill.query_share == 1.0
    assert long_.prefill is not None and long_.prefill.folded_requests == 0
    assert long_.prefill.traffic_queries == 700 and long_.prefill.query_share == 0.0
    assert long_.decode is not None and long_.decode.folded_requests == 0
    # the phases' shares: prompt tokens 2500 of 3200 in buckets with statistics; decode 300
    # of 380
    assert b.prefill_query_share == round(2500 / 3200, 4)
    assert b.decode_query_share == round(300 / 380, 4)


def test_the_sentence_verdict_and_dynamic_share_are_the_advices() -> None:
    b = _model().advice_basis
    assert b is not None
    assert (b.folded_requests, b.traffic_requests, b.kv_share) == (19, 20, 0.4)
    assert b.need_more_traffic_above == 512
    assert b.need_more_traffic is not None
    assert b.need_more_traffic.startswith("need more traffic at > 512 tokens (the 512-1024 "
                                          "bucket holds 60% of the KV block-seconds")
    assert (b.dynamic_kv_heads, b.kv_heads, b.dynamic_share, b.rated_kv_heads) == \
        (1, 4, 0.25, 3)
    assert b.stability_views == 4
    assert b.stands_on.startswith("The window advice stands on 19 of 20 requests (78% of "
                                  "prompt tokens, 40% of KV block-seconds, traffic-weighted)")
    assert "dynamic heads: 1 of 4 KV heads (25.0%; 3 rated by two or more views), kept full" \
        in b.stands_on
    assert "it windows nothing: need more traffic at > 512 tokens" in b.stands_on


def test_without_an_advice_the_statistics_say_what_they_stand_on() -> None:
    b = _model(advice=False).advice_basis
    assert b is not None and b.available
    # from the coverage table: 19 prefill requests folded (16 + 3) of 20
    assert b.stands_on.startswith("No window advice yet; the head statistics so far stand on "
                                  "19 of 20 requests (78% of prompt tokens, 40% of KV "
                                  "block-seconds, traffic-weighted)"), b.stands_on
    assert b.need_more_traffic is None and b.need_more_traffic_above is None
    # the stability the last advice refresh computed: 1 of 4 dynamic, 2 + 1 rated
    assert (b.dynamic_kv_heads, b.kv_heads, b.rated_kv_heads) == (1, 4, 3)


def test_an_old_snapshot_without_coverage_says_so() -> None:
    m = _model(coverage=False)
    b = m.advice_basis
    assert b is not None and not b.available and b.buckets == []
    assert b.stands_on == NO_COVERAGE and NO_COVERAGE.startswith("No coverage data")
    # and the document round-trips (report.json read back)
    rep = Report(generated_at=0.0, source=_source(), models=[m], formulas={}, versions={})
    back = Report.from_json(json.loads(json.dumps(rep.to_json())))
    assert back.models[0].advice_basis == b


def test_a_source_without_coverage_gets_the_no_coverage_basis() -> None:
    """Prometheus' inputs carry no basis: the report still says what is not known."""
    from tests.unit.analyze.test_cost_report import _inputs

    m = build_model_report(_inputs(), Settings(), FLAGS)
    assert m.advice_basis == advice_basis(None, None, None)
    assert m.advice_basis is not None and not m.advice_basis.available


def test_the_basis_round_trips_through_report_json() -> None:
    m = _model()
    rep = Report(generated_at=0.0, source=_source(), models=[m], formulas={}, versions={})
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["schema_version"] == "attnprof.report/2.2"
    basis = doc["models"][0]["advice_basis"]
    assert basis["buckets"][2]["prefill"]["traffic_queries"] == 700
    assert Report.from_json(doc).models[0].advice_basis == m.advice_basis


def _source() -> Any:
    from attnprof.contracts.report import ReportSource

    return ReportSource(kind="files", where=["demo.json"])


def test_a_record_window_has_the_advices_coverage_and_says_the_table_is_left_out() -> None:
    """``attnprof record`` drops the snapshot's coverage table (analyze/window.py) and keeps
    the end snapshot's advice: the sentence stands, the table is said to be missing."""
    from attnprof.analyze.window import window_between
    from attnprof.contracts.snapshot import Snapshot

    raw, wa = _demo()
    end = Snapshot.from_json(raw)
    rec = window_between(end, end)
    assert rec.coverage is None
    inp, _ = from_snapshot(rec.to_json(), "rec.json", advice=wa)
    b = build_model_report(inp, Settings(), FLAGS).advice_basis
    assert b is not None and b.available and b.buckets == []
    assert b.stands_on.startswith("The window advice stands on 19 of 20 requests")
    assert "no per-bucket table" in b.stands_on
