"""What ``attnprof profile`` feeds each model family at a given sequence length.

The profile sweeps one length ``L`` per run; this module turns it into the family's inputs:

- **text** (decoder-only LMs, encoder-only models like BERT): ``input_ids`` of length ``L``
  (random ids, no text) with the attention mask when padding is asked for.
- **encoder-decoder** (BART, T5, ...): the encoder reads ``L`` tokens and the decoder
  :func:`decoder_len` ``(L)`` = ``ceil(L / 2)`` tokens, so that cross-attention (queries from
  the decoder, keys/values from the encoder) has a KV length that differs from its query
  length and the accounting can be checked to use the encoder's.
- **vision** (ViT-style patch encoders): the sequence is ``(side / patch)^2`` patches plus
  the class token, set by the image size. ``L`` must be ``n^2 + 1``; the image side is then
  ``n * patch_size`` and the position embeddings are interpolated to it
  (``interpolate_pos_encoding``). Any other ``L`` is refused with the nearest valid lengths.

Pure functions over a transformers config and torch tensors; nothing is downloaded.
"""

from __future__ import annotations

import math
from typing import Any, Literal

__all__ = ["Kind", "can_run", "check_positions", "check_seq_lens", "decoder_len", "forward",
           "forward_kwargs", "inputs_note", "model_kind", "patch_grid", "position_limit",
           "random_ids"]

Kind = Literal["text", "encoder_decoder", "vision"]


def model_kind(cfg: Any) -> Kind:
    """The family of inputs a config's model takes."""
    if bool(getattr(cfg, "is_encoder_decoder", False)):
        return "encoder_decoder"
    if getattr(cfg, "patch_size", None) and getattr(cfg, "image_size", None) \
            and not getattr(cfg, "vocab_size", None):
        return "vision"
    return "text"


def decoder_len(seq_len: int) -> int:
    """The decoder's length when the encoder reads ``seq_len`` tokens."""
    return max(1, (seq_len + 1) // 2)


def patch_grid(cfg: Any, seq_len: int) -> int | None:
    """Patches per image side for a vision model's sequence length (``n^2 + 1`` with the
    class token), or None when no square grid gives ``seq_len``."""
    n = math.isqrt(max(0, seq_len - 1))
    return n if n >= 1 and n * n + 1 == seq_len else None


def can_run(cfg: Any, seq_len: int) -> bool:
    """Whether the model's inputs can have exactly ``seq_len`` positions."""
    return model_kind(cfg) != "vision" or patch_grid(cfg, seq_len) is not None


def check_seq_lens(cfg: Any, seq_lens: list[int]) -> None:
    """Raise ValueError (one line) for lengths the model's inputs cannot have."""
    if model_kind(cfg) != "vision":
        return
    for L in seq_lens:
        if patch_grid(cfg, L) is None:
            n = max(1, math.isqrt(max(0, L - 1)))
            near = sorted({n * n + 1, (n + 1) ** 2 + 1})
            native = (int(cfg.image_size) // int(cfg.patch_size)) ** 2 + 1
            raise ValueError(
                f"--seq-lens {L}: a vision model's sequence is n^2 patches + 1 class token, "
                f"set by the image size; use e.g. {near[0]} or {near[1]} (this config's "
                f"{cfg.image_size}px images give {native})")


# Tables indexed by absolute position: GPT-2/GPT-Neo ``wpe``, BERT ``position_embeddings``,
# BART/OPT ``embed_positions`` (an nn.Embedding with ``offset`` 2).
_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")


def position_limit(model: Any) -> int | None:
    """The most positions a model with learned absolute position embeddings can index (an
    ``nn.Embedding`` table looked up by position, less its offset), or None when positions
    are rotary, relative or interpolated (Llama, T5, ViT) and a longer input still runs."""
    from torch import nn

    cfg = getattr(model, "config", None)
    if model_kind(cfg) == "vision":  # a Parameter, interpolated to the image size
        return None
    # BERT-style configs keep the table but skip it for relative position types.
    if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
        return None
    limits = [int(m.num_embeddings) - int(getattr(m, "offset", 0) or 0)
              for name, m in model.named_modules()
              if isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES]
    return min(limits) if limits else None


def check_positions(model: Any, seq_lens: list[int]) -> None:
    """Raise ValueError (one line) for lengths past a learned position table: the forward
    would index past it."""
    limit = position_limit(model)
    over = [L for L in seq_lens if limit is not None and limit < L]
    if over:
        raise ValueError(
            f"--seq-lens {max(over)}: this model has learned absolute position embeddings "
            f"for {limit} positions; use lengths up to {limit}")


def forward_kwargs(model: Any, ids: Any, mask: Any = None) -> dict[str, Any]:
    """The model's forward arguments for a ``(B, L)`` block of random ids: the ids
    themselves (text), split into encoder and decoder inputs (encoder-decoder), or a
    seeded random image whose patch sequence has length ``L`` (vision)."""
    import torch

    cfg = model.config
    kind = model_kind(cfg)
    B, L = int(ids.shape[0]), int(ids.shape[1])
    if kind == "vision":
        n = patch_grid(cfg, L)
        if n is None:
            raise ValueError(f"sequence length {L} is not n^2 + 1 patches")
        side = n * int(cfg.patch_size)
        g = torch.Generator().manual_seed(L)
        px = torch.randn(B, int(getattr(cfg, "num_channels", 3)), side, side, generator=g,
                         dtype=next(model.parameters()).dtype)
        return {"pixel_values": px, "interpolate_pos_encoding": True}
    if kind == "encoder_decoder":
        return {"input_ids": ids, "attention_mask": mask,
                "decoder_input_ids": ids[:, :decoder_len(L)], "use_cache": True}
    return {"input_ids": ids, "attention_mask": mask, "use_cache": True}


def inputs_note(cfg: Any) -> str:
    """profile.json's ``run.inputs`` for this family."""
    kind = model_kind(cfg)
    if kind == "vision":
        return ("random images (no data): seq_len = n^2 patches + 1 class token, image side "
                "n * patch_size, position embeddings interpolated")
    if kind == "encoder_decoder":
        return ("random token ids (no text): the encoder reads seq_len tokens, the decoder "
                "ceil(seq_len / 2); cross-attention's KV length is the encoder's")
    return "random token ids (no text)"


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> Any:
    """``[batch, length]`` token ids drawn uniformly from the vocabulary (no text: attention
    cost does not depend on token values), reproducible by ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, vocab), (batch, length), generator=g)


def forward(model: Any, ids: Any, mask: Any = None) -> Any:
    """One no-grad forward of ``model`` on ``ids`` with the family's inputs."""
    import torch

    with torch.no_grad():
        return model(**forward_kwargs(model, ids, mask))
