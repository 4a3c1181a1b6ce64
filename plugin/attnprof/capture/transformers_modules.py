"""The module route: transformers attention modules that do not call the attention registry
(GPT-Neo, GPT-J, Bloom, DeBERTa, ... in transformers 5.x) get their ``forward`` wrapped on the
instance. On the first call of a shape class the SDPA spy and an aten-op recorder run inside
it, so the activation map still says which kernel ran (``impl="module"``, reason
``no_registry``); its time includes the module's projections. See
:mod:`attnprof.capture.transformers`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from attnprof.capture.device_clock import clock
from attnprof.capture.transformers_records import length_bucket, mask_kind, resolve_module_entry
from attnprof.facts.shape import layer_label

__all__ = ["module_call", "wrap_module"]


def wrap_module(prof: Any, mod: Any) -> None:
    """Wrap ``mod``'s forward on the instance for ``prof`` (a :class:`Profile`; its
    ``uninstrument`` removes the instance attribute)."""
    orig = mod.forward  # the bound class method

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not prof.enabled:
            return orig(*args, **kwargs)
        return module_call(prof, mod, orig, args, kwargs)

    mod.forward = forward
    prof._wrapped.append(mod)

def module_call(prof: Any, mod: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    """Run the module's own forward exactly once; attnprof's steps around it guarded
    as in :meth:`Profile._call`."""
    import torch

    stack = ExitStack()
    try:
        site = prof._layer_idx(mod)
        hs: Any = kwargs.get("hidden_states", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        q_len = int(hs.shape[-2])
        ckey = (site, "module", "prefill" if q_len > 1 else "decode", mask_kind(mask),
                length_bucket(q_len), str(hs.dtype), False,
                tuple(sorted((k, v) for k, v in prof._tags.items()
                             if k in prof.class_tags)))
        entry = prof.kernels.get(ckey)
        probes: tuple[Any, Any] | None = None
        stack.enter_context(torch.profiler.record_function(
            f"attn::{layer_label(*site)}::module"))
        if entry is None:
            from attnprof.capture.sdpa import OpRecorder, SDPASpy

            probes = (stack.enter_context(OpRecorder()),
                      stack.enter_context(SDPASpy(explain=prof.explain)))
        clk = clock(torch, hs)
    except Exception as exc:
        prof._error("setup", exc)
        prof._close(stack)
        return fn(*args, **kwargs)
    try:
        out = fn(*args, **kwargs)
    except BaseException:
        prof._close(stack)
        raise
    try:
        dt = clk.stop()
        prof._close(stack)
        failed = [m for p in probes or () for m in p.errors]
        for msg in failed:
            prof._error("spy", msg)
        if not failed:
            if entry is None and probes is not None:
                entry = prof.kernels[ckey] = resolve_module_entry(ckey, *probes)
            if entry is not None:
                entry.calls += 1
                entry.time_s += dt
    except Exception as exc:
        prof._close(stack)
        prof._error("record", exc)
    return out
