"""Head statistics and window replay through real transformers models (tiny, random weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnprof.tools.replay import (
    ReplayError,
    collect_head_stats,
    default_prompts,
    load_model,
    read_prompts,
    replay,
)
from tests.conftest import build_tiny_model


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), sliding_window=16)


def test_statistics_match_the_models_own_attention_weights(tiny_model: Path) -> None:
    """q/k hooked after RoPE give the same coverage as the eager path's softmax output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    prompt = default_prompts(tok, (150,))[0]
    acc = collect_head_stats(model, tok, [prompt], sinks_grid=(0, 4), window_grid=(8, 32),
                             n_last=16, n_random=16)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    n = ids.shape[1]
    rows, wts = acc.sample_plan(n, 0)  # all-query estimates: weighted means
    cov = acc.coverage_mean()
    sink = acc.per_head_means()["sink_mass"]
    for layer, a in enumerate(att):
        p = a[0].double().numpy()  # [H, L, L]
        for h in range(p.shape[0]):
            for si, s in enumerate(acc.sinks_grid):
                want_sink = np.average([p[h, i, :s].sum() for i in rows], weights=wts)
                assert sink[layer, h, si] == pytest.approx(want_sink, abs=1e-5)
                for wi, w in enumerate(acc.window_grid):
                    el = [(i, x) for i, x in zip(rows, wts, strict=True) if i + 1 > s + w]
                    vals = [p[h, i, :s].sum() + p[h, i, max(s, i - w + 1):i + 1].sum()
                            for i, _ in el]
                    want = np.average(vals, weights=[x for _, x in el])
                    assert cov[layer, h, si, wi] == pytest.approx(want, abs=1e-5)


def test_replay_of_the_native_window_is_identical(tiny_mistral: Path) -> None:
    """Mistral already slides with w = 16: replaying w = 16 (no sinks) must change nothing,
    which pins the window semantics to transformers' (key j visible iff j > i - w)."""
    model, tok, _ = load_model(tiny_mistral)
    prompts = default_prompts(tok, (60, 90))
    same = replay(model, tok, prompts, window=16, sinks=0)
    assert same["positions"] > 100
    assert same["agreement"] == 1.0 and same["mean_kl"] < 1e-9 and same["safe"]
    tighter = replay(model, tok, prompts, window=15, sinks=0)
    assert tighter["positions"] > 100 and tighter["mean_kl"] > 1e-6


def test_replay_reports_no_evidence_when_the_window_never_binds(tiny_model: Path) -> None:
    model, tok, _ = load_model(tiny_model)
    res = replay(model, tok, default_prompts(tok, (40,)), window=512, sinks=4)
    assert res["positions"] == 0 and res["safe"] is False
    assert "no evidence" in res["verdict"]
    small = replay(model, tok, default_prompts(tok, (120,)), window=8, sinks=0, generate=4)
    assert small["positions"] > 100 and 0.0 <= small["agreement"] <= 1.0
    assert small["longest_tokens"] > 120


def test_read_prompts_formats(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompts(f) == ["first prompt", "second prompt"]
    f.write_text('["a b", "c"]')
    assert read_prompts(f) == ["a b", "c"]
    f.write_text('{"prompt": "x"}\n{"prompt": "y"}\n')
    assert read_prompts(f) == ["x", "y"]
    for bad in ("", "[1, 2]", '{"text": 1}'):
        f.write_text(bad)
        with pytest.raises(ReplayError):
            read_prompts(f)
