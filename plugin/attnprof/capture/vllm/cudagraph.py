"""Sampled steps under CUDA graphs: attention outside the graph on the steps attnprof samples.

With vLLM's default ``cudagraph_mode=FULL_AND_PIECEWISE`` uniform-decode batches replay a
**full** CUDA graph: no Python runs inside, so no layer wrapper fires and a sampled step is
blind. vLLM picks each step's graph in ``GPUModelRunner._determine_batch_execution_and_padding``
(through ``CudagraphDispatcher.dispatch``), before ``_model_forward``, where the step hook
decides. So on a runner whose dispatcher can answer FULL, :func:`determine_hook` decides the
step at dispatch time, exactly as the step hook would (the sampler is a pure function of seed,
step index and rate; the long-prefill stratum reads the step's scheduled token count, which
dispatch has), and hands the decision to the step hook (``Capture.predecided``), which takes it
instead of deciding again. For a sampled step vLLM's dispatcher is asked once more with FULL
excluded: PIECEWISE where vLLM captured a piecewise graph for that size, else NONE (eager).
Unsampled steps get vLLM's own answer, not even asked twice, and the runner's dispatcher is
untouched outside a sampled step's dispatch.

A sampled step stays in a full graph (blind, ``attnprof_dropped_samples_total{reason=
"cudagraph_full_only"}``) only where vLLM allows nothing else for it: data-parallel ranks that
agreed on FULL (vLLM re-dispatches with ``valid_modes={FULL}``). An error in this module is
counted (``place="cudagraph"``) and vLLM's own answer stands: the step is then blind, as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from attnprof.capture.vllm import args as vargs

__all__ = ["FULL_ONLY", "GraphSteer", "decide_now", "determine_hook"]

FULL_ONLY = "cudagraph_full_only"
"""Drop reason of a sampled step left in a full CUDA graph: vLLM allowed no other mode."""


@dataclass
class GraphSteer:
    """Sampled steps on a runner that can replay full CUDA graphs, by the runtime mode they
    ran in (``FULL``: blind), and how many of them vLLM would have run as a full graph
    (``steered``: moved to PIECEWISE or NONE for attnprof)."""

    modes: dict[str, int] = field(default_factory=dict)
    steered: int = 0

    def count(self, mode: str, steered: bool) -> None:
        self.modes[mode] = self.modes.get(mode, 0) + 1
        self.steered += int(steered)


def decide_now(cap: Any, num_tokens: int) -> str | None:
    """Decide the step about to run as the step hook would (None, "sampled" or
    "sampled_long") and leave the decision for it: the sampler is advanced past the step,
    ``cap.predecided`` holds (outcome, the countdown after the step) and the countdown is set
    so the hook's own decrement takes its slow path, which restores it and returns the
    outcome. Asked again before that step runs, it returns the same decision."""
    pre = cap.predecided
    if pre is not None:
        return pre[0]  # type: ignore[no-any-return]
    s = cap.sampler
    s.countdown -= 1  # the step hook's decrement, done here
    outcome = None
    try:
        if s.countdown <= 0 and s.fire():
            outcome = None if cap.errors.disabled else "sampled"
        elif (cap.long_on and not cap.errors.disabled and num_tokens >= s.long_tokens
              and s.long_prefill(num_tokens)):
            outcome = "sampled_long"
    except Exception as exc:  # as the step hook's own decision: counted, unsampled
        cap.errors.record("sampler", exc)
        outcome = None
    cap.predecided = (outcome, s.countdown)
    s.countdown = 1
    return outcome


def _full_modes() -> frozenset[Any]:
    """vLLM's cudagraph modes under which a step may replay a full graph."""
    from vllm.config import CUDAGraphMode

    return frozenset(m for m in CUDAGraphMode if m.has_full_cudagraphs())


class _Steered:
    """``CudagraphDispatcher.dispatch`` for one sampled step: vLLM's own answer, unless it is
    FULL; then vLLM's answer with FULL excluded, where that leaves a mode vLLM allows.
    ``steered``: an answer was replaced."""

    def __init__(self, orig: Any, args: vargs.VllmArgs, errors: Any) -> None:
        from vllm.config import CUDAGraphMode

        self.orig = orig
        self.args = args
        self.errors = errors
        self.modes = CUDAGraphMode
        self.steered = False

    def __call__(self, *a: Any, **kw: Any) -> Any:
        got = self.orig(*a, **kw)  # vLLM's own answer (its exceptions are vLLM's)
        try:
            full = self.modes.FULL
            if got[0] != full:
                return got
            call = self.args.dispatch_call(a, kw)
            valid = call.get("valid_modes")
            invalid = set(call.get("invalid_modes") or ()) | {full}
            allowed = set(valid or self.modes.valid_runtime_modes()) - invalid
            if not allowed:  # data-parallel ranks agreed on FULL: nothing else is allowed
                return got
            # Copies: vLLM subtracts invalid_modes from valid_modes in place.
            alt = self.orig(**dict(call, valid_modes=set(valid) if valid else None,
                                   invalid_modes=invalid))
        except Exception as exc:  # ours, or vLLM refusing our question: its answer stands
            self.errors.record("cudagraph", exc)
            return got
        if alt[0] not in allowed:
            return got
        self.steered = True
        return alt


def determine_hook(cap: Any, orig: Any, steer: GraphSteer,
                   args: vargs.VllmArgs = vargs.VLLM_0_32) -> Any:
    """The replacement for ``GPUModelRunner._determine_batch_execution_and_padding``
    (``orig``). A runner whose dispatcher cannot answer FULL (CPU, ``--enforce-eager``,
    PIECEWISE), a dummy or capture run, and capture switched off: vLLM's call alone. Never
    raises for its own bookkeeping; vLLM's own exceptions pass through."""
    full_modes: frozenset[Any] | None = None
    sampler = cap.sampler
    long_on, long_tokens = cap.long_on, sampler.long_tokens

    @functools.wraps(orig)
    def _determine(runner: Any, *a: Any, **kw: Any) -> Any:
        nonlocal full_modes
        disp: Any = None
        steered: _Steered | None = None
        try:
            disp = runner.cudagraph_dispatcher
            if full_modes is None:
                full_modes = _full_modes()
            n = args.step_dispatch_tokens(a, kw)
            if (n is not None and disp.cudagraph_mode in full_modes and not cap.errors.disabled
                    and (sampler.countdown <= 1 or (long_on and _may_be_long(
                        runner, disp, n, long_tokens)))
                    and decide_now(cap, n) is not None):
                steered = _Steered(type(disp).dispatch.__get__(disp), args, cap.errors)
                disp.__dict__["dispatch"] = steered
            # Otherwise not a serving step, no full graph to leave, unsampled, or a step the
            # hook's unsampled fast path takes whatever it decides: vLLM's call alone.
        except Exception as exc:
            cap.errors.record("cudagraph", exc)
            steered = None
        if steered is None:
            return orig(runner, *a, **kw)
        try:
            got = orig(runner, *a, **kw)
        finally:
            if vars(disp).get("dispatch") is steered:
                del disp.__dict__["dispatch"]
        try:
            mode = str(getattr(got[0], "name", got[0]))
            steer.count(mode, steered.steered)
            if mode == "FULL":
                cap.errors.drop(FULL_ONLY)
        except Exception as exc:
            cap.errors.record("cudagraph", exc)
        return got

    return _determine


def _may_be_long(runner: Any, disp: Any, n: int, long_tokens: int) -> bool:
    """Whether the forward may be handed ``long_tokens`` tokens or more (padding included:
    the step hook's long-prefill check reads the padded count). Data-parallel ranks pad to
    each other's counts: any size then."""
    if n >= long_tokens:
        return True
    try:
        if runner.vllm_config.parallel_config.data_parallel_size > 1:
            return True
        top = disp.compilation_config.max_cudagraph_capture_size or 0
    except Exception:
        return True
    return n <= top and top >= long_tokens
