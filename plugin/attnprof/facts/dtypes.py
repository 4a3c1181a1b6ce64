"""Element sizes of the dtypes attention runs in, and their canonical short names.

Accepts torch dtypes (``torch.bfloat16``), their names (``"bfloat16"``), the short forms
vLLM and configs use (``bf16``, ``half``) and KV-cache dtypes (``fp8_e4m3``, ``int8``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CANONICAL", "dtype_bytes", "dtype_name", "normalize", "torch_dtype"]

# alias -> (canonical short name, bytes per element)
_TABLE: dict[str, tuple[str, int]] = {
    "float64": ("fp64", 8), "double": ("fp64", 8), "fp64": ("fp64", 8),
    "float32": ("fp32", 4), "float": ("fp32", 4), "fp32": ("fp32", 4), "f32": ("fp32", 4),
    "float16": ("fp16", 2), "half": ("fp16", 2), "fp16": ("fp16", 2), "f16": ("fp16", 2),
    "bfloat16": ("bf16", 2), "bf16": ("bf16", 2),
    "fp8": ("fp8", 1), "float8": ("fp8", 1), "e4m3": ("fp8", 1), "e5m2": ("fp8", 1),
    "int8": ("int8", 1), "uint8": ("int8", 1),
}
CANONICAL = frozenset(v[0] for v in _TABLE.values())
_TORCH = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"BFloat16"`` -> ``"bfloat16"``."""
    return str(dtype).strip().lower().removeprefix("torch.")


def _lookup(dtype: Any) -> tuple[str, int] | None:
    name = dtype_name(dtype)
    hit = _TABLE.get(name)
    if hit is None and name.startswith(("fp8", "float8")):  # fp8_e4m3, float8_e4m3fn, ...
        hit = _TABLE["fp8"]
    return hit


def dtype_bytes(dtype: Any, default: int | None = None) -> int:
    """Bytes per element; ``default`` for an unknown dtype, or ``ValueError`` when None."""
    hit = _lookup(dtype)
    if hit is not None:
        return hit[1]
    if default is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    return default


def normalize(dtype: Any) -> str:
    """Canonical short name (fp32, fp16, bf16, fp8, int8, fp64); ``ValueError`` if unknown."""
    hit = _lookup(dtype)
    if hit is None:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(sorted(_TABLE))})")
    return hit[0]


def torch_dtype(dtype: Any) -> Any:
    """The ``torch.dtype`` of a compute dtype alias (fp64/fp32/fp16/bf16); torch is imported
    here, on call. ``ValueError`` for a dtype with no single torch compute type (fp8, int8)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = normalize(dtype)
    if name not in _TORCH:
        raise ValueError(f"{dtype!r} is not a compute dtype (one of {', '.join(_TORCH)})")
    return getattr(torch, _TORCH[name])
