"""Head statistics on synthetic attention whose probabilities are known in closed form."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import Thresholds, classify, head_windows
from attnprof.analyze.sparsity.recommend import evaluate, export_summary, recommend
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.capture import head_rows
from attnprof.facts.shape import AttentionShape

T, D, LOGIT = 256, 64, 10.0
SCALE = 1 / math.sqrt(D)
SAMPLE = list(range(128, 256, 4))
E = math.exp(LOGIT)


def build(kinds: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D]; kinds[kv] lists the pattern of each query head of a group.

    Logits are LOGIT on the keys a pattern targets and exactly 0 elsewhere:
    sink -> keys 0..3; block -> keys in the query's own 16-token block; needle -> key 10;
    uniform -> nothing (q = 0). Keys carry every pattern's feature in separate dims.
    """
    hkv, g = len(kinds), len(kinds[0])
    k = torch.zeros(T, hkv, D)
    q = torch.zeros(T, hkv * g, D)
    pos = torch.arange(T)
    for kv in range(hkv):
        k[:4, kv, 30] = 1.0
        k[pos, kv, pos // 16] = 1.0
        k[10, kv, 20] = 1.0
        for j, kind in enumerate(kinds[kv]):
            h = kv * g + j
            if kind == "sink":
                q[:, h, 30] = LOGIT / SCALE
            elif kind == "weaksink":  # top-1 on a sink, but most mass spread far back
                q[:, h, 30] = 2.5 / SCALE
            elif kind == "block":
                q[pos, h, pos // 16] = LOGIT / SCALE
            elif kind == "needle":
                q[:, h, 20] = LOGIT / SCALE
    return q, k


def expected(kind: str, i: int, s: int, w: int) -> tuple[float, float]:
    """(coverage C_i(s, w), sink mass of the first s keys) in closed form, s in {0, 4}."""
    if kind == "sink":
        z = 4 * E + (i - 3)
        sink = s * E / z
        return (sink + w / z, sink)
    if kind == "block":
        m = i % 16 + 1
        z = m * E + (i + 1 - m)
        local = m * E + (w - m) if w >= m else w * E
        return ((local + s) / z, s / z)
    if kind == "needle":
        z = E + i
        return ((s + w) / z, s / z)
    return ((s + w) / (i + 1), s / (i + 1))


def acc_for(hkv: int, g: int) -> HeadStatsAccumulator:
    return HeadStatsAccumulator(1, hkv, g, sinks_grid=(0, 4), window_grid=(8, 16, 32, 64))


def test_exact_coverage_sink_mass_and_entropy() -> None:
    kinds = ["sink", "block", "needle", "uniform"]
    q, k = build([[x] for x in kinds])
    acc = acc_for(4, 1)
    assert head_rows.update(acc, 0, q, k, SCALE, sample=SAMPLE) == len(SAMPLE)
    cov = acc.coverage_mean()
    means = acc.per_head_means()
    for h, kind in enumerate(kinds):
        for si, s in enumerate(acc.sinks_grid):
            for wi, w in enumerate(acc.window_grid):
                rows = [expected(kind, i, s, w) for i in SAMPLE if i + 1 > s + w]
                assert acc.cov_n[0, h, si, wi] == len(rows)
                want = np.mean([c for c, _ in rows])
                # float32 logits/exp: exact to ~1e-7 relative; tiny masses to 1e-8 absolute
                # (reduction order may differ between processes)
                assert cov[0, h, si, wi] == pytest.approx(want, rel=1e-5, abs=1e-8), \
                    (kind, s, w)
                assert acc.cov_min[0, h, si, wi] == pytest.approx(min(c for c, _ in rows),
                                                                  rel=1e-5, abs=1e-8)
            sink = np.mean([expected(kind, i, s, 8)[1] for i in SAMPLE])
            assert means["sink_mass"][0, h, si] == pytest.approx(sink, rel=1e-5, abs=1e-8)
    # entropy and top-k run on the detail subset of the sampled queries
    picks = acc.detail_subset(len(SAMPLE))
    detail = [SAMPLE[j] for j, _ in picks]
    # one per half of the sample, each standing for its half (16 unit-weight queries)
    assert len(detail) == acc.n_detail and detail[0] < SAMPLE[16] <= detail[1]
    assert [w for _, w in picks] == [16.0, 16.0]
    assert acc.detail_n[0, 0] == len(detail)
    assert means["entropy"][0, 3] == pytest.approx(1.0, rel=1e-5)  # uniform rows
    def sink_entropy(i: int) -> float:  # 4 keys of weight E, i - 3 keys of weight 1
        z = 4 * E + (i - 3)
        return (-4 * E / z * math.log(E / z) + (i - 3) / z * math.log(z)) / math.log(i + 1)

    want_h = np.mean([sink_entropy(i) for i in detail])
    assert means["entropy"][0, 0] == pytest.approx(want_h, rel=1e-4)
    # uniform: top-k for 90% of the mass is ceil(0.9 n) keys
    want_k = np.mean([math.ceil(0.9 * (i + 1)) / (i + 1) for i in detail])
    assert means["topk_fraction"][0, 3] == pytest.approx(want_k, abs=1.5 / 129)
    assert means["topk_fraction"][0, 2] == pytest.approx(np.mean([1 / (i + 1) for i in detail]))
    # the needle's top-1 key (10) lies outside 4 sinks + any window for every query
    assert np.all(means["top1_outside"][0, 2, 1] == 1.0)
    # block head: ties resolve to the block start, outside w = 8 exactly when m >= 9
    assert list(means["top1_outside"][0, 1, 1]) == [0.5, 0.0, 0.0, 0.0]


def test_low_quantile_is_conservative_and_decides_windows_exactly() -> None:
    q, k = build([["sink"], ["block"], ["needle"], ["uniform"]])
    acc = acc_for(4, 1)
    head_rows.update(acc, 0, q, k, SCALE, sample=SAMPLE)
    cq = acc.coverage_quantile(0.05)
    for h, kind in enumerate(["sink", "block", "needle", "uniform"]):
        for wi, w in enumerate(acc.window_grid):
            true = sorted(expected(kind, i, 4, w)[0] for i in SAMPLE)
            assert cq[0, h, 1, wi] <= np.quantile(true, 0.05) + 1e-9
    # block head: half the queries have m > 8 own-block keys, so w = 8 fails and 16 holds
    w = head_windows(acc, Thresholds(sinks=4))
    assert list(w[0]) == [8.0, 16.0, math.inf, math.inf]


def test_classification_mha() -> None:
    q, k = build([["sink"], ["block"], ["needle"], ["uniform"]])
    acc = acc_for(4, 1)
    head_rows.update(acc, 0, q, k, SCALE, sample=SAMPLE)
    cls = classify(acc, Thresholds(sinks=4)).to_json()
    heads = cls["layers"][0]["kv_heads"]
    assert [h["class"] for h in heads] == ["sink", "streaming", "retrieval", "near_uniform"]
    assert [h["window"] for h in heads] == [8, 16, "full", "full"]
    assert cls["layers"][0]["window"] == "full"
    assert cls["class_counts"] == {"sink": 1, "streaming": 1, "retrieval": 1,
                                   "near_uniform": 1}


def test_untested_windows_leave_a_failing_head_undetermined() -> None:
    q, k = build([["weaksink"]])
    th = Thresholds(sinks=4, near_uniform_entropy=0.99)
    tested = acc_for(1, 1)
    head_rows.update(tested, 0, q, k, SCALE, sample=SAMPLE)
    head = classify(tested, th).layers[0].kv_heads[0]
    assert (head.cls, head.window) == ("retrieval", "full")
    # same head, but the grid's largest window is longer than every sampled query
    short = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=(8, 16, 32, 512))
    head_rows.update(short, 0, q, k, SCALE, sample=SAMPLE)
    head = classify(short, th).layers[0].kv_heads[0]
    assert (head.cls, head.window) == ("unknown", None)


def test_gqa_decision_is_per_kv_head() -> None:
    q, k = build([["block", "needle"], ["block", "sink"]])
    acc = acc_for(2, 2)
    head_rows.update(acc, 0, q, k, SCALE, sample=SAMPLE)
    heads = classify(acc, Thresholds(sinks=4)).layers[0].kv_heads
    assert heads[0].cls == "retrieval" and heads[0].window == "full"
    assert heads[0].q_head_classes == ("streaming", "retrieval")
    assert heads[1].cls == "streaming" and heads[1].window == 16


def test_recommend_windows_only_layers_whose_heads_are_covered() -> None:
    q1, k1 = build([["block"], ["sink"]])
    q2, k2 = build([["block"], ["needle"]])
    acc = HeadStatsAccumulator(2, 2, 1, sinks_grid=(0, 4), window_grid=(8, 16, 32, 64))
    head_rows.update(acc, 0, q1, k1, SCALE, sample=SAMPLE)
    head_rows.update(acc, 1, q2, k2, SCALE, sample=SAMPLE)
    arch = AttentionShape(2, 2, 2, D, "float32")
    dist = LengthDistribution.from_lengths([40, 100, 256, 300])
    rec = recommend(dist, arch, acc)
    assert rec.best.window == 16 and rec.best.layers == (0,)
    assert rec.best.heads_at_risk_count == 0
    ev = evaluate(dist, arch, 16, 4, head_stats=acc, thresholds=Thresholds(sinks=4))
    assert ev.layers == (0, 1) and ev.evidence is not None
    assert [(r.layer, r.kv_head) for r in ev.evidence.heads_at_risk] == [(1, 1)]
    assert rec.best.attention_flop_saving == pytest.approx(
        evaluate(dist, arch, 16, 4, layers=[0]).attention_flop_saving)
    assert rec.head_level_split is not None and rec.head_level_split.windowed_kv_heads == 3
    assert any(a.startswith("a head-level split (3 ") for a in rec.advice)
    exp = export_summary(rec)
    assert exp.per_layer is not None
    assert [x.windowed for x in exp.per_layer] == [True, False]
    assert exp.per_layer[1].coverage_q["64"] < 0.9 <= exp.per_layer[0].coverage_q["16"]
    assert exp.safe is False and "not validated" in exp.summary
    assert len(json.dumps(exp.to_json())) < 4000  # bounded: no per-head or per-request lists


def test_hf_layout_merge_and_roundtrip() -> None:
    q, k = build([["block"], ["needle"]])
    a = acc_for(2, 1)
    head_rows.update(a, 0, q, k, SCALE, sample=SAMPLE)
    b = acc_for(2, 1)
    head_rows.update_hf(b, 0, q.transpose(0, 1)[None], k.transpose(0, 1)[None], SCALE,
                        sample=SAMPLE)
    np.testing.assert_allclose(a.cov_sum, b.cov_sum)
    np.testing.assert_array_equal(a.cov_hist, b.cov_hist)
    half1, half2 = acc_for(2, 1), acc_for(2, 1)
    head_rows.update(half1, 0, q, k, SCALE, sample=SAMPLE[:10])
    head_rows.update(half2, 0, q, k, SCALE, sample=SAMPLE[10:])
    merged = HeadStatsAccumulator.from_dict(json.loads(json.dumps(half1.to_dict())))
    merged.merge(HeadStatsAccumulator.from_dict(half2.to_dict()))
    for f in ("queries", "cov_n", "cov_hist", "top1_out"):
        np.testing.assert_array_equal(getattr(merged, f), getattr(a, f))
    # detail statistics depend on which queries each request sampled: they add up
    for f in ("detail_n", "entropy_hist", "topk_hist", "entropy_sum"):
        np.testing.assert_allclose(getattr(merged, f),
                                   getattr(half1, f) + getattr(half2, f))
    np.testing.assert_allclose(merged.cov_sum, a.cov_sum, rtol=1e-7)
    np.testing.assert_allclose(merged.cov_min, a.cov_min, rtol=1e-7)
    with pytest.raises(ValueError):
        merged.merge(acc_for(1, 2))


def test_sampling_is_bounded_and_deterministic() -> None:
    acc = HeadStatsAccumulator(1, 1, 1, n_last=64, n_random=64)
    idx = head_rows.sample_queries(acc, 4096, 0)
    assert len(idx) <= 128 and list(idx[-64:]) == list(range(4032, 4096))
    assert len(set(idx.tolist())) == len(idx)
    assert idx.tolist() == head_rows.sample_queries(acc, 4096, 0).tolist()
    assert head_rows.sample_queries(acc, 10, 0).tolist() == list(range(10))
    # weights: every position of the prompt is represented exactly once in expectation
    _, w = acc.sample_plan(4096, 0)
    assert w.sum() == 4096 and np.all(w[-64:] == 1)
    # memory does not grow with traffic
    q, k = torch.randn(300, 1, 8), torch.randn(300, 1, 8)
    before = len(json.dumps(acc.to_dict()["arrays"]["cov_hist"]["index"]))
    for _ in range(3):
        head_rows.update(acc, 0, q, k, 0.3)
    assert acc.cov_hist.shape == (1, 1, 5, 9, 20) and acc.queries[0, 0] == 3 * 128
    assert before == 2  # "[]": nothing recorded before the first update


def test_learned_sinks_count_as_sink_mass() -> None:
    q, k = torch.zeros(50, 1, 8), torch.zeros(50, 1, 8)  # uniform over keys
    acc = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=(8,), n_last=1,
                               n_random=0)
    head_rows.update(acc, 0, q, k, 1.0, sink_logits=torch.tensor([math.log(50.0)]))
    # query 49 sees 50 keys with weight 1 and a learned sink of weight 50: half the mass
    sink4 = acc.per_head_means()["sink_mass"][0, 0, 1]
    assert sink4 == pytest.approx(0.5 + 4 / 100, rel=1e-5)
