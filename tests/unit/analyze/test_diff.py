"""attnprof diff's pieces without a model: the two-sample statistics, thresholds, the
comparison of typed snapshots, the record window, provenance and the renderers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from attnprof.analyze.diff import Incomparable, compare
from attnprof.analyze.diff_thresholds import parse_fail_on
from attnprof.analyze.twosample import distribution_distance, mann_whitney, ratio_test
from attnprof.analyze.window import window_between
from attnprof.contracts.diff import DiffReport
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance
from attnprof.contracts.snapshot import (
    ContextHistogram,
    LayerProfile,
    PhaseStats,
    QuantileSummary,
    RequestStats,
    SamplerStats,
    Snapshot,
    StepPhaseStats,
    WorkerSnapshot,
)
from attnprof.exporters.diff_report import render_markdown, render_text
from attnprof.facts.layers import format_layers, format_sites
from attnprof.tools.provenance import model_identity, redact_argv


# ----- statistics -----
def test_mann_whitney_matches_a_hand_computed_case() -> None:
    # b entirely above a (n=5 each): U_b = 25; normal approximation with continuity
    # correction: z = (25 - 12.5 - 0.5) / sqrt(5*5*11/12) = 2.5067 -> p = 0.01219.
    u, p = mann_whitney([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert u == 25
    assert p == pytest.approx(0.01219, abs=2e-4)
    u, p = mann_whitney([1, 2, 3], [1, 2, 3])
    assert p == 1.0
    assert mann_whitney([], [1.0]) == (0.0, 1.0)


@pytest.mark.slow
def test_ratio_test_recovers_the_ratio_and_its_interval_covers_it() -> None:
    rng = random.Random(7)
    covered = 0
    for trial in range(60):
        base = [rng.lognormvariate(0, 0.2) for _ in range(40)]
        new = [1.3 * rng.lognormvariate(0, 0.2) for _ in range(40)]
        t = ratio_test(base, new, resamples=400, seed=trial)
        assert t is not None
        covered += t.low <= 1.3 <= t.high
    # A 95% percentile interval: most trials cover the true ratio (loose bound, 60 trials).
    assert covered >= 48
    t = ratio_test([1.0] * 10, [2.0] * 10)
    assert t is not None and t.ratio == 2.0 and t.p_value < 1e-3
    assert ratio_test([], [1.0]) is None


def test_distribution_distance_is_zero_for_equal_and_one_octave_for_a_doubling() -> None:
    bounds = [128, 256, 512, 1024]
    assert distribution_distance(bounds, [0, 5, 5, 0, 0], [0, 10, 10, 0, 0]) == (0.0, 0.0)
    ks, w1 = distribution_distance(bounds, [0, 10, 0, 0, 0], [0, 0, 10, 0, 0]) or (0, 0)
    assert ks == 1.0 and w1 == pytest.approx(1.0)
    assert distribution_distance(bounds, [0] * 5, [1] * 5) is None
    assert distribution_distance(bounds, [1, 2], [1, 2]) is None


def test_fail_on_parses_percentages_off_and_refuses_unknown_keys() -> None:
    th = parse_fail_on("fused-drop=5%,time=0.2,oom=off,kernel=on,context-shift=0.3")
    assert th["fused-drop"] == pytest.approx(0.05) and th["time"] == 0.2
    assert th["oom"] is None and th["kernel"] == 1.0 and th["context-shift"] == 0.3
    assert parse_fail_on("kernel=off")["kernel"] is None
    assert parse_fail_on("kernel=0")["kernel"] is None  # 0 reads as off, not "on at 0"
    for bad, word in (("speed=5%", "unknown check"), ("time", "needs a value"),
                      ("time=fast", "not a number"), ("time=-1", "between 0 and 1000"),
                      ("time=nan", "between"), ("time=10", "ambiguous: write time=10%"),
                      ("kernel=5%", "kernel=on or kernel=off")):
        with pytest.raises(ValueError, match=word):
            parse_fail_on(bad)


def test_format_layers_groups_consecutive_runs() -> None:
    assert format_layers([12, 13, 14, 15, 16]) == "layers 12-16"
    assert format_layers([3]) == "layer 3"
    assert format_layers([5, 0, 1, 2, 9]) == "layers 0-2, 5, 9"


# ----- comparing snapshots -----
def _prov(config: str = "c1", rev: str = "a" * 40, dtype_tag: str = "x") -> Provenance:
    return Provenance(attnprof="0.1", python="3.11", torch="2.13", transformers=None,
                      vllm="0.32", hardware=Hardware(type="cpu", cpu_isa="AVX512"),
                      model=ModelIdentity(name="m", config_sha256=config),
                      command=["vllm", "serve", dtype_tag])


def _layer(i: int, kernel: str, dtype: str, times: list[float], calls: int = 100,
           fused: bool = True) -> LayerProfile:
    return LayerProfile(
        name=f"model.layers.{i}.self_attn.attn", index=i, backend="CPU_ATTN", impl="CPUAttn",
        num_heads=4, num_kv_heads=2, head_size=64, head_size_v=64, sliding_window=None,
        dtype=dtype, kv_cache_dtype="auto", fused=fused, kv_cache_bytes=1 << 20,
        kernel=kernel,
        phases={"decode": PhaseStats(calls=calls, time_s=sum(times) * calls / len(times),
                                     recent_time_s=times)})


def _snap(kernel: str = "k[amx]", dtype: str = "bfloat16", slow: float = 1.0,
          config: str = "c1", seed: int = 0, hist: list[int] | None = None,
          layers: int = 4, t: float = 100.0) -> Snapshot:
    rng = random.Random(seed)
    lays = [_layer(i, kernel, dtype, [slow * 1e-4 * rng.uniform(0.9, 1.1) for _ in range(64)])
            for i in range(layers)]
    w = WorkerSnapshot(pid=10, process="w0", layers=lays,
                       steps={"decode": StepPhaseStats(steps=100, model_time_s=1.0,
                                                       attention_time_s=0.04 * slow,
                                                       attention_share=0.04 * slow)},
                       sampler=SamplerStats(seen=100, sampled=100))
    bounds = [128.0, 256.0, 512.0]
    req = RequestStats(requests=sum(hist or [0]), max_model_len=512,
                       context_tokens=QuantileSummary(), prompt_tokens=QuantileSummary(),
                       generation_tokens=QuantileSummary(),
                       context_histogram=ContextHistogram(bounds=bounds,
                                                          counts=hist or [0, 0, 0, 0]))
    return Snapshot(time=t, model="m", enabled=True, workers=[w], requests=req,
                    provenance=_prov(config, dtype_tag=dtype))


def _diff(a: Snapshot, b: Snapshot, **kw: object) -> DiffReport:
    return compare(a, b, base_name="a.json", new_name="b.json", **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_snapshot_kernel_downgrade_names_the_layers_and_the_input_that_changed() -> None:
    rep = _diff(_snap(), _snap(kernel="k[vec]", dtype="float32", seed=1))
    kern = [f for f in rep.findings if f.kind == "kernel"]
    assert len(kern) == 1 and kern[0].severity == "regression"
    assert kern[0].title == "layers 0-3: k[amx] -> k[vec]: dtype bfloat16 -> float32"
    assert rep.regression
    assert any(c.field == "command" for c in rep.changes)
    md = render_markdown(rep)
    assert "| kernel | layers 0-3: k[amx] -> k[vec]: dtype bfloat16 -> float32 |" in md
    assert md.startswith("### attnprof diff: REGRESSION")
    # The reverse is an improvement, not a regression.
    back = _diff(_snap(kernel="k[vec]", dtype="float32"), _snap())
    assert not back.regression
    assert [f.severity for f in back.findings if f.kind == "kernel"] == ["improvement"]


@pytest.mark.slow
def test_noise_alone_is_not_a_regression_and_a_real_slowdown_is() -> None:
    for seed in range(10):
        rep = _diff(_snap(seed=seed), _snap(seed=seed + 100))
        assert not rep.regression, render_text(rep)
    slow = _diff(_snap(), _snap(slow=1.5, seed=3))
    reg = [f for f in slow.findings if f.severity == "regression"]
    assert {f.kind for f in reg} >= {"attention_time", "layer_time"}
    total = next(f for f in reg if f.kind == "attention_time")
    assert total.evidence["ci_low"] > 1.1 and total.evidence["p_value"] < 0.01
    assert 1.3 < total.evidence["ratio"] < 1.7
    # The Markdown says it once for the layers, not once per layer.
    md = render_markdown(slow)
    assert md.count("attention time +") == 1 and "| time | layers 0-3: attention time +" in md
    # --fail-on time=off: the slowdown stays a reported finding, not a failure.
    off = _diff(_snap(), _snap(slow=1.5, seed=3),
                thresholds={"time": None, "share": None})
    assert not off.regression


@pytest.mark.slow
def test_a_busy_machine_slowing_everything_does_not_trip_the_time_check() -> None:
    base, new = _snap(), _snap(slow=2.0, seed=5)
    # Everything, not only attention, took twice as long in NEW.
    new.workers[0].steps["decode"].model_time_s *= 2.0
    rep = _diff(base, new)
    assert not any(f.severity == "regression" and f.kind.endswith("time")
                   for f in rep.findings), render_text(rep)
    assert any("2.00x as long" in n for n in rep.notes)


@pytest.mark.slow
def test_two_models_are_incomparable_unless_allowed() -> None:
    with pytest.raises(Incomparable, match="different models"):
        _diff(_snap(), _snap(config="c2"))
    rep = _diff(_snap(), _snap(config="c2"), allow_model_change=True)
    assert any("different models" in n for n in rep.notes)
    assert any(c.field == "model.config_sha256" for c in rep.changes)


def test_a_file_without_provenance_compares_by_label_and_attention_shape() -> None:
    old = _snap()
    old.provenance = None  # a snapshot from before 1.5
    assert not _diff(old, _snap(seed=1)).regression
    other = _snap(seed=1)
    other.model = "another"
    with pytest.raises(Incomparable):
        _diff(old, other)


@pytest.mark.slow
def test_context_shift_is_measured_and_fails_only_when_asked() -> None:
    a, b = _snap(hist=[10, 0, 0, 0]), _snap(hist=[0, 0, 10, 0], seed=1)
    rep = _diff(a, b)
    f = next(x for x in rep.findings if x.kind == "context_shift")
    assert f.evidence["ks"] == 1.0 and f.evidence["wasserstein_octaves"] == pytest.approx(2.0)
    assert f.severity == "info"
    assert _diff(a, b, thresholds={"context-shift": 0.5}).regression


def test_a_histogram_without_buckets_is_not_compared_and_does_not_crash() -> None:
    a, b = _snap(hist=[5]), _snap(hist=[5], seed=1)
    for s in (a, b):
        assert s.requests is not None and s.requests.context_histogram is not None
        s.requests.context_histogram.bounds = []
    rep = _diff(a, b)
    assert not any(f.kind == "context_shift" for f in rep.findings)


def test_too_few_calls_per_layer_are_said_not_silently_passed() -> None:
    a, b = _snap(), _snap(slow=3.0, seed=1)
    for s in (a, b):
        for lay in s.workers[0].layers:
            lay.phases["decode"].recent_time_s = lay.phases["decode"].recent_time_s[:4]
    rep = _diff(a, b)
    assert any("fewer than 6 calls per side" in n for n in rep.notes)
    # Per forward, the four layers' calls sum into 4 totals per side: not enough either.
    assert not any(f.kind == "layer_time" and f.severity == "regression"
                   for f in rep.findings)


def test_report_round_trips_through_its_contract() -> None:
    rep = _diff(_snap(), _snap(kernel="k[vec]", dtype="float32", seed=1))
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["schema_version"] == "attnprof.diff/1.0"
    assert DiffReport.from_json(doc) == rep


# ----- record windows -----
def test_a_record_window_holds_only_what_happened_inside_it() -> None:
    start = _snap(hist=[3, 1, 0, 0], t=100.0)
    end = _snap(hist=[5, 4, 1, 0], t=160.0)
    for lay in end.workers[0].layers:
        lay.phases["decode"].calls = 250
        lay.phases["decode"].time_s = 0.05
    for lay in start.workers[0].layers:
        lay.phases["decode"].time_s = 0.02
    end.workers[0].steps["decode"] = StepPhaseStats(steps=250, model_time_s=2.5,
                                                    attention_time_s=0.2,
                                                    attention_share=0.08)
    end.workers[0].sampler = SamplerStats(seen=300, sampled=250)
    w = window_between(start, end)
    assert w.window is not None and w.window.duration_s == 60.0
    assert w.window.requests == 6 and w.requests is not None and w.requests.requests == 6
    assert w.requests.context_histogram is not None
    assert w.requests.context_histogram.counts == [2, 3, 1, 0]
    # Window quantiles are the upper bounds of the buckets holding them (6 requests).
    q = w.requests.context_tokens
    assert (q.p50, q.p90, q.p99, q.count, q.exact) == (256.0, 512.0, 512.0, 6, False)
    ph = w.workers[0].layers[0].phases["decode"]
    assert ph.calls == 150 and ph.time_s == pytest.approx(0.03)
    assert ph.mean_time_s == pytest.approx(0.0002)
    st = w.workers[0].steps["decode"]
    assert st.steps == 150 and st.model_time_s == pytest.approx(1.5)
    assert st.attention_share == pytest.approx((0.2 - 0.04) / 1.5)
    assert w.workers[0].sampler.sampled == 150 and w.workers[0].sampler.seen == 200
    # Only the window's own calls are kept for the time test (the ring holds 64).
    assert len(ph.recent_time_s) == 64
    end.workers[0].layers[0].phases["decode"].calls = 103
    assert len(window_between(start, end).workers[0].layers[0].phases["decode"]
               .recent_time_s) == 3
    end.workers[0].layers[0].phases["decode"].calls = 250
    # A worker that restarted (another pid, or the same pid with counters that went down)
    # counts from its own start; so does an API server whose request count went down.
    end.workers[0].pid = 11
    assert window_between(start, end).workers[0].layers[0].phases["decode"].calls == 250
    end.workers[0].pid = 10
    end.workers[0].sampler = SamplerStats(seen=40, sampled=40)
    again = window_between(start, end)
    assert again.workers[0].layers[0].phases["decode"].calls == 250
    assert again.window is not None and "1 worker(s) started" in again.window.note
    end.requests = _snap(hist=[1, 0, 0, 0]).requests
    assert window_between(start, end).requests.requests == 1  # type: ignore[union-attr]


def test_a_record_window_subtracts_token_sums() -> None:
    start, end = _snap(hist=[3, 1, 0, 0], t=100.0), _snap(hist=[5, 4, 1, 0], t=160.0)
    assert start.requests is not None and end.requests is not None
    start.requests.prompt_tokens = QuantileSummary(mean=100.0, count=4, p50=90.0)
    end.requests.prompt_tokens = QuantileSummary(mean=160.0, count=10, p50=150.0)
    w = window_between(start, end)
    assert w.requests is not None
    pt = w.requests.prompt_tokens
    # (160 x 10 - 100 x 4) / 6 = 200 per request in the window; quantiles stay the end's.
    assert (pt.count, pt.mean, pt.p50) == (6, pytest.approx(200.0), 150.0)


# ----- provenance -----
def test_secrets_on_the_command_line_are_redacted() -> None:
    argv = ["vllm", "serve", "m", "--api-key", "S3CRET", "--hf-token=T0K", "--port", "8000",
            "--url", "http://user:pw@host:9090/x", "--Authorization", "Bearer x",
            "--otlp", "http://h/v1?api_key=Q1&b=2", "OPENAI_API_KEY=sk-9",
            "--max-num-batched-tokens", "8192", "--skip-tokenizer-init", "Qwen/Qwen3-8B",
            "--tokenizer", "tok/x"]
    out = redact_argv(argv)
    joined = " ".join(out)
    for secret in ("S3CRET", "T0K", "pw@", "Bearer x", "Q1", "sk-9"):
        assert secret not in joined
    # Settings that merely contain "token" stay: they are what a diff should show.
    for kept in ("8192", "Qwen/Qwen3-8B", "tok/x", "b=2", "8000"):
        assert kept in joined, kept
    assert out[:3] == ["vllm", "serve", "m"]


def test_model_identity_hashes_follow_the_config_and_the_tensor_layout(tmp_path: Path
                                                                       ) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"b": 1, "a": 2}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    one = model_identity("m", d)
    assert one.weights_source == "safetensors-headers" and one.config_sha256
    (d / "config.json").write_text(json.dumps({"a": 2, "b": 1}))  # same content, reordered
    assert model_identity("m", d).config_sha256 == one.config_sha256
    (d / "config.json").write_text(json.dumps({"a": 3, "b": 1}))
    assert model_identity("m", d).config_sha256 != one.config_sha256
    header2 = header.replace(b"[2]", b"[3]")
    (d / "model.safetensors").write_bytes(len(header2).to_bytes(8, "little") + header2)
    assert model_identity("m", d).weights_sha256 != one.weights_sha256
    assert model_identity("m", tmp_path / "missing").config_sha256 is None


def test_renderers_lead_with_the_verdict() -> None:
    same = _diff(_snap(), _snap())
    assert render_text(same).startswith("attnprof diff: no regression")
    assert render_markdown(same).startswith("### attnprof diff: no regression")


# ----- encoder-decoder sites -----
_SITES = [("encoder", "self"), ("decoder", "cross"), ("decoder", "self")]
"""BART-like: every stack numbers its layers from 0, so all three sites are layer 0 (the
cross row sits between the others: a diff keyed by index alone keeps the last)."""


def _enc_dec_profile(cross_kernel: str = "flash_cpu", cross_slow: float = 1.0,
                     seed: int = 0) -> ProfileReport:
    import copy

    from tests.unit.contracts.test_contracts import PROFILE_1_0

    rng = random.Random(seed)
    doc = copy.deepcopy(PROFILE_1_0)
    doc.pop("window_advice")
    base_layer = doc["layers"][0]
    layers, rows = [], []
    for stack, kind in _SITES:
        slow = cross_slow if kind == "cross" else 1.0
        lay = copy.deepcopy(base_layer)
        lay.update(stack=stack, kind=kind, sliding_window=None, layer_type=None)
        lay["timing"]["samples_s_by_seq_len"] = {
            "32": [slow * 4e-4 * rng.uniform(0.95, 1.05) for _ in range(12)]}
        layers.append(lay)
        row = copy.deepcopy(doc["activation_map"][0])
        kernel = cross_kernel if kind == "cross" else "flash_cpu"
        row.update(stack=stack, kind=kind, impl="sdpa", kernel=kernel,
                   fused=kernel == "flash_cpu", reasons=[] if kernel == "flash_cpu" else
                   row["reasons"])
        rows.append(row)
    doc["layers"], doc["activation_map"] = layers, rows
    return ProfileReport.from_json(doc)


def test_diff_keeps_encoder_decoder_and_cross_layers_apart() -> None:
    """Only decoder.L0.cross changes kernel and slows down: the diff names exactly that site,
    not "layer 0" (which encoder.L0 and decoder.L0 share), and tests each site's time."""
    base = _enc_dec_profile(seed=1)
    new = _enc_dec_profile(cross_kernel="math", cross_slow=2.0, seed=2)
    rep = compare(base, new)
    kern = [f for f in rep.findings if f.kind == "kernel"]
    assert len(kern) == 1
    assert kern[0].sites == ["decoder.L0.cross"] and kern[0].layers == [0]
    assert kern[0].title.startswith("decoder.L0.cross: flash_cpu -> math (fallback)")
    assert kern[0].severity == "regression"
    times = {f.sites[0]: f for f in rep.findings if f.kind == "layer_time"}
    assert set(times) == {"encoder.L0", "decoder.L0", "decoder.L0.cross"}
    assert times["decoder.L0.cross"].severity == "regression"
    assert times["decoder.L0.cross"].title.startswith("decoder.L0.cross: +")
    assert times["encoder.L0"].severity == times["decoder.L0"].severity == "info"
    assert "decoder.L0.cross" in render_text(rep)
    # Unchanged: nothing to report, and no site compared against another.
    same = compare(base, _enc_dec_profile(seed=3))
    assert not [f for f in same.findings if f.kind == "kernel"] and not same.regression


def test_format_sites_ranges_plain_layers_and_names_the_rest() -> None:
    assert format_sites(["L0", "L1", "L2", "L5"]) == "layers 0-2, 5"
    assert format_sites(["L3"]) == "layer 3"
    assert format_sites(["encoder.L0", "decoder.L0", "decoder.L0.cross"]) == \
        "encoder.L0, decoder.L0, decoder.L0.cross"
    assert format_sites(["L1", "L1.cross", "L2"]) == "layers 1-2, L1.cross"
    assert format_sites([]) == "no layers"
