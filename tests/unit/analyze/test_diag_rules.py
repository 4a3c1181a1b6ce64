"""The CUDA rule port, the compatibility matrix and vLLM's own backend validity."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
import torch

from attnprof.analyze import compat, rules
from attnprof.analyze.vllm_backends import from_matrix
from attnprof.capture.vllm import backends


def vllm_backend_report(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Capture's report with the derived matrix handed in, as the plugin host and CLI do."""
    return backends.vllm_backend_report(*args, fallback=from_matrix, **kwargs)


def test_matrix_is_versioned_and_sourced() -> None:
    m = rules.load_matrix()
    assert m["schema_version"] == 1 and m["matrix_version"]
    for hw in ("sm80", "sm86", "sm89", "sm90", "sm100", "mi300", "cpu_avx2", "cpu_avx512"):
        assert hw in m["hardware"]
    for name, spec in m["backends"].items():
        assert spec["sources"], name
        assert set(spec["hardware"]) <= set(m["hardware"]), name
        assert set(spec["features"]) == {"mask", "sliding_window", "sinks", "fp8_kv"}, name
    text = resources.files("attnprof.analyze").joinpath("data/compat_matrix.json").read_text()
    assert json.loads(text) == m


@pytest.mark.parametrize(("name", "key"), [("h100", "sm90"), ("A100", "sm80"), ("9.0", "sm90"),
                                           ("mi300x", "mi300"), ("cpu", "cpu_avx2"),
                                           ("sm_100", "sm100"), ("l40s", "sm89")])
def test_resolve_hardware(name: str, key: str) -> None:
    assert rules.resolve_hardware(name) == key


def test_unknown_hardware_and_dtype_raise() -> None:
    with pytest.raises(ValueError, match="unknown GPU"):
        rules.resolve_hardware("tpu-v5")
    with pytest.raises(ValueError, match="unknown dtype"):
        rules.normalize_dtype("int3")


def test_head_dim_96_bf16_h100() -> None:
    rep = compat.case_report("h100", 96, "bf16")
    by = {b["backend"]: b for b in rep["backends"]}
    assert by["flash_attn_3"]["ok"] and by["torch_sdpa_flash"]["ok"]
    # vLLM's backends are not hand-kept any more: they come from the derived matrix.
    assert "flashinfer" not in by and "triton_attn" not in by
    v = {b["backend"]: b for b in rep["vllm"]["backends"]}
    assert rep["vllm"]["selected"] == "FLASH_ATTN" and rep["vllm"]["flash_attn_version"] == 3
    assert v["FLASHINFER"]["reasons"] == ["head_size not supported"]
    assert not by["vllm_cpu_attn"]["ok"] and by["vllm_cpu_attn"]["reasons"][0]["code"] == \
        "hardware"
    assert rep["torch_sdpa_choice"]["backend"] == "flash"


def test_fa3_only_on_hopper_and_fp8_kv() -> None:
    assert not rules.evaluate("flash_attn_3", "a100", 128, "bf16").ok
    assert rules.evaluate("flash_attn_3", "h100", 128, "bf16", {"fp8_kv": True}).ok
    v = rules.evaluate("flash_attn_2", "h100", 128, "bf16", {"fp8_kv": True})
    assert [r["code"] for r in v.reasons] == ["fp8_kv"]


def test_cudnn_head_dim_limit_depends_on_hardware() -> None:
    assert not rules.evaluate("torch_sdpa_cudnn", "a100", 256, "bf16").ok
    assert rules.evaluate("torch_sdpa_cudnn", "h100", 256, "bf16").ok


def test_predict_sdpa_cuda() -> None:
    s = (1, 8, 1024, 128)
    assert rules.predict_sdpa_cuda("h100", s, s, s, "bf16", is_causal=True)["backend"] == "flash"
    masked = rules.predict_sdpa_cuda("h100", s, s, s, "bf16", has_mask=True)
    assert masked["backend"] == "efficient"
    assert [r["code"] for r in masked["reasons"]] == ["mask"]
    fp32 = rules.predict_sdpa_cuda("a100", s, s, s, "fp32", is_causal=True)
    assert fp32["backend"] == "efficient" and fp32["reasons"][0]["code"] == "dtype"
    big = (1, 8, 1024, 512)
    assert rules.predict_sdpa_cuda("h100", big, big, big, "bf16")["backend"] == "efficient"
    gqa_k = (1, 2, 1024, 128)
    gqa_mask = rules.predict_sdpa_cuda("a100", s, gqa_k, gqa_k, "bf16", has_mask=True)
    assert gqa_mask["backend"] == "math"
    assert {r["code"] for r in gqa_mask["reasons"]} == {"mask", "gqa_without_enable_gqa"}
    drop = rules.predict_sdpa_cuda("h100", s, s, s, "bf16", dropout_p=0.1, flash_impl="FA3")
    assert drop["backend"] == "efficient"
    with pytest.raises(ValueError):
        rules.predict_sdpa_cuda("cpu", s, s, s, "fp32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to compare")
def test_predict_sdpa_cuda_matches_dispatcher() -> None:  # pragma: no cover - GPU only
    from torch.nn.attention import SDPBackend

    cc = torch.cuda.get_device_capability()
    hw = f"{cc[0]}.{cc[1]}"
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for d in (64, 96, 128, 256, 512):
            q = torch.randn(1, 8, 256, d, device="cuda", dtype=torch_dtype)
            for mask in (None, torch.ones(256, 256, device="cuda", dtype=torch.bool).tril()):
                got = SDPBackend(torch._fused_sdp_choice(q, q, q, mask, 0.0, mask is None)).name
                pred = rules.predict_sdpa_cuda(hw, q.shape, q.shape, q.shape, dtype,
                                               has_mask=mask is not None,
                                               is_causal=mask is None)["backend"]
                assert got.split("_")[0].lower() == pred, (dtype, d, mask is None)


def test_markdown_matrix_lists_every_backend() -> None:
    md = compat.markdown_matrix()
    for name in rules.load_matrix()["backends"]:
        assert f"`{name}`" in md
    assert "| `sm90` |" in md


def test_docs_compat_matrix_is_generated() -> None:
    from pathlib import Path

    doc = Path(__file__).resolve().parents[3] / "docs" / "compat-matrix.md"
    assert doc.read_text() == compat.markdown_matrix() + "\n", \
        "regenerate: attnprof compat --markdown --out docs/compat-matrix.md"


@pytest.mark.vllm
def test_vllm_backend_report_cpu() -> None:
    # The running platform is the target: vLLM's CPU backend answers itself, and no CUDA
    # backend is validated under the CPU platform.
    rep = vllm_backend_report(9, 3, 64, torch.float32, "auto", None)
    assert rep["source"] == "vllm.validate_configuration (CpuPlatform, this machine)"
    assert list(rep["backends"]) == ["CPU_ATTN"]
    assert rep["valid"] == ["CPU_ATTN"] and rep["predicted"] == "CPU_ATTN"
    bad = vllm_backend_report(9, 3, 72, torch.float32, "auto", None)
    assert bad["backends"]["CPU_ATTN"]["reasons"] == ["head_size not supported"]


@pytest.mark.slow
def test_capture_reads_no_matrix_unless_handed_one() -> None:
    # Capture imports no analyze: for a target vLLM cannot answer for here, the report says
    # so instead of reading the derived matrix itself.
    rep = backends.vllm_backend_report(9, 3, 96, torch.bfloat16, "auto", None,
                                       device_capability=(9, 0))
    assert rep["valid"] is None and rep["backends"] == {} and rep["source"] is None
    assert "no derived matrix was handed in" in rep["note"]


@pytest.mark.slow
def test_vllm_backend_report_gpu_target_reads_the_derived_matrix() -> None:
    # An H100 asked about from this CPU process: the derived matrix answers, and says so.
    rep = vllm_backend_report(9, 3, 96, torch.bfloat16, "fp8", 4096, device_capability=(9, 0))
    assert rep["source"].startswith("attnprof derived matrix")
    assert "not the running platform" in rep["source"]
    b = rep["backends"]
    # vLLM 0.32 runs FA3 with an fp8 KV cache on Hopper (the hand rules said it could not).
    assert b["FLASH_ATTN"]["valid"] and rep["predicted"] == "FLASH_ATTN"
    assert rep["flash_attn_version"] == 3
    assert b["FLASHINFER"]["reasons"] == ["head_size not supported"]
    bw = vllm_backend_report(8, 8, 128, torch.bfloat16, "auto", None, device_capability=(10, 0))
    assert next(iter(bw["backends"])) == "FLASHINFER" and bw["predicted"] == "FLASHINFER"
    off = vllm_backend_report(8, 8, 100, torch.bfloat16, "auto", None, device_capability=(9, 0))
    assert off["valid"] is None and "outside the derived grid" in off["note"]
    unk = vllm_backend_report(8, 8, 128, torch.bfloat16, "auto", None, device_capability=(12, 0))
    assert unk["valid"] is None and "12.0" in unk["note"]
    e5 = vllm_backend_report(8, 8, 128, torch.bfloat16, "fp8_e5m2", None,
                             device_capability=(9, 0))
    assert e5["valid"] is None and "fp8_e5m2" in e5["note"]
