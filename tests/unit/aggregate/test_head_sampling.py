"""The sampled head statistics estimate their all-query values without bias.

Synthetic attention whose statistics change strongly with position (uniform rows, a decaying
local head, a sink head, a random head) over a 1,536-token prompt. Over many seeds the
sampled estimate of mean coverage, entropy and top-k fraction must centre on the exact
all-query value (float64, every query): its bias is small against the spread across seeds
and against the tolerance the decisions need. A sample weighted towards the prompt's end
(the last 32 queries were half of it) fails this by many standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.capture import head_rows

T, D = 1536, 16
SINKS, WINDOWS = (0, 4), (64, 256, 1024)
SEEDS = 120


def _attention() -> tuple[torch.Tensor, torch.Tensor, float]:
    """q [T, 4, D], k [T, 1, D] (one KV head shared by four query heads), scale 1."""
    gen = torch.Generator().manual_seed(7)
    pos = torch.arange(T, dtype=torch.float64)
    k = torch.zeros(T, 1, D, dtype=torch.float64)
    q = torch.zeros(T, 4, D, dtype=torch.float64)
    k[:, 0, 0] = pos / T  # recency: logit beta * (j - i) / T
    k[:, 0, 1] = 1.0
    k[:4, 0, 2] = 1.0  # sink feature
    k[:, 0, 4:] = torch.randn(T, D - 4, generator=gen, dtype=torch.float64)
    # head 0 uniform (q = 0); head 1 decays with distance (~ e^-1 per 48 tokens)
    q[:, 1, 0] = 32.0
    q[:, 1, 1] = -32.0 * pos / T
    q[:, 2, 2] = 6.0  # head 2: the first 4 keys weigh e^6 each, the rest 1
    q[:, 3, 4:] = 0.6 * torch.randn(T, D - 4, generator=gen, dtype=torch.float64)
    return q.float(), k.float(), 1.0


def _truth(q: torch.Tensor, k: torch.Tensor) -> dict[str, np.ndarray]:
    """Exact all-query statistics in float64 for every query of the prompt."""
    x = torch.einsum("ihd,jd->hij", q.double(), k[:, 0].double())  # [H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = x.masked_fill(~causal, -math.inf)
    p = torch.softmax(x, -1)
    i = torch.arange(T)
    seen = (i + 1).double()
    cov = np.zeros((4, len(SINKS), len(WINDOWS)))
    j = torch.arange(T)
    for si, s in enumerate(SINKS):
        for wi, w in enumerate(WINDOWS):
            keep = (j[None, :] < s) | (j[None, :] > i[:, None] - w)
            c = (p * keep).sum(-1)  # [H, T]
            elig = seen > s + w
            cov[:, si, wi] = c[:, elig].mean(-1).numpy()
    ent = -torch.special.xlogy(p, p).sum(-1) / torch.log(seen).clamp(min=1e-300)
    ent[:, 0] = 0.0
    srt = p.sort(-1, descending=True).values.cumsum(-1)
    topk = ((srt < 0.9 * srt[..., -1:]).sum(-1) + 1).double() / seen
    return {"coverage": cov, "entropy": ent.mean(-1).numpy(), "topk": topk.mean(-1).numpy()}


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    q, k, scale = _attention()
    truth = _truth(q, k)
    est: dict[str, list[np.ndarray]] = {"coverage": [], "entropy": [], "topk": []}
    for seed in range(SEEDS):
        acc = HeadStatsAccumulator(1, 1, 4, sinks_grid=SINKS, window_grid=WINDOWS, seed=seed)
        head_rows.update(acc, 0, q, k, scale, q_start=0)
        means = acc.per_head_means()
        est["coverage"].append(acc.coverage_mean()[0])
        est["entropy"].append(means["entropy"][0])
        est["topk"].append(means["topk_fraction"][0])
    return truth, {name: np.stack(v) for name, v in est.items()}


@pytest.mark.slow
@pytest.mark.parametrize("stat", ["coverage", "entropy", "topk"])
def test_sampled_statistics_centre_on_the_all_query_value(
        runs: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], stat: str) -> None:
    truth, est = runs
    bias = est[stat].mean(0) - truth[stat]
    spread = est[stat].std(0)
    # unbiased: the mean over seeds sits within ~4 standard errors of the truth (plus 1.5/T:
    # query 0, entropy 0, is rarely drawn in a few seeds) ...
    se = spread / math.sqrt(SEEDS)
    assert np.all(np.abs(bias) <= 4 * se + 1e-3), (stat, bias, se)
    # ... and the bias is well below one run's sampling spread
    assert np.all(np.abs(bias) <= 0.25 * spread + 1e-3), (stat, bias, spread)


@pytest.mark.slow
def test_sampling_error_is_reported_and_honest(
        runs: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]) -> None:
    """The standard error one run reports is the right size for the spread across seeds."""
    q, k, scale = _attention()
    _, est = runs
    spread = est["coverage"].std(0)
    ses = []
    for seed in range(8):
        acc = HeadStatsAccumulator(1, 1, 4, sinks_grid=SINKS, window_grid=WINDOWS, seed=seed)
        head_rows.update(acc, 0, q, k, scale, q_start=0)
        ses.append(acc.coverage_se()[0])
        assert np.all(acc.n_eff()[0] > 8)
    se = np.mean(ses, 0)
    # stratification makes the true error smaller than the Kish estimate, so it is mostly
    # conservative; a rare high-coverage query a run did not draw (the sink head's queries
    # whose window still reaches the sinks) is invisible to it, hence "most cells"
    material = spread > 1e-3
    ratio = se[material] / spread[material]
    assert np.median(ratio) >= 1.0 and np.mean(ratio >= 0.5) >= 0.9, (se, spread)


def test_every_layer_of_a_request_samples_the_same_positions() -> None:
    acc = HeadStatsAccumulator(2, 1, 1, seed=3)
    a, wa = acc.sample_plan(1500, 0)
    b, wb = acc.sample_plan(1500, 0)
    assert a.tolist() == b.tolist() and wa.tolist() == wb.tolist()
    assert acc.sample_plan(1500, 7)[0].tolist() != a.tolist()  # another request
    assert wa.sum() == 1500 and len(a) == 64 and np.all(np.diff(a) > 0)
    # strata are narrower towards the end; the detail queries spread over the prompt
    assert wa[0] > 3 * wa[-1]
    det = acc.detail_subset(len(a), wa, 0)
    assert len(det) == 2 and a[det[0][0]] < 750 <= a[det[1][0]]
    assert sum(w for _, w in det) == pytest.approx(1500)


@pytest.mark.slow
def test_weighted_state_merges_serializes_and_reads_old_state() -> None:
    q, k, scale = _attention()
    a = HeadStatsAccumulator(1, 1, 4, sinks_grid=SINKS, window_grid=WINDOWS, seed=1)
    head_rows.update(a, 0, q[:900], k[:900], scale, q_start=0)
    b = HeadStatsAccumulator(1, 1, 4, sinks_grid=SINKS, window_grid=WINDOWS, seed=2)
    head_rows.update(b, 0, q, k, scale, q_start=0)
    both = HeadStatsAccumulator.from_dict(a.to_dict()).merge(HeadStatsAccumulator.from_bytes(
        HeadStatsAccumulator.from_dict(b.to_dict()).take_bytes()))
    assert both.weight_sum[0, 0] == 900 + T  # estimated queries of both prompts
    np.testing.assert_allclose(both.cov_w, a.cov_w + b.cov_w)
    np.testing.assert_allclose(both.coverage_mean(),
                               (a.cov_sum + b.cov_sum) / (a.cov_w + b.cov_w))
    # schema 1 (unweighted sums) still reads: every sampled query had weight 1
    old = a.to_dict()
    old["schema"] = "attnprof.head_stats/1"
    old["arrays"] = {f: v for f, v in old["arrays"].items()
                     if f not in ("weight_sum", "detail_w", "cov_w", "cov_w2", "cov_sq")}
    back = HeadStatsAccumulator.from_dict(old)
    np.testing.assert_array_equal(back.cov_w, a.cov_n)
    np.testing.assert_array_equal(back.weight_sum, a.queries)
    assert np.all(np.isfinite(back.coverage_se()[back.cov_n >= 2]))


def test_confidence_margin_and_reported_sampling_error() -> None:
    """One query in 30 misses the window: the point estimate (1/30 <= 0.05) passes, but with
    30 effective queries the Wilson interval (z = 1: 0.013..0.084) straddles 0.05, so the
    window is undecided, not passed (and not a head at risk either)."""
    from attnprof.analyze.sparsity.classify import Thresholds, classify
    from attnprof.analyze.sparsity.recommend import (
        evaluate,
        export_summary,
        format_summary,
        recommend,
    )
    from attnprof.analyze.sparsity.savings import LengthDistribution
    from attnprof.facts.shape import AttentionShape

    n = 200
    pos = torch.arange(n, dtype=torch.float32)
    k = torch.stack([torch.ones(n), pos / n], -1)[:, None, :]  # [n, 1, 2]
    q = torch.stack([-4.0 * pos, 4.0 * n * torch.ones(n)], -1)[:, None, :]  # e^-4 per token
    sample = list(range(n - 30, n))
    q[sample[7]] = 0.0  # uniform: coverage (4 + 8) / 178 of its keys
    acc = HeadStatsAccumulator(1, 1, 1, sinks_grid=(0, 4), window_grid=(8, 16))
    head_rows.update(acc, 0, q, k, 1.0, sample=sample)
    p, se = acc.fail_share(0.9)
    assert p[0, 0, 1, 0] == pytest.approx(1 / 30) and se[0, 0, 1, 0] == pytest.approx(
        math.sqrt(1 / 30 * 29 / 30 / 30))
    assert acc.n_eff()[0, 0, 1, 0] == pytest.approx(30)
    loose = classify(acc, Thresholds(confidence_z=0.0)).layers[0].kv_heads[0]
    strict = classify(acc, Thresholds()).layers[0].kv_heads[0]
    assert loose.window == 8 and strict.window != 8
    se = strict.coverage_se[8]
    assert strict.coverage_n_eff[8] == 30.0 and se is not None and 0 < se < 0.1
    arch = AttentionShape(1, 1, 1, 2, "float32")
    dist = LengthDistribution.from_lengths([150, 200, 400])
    ev = evaluate(dist, arch, 8, 4, head_stats=acc).to_json()
    assert ev["heads_at_risk_count"] == 0 and ev["heads_undecided_count"] == 1
    assert ev["heads_undecided"][0]["n_eff"] == 30.0 and ev["sampling"]["min_n_eff"] == 30.0
    assert strict.decision[8] == "undecided" and loose.decision[8] == "pass"
    rec = recommend(dist, arch, acc, thresholds=Thresholds(confidence_z=0.0))
    assert rec.best.window == 8 and "effective n >= 30" in format_summary(rec.to_json())
    # at z = 1 the head is undecided at both windows: nothing is windowed, and the advice
    # and the sentence say why
    rec = recommend(dist, arch, acc)
    assert rec.best.layers == () and rec.undecided == {8: 1, 16: 1}
    assert rec.to_json()["undecided"] == {"8": 1, "16": 1}
    assert rec.advice[0].startswith("1 KV head undecided at w=16, 1 at w=8: need more "
                                    "traffic")
    assert "1 KV head undecided at w=16, 1 at w=8: need more traffic" \
        in format_summary(rec.to_json())
    adv = export_summary(rec)
    assert adv.heads_undecided == {"8": 1, "16": 1}
    assert [p.heads_undecided for p in rec.pareto] == [1, 1]


# ---------------------------------------------------------------- three-valued decisions
# One KV head per query head (group 1), s = 4, w = 64. Every query attends locally (e^-1 per
# ~3 tokens) except a chosen, evenly spread share of the eligible queries, which put all
# their mass on a "needle" key far back (coverage ~0). Head 0: no such query; head 1: 30% of
# them; head 2: 4% (passes on all queries, but a sample of ~55 cannot tell it from 0.05).
TT, W3, NEEDLE = 600, 64, 4  # key 4: past the sinks, outside every window
SHARES = (0.0, 0.3, 0.04)


def _needle_attention(t: int = TT) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    pos = torch.arange(t, dtype=torch.float32)
    k = torch.zeros(t, len(SHARES), 4)
    k[:, :, 0] = (pos / t)[:, None]
    k[:, :, 1] = 1.0
    k[NEEDLE, :, 2] = 1.0
    q = torch.zeros(t, len(SHARES), 4)
    q[:, :, 0] = 200.0
    q[:, :, 1] = (-200.0 * pos / t)[:, None]
    elig = np.flatnonzero(np.arange(t) + 1 > 4 + W3)
    exact = []
    for h, f in enumerate(SHARES):
        far = elig[np.floor(np.arange(len(elig)) * f) != np.floor((np.arange(len(elig)) + 1) * f)]
        q[far, h, 2] = 400.0  # the needle's logit dwarfs every local one
        exact.append(len(far) / len(elig))
    return q, k, exact


def _acc(**kw: object) -> HeadStatsAccumulator:
    return HeadStatsAccumulator(1, len(SHARES), 1, sinks_grid=(0, 4), window_grid=(W3,),
                                **kw)  # type: ignore[arg-type]


def _decisions(acc: HeadStatsAccumulator, z: float = 1.0) -> list[str | None]:
    from attnprof.analyze.sparsity.classify import Thresholds, classify

    out = classify(acc, Thresholds(confidence_z=z))
    return [k.decision[W3] for k in out.layers[0].kv_heads]


def test_wilson_bound_is_one_sided_and_never_zero() -> None:
    from attnprof.analyze.sparsity.confidence import wilson_bounds, wilson_low

    low, high = wilson_bounds(np.array([0.0, 3.0]), np.array([30.0, 30.0]), 1.0)
    assert low[0] == 0.0 and high[0] == pytest.approx(1 / 31)  # z^2 / (n + z^2)
    assert 0 < low[1] < 0.1 < high[1] < 0.2
    assert np.isnan(wilson_bounds(0.0, 0.0, 1.0)[1]) and math.isnan(wilson_low(1, 0))


@pytest.mark.slow
def test_window_decisions_pass_fail_and_undecided() -> None:
    """Sampled (64 queries, ~55 eligible): the clean head passes, the 30% head fails, the 4%
    head is undecided and therefore not windowed; the all-query census decides it (pass)."""
    from attnprof.analyze.sparsity.classify import Thresholds, classify, head_windows

    q, k, exact = _needle_attention()
    assert exact[0] == 0 and exact[1] == pytest.approx(0.3, abs=0.01) \
        and exact[2] == pytest.approx(0.04, abs=0.005)
    acc = _acc()
    head_rows.update(acc, 0, q, k, 1.0, q_start=0)
    assert _decisions(acc) == ["pass", "fail", "undecided"]
    out = classify(acc, Thresholds()).to_json()
    assert out["undecided"] == {str(W3): 1}
    kv2 = out["layers"][0]["kv_heads"][2]
    assert 0 < kv2["fail_share"][str(W3)] < kv2["fail_share_upper"][str(W3)]
    assert kv2["fail_share_upper"][str(W3)] > 0.05
    assert not kv2["exact"] and kv2["window"] != W3  # undecided never passes
    assert not np.isfinite(head_windows(acc, Thresholds())[0, 2])

    census = _acc()
    head_rows.update(census, 0, q, k, 1.0, q_start=0, sample=torch.arange(TT))
    acc.set_exact(census, [0])
    assert _decisions(acc) == ["pass", "fail", "pass"]  # 4% <= 5%, no sampling error
    p, se = acc.fail_share(0.9)
    np.testing.assert_allclose(p[0, :, 1, 0], exact, atol=1e-12)
    assert np.all(se[0, :, 1, 0] == 0) and np.all(acc.coverage_se()[0, :, 1, 0] == 0)
    cls = classify(acc, Thresholds())
    assert cls.undecided == {} and cls.decided_exactly_kv_heads == 3
    assert cls.layers[0].kv_heads[2].window == W3


def test_a_sample_with_no_failures_is_not_proof() -> None:
    """12 eligible queries, none failing: the point estimate is 0 with zero standard error,
    but 12 queries cannot show a share <= 0.05 (Wilson upper 1/13): undecided, not pass."""
    q, k, _ = _needle_attention(t=4 + W3 + 12)
    acc = _acc()
    head_rows.update(acc, 0, q[:, :1].repeat(1, 3, 1), k, 1.0, q_start=0,
                     sample=range(4 + W3, len(q)))
    assert acc.cov_n[0, 0, 1, 0] == 12
    assert _decisions(acc) == ["undecided"] * 3


@pytest.mark.slow
def test_exact_flag_survives_serialization_and_merging_clears_it() -> None:
    q, k, _ = _needle_attention()
    census = _acc()
    head_rows.update(census, 0, q, k, 1.0, q_start=0, sample=torch.arange(TT))
    acc = _acc()
    head_rows.update(acc, 0, q, k, 1.0, q_start=0)
    with pytest.raises(ValueError):
        acc.set_exact(census, [1])
    acc.set_exact(census, [0])
    assert acc.exact.all()
    back = HeadStatsAccumulator.from_dict(acc.to_dict())
    assert back.exact.all() and _decisions(back) == ["pass", "fail", "pass"]
    clone = HeadStatsAccumulator.from_dict(acc.to_dict())
    got = HeadStatsAccumulator.from_bytes(clone.take_bytes())
    assert got.exact.all() and not clone.exact.any()  # a take restarts from zero
    merged = HeadStatsAccumulator.from_dict(acc.to_dict()).merge(_acc())
    assert not merged.exact.any()
    glob = _acc()
    glob.add_at(HeadStatsAccumulator.from_dict(acc.to_dict()))
    assert not glob.exact.any()
    # state written before the flag existed reads as sampled
    old = acc.to_dict()
    del old["exact"]
    assert not HeadStatsAccumulator.from_dict(old).exact.any()
