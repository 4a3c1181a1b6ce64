"""The one masked attention that replays run in place of the model's own (sinks + window
replay, head edits): causal, the model's own sliding window and padding kept, an optional
sinks + window restriction on chosen layers. Registered as a transformers attention function.

Every tensor it creates is made on the input's device (a replay on CUDA must not build its
position tensors on the CPU); ``tests/unit/tools/test_masked_attention.py`` runs it on the ``meta``
device to prove it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReplayError", "allowed_mask", "masked_attention"]


class ReplayError(RuntimeError):
    """Replay cannot run on this model/input; one line."""


def allowed_mask(lq: int, lk: int, device: Any, attention_mask: Any = None,
                 native_window: int | None = None, window: int | None = None,
                 sinks: int = 0) -> Any:
    """``[.., lq, lk]`` boolean mask of the keys each query may see: causal (the queries are
    the last ``lq`` of ``lk`` positions), the model's own window (HF semantics: ``j > pos - w``)
    and padding from a boolean ``attention_mask`` kept; with ``window``, only the first
    ``sinks`` keys and the last ``window`` ones."""
    import torch

    pos = torch.arange(lk - lq, lk, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    allowed = j <= pos
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        allowed = allowed & attention_mask[..., -lk:]  # padding, if any
    if native_window:  # the model's own window stays in every run
        allowed = allowed & (j > pos - int(native_window))
    if window is not None:
        allowed = allowed & ((j < sinks) | (j > pos - window))
    return allowed


def masked_attention(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, *,
                     scaling: float | None = None, softcap: float | None = None,
                     window: int | None = None, sinks: int = 0, what: str = "replay",
                     **kw: Any) -> Any:
    """SDPA over ``allowed_mask``: ``[B, Hq, Lq, D]`` (not yet transposed, so a caller can
    edit heads). Raises :class:`ReplayError` for softcapping and learned sinks, which a
    boolean mask cannot reproduce."""
    import torch

    if softcap:
        raise ReplayError(f"{what} does not support logit softcapping")
    if getattr(module, "sinks", None) is not None:
        raise ReplayError(f"{what} does not support learned attention sinks")
    allowed = allowed_mask(q.shape[2], k.shape[2], q.device, attention_mask,
                           kw.get("sliding_window"), window, sinks)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
