"""Replay a transformers model with some heads' outputs replaced (``attnprof validate-heads``).

Each edit replaces one query head's attention output (softmax(qK^T) V for that head, before
the output projection) at every position:

* ``mean``: by that head's mean output over every position of the same prompts, computed in
  a first, unedited pass (for dormant and near-uniform heads: what pruning the head and
  folding its average into the output projection's bias would give);
* ``twin``: by the output of another query head of the same layer (for redundant heads).

Each prompt runs once unedited (the base) and once per edit set; the comparison is
teacher-forced on the base's token ids at every position: greedy agreement = share of
positions whose argmax next token is the same, and KL(base || edited) of the next-token
distributions in nats, per position. An edit is ``safe`` only when agreement >=
``target_agreement`` (0.99), mean KL <= ``max_kl`` (0.01) and at least ``min_positions``
positions were compared. The safe edits are then replayed together (``combined``): heads
that are harmless one at a time can add up.

Attention runs through a registered function (transformers' attention registry), plain
scaled softmax with the causal mask (and a model's own sliding window); softcapping and
learned sinks are refused, as in :mod:`attnprof.tools.replay`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from attnprof.tools.masked_attention import ReplayError, masked_attention

__all__ = ["HeadEdit", "edits_from_findings", "parse_heads", "replay_heads"]

_IMPL = "attnprof_head_replay"
TARGET_AGREEMENT = 0.99
MAX_KL = 0.01
MIN_POSITIONS = 64


@dataclass(frozen=True)
class HeadEdit:
    layer: int
    head: int
    twin: int | None = None
    """None: replace by the head's mean output; else by this head's output."""
    kind: str = ""
    """The finding it tests (dormant, near_uniform, redundant) or "given"."""

    @property
    def label(self) -> str:
        return f"{self.layer}.{self.head}" + ("" if self.twin is None else f"~{self.twin}")


_SPEC = re.compile(r"^\s*(\d{1,6})\.(\d{1,6})(?:~(\d{1,6}))?\s*$")


def parse_heads(spec: str, num_layers: int, num_heads: int) -> list[HeadEdit]:
    """``'3.2,5.1~0'``: layer 3 head 2 by its mean output, layer 5 head 1 by head 0's
    output. :class:`ReplayError` (one line) for bad syntax or a head outside the model."""
    shown = spec if len(spec) <= 60 else spec[:57] + "..."
    out: list[HeadEdit] = []
    for part in spec.split(","):
        if not part.strip():
            continue
        m = _SPEC.match(part)
        if m is None:
            raise ReplayError(f"--heads {shown!r}: expected LAYER.HEAD or LAYER.HEAD~TWIN, "
                              "e.g. '3.2,5.1~0'")
        layer, head = int(m[1]), int(m[2])
        twin = None if m[3] is None else int(m[3])
        if layer >= num_layers or head >= num_heads or (twin is not None
                                                        and twin >= num_heads):
            raise ReplayError(f"--heads {shown!r}: the model has layers 0..{num_layers - 1} "
                              f"and heads 0..{num_heads - 1}")
        if twin == head:
            raise ReplayError(f"--heads {shown!r}: head {layer}.{head} cannot be its own twin")
        out.append(HeadEdit(layer, head, twin, "given"))
    if not out:
        raise ReplayError(f"--heads {shown!r}: no heads given")
    if len({(e.layer, e.head) for e in out}) != len(out):
        raise ReplayError(f"--heads {shown!r}: a head is listed twice")
    return out


def edits_from_findings(findings: Sequence[dict[str, Any]]) -> list[HeadEdit]:
    """One edit per underused-head finding (mean for dormant/near-uniform, twin for
    redundant)."""
    return [HeadEdit(int(f["layer"]), int(f["head"]),
                     None if f.get("twin") is None else int(f["twin"]), str(f["kind"]))
            for f in findings]


@dataclass
class _State:
    collect: bool = False
    edits: dict[int, list[HeadEdit]] = field(default_factory=dict)
    sums: dict[tuple[int, int], Any] = field(default_factory=dict)
    counts: dict[tuple[int, int], int] = field(default_factory=dict)


def _register(state: _State) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    def attn(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, *,
             scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
             **kw: Any) -> tuple[Any, None]:
        out = masked_attention(module, q, k, v, attention_mask, scaling=scaling,
                               softcap=softcap, what="head replay", **kw)
        lq = q.shape[2]
        layer = int(module.layer_idx)
        edits = state.edits.get(layer, ())
        if edits and state.collect:  # [B, Hq, L, D]: sum over positions, mean later
            for e in edits:
                if e.twin is None:
                    key = (layer, e.head)
                    s = out[:, e.head].sum((0, 1)).double()
                    state.sums[key] = s if key not in state.sums else state.sums[key] + s
                    state.counts[key] = state.counts.get(key, 0) + out.shape[0] * lq
        elif edits:
            orig = out.clone()  # a twin's own output, even if it is edited too
            for e in edits:
                if e.twin is None:
                    key = (layer, e.head)
                    out[:, e.head] = (state.sums[key] / state.counts[key]).to(out.dtype)
                else:
                    out[:, e.head] = orig[:, e.twin]
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(_IMPL, attn)
    AttentionMaskInterface.register(_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _compare(base: Any, mod: Any) -> tuple[float, float, float]:
    """(agreeing positions, sum of KL(base || mod), max KL) over [L, vocab] logits."""
    import torch

    lb = torch.log_softmax(base.float(), -1)
    lm = torch.log_softmax(mod.float(), -1)
    kl = (lb.exp() * (lb - lm)).sum(-1).clamp(min=0)
    return float((lb.argmax(-1) == lm.argmax(-1)).sum()), float(kl.sum()), float(kl.max())


def replay_heads(model: Any, prompts: Sequence[Any], edits: Sequence[HeadEdit], *,
                 target_agreement: float = TARGET_AGREEMENT, max_kl: float = MAX_KL,
                 min_positions: int = MIN_POSITIONS, combined: bool = True,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replay ``prompts`` ([1, L] token-id tensors) with each edit alone, then the safe ones
    together. Returns ``{"results": [...], "combined": {...} | None, ...}``."""
    import torch

    cfg = model.config.get_text_config()
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    for e in edits:
        if not (0 <= e.layer < n_layers and 0 <= e.head < n_heads
                and (e.twin is None or 0 <= e.twin < n_heads)):
            raise ReplayError(f"head {e.label} is outside the model ({n_layers} layers x "
                              f"{n_heads} heads)")
    if not edits:
        raise ReplayError("nothing to validate: no heads given and none found")
    if not prompts:
        raise ReplayError("no prompts")
    state = _State()
    _register(state)
    old = model.config._attn_implementation
    model.set_attn_implementation(_IMPL)
    try:
        with torch.no_grad():
            # pass 1: base logits, and every mean-replaced head's mean output
            state.collect = True
            for e in edits:
                state.edits.setdefault(e.layer, []).append(e)
            base = [model(input_ids=ids, use_cache=False).logits[0].float() for ids in prompts]
            state.collect = False
            positions = sum(b.shape[0] for b in base)

            def run(group: Sequence[HeadEdit]) -> dict[str, Any]:
                state.edits = {}
                for e in group:
                    state.edits.setdefault(e.layer, []).append(e)
                agree = kl_sum = kl_max = 0.0
                for ids, b in zip(prompts, base, strict=True):
                    a, s, m = _compare(b, model(input_ids=ids, use_cache=False).logits[0])
                    agree += a
                    kl_sum += s
                    kl_max = max(kl_max, m)
                agreement, mean_kl = agree / positions, kl_sum / positions
                meets = agreement >= target_agreement and mean_kl <= max_kl
                safe = meets and positions >= min_positions
                verdict = ("safe: replay meets the target" if safe else
                           f"NOT safe: too little evidence ({positions} positions, "
                           f"{min_positions} needed)" if meets
                           else "NOT safe: replay misses the target")
                return {"agreement": round(agreement, 6), "mean_kl": round(mean_kl, 6),
                        "max_kl": round(kl_max, 6), "safe": safe, "verdict": verdict}

            results = []
            for e in edits:
                if progress is not None:
                    progress(e.label)
                results.append({"layer": e.layer, "head": e.head, "twin": e.twin,
                                "kind": e.kind,
                                "replacement": "mean output" if e.twin is None
                                else f"head {e.twin}'s output"} | run([e]))
            safe = [e for e, r in zip(edits, results, strict=True) if r["safe"]]
            both = None
            if combined and len(safe) > 1:
                if progress is not None:
                    progress("combined")
                both = {"heads": [e.label for e in safe]} | run(safe)
    finally:
        model.set_attn_implementation(old)
        state.edits = {}
    return {"prompts": len(prompts), "positions": positions,
            "comparison": "teacher-forced: the edited model reads the same tokens; argmax "
                          "next-token agreement and KL(base || edited) per position",
            "target_agreement": target_agreement, "max_kl_target": max_kl,
            "min_positions": min_positions, "results": results, "combined": both}
