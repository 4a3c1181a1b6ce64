"""Offline evidence through transformers: head statistics on prompts, and window replay.

* :func:`collect_head_stats` runs prompts through the model with
  :func:`attnprof.capture.transformers.instrument` and feeds each prefill's
  post-RoPE q/k to a :class:`HeadStatsAccumulator`.
* :func:`refine_head_stats` decides the KV heads a sampled pass left undecided on every
  query: it reruns the prompts, computing exact statistics (each query, weight 1) for the
  layers holding undecided heads only, and marks those rows exact.
* :func:`replay` runs each prompt twice through one registered attention function, once with
  the causal mask and once with sinks + window applied as a mask (keys keep their original
  positions, like vLLM/HF sliding windows; no StreamingLLM re-rotation), and compares the
  next-token distributions at every position where the window binds (i + 1 > s + w):
  greedy-token agreement and mean KL(full || windowed).

Only plain scaled-softmax attention is replayed (Llama, Mistral, Qwen, SmolLM...): logit
softcapping and learned sinks are refused rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.capture import head_rows
from attnprof.tools.masked_attention import ReplayError, masked_attention

__all__ = [
    "TARGET_AGREEMENT",
    "ReplayError",
    "collect_head_stats",
    "default_prompts",
    "load_model",
    "read_prompts",
    "refine_head_stats",
    "replay",
]

_IMPL = "attnprof_window_replay"
TARGET_AGREEMENT = 0.95
"""Greedy agreement a window's replay must reach to be called safe (``validate-window``'s
default); a measured what-if below it is not ranked as a saving."""


def load_model(spec: str | Path) -> tuple[Any, Any, Path]:
    """(model, tokenizer, path) in float32 eval mode; ``spec`` is a dir or ``smollm2``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnprof.tools.models import ModelCacheError, resolve_model

    try:
        path = resolve_model(str(spec))
    except ModelCacheError as err:
        raise ReplayError(str(err)) from None
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    return model, tok, path


def read_prompts(path: Path) -> list[str]:
    """One prompt per line, a JSON list of strings, or JSONL of {"prompt": ...}."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ReplayError(f"cannot read {str(path)!r}: "
                          f"{getattr(err, 'strerror', None) or err}") from None
    s = text.strip()
    if not s:
        raise ReplayError(f"{path}: no prompts")
    if s.startswith("["):
        try:
            obj = json.loads(s)
        except ValueError as err:
            raise ReplayError(f"{path}: malformed JSON ({err})") from None
        if not isinstance(obj, list) or not all(isinstance(x, str) for x in obj):
            raise ReplayError(f"{path}: expected a JSON list of strings")
        out = [x for x in obj if x.strip()]
    elif s.startswith("{"):
        out = []
        for n, line in enumerate(s.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ReplayError(f"{path} line {n}: expected {{\"prompt\": ...}}") from None
    else:
        out = [line for line in s.splitlines() if line.strip()]
    if not out:
        raise ReplayError(f"{path}: no prompts")
    return out


def default_prompts(tokenizer: Any, lengths: Sequence[int] = (300, 600, 1000), seed: int = 0
                    ) -> list[str]:
    """Deterministic documents of the demo's shape (see :mod:`attnprof.tools.traffic`)."""
    import random

    from attnprof.tools.traffic import document

    rng = random.Random(seed)
    return [f"Summarize the following document.\n\n{document(rng, tokenizer, n)}\n\nSummary:"
            for n in lengths]


def _encode(tokenizer: Any, prompt: str, max_tokens: int) -> Any:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids[:, :max_tokens]


def collect_head_stats(model: Any, tokenizer: Any, prompts: Iterable[Any],
                       acc: HeadStatsAccumulator | None = None, *, max_tokens: int = 4096,
                       progress: Callable[[int], None] | None = None,
                       layers: Iterable[int] | None = None, every_query: bool = False,
                       **acc_kw: Any) -> HeadStatsAccumulator:
    """Head statistics over each prompt's prefill (one forward per prompt, no cache);
    a prompt is a string or a [1, L] tensor of token ids. ``layers``: only these layers
    (default all); ``every_query``: every query at weight 1 instead of the sample."""
    import torch

    from attnprof.capture.transformers import instrument

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    if acc is None:
        acc = HeadStatsAccumulator.for_config(cfg.to_dict(), **acc_kw)
    failures: list[str] = []
    only = None if layers is None else frozenset(int(x) for x in layers)

    def on_call(ev: Any) -> None:
        q, k = ev.query, ev.key
        if q.shape[2] < 2 or (only is not None and ev.layer_idx not in only):  # prefill only
            return
        scale = ev.kwargs.get("scaling") or getattr(ev.module, "scaling", None) \
            or 1 / math.sqrt(q.shape[-1])
        sinks = getattr(ev.module, "sinks", None)
        try:
            head_rows.update_hf(acc, ev.layer_idx, q, k, float(scale), v=ev.value,
                          softcap=ev.kwargs.get("softcap"),
                          sink_logits=None if sinks is None else sinks.detach(),
                          sample=torch.arange(q.shape[2]) if every_query else None)
        except Exception as exc:  # surfaced below: a statistics bug must not look like data
            failures.append(f"{type(exc).__name__}: {exc}")
            raise

    prof = instrument(model, on_call=on_call, explain=False, keep_records=False)
    try:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                ids = _encode(tokenizer, p, max_tokens) if isinstance(p, str) \
                    else p[..., :max_tokens]  # already token ids [1, L]
                model(input_ids=ids, use_cache=False)
                if failures:
                    raise ReplayError(f"head statistics failed: {failures[0]}")
                if progress is not None:
                    progress(i + 1)
    finally:
        prof.uninstrument()
    return acc


def refine_head_stats(model: Any, tokenizer: Any, prompts: Sequence[Any],
                      acc: HeadStatsAccumulator, thresholds: Any = None, *,
                      max_tokens: int = 4096) -> dict[str, Any]:
    """Decide on every query the KV heads that ``acc`` (sampled from the same ``prompts``)
    leaves undecided at some grid window: rerun the prompts computing exact statistics for
    the layers holding such heads only, and replace those layers' coverage rows in ``acc``
    (marked exact). Returns what it did and what it cost (seconds, layers rerun)."""
    import numpy as np

    from attnprof.analyze.sparsity.classify import Thresholds, kv_decisions, window_decisions

    th = thresholds if thresholds is not None else Thresholds()

    def undecided() -> Any:
        return kv_decisions(window_decisions(acc, th)["decision"], acc.group_size) == 0

    before = undecided()  # [layer, KV head, window]
    layers = [int(x) for x in np.flatnonzero(before.any((1, 2)))]
    t0 = time.perf_counter()
    if layers:
        exact = collect_head_stats(model, tokenizer, prompts, acc.empty_like(),
                                   max_tokens=max_tokens, layers=layers, every_query=True)
        acc.set_exact(exact, layers)
    after = undecided()
    grid = acc.window_grid
    return {"layers": layers, "seconds": round(time.perf_counter() - t0, 2),
            "prompts": len(prompts), "sinks": th.sinks,
            "undecided_before": {str(w): int(before[..., i].sum()) for i, w in enumerate(grid)
                                 if before[..., i].any()},
            "undecided_after": {str(w): int(after[..., i].sum()) for i, w in enumerate(grid)
                                if after[..., i].any()},
            "exact_kv_heads": len(layers) * acc.num_kv_heads}


@dataclass
class _WindowState:
    window: int | None = None
    sinks: int = 0
    layers: frozenset[int] = frozenset()


def _register(state: _WindowState) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    def attn(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, *,
             scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
             **kw: Any) -> tuple[Any, None]:
        w = state.window if module.layer_idx in state.layers else None
        out = masked_attention(module, q, k, v, attention_mask, scaling=scaling,
                               softcap=softcap, window=w, sinks=state.sinks, **kw)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(_IMPL, attn)
    AttentionMaskInterface.register(_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def replay(model: Any, tokenizer: Any, prompts: Sequence[str], window: int, sinks: int, *,
           layers: Iterable[int] | None = None, max_tokens: int = 4096, generate: int = 0,
           target_agreement: float = TARGET_AGREEMENT, max_kl: float = 0.05,
           min_positions: int = 64,
           progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Greedy agreement and mean KL between full attention and sinks + window.

    Positions where the window cannot bind (i + 1 <= s + w) are identical by construction and
    are excluded; fewer than ``min_positions`` compared positions is too little evidence to
    call the window safe. ``generate`` > 0 first extends each prompt with that many greedy tokens of
    the full model, so decode positions are compared too (teacher-forced).
    """
    import torch

    if window < 1 or sinks < 0:
        raise ReplayError("window must be >= 1 and sinks >= 0")
    n_layers = model.config.get_text_config().num_hidden_layers
    state = _WindowState(None, sinks, frozenset(range(n_layers) if layers is None
                                                else layers))
    _register(state)
    old = model.config._attn_implementation
    model.set_attn_implementation(_IMPL)
    agree = kl_sum = 0.0
    positions = 0
    longest = 0
    try:
        with torch.no_grad():
            for i, p in enumerate(prompts):
                ids = _encode(tokenizer, p, max_tokens)
                state.window = None
                if generate > 0:
                    ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=generate, do_sample=False,
                                         pad_token_id=tokenizer.eos_token_id)[:, :max_tokens]
                longest = max(longest, ids.shape[1])
                full = model(input_ids=ids, use_cache=False).logits[0].float()
                state.window = window
                win = model(input_ids=ids, use_cache=False).logits[0].float()
                first = sinks + window  # positions i with i + 1 > s + w
                if ids.shape[1] > first:
                    lf = torch.log_softmax(full[first:], -1)
                    lw = torch.log_softmax(win[first:], -1)
                    agree += float((lf.argmax(-1) == lw.argmax(-1)).sum())
                    kl_sum += float((lf.exp() * (lf - lw)).sum(-1).clamp(min=0).sum())
                    positions += lf.shape[0]
                if progress is not None:
                    progress(i + 1)
    finally:
        model.set_attn_implementation(old)
    if positions == 0:
        agreement, mean_kl = 1.0, 0.0
        safe = False
        verdict = (f"no evidence: no prompt is longer than sinks + window = {sinks + window} "
                   f"tokens (longest {longest}), so the window never binds on them")
    else:
        agreement, mean_kl = agree / positions, kl_sum / positions
        meets = agreement >= target_agreement and mean_kl <= max_kl
        safe = meets and positions >= min_positions
        if safe:
            verdict = "safe: replay meets the target"
        elif meets:
            verdict = (f"NOT safe: too little evidence ({positions} positions where the window "
                       f"binds, {min_positions} needed; use longer or more prompts)")
        else:
            verdict = "NOT safe: replay misses the target"
    return {"window": window, "sinks": sinks, "layers": sorted(state.layers),
            "prompts": len(prompts), "positions": positions, "longest_tokens": longest,
            "agreement": round(agreement, 6), "mean_kl": round(mean_kl, 6),
            "target_agreement": target_agreement, "max_kl": max_kl,
            "min_positions": min_positions, "safe": safe,
            "verdict": verdict, "generate": generate,
            "variant": "mask (original positions, no RoPE re-rotation)"}
