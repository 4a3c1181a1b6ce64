"""Per-head memory: analytic KV bytes vs the real cache, analytic vs measured attention peaks,
fits and OOM inversion."""

from __future__ import annotations

import pytest
import torch

from attnprof.analyze import memory, scaling
from attnprof.tools import memory_measure, scaling_bench


def test_kv_bytes_per_token_formula() -> None:
    kv = memory.kv_bytes_per_token(3, 64, "float32", num_heads=9)
    assert kv == {"per_layer": 2 * 3 * 64 * 4, "per_kv_head": 2 * 64 * 4,
                  "per_query_head": 2 * 3 * 64 * 4 / 9}
    assert memory.kv_bytes_per_token(2, 32, torch.bfloat16)["per_layer"] == 256


@pytest.mark.slow
@pytest.mark.parametrize(("family", "extra"), [("llama", {}), ("qwen2", {})])
def test_analytic_kv_equals_real_cache(family: str, extra: dict[str, int]) -> None:
    import transformers as tf

    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)
    model = model_cls(cfg).eval().to(torch.bfloat16)
    B, L = 2, 40
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 100, (B, L)), use_cache=True)
    per = memory.kv_bytes_per_token(2, 16, torch.bfloat16)["per_layer"]
    assert memory_measure.cache_bytes(out.past_key_values) == per * B * L * 3


@pytest.mark.slow
@pytest.mark.parametrize("path", ["flash_cpu", "math", "eager"])
@pytest.mark.parametrize("length", [512, 1024])
def test_analytic_peak_within_10_percent_fp32(path: str, length: int) -> None:
    shape = memory.AttnShape(1, 9, 3, length, length, 64, 64, "float32")
    measured = scaling_bench.bench_path(path, 1, 9, 3, length, 64, "float32", repeats=1)
    modeled = memory.analytic_attention_peak(shape, path,
                                            threads=torch.get_num_threads())["total"]
    assert memory.rel_err(modeled, measured["peak_bytes"]) < 0.10, (modeled, measured)


@pytest.mark.slow
def test_unfused_paths_hold_the_score_matrix() -> None:
    # Doubling L quadruples the math path's peak; the fused one grows at most linearly.
    def peak(path: str, length: int) -> float:
        got = scaling_bench.bench_path(path, 1, 4, 4, length, 64, "float32", repeats=1)
        return got["peak_bytes"]

    assert peak("math", 1024) / peak("math", 512) > 3.5
    assert peak("flash_cpu", 2048) / peak("flash_cpu", 1024) < 2.1  # tiles: same q split


@pytest.mark.slow
def test_measure_peak_sees_a_known_allocation() -> None:
    _, peak = memory_measure.measure_peak(lambda: torch.empty(1 << 20, dtype=torch.uint8).sum())
    assert peak >= 1 << 20


def test_fit_and_predict() -> None:
    xs = [512, 1024, 2048, 4096]
    ys = [100 + 3 * x + 0.5 * x * x for x in xs]
    fit = scaling.fit_poly2(xs, ys)
    assert fit["c"] == pytest.approx(0.5, rel=1e-6) and fit["r2"] > 0.999
    budget = 100 + 3 * 5000 + 0.5 * 5000**2
    assert scaling.predict_max(fit, budget) == 5000
    assert scaling.predict_max(fit, 50) == 0
    # Non-negative terms even on noisy, decreasing data.
    noisy = scaling.fit_poly2([64, 128, 256], [0.48, 0.2, 0.38])
    assert noisy["b"] >= 0 and noisy["c"] >= 0
