"""Ground truth for ``torch.nn.functional.scaled_dot_product_attention``.

Two independent sources, both from torch itself:
- :func:`sdpa_choice` asks the dispatcher (``torch._fused_sdp_choice``) which backend it
  picks for these exact tensors, and, when it is not a fused one, re-runs the selector with
  only the fused backends enabled so that its own debug warnings give the rejection reasons.
- :class:`SDPASpy` records the arguments of SDPA calls after any library rewrite
  (transformers' ``repeat_kv``/``enable_gqa``/``is_causal`` logic) and the aten op that ran
  under ``aten::scaled_dot_product_attention``.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FUSED_OPS",
    "OpRecorder",
    "SDPACall",
    "SDPAChoice",
    "SDPASpy",
    "classify_reason",
    "sdpa_choice",
]

# aten op under aten::scaled_dot_product_attention -> (backend name, fused)
FUSED_OPS: dict[str, tuple[str, bool]] = {
    "_scaled_dot_product_flash_attention_for_cpu": ("flash_cpu", True),
    "_scaled_dot_product_flash_attention": ("flash", True),
    "_scaled_dot_product_efficient_attention": ("efficient", True),
    "_scaled_dot_product_cudnn_attention": ("cudnn", True),
    "_scaled_dot_product_fused_attention_overrideable": ("overrideable", True),
}
_MAX_OPS = 256  # aten ops kept per observed SDPA call (the math path needs a handful)
_MAX_ERRORS = 20
_BACKEND_NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}

# Message fragments of torch's sdp_utils checks -> stable reason codes (advice keys on them).
_REASON_PATTERNS: list[tuple[str, str]] = [
    (r"non-zero dropout", "dropout"),
    (r"same last dimension", "head_dim_mismatch"),
    (r"4 dimensional", "not_4d"),
    (r"stride 1", "non_contiguous_last_dim"),
    (r"same num_heads", "gqa_without_enable_gqa"),
    (r"dtype", "dtype"),
    (r"seq_len|zero", "zero_length"),
    (r"attn_mask|attention mask", "mask"),
    (r"head_dim|head dimension|headdim", "head_dim"),
    (r"is_causal", "causal_shape"),
    (r"compute capability|sm\d+|architecture", "hardware"),
    (r"nested", "nested"),
]


def classify_reason(message: str) -> str:
    low = message.lower()
    for pat, code in _REASON_PATTERNS:
        if re.search(pat, low):
            return code
    return "other"


@dataclass
class SDPAChoice:
    backend: str  # math | flash | efficient | cudnn | overrideable | error
    fused: bool
    reasons: list[dict[str, str]] = field(default_factory=list)  # [{code, backend, message}]

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "fused": self.fused, "reasons": list(self.reasons)}


def _fused_for(device_type: str) -> list[Any]:
    from torch.nn.attention import SDPBackend

    if device_type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION]  # the only fused SDPA kernel on CPU


def sdpa_choice(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> SDPAChoice:
    """The dispatcher's backend for these inputs, and its reasons if no fused kernel fits.

    Cheap (no attention math) but flips process-global ``sdpa_kernel`` flags while asking for
    reasons: call it off the hot path, not concurrently with other SDPA users.
    """
    import torch
    from torch.nn.attention import sdpa_kernel

    kw: dict[str, Any] = {"scale": scale, "enable_gqa": enable_gqa}
    try:
        idx = int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                          **kw))
    except RuntimeError as exc:
        return SDPAChoice("error", False, [{"code": classify_reason(str(exc)), "backend": "any",
                                           "message": str(exc)}])
    backend = _BACKEND_NAMES.get(idx, str(idx))
    if backend != "math":
        return SDPAChoice(backend, backend != "error")
    reasons: list[dict[str, str]] = []
    current = "fused"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sdpa_kernel(_fused_for(query.device.type)):
            try:
                torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, **kw)
            except RuntimeError:
                pass  # "No available kernel": expected, the warnings carry the reasons
    for w in caught:
        msg = str(w.message).split(" (Triggered internally")[0].strip()
        m = re.match(r"(\w[\w ]*?) kernel not used because", msg)
        if m:
            current = m.group(1).strip().lower().replace(" attention", "")
            continue
        reasons.append({"code": classify_reason(msg), "backend": current, "message": msg})
    if not reasons:
        # Every fused backend is disabled by the user (sdpa_kernel / torch.backends flags).
        reasons.append({"code": "disabled", "backend": "fused",
                        "message": "fused SDPA backends are disabled "
                                   "(torch.backends flags or sdpa_kernel)"})
    return SDPAChoice("math", False, reasons)


@dataclass
class SDPACall:
    """One SDPA call as the dispatcher saw it (shapes only: never tensor contents)."""

    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    dtype: str
    mask: str | None  # None, "bool" or "float"
    mask_shape: tuple[int, ...] | None
    dropout_p: float
    is_causal: bool
    enable_gqa: bool
    choice: SDPAChoice
    ops: list[str] = field(default_factory=list)  # aten ops seen while the call ran
    op: str | None = None  # the fused op under aten::scaled_dot_product_attention, if any

    @property
    def backend(self) -> str:
        if self.op is not None:
            return FUSED_OPS.get(self.op, (self.op, True))[0]
        return "math" if self.ops else self.choice.backend

    @property
    def fused(self) -> bool:
        return self.op is not None if self.ops else self.choice.fused


class SDPASpy:
    """Context manager recording every SDPA call's arguments, choice and aten op.

    A ``TorchFunctionMode`` sees the call as the library made it; a ``TorchDispatchMode``
    inside it sees the aten ops the composite SDPA decomposed into (the fused op, or the
    math path's bmm/softmax). Both pass every call through unchanged, so results are
    bit-identical; they add Python overhead per op, so use them on sampled calls only.

    The spy's own steps never raise into the call it watches: a failure is appended to
    ``errors`` and the op runs exactly once, unobserved.
    """

    def __init__(self, explain: bool = True) -> None:
        self.calls: list[SDPACall] = []
        self.errors: list[str] = []
        self.explain = explain
        self._modes: list[Any] = []

    def __enter__(self) -> SDPASpy:
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        spy = self

        class _Ops(TorchDispatchMode):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.ops: list[str] = []

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                try:
                    if len(self.ops) < _MAX_OPS:
                        self.ops.append(func.__name__.split(".")[0])
                except Exception as exc:
                    spy._fail("ops", exc)
                return func(*args, **(kwargs or {}))

        class _Fn(TorchFunctionMode):  # type: ignore[misc]
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func is not F.scaled_dot_product_attention:
                    return func(*args, **kwargs)
                return spy._observe(func, args, kwargs, _Ops)

        mode = _Fn()
        mode.__enter__()
        self._modes = [mode]
        return self

    def __exit__(self, *exc: Any) -> None:
        modes, self._modes = self._modes, []
        if modes:
            modes[0].__exit__(*exc)

    def _fail(self, place: str, exc: BaseException) -> None:
        try:
            if len(self.errors) < _MAX_ERRORS:
                self.errors.append(f"{place}: {type(exc).__name__}: {exc}")
        except Exception:
            self.errors.append(f"{place}: {type(exc).__name__}")

    def _observe(self, func: Any, args: Any, kwargs: dict[str, Any], ops_mode: Any) -> Any:
        """Run one SDPA call exactly once, recording it when the spy's own steps succeed."""
        try:
            call = self._describe(args, kwargs)
            ops = ops_mode()
            ops.__enter__()  # if this raises, nothing of ours is on the mode stack to pop
        except Exception as exc:
            self._fail("spy", exc)
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        finally:
            try:
                ops.__exit__(None, None, None)
            except Exception as exc:
                self._fail("ops", exc)
        try:
            if call is not None:
                call.ops = ops.ops
                call.op = next((o for o in ops.ops if o in FUSED_OPS), None)
                self.calls.append(call)
        except Exception as exc:
            self._fail("spy", exc)
        return out

    def _describe(self, args: Any, kwargs: dict[str, Any]) -> SDPACall | None:
        try:
            names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
            a = dict(zip(names, args, strict=False))
            a.update(kwargs)
            q, k, v = a["query"], a["key"], a["value"]
            mask = a.get("attn_mask")
            p = float(a.get("dropout_p", 0.0) or 0.0)
            causal = bool(a.get("is_causal", False))
            gqa = bool(a.get("enable_gqa", False))
            choice = (sdpa_choice(q, k, v, mask, p, causal, a.get("scale"), gqa)
                      if self.explain else SDPAChoice("unknown", False))
            return SDPACall(
                tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype).removeprefix("torch."),
                None if mask is None else ("bool" if mask.dtype.is_floating_point is False
                                           else "float"),
                None if mask is None else tuple(mask.shape), p, causal, gqa, choice)
        except Exception as exc:  # describing must never break the host call
            self._fail("describe", exc)
            return None


class OpRecorder:
    """Context manager recording the names of the first aten ops that run inside it (a
    ``TorchDispatchMode`` that passes every op through unchanged). For attention modules
    that do not go through transformers' registry: their ops are the ground truth of what
    ran. A failure of its own is kept in ``errors``; the op still runs exactly once."""

    def __init__(self, limit: int = _MAX_OPS) -> None:
        self.ops: list[str] = []
        self.errors: list[str] = []
        self.limit = limit
        self._mode: Any = None

    def __enter__(self) -> OpRecorder:
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class _Ops(TorchDispatchMode):  # type: ignore[misc]
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                try:
                    if len(rec.ops) < rec.limit:
                        rec.ops.append(func.__name__.split(".")[0])
                except Exception as exc:
                    if len(rec.errors) < _MAX_ERRORS:
                        rec.errors.append(f"ops: {type(exc).__name__}: {exc}")
                return func(*args, **(kwargs or {}))

        mode = _Ops()
        mode.__enter__()
        self._mode = mode
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)
