"""The vLLM backend report's one shape: the question asked for one layer (:class:`Layer`) and
the report both of its sources fill: vLLM's own answer on the device a process runs on
(:mod:`attnprof.capture.vllm.backends`) and the derived matrix for any other target
(:func:`attnprof.analyze.vllm_backends.from_matrix`). Pure: no vLLM, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Layer", "finish", "new_report"]


@dataclass
class Layer:
    """The selector's inputs for one layer (vLLM's own ``AttentionSelectorConfig`` when the
    caller has it; otherwise built from the layer's facts)."""

    num_heads: int
    head_size: int
    dtype: Any
    kv_cache_dtype: str | None
    block_size: int | None
    has_sink: bool
    sliding_window: int | None
    selector: Any = None
    requires_alibi: bool = False
    requires_softcap: bool = False

    @property
    def attn_type(self) -> str:
        t = getattr(self.selector, "attn_type", None) or "decoder"
        return str(getattr(t, "value", t))

    @property
    def decoder_grid(self) -> bool:
        """Within the derived grid's assumptions (decoder self-attention, no mm prefix)."""
        sel = self.selector
        return self.attn_type == "decoder" and not getattr(sel, "use_mm_prefix", False)


def new_report(lay: Layer, num_kv_heads: int, selected: str | None,
               device_capability: tuple[int, int] | None) -> dict[str, Any]:
    """The report for ``lay`` before any source answered (``valid`` None)."""
    return {
        "layer": {"num_heads": lay.num_heads, "num_kv_heads": num_kv_heads,
                  "head_size": lay.head_size, "dtype": str(lay.dtype).removeprefix("torch."),
                  "kv_cache_dtype": lay.kv_cache_dtype, "sliding_window": lay.sliding_window,
                  "has_sink": lay.has_sink, "block_size": lay.block_size,
                  "attn_type": lay.attn_type},
        "selected": selected, "backends": {}, "valid": None, "predicted": None,
        "flash_attn_version": None, "source": None, "note": None,
        "vllm_version": None, "platform": None,
        "device_capability": list(device_capability) if device_capability else None,
    }


def finish(out: dict[str, Any], backends: dict[str, dict[str, Any]]) -> None:
    """Fill ``out`` from a source's per-backend answers: sorted by priority, ``valid`` and
    ``predicted`` (the first valid one: what vLLM picks without ``--attention-backend``)."""
    out["backends"] = dict(sorted(backends.items(), key=lambda kv: kv[1]["priority"]))
    out["valid"] = [n for n, e in out["backends"].items() if e["valid"]]
    out["predicted"] = out["valid"][0] if out["valid"] else None
