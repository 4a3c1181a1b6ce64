"""The ``model`` label on every metric: the name clients use for the model."""

from __future__ import annotations

from typing import Any

__all__ = ["UNKNOWN", "model_label"]

UNKNOWN = "unknown"


def model_label(model_config: Any) -> str:
    """First served model name of a vLLM ``ModelConfig`` (what clients send as ``model``),
    else its model path; ``"unknown"`` when neither is set. Never raises."""
    try:
        names = getattr(model_config, "served_model_name", None) or getattr(
            model_config, "model", None)
        if isinstance(names, (list, tuple)):
            names = names[0] if names else None
        return str(names) if names else UNKNOWN
    except Exception:
        return UNKNOWN
