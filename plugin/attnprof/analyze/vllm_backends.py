"""vLLM attention backends: which are valid for a layer and why the others are not.

Uses vLLM's own ``validate_configuration`` on each backend class (the same call
``CudaPlatform.get_valid_backends`` makes) where the class imports; where it does not (e.g.
FlashInfer on a CPU build), falls back to the rules in ``data/compat_matrix.json``.
Safe inside a vLLM worker on CPU: no kernels run, nothing is allocated.
"""

from __future__ import annotations

import logging
from typing import Any

from attnprof.analyze.rules import evaluate, resolve_hardware

__all__ = ["CANDIDATES", "vllm_backend_report"]

logger = logging.getLogger("attnprof")

# vLLM backend -> compat-matrix key (used when the class cannot be imported here).
CANDIDATES: dict[str, str] = {
    "FLASH_ATTN": "flash_attn_2",
    "FLASHINFER": "flashinfer",
    "TRITON_ATTN": "triton_attn",
    "FLEX_ATTENTION": "flex_attention",
    "CPU_ATTN": "vllm_cpu_attn",
}
_GPU_ONLY = {"FLASH_ATTN", "FLASHINFER"}


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
            "fp32": torch.float32, "float": torch.float32}.get(name) or getattr(torch, name)


def _matrix_hw(device_capability: tuple[int, int] | None) -> str:
    if device_capability is None:
        return "cpu_avx2"
    try:
        return resolve_hardware(f"{device_capability[0]}.{device_capability[1]}")
    except ValueError:
        return "sm90" if device_capability >= (9, 0) else "sm80"


def vllm_backend_report(num_heads: int, num_kv_heads: int, head_size: int, dtype: Any,
                        kv_cache_dtype: str | None = "auto", sliding_window: int | None = None,
                        *, has_sink: bool = False, block_size: int | None = None,
                        device_capability: tuple[int, int] | None = None,
                        backends: list[str] | None = None,
                        selected: str | None = None) -> dict[str, Any]:
    """Per-backend validity for one attention layer, as vLLM would judge it.

    ``device_capability`` defaults to the current platform's (None on CPU, where only
    backends without a capability requirement are judged by vLLM and GPU-only ones by the
    rule data for an sm90 target). Returns ``{"source", "vllm_version", "platform",
    "device_capability", "layer", "selected", "valid", "predicted", "backends": {NAME:
    {"valid", "config_valid", "reasons", "source", "priority"}}}``; ``selected`` echoes the
    backend the worker uses, ``predicted`` is the first valid backend in vLLM's priority order
    (what vLLM picks without ``--attention-backend``).
    """
    out: dict[str, Any] = {
        "layer": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size,
                  "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": kv_cache_dtype,
                  "sliding_window": sliding_window, "has_sink": has_sink,
                  "block_size": block_size},
        "selected": selected, "backends": {}, "vllm_version": None, "platform": None,
        "device_capability": list(device_capability) if device_capability else None,
    }
    cap_obj: Any = None
    enum: Any = None
    try:
        import vllm
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        enum = AttentionBackendEnum

        out["vllm_version"] = str(vllm.__version__)
        out["platform"] = type(current_platform).__name__
        if device_capability is None:
            cc = current_platform.get_device_capability()
            if cc is not None:
                device_capability = (int(cc.major), int(cc.minor))
                out["device_capability"] = list(device_capability)
        if device_capability is not None:
            cap_obj = DeviceCapability(*device_capability)
    except Exception as exc:  # no vLLM here: rules only
        logger.debug("vLLM not importable (%s): rule data only", exc)
    cpu_platform = device_capability is None
    if backends:
        names = list(backends)
    elif device_capability is not None:
        # CudaPlatform's priority order (vllm/platforms/cuda.py, _get_backend_priorities).
        names = (["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
                 if device_capability[0] == 10 else
                 ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"])
        live = _cuda_valid_backends(device_capability, cap_obj, num_heads, head_size, dtype,
                                    kv_cache_dtype, block_size, has_sink, sliding_window)
        if live is not None:
            out["backends"] = live
            out["valid"] = [n for n, e in live.items() if e["valid"]]
            out["predicted"] = out["valid"][0] if out["valid"] else None
            return out
    else:
        names = list(CANDIDATES)
    hw = _matrix_hw(device_capability)
    for prio, name in enumerate(names):
        entry: dict[str, Any] = {"priority": prio}
        reasons: list[str] | None = None
        if enum is not None and not (cap_obj is None and name in _GPU_ONLY):
            try:
                cls = enum[name].get_class()
                reasons = list(cls.validate_configuration(
                    head_size=head_size, dtype=_torch_dtype(dtype),
                    kv_cache_dtype=kv_cache_dtype, block_size=block_size, use_mla=False,
                    has_sink=has_sink, use_sparse=False, use_mm_prefix=False,
                    use_per_head_quant_scales=False, device_capability=cap_obj,
                    attn_type="decoder", has_sliding_window=bool(sliding_window)))
                entry["source"] = "vllm.validate_configuration"
            except Exception as exc:
                logger.debug("validate_configuration(%s) failed: %s", name, exc)
                reasons = None
        if reasons is None:
            key = CANDIDATES.get(name)
            if key is None:
                entry.update(valid=None, reasons=["unknown backend"], source="none")
                out["backends"][name] = entry
                continue
            if key == "flash_attn_2" and hw == "sm90":
                key = "flash_attn_3"
            feats = {"sliding_window": bool(sliding_window), "sinks": has_sink,
                     "fp8_kv": str(kv_cache_dtype or "auto").startswith("fp8")}
            v = evaluate(key, hw, head_size, str(dtype).removeprefix("torch."), feats)
            reasons = [r["message"] for r in v.reasons]
            entry["source"] = f"attnprof rules ({key} on {hw})"
        entry["config_valid"] = not reasons
        if cpu_platform and name != "CPU_ATTN":
            # vLLM's CPU platform never asks the other backends; say so, keep their verdict.
            reasons = [*reasons, "not selectable on the CPU platform (vLLM CPU always uses "
                                 "CPU_ATTN)"]
        entry["valid"] = not reasons
        entry["reasons"] = reasons
        out["backends"][name] = entry
    out["valid"] = [n for n, e in out["backends"].items() if e.get("valid")]
    # What vLLM would pick without --attention-backend: the first valid one in priority order.
    out["predicted"] = "CPU_ATTN" if cpu_platform else (out["valid"][0] if out["valid"]
                                                        else None)
    return out


def _cuda_valid_backends(device_capability: tuple[int, int], cap_obj: Any, num_heads: int,
                         head_size: int, dtype: Any, kv_cache_dtype: str | None,
                         block_size: int | None, has_sink: bool, sliding_window: int | None
                         ) -> dict[str, Any] | None:
    """``CudaPlatform.get_valid_backends`` itself, where vLLM's CUDA build is importable."""
    try:
        from vllm.platforms.cuda import CudaPlatform
        from vllm.v1.attention.selector import AttentionSelectorConfig

        cfg = AttentionSelectorConfig(head_size=head_size, dtype=_torch_dtype(dtype),
                                      kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                                      has_sink=has_sink,
                                      has_sliding_window=bool(sliding_window))
        valid, invalid = CudaPlatform.get_valid_backends(cap_obj, cfg, num_heads=num_heads)
    except Exception as exc:  # CPU wheel: vllm._C_stable_libtorch is missing
        logger.debug("CudaPlatform.get_valid_backends unavailable: %s", exc)
        return None
    out: dict[str, Any] = {}
    for cand in valid:
        out[cand.backend.name] = {"priority": cand.priority, "valid": True, "reasons": [],
                                  "config_valid": True, "source": "vllm.get_valid_backends"}
    for be, (prio, reasons) in invalid.items():
        out[be.name] = {"priority": prio, "valid": False, "reasons": list(reasons),
                        "config_valid": False, "source": "vllm.get_valid_backends"}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["priority"]))
