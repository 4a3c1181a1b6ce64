"""Ground truth of torch SDPA on CPU: the dispatcher's choice, its reasons, the op that ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from attnprof.capture.sdpa import SDPASpy, classify_reason, sdpa_choice


def qkv(d_v: int = 64, heads_kv: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, 16, 64, generator=g), torch.randn(1, heads_kv, 16, 64, generator=g),
            torch.randn(1, heads_kv, 16, d_v, generator=g))


def run(fn: Callable[[], Any]) -> Any:
    with SDPASpy() as spy:
        fn()
    assert len(spy.calls) == 1
    return spy.calls[0]


def test_default_runs_fused_cpu_kernel() -> None:
    q, k, v = qkv()
    call = run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert call.op == "_scaled_dot_product_flash_attention_for_cpu"
    assert call.backend == "flash_cpu" and call.fused
    assert call.choice.backend == "flash" and call.choice.reasons == []


def test_mask_and_decode_stay_fused_on_cpu() -> None:
    q, k, v = qkv()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    assert run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).fused
    assert run(lambda: F.scaled_dot_product_attention(q[:, :, -1:], k, v)).fused


def _noncontig() -> torch.Tensor:
    return torch.randn(1, 4, 64, 16).transpose(-1, -2)  # last-dim stride 16


CASES: list[tuple[str, Callable[[], Any]]] = [
    ("dropout", lambda: F.scaled_dot_product_attention(*qkv(), dropout_p=0.5)),
    ("head_dim_mismatch", lambda: F.scaled_dot_product_attention(*qkv(d_v=32))),
    ("not_4d", lambda: F.scaled_dot_product_attention(*(t[0] for t in qkv()))),
    ("non_contiguous_last_dim",
     lambda: F.scaled_dot_product_attention(_noncontig(), *qkv()[1:])),
]


@pytest.mark.parametrize(("code", "fn"), CASES, ids=[c for c, _ in CASES])
def test_fallbacks_run_math_with_matching_reason(code: str, fn: Callable[[], Any]) -> None:
    call = run(fn)
    assert call.op is None and not call.fused and call.backend == "math"
    assert "bmm" in call.ops or "matmul" in call.ops or "_safe_softmax" in call.ops
    assert [r["code"] for r in call.choice.reasons] == [code]
    assert call.choice.reasons[0]["backend"] == "flash"


def test_gqa_without_enable_gqa_reason() -> None:
    q, k, v = qkv(heads_kv=2)
    choice = sdpa_choice(q, k, v)
    assert choice.backend == "math"
    assert [r["code"] for r in choice.reasons] == ["gqa_without_enable_gqa"]
    assert sdpa_choice(q, k, v, enable_gqa=True).backend == "flash"


def test_dtype_reason() -> None:
    q, k, v = (t.to(torch.int32) for t in qkv())
    choice = sdpa_choice(q, k, v)
    assert choice.backend == "math" and choice.reasons[0]["code"] == "dtype"


def test_outputs_unchanged_under_spy() -> None:
    q, k, v = qkv()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with SDPASpy():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(ref, out)


def test_classify_reason_unknown_is_other() -> None:
    assert classify_reason("something new in torch 3.0") == "other"
