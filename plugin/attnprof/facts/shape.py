"""A model's attention shape from its Hugging Face config: the one reader every room uses.

Per-layer sliding windows follow what transformers (5.x) derives in each config class's
``__post_init__`` and what its modeling code then reads, checked in this order:

1. No window: ``sliding_window`` (older Gemma3/Cohere2: ``interleaved_sliding_window``) is
   missing, null or 0, and the family has no class default (:data:`FAMILIES`); or
   ``use_sliding_window`` is false. The Qwen2/Qwen3 family (and SmolLM3) default it to
   false, so a Qwen config without the key has no window whatever ``sliding_window`` says.
2. Mistral, Mixtral, Phi-3, PhiMoE, Starcoder2, Qwen3-MoE: every layer is windowed; their
   modeling code never reads ``layer_types``.
3. ``layer_types`` (every config transformers writes now): windowed where the type is
   ``sliding_attention``. ``chunked_attention`` (Llama 4) and ``linear_attention`` are not
   sliding windows and count as full here.
4. Without ``layer_types``, the family's default pattern (:data:`FAMILIES`): Gemma2,
   VaultGemma, GPT-OSS windows even layers; Gemma3 (``sliding_window_pattern``, default 6),
   Cohere2 (default 4), Exaone4 (default 4; also a string like ``"LLLG"``) window layer i
   unless ``(i + 1) % pattern == 0``; Gemma4 (6, and its last layer is always full),
   Gemma3n (5), OLMo3 (4) likewise with a fixed pattern; CWM keeps every 4th layer from 0
   full; Qwen2/Qwen3/Qwen2-VL/dots1 window layers ``i >= max_window_layers`` (class defaults
   28, 80, 62); Qwen2-MoE windows even layers ``i < max_window_layers``; SmolLM3 windows
   its NoPE layers (``no_rope_layers[i] == 0``, default every 4th).
5. Otherwise an int ``sliding_window_pattern`` as in 4, else every layer is windowed.

Gemma3/Gemma4 with bidirectional attention (embedding models) halve the window the way
their config class does (``w // 2 + 1``). Per-layer configs (transformers' heterogeneous
``per_layer_config``) are not read.

The window is the number of most recent keys a query sees, itself included (transformers'
``sliding_window_overlay``: key j is visible from query i when ``i - w < j <= i``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attnprof.facts.dtypes import dtype_bytes, dtype_name
from attnprof.facts.kv import kv_bytes_per_token

__all__ = ["FAMILIES", "AttentionShape", "Family", "ShapeError", "layer_label", "layer_windows",
           "site_order"]

_STACK_ORDER = {None: 0, "encoder": 1, "decoder": 2}


def layer_label(index: int, stack: str | None = None, kind: str = "self") -> str:
    """One attention site's name in every output: ``L3`` (one stack, self-attention),
    ``encoder.L3``/``decoder.L3`` (encoder-decoder self-attention), ``decoder.L3.cross``
    (cross-attention), ``L3.cross`` (cross-attention in a single-stack model)."""
    out = f"L{index}" if stack is None else f"{stack}.L{index}"
    return out if kind == "self" else f"{out}.{kind}"


def site_order(stack: str | None, index: int, kind: str = "self") -> tuple[int, str, int, int]:
    """Sort key of a site in model order: encoder layers, then each decoder layer's
    self-attention followed by its cross-attention."""
    return (_STACK_ORDER.get(stack, 3), stack or "", index, 0 if kind == "self" else 1)


class ShapeError(ValueError):
    """The config lacks a field the shape needs (message: one line naming it)."""


def _as_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        d = dict(to_dict())
        # Canonical names of renamed fields (GPT-2's n_layer, T5's d_kv, BART's encoder_*):
        # transformers maps them through the class's attribute_map, not in to_dict().
        for k, src in (getattr(cfg, "attribute_map", None) or {}).items():
            if d.get(k) is None and d.get(src) is not None:
                d[k] = d[src]
        # Derived attributes (layer_types, ...) live on the object, not always in to_dict().
        for k in ("layer_types", "sliding_window", "head_dim", "text_config"):
            v = getattr(cfg, k, None)
            if v is not None and d.get(k) is None:
                d[k] = v.to_dict() if k == "text_config" and hasattr(v, "to_dict") else v
        return d
    return dict(vars(cfg))


# Field names of families that predate transformers' common names, as their config classes'
# ``attribute_map`` aliases them (GPT-2; T5; BART and other encoder-decoders: the encoder's).
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("n_layer", "num_layers", "encoder_layers"),
    "num_attention_heads": ("n_head", "num_heads", "encoder_attention_heads"),
    "hidden_size": ("n_embd", "d_model"),
    "head_dim": ("d_kv",),
    "max_position_embeddings": ("n_positions",),
}


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
    n_params: float | None = None
    """Parameter count (from the safetensors headers: :meth:`from_model_dir`), for
    attention's share of a step's FLOPs (~2 N per token elsewhere); None: unknown."""
    name: str = ""
    """The model's name in outputs (:meth:`from_model_dir`: its directory's name)."""

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype, 2)

    @property
    def group_size(self) -> int:
        return max(1, self.num_heads // max(1, self.num_kv_heads))

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def full_layers(self) -> list[int]:
        """Layers with full attention (no sliding window)."""
        return [i for i in range(self.num_layers) if self.window(i) is None]

    @property
    def hybrid(self) -> bool:
        """Some layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def flops_per_pair(self) -> int:
        """Attention FLOPs per query-key pair, every query head: QK^T and PV, 2 each."""
        return 4 * self.head_dim * self.num_heads

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if self.window(i) else "full_attention"
                for i in range(self.num_layers)]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer: ``2 * Hkv * D * s``."""
        return kv_bytes_per_token(self.num_kv_heads, self.head_dim, self.dtype, default=2)

    @classmethod
    def from_config(cls, cfg: Any) -> AttentionShape:
        """From a config.json dict or a transformers ``PretrainedConfig``."""
        outer = _as_dict(cfg)
        text = outer.get("text_config")
        c = {**_as_dict(text)} if text else outer
        for name, aliases in _ALIASES.items():  # config.json keeps the family's own names
            alias = next((a for a in aliases if c.get(a) is not None), None)
            if c.get(name) is None and alias is not None:
                c[name] = c[alias]
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
    def from_model_dir(cls, path: Path, name: str = "") -> AttentionShape:
        """From ``path/config.json`` (no transformers needed) and the parameter count in the
        safetensors headers (no weights are read); ``name`` defaults to the directory's."""
        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise ShapeError(f"cannot read {path / 'config.json'}: {err}") from None
        return replace(cls.from_config(cfg), n_params=_count_params(path),
                       name=name or path.name)


def _count_params(path: Path) -> float | None:
    """Parameter count from safetensors headers (None: no safetensors, or one unreadable)."""
    total = 0
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for k, v in header.items():
            if k != "__metadata__":
                total += math.prod(v["shape"])
    return float(total) if files else None


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` lays out windows when its config has no ``layer_types``."""

    sliding: Callable[[int, Mapping[str, Any]], bool] | None = None
    """Layer i is windowed (None: every layer)."""
    window: int | None = None
    """The config class's default ``sliding_window`` when the key is absent."""
    gated: bool = False
    """``use_sliding_window`` defaults to false (Qwen family): no window unless it is true."""
    every_layer: bool = False
    """Modeling code windows every layer and ignores ``layer_types`` (Mistral family)."""
    last_full: bool = False
    """The config class forces the last layer to full attention (Gemma4)."""


def _every(n: int, default: int | None = None) -> Callable[[int, Mapping[str, Any]], bool]:
    """Windowed unless ``(i + 1) % pattern == 0``; the pattern comes from the config's
    ``sliding_window_pattern`` when ``default`` is given, else it is fixed at ``n``."""
    def sliding(i: int, c: Mapping[str, Any]) -> bool:
        pat = c.get("sliding_window_pattern") if default is not None else None
        if isinstance(pat, str) and pat:  # Exaone4: "LLLG"; the last layer is always full
            return pat[i % len(pat)].upper() == "L" and i != int(c["num_hidden_layers"]) - 1
        p = int(pat) if isinstance(pat, int) and pat > 0 else n
        return p <= 0 or (i + 1) % p != 0
    return sliding


def _from_max_window_layers(default: int) -> Callable[[int, Mapping[str, Any]], bool]:
    def sliding(i: int, c: Mapping[str, Any]) -> bool:
        mwl = c.get("max_window_layers")
        return i >= (default if mwl is None else int(mwl))
    return sliding


def _qwen2_moe(i: int, c: Mapping[str, Any]) -> bool:
    mwl = c.get("max_window_layers")
    return i % 2 == 0 and i < (28 if mwl is None else int(mwl))


def _smollm3(i: int, c: Mapping[str, Any]) -> bool:
    nope = c.get("no_rope_layers")
    if isinstance(nope, Sequence) and i < len(nope):
        return not nope[i]
    return (i + 1) % int(c.get("no_rope_layer_interval") or 4) == 0


_EVEN = _every(2)
FAMILIES: dict[str, Family] = {
    "gemma2": Family(_EVEN, 4096), "vaultgemma": Family(_EVEN, 4096),
    "gpt_oss": Family(_EVEN, 128),
    "gemma3": Family(_every(6, 6), 4096), "gemma3_text": Family(_every(6, 6), 4096),
    "gemma4": Family(_every(6), 512, last_full=True),
    "gemma4_text": Family(_every(6), 512, last_full=True),
    "gemma3n": Family(_every(5), 512), "gemma3n_text": Family(_every(5), 512),
    "cohere2": Family(_every(4, 4), 4096), "exaone4": Family(_every(4, 4), 4096),
    "olmo3": Family(_every(4), 4096),
    "cwm": Family(lambda i, _c: i % 4 != 0, 8192),
    "qwen2": Family(_from_max_window_layers(28), 4096, gated=True),
    "qwen3": Family(_from_max_window_layers(28), 4096, gated=True),
    "qwen2_vl": Family(_from_max_window_layers(80), 4096, gated=True),
    "qwen2_vl_text": Family(_from_max_window_layers(80), 4096, gated=True),
    "qwen2_5_vl": Family(_from_max_window_layers(80), 4096, gated=True),
    "qwen2_5_vl_text": Family(_from_max_window_layers(80), 4096, gated=True),
    "dots1": Family(_from_max_window_layers(62), 4096),
    "qwen2_moe": Family(_qwen2_moe, 4096, gated=True),
    "qwen3_moe": Family(None, 4096, gated=True, every_layer=True),
    "smollm3": Family(_smollm3, None, gated=True),
    "mistral": Family(None, 4096, every_layer=True),
    "mixtral": Family(None, None, every_layer=True),
    "phi3": Family(None, None, every_layer=True),
    "phimoe": Family(None, None, every_layer=True),
    "starcoder2": Family(None, None, every_layer=True),
    "llama4": Family(lambda _i, _c: False), "llama4_text": Family(lambda _i, _c: False),
}
"""Families whose defaults differ from "every layer windowed when ``sliding_window`` is set",
read off each ``configuration_*.py`` of transformers 5.x (tests/unit/facts/test_facts.py builds the
config classes and checks the reader against the ``layer_types`` they derive)."""


def layer_windows(c: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window under the conventions in the module docstring."""
    fam = FAMILIES.get(str(c.get("model_type") or ""), Family())
    if "sliding_window" in c or "interleaved_sliding_window" in c:
        raw = c.get("sliding_window") or c.get("interleaved_sliding_window")
    else:
        raw = fam.window
    sw = int(raw) if isinstance(raw, (int, float)) and raw > 0 else None
    use = c.get("use_sliding_window")
    if sw is None or use is False or (fam.gated and not use):
        return ()
    if c.get("use_bidirectional_attention") in (True, "all"):
        sw = sw // 2 + 1
    types = c.get("layer_types")
    if fam.every_layer:
        out: tuple[int | None, ...] = tuple(sw for _ in range(layers))
    elif isinstance(types, Sequence) and not isinstance(types, str) and len(types) == layers:
        out = tuple(sw if t == "sliding_attention" else None for t in types)
    elif fam.sliding is not None:
        out = tuple(sw if fam.sliding(i, c) else None for i in range(layers))
    elif isinstance(c.get("sliding_window_pattern"), (int, str)):
        rule = _every(0, 0)
        out = tuple(sw if rule(i, c) else None for i in range(layers))
    else:
        out = tuple(sw for _ in range(layers))
    if fam.last_full and out:
        out = (*out[:-1], None)
    return out if any(w is not None for w in out) else ()
