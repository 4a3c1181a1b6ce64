"""The cost report's what-ifs and money (analyze/cost.py): each number against its formula,
computed here by hand from the inputs."""

from __future__ import annotations

import json
import math

import pytest

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.analyze.cost import (
    CostInputs,
    FlagChecks,
    Settings,
    WindowInputs,
    build_model_report,
)
from attnprof.contracts.advice import HeadLevelSplit, ReplayEvidence
from attnprof.contracts.report import (
    ContextDistribution,
    KvMemory,
    ModelReport,
    TimeBreakdown,
    Traffic,
    WhatIf,
)
from attnprof.exporters.money import saving_lines

FLAGS = FlagChecks(version="0.32.0", kv_cache_dtype=True, fp8_values=True, backend_fp8=True,
                   hf_overrides=True, max_model_len=True, layer_types=True,
                   layer_types_detail="models/llama.py reads layer_types")



def _interpolated(bounds: list[float], counts: list[float], q: float) -> float | None:
    return bucket_quantile(bounds, counts, q, interpolate=True)

def _inputs(verdict: str = "neither", window: WindowInputs | None = None,
            requests: float = 5000.0, dtype: str = "bfloat16") -> CostInputs:
    # 100 requests <= 128 tokens, 4800 in (128, 1024], 100 in (1024, 4096].
    bounds = [128.0, 1024.0, 4096.0]
    counts = [100.0, 4800.0, 100.0, 0.0]
    ctx = ContextDistribution(bounds=bounds, counts=counts, p50=500.0, p90=900.0, p99=2000.0,
                              p999=_interpolated(bounds, counts, 0.999), max=4000.0,
                              mean=600.0)
    traffic = Traffic(requests=requests, requests_per_s=2.0, tokens_per_s=1000.0,
                      prompt_tokens=1e6, generation_tokens=2e5, max_model_len=8192,
                      context=ctx)
    time = TimeBreakdown(attention_share={"prefill": 0.2, "decode": 0.4},
                         model_time_s={"prefill": 30.0, "decode": 70.0})
    kv = KvMemory(bytes_per_token=36864.0, kv_dtype=dtype, capacity_tokens=100_000.0,
                  capacity_sequences={"p50": 200.0, "p99": 50.0}, usage_p95=0.8,
                  usage_peak=0.95, above_90_fraction=0.3, preemptions=3.0,
                  waiting_fraction=0.1, verdict=verdict, peak_concurrency=500.0)
    return CostInputs(model="m", traffic=traffic, time=time, kv=kv, window=window,
                      architecture="LlamaForCausalLM", num_layers=4, replicas=4,
                      replicas_basis="--replicas", gpus_per_replica=2.0,
                      backends=["FLASH_ATTN"])


def _window(sinks: int = 4, replay: ReplayEvidence | None = None) -> WindowInputs:
    return WindowInputs(sinks=sinks, window=1024, layers=[1, 3], flop_saving=0.3,
                        kv_saving=0.25, exact_fraction=0.9, heads_at_risk=0, replay=replay,
                        safe=replay is not None and replay.safe, summary="window 1024")


def _get(rep: ModelReport, wid: str) -> WhatIf:
    return next(w for w in rep.what_ifs if w.id == wid)


def _lines(rep: ModelReport) -> list[str]:
    """The savings lines as the report prints them (exporters/money.py)."""
    return saving_lines(rep)


def _headroom(inp: CostInputs, max_tps: float = 1000.0) -> CostInputs:
    """A fleet whose replica's saturated tokens/s and mean replicas are known: a KV saving
    is then capped by compute only at ``max_tps``, and the autoscaled base is the fleet
    counted (all its replicas ran all the time)."""
    inp.replica_max_tokens_per_s = max_tps
    inp.mean_replicas, inp.mean_replicas_basis = float(inp.replicas), "test"
    return inp


def test_bucket_quantile_interpolates_like_histogram_quantile() -> None:
    # 10 in (0, 10], 10 in (10, 20]: the median is the first bucket's top, p75 halfway up
    # the second.
    assert _interpolated([10.0, 20.0], [10.0, 10.0, 0.0], 0.5) == pytest.approx(10.0)
    assert _interpolated([10.0, 20.0], [10.0, 10.0, 0.0], 0.75) == pytest.approx(15.0)
    assert _interpolated([10.0], [0.0, 0.0], 0.5) is None


def test_money_now_follows_its_formula() -> None:
    rep = build_model_report(_inputs(), Settings(gpu_hour_price=2.0), FLAGS)
    gpus = 4 * 2.0
    gph = gpus / (1000.0 * 3600) * 1e6
    assert rep.money.gpu_hours_per_mtok == pytest.approx(gph)
    assert rep.money.cost_per_mtok == pytest.approx(gph * 2.0)
    assert rep.money.monthly_cost == pytest.approx(gpus * 730 * 2.0)


def test_fp8_on_a_fleet_short_of_kv_at_its_peak_removes_no_replica() -> None:
    # It used to claim half the bill (12 replicas needed -> 6) from a fleet of 4.
    rep = build_model_report(_headroom(_inputs("kv_bound")), Settings(gpu_hour_price=2.0),
                             FLAGS)
    w = _get(rep, "fp8_kv")
    assert w.kv_saving == pytest.approx(0.5)
    assert w.kv_bytes_freed_per_token == pytest.approx(36864.0 / 2)
    # 100,000 tokens / 600 mean context = 166.7 sequences; x (1/(1-0.5) - 1) more.
    assert w.extra_sequences == pytest.approx(100_000 / 600)
    # 95% of 100,000 tokens held at the peak: 4 replicas of 25,000 now, 2 after; but the
    # fleet ran out of KV (3 preemptions at 95%): the change relieves that first.
    assert (w.replicas_now, w.replicas_after) == (4, 2)
    assert w.replicas_removed == 0
    assert w.monthly_saving == 0.0 and w.monthly_gpu_hours_saved == 0.0
    assert w.gpu_hours_per_mtok_after == pytest.approx(rep.money.gpu_hours_per_mtok)
    assert any("ran out of KV memory at its peak" in n and
               "relieves that shortage and removes no replica" in n for n in w.notes)
    # Autoscaled, memory sizes it: the KV saving s, stated as such.
    assert w.autoscaled is not None and w.autoscaled.share == pytest.approx(0.5)
    assert w.autoscaled.monthly_saving == pytest.approx(8 * 730 * 2.0 * 0.5)
    assert "KV saving" in w.autoscaled.assumes
    assert w.apply.flags == ["--kv-cache-dtype fp8"] and w.apply.supported
    assert w.evidence == "estimated"


def _issue_26_fleet(replicas: int = 1, tokens_per_s: float = 1000.0) -> CostInputs:
    """Issue 26's worked example: one server, KV-bound, 23,296 tokens of KV, mean context
    430 (54.2 sequences), 120 sequences at the peak, fp32 KV."""
    inp = _inputs("kv_bound", dtype="float32")
    inp.replicas, inp.gpus_per_replica = replicas, 1.0
    inp.traffic.scope = "replica"
    inp.traffic.tokens_per_s = tokens_per_s
    inp.traffic.context.mean = 430.0
    inp.kv.capacity_tokens, inp.kv.peak_concurrency = 23_296.0, 120.0
    return inp


def test_issue_26_fp8_on_one_short_replica_banks_nothing() -> None:
    rep = build_model_report(_headroom(_issue_26_fleet(), 4000.0),
                             Settings(gpu_hour_price=1.0), FLAGS)
    w = _get(rep, "fp8_kv")
    assert w.kv_saving == pytest.approx(0.75)
    # One replica, out of KV at its peak: nothing whole to remove.
    assert (w.replicas_now, w.replicas_after, w.replicas_removed) == (1, 1, 0)
    assert w.monthly_gpu_hours_saved == 0.0 and w.monthly_saving == 0.0  # it said 487
    assert any("ran out of KV memory at its peak" in n for n in w.notes)
    assert w.autoscaled is not None
    # Autoscaled over 1 mean replica, capped at 1 - 1000/4000 = 75% (the whole saving).
    assert w.autoscaled.monthly_gpu_hours_saved == pytest.approx(730 * 0.75)
    # Fixed figure 0 but an autoscaled one: still listed, with both figures.
    line = next(x for x in _lines(rep) if x.startswith("FP8 KV cache"))
    assert "0 GPU-hours) at a fixed fleet (0 replicas removed)" in line
    assert "$548/month (548 GPU-hours) autoscaled" in line


def test_replicas_removed_never_exceed_those_counted() -> None:
    # 90% of 100,000 tokens held at the peak: 4 replicas of 25,000; 2 after FP8: 2 removed.
    inp = _headroom(_inputs("kv_bound"))
    inp.kv.usage_peak, inp.kv.preemptions = 0.9, 0.0
    w = _get(build_model_report(inp, Settings(gpu_hour_price=2.0), FLAGS), "fp8_kv")
    assert (w.replicas_now, w.replicas_after, w.replicas_removed) == (4, 2, 2)
    assert w.monthly_saving == pytest.approx(8 * 730 * 2.0 * 2 / 4)
    for peak in (0.0, 0.01, 0.3, 0.5, 0.9, 0.99, 1.0):
        inp.kv.usage_peak = peak
        w = _get(build_model_report(inp, Settings(), FLAGS), "fp8_kv")
        assert w.replicas_removed is not None and 0 <= w.replicas_removed <= inp.replicas


def test_kv_bound_without_peak_usage_has_no_fixed_figure() -> None:
    inp = _headroom(_inputs("kv_bound"))
    inp.kv.usage_peak = None
    rep = build_model_report(inp, Settings(gpu_hour_price=2.0), FLAGS)
    w = _get(rep, "fp8_kv")
    assert w.replicas_removed is None and w.monthly_gpu_hours_saved is None
    assert w.monthly_saving is None and w.gpu_hours_per_mtok_after is None
    assert any("cannot be computed" in n for n in w.notes)
    assert w.autoscaled is not None and w.autoscaled.share == pytest.approx(0.5)
    line = next(x for x in _lines(rep) if x.startswith("FP8 KV cache"))
    assert "fixed fleet: not computable" in line and "autoscaled" in line


@pytest.mark.parametrize(("replicas", "removed"), [(1, 0), (4, 0), (20, 1), (100, 8)])
def test_compute_bound_fleet_removes_whole_replicas(replicas: int, removed: int) -> None:
    inp = _inputs("compute_bound", _window(sinks=0))
    inp.replicas = replicas
    inp.mean_replicas = float(replicas)  # every replica ran all month
    rep = build_model_report(inp, Settings(gpu_hour_price=None), FLAGS)
    w = _get(rep, "window")
    # prefill: 0.3 of time x 0.2 share x 0.3 FLOP saving; decode: 0.7 x 0.4 x 0.25 KV saving
    t = 0.3 * 0.2 * 0.3 + 0.7 * 0.4 * 0.25  # 8.8%: removed = M - ceil(M x (1 - t))
    assert w.time_saving == pytest.approx(t)
    assert w.replicas_removed == removed == replicas - math.ceil(replicas * (1 - t))
    assert w.monthly_gpu_hours_saved == pytest.approx(2 * replicas * 730 * removed / replicas)
    assert w.autoscaled is not None
    assert w.autoscaled.monthly_gpu_hours_saved == pytest.approx(2 * replicas * 730 * t)
    assert w.autoscaled.gpu_hours_per_mtok_after == pytest.approx(
        rep.money.gpu_hours_per_mtok * (1 - t))
    assert w.monthly_saving is None and rep.money.cost_per_mtok is None


def test_one_replica_with_a_13_percent_time_saving_removes_none() -> None:
    inp = _inputs("compute_bound")
    inp.replicas = 1
    inp.time = TimeBreakdown(attention_share={"decode": 0.26}, model_time_s={"decode": 1.0})
    w = _get(build_model_report(inp, Settings(), FLAGS), "fp8_kv")  # bf16: s = 0.5
    assert w.time_saving == pytest.approx(0.13)
    assert w.replicas_removed == 0 and w.monthly_gpu_hours_saved == 0.0


def test_fp8_on_a_compute_bound_fleet_says_its_money_is_the_time_saving() -> None:
    rep = build_model_report(_inputs("compute_bound"), Settings(), FLAGS)
    w = _get(rep, "fp8_kv")
    t = 0.7 * 0.4 * 0.5  # decode only: half the KV bytes read
    assert w.time_saving == pytest.approx(t)
    assert w.autoscaled is not None and w.autoscaled.share == pytest.approx(t)  # not s
    assert "saves nothing until memory binds" in w.autoscaled.assumes
    assert any("saves nothing until memory binds" in n and "time saving" in n
               for n in w.notes)


def test_a_per_replica_token_rate_is_multiplied_by_the_replicas() -> None:
    # One server at 172 tok/s, --replicas 8: 1.615 GPU-hours per 1M tokens, not 12.92.
    one = build_model_report(_issue_26_fleet(replicas=8, tokens_per_s=172.0), Settings(),
                             FLAGS)
    assert one.money.gpu_hours_per_mtok == pytest.approx(1 / (172 * 3600) * 1e6)
    assert one.money.gpu_hours_per_mtok == pytest.approx(1.615, abs=5e-4)
    fleet = _issue_26_fleet(replicas=8, tokens_per_s=172.0)
    fleet.traffic.scope = "fleet"  # Prometheus: the rate is already the fleet's
    assert build_model_report(fleet, Settings(), FLAGS).money.gpu_hours_per_mtok == \
        pytest.approx(12.92, abs=5e-3)
    # The KV figures are one server's too: the fleet holds 8 x 95% of 23,296 tokens at the
    # peak: 8 replicas now, 2 after, none removed (out of KV at the peak: preemptions).
    w = _get(one, "fp8_kv")
    assert (w.replicas_now, w.replicas_after, w.replicas_removed) == (8, 2, 0)
    assert w.extra_sequences == pytest.approx(8 * 23_296 / 430 * 3)


def test_window_flags_name_the_windowed_layers_and_sinks_need_a_kernel() -> None:
    rep = build_model_report(_inputs(window=_window(sinks=4)), Settings(), FLAGS)
    w = _get(rep, "window")
    assert len(w.apply.flags) == 1 and w.apply.flags[0].startswith("--hf-overrides '")
    override = json.loads(w.apply.flags[0].split("'")[1])
    assert override == {"sliding_window": 1024, "layer_types": [
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"]}
    assert w.apply.needs_change and "sink" in w.apply.needs_change
    no_sinks = _get(build_model_report(_inputs(window=_window(sinks=0)), Settings(), FLAGS),
                    "window")
    assert no_sinks.apply.needs_change is None and no_sinks.apply.supported


def test_a_family_without_layer_types_needs_a_model_change() -> None:
    flags = FlagChecks(**{**FLAGS.__dict__, "layer_types": False,
                          "layer_types_detail": "models/gpt2.py does not read layer_types"})
    w = _get(build_model_report(_inputs(window=_window(sinks=0)), Settings(), flags),
             "window")
    assert not w.apply.supported
    assert w.apply.needs_change and "model change" in w.apply.needs_change


def test_replay_evidence_sets_confidence() -> None:
    ok = ReplayEvidence(agreement=0.995, mean_kl=0.002, positions=400, safe=True,
                        verdict="safe")
    w = _get(build_model_report(_inputs(window=_window(replay=ok)), Settings(), FLAGS),
             "window")
    assert w.evidence == "replay" and w.confidence == "high"
    assert w.evidence_detail.startswith("99.5% greedy agreement")
    bad = ReplayEvidence(agreement=0.8, mean_kl=0.2, positions=400, safe=False,
                         verdict="not safe")
    rep = build_model_report(_inputs(window=_window(replay=bad)), Settings(), FLAGS)
    w = _get(rep, "window")
    assert w.confidence == "low" and any("do not apply" in n for n in w.notes)
    # Quality before money: listed with its reason, never ranked as a saving.
    assert not w.ranked and "below its target" in w.not_ranked
    assert "window" not in rep.ranking
    assert "window" in build_model_report(_inputs(window=_window(replay=ok)), Settings(),
                                           FLAGS).ranking


def test_max_model_len_saves_nothing_and_says_why() -> None:
    rep = build_model_report(_inputs(), Settings(gpu_hour_price=2.0), FLAGS)
    w = _get(rep, "max_model_len")
    p999 = _interpolated([128.0, 1024.0, 4096.0], [100.0, 4800.0, 100.0, 0.0], 0.999)
    assert p999 is not None
    new = math.ceil(p999 / 256) * 256
    assert w.apply.flags == [f"--max-model-len {new}"]
    assert w.monthly_saving == 0.0 and w.kv_saving == 0.0
    assert "frees no memory" in w.notes[0]
    # Share above `new`, linear inside the (1024, 4096] bucket.
    assert w.inputs["refused_share"] == pytest.approx(100 * (4096 - new) / 3072 / 5000)


def test_fp8_absent_when_already_fp8_and_savings_ranked() -> None:
    rep = build_model_report(_inputs("kv_bound", _window(sinks=0), dtype="fp8_e4m3"),
                             Settings(gpu_hour_price=1.0), FLAGS)
    assert all(w.id != "fp8_kv" for w in rep.what_ifs)
    rep = build_model_report(_headroom(_inputs("kv_bound", _window(sinks=0))),
                             Settings(gpu_hour_price=1.0), FLAGS)
    # Fixed fleet (a shortage at the peak: 0 each), then autoscaled: 50% beats 25%.
    assert rep.ranked_by == "fixed_fleet"
    assert rep.ranking == ["fp8_kv", "window"]
    assert _lines(rep)[0].startswith("FP8 KV cache")
    assert _lines(rep)[1].startswith("0 sinks + window 1024")
    fp32 = build_model_report(_inputs("kv_bound", dtype="float32"), Settings(), FLAGS)
    assert _get(fp32, "fp8_kv").inputs["bytes_per_element"] == 4.0
    auto = build_model_report(_inputs("kv_bound", dtype="auto"), Settings(), FLAGS)
    assert all(w.id != "fp8_kv" for w in auto.what_ifs)


def test_a_kv_saving_that_frees_no_whole_replica_saves_nothing() -> None:
    inp = _headroom(_inputs("kv_bound"))
    inp.replicas = 1  # 30% of its memory held at the peak: 1 replica now, 1 after
    inp.mean_replicas = 1.0
    inp.kv.usage_peak, inp.kv.preemptions = 0.3, 0.0
    w = _get(build_model_report(inp, Settings(gpu_hour_price=2.0), FLAGS), "fp8_kv")
    assert (w.replicas_now, w.replicas_after, w.replicas_removed) == (1, 1, 0)
    assert w.monthly_saving == 0.0 and w.kv_saving == pytest.approx(0.5)


def _ranked_inputs() -> CostInputs:
    # KV-bound, 4 replicas, 150 at peak: FP8 removes 2 (fixed 50%, autoscaled 50%); the
    # window (s = 25%: 4 -> 3) removes 1 (25%); per-head windows (s = 60%: 4 -> 2) remove
    # 2 (50%, autoscaled 60%), an alternative to the window.
    inp = _headroom(_inputs("kv_bound", _window(sinks=0)))
    assert inp.window is not None
    inp.window.head_split = HeadLevelSplit(windowed_kv_heads=3, attention_flop_saving=0.5,
                                           kv_memory_saving=0.6)
    inp.kv.usage_peak, inp.kv.preemptions = 0.9, 0.0  # 3.6 replicas' memory held: 4
    return inp


def test_savings_rank_by_the_fixed_fleet_unless_autoscaled() -> None:
    rep = build_model_report(_ranked_inputs(), Settings(gpu_hour_price=1.0), FLAGS)
    assert rep.ranked_by == "fixed_fleet"
    order = [s.split(":")[0] for s in _lines(rep)]
    # FP8 and per-head windows tie at 2 replicas; the autoscaled figure breaks the tie.
    assert order == ["per-head windows on 3 KV heads", "FP8 KV cache (from bfloat16)",
                     "0 sinks + window 1024 on 2 layers"]
    assert "(2 replicas removed)" in _lines(rep)[0] and "(1 replica removed)" in _lines(rep)[2]
    auto = build_model_report(_ranked_inputs(), Settings(gpu_hour_price=1.0,
                                                         autoscaled=True), FLAGS)
    assert auto.ranked_by == "autoscaled"
    assert _lines(auto)[0].startswith("per-head windows")


def test_a_fixed_zero_ranks_after_the_fixed_savings_and_a_double_zero_is_dropped() -> None:
    inp = _ranked_inputs()
    inp.kv.verdict = "compute_bound"  # compute sizes it: the time savings decide
    inp.replicas = 20  # compute: the window's t removes 1 of 20; FP8's t (14%) removes 2
    rep = build_model_report(inp, Settings(), FLAGS)
    assert [s.split(":")[0] for s in _lines(rep)][:3] == [
        "per-head windows on 3 KV heads", "FP8 KV cache (from bfloat16)",
        "0 sinks + window 1024 on 2 layers"]
    inp.replicas = 1  # nothing whole to remove: every what-if is listed by its autoscaled
    rep = build_model_report(inp, Settings(), FLAGS)
    assert all(_get(rep, i).replicas_removed == 0 for i in ("window", "fp8_kv", "head_split"))
    assert len(_lines(rep)) == 3 and _lines(rep)[0].startswith("per-head windows")
    assert all("max_model_len" not in s for s in _lines(rep))  # 0 and 0: not listed


def test_layer_and_head_windows_are_alternatives_not_summed() -> None:
    rep = build_model_report(_ranked_inputs(), Settings(), FLAGS)
    win, hs = _get(rep, "window"), _get(rep, "head_split")
    assert win.alternative_to == ["head_split"] and hs.alternative_to == ["window"]
    assert all(_get(rep, i).alternative_to == [] for i in ("fp8_kv", "max_model_len"))
    line = next(s for s in _lines(rep) if s.startswith("0 sinks"))
    assert line.endswith("; alternative to per-head windows on 3 KV heads: not additive")
    line = next(s for s in _lines(rep) if s.startswith("per-head"))
    assert "alternative to 0 sinks + window 1024 on 2 layers: not additive" in line


def test_unchecked_family_is_not_called_unsupported() -> None:
    flags = FlagChecks(**{**FLAGS.__dict__, "layer_types": None,
                          "layer_types_detail": "architecture unknown: not checked"})
    w = _get(build_model_report(_inputs(window=_window(sinks=0)), Settings(), flags),
             "window")
    assert w.apply.supported is None and w.apply.needs_change is None
    assert any("not checked" in n for n in w.notes)


def test_fallback_evidence_is_measured_only_when_measured() -> None:
    from attnprof.contracts.report import Fallback

    inp = _inputs()
    inp.time.fallbacks = [
        Fallback(["0"], "TORCH_SDPA", "mask", "pass is_causal", "measured: 2.00x faster"),
        Fallback(["1"], "TORCH_SDPA", "mask", "pass is_causal", "not measured here")]
    ws = [w for w in build_model_report(inp, Settings(), FLAGS).what_ifs if w.id == "fallback"]
    assert [w.evidence for w in ws] == ["measured", "estimated"]


def test_bucketed_p999_rounds_to_its_bucket_edge() -> None:
    inp = _inputs()
    inp.traffic.context.estimated_from_buckets = True
    w = _get(build_model_report(inp, Settings(), FLAGS), "max_model_len")
    # p99.9 lies in (1024, 4096]: the edge 4096 is a multiple of 256; the refused share is
    # then exactly the count above 4096 (none).
    assert w.apply.flags == ["--max-model-len 4096"]
    assert w.inputs["refused_share"] == 0.0


def test_drift_says_stable_or_how_far_it_moved() -> None:
    from attnprof.analyze.cost_inputs import drift

    def dist(p50: float, p99: float) -> ContextDistribution:
        return ContextDistribution(bounds=[], counts=[], p50=p50, p99=p99)

    assert drift(dist(100, 1000), dist(105, 1050)).shift.startswith("stable")
    moved = drift(dist(100, 1000), dist(200, 1000)).shift
    assert moved.startswith("moved") and "+100%" in moved and "+0%" in moved
    assert "not enough" in drift(dist(100, 1000), ContextDistribution([], [])).shift


def test_no_refusal_is_predicted_above_the_longest_context_seen() -> None:
    inp = _inputs()
    inp.traffic.context.max = 2500.0  # nothing observed above 2500; p99.9 -> 4096 cap
    inp.traffic.context.p999 = 2400.0
    inp.traffic.context.estimated_from_buckets = False
    w = _get(build_model_report(inp, Settings(), FLAGS), "max_model_len")
    assert w.inputs["suggested"] == 2560 and w.inputs["refused_share"] == 0.0


def test_a_measured_what_if_takes_its_money_from_the_measurement() -> None:
    from attnprof.analyze.cost import Measured

    inp = _headroom(_inputs("kv_bound", dtype="float32"))
    inp.measured = {"fp8_kv": Measured(time_saving=-0.5, kv_saving=0.5, detail="run",
                                       time_saving_low=-0.6, time_saving_high=-0.4)}
    est = _get(build_model_report(_inputs("kv_bound", dtype="float32"), Settings(), FLAGS),
               "fp8_kv")
    w = _get(build_model_report(inp, Settings(), FLAGS), "fp8_kv")
    assert w.evidence == "measured" and w.evidence_detail == "run"
    assert w.kv_saving == 0.5 and est.kv_saving == pytest.approx(0.75)
    assert w.time_saving == -0.5 and w.banked_time_saving == 0.0  # slower: none counted
    assert (w.time_saving_low, w.time_saving_high) == (-0.6, -0.4)
    assert any("measured slower" in n for n in w.notes)
    assert w.autoscaled is not None and w.autoscaled.share == pytest.approx(0.5)
