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
"""

from __future__ import annotations

import itertools
import logging
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, MutableSequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from attnprof.facts.shape import layer_label, site_order

__all__ = [
    "DEFAULT_MAX_RECORDS",
    "NO_REGISTRY_REASON",
    "AttentionCallEvent",
    "CallRecord",
    "KernelEntry",
    "Profile",
    "instrument",
    "profile",
    "uninstrument_all",
]

logger = logging.getLogger("attnprof")
_KEY_PREFIX = "attnprof"
_counter = itertools.count()
_LAYER_RE = re.compile(r"\.(\d+)(?:\.|$)")
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

NO_REGISTRY_REASON = {
    "code": "no_registry",
    "backend": "transformers",
    "message": "this attention module does not call transformers' attention registry "
               "(no attn_implementation); attnprof wraps its forward and reads the aten ops "
               "it ran",
}
EAGER_REASON = {
    "code": "eager",
    "backend": "transformers",
    "message": "attn_implementation='eager' runs QK^T, softmax and PV as separate ops and "
               "materializes the [B, Hq, Lq, Lk] score matrix",
}


@dataclass
class AttentionCallEvent:
    """What ``on_call`` receives for each attention call (after it ran, outside timing).

    Tensors are the live ones the model passed (do not modify them in place); ``kwargs``
    holds transformers' keyword arguments (``scaling``, ``dropout``, ``sliding_window``,
    ``softcap``, ``is_causal``...); ``backend`` is the transformers implementation that ran
    ("sdpa", "eager", "flex_attention", ...); ``kernel``/``fused`` are the resolved kernel
    when known (e.g. "flash_cpu" for SDPA's fused CPU kernel, "math", "eager").
    """

    layer_idx: int
    module: Any
    query: Any
    key: Any
    value: Any
    attention_mask: Any
    kwargs: dict[str, Any]
    backend: str
    output: Any = None
    attn_weights: Any = None
    elapsed_s: float = 0.0
    kernel: str | None = None
    fused: bool | None = None
    stack: str | None = None
    kind: str = "self"


@dataclass
class CallRecord:
    """One attention call, shapes and timing only (no tensor contents, no token ids)."""

    layer_idx: int
    impl: str
    phase: str  # prefill (Lq > 1) | decode (Lq == 1)
    mask: str  # none | bool | float | block_mask
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str
    sliding_window: int | None
    dropout: float
    elapsed_s: float
    kernel: str
    fused: bool
    tags: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0
    """``time.perf_counter_ns()`` just before the call's clock started (places it in a trace)."""
    stack: str | None = None
    """"encoder"/"decoder" in encoder-decoder models, else None."""
    kind: str = "self"
    """"cross" for cross-attention (keys/values from the encoder), else "self"."""

    @property
    def label(self) -> str:
        return layer_label(self.layer_idx, self.stack, self.kind)


@dataclass
class KernelEntry:
    """Activation-map row: the kernel that ran for one layer and shape class, and why."""

    layer_idx: int
    impl: str
    phase: str
    mask: str
    length_bucket: int
    dtype: str
    kernel: str
    fused: bool
    reasons: list[dict[str, str]]
    sdpa_args: dict[str, Any] | None  # what reached F.scaled_dot_product_attention
    ops: list[str]  # aten ops under the call (first ones), the ground truth
    calls: int = 0
    time_s: float = 0.0
    tags: dict[str, Any] = field(default_factory=dict)
    stack: str | None = None
    kind: str = "self"

    @property
    def label(self) -> str:
        return layer_label(self.layer_idx, self.stack, self.kind)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def length_bucket(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _mask_kind(mask: Any) -> str:
    if mask is None:
        return "none"
    dt = getattr(mask, "dtype", None)
    if dt is None:
        return "block_mask" if type(mask).__name__ == "BlockMask" else type(mask).__name__
    return "bool" if str(dt) == "torch.bool" else "float"


def _site(name: str, module: Any, two_stacks: bool) -> tuple[int, str | None, str]:
    """(layer index from the name, stack, kind) of the module at ``name``."""
    m = _LAYER_RE.search(name)
    parts = name.split(".")
    stack = next((p for p in parts if p in _STACKS), None) if two_stacks else None
    cross = (getattr(module, "is_cross_attention", False) is True
             or any(p.lower() in _CROSS_NAMES for p in parts))
    return (int(m.group(1)) if m else -1, stack, "cross" if cross else "self")


def _unrouted(mod: Any) -> bool:
    """An attention module whose modeling file does not use the registry."""
    if not type(mod).__name__.endswith("Attention") or not hasattr(mod, "forward"):
        return False
    owner = sys.modules.get(type(mod).__module__)
    return owner is not None and str(getattr(owner, "__name__", "")).startswith(
        "transformers.models.") and not hasattr(owner, "ALL_ATTENTION_FUNCTIONS")


def _attention_ops(ops: list[str]) -> list[str]:
    """The ops of the attention maths among a module's ops (projections dropped), first 12."""
    keep = ("bmm", "baddbmm", "matmul", "softmax", "_softmax", "masked_fill", "where",
            "dropout", "native_dropout", "scaled_dot_product")
    return [o for o in ops if o.startswith(keep)][:12]


def _encoder_decoder(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "is_encoder_decoder", False))


def _configs(model: Any) -> list[Any]:
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


def _eager_fn(module: Any) -> Callable[..., Any]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"attnprof: {type(module).__name__} has no eager_attention_forward "
                           f"in its modeling module; cannot wrap attn_implementation='eager'")
    return fn  # type: ignore[no-any-return]


def _synchronize(event: Any) -> None:
    """The one place attnprof waits for a device (once per timed CUDA call, never on CPU)."""
    event.synchronize()


class _HostClock:
    """Wall time of a CPU call: nothing to wait for."""

    __slots__ = ("t0",)

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self.t0


class _CudaClock:
    """Device time between two events on the tensors' stream: one synchronize, at the end.

    Host-side timing would need a synchronize before the call too (else earlier queued work
    is counted); events need none there.
    """

    __slots__ = ("end", "start", "stream")

    def __init__(self, torch: Any, device: Any) -> None:
        self.stream = torch.cuda.current_stream(device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(self.stream)

    def stop(self) -> float:
        self.end.record(self.stream)
        _synchronize(self.end)
        return float(self.start.elapsed_time(self.end)) / 1000.0


def _clock(torch: Any, query: Any) -> _HostClock | _CudaClock:
    if bool(getattr(query, "is_cuda", False)):
        return _CudaClock(torch, query.device)
    return _HostClock()


@dataclass
class _Pending:
    """What the guarded set-up of one wrapped call hands to its guarded bookkeeping."""

    site: tuple[int, str | None, str]
    ckey: tuple[Any, ...]
    entry: KernelEntry | None
    spy: Any
    clock: _HostClock | _CudaClock
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
        two_stacks = _encoder_decoder(self.model)
        for name, mod in self.model.named_modules():
            self._site_of[id(mod)] = _site(name, mod, two_stacks)
        self.module_route = []
        for name, mod in self.model.named_modules():
            if _unrouted(mod) and not any(_unrouted(c) for c in mod.modules() if c is not mod):
                self._wrap_module(mod)
                self.module_route.append(name)
        n = next(_counter)
        keys: dict[str, str] = {}
        eager_missing = self._eager_missing()
        for cfg in _configs(self.model):
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
            fn = orig if orig is not None else _eager_fn(module)
            if not prof.enabled:
                return fn(module, query, key, value, attention_mask, **kwargs)
            return prof._call(base, fn, module, query, key, value, attention_mask, kwargs)

        return attnprof_attention

    # ----- the module route (attention modules outside the registry) -----
    def _wrap_module(self, mod: Any) -> None:
        orig = mod.forward  # the bound class method
        prof = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not prof.enabled:
                return orig(*args, **kwargs)
            return prof._module_call(mod, orig, args, kwargs)

        mod.forward = forward
        self._wrapped.append(mod)

    def _module_call(self, mod: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        """Run the module's own forward exactly once; attnprof's steps around it guarded
        as in :meth:`_call`."""
        import torch

        stack = ExitStack()
        try:
            site = self._layer_idx(mod)
            hs: Any = kwargs.get("hidden_states", args[0] if args else None)
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            q_len = int(hs.shape[-2])
            ckey = (site, "module", "prefill" if q_len > 1 else "decode", _mask_kind(mask),
                    length_bucket(q_len), str(hs.dtype), False,
                    tuple(sorted((k, v) for k, v in self._tags.items()
                                 if k in self.class_tags)))
            entry = self.kernels.get(ckey)
            probes: tuple[Any, Any] | None = None
            stack.enter_context(torch.profiler.record_function(
                f"attn::{layer_label(*site)}::module"))
            if entry is None:
                from attnprof.capture.sdpa import OpRecorder, SDPASpy

                probes = (stack.enter_context(OpRecorder()),
                          stack.enter_context(SDPASpy(explain=self.explain)))
            clock = _clock(torch, hs)
        except Exception as exc:
            self._error("setup", exc)
            self._close(stack)
            return fn(*args, **kwargs)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            self._close(stack)
            raise
        try:
            dt = clock.stop()
            self._close(stack)
            failed = [m for p in probes or () for m in p.errors]
            for msg in failed:
                self._error("spy", msg)
            if not failed:
                if entry is None and probes is not None:
                    entry = self.kernels[ckey] = self._resolve_module(ckey, *probes)
                if entry is not None:
                    entry.calls += 1
                    entry.time_s += dt
        except Exception as exc:
            self._close(stack)
            self._error("record", exc)
        return out

    def _resolve_module(self, ckey: tuple[Any, ...], rec: Any, spy: Any) -> KernelEntry:
        """The module route's row: the SDPA call it made, if any, else its own ops."""
        if spy.calls:
            entry = self._resolve(ckey, "module", spy)
            entry.reasons.append(dict(NO_REGISTRY_REASON))
            return entry
        (layer, stack, kind), _b, phase, mask, bucket, dtype, _d, tags = ckey
        return KernelEntry(layer_idx=layer, impl="module", phase=phase, mask=mask,
                           length_bucket=bucket, dtype=dtype.removeprefix("torch."),
                           kernel="eager", fused=False, reasons=[dict(NO_REGISTRY_REASON)],
                           sdpa_args=None, ops=_attention_ops(rec.ops), tags=dict(tags),
                           stack=stack, kind=kind)

    def _class_key(self, site: tuple[int, str | None, str], base: str, query: Any, key: Any,
                   mask: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        q_len, kv_len = int(query.shape[-2]), int(key.shape[-2])
        return (site, base, "prefill" if q_len > 1 else "decode", _mask_kind(mask),
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
        return _Pending(site, ckey, entry, spy, _clock(torch, query), start_ns)

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
                    entry = self.kernels[p.ckey] = self._resolve(p.ckey, base, p.spy)
                entry.calls += 1
                entry.time_s += dt
                if self.keep_records:
                    self.records.append(self._record(p.site, base, query, key, value, mask,
                                                     kwargs, dt, entry, p.start_ns))
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

    def _resolve(self, ckey: tuple[Any, ...], base: str, spy: Any) -> KernelEntry:
        (layer, stack, kind), _base, phase, mask, bucket, dtype, _drop, tags = ckey
        dtype = dtype.removeprefix("torch.")
        common = dict(layer_idx=layer, impl=base, phase=phase, mask=mask, length_bucket=bucket,
                      dtype=dtype, tags=dict(tags), stack=stack, kind=kind)
        if base == "eager":
            return KernelEntry(kernel="eager", fused=False, reasons=[dict(EAGER_REASON)],
                               sdpa_args=None, ops=["matmul", "softmax", "matmul"], **common)
        calls = spy.calls if spy is not None else []
        if calls:
            c = calls[-1]
            args = {"query": list(c.query_shape), "key": list(c.key_shape),
                    "value": list(c.value_shape), "dtype": c.dtype, "mask": c.mask,
                    "mask_shape": list(c.mask_shape) if c.mask_shape else None,
                    "dropout_p": c.dropout_p, "is_causal": c.is_causal,
                    "enable_gqa": c.enable_gqa, "dispatcher_choice": c.choice.backend}
            reasons = [] if c.fused else list(c.choice.reasons)
            if not c.fused and c.choice.fused:
                reasons.append({"code": "dispatch_mismatch", "backend": c.choice.backend,
                                "message": "the dispatcher chose a fused backend but the math "
                                           "ops ran"})
            return KernelEntry(kernel=c.backend, fused=c.fused, reasons=reasons,
                               sdpa_args=args, ops=c.ops[:12], **common)
        if "flex" in base:
            return KernelEntry(kernel="flex_attention", fused=True, reasons=[], sdpa_args=None,
                               ops=["flex_attention"], **common)
        return KernelEntry(kernel=base, fused=True, reasons=[], sdpa_args=None, ops=[], **common)

    def _record(self, site: tuple[int, str | None, str], base: str, q: Any, k: Any, v: Any,
                mask: Any, kwargs: dict[str, Any], dt: float, entry: KernelEntry,
                start_ns: int = 0) -> CallRecord:
        sw = kwargs.get("sliding_window")
        layer, stack, kind = site
        return CallRecord(
            layer_idx=layer, impl=base, phase="prefill" if int(q.shape[-2]) > 1 else "decode",
            mask=_mask_kind(mask), batch=int(q.shape[0]), q_len=int(q.shape[-2]),
            kv_len=int(k.shape[-2]), num_heads=int(q.shape[1]), num_kv_heads=int(k.shape[1]),
            head_dim=int(q.shape[-1]), head_dim_v=int(v.shape[-1]),
            dtype=str(q.dtype).removeprefix("torch."),
            sliding_window=int(sw) if isinstance(sw, int) and sw > 0 else None,
            dropout=float(kwargs.get("dropout", 0.0) or 0.0), elapsed_s=dt,
            kernel=entry.kernel, fused=entry.fused, tags=dict(self._tags), start_ns=start_ns,
            stack=stack, kind=kind)

    # ----- results -----
    def activation_map(self) -> list[dict[str, Any]]:
        """One row per (layer site, implementation, phase, mask kind, length bucket, dtype);
        a site is (stack, layer index, kind), in model order (encoder before decoder)."""
        rows = [e.as_dict() for e in self.kernels.values()]
        rows.sort(key=lambda r: (*site_order(r["stack"], r["layer_idx"], r["kind"]),
                                 r["phase"], r["mask"], r["length_bucket"]))
        return rows

    def layers(self) -> list[dict[str, Any]]:
        """Per layer site: kernels seen, whether all calls were fused, reasons, calls and
        time (``stack``/``kind``/``label`` tell encoder, decoder and cross-attention apart)."""
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for e in self.kernels.values():
            d = out.setdefault(site_order(e.stack, e.layer_idx, e.kind), {
                "layer": e.layer_idx, "stack": e.stack, "kind": e.kind, "label": e.label,
                "impl": e.impl, "kernels": [], "fused": True, "reasons": [], "calls": 0,
                "time_s": 0.0})
            if e.kernel not in d["kernels"]:
                d["kernels"].append(e.kernel)
            d["fused"] = d["fused"] and e.fused
            for r in e.reasons:
                if r not in d["reasons"]:
                    d["reasons"].append(r)
            d["calls"] += e.calls
            d["time_s"] += e.time_s
        return [out[k] for k in sorted(out)]


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
