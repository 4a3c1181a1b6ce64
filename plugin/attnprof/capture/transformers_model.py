"""How a transformers model is laid out, as the wrapper needs it: each module's layer site
(index, stack, self/cross), attention modules that bypass the registry, the configs that
choose the attention implementation, and a module's eager attention function.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["configs", "eager_fn", "encoder_decoder", "site", "unrouted"]

_LAYER_RE = re.compile(r"\.(\d+)(?:\.|$)")
# Module-name segments of cross-attention in transformers' modeling files (BART/Marian/
# Whisper/mBART: encoder_attn; BERT/RoBERTa as decoders: crossattention; T5: EncDecAttention;
# others: cross_attn / cross_attention), lower-cased.
_CROSS_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attn", "cross_attention",
                          "encdecattention"})
_STACKS = ("encoder", "decoder")


def site(name: str, module: Any, two_stacks: bool) -> tuple[int, str | None, str]:
    """(layer index from the name, stack, kind) of the module at ``name``."""
    m = _LAYER_RE.search(name)
    parts = name.split(".")
    stack = next((p for p in parts if p in _STACKS), None) if two_stacks else None
    cross = (getattr(module, "is_cross_attention", False) is True
             or any(p.lower() in _CROSS_NAMES for p in parts))
    return (int(m.group(1)) if m else -1, stack, "cross" if cross else "self")


def unrouted(mod: Any) -> bool:
    """An attention module whose modeling file does not use the registry."""
    if not type(mod).__name__.endswith("Attention") or not hasattr(mod, "forward"):
        return False
    owner = sys.modules.get(type(mod).__module__)
    return owner is not None and str(getattr(owner, "__name__", "")).startswith(
        "transformers.models.") and not hasattr(owner, "ALL_ATTENTION_FUNCTIONS")


def encoder_decoder(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "is_encoder_decoder", False))


def configs(model: Any) -> list[Any]:
    """Every distinct config object that attention modules of ``model`` may read."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            seen.setdefault(id(cfg), cfg)
            for sub in getattr(cfg, "sub_configs", {}) or {}:
                sc = getattr(cfg, sub, None)
                if sc is not None and hasattr(sc, "_attn_implementation_internal"):
                    seen.setdefault(id(sc), sc)
    return list(seen.values())


def eager_fn(module: Any) -> Callable[..., Any]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"attnprof: {type(module).__name__} has no eager_attention_forward "
                           f"in its modeling module; cannot wrap attn_implementation='eager'")
    return fn  # type: ignore[no-any-return]
