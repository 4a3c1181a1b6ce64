"""Patching vLLM in this process, and undoing it.

:func:`install` (called once per process by the general plugin) patches these places and
logs each in a patch book; :func:`uninstall` puts back exactly what was there, in reverse
order, and is idempotent (OpenTelemetry's instrumentors work the same way):

* ``Attention.__init__``: wraps each layer's impl as it is built (:meth:`Capture.wrap_layer`);
* ``selector._cached_get_attn_backend``: keeps the selector's inputs for the kernel map;
* ``GPUModelRunner._model_forward``: the step hook (:func:`~.hooks.step_hook`);
* ``GPUModelRunner._determine_batch_execution_and_padding``: a sampled step's CUDA graph
  mode, attention outside the graph (:func:`~.cudagraph.determine_hook`);
* ``GPUModelRunner.initialize_kv_cache``: each layer's KV-cache group
  (:func:`~.model_info.learn_kv_groups`);
* ``WorkerWrapperBase.init_device``: once vLLM built the worker's model runner, which one it
  is and whether its steps are hooked (:func:`~.runner_v2.runner_report`; a warning in the
  worker's log when not); a Model Runner V2 worker gets V2's ``execute_model`` (the step
  hook and its CUDA-graph steering, :mod:`.runner_v2`) and ``initialize_kv_cache`` patched
  then, only where it runs V2;
* ``WorkerBase.attnprof_*``: the RPC methods the host hands in
  (:func:`attnprof.host.vllm.worker_rpc.worker_methods`).

Layers already built keep no attnprof state after :func:`uninstall`: their timing wrappers
(present only during sampled steps) and marks are removed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from attnprof.capture.vllm import args as vargs
from attnprof.capture.vllm import cudagraph, model_info, runner_v2
from attnprof.capture.vllm.hooks import Capture, step_hook
from attnprof.capture.vllm.host_state import HostState

__all__ = ["install", "installed", "uninstall"]

_MISSING = object()
_PATCHES: list[tuple[Any, str, Any]] = []
"""(owner, attribute, what its own ``__dict__`` held before; ``_MISSING``: nothing)."""
_CAPTURES: list[tuple[Capture, HostState]] = []


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHES.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def installed() -> bool:
    """Whether any attnprof patch is in place in this process."""
    return bool(_PATCHES)


def _vllm_version() -> str | None:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "") or "") or None
    except Exception:
        return None


def _watch_selector(cap: Capture, state: HostState) -> None:
    """Keep the ``AttentionSelectorConfig`` vLLM's selector builds for each layer (block size,
    attention type, multimodal prefix, batch invariance, ...), so the kernel map asks vLLM with
    exactly its own inputs. Model build time only; the call itself is untouched."""
    try:
        from vllm.v1.attention import selector as sel
    except Exception as exc:
        state.errors.record("install", exc)
        return
    orig = getattr(sel, "_cached_get_attn_backend", None)
    if orig is None or getattr(orig, "_attnprof", False):
        return

    @functools.wraps(orig)
    def _cached_get_attn_backend(*args: Any, **kwargs: Any) -> Any:
        cap.selector_seen = kwargs.get("attn_selector_config")
        return orig(*args, **kwargs)

    _cached_get_attn_backend._attnprof = True  # type: ignore[attr-defined]
    for name in ("cache_clear", "cache_info"):  # it is an lru_cache; keep its handles
        if hasattr(orig, name):
            setattr(_cached_get_attn_backend, name, getattr(orig, name))
    _patch(sel, "_cached_get_attn_backend", _cached_get_attn_backend)


def _watch_kv_cache(cap: Capture, state: HostState, runner_cls: Any) -> None:
    """Learn each layer's KV-cache group when vLLM allocates the KV cache
    (``initialize_kv_cache``; ``CPUModelRunner`` calls this one): the call is untouched."""
    orig = getattr(runner_cls, "initialize_kv_cache", None)
    if orig is None or getattr(orig, "_attnprof", False):
        return

    @functools.wraps(orig)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, kv_cache_config, *args, **kwargs)
        try:
            model_info.learn_kv_groups(cap, kv_cache_config)
        except Exception as exc:
            state.errors.record("kv_groups", exc)
        return out

    initialize_kv_cache._attnprof = True  # type: ignore[attr-defined]
    _patch(runner_cls, "initialize_kv_cache", initialize_kv_cache)


def _watch_runner(cap: Capture, state: HostState) -> None:
    """After vLLM's ``init_device`` (which builds the worker's model runner): hook V2 where the
    worker runs it, and keep the runner report (``cap.runner``). The call is untouched."""
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except Exception as exc:
        state.errors.record("install", exc)
        return
    orig = WorkerWrapperBase.init_device
    if getattr(orig, "_attnprof", False):
        return

    @functools.wraps(orig)
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        try:
            # vars(): the wrapper's __getattr__ forwards to a worker it may not have yet.
            runner = getattr(vars(self).get("worker"), "model_runner", None)
            cap.runner = runner_v2.on_runner_built(
                runner, lambda: runner_v2.patch_v2(
                    cap, _patch, lambda c: _watch_kv_cache(cap, state, c)))
        except Exception as exc:
            state.errors.record("install", exc)
        return out

    init_device._attnprof = True  # type: ignore[attr-defined]
    _patch(WorkerWrapperBase, "init_device", init_device)


WorkerMethods = Callable[[Capture, HostState], dict[str, Callable[..., Any]]]
"""Builds the ``attnprof_*`` methods vLLM's ``WorkerBase`` answers RPCs with (the host's)."""


def install(state: HostState, methods: WorkerMethods | None = None) -> Capture | None:
    """Patch vLLM classes in this process (called once, from the general plugin), with
    ``methods(cap, state)`` on ``WorkerBase`` (none without). Returns the :class:`Capture`,
    or None when vLLM's ``Attention`` cannot be imported (counted)."""
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except Exception as exc:
        state.errors.record("install", exc)
        return None
    cap = Capture(state, args=vargs.for_version(_vllm_version()))
    _CAPTURES.append((cap, state))

    _watch_selector(cap, state)
    orig_init = Attention.__init__
    if not getattr(orig_init, "_attnprof", False):
        @functools.wraps(orig_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            # Subclasses (encoder-only, cross attention) select before calling this, so the
            # selector seen last is this layer's; it is consumed here.
            orig_init(self, *args, **kwargs)
            try:
                cap.wrap_layer(self, cap.selector_seen)
            except Exception as exc:
                state.errors.record("wrap_layer", exc)
            cap.selector_seen = None

        __init__._attnprof = True  # type: ignore[attr-defined]
        _patch(Attention, "__init__", __init__)

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        orig_fwd = GPUModelRunner._model_forward
        if not getattr(orig_fwd, "_attnprof", False):
            _model_forward = step_hook(cap, orig_fwd)
            _model_forward._attnprof = True  # type: ignore[attr-defined]
            _patch(GPUModelRunner, "_model_forward", _model_forward)
        # Sampled steps leave full CUDA graphs: decided where vLLM picks the step's graph.
        orig_det = getattr(GPUModelRunner, "_determine_batch_execution_and_padding", None)
        if orig_det is not None and not getattr(orig_det, "_attnprof", False):
            _determine = cudagraph.determine_hook(cap, orig_det, cap.graphs, cap.args)
            _determine._attnprof = True  # type: ignore[attr-defined]
            _patch(GPUModelRunner, "_determine_batch_execution_and_padding", _determine)
        _watch_kv_cache(cap, state, GPUModelRunner)
    except Exception as exc:
        state.errors.record("install", exc)
    _watch_runner(cap, state)

    try:
        from vllm.v1.worker.worker_base import WorkerBase

        for name, fn in (methods(cap, state) if methods is not None else {}).items():
            _patch(WorkerBase, name, fn)
        state.capture = cap
    except Exception as exc:
        state.errors.record("install", exc)
    return cap


def uninstall() -> None:
    """Undo :func:`install` in this process: every patched attribute holds its original
    again (or is gone, where there was none), layers built meanwhile run vLLM's own
    ``forward`` with no attnprof mark, and the state forgets its capture. Idempotent;
    without an install it does nothing. Never raises for one attribute that cannot be put
    back (the others still are)."""
    while _PATCHES:
        owner, name, old = _PATCHES.pop()
        try:
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        except Exception:  # one failing undo must not keep the rest patched
            pass
    while _CAPTURES:
        cap, state = _CAPTURES.pop()
        cap.remove_layers()
        for w in cap.wrapped:
            w.impl.__dict__.pop("_attnprof_wrapped", None)
        cap.wrapped.clear()
        if state.capture is cap:
            state.capture = None
