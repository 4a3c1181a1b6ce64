"""A model's attention shape from its Hugging Face config: the one reader every room uses.

Sliding-window conventions transformers uses, in the order they are checked (the first that
applies wins, as transformers derives ``layer_types`` itself):

1. ``layer_types`` (new configs: Gemma2/3, Cohere2, Qwen2/3, GPT-OSS, ...): windowed where
   the type is ``sliding_attention``. ``chunked_attention`` (Llama 4) is not a sliding
   window and counts as full here.
2. ``use_sliding_window: false`` (Qwen2 family): no window, whatever ``sliding_window`` says.
3. ``use_sliding_window: true`` + ``max_window_layers`` (Qwen2 family): layers with index
   >= ``max_window_layers`` are windowed.
4. ``sliding_window_pattern`` (Gemma3: 6, Cohere2: 4): layer i is windowed unless
   ``(i + 1) % pattern == 0``. Older Gemma3/Cohere2 configs call the window
   ``interleaved_sliding_window``.
5. ``model_type`` ``gemma2`` without ``layer_types``: even layers are windowed.
6. ``sliding_window`` alone (Mistral, Phi-3, Starcoder2): every layer is windowed.

The window is the number of most recent keys a query sees, itself included (transformers'
``sliding_window_overlay``: key j is visible from query i when ``i - w < j <= i``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprof.facts.dtypes import dtype_bytes, dtype_name

__all__ = ["AttentionShape", "ShapeError"]


class ShapeError(ValueError):
    """The config lacks a field the shape needs (message: one line naming it)."""


def _as_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        d = dict(to_dict())
        # Derived attributes (layer_types, ...) live on the object, not always in to_dict().
        for k in ("layer_types", "sliding_window", "head_dim", "text_config"):
            v = getattr(cfg, k, None)
            if v is not None and d.get(k) is None:
                d[k] = v.to_dict() if k == "text_config" and hasattr(v, "to_dict") else v
        return d
    return dict(vars(cfg))


@dataclass(frozen=True)
class AttentionShape:
    """What attention costs depend on, per model (text tower of multimodal models)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    layer_windows: tuple[int | None, ...] = field(default=())
    """Sliding window per layer (None: full attention); empty means every layer is full."""
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    model_type: str = ""

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype, 2)

    @property
    def group_size(self) -> int:
        return max(1, self.num_heads // max(1, self.num_kv_heads))

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if self.window(i) else "full_attention"
                for i in range(self.num_layers)]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer: ``2 * Hkv * D * s``."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, cfg: Any) -> AttentionShape:
        """From a config.json dict or a transformers ``PretrainedConfig``."""
        outer = _as_dict(cfg)
        text = outer.get("text_config")
        c = {**_as_dict(text)} if text else outer
        try:
            layers = int(c["num_hidden_layers"])
            hq = int(c["num_attention_heads"])
            hkv = int(c.get("num_key_value_heads") or hq)
            d = int(c.get("head_dim") or int(c["hidden_size"]) // hq)
        except KeyError as err:
            raise ShapeError(f"model config has no {err.args[0]!r}") from None
        dtype = dtype_name(c.get("dtype") or c.get("torch_dtype") or outer.get("dtype")
                           or outer.get("torch_dtype") or "bfloat16")
        vocab = c.get("vocab_size") or outer.get("vocab_size")
        mpe = c.get("max_position_embeddings")
        return cls(layers, hq, hkv, d, dtype, layer_windows(c, layers),
                   int(vocab) if vocab else None, int(mpe) if mpe else None,
                   str(c.get("model_type") or outer.get("model_type") or ""))

    @classmethod
    def from_model_dir(cls, path: Path) -> AttentionShape:
        """From ``path/config.json`` (no transformers needed)."""
        try:
            cfg = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise ShapeError(f"cannot read {Path(path) / 'config.json'}: {err}") from None
        return cls.from_config(cfg)


def layer_windows(c: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window under the conventions in the module docstring."""
    sw = c.get("sliding_window") or c.get("interleaved_sliding_window")
    sw = int(sw) if isinstance(sw, (int, float)) and sw > 0 else None
    types = c.get("layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str) and len(types) == layers:
        if sw is None:
            return ()
        out = tuple(sw if t == "sliding_attention" else None for t in types)
        return out if any(out) else ()
    if sw is None or c.get("use_sliding_window") is False:
        return ()
    if c.get("use_sliding_window"):
        first = int(c.get("max_window_layers") or 0)
        return tuple(sw if i >= first else None for i in range(layers))
    pattern = c.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return tuple(None if (i + 1) % pattern == 0 else sw for i in range(layers))
    if c.get("model_type") == "gemma2":
        return tuple(sw if i % 2 == 0 else None for i in range(layers))
    return tuple(sw for _ in range(layers))
