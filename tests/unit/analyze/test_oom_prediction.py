"""OOM predictions the analytic memory model allows (issue 13, item 5).

Short-length fits on every attention path never predict past the analytic bound; the headline
prediction is for the path the model ran; every prediction carries its extrapolation factor and
a confidence, and says "extrapolation" beyond the documented factor. Everything here is real:
measured micro-benchmarks, the real analytic model, and a random-weight model with SmolLM2's
attention shape (30 layers, 9 query heads, 3 KV heads, head_dim 64) profiled end to end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from attnprof.analyze import memory, oom, scaling
from attnprof.cli import main
from attnprof.tools import scaling_bench

GIB = 1 << 30
# SmolLM2-135M's attention shape (../shared/notes/smollm2.md).
LAYERS, HQ, HKV, D = 30, 9, 3, 64


def _call_floor(path: str) -> Any:
    def f(L: int) -> float:
        shape = memory.AttnShape(1, HQ, HKV, L, L, D, D, "float32")
        return memory.analytic_attention_peak(shape, path, threads=1)["total"]
    return f


def _largest(f: Any, budget: float) -> int:
    """Largest L with f(L) <= budget by a plain linear-then-bisect search (independent of
    scaling.predict_max)."""
    lo, hi = 1, 2
    while f(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if f(mid) <= budget else (lo, mid)
    return lo


@pytest.fixture(scope="module")
def short_benches() -> dict[str, tuple[list[int], list[float]]]:
    torch.set_num_threads(1)  # the flash tiles in the analytic model are per thread
    out = {}
    for path in scaling.PATHS:
        Ls = [32, 64]
        peaks = [scaling_bench.bench_path(path, 1, HQ, HKV, L, D, "float32",
                                          repeats=1)["peak_bytes"] for L in Ls]
        out[path] = (Ls, peaks)
    return out


@pytest.mark.parametrize("budget", [64 << 20, 24 * GIB])
@pytest.mark.parametrize("path", list(scaling.PATHS))
def test_short_fits_never_exceed_the_analytic_bound(
        short_benches: dict[str, tuple[list[int], list[float]]], path: str,
        budget: int) -> None:
    """Two measured lengths (32, 64) of one call on each CPU path (flash_cpu is the fused
    path here; efficient/cuDNN exist on CUDA only, and vLLM makes no OOM prediction)."""
    Ls, peaks = short_benches[path]
    floor = _call_floor(path)
    pred = oom.predict_oom(Ls, peaks, budget, floor)
    bound = _largest(floor, budget)
    assert pred.analytic_max_seq_len == bound
    assert 64 < pred.max_seq_len <= bound
    assert floor(pred.max_seq_len) <= budget
    assert pred.extrapolation_factor == round(pred.max_seq_len / 64, 2)
    assert pred.extrapolation and pred.confidence == "low"  # far past 4x of 64
    if path != "flash_cpu":
        # The plain fit through two points has no L^2 term: it would have gone far past the
        # score matrices' limit (what `attnprof profile` used to report).
        plain = scaling.predict_max(scaling.fit_poly2(Ls, peaks), budget)
        assert plain > 2 * bound
        assert pred.fit_max_seq_len == plain and "rules out" in pred.note
        # And the prediction is close to the score-matrix limit itself, not just below it.
        per_l2 = memory.PATH_BYTES_PER_SCORE[path](4) * HQ
        assert pred.max_seq_len > 0.9 * math.sqrt(budget / per_l2)


def test_confidence_levels_follow_the_documented_rule() -> None:
    c = oom.confidence
    assert [c(1.0), c(2.0), c(3.9), c(4.0), c(4.1), c(400)] == [
        "high", "high", "medium", "medium", "low", "low"]
    assert c(30, validated=True) == "high"
    assert c(1.5, model_error=0.2) == "medium" and c(3, model_error=0.2) == "low"
    assert c(None) == "low" and c(0) == "low"
    assert f"{oom.EXTRAPOLATION_LIMIT:g}x" in oom.CONFIDENCE_RULE


@pytest.fixture(scope="module")
def smol_shape_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, SmolLM2's attention shape, a small MLP and vocabulary (quick to run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("smol_shape")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=HQ * D, intermediate_size=64,
                      num_hidden_layers=LAYERS, num_attention_heads=HQ,
                      num_key_value_heads=HKV, head_dim=D, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _profile(ckpt: Path, out: Path, *args: str) -> dict[str, Any]:
    """The what-ifs need no micro-benchmarks (the analytic model sets their attention term):
    only the fused path is benchmarked unless ``args`` say otherwise."""
    if "--paths" not in args:
        args = ("--paths", "flash_cpu", *args)
    rc = main(["profile", str(ckpt), "--out", str(out), "--repeats", "1", *args])
    assert rc == 0
    return dict(json.loads((out / "profile.json").read_text()))


@pytest.mark.slow
def test_default_sdpa_math_what_if_is_physically_possible(
        smol_shape_ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    """`attnprof profile smollm2 --seq-lens 128,256`: the math what-if used to be 93,950
    tokens in 24 GiB, where one call's score matrix alone is 9 x L^2 x 4 B ~ 318 GB."""
    prof = _profile(smol_shape_ckpt, tmp_path / "o", "--seq-lens", "128,256", "--no-validate",
                    "--paths", "flash_cpu,math,eager")
    o = prof["oom_prediction"]
    math_limit = math.sqrt(24 * GIB / (HQ * 9 + 4))  # scores, softmax, bool + fp32 masks
    w = o["if_attention_path"]["math"]
    assert 10_000 < w["max_seq_len"] <= math_limit
    assert w["max_seq_len"] <= w["analytic_max_seq_len"]
    assert o["attention_paths"] == {"flash_cpu": list(range(LAYERS))}
    assert w["extrapolation"] and w["confidence"] == "low"
    assert w["extrapolation_factor"] == round(w["max_seq_len"] / 256, 2)
    assert o["max_seq_len"] <= o["analytic_max_seq_len"]
    assert o["extrapolation"] is (o["extrapolation_factor"] > oom.EXTRAPOLATION_LIMIT)
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("OOM prediction"))
    assert "flash_cpu: all layers" in line and "confidence" in line
    assert f"if attention ran on math: max seq_len {w['max_seq_len']:,} (EXTRAPOLATION" in text
    # The fused headline (~100k tokens) is past the model's 8,192 positions: said plainly.
    assert o["model_max_context"] == 8192 and o["max_seq_len"] > 8192
    assert (f"beyond the model's maximum context (8,192 tokens): memory would allow "
            f"{o['max_seq_len']:,}") in text


@pytest.mark.slow
def test_eager_headline_is_for_the_eager_path_it_ran(
        smol_shape_ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    """`--attn-implementation eager --seq-lens 256,512` used to report 102,990 tokens (the
    linear fit of a model whose every layer holds two fp32 score matrices)."""
    prof = _profile(smol_shape_ckpt, tmp_path / "o", "--attn-implementation", "eager",
                    "--seq-lens", "256,512", "--no-validate")
    o = prof["oom_prediction"]
    two_fp32_scores = math.sqrt(24 * GIB / (HQ * 2 * 4))  # 18,918 tokens
    assert 10_000 < o["max_seq_len"] <= two_fp32_scores
    assert o["max_seq_len"] <= o["analytic_max_seq_len"]
    assert o["attention_paths"] == {"eager": list(range(LAYERS))}
    assert o["fit_max_seq_len"] > 3 * o["max_seq_len"] and "rules out" in o["note"]
    assert o["extrapolation"] and o["confidence"] == "low"
    assert o["extrapolation_factor"] == round(o["max_seq_len"] / 512, 2)
    assert "eager" not in o["if_attention_path"]
    assert o["if_attention_path"]["flash_cpu"]["max_seq_len"] > o["max_seq_len"]
    text = capsys.readouterr().out
    assert (f"max seq_len {o['max_seq_len']:,} at batch 1 (EXTRAPOLATION: "
            f"{o['extrapolation_factor']:g}x the longest measured length (512), "
            f"confidence low)") in text
    assert "eager: all layers" in text


@pytest.mark.slow
def test_eager_prediction_holds_when_run_at_the_predicted_length(
        smol_shape_ckpt: Path, tmp_path: Path) -> None:
    """A budget this machine can afford (160 MiB over the weights): the prediction from
    128/256 tokens (beyond the extrapolation limit) is run at the predicted length and
    measured; a validated prediction has high confidence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_shape_ckpt, dtype=torch.float32)
    static = sum(t.numel() * t.element_size()
                 for t in [*model.parameters(), *model.buffers()])
    del model
    prof = _profile(smol_shape_ckpt, tmp_path / "o", "--attn-implementation", "eager",
                    "--seq-lens", "128,256", "--memory-budget", str(static + (160 << 20)))
    o = prof["oom_prediction"]
    assert o["static_bytes"] == static
    v = o["validation"]
    assert v["planned"] and v["seq_len"] == o["max_seq_len"], v
    assert v["fits_budget"] and v["rel_error"] < 0.05, v
    assert o["extrapolation_factor"] > oom.EXTRAPOLATION_LIMIT and o["extrapolation"]
    assert o["confidence"] == "high"
    assert o["max_seq_len"] <= o["analytic_max_seq_len"]
