"""Cost model: closed forms vs brute force, the notes' worked example, input parsers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from attnprof.aggregate.quantiles import QuantileSketch
from attnprof.analyze.sparsity.inputs import (
    InputError,
    from_buckets,
    from_prometheus_response,
    from_snapshot,
    parse_lengths_text,
)
from attnprof.analyze.sparsity.recommend import evaluate, format_summary, recommend
from attnprof.analyze.sparsity.savings import LengthDistribution, pairs_window
from attnprof.facts.shape import AttentionShape


def keys_seen(i: int, w: int | None, s: int) -> int:
    """Brute force: count keys j <= i that the mask keeps (HF: kv_idx > i - w, plus j < s)."""
    if w is None:
        return i + 1
    return sum(1 for j in range(i + 1) if j < s or j > i - w)


def brute(lengths: list[int], weights: list[float], arch: AttentionShape, w: int, s: int,
          layers: set[int]) -> tuple[float, float, float]:
    """Per request, per layer, per query: FLOP and KV sums, then ratios of the sums."""
    fl_full = fl_win = kv_full = kv_win = 0.0
    exact = 0.0
    for t, wt in zip(lengths, weights, strict=True):
        exact += wt * (t <= w + s)
        for layer in range(arch.num_layers):
            nat = arch.window(layer)
            base = sum(keys_seen(i, nat, 0) for i in range(t))
            kvb = t if nat is None else min(t, nat)
            if layer in layers:
                win = min(base, sum(keys_seen(i, w, s) for i in range(t)))
                kvw = min(kvb, min(t, w + s))
            else:
                win, kvw = base, kvb
            fl_full += wt * base
            fl_win += wt * win
            kv_full += wt * kvb
            kv_win += wt * kvw
    return 1 - fl_win / fl_full, 1 - kv_win / kv_full, exact / sum(weights)


def test_closed_form_pairs_match_brute_force() -> None:
    for t in (1, 2, 5, 17, 40):
        for w in (1, 3, 8, 40):
            for s in (0, 1, 4, 9):
                want = sum(keys_seen(i, w, s) for i in range(t))
                assert pairs_window(t, w, s) == want, (t, w, s)


def test_savings_equal_brute_force_sum_over_requests() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(1, 90) for _ in range(40)]
    weights = [rng.choice([1.0, 2.0, 0.5]) for _ in lengths]
    # hybrid: layers 1 and 3 have a native window of 24
    arch = AttentionShape(4, 4, 2, 8, layer_windows=(None, 24, None, 24))
    dist = LengthDistribution.from_lengths(lengths, weights=weights)
    for w, s, layers in ((16, 4, {0, 2}), (8, 0, {0, 1, 2, 3}), (30, 2, {2})):
        ev = evaluate(dist, arch, w, s, layers=layers).to_json()
        fl, kv, ex = brute(lengths, weights, arch, w, s, layers)
        assert ev["attention_flop_saving"] == pytest.approx(fl, abs=1e-6)
        assert ev["kv_memory_saving"] == pytest.approx(kv, abs=1e-6)
        assert ev["exact_request_fraction"] == pytest.approx(ex, abs=1e-6)


def test_notes_worked_example() -> None:
    """sparsity.md section 2: Llama-3.1-8B shape, 80/15/5 traffic, w=2048, s=4."""
    arch = AttentionShape(32, 32, 8, 128, n_params=7e9)
    dist = LengthDistribution.from_lengths([1000, 8000, 32000], weights=[80, 15, 5])
    ev = evaluate(dist, arch, 2048, 4).to_json()
    assert ev["exact_request_fraction"] == pytest.approx(0.80)
    assert round(ev["attention_flop_saving"], 3) == 0.814
    assert round(ev["naive_mean_request_saving"], 3) == 0.127
    assert round(ev["attention_flop_share"], 3) == 0.243
    assert round(ev["end_to_end_flop_saving"], 3) == 0.198
    kv = ev["kv_bytes_per_request"]
    assert kv["full"] / 2**20 == pytest.approx(450.0)
    assert round(kv["windowed"] / 2**20) == 151
    assert round(ev["kv_memory_saving"], 2) == 0.66


def test_recommend_without_stats_keeps_min_exact_and_pareto_is_monotone() -> None:
    arch = AttentionShape(2, 4, 2, 16)
    dist = LengthDistribution.from_lengths([100] * 50 + [300] * 45 + [5000] * 5)
    rec = recommend(dist, arch, min_exact=0.9).to_json()
    assert rec["exact_request_fraction"] >= 0.9
    smaller = [e for e in rec["pareto"] if e["window"] < rec["window"]]
    assert all(e["exact_request_fraction"] < 0.9 for e in smaller)
    savings = [e["attention_flop_saving"] for e in rec["pareto"]]
    assert savings == sorted(savings, reverse=True)
    line = format_summary(rec)
    assert "P50/P90/P99 = 100/300/5000" in line and "not validated" in line


def test_native_windows_report_never_binds_and_global_share() -> None:
    # 5 local : 1 global, window 1024, every request 32768 tokens: notes say 86.5%
    arch = AttentionShape(6, 8, 4, 64, layer_windows=(1024, 1024, 1024, 1024, 1024, None))
    rec = recommend(LengthDistribution.from_lengths([32768]), arch).to_json()
    nw = rec["native_windows"]
    assert round(nw["global_kv_share"], 3) == 0.865
    assert nw["sliding"][0]["never_binds"] is False
    assert any("global layers hold 86%" in a for a in rec["advice"])
    assert any("dynamic sparse prefill" not in a for a in rec["advice"])
    short = recommend(LengthDistribution.from_lengths([500, 900]), arch).to_json()
    assert short["native_windows"]["sliding"][0]["never_binds"] is True
    assert any("never binds" in a for a in short["advice"])
    long = recommend(LengthDistribution.from_lengths([1000] * 9 + [40000]), arch).to_json()
    assert any("10.0% of requests" in a and "dynamic sparse" in a for a in long["advice"])
    all_sliding = AttentionShape(2, 4, 2, 16, layer_windows=(64, 64))
    rec = recommend(LengthDistribution.from_lengths([10, 500]), all_sliding).to_json()
    assert rec["layers"] == [] and "every layer already slides" in format_summary(rec)


def test_shape_from_configs() -> None:
    llama = AttentionShape.from_config({"num_hidden_layers": 30, "num_attention_heads": 9,
                              "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576,
                              "dtype": "float32"})
    assert (llama.num_layers, llama.kv_bytes_per_token_layer, llama.hybrid) == (30, 1536, False)
    mistral = AttentionShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_size": 256, "sliding_window": 4096})
    assert mistral.layer_windows == (4096, 4096)
    gemma = AttentionShape.from_config({"num_hidden_layers": 3, "num_attention_heads": 4,
                              "hidden_size": 256, "sliding_window": 512,
                              "layer_types": ["sliding_attention", "sliding_attention",
                                              "full_attention"]})
    assert gemma.layer_windows == (512, 512, None) and gemma.full_layers == [2]
    qwen = AttentionShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                             "hidden_size": 256, "sliding_window": 4096,
                             "use_sliding_window": False})
    assert not qwen.hybrid


def test_parse_lengths_formats() -> None:
    a = parse_lengths_text("10\n20\n\n20\n", "f")
    assert a.lengths == (10, 20) and a.weights == (1.0, 2.0)
    assert parse_lengths_text("[10, 20, 20]", "f").weights == (1.0, 2.0)
    assert parse_lengths_text('{"lengths": [5]}', "f").lengths == (5,)
    c = parse_lengths_text("length,count\n10,3\n30,1\n", "f")
    assert c.weights == (3.0, 1.0)
    h = parse_lengths_text("le,count\n100,4\n1000,10\n+Inf,10\n", "f")
    assert h.total_weight == pytest.approx(10) and not h.exact
    assert h.fraction_at_most(100) == pytest.approx(0.4)
    for bad in ("", "abc\n", "[1, -2]", "[]", "{bad json", "12.5\n", '{"x": 1}'):
        with pytest.raises(InputError):
            parse_lengths_text(bad, "f")


def test_prometheus_response_real_format() -> None:
    # Shape of GET /api/v1/query?query=sum by (le) (attnprof_request_context_tokens_bucket)
    body = json.loads("""{"status":"success","data":{"resultType":"vector","result":[
      {"metric":{"le":"100"},"value":[1733140000.123,"6"]},
      {"metric":{"le":"+Inf"},"value":[1733140000.123,"10"]},
      {"metric":{"le":"1000"},"value":[1733140000.123,"9"]},
      {"metric":{"le":"10"},"value":[1733140000.123,"0"]}]}}""")
    d = from_prometheus_response(body)
    assert d.total_weight == pytest.approx(10)
    assert d.fraction_at_most(100) == pytest.approx(0.6)
    assert d.fraction_at_most(1000) == pytest.approx(0.9)
    assert max(d.lengths) == 1001  # +Inf bucket: just above the last finite edge
    with pytest.raises(InputError, match="no attnprof_request_context_tokens_bucket"):
        from_prometheus_response({"status": "success",
                                  "data": {"resultType": "vector", "result": []}})
    with pytest.raises(InputError, match="query failed: parse error"):
        from_prometheus_response({"status": "error", "errorType": "bad_data",
                                  "error": "parse error"})
    with pytest.raises(InputError, match="not cumulative"):
        from_buckets([(10, 5), (20, 3)])


def test_snapshot_sketch_to_distribution() -> None:
    sk = QuantileSketch()
    lengths = [50] * 30 + [700] * 60 + [3000] * 10
    for x in lengths:
        sk.add(x)
    snap = {"schema_version": "attnprof.snapshot/1",
            "requests": {"context_tokens": {**sk.summary(), "sketch": sk.to_dict()}}}
    d = from_snapshot(json.loads(json.dumps(snap)))
    assert d.total_weight == 100
    for q, want in ((0.2, 50), (0.5, 700), (0.95, 3000)):
        assert abs(d.quantile(q) - want) <= 0.01 * want + 1
    arch = AttentionShape(4, 4, 2, 16)
    exact = evaluate(LengthDistribution.from_lengths(lengths), arch, 256, 4)
    approx = evaluate(d, arch, 256, 4)
    assert approx.attention_flop_saving == pytest.approx(exact.attention_flop_saving,
                                                            abs=0.01)
    with pytest.raises(InputError, match="no finished requests"):
        from_snapshot({"schema_version": "attnprof.snapshot/1", "requests": None})
    empty = QuantileSketch().to_dict()
    with pytest.raises(InputError, match="empty"):
        from_snapshot({"requests": {"context_tokens": {"sketch": empty}}})


def test_distribution_rejects_empty() -> None:
    with pytest.raises(ValueError):
        LengthDistribution.from_lengths([])
    assert np.isclose(LengthDistribution.from_lengths([3, 3]).total_weight, 2)
