"""Issue 32's ten money cases, each built from the issue's own numbers at $2.50/GPU-hour:
what the cost report used to bank that a fleet could not, and what it banks now. Every
expected figure is worked out here by hand from the inputs (never read back from the code).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from attnprof.analyze.cost import (
    CostInputs,
    FlagChecks,
    Measured,
    Settings,
    build_model_report,
)
from attnprof.cli import main
from attnprof.contracts.report import (
    ContextDistribution,
    KvMemory,
    ModelReport,
    TimeBreakdown,
    Traffic,
    WhatIf,
)
from attnprof.exporters.money import saving_lines
from tests.golden import DEMO

PRICE = 2.50
FLAGS = FlagChecks(version="0.32.0", kv_cache_dtype=True, fp8_values=True, backend_fp8=True,
                   hf_overrides=True, max_model_len=True, layer_types=True,
                   layer_types_detail="models/llama.py reads layer_types",
                   kv_cache_dtype_skip_layers=True)
SETTINGS = Settings(gpu_hour_price=PRICE)


def _fleet(*, replicas: int = 8, verdict: str = "compute_bound", dtype: str = "bfloat16",
           tokens_per_s: float = 8000.0, decode_share: float = 0.39,
           capacity: float = 800_000.0, usage_peak: float = 0.9, preemptions: float = 0.0,
           scope: str = "fleet", requests: float = 10_000.0) -> CostInputs:
    """A fleet of ``replicas`` (1 GPU each) whose model time is all decode; FP8 from bf16
    halves the KV bytes read, so its time saving is ``decode_share`` x 0.5."""
    ctx = ContextDistribution(bounds=[1024.0, 4096.0], counts=[requests, 0.0, 0.0],
                              p50=500.0, p90=900.0, p99=1000.0, p999=1020.0, max=1024.0,
                              mean=1000.0)
    traffic = Traffic(requests=requests, requests_per_s=requests / 3600,
                      tokens_per_s=tokens_per_s, prompt_tokens=1e6, generation_tokens=1e5,
                      max_model_len=1024, context=ctx, scope=scope)  # type: ignore[arg-type]
    time = TimeBreakdown(attention_share={"decode": decode_share},
                         model_time_s={"decode": 100.0})
    kv = KvMemory(bytes_per_token=65536.0, kv_dtype=dtype, capacity_tokens=capacity,
                  capacity_sequences={}, usage_p95=usage_peak, usage_peak=usage_peak,
                  above_90_fraction=0.0, preemptions=preemptions, waiting_fraction=0.0,
                  verdict=verdict)
    return CostInputs(model="m", traffic=traffic, time=time, kv=kv, window=None,
                      architecture="LlamaForCausalLM", num_layers=32, replicas=replicas,
                      replicas_basis="--replicas", gpus_per_replica=1.0,
                      backends=["FLASH_ATTN"], sliding_layers=[], head_sizes=[128])


def _fp8(rep: ModelReport) -> WhatIf:
    return next(w for w in rep.what_ifs if w.id == "fp8_kv")


def _line(rep: ModelReport, start: str = "FP8 KV cache") -> str:
    return next(x for x in saving_lines(rep) if x.startswith(start))


# a) -------------------------------------------------------------------------------------

def test_a_autoscaled_base_is_the_fleets_mean_replicas_not_its_counted_bill() -> None:
    # 8 replicas, FP8 saves 0.39 x 0.5 = 19.5% of the time: over the counted fleet that
    # was 0.195 x 8 x 730 = 1,139 GPU-hours/month; at 40% average load the fleet runs 3.2
    # replicas on average: 0.195 x 3.2 x 730 = 455.5 is what it banks.
    inp = _fleet()
    inp.mean_replicas, inp.mean_replicas_basis = 3.2, "Prometheus"
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.autoscaled is not None and w.autoscaled.share == pytest.approx(0.195)
    assert w.autoscaled.monthly_gpu_hours_saved == pytest.approx(0.195 * 3.2 * 730)
    assert w.autoscaled.monthly_gpu_hours_saved == pytest.approx(455.5, abs=0.1)
    assert w.autoscaled.monthly_saving == pytest.approx(455.52 * PRICE)


def test_a_without_the_mean_replicas_the_autoscaled_figure_is_per_replica_month() -> None:
    w_rep = build_model_report(_fleet(), SETTINGS, FLAGS)
    a = _fp8(w_rep).autoscaled
    assert a is not None and a.monthly_gpu_hours_saved is None and a.monthly_saving is None
    assert a.gpu_hours_saved_per_replica_month == pytest.approx(0.195 * 730)
    line = _line(w_rep)
    assert "1,139 GPU-hours" not in line and "not computable" in line
    assert "(142 GPU-hours)" in line and "/replica-month" in line
    # A 1-replica demo printed 58 GPU-hours/month (8% of one replica's month): it is per
    # replica-month now, never a fleet's monthly figure.
    demo = _fleet(replicas=1, tokens_per_s=1000.0, decode_share=0.159, scope="replica")
    line = _line(build_model_report(demo, SETTINGS, FLAGS))
    assert "58 GPU-hours/month" not in line and "58 GPU-hours)" in line
    assert "not computable without the fleet's mean replicas" in line


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "x"])
@pytest.mark.parametrize("flag", ["--mean-replicas", "--replica-max-tokens-per-s"])
def test_a_mean_replicas_flag_is_checked(bad: str, flag: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("report", "whatif"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, str(DEMO), flag, bad, "--out", str(tmp_path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0]
        assert "> 0" in err[0] or "not a number" in err[0]


def test_a_mean_replicas_flag_is_the_autoscaled_base(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(DEMO.read_text())
    for p in doc["snapshot"]["processes"]:  # 100 s under the counters (the golden: 0)
        p["started_at"] = doc["snapshot"]["time"] - 100.0
    src = tmp_path / "demo.json"
    src.write_text(json.dumps(doc))
    assert main(["report", str(src), "--mean-replicas", "3.2", "--replica-max-tokens-per-s",
                 "900", "--out", str(tmp_path / "o")]) == 0
    (m,) = json.loads((tmp_path / "o" / "report.json").read_text())["models"]
    assert m["money"]["mean_replicas"] == 3.2
    assert m["money"]["replica_max_tokens_per_s"] == 900.0
    assert m["money"]["mean_replicas_basis"] == "--mean-replicas"
    for w in m["what_ifs"]:
        a = w["autoscaled"]
        if a is not None and a["gpu_hours_saved_per_replica_month"] is not None:
            assert a["monthly_gpu_hours_saved"] == pytest.approx(
                a["gpu_hours_saved_per_replica_month"] * 3.2)


# b) -------------------------------------------------------------------------------------

def _kv_bound_eight() -> CostInputs:
    # 8 replicas of 100,000 tokens, 90% held at the peak (720,000 tokens): 8 needed now;
    # FP8 from fp32 (s = 75%): 180,000 tokens, 2 replicas after. 8,000 tokens/s observed,
    # 1,000 per replica: the 2 left would need 4,000 each, 4x what one was seen doing.
    return _fleet(verdict="kv_bound", dtype="float32")


def test_b_kv_savings_are_capped_by_compute_headroom() -> None:
    w = _fp8(build_model_report(_kv_bound_eight(), SETTINGS, FLAGS))
    assert (w.replicas_now, w.replicas_after) == (8, 2)
    # Without a measured maximum, one replica's observed 1,000 tokens/s caps it: 8 stay.
    assert w.compute_floor == 8 and w.replicas_removed == 0
    assert any("measure at saturation" in n for n in w.notes)
    assert w.autoscaled is not None and w.autoscaled.share == 0.0
    # A replica measured at 2,000 tokens/s at saturation: ceil(8,000 / 2,000) = 4 stay.
    inp = _kv_bound_eight()
    inp.replica_max_tokens_per_s = 2000.0
    inp.mean_replicas = 8.0
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.compute_floor == 4 and w.replicas_removed == 4  # was 6
    assert w.monthly_gpu_hours_saved == pytest.approx(4 * 730)
    assert w.monthly_saving == pytest.approx(4 * 730 * PRICE)
    # Autoscaled: 8 mean replicas may drop to 8,000 / 2,000 = 4: at most 50%, not 75%.
    assert w.autoscaled is not None and w.autoscaled.share == pytest.approx(0.5)


# c) -------------------------------------------------------------------------------------

def test_c_an_estimated_kv_saving_is_never_labelled_measured() -> None:
    inp = _kv_bound_eight()
    inp.replica_max_tokens_per_s, inp.mean_replicas = 2000.0, 8.0  # a saving to list
    inp.measured = {"fp8_kv": Measured(time_saving=0.05, kv_saving=None, detail="run",
                                       time_saving_low=0.02, time_saving_high=0.08,
                                       verdict="confirmed")}
    rep = build_model_report(inp, SETTINGS, FLAGS)
    w = _fp8(rep)
    assert w.kv_saving == pytest.approx(0.75) and w.evidence == "estimated"
    assert "capacity line was missing" in w.evidence_detail
    assert "[measured" not in _line(rep) and "[estimated" in _line(rep)
    inp.measured["fp8_kv"].kv_saving = 0.74  # with vLLM's figure it is measured
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.evidence == "measured" and w.kv_saving == 0.74


# d) -------------------------------------------------------------------------------------

def _measured_time(lo: float, point: float, hi: float) -> CostInputs:
    inp = _fleet(replicas=100)
    inp.mean_replicas = 100.0
    inp.measured = {"fp8_kv": Measured(time_saving=point, kv_saving=0.5, detail="run",
                                       time_saving_low=lo, time_saving_high=hi)}
    return inp


def test_d_a_saving_whose_interval_holds_zero_banks_nothing() -> None:
    # FP8's measured throughput change [-3.0%, +7.2%] (point +2.1%), as time savings.
    lo, hi, pt = 1 - 1 / 0.97, 1 - 1 / 1.072, 1 - 1 / 1.021
    rep = build_model_report(_measured_time(lo, pt, hi), SETTINGS, FLAGS)
    w = _fp8(rep)
    assert w.banked_time_saving == 0.0 and w.replicas_removed == 0
    assert w.monthly_gpu_hours_saved == 0.0
    assert w.autoscaled is not None and w.autoscaled.share == 0.0
    assert w.id not in rep.ranking  # nothing to rank
    assert (w.time_saving_low, w.time_saving_high) == (lo, hi)
    assert any("holds 0" in n for n in w.notes)


def test_d_a_measured_saving_banks_its_lower_bound_and_prints_its_interval() -> None:
    rep = build_model_report(_measured_time(0.03, 0.08, 0.12), SETTINGS, FLAGS)
    w = _fp8(rep)
    # 100 replicas: 100 - ceil(100 x 0.97) = 3 removed, not 8 from the point estimate.
    assert w.banked_time_saving == 0.03 and w.replicas_removed == 3
    assert w.monthly_saving == pytest.approx(3 * 730 * PRICE)
    assert w.autoscaled is not None
    assert w.autoscaled.monthly_gpu_hours_saved == pytest.approx(0.03 * 100 * 730)
    line = _line(rep)
    assert "[+3.0%, +12.0%]" in line and "banks 3.0%" in line and "+8.0%" in line
    # Without an interval (one round) nothing is banked.
    inp = _measured_time(0.03, 0.08, 0.12)
    inp.measured["fp8_kv"].time_saving_low = inp.measured["fp8_kv"].time_saving_high = None
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.banked_time_saving == 0.0 and w.replicas_removed == 0


# e) -------------------------------------------------------------------------------------

def test_e_replicas_needed_come_from_memory_held_at_the_peak() -> None:
    # 4 replicas of 40,000 tokens; vLLM saw 300 running at the peak and the mean context is
    # 1,200: 300 x 1,200 = 360,000 tokens = "needs 9, has 4". The memory held at the peak
    # was 80% of 160,000 = 128,000 tokens: 3.2 replicas' worth, 4 needed.
    inp = _fleet(replicas=4, verdict="kv_bound", capacity=160_000.0, usage_peak=0.8,
                 tokens_per_s=4000.0)
    inp.traffic.context.mean = 1200.0
    inp.kv.peak_concurrency = 300.0
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.replicas_now == 4 == math.ceil(0.8 * 160_000 / 40_000)
    assert w.replicas_after == math.ceil(0.8 * 160_000 * 0.5 / 40_000)  # 2
    assert not any("needs 9" in n for n in w.notes)


# f) -------------------------------------------------------------------------------------

def test_f_replicas_flag_never_multiplies_a_fleet_scope_rate() -> None:
    # Prometheus summed 1,000 tokens/s over the 4 replicas it scraped; --replicas 8.
    inp = _fleet(replicas=8, tokens_per_s=1000.0)
    inp.scope_replicas = 4
    rep = build_model_report(inp, SETTINGS, FLAGS)
    assert rep.money.gpu_hours_per_mtok == pytest.approx(4 / (1000 * 3600) * 1e6)  # 1.11
    assert rep.money.cost_per_mtok == pytest.approx(1.111 * PRICE, rel=1e-3)
    assert rep.money.monthly_gpu_hours == 8 * 730  # the fleet billed is the one asked for


# g) -------------------------------------------------------------------------------------

def test_g_zero_traffic_prints_no_autoscaled_dollars() -> None:
    inp = _fleet(requests=0.0, tokens_per_s=0.0)
    inp.mean_replicas = 8.0
    rep = build_model_report(inp, SETTINGS, FLAGS)
    assert any("money figures are missing" in x for x in rep.warnings)
    for w in rep.what_ifs:
        assert w.autoscaled is None and w.monthly_saving is None
    assert rep.ranking == [] and saving_lines(rep) == []


# h) -------------------------------------------------------------------------------------

def test_h_a_zero_second_window_has_no_rate() -> None:
    from attnprof.tools import report_sources as rs

    # The golden demo's counters start at the snapshot's own instant: 0 s of data.
    g = rs.from_live(json.loads(DEMO.read_text())["snapshot"], "http://127.0.0.1:8000")
    (inp,) = g.inputs
    assert inp.traffic.requests > 0
    assert inp.traffic.tokens_per_s is None and inp.traffic.requests_per_s is None
    rep = build_model_report(inp, SETTINGS, FLAGS)
    assert rep.money.gpu_hours_per_mtok is None and rep.money.cost_per_mtok is None
    assert "no token rate" in rep.money.note
    assert any("too little time for a rate" in x for x in inp.warnings)


# i) -------------------------------------------------------------------------------------

def test_i_a_variant_that_could_not_start_is_never_ranked() -> None:
    inp = _fleet(replicas=100)
    assert "fp8_kv" in build_model_report(inp, SETTINGS, FLAGS).ranking  # #1 before
    inp.measured = {"fp8_kv": Measured(time_saving=0.0, kv_saving=None,
                                       detail="the server exited", status="could_not_start")}
    rep = build_model_report(inp, SETTINGS, FLAGS)
    w = _fp8(rep)
    assert "fp8_kv" not in rep.ranking and not w.ranked
    assert all(not x.startswith("FP8") for x in saving_lines(rep))
    assert w.apply.supported is False and "could not start" in w.not_ranked


# j) -------------------------------------------------------------------------------------

def test_j_a_cpu_measurement_never_overrides_a_gpu_fleets_estimate() -> None:
    # bf16 GPU fleet: FP8 halves the KV (+100% capacity); the CPU measured fp32 -> fp8
    # (75% saved, +300%) and a 30% time saving: shown beside, not adopted.
    inp = _fleet(replicas=100)
    est = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    inp.measured = {"fp8_kv": Measured(
        time_saving=0.3, kv_saving=0.75, detail="cpu run", time_saving_low=0.25,
        time_saving_high=0.35, verdict="confirmed", comparable=False,
        mismatch="cpu float32 vs cuda bfloat16")}
    rep = build_model_report(inp, SETTINGS, FLAGS)
    w = _fp8(rep)
    assert w.kv_saving == pytest.approx(0.5) and w.evidence == "estimated"
    assert w.time_saving == est.time_saving and w.replicas_removed == est.replicas_removed
    assert w.measured_beside is not None and w.measured_beside.kv_saving == 0.75
    assert w.measured_beside.mismatch == "cpu float32 vs cuda bfloat16"
    assert "cpu float32 vs cuda bfloat16" in _line(rep) and "not adopted" in _line(rep)


# quality before money --------------------------------------------------------------------

def test_fp8_keeps_sliding_window_layers_with_the_skip_layers_flag() -> None:
    inp = _fleet()
    inp.sliding_layers = list(range(0, 32, 2))  # 16 of 32 layers slide
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.apply.flags == ["--kv-cache-dtype fp8",
                             "--kv-cache-dtype-skip-layers sliding_window"]
    assert w.kv_saving == pytest.approx(0.5 * 16 / 32)
    old = FlagChecks(**{**FLAGS.__dict__, "kv_cache_dtype_skip_layers": False})
    w = _fp8(build_model_report(inp, SETTINGS, old))
    assert w.apply.flags == ["--kv-cache-dtype fp8"] and w.confidence == "low"
    assert any("no --kv-cache-dtype-skip-layers" in n for n in w.notes)


def test_fp8_with_head_size_256_says_its_prefill_exception() -> None:
    inp = _fleet()
    inp.head_sizes = [256]
    w = _fp8(build_model_report(inp, SETTINGS, FLAGS))
    assert w.confidence == "low" and any("head size 256" in n for n in w.notes)
    assert w.apply.flags == ["--kv-cache-dtype fp8"]  # no invented flag


def test_agreement_below_the_replay_target_is_not_ranked() -> None:
    inp = _measured_time(0.03, 0.08, 0.12)
    inp.measured["fp8_kv"].agreement_ok = False
    rep = build_model_report(inp, SETTINGS, FLAGS)
    assert "fp8_kv" not in rep.ranking and not _fp8(rep).ranked


def test_the_verdict_is_on_the_savings_line_and_the_what_if() -> None:
    inp = _measured_time(0.03, 0.08, 0.12)
    inp.measured["fp8_kv"].verdict = "confirmed"
    rep = build_model_report(inp, SETTINGS, FLAGS)
    assert _fp8(rep).verdict == "confirmed" and _fp8(rep).confidence == "high"
    assert "[measured, confirmed: time saving +8.0% [+3.0%, +12.0%], banks 3.0%]" in _line(rep)


def test_the_report_files_carry_the_interval_what_is_banked_and_the_base() -> None:
    from attnprof.analyze.cost import FORMULAS
    from attnprof.contracts.report import Report, ReportSource
    from attnprof.tools.report import render_all

    inp = _measured_time(0.03, 0.08, 0.12)
    inp.measured["fp8_kv"].verdict = "confirmed"
    m = build_model_report(inp, SETTINGS, FLAGS)
    m.savings = saving_lines(m)
    rep = Report(generated_at=0.0, source=ReportSource(kind="files", where=["x"]),
                 models=[m], formulas=dict(FORMULAS), versions={})
    texts = render_all(rep)
    doc = json.loads(texts["report.json"])["models"][0]
    (w,) = [x for x in doc["what_ifs"] if x["id"] == "fp8_kv"]
    assert (w["time_saving_low"], w["banked_time_saving"], w["verdict"]) == (
        0.03, 0.03, "confirmed")
    assert doc["ranking"][0] == "fp8_kv" and doc["money"]["mean_replicas"] == 100.0
    for name in ("report.md", "report.html"):
        text = texts[name]
        assert "[+3.0%, +12.0%], banks 3.0%" in text  # the savings line
        assert "Time saving the money banks" in text and "Mean replicas" in text


# the one definition of each piece of maths both sources use --------------------------------

def test_mean_over_range_counts_a_step_without_replicas_as_zero() -> None:
    from attnprof.analyze.cost_inputs import mean_over_range

    # 0..100 s every 10 s: 11 steps; 8 replicas for the first 4, 2 for the next 4, none
    # for the last 3 (scaled to zero: no series): (4 x 8 + 4 x 2) / 11.
    pts = [(float(t), 8.0) for t in range(0, 40, 10)] + \
        [(float(t), 2.0) for t in range(40, 80, 10)]
    assert mean_over_range(pts, 0.0, 100.0, 10.0) == pytest.approx(40 / 11)
    assert mean_over_range([], 0.0, 100.0, 10.0) is None
    assert mean_over_range(pts, 100.0, 100.0, 10.0) is None


def test_rates_need_a_second_of_data() -> None:
    from attnprof.analyze.cost_inputs import rate

    assert rate(2000.0, 0.0) is None and rate(2000.0, 1e-9) is None
    assert rate(2000.0, None) is None and rate(2000.0, 0.5) is None
    assert rate(2000.0, 4.0) == 500.0


def test_attention_share_and_peak_concurrency_have_one_definition() -> None:
    from attnprof.analyze.cost_inputs import attention_shares, peak_concurrency

    shares, overall = attention_shares({"prefill": 30.0, "decode": 70.0, "idle": 0.0},
                                       {"prefill": 6.0, "decode": 28.0})
    assert shares == {"prefill": pytest.approx(0.2), "decode": pytest.approx(0.4)}
    assert overall == pytest.approx((6.0 + 28.0) / 100.0)
    assert attention_shares({}, {}) == ({}, None)
    assert peak_concurrency(0.5, 10_000.0, 500.0)[0] == pytest.approx(10.0)
    assert peak_concurrency(0.5, 10_000.0, 500.0, running_peak=7.0)[0] == 7.0
    assert peak_concurrency(None, 10_000.0, 500.0) == (None, "")


def test_a_fleet_sums_memory_held_from_the_busiest_replica_and_says_it_is_an_upper_bound(
        ) -> None:
    # Prometheus' peak usage is the busiest replica's own peak; times the whole fleet's
    # capacity it assumes all 8 peaked together: the report says so beside the KV saving.
    fleet = build_model_report(_fleet(verdict="kv_bound"), SETTINGS, FLAGS)
    assert any("upper bound" in n for n in _fp8(fleet).notes)
    # One server's figures (scope replica) are its own peak: no such note.
    one = build_model_report(_fleet(verdict="kv_bound", scope="replica"), SETTINGS, FLAGS)
    assert not any("upper bound" in n for n in _fp8(one).notes)


def test_a_fleets_own_sum_at_one_instant_sizes_it_when_prometheus_has_it() -> None:
    # 8 replicas of 100,000 tokens: the busiest replica peaked at 90%, but the fleet's own
    # sum at its busiest instant held 360,000 tokens (3.6 replicas' worth, not 7.2): 4
    # replicas needed now, not 8, and no upper-bound note.
    inp = _fleet(verdict="kv_bound")
    bound = build_model_report(inp, SETTINGS, FLAGS)
    inp.kv.held_peak_tokens = 360_000.0
    own = build_model_report(inp, SETTINGS, FLAGS)
    assert _fp8(bound).replicas_now == math.ceil(0.9 * 800_000 / 100_000)  # 8
    assert _fp8(own).replicas_now == math.ceil(360_000 / 100_000)  # 4
    assert not any("upper bound" in n for n in _fp8(own).notes)
