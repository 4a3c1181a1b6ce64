"""Coverage per context bucket, post-stratification, the need-more-traffic verdict, Fleiss'
kappa and dynamic heads, on statistics folded by the real ``head_rows.update`` from synthetic
q/k whose attention (and so each head's class) is known by construction."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import Thresholds, classify
from attnprof.analyze.sparsity.coverage import (
    coverage_table,
    post_stratify,
    under_covered,
)
from attnprof.analyze.sparsity.recommend import export_summary, recommend
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.analyze.sparsity.stability import (
    MIN_VIEW_REQUESTS,
    fleiss_kappa,
    stability,
    stability_views,
)
from attnprof.analyze.sparsity.strata_advice import recommend_strata
from attnprof.capture import head_rows
from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.snapshot import ContextBuckets
from attnprof.facts.shape import AttentionShape

D, LOGIT = 64, 10.0
SCALE = 1 / math.sqrt(D)
TH = Thresholds(sinks=4)


def build(t: int, kinds: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, H, D], k [t, H, D] (one query head per KV head). Logits are LOGIT on the keys a
    pattern targets, exactly 0 elsewhere: sink -> keys 0..3 (class ``sink``); block -> the
    query's own 16-token block (``streaming``, w* = 16); needle -> key 10 (``retrieval``);
    uniform -> none (q = 0: every key weight 1 / (i + 1))."""
    h = len(kinds)
    k = torch.zeros(t, h, D)
    q = torch.zeros(t, h, D)
    pos = torch.arange(t)
    for kv, kind in enumerate(kinds):
        k[:4, kv, 62] = 1.0
        k[pos, kv, (pos // 16) % 60] = 1.0
        k[10, kv, 61] = 1.0
        if kind == "sink":
            q[:, kv, 62] = LOGIT / SCALE
        elif kind == "block":
            q[pos, kv, (pos // 16) % 60] = LOGIT / SCALE
        elif kind == "needle":
            q[:, kv, 61] = LOGIT / SCALE
    return q, k


def fold(acc: HeadStatsAccumulator, layer: int, t: int, kinds: list[str], sample: list[int],
         times: int = 1) -> HeadStatsAccumulator:
    q, k = build(t, kinds)
    for _ in range(times):
        head_rows.update(acc, layer, q, k, SCALE, sample=sample)
    return acc


def acc_for(layers: int, heads: int) -> HeadStatsAccumulator:
    return HeadStatsAccumulator(layers, heads, 1, sinks_grid=(0, 4), window_grid=(8, 16, 32, 64))


def traffic(edges: list[int], prompt: list[int], kv: list[float], requests: list[int] | None = None
            ) -> ContextBuckets:
    return ContextBuckets(edges=edges, min_tokens=edges[1],
                          requests=requests or [1] * len(edges), prompt_tokens=prompt,
                          decode_tokens=[0] * len(edges), kv_block_seconds=kv)


# ---------------------------------------------------------------- scaled()
def test_scaled_multiplies_weights_keeps_counts_and_estimates() -> None:
    acc = acc_for(1, 2)
    q, k = build(300, ["block", "uniform"])
    head_rows.update(acc, 0, q, k, SCALE)  # the default plan: unequal Horvitz-Thompson weights
    assert len(np.unique(acc.sample_plan(300, 0)[1])) > 1
    s = acc.scaled(2.5)
    for f in acc._SUM_FIELDS:
        a, b = getattr(acc, f), getattr(s, f)
        if f in ("queries", "detail_n", "requests", "requests_seen", "cov_n", "sink_n", "js_k"):
            np.testing.assert_array_equal(b, a, err_msg=f)
        elif f == "cov_w2":
            np.testing.assert_allclose(b, a * 6.25, err_msg=f)
        else:
            np.testing.assert_allclose(b, a * 2.5, err_msg=f)
    np.testing.assert_array_equal(s.cov_min, acc.cov_min)
    # a stratum's own estimates and effective sample size do not move
    np.testing.assert_allclose(s.coverage_mean(), acc.coverage_mean(), equal_nan=True)
    np.testing.assert_allclose(s.n_eff(), acc.n_eff())
    np.testing.assert_allclose(s.coverage_quantile(0.05, 1.0), acc.coverage_quantile(0.05, 1.0),
                               equal_nan=True)
    assert acc.weight_sum[0, 0] == pytest.approx(300)  # the original is untouched
    with pytest.raises(ValueError):
        acc.scaled(0)


# ---------------------------------------------------------------- post-stratification
SHORT = list(range(200, 300, 4))  # 25 queries, every one sees > 4 + 64 keys
LONG = list(range(1100, 1200, 4))


def uniform_mean(pos: list[int], s: int, w: int) -> float:
    return float(np.mean([(s + w) / (i + 1) for i in pos]))


def skewed_strata() -> dict[tuple[str, int], HeadStatsAccumulator]:
    """9 short prompts folded for every long one (a sampler that sees mostly chats)."""
    return {("prefill", 256): fold(acc_for(1, 1), 0, 300, ["uniform"], SHORT, times=9),
            ("prefill", 1024): fold(acc_for(1, 1), 0, 1200, ["uniform"], LONG)}


def test_post_stratification_gives_the_traffic_weighted_answer() -> None:
    strata = skewed_strata()
    # traffic: 100 prompts of 300 and 100 of 1200 tokens -> 20% / 80% of prompt tokens
    tr = traffic([0, 256, 512, 1024, 2048], [0, 30000, 0, 120000, 0], [0, 1, 0, 4, 0])
    corr = post_stratify(strata, tr)
    assert corr.corrected and corr.traffic_share == pytest.approx(1.0)
    # sampled shares 225/250 and 25/250 -> factors 0.2/0.9 and 0.8/0.1
    assert corr.weights == {256: pytest.approx(2 / 9), 1024: pytest.approx(8.0)}
    assert corr.acc is not None
    si, wi = 1, 1  # s = 4, w = 16
    want = 0.2 * uniform_mean(SHORT, 4, 16) + 0.8 * uniform_mean(LONG, 4, 16)
    assert corr.acc.coverage_mean()[0, 0, si, wi] == pytest.approx(want, rel=1e-5)
    plain = post_stratify(strata, None)
    assert not plain.corrected and plain.acc is not None
    sampled = 0.9 * uniform_mean(SHORT, 4, 16) + 0.1 * uniform_mean(LONG, 4, 16)
    assert plain.acc.coverage_mean()[0, 0, si, wi] == pytest.approx(sampled, rel=1e-5)
    assert abs(want - sampled) > 0.03  # the bias is not small: the correction matters
    # n_eff: Kish's for the reweighted sample, (sum f W)^2 / sum f^2 W2 with unit weights
    f_s, f_l = 2 / 9, 8.0
    neff = (f_s * 225 + f_l * 25) ** 2 / (f_s ** 2 * 225 + f_l ** 2 * 25)
    assert corr.acc.n_eff()[0, 0, si, wi] == pytest.approx(neff, rel=1e-9)
    assert neff < 250  # raw counts stay, the evidence shrinks
    assert corr.acc.queries[0, 0] == 250


def test_traffic_share_leaves_out_buckets_without_statistics() -> None:
    tr = traffic([0, 256, 512, 1024, 2048], [0, 30000, 0, 120000, 50000], [0, 1, 0, 4, 4])
    corr = post_stratify(skewed_strata(), tr)
    assert corr.traffic_share == pytest.approx(150000 / 200000)
    table = coverage_table(skewed_strata(), tr)
    assert table is not None
    rows = {r.bucket: r for r in table.buckets if r.phase == "prefill"}
    assert set(rows) == {0, 256, 512, 1024, 2048}
    assert (rows[256].folded_requests, rows[256].sampled_queries) == (9, 225)
    assert rows[2048].folded_requests == 0 and rows[2048].traffic_queries == 50000
    assert rows[2048].kv_share == pytest.approx(4 / 9, abs=1e-4)
    assert rows[2048].hi is None and rows[1024].hi == 2048
    # shares among the buckets represented: 120000 / 150000 over 25 / 250
    assert rows[1024].weight == pytest.approx(0.8 / 0.1)
    assert table.phases[0].traffic_query_share == 0.75


# ---------------------------------------------------------------- need more traffic
def sink_strata(long_queries: int) -> dict[tuple[str, int], HeadStatsAccumulator]:
    return {("prefill", 256): fold(acc_for(1, 1), 0, 300, ["sink"], SHORT[:20], times=2),
            ("prefill", 1024): fold(acc_for(1, 1), 0, 1200, ["sink"], LONG[:long_queries])}


def test_need_more_traffic_from_the_buckets_own_sampling_error() -> None:
    edges = [0, 256, 512, 1024, 2048]
    heavy = traffic(edges, [0, 1, 0, 1, 0], [0, 50, 0, 50, 0])
    # a sink head never fails: with n queries and none failing, the one-sided Wilson upper
    # bound (z = 1) of the failing share is 1 / (n + 1); the target share is 0.05
    thin = sink_strata(10)  # 1/11 = 0.091 > 0.05: undecided
    u = under_covered(thin, heavy, [0], 4, 16, TH)
    assert [(x.bucket, x.hi, x.kv_share, x.undecided_kv_heads, x.unmeasured_kv_heads)
            for x in u] == [(1024, 2048, 0.5, 1, 0)]
    assert u[0].min_n_eff == pytest.approx(10.0)
    assert under_covered(sink_strata(20), heavy, [0], 4, 16, TH) == []  # 1/21 = 0.048
    # the same thin bucket holding 5% of the KV block-seconds does not decide the advice
    light = traffic(edges, [0, 1, 0, 1, 0], [0, 95, 0, 5, 0])
    assert under_covered(thin, light, [0], 4, 16, TH) == []
    # a heavy bucket with no statistics at all
    gone = {("prefill", 256): fold(acc_for(1, 3), 0, 300, ["sink"] * 3, SHORT[:20])}
    u = under_covered(gone, heavy, [0], 4, 16, TH)
    assert [(x.bucket, x.unmeasured_kv_heads) for x in u] == [(1024, 3)]  # 3 KV heads
    # contexts that all fit sinks + window are exact under it: nothing to decide
    assert under_covered(gone, heavy, [0], 4, 2048, TH) == []
    assert under_covered(gone, heavy, [], 4, 16, TH) == []  # no layer windowed


def test_contexts_no_sample_can_reach_are_never_asked_more_traffic_for() -> None:
    """Past HEAD_STATS_MAX_TOKENS no context is folded: asking for more traffic there would
    never be answered, so the advice says they are never sampled instead."""
    from attnprof.aggregate.head_strata import HEAD_STATS_MAX_TOKENS
    from attnprof.analyze.sparsity.coverage import need_more_traffic_phrase

    top = HEAD_STATS_MAX_TOKENS
    edges = [0, 256, 512, 1024, 2048, top, 2 * top]
    heavy = traffic(edges, [0, 1, 0, 1, 0, 1, 0], [0, 30, 0, 30, 0, 40, 0])
    u = under_covered(sink_strata(20), heavy, [0], 4, 16, TH)
    assert [x.bucket for x in u] == [top]
    phrase = need_more_traffic_phrase(u, 16)
    assert phrase.startswith(f"contexts over {top} tokens are never sampled"), phrase
    assert "40%" in phrase and "need more traffic" not in phrase
    # below the limit the ask stands
    assert need_more_traffic_phrase(under_covered(sink_strata(10), heavy, [0], 4, 16, TH),
                                    16).startswith("need more traffic at > 1024 tokens")


def test_advice_turns_into_need_more_traffic_and_says_what_it_stands_on() -> None:
    arch = AttentionShape(1, 1, 1, D, "float32")
    dist = LengthDistribution.from_lengths([300] * 10 + [1200] * 10)
    edges = [0, 256, 512, 1024, 2048]
    tr = traffic(edges, [0, 3000, 0, 12000, 0], [0, 50, 0, 50, 0], requests=[0, 10, 0, 10, 0])
    thin = recommend_strata(dist, arch, sink_strata(10), tr, thresholds=TH)
    rec = thin.recommendation
    assert rec.best.layers == () and rec.coverage is not None
    assert rec.coverage.need_more_traffic_above == 1024
    adv = export_summary(rec)
    assert "need more traffic at > 1024 tokens" in adv.summary
    assert ("stands on 3 of 20 requests (100% of prompt tokens, 100% of KV block-seconds, "
            "traffic-weighted)") in adv.summary
    # a bucket without statistics holding half the KV block-seconds: the advice says so
    tr2 = traffic(edges, [0, 3000, 0, 12000, 15000], [0, 50, 0, 50, 100],
                  requests=[0, 10, 0, 10, 10])
    half = recommend_strata(dist, arch, sink_strata(25), tr2, thresholds=TH).recommendation
    assert half.coverage is not None and half.coverage.kv_share == 0.5
    assert "(50% of prompt tokens, 50% of KV block-seconds, traffic-weighted)" in \
        export_summary(half).summary
    back = WindowAdvice.from_json(adv.to_json())
    assert back.coverage is not None and back.coverage.need_more_traffic_above == 1024
    enough = recommend_strata(dist, arch, sink_strata(25), tr, thresholds=TH).recommendation
    assert enough.best.layers == (0,) and enough.coverage is not None
    assert enough.coverage.need_more_traffic_above is None
    assert "need more traffic" not in export_summary(enough).summary


# ---------------------------------------------------------------- kappa and dynamic heads
def test_fleiss_kappa_matches_the_published_example() -> None:
    # Fleiss (1971) as tabulated on Wikipedia: 10 subjects, 14 raters, 5 categories
    table = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0],
             [2, 2, 8, 1, 1], [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2],
             [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]
    kappa, p_bar = fleiss_kappa(table)
    assert kappa == pytest.approx(0.210, abs=5e-4)
    assert p_bar == pytest.approx(0.378, abs=5e-4)
    assert fleiss_kappa([[2, 0], [2, 0]]) == (None, 1.0)  # one class everywhere
    assert fleiss_kappa([[1, 0], [0, 1]]) == (None, None)  # nobody rated twice


SAMPLE = list(range(128, 256, 4))  # 32 queries: decided at every window
VOTE = MIN_VIEW_REQUESTS  # requests a view needs before it rates a head


def test_a_head_that_switches_between_epochs_is_dynamic() -> None:
    # layer 0: head 0 reads a far needle in one epoch and its own block in the next
    # layer 1: two block heads throughout
    a, b = acc_for(2, 2), acc_for(2, 2)
    fold(a, 0, 256, ["needle", "block"], SAMPLE, times=VOTE)
    fold(b, 0, 256, ["block", "block"], SAMPLE, times=VOTE)
    for e in (a, b):
        fold(e, 1, 256, ["block", "block"], SAMPLE, times=VOTE)
    assert [k.cls for k in classify(a, TH).layers[0].kv_heads] == ["retrieval", "streaming"]
    assert [k.cls for k in classify(b, TH).layers[0].kv_heads] == ["streaming", "streaming"]
    st = stability({"epoch:0": a, "epoch:1": b}, TH)
    assert st is not None
    assert st.dynamic.tolist() == [[True, False], [False, False]]
    rec = st.record
    assert (rec.dynamic_kv_heads, rec.kv_heads, rec.dynamic_share) == (1, 4, 0.25)
    # layer 0 by hand: head 0 rated (retrieval, windowed), head 1 (windowed, windowed):
    # P-bar = (0 + 1) / 2; p = (1/4, 3/4); P_e = 1/16 + 9/16 = 10/16
    p_bar, p_e = 0.5, 10 / 16
    assert rec.layers[0].kappa == pytest.approx(round((p_bar - p_e) / (1 - p_e), 4))
    assert rec.layers[0].agreement == 0.5 and rec.layers[0].dynamic_kv_heads == [0]
    assert rec.layers[1].kappa is None and rec.layers[1].agreement == 1.0  # one role


def test_sink_streaming_and_local_are_one_role() -> None:
    # a sink head one hour and a block head the next: both served by sinks + a window (how
    # large is the merged statistics' call), so not dynamic
    a, b = acc_for(1, 1), acc_for(1, 1)
    fold(a, 0, 256, ["sink"], SAMPLE, times=VOTE)
    fold(b, 0, 256, ["block"], SAMPLE, times=VOTE)
    assert classify(a, TH).layers[0].kv_heads[0].cls == "sink"
    st = stability({"epoch:0": a, "epoch:1": b}, TH)
    assert st is not None and not st.dynamic.any()
    assert st.classes["epoch:0"] == st.classes["epoch:1"] == [["windowed"]]


def test_a_dynamic_head_gets_no_window_though_the_weighted_merge_would_give_one() -> None:
    # the head attends to its block in the short prompts (99% of the prompt tokens) and to a
    # far needle in the long ones (1%): the traffic-weighted merge fails for 1% of queries,
    # within the target, so it would window the layer; the bucket views disagree on its role
    strata = {("prefill", 256): fold(acc_for(1, 1), 0, 256, ["block"], SAMPLE, times=10),
              ("prefill", 1024): fold(acc_for(1, 1), 0, 256, ["needle"], SAMPLE, times=VOTE)}
    tr = traffic([0, 256, 512, 1024, 2048], [0, 99000, 0, 1000, 0], [0, 95, 0, 5, 0])
    arch = AttentionShape(1, 1, 1, D, "float32")
    dist = LengthDistribution.from_lengths([300] * 99 + [1100])
    corr = post_stratify(strata, tr)
    assert corr.acc is not None
    assert recommend(dist, arch, corr.acc, thresholds=TH).best.layers == (0,)
    out = recommend_strata(dist, arch, strata, tr, thresholds=TH)
    assert out.stability is not None and out.stability.dynamic.tolist() == [[True]]
    rec = out.recommendation
    assert rec.best.layers == ()
    assert rec.classification is not None
    head = rec.classification.layers[0].kv_heads[0]
    assert (head.cls, head.window) == ("dynamic", "full")
    assert rec.coverage is not None and rec.coverage.need_more_traffic_above is None


def test_a_thin_epoch_does_not_make_a_head_dynamic() -> None:
    full, thin = acc_for(1, 1), acc_for(1, 1)
    fold(full, 0, 256, ["block"], SAMPLE, times=VOTE)
    fold(thin, 0, 256, ["block"], SAMPLE[:1], times=VOTE)
    # enough requests, but 8 queries cannot pass any window (Wilson upper bound 1/9 >
    # 0.05), so the thin epoch alone calls the block head a retrieval head
    assert classify(thin, TH).layers[0].kv_heads[0].cls == "retrieval"
    st = stability({"epoch:0": full, "epoch:1": thin}, TH)
    assert st is not None and not st.dynamic.any()
    assert st.classes["epoch:1"] == [[None]] and st.classes["epoch:0"] == [["windowed"]]


def test_stability_over_context_buckets() -> None:
    # a head local in short prompts and a retrieval head in long ones: roles shift with
    # context, and only the buckets show it (one epoch)
    short, long_ = acc_for(1, 1), acc_for(1, 1)
    fold(short, 0, 256, ["block"], SAMPLE, times=VOTE)
    fold(long_, 0, 256, ["needle"], SAMPLE, times=VOTE)
    strata = {("prefill", 256): short, ("prefill", 1024): long_}
    arch = AttentionShape(1, 1, 1, D, "float32")
    out = recommend_strata(LengthDistribution.from_lengths([256, 1100]), arch, strata, None,
                           thresholds=TH)
    assert out.stability is not None
    assert out.stability.record.views == ["prefill:256", "prefill:1024"]
    assert out.stability.dynamic.tolist() == [[True]]
    cov = out.recommendation.coverage
    assert cov is not None and (cov.dynamic_kv_heads, cov.dynamic_share) == (1, 1.0)
    assert not cov.corrected and cov.traffic_share is None
    assert "dynamic heads: 1 of 1 KV heads (100.0%; 1 rated by two or more views), kept full" in \
        export_summary(out.recommendation).summary


# ---------------------------------------------------------------- stable heads measure as stable
MIXED = 0.03
"""A "mixed" head reads the far needle on 3% of its queries, its own block otherwise: its
far top-1 rate sits near the retrieval rule (2%), so point estimates flip with the sample."""
TH_MIX = Thresholds(sinks=4, streaming_max_window=8)  # w* = 16 is local: the far rule decides


def request(t: int, kinds: list[str], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One request of :func:`build`'s patterns, "mixed" heads drawn query by query."""
    q, k = build(t, ["block" if kd == "mixed" else kd for kd in kinds])
    for kv, kd in enumerate(kinds):
        if kd == "mixed":
            far = torch.rand(t, generator=g) < MIXED
            q[far, kv, :] = 0.0
            q[far, kv, 61] = LOGIT / SCALE
    return q, k


def views_of(kinds_per_view: list[list[str]], seed: int = 0, requests: int = VOTE,
             t: int = 256) -> dict[str, HeadStatsAccumulator]:
    """One view per entry, each ``requests`` requests folded by the default sample plan."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, kinds in enumerate(kinds_per_view):
        acc = acc_for(1, len(kinds))
        for r in range(requests):
            acc.seed = seed * 1000 + i * 100 + r  # a fresh draw of positions per request
            q, k = request(t, kinds, g)
            head_rows.update(acc, 0, q, k, SCALE)
        out[f"epoch:{i}"] = acc
    return out


STABLE = ["block", "needle", "mixed", "mixed", "mixed", "mixed"]


def test_heads_stable_by_construction_measure_as_stable() -> None:
    # every view draws the same distribution: any dynamic head would be sampling noise
    views = views_of([STABLE] * 6)
    point = [[k.cls for k in classify(a, TH_MIX).layers[0].kv_heads] for a in views.values()]
    # the noise is real: the views' point classes of the mixed heads disagree
    assert any(len({p[h] for p in point}) > 1 for h in range(2, 6)), point
    st = stability(views, TH_MIX)
    assert st is not None
    assert st.record.dynamic_kv_heads == 0 and st.record.dynamic_share == 0.0
    # the clear heads are still rated by every view (so "0 dynamic" is not "nothing rated")
    assert [st.classes[v][0][:2] for v in views] == [["windowed", "retrieval"]] * 6
    assert st.record.layers[0].rated_kv_heads >= 2 and st.record.layers[0].kappa == 1.0


def test_heads_that_switch_are_found_among_noisy_ones() -> None:
    # head 0 reads its block in the first three views and the far needle in the last three
    switching = [["block" if i < 3 else "needle", *STABLE[1:]] for i in range(6)]
    st = stability(views_of(switching, seed=1), TH_MIX)
    assert st is not None
    assert st.dynamic.tolist() == [[True, False, False, False, False, False]]
    assert st.record.layers[0].dynamic_kv_heads == [0]


def test_a_view_of_few_requests_does_not_vote() -> None:
    # the same switch, but the needle views hold one request each: their classes are clear
    # (the rows are noiseless) yet they stand on too little traffic to call a head dynamic
    views = {**views_of([STABLE] * 2, seed=2),
             **{f"epoch:{i + 2}": a for i, a in enumerate(views_of(
                 [["needle", *STABLE[1:]]] * 2, seed=3, requests=1).values())}}
    assert classify(views["epoch:2"], TH_MIX).layers[0].kv_heads[0].cls == "retrieval"
    st = stability(views, TH_MIX)
    assert st is not None and not st.dynamic.any()
    assert st.record.views == ["epoch:0", "epoch:1"]  # the views that vote
    each = stability(views, TH_MIX, min_requests=1)
    assert each is not None and each.dynamic[0, 0]  # counted each alone, they would


def test_a_window_that_passes_only_because_the_context_is_short_does_not_rate() -> None:
    # in 72-token prompts a window of 64 covers nearly every key: it passes for a needle
    # head as for any (the demo's short chats "windowed" heads every long bucket keeps
    # full), so the short view cannot tell the head's role; the long view can
    grid = (64, 128)
    short = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=grid)
    long_ = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=grid)
    q, k = build(72, ["needle"])
    k[10, 0, 61], k[20, 0, 61] = 0.0, 1.0  # the needle inside the last 64 keys
    for _ in range(VOTE):
        head_rows.update(short, 0, q, k, SCALE, sample=[69, 70, 71])
        head_rows.update(long_, 0, *build(256, ["needle"]), SCALE, sample=SAMPLE)
    assert classify(short, TH).layers[0].kv_heads[0].window == 64  # passes, trivially
    assert classify(long_, TH).layers[0].kv_heads[0].cls == "retrieval"
    st = stability({"prefill:0": short, "prefill:256": long_}, TH)
    assert st is not None and not st.dynamic.any()
    assert st.classes["prefill:0"] == [[None]] and st.classes["prefill:256"] == [["retrieval"]]


def test_a_head_served_by_one_window_everywhere_is_not_dynamic() -> None:
    # every query reads the key 40 back: w = 64 serves it in long prompts and in 72-token
    # ones, where 64 passes only trivially; dropping that pass would leave "fails at 16
    # with far reads", i.e. retrieval, and a head dynamic across buckets for no reason
    grid = (16, 64, 128)

    def back40(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        code = torch.nn.functional.normalize(
            torch.randn(t, D, generator=torch.Generator().manual_seed(t)), dim=-1)
        q = torch.zeros(t, 1, D)
        q[40:, 0] = code[:-40] * (LOGIT / SCALE)
        return q, code[:, None, :]

    short = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=grid)
    long_ = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=grid)
    for _ in range(VOTE):
        head_rows.update(short, 0, *back40(72), SCALE, sample=[69, 70, 71])
        head_rows.update(long_, 0, *back40(256), SCALE, sample=SAMPLE)
    for view in (short, long_):
        assert [classify(view, TH).layers[0].kv_heads[0].decision[w] for w in (16, 64)] == \
            ["fail", "pass"]
    st = stability({"prefill:0": short, "prefill:256": long_}, TH)
    assert st is not None and not st.dynamic.any()
    assert st.classes["prefill:0"] == [[None]] and st.classes["prefill:256"] == [["windowed"]]


def test_a_lone_epoch_is_not_a_view() -> None:
    a, b = acc_for(1, 1), acc_for(1, 1)
    strata = {("prefill", 256): a}
    assert list(stability_views(strata, [b])) == ["prefill:256"]
    assert list(stability_views(strata, [b, a])) == ["epoch:0", "epoch:1", "prefill:256"]
