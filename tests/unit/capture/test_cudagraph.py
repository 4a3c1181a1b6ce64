"""Sampled steps leave full CUDA graphs (capture/vllm/cudagraph.py), checked against vLLM 0.32's
real ``CudagraphDispatcher`` and its real ``GPUModelRunner._determine_batch_execution_and_padding``
on CPU: the dispatcher is built from a ``VllmConfig`` whose compilation config is set as on a GPU
(VLLM_COMPILE, attention in the splitting ops, capture sizes) and its keys initialized as the
GPU model runner does (``resolve_cudagraph_mode_and_sizes``, ``initialize_cudagraph_keys``).
The runner is a namespace holding what that method reads (no GPU model runner builds on CPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from attnprof.aggregate.sampler import StepSampler
from attnprof.capture.vllm import args as vargs
from attnprof.capture.vllm.cudagraph import FULL_ONLY, GraphSteer, determine_hook
from attnprof.capture.vllm.hooks import Capture, step_hook
from attnprof.config import Config
from attnprof.host.vllm import worker_rpc
from attnprof.host.vllm.runtime import State

pytestmark = pytest.mark.slow
vcfg = pytest.importorskip("vllm.config")
gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher  # noqa: E402

M = vcfg.CUDAGraphMode
SIZES = [1, 2, 4, 8]
ORIG = gmr.GPUModelRunner._determine_batch_execution_and_padding


def gpu_vllm_config(mode: Any) -> Any:
    """A ``VllmConfig`` whose CUDA graphs are set as on a GPU for ``mode`` (the CPU platform
    turned them off): compiled, attention split out, captured at ``SIZES``. Test_runner_v2
    keys V2's manager on it."""
    vc = vcfg.VllmConfig()
    cc = vc.compilation_config
    cc.mode = vcfg.CompilationMode.VLLM_COMPILE
    cc.cudagraph_mode = mode
    cc.cudagraph_capture_sizes = list(SIZES)
    cc.max_cudagraph_capture_size = SIZES[-1]
    cc.splitting_ops = None
    cc.set_splitting_ops_for_v1("naive")
    cc.post_init_cudagraph_sizes()
    return vc


def _runner(mode: Any) -> Any:
    """A runner whose dispatcher is vLLM's, keyed for ``mode`` as the GPU runner keys it."""
    vc = gpu_vllm_config(mode)
    cc = vc.compilation_config
    disp = CudagraphDispatcher(vc)
    support = AttentionCGSupport.ALWAYS if mode == M.FULL else AttentionCGSupport.UNIFORM_BATCH
    resolved = cc.resolve_cudagraph_mode_and_sizes(
        support, "FLASH_ATTN", 1, max_num_reqs=vc.scheduler_config.max_num_seqs)
    assert resolved == mode
    disp.initialize_cudagraph_keys(resolved, 1)
    return SimpleNamespace(
        cudagraph_dispatcher=disp, vllm_config=vc, parallel_config=vc.parallel_config,
        uniform_decode_query_len=1, _is_uniform_decode=gmr.GPUModelRunner._is_uniform_decode,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        input_batch=SimpleNamespace(lora_id_to_lora_request={}),
        device=SimpleNamespace(type="cpu"))


def steer_capture(rate: float, long_rate: float = 0.0, long_tokens: int = 1024) -> Capture:
    """A capture sampling at ``rate`` (seed 3) with head statistics off. Budget 1.0: the rate
    stays put, so a sampler alone gives the reference decisions."""
    return Capture(State(config=Config(
        enabled=True, sample_rate=rate, seed=3, model_label="m", long_prefill_rate=long_rate,
        long_prefill_tokens=long_tokens, overhead_budget=1.0, head_stats_rate=0.0)))


def _step_kw(n: int, decode: bool = True) -> dict[str, Any]:
    """``execute_model``'s call for a batch of ``n`` tokens (decode: n requests of one)."""
    per = [1] * n if decode else [n]
    return dict(num_tokens=n, num_reqs=len(per),
                num_scheduled_tokens_np=np.array(per, dtype=np.int32),
                max_num_scheduled_tokens=max(per), use_cascade_attn=False, num_encoder_reqs=0,
                allow_microbatching=True)


def _serve(cap: Capture, runner: Any, sizes: list[int]) -> list[tuple[Any, bool, Any]]:
    """Steps as ``execute_model`` runs them: vLLM's graph choice through the hook, then the
    forward through the step hook. Per step: (mode chosen, whether attnprof sampled it,
    vLLM's own answer for the same call)."""
    det = determine_hook(cap, ORIG, cap.graphs, cap.args)
    out: list[tuple[Any, bool, Any]] = []
    sampled: list[bool] = []

    def forward(_runner: Any, input_ids: Any = None) -> None:
        sampled.append(bool(cap.in_step))

    hook = step_hook(cap, forward)
    for n in sizes:
        own = ORIG(runner, **_step_kw(n))
        got = det(runner, **_step_kw(n))
        hook(runner, input_ids=np.zeros(got[1].num_tokens))
        out.append((got, sampled[-1], own))
    return out


def _reference(rate: float, sizes: list[int], long_rate: float = 0.0,
               long_tokens: int = 1024) -> list[bool]:
    """The step hook's decisions with no dispatch involved: the sampler alone."""
    s = StepSampler(rate, 1.0, long_tokens, long_rate, seed=3)
    return [s.tick() or (long_rate > 0 and s.long_prefill(n)) for n in sizes]


SIZES_RUN = [1, 3, 8, 2, 4, 5, 1, 8, 7, 6] * 20


@pytest.mark.parametrize(("mode", "sampled_mode"), [
    (M.FULL_AND_PIECEWISE, M.PIECEWISE),  # vLLM's default: the piecewise graph of that size
    (M.FULL, M.NONE),  # no piecewise graphs: eager
    (M.FULL_DECODE_ONLY, M.NONE),
])
def test_sampled_steps_leave_full_graphs_unsampled_keep_vllms_answer(mode: Any,
                                                                     sampled_mode: Any) -> None:
    runner = _runner(mode)
    cap = steer_capture(0.3)
    steps = _serve(cap, runner, SIZES_RUN)
    assert [s for _, s, _ in steps] == _reference(0.3, SIZES_RUN)  # the same steps sampled
    assert 20 < sum(s for _, s, _ in steps) < 100
    for n, (got, sampled, own) in zip(SIZES_RUN, steps, strict=True):
        assert own[0] == M.FULL  # vLLM would replay every one of these as a full graph
        if sampled:
            assert got[0] == sampled_mode
            # vLLM's own answer with FULL excluded (its padding to the graph's size included)
            assert got[:2] == runner.cudagraph_dispatcher.dispatch(
                n, uniform_decode=True, invalid_modes={M.FULL})
        else:
            assert got == own  # untouched: the very tuple vLLM gives
    n_sampled = sum(s for _, s, _ in steps)
    assert cap.graphs == GraphSteer(modes={sampled_mode.name: n_sampled}, steered=n_sampled)
    stats = worker_rpc.sampler_stats(cap)  # what the snapshot says
    assert stats.graph_modes == {sampled_mode.name: n_sampled}
    assert stats.graph_steered == n_sampled
    assert "dispatch" not in vars(runner.cudagraph_dispatcher)  # nothing left on the instance
    assert cap.errors.by_place == {} and FULL_ONLY not in cap.errors.dropped


def test_piecewise_mode_is_vllms_alone() -> None:
    """No full graph to leave: the hook decides nothing at dispatch, the step hook does."""
    runner = _runner(M.PIECEWISE)
    cap = steer_capture(0.3)
    steps = _serve(cap, runner, SIZES_RUN[:50])
    assert [s for _, s, _ in steps] == _reference(0.3, SIZES_RUN[:50])
    assert all(got == own and got[0] == M.PIECEWISE for got, _, own in steps)
    assert cap.graphs == GraphSteer()


def test_long_prefill_stratum_is_decided_at_dispatch_too() -> None:
    """The long-prefill stratum reads the step's token count (here a capture size reaches
    it): its coin is drawn at dispatch, and the step hook takes the same decision."""
    runner = _runner(M.FULL_AND_PIECEWISE)
    cap = steer_capture(0.05, long_rate=0.5, long_tokens=4)
    sizes = [4, 8, 1, 2, 8, 4] * 30
    steps = _serve(cap, runner, sizes)
    ref = _reference(0.05, sizes, long_rate=0.5, long_tokens=4)
    assert [s for _, s, _ in steps] == ref
    assert sum(ref) > 40
    assert all((got[0] == M.PIECEWISE) == sampled for got, sampled, _ in steps)


def test_dummy_and_capture_runs_are_untouched() -> None:
    """``_dummy_run`` (warm-up, graph capture) passes ``force_uniform_decode``: vLLM asserts
    its capture mode equals the dispatch, so such calls are never steered nor decided."""
    runner = _runner(M.FULL_AND_PIECEWISE)
    cap = steer_capture(1.0)
    det = determine_hook(cap, ORIG, cap.graphs, cap.args)
    before = cap.sampler.countdown
    kw = dict(_step_kw(4), force_uniform_decode=True, force_has_lora=False,
              force_num_active_loras=0)
    assert det(runner, **kw) == ORIG(runner, **kw)
    assert det(runner, **kw)[0] == M.FULL
    assert cap.sampler.countdown == before and cap.predecided is None


def test_asked_twice_before_the_step_decides_once() -> None:
    runner = _runner(M.FULL_AND_PIECEWISE)
    cap = steer_capture(1.0)
    det = determine_hook(cap, ORIG, cap.graphs, cap.args)
    a = det(runner, **_step_kw(4))
    b = det(runner, **_step_kw(4))
    assert a[0] == b[0] == M.PIECEWISE
    assert cap.sampler.decided == 1


def test_full_only_when_vllm_allows_nothing_else() -> None:
    """Data-parallel ranks that agreed on FULL re-dispatch with ``valid_modes={FULL}``: the
    step stays in the full graph, vLLM's answer untouched, and the drop says why."""
    from attnprof.capture.vllm.cudagraph import _Steered

    runner = _runner(M.FULL_AND_PIECEWISE)
    disp = runner.cudagraph_dispatcher
    cap = steer_capture(1.0)
    steered = _Steered(type(disp).dispatch.__get__(disp), cap.args, cap.errors)
    valid = {M.FULL}
    got = steered(4, uniform_decode=True, valid_modes=valid)
    assert got == disp.dispatch(4, uniform_decode=True, valid_modes={M.FULL})
    assert got[0] == M.FULL and not steered.steered and valid == {M.FULL}
    # the caller's sets are never changed (vLLM subtracts in place)
    inv = {M.NONE}
    got = steered(4, True, False, 0, None, inv)
    assert got[0] == M.PIECEWISE and steered.steered and inv == {M.NONE}


class _BrokenArgs(vargs.VllmArgs):
    def step_dispatch_tokens(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        raise RuntimeError("boom")

    def dispatch_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("boom")


def test_errors_in_attnprof_fall_back_to_vllms_answer() -> None:
    runner = _runner(M.FULL_AND_PIECEWISE)
    cap = steer_capture(1.0)
    broken = _BrokenArgs(versions=("0.32",))
    det = determine_hook(cap, ORIG, cap.graphs, broken)
    assert det(runner, **_step_kw(4)) == ORIG(runner, **_step_kw(4))
    assert cap.errors.by_place == {"cudagraph": 1}
    # failing inside the steered dispatch (the step is already decided): vLLM's answer
    from attnprof.capture.vllm.cudagraph import _Steered

    disp = runner.cudagraph_dispatcher
    steered = _Steered(type(disp).dispatch.__get__(disp), broken, cap.errors)
    assert steered(4, uniform_decode=True) == disp.dispatch(4, uniform_decode=True)
    assert cap.errors.by_place == {"cudagraph": 2}


def test_adapter_matches_vllms_signatures() -> None:
    import inspect

    det = list(inspect.signature(ORIG).parameters)[1:]
    assert tuple(det[:len(vargs.VLLM_0_32.determine)]) == vargs.VLLM_0_32.determine
    disp = list(inspect.signature(CudagraphDispatcher.dispatch).parameters)[1:]
    assert tuple(disp) == vargs.VLLM_0_32.dispatch
