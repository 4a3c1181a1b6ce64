"""Profile every attention call of a Hugging Face transformers model without editing it.

Three lines::

    import attnprof
    with attnprof.profile(model) as prof:
        model(**inputs)
    print(prof.activation_map())

How: transformers modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` at
every forward, and build masks with ``ALL_MASK_ATTENTION_FUNCTIONS[...]`` under the same key.
:func:`instrument` registers a wrapper of the model's current implementation (eager, sdpa,
flex_attention, or any other registered one) under a private key in **both** registries
(without the mask entry transformers skips mask creation and padding is silently dropped)
and points the model's configs at that key. The wrapper calls the original function with the
original arguments, so outputs are bit-identical. ``uninstrument`` restores the configs and
removes the keys.

Bounded by default: ``Profile.kernels`` (the activation map) is O(layers x shape classes) and
``Profile.records`` is a ring of the :data:`DEFAULT_MAX_RECORDS` most recent calls; pass
``max_records=None`` to keep every call (offline profiling), ``keep_records=False`` for the
aggregates only. Every attnprof step of a wrapped call runs under one guard: an exception in
attnprof's own code is counted in ``Profile.error_count`` (first messages in ``errors``) and
dropped, and the original attention still runs exactly once with the original arguments.
Timing waits for the device at most once per call (CUDA: one event synchronize; CPU: none).

Layer identity is (stack, layer index, kind): ``stack`` is "encoder"/"decoder" in
encoder-decoder models (BART, T5, ...) and None elsewhere; ``kind`` is "cross" for
cross-attention modules (whose keys and values come from the encoder: no causal mask, KV
length the encoder's) and "self" otherwise. Encoder-decoder models number the layers of
each stack from 0, so the index alone would merge an encoder layer with the decoder's self-
and cross-attention of the same number. :func:`attnprof.facts.shape.layer_label` names a
site the same way in every output (``L3``, ``encoder.L3``, ``decoder.L3.cross``).

Families whose attention modules do not call the registry (their modeling file has no
``ALL_ATTENTION_FUNCTIONS``: GPT-Neo, GPT-J, Bloom, DeBERTa, ... in transformers 5.x) take a
second route, the *module route*: the innermost ``*Attention`` module's ``forward`` is
wrapped on the instance (restored by ``uninstrument``). On the first call of a shape class
the SDPA spy and an aten-op recorder run inside it, so the activation map still says which
kernel ran (the fused SDPA op, or the module's own softmax/matmuls) with
``impl="module"`` and the reason code ``no_registry``; its time includes the module's
projections, its shape class comes from the hidden states (length bucket of the query
length), and it makes no per-call :class:`CallRecord` (those need the query and key tensors
that only the registry hands over).

Beside this module (the :class:`Profile` wrapper and its install/undo):
:mod:`.transformers_records` (the records and activation-map rows),
:mod:`.transformers_model` (reading the model's layout), :mod:`.transformers_modules` (the
module route) and :mod:`.device_clock` (timing a call on its device).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, MutableSequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from attnprof.capture.device_clock import CudaClock, HostClock, clock
from attnprof.capture.transformers_model import (
    configs,
    eager_fn,
    encoder_decoder,
    site,
    unrouted,
)
from attnprof.capture.transformers_modules import wrap_module
from attnprof.capture.transformers_records import (
    AttentionCallEvent,
    CallRecord,
    KernelEntry,
    activation_rows,
    call_record,
    layer_rows,
    length_bucket,
    mask_kind,
    resolve_entry,
)
from attnprof.facts.shape import layer_label

__all__ = ["DEFAULT_MAX_RECORDS", "Profile", "instrument", "profile", "uninstrument_all"]

logger = logging.getLogger("attnprof")
_KEY_PREFIX = "attnprof"
_counter = itertools.count()
# Per-call records kept by default (a ring: the oldest are dropped). A CallRecord with its tags
# is ~400 bytes (tracemalloc), so the default ring stays near 1.5 MiB however long it runs.
DEFAULT_MAX_RECORDS = 4096
_MAX_ERROR_MESSAGES = 100
_LIVE: list[Profile] = []
"""Installed profiles, in install order (what :func:`uninstrument_all` undoes)."""

# Module-name segments of cross-attention in transformers' modeling files (BART/Marian/
# Whisper/mBART: encoder_attn; BERT/RoBERTa as decoders: crossattention; T5: EncDecAttention;
# others: cross_attn / cross_attention), lower-cased.
_CROSS_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attn", "cross_attention",
                          "encdecattention"})
_STACKS = ("encoder", "decoder")

@dataclass
class _Pending:
    """What the guarded set-up of one wrapped call hands to its guarded bookkeeping."""

    site: tuple[int, str | None, str]
    ckey: tuple[Any, ...]
    entry: KernelEntry | None
    spy: Any
    clock: HostClock | CudaClock
    start_ns: int = 0


class Profile:
    """Per-call records and the kernel activation map of an instrumented model.

    Use as a context manager (exit uninstruments) or call :meth:`uninstrument` yourself.

    ``kernels`` (what :meth:`activation_map` and :meth:`layers` read) holds one entry per
    layer and shape class, so it stays O(layers x shape classes). ``records`` holds per-call
    :class:`CallRecord` s: a ring (``collections.deque``) of the ``max_records`` most recent
    calls, :data:`DEFAULT_MAX_RECORDS` by default; ``max_records=None`` keeps every call in a
    list (offline profiling that reads every call, like ``attnprof profile``), and
    ``keep_records=False`` keeps none. ``records_total`` counts every record made, including
    the ones the ring dropped. ``error_count`` counts attnprof's own failures (never raised
    into the model); ``errors`` keeps the first messages.
    """

    def __init__(self, model: Any, on_call: Callable[[AttentionCallEvent], None] | None = None,
                 explain: bool = True, keep_records: bool = True,
                 class_tags: tuple[str, ...] = ("padded",),
                 max_records: int | None = DEFAULT_MAX_RECORDS) -> None:
        if max_records is not None and max_records < 0:
            raise ValueError(f"max_records must be >= 0 or None, got {max_records}")
        self.model = model
        # Tags that split activation-map rows (others, like seq_len, only label records).
        self.class_tags = class_tags
        self.on_call = on_call
        self.explain = explain
        self.keep_records = keep_records
        self.max_records = max_records
        self.records: MutableSequence[CallRecord] = (
            [] if max_records is None else deque(maxlen=max_records))
        self.records_total = 0
        self.kernels: dict[tuple[Any, ...], KernelEntry] = {}
        self.errors: list[str] = []
        self.error_count = 0
        self.enabled = True
        self._tags: dict[str, Any] = {}
        self._saved: list[tuple[Any, Any]] = []
        self._keys: list[str] = []
        self._site_of: dict[int, tuple[int, str | None, str]] = {}
        self._wrapped: list[Any] = []
        self.module_route: list[str] = []
        """Names of the attention modules profiled by the module route (see the module
        docstring); empty when every one goes through the registry."""
        self._installed = False

    # ----- installation -----
    def install(self) -> Profile:
        if self._installed:
            return self
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        attn_map = AttentionInterface._global_mapping
        mask_map = AttentionMaskInterface._global_mapping
        two_stacks = encoder_decoder(self.model)
        for name, mod in self.model.named_modules():
            self._site_of[id(mod)] = site(name, mod, two_stacks)
        self.module_route = []
        for name, mod in self.model.named_modules():
            if unrouted(mod) and not any(unrouted(c) for c in mod.modules() if c is not mod):
                wrap_module(self, mod)
                self.module_route.append(name)
        n = next(_counter)
        keys: dict[str, str] = {}
        eager_missing = self._eager_missing()
        for cfg in configs(self.model):
            base = cfg._attn_implementation_internal or "eager"
            if isinstance(base, dict) or str(base).startswith(_KEY_PREFIX):
                continue
            if base == "eager" and eager_missing:
                # Eager lives in each modeling file; where it cannot be found, leaving the
                # model as it is beats a wrapper that would have nothing to call.
                self._error("install", f"{eager_missing} has no eager_attention_forward in "
                                       "its modeling module; eager attention left unwrapped")
                continue
            key = keys.get(base)
            if key is None:
                key = keys[base] = f"{_KEY_PREFIX}{n}:{base}"
                attn_map[key] = self._make_wrapper(base)
                if base in mask_map:  # else transformers builds no mask for it either
                    mask_map[key] = mask_map[base]
                self._keys.append(key)
            self._saved.append((cfg, cfg._attn_implementation_internal))
            cfg._attn_implementation_internal = key
        self._installed = True
        _LIVE.append(self)
        return self

    def _eager_missing(self) -> str | None:
        """The first attention module class whose modeling file has no
        ``eager_attention_forward`` (None when every one has it)."""
        for mod in self.model.modules():
            name = type(mod).__name__
            if not name.endswith("Attention"):
                continue
            owner = sys.modules.get(type(mod).__module__)
            uses_interface = hasattr(owner, "ALL_ATTENTION_FUNCTIONS")
            if uses_interface and getattr(owner, "eager_attention_forward", None) is None:
                return name
        return None

    def uninstrument(self) -> None:
        """Restore the model's attention implementation and drop the private registry keys."""
        if not self._installed:
            return
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        for cfg, old in self._saved:
            cfg._attn_implementation_internal = old
        for key in self._keys:
            AttentionInterface._global_mapping.pop(key, None)
            AttentionMaskInterface._global_mapping.pop(key, None)
        for mod in self._wrapped:
            mod.__dict__.pop("forward", None)  # the class's forward again
        self._wrapped.clear()
        self._saved.clear()
        self._keys.clear()
        self._installed = False
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> Profile:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstrument()

    @contextmanager
    def tag(self, **tags: Any) -> Iterator[None]:
        """Attach tags (e.g. ``padded=True, seq_len=512``) to calls made inside the block."""
        old = dict(self._tags)
        self._tags.update(tags)
        try:
            yield
        finally:
            self._tags = old

    def clear(self) -> None:
        self.records.clear()
        self.records_total = 0
        self.kernels.clear()

    @property
    def records_dropped(self) -> int:
        """Records the ring let go of (0 with ``max_records=None``)."""
        return self.records_total - len(self.records) if self.keep_records else 0

    # ----- the wrapper -----
    def _layer_idx(self, module: Any) -> tuple[int, str | None, str]:
        """(layer index, stack, kind): the module's own ``layer_idx`` when it has one, else
        the number in its name; stack and kind from its name (see the module docstring)."""
        layer, stack, kind = self._site_of.get(id(module), (-1, None, "self"))
        idx = getattr(module, "layer_idx", None)
        return (idx if isinstance(idx, int) else layer), stack, kind

    def _make_wrapper(self, base: str) -> Callable[..., Any]:
        from transformers.modeling_utils import AttentionInterface

        prof = self
        # Resolve the original once for registered impls; eager lives in each modeling file.
        orig = None if base == "eager" else AttentionInterface._global_mapping[base]

        def attnprof_attention(module: Any, query: Any, key: Any, value: Any,
                               attention_mask: Any, **kwargs: Any) -> Any:
            fn = orig if orig is not None else eager_fn(module)
            if not prof.enabled:
                return fn(module, query, key, value, attention_mask, **kwargs)
            return prof._call(base, fn, module, query, key, value, attention_mask, kwargs)

        return attnprof_attention

    def _class_key(self, site: tuple[int, str | None, str], base: str, query: Any, key: Any,
                   mask: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        q_len, kv_len = int(query.shape[-2]), int(key.shape[-2])
        return (site, base, "prefill" if q_len > 1 else "decode", mask_kind(mask),
                length_bucket(kv_len), str(query.dtype), float(kwargs.get("dropout", 0.0) or 0.0)
                > 0, tuple(sorted((k, v) for k, v in self._tags.items() if k in self.class_tags)))

    def _call(self, base: str, fn: Callable[..., Any], module: Any, query: Any, key: Any,
              value: Any, mask: Any, kwargs: dict[str, Any]) -> Any:
        """Run ``fn`` exactly once; every attnprof step around it is guarded.

        Set-up (layer, class key, spy, profiler range, clock) failing: counted, undone, and
        ``fn`` runs plain. ``fn`` raising: the host's own exception, re-raised after undoing
        the set-up. Bookkeeping failing afterwards: counted; the output is returned as is.
        """
        stack = ExitStack()
        try:
            pending = self._begin(stack, base, module, query, key, mask, kwargs)
        except Exception as exc:
            self._error("setup", exc)
            self._close(stack)
            return fn(module, query, key, value, mask, **kwargs)
        try:
            out = fn(module, query, key, value, mask, **kwargs)
        except BaseException:
            self._close(stack)
            raise
        try:
            self._finish(pending, stack, base, module, query, key, value, mask, kwargs, out)
        except Exception as exc:  # _finish guards its own steps; this is the last net
            self._error("finish", exc)
        return out

    def _begin(self, stack: ExitStack, base: str, module: Any, query: Any, key: Any,
               mask: Any, kwargs: dict[str, Any]) -> _Pending:
        import torch

        site = self._layer_idx(module)
        ckey = self._class_key(site, base, query, key, mask, kwargs)
        entry = self.kernels.get(ckey)
        spy = None
        if entry is None and base not in ("eager",):
            # First call of this shape class: resolve the kernel with the dispatcher spy.
            from attnprof.capture.sdpa import SDPASpy

            spy = SDPASpy(explain=self.explain)
        stack.enter_context(torch.profiler.record_function(f"attn::{layer_label(*site)}::{base}"))
        if spy is not None:
            stack.enter_context(spy)
        # Last, so that the timed region is the call itself (its start read just before).
        start_ns = time.perf_counter_ns()
        return _Pending(site, ckey, entry, spy, clock(torch, query), start_ns)

    def _finish(self, p: _Pending, stack: ExitStack, base: str, module: Any, query: Any,
                key: Any, value: Any, mask: Any, kwargs: dict[str, Any], out: Any) -> None:
        dt: float | None = None
        try:
            dt = p.clock.stop()
        except Exception as exc:
            self._error("timing", exc)
        self._close(stack)
        entry = p.entry
        spy_ok = True
        try:
            for msg in getattr(p.spy, "errors", None) or ():
                spy_ok = False
                self._error("spy", msg)
        except Exception as exc:
            spy_ok = False
            self._error("spy", exc)
        # A call that could not be timed, or whose kernel the spy failed to see, is dropped
        # (not counted with a made-up time or kernel); the next call of its class re-samples.
        if dt is not None and spy_ok:
            try:
                if entry is None:
                    entry = self.kernels[p.ckey] = resolve_entry(p.ckey, base, p.spy)
                entry.calls += 1
                entry.time_s += dt
                if self.keep_records:
                    self.records.append(call_record(p.site, base, query, key, value, mask,
                                                    kwargs, dt, entry, self._tags, p.start_ns))
                    self.records_total += 1
            except Exception as exc:  # bookkeeping must never break the model
                self._error("record", exc)
        if self.on_call is not None:
            try:
                attn_out, weights = (out if isinstance(out, tuple) and len(out) == 2
                                     else (out, None))
                self.on_call(AttentionCallEvent(
                    p.site[0], module, query, key, value, mask, kwargs, base, attn_out, weights,
                    dt or 0.0, entry.kernel if entry else None, entry.fused if entry else None,
                    p.site[1], p.site[2]))
            except Exception as exc:
                self._error("on_call", exc)

    def _close(self, stack: ExitStack) -> None:
        try:
            stack.close()
        except Exception as exc:
            self._error("close", exc)

    def _error(self, place: str, exc: BaseException | str) -> None:
        """Count one attnprof failure; keep the first messages; warn once. Never raises."""
        self.error_count += 1
        try:
            msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            if len(self.errors) < _MAX_ERROR_MESSAGES:
                self.errors.append(f"{place}: {msg}")
            if self.error_count == 1:
                logger.warning("attnprof: %s failed (%s); the model call was not affected",
                               place, msg)
        except Exception:  # a broken __str__ or logging handler: the count stands
            pass

    # ----- results -----
    def activation_map(self) -> list[dict[str, Any]]:
        """One row per (layer site, implementation, phase, mask kind, length bucket, dtype);
        a site is (stack, layer index, kind), in model order (encoder before decoder)."""
        return activation_rows(self.kernels.values())

    def layers(self) -> list[dict[str, Any]]:
        """Per layer site: kernels seen, whether all calls were fused, reasons, calls and
        time (``stack``/``kind``/``label`` tell encoder, decoder and cross-attention apart)."""
        return layer_rows(self.kernels.values())


def instrument(model: Any, on_call: Callable[[AttentionCallEvent], None] | None = None, *,
               explain: bool = True, keep_records: bool = True,
               max_records: int | None = DEFAULT_MAX_RECORDS) -> Profile:
    """Wrap ``model``'s attention (any HF model using the attention-function registry).

    ``on_call(event)`` (optional) gets an :class:`AttentionCallEvent` per attention call,
    after the call and outside its timed region; exceptions it raises are recorded in
    ``Profile.errors`` and never reach the model. ``explain`` asks the SDPA dispatcher for
    rejection reasons on the first call of each shape class. ``prof.records`` keeps the
    ``max_records`` most recent calls (:data:`DEFAULT_MAX_RECORDS`; ``None``: every call,
    for offline runs; ``keep_records=False``: none, aggregates only). Returns the installed
    :class:`Profile`; call ``uninstrument()`` (or use it as a context manager) to undo.
    Idempotent per model: an already-instrumented config is left alone.
    """
    return Profile(model, on_call=on_call, explain=explain, keep_records=keep_records,
                   max_records=max_records).install()


def profile(model: Any, on_call: Callable[[AttentionCallEvent], None] | None = None, *,
            explain: bool = True, keep_records: bool = True,
            max_records: int | None = DEFAULT_MAX_RECORDS) -> Profile:
    """``with profile(model) as prof: model(...)``: instrument for the block, then undo."""
    return Profile(model, on_call=on_call, explain=explain, keep_records=keep_records,
                   max_records=max_records)


def uninstrument_all() -> None:
    """Undo every installed :class:`Profile` in this process, newest first (configs,
    registry keys and module forwards as they were). Idempotent."""
    for prof in reversed(list(_LIVE)):
        prof.uninstrument()
