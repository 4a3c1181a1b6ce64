"""Rule port: which attention backends activate for a (hardware, head dim, dtype, features) case.

Two layers, both pure Python (no torch, no GPU):
- :func:`evaluate` checks one backend of the versioned compatibility matrix
  (``data/compat_matrix.json``) and returns exact reasons for a rejection.
- :func:`predict_sdpa_cuda` ports torch 2.13's CUDA SDPA selector (``sdp_utils.cpp``):
  priority order, per-backend checks, FA3/FA4 implementation switch. On a machine with a GPU,
  ``tests/unit/analyze/test_diag_rules.py`` compares it with ``torch._fused_sdp_choice``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from attnprof.facts.dtypes import normalize

__all__ = [
    "Verdict",
    "evaluate",
    "evaluate_all",
    "load_matrix",
    "normalize_dtype",
    "predict_sdpa_cuda",
    "resolve_hardware",
]

@functools.cache
def load_matrix() -> dict[str, Any]:
    text = resources.files("attnprof.analyze").joinpath("data/compat_matrix.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def normalize_dtype(dtype: Any) -> str:
    """The matrix's dtype name (fp32, fp16, bf16, fp8; also int8, fp64, which no backend
    lists) from any alias :mod:`attnprof.facts.dtypes` knows; ``ValueError`` if unknown."""
    return normalize(dtype)


def resolve_hardware(name: str) -> str:
    """``h100`` / ``sm90`` / ``9.0`` / ``mi300x`` / ``cpu`` -> a matrix hardware key."""
    hw = load_matrix()["hardware"]
    key = name.strip().lower().replace("-", "_")
    if key in hw:
        return key
    for k, spec in hw.items():
        cc = spec.get("cc")
        if key in spec["aliases"] or key.replace("_", "-") in spec["aliases"] or (
                cc and key in (f"{cc[0]}.{cc[1]}", f"sm_{cc[0]}{cc[1]}")):
            return str(k)
    choices = sorted(set(hw) | {a for s in hw.values() for a in s["aliases"]})
    raise ValueError(f"unknown GPU/hardware {name!r} (one of {', '.join(choices)})")


@dataclass
class Verdict:
    backend: str
    ok: bool
    fused: bool
    reasons: list[dict[str, str]] = field(default_factory=list)
    notes: str = ""
    tag: str = ""
    sources: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "ok": self.ok, "fused": self.fused,
                "reasons": self.reasons, "notes": self.notes, "tag": self.tag,
                "sources": self.sources}


def _feature_ok(value: Any, hw: str) -> bool:
    return bool(value) if not isinstance(value, list) else hw in value


def evaluate(backend: str, hardware: str, head_dim: int, dtype: str,
             features: dict[str, bool] | None = None, head_dim_v: int | None = None,
             matrix: dict[str, Any] | None = None) -> Verdict:
    """Does ``backend`` activate for this case, and if not, every reason why. ``matrix``
    replaces the shipped rules (an older matrix, for audits)."""
    spec = (matrix or load_matrix())["backends"][backend]
    hw = resolve_hardware(hardware)
    dt = normalize_dtype(dtype)
    reasons: list[dict[str, str]] = []

    def no(code: str, msg: str) -> None:
        reasons.append({"code": code, "backend": backend, "message": msg})

    if hw not in spec["hardware"]:
        no("hardware", f"not available on {hw} (supports {', '.join(spec['hardware'])})")
    if dt not in spec["dtypes"]:
        no("dtype", f"dtype {dt} not supported (supports {', '.join(spec['dtypes'])})")
    hd = spec.get("head_dim", {})
    mx = hd.get("max_by_hardware", {}).get(hw, hd.get("max"))
    mult = hd.get("multiple_of_by_dtype", {}).get(dt, hd.get("multiple_of"))
    if head_dim_v is not None and head_dim_v != head_dim and spec["family"] == "torch_sdpa" \
            and backend != "torch_sdpa_math":
        no("head_dim_mismatch", f"q/k head dim {head_dim} != v head dim {head_dim_v}")
    if mx is not None and head_dim > mx:
        no("head_dim", f"head dim {head_dim} > {mx}" + (f" on {hw}" if "max_by_hardware" in hd
                                                       else ""))
    if hd.get("min") is not None and head_dim < hd["min"]:
        no("head_dim", f"head dim {head_dim} < {hd['min']}")
    if mult and head_dim % mult:
        no("head_dim", f"head dim {head_dim} is not a multiple of {mult}" +
           (f" for {dt}" if "multiple_of_by_dtype" in hd else ""))
    if hd.get("one_of") and head_dim not in hd["one_of"]:
        no("head_dim", f"head dim {head_dim} not in {hd['one_of']}")
    for feat, wanted in (features or {}).items():
        if wanted and not _feature_ok(spec["features"].get(feat, False), hw):
            no(feat, f"{feat.replace('_', ' ')} not supported"
               + (f" on {hw}" if isinstance(spec["features"].get(feat), list) else ""))
    return Verdict(backend, not reasons, bool(spec["fused"]), reasons, spec.get("notes", ""),
                   spec.get("tag", ""), list(spec.get("sources", [])))


def evaluate_all(hardware: str, head_dim: int, dtype: str,
                 features: dict[str, bool] | None = None) -> list[Verdict]:
    return [evaluate(b, hardware, head_dim, dtype, features) for b in load_matrix()["backends"]]


# ----- torch 2.13 CUDA SDPA selector port -----

def predict_sdpa_cuda(hardware: str, query_shape: tuple[int, ...], key_shape: tuple[int, ...],
                      value_shape: tuple[int, ...], dtype: str, *, has_mask: bool = False,
                      dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False,
                      last_dim_contiguous: bool = True, flash_impl: str = "FA2",
                      cudnn_first: bool = False) -> dict[str, Any]:
    """The backend torch 2.13's CUDA dispatcher picks, with per-backend rejection reasons.

    Mirrors ``select_sdp_backend``: order flash -> efficient -> math (cuDNN first on
    Hopper/Blackwell when ``cudnn_first``, i.e. cuDNN > 9.15 and not deprioritized).
    Reasons use the same codes as the CPU ground truth in :mod:`.sdpa`.
    """
    hw = resolve_hardware(hardware)
    spec = load_matrix()["hardware"][hw]
    dt = normalize_dtype(dtype)
    cc = tuple(spec["cc"] or (0, 0))
    rocm = spec["vendor"] == "amd"
    if spec["vendor"] == "cpu":
        raise ValueError("predict_sdpa_cuda needs a GPU target; on CPU ask the dispatcher "
                         "(attnprof.capture.sdpa.sdpa_choice)")
    ndim = len(query_shape)
    dq, dk, dv = query_shape[-1], key_shape[-1], value_shape[-1]
    lq = query_shape[-2] if ndim >= 2 else 0
    lk = key_shape[-2] if ndim >= 2 else 0
    hq = query_shape[1] if ndim == 4 else 0
    hk = key_shape[1] if ndim == 4 else 0
    reasons: dict[str, list[dict[str, str]]] = {"flash": [], "efficient": [], "cudnn": []}

    def no(b: str, code: str, msg: str) -> None:
        reasons[b].append({"code": code, "backend": b, "message": msg})

    for b in reasons:
        if ndim != 4:
            no(b, "not_4d", f"all fused kernels require 4-D query/key/value, got {ndim}-D")
        if lq == 0 or lk == 0:
            no(b, "zero_length", "zero seq_len_q or seq_len_kv")
        if not last_dim_contiguous:
            no(b, "non_contiguous_last_dim", "last dimension must have stride 1")
        if dropout_p > 0 and b == "flash" and flash_impl == "FA3":
            no(b, "dropout", "FA3 does not support dropout")
    # flash
    if has_mask:
        no("flash", "mask", "flash attention does not support an explicit attn_mask "
                            "(pass is_causal=True instead)")
    if not dq == dk == dv:
        no("flash", "head_dim_mismatch", f"q, k, v head dims differ ({dq}, {dk}, {dv})")
    elif dq > 256:
        no("flash", "head_dim", f"head dim {dq} > 256")
    if is_causal and lq != lk and lq > 1:
        no("flash", "causal_shape", "is_causal with seq_len_q != seq_len_kv")
    if dt not in ("fp16", "bf16"):
        no("flash", "dtype", f"flash needs fp16/bf16, got {dt}")
    if not rocm and not (8, 0) <= cc <= (12, 1):
        no("flash", "hardware", f"flash needs sm80-sm121, got sm{cc[0]}{cc[1]}")
    if flash_impl == "FA3" and cc != (9, 0):
        no("flash", "hardware", "FA3 needs compute capability 9.0")
    if flash_impl == "FA4" and cc not in ((9, 0), (10, 0)):
        no("flash", "hardware", "FA4 needs compute capability 9.0 or 10.0")
    if ndim == 4 and hq != hk and not enable_gqa:
        no("flash", "gqa_without_enable_gqa", f"query has {hq} heads, key {hk}: pass "
                                              "enable_gqa=True")
    # efficient
    if dq != dk:
        no("efficient", "head_dim_mismatch", f"q and k head dims differ ({dq}, {dk})")
    align = 4 if dt == "fp32" else 8
    if dq % align or dv % align:
        no("efficient", "head_dim", f"head dims must be multiples of {align} for {dt}")
    if dt not in ("fp32", "fp16", "bf16"):
        no("efficient", "dtype", f"efficient needs fp32/fp16/bf16, got {dt}")
    if dt == "bf16" and not rocm and cc < (8, 0):
        no("efficient", "dtype", "bf16 needs sm80+")
    if ndim == 4 and hq != hk:
        no("efficient", "gqa_without_enable_gqa", "memory-efficient attention does not "
                                                  "support GQA (different head counts)")
    # cudnn
    if rocm:
        no("cudnn", "hardware", "cuDNN attention is NVIDIA-only")
    cmax = 256 if cc in ((9, 0), (10, 0)) else 128
    if dt not in ("fp16", "bf16"):
        no("cudnn", "dtype", f"cuDNN needs fp16/bf16, got {dt}")
    if dq % 8 or dv % 8 or dq > cmax or dv > cmax:
        no("cudnn", "head_dim", f"cuDNN needs head dims multiple of 8 and <= {cmax}")
    if lk == 1:
        no("cudnn", "zero_length", "cuDNN needs seq_len_kv > 1")
    if ndim == 4 and hq != hk and not enable_gqa:
        no("cudnn", "gqa_without_enable_gqa", f"query has {hq} heads, key {hk}")

    order = ["flash", "efficient", "math"]
    if cudnn_first and cc in ((9, 0), (10, 0)):
        order = ["cudnn", *order]
    chosen = next(b for b in order if b == "math" or not reasons[b])
    rejected = [r for b in order[: order.index(chosen)] for r in reasons[b]]
    return {"backend": chosen, "fused": chosen != "math", "reasons": rejected,
            "per_backend": reasons, "order": order, "hardware": hw,
            "flash_impl": flash_impl, "torch": "2.13"}
