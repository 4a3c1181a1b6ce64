"""The aggregate room and the capture hooks, with hand-built records and fake vLLM objects:
every counting rule checked in milliseconds, no server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from attnprof.aggregate.layers import (
    BatchShape,
    LayerCall,
    LayerInfo,
    StepRecord,
    WorkerAggregates,
    attention_bytes,
    attention_flops,
)
from attnprof.capture.vllm.args import batch_shape
from attnprof.capture.vllm.hooks import Capture, step_hook
from attnprof.config import Config
from attnprof.exporters.hub import ExportHub
from attnprof.exporters.prometheus import PrometheusSink
from attnprof.exporters.samples import worker_samples
from attnprof.host.vllm import worker_rpc
from attnprof.host.vllm.runtime import State


def _info(index: int = 0, kv_dtype: str = "auto", dtype: str = "bfloat16") -> LayerInfo:
    return LayerInfo(name=f"model.layers.{index}.self_attn.attn", index=index,
                     backend="FLASH_ATTN", impl="FlashAttentionImpl", num_heads=8,
                     num_kv_heads=2, head_size=64, head_size_v=64, sliding_window=None,
                     dtype=dtype, kv_cache_dtype=kv_dtype, fused=True)


def _shape(phase: Any = "decode", tokens: int = 4, seqs: tuple[int, ...] = (10, 20, 30, 40)
           ) -> BatchShape:
    qlens = [1] * len(seqs) if phase == "decode" else list(seqs)
    pairs = sum(q * s for q, s in zip(qlens, seqs, strict=True))
    return BatchShape(phase, tokens, pairs, sum(seqs), len(seqs), max(seqs))


def test_flops_and_bytes_formulas() -> None:
    info, shape = _info(), _shape()
    assert shape.pairs == 100
    assert attention_flops(info, shape) == 2 * 8 * 128 * 100
    # bf16: Q+O 2 B * 4 tokens * 8 heads * 128; K+V 2 B * 100 keys * 2 kv heads * 128
    assert attention_bytes(info, shape) == 2 * 4 * 8 * 128 + 2 * 100 * 2 * 128
    fp8 = _info(kv_dtype="fp8_e4m3")
    assert attention_bytes(fp8, shape) == 2 * 4 * 8 * 128 + 1 * 100 * 2 * 128


def test_record_step_folds_per_layer_and_phase() -> None:
    aggs = WorkerAggregates()
    l0, l1 = _info(0), _info(1)
    aggs.add_layer(l0)
    aggs.add_layer(l1)
    dec = _shape("decode")
    pre = _shape("prefill", tokens=100, seqs=(100,))
    aggs.record_step(StepRecord("sampled", 0.010, [LayerCall(l0, dec, 0.001),
                                                   LayerCall(l1, dec, 0.003)]))
    aggs.record_step(StepRecord("sampled", 0.020, [LayerCall(l0, dec, 0.002)]))
    aggs.record_step(StepRecord("sampled_long", 0.050, [LayerCall(l0, pre, 0.010)]))
    aggs.record_step(StepRecord("blind", 0.0))
    prof = {p.index: p for p in aggs.layer_profiles()}
    d0 = prof[0].phases["decode"]
    assert (d0.calls, d0.tokens, d0.max_seq_len) == (2, 8, 40)
    assert d0.time_s == pytest.approx(0.003) and d0.mean_time_s == pytest.approx(0.0015)
    assert d0.mean_batch_requests == 4 and d0.mean_seq_len == 25
    assert prof[0].phases["prefill"].calls == 1 and "prefill" not in prof[1].phases
    steps = aggs.step_stats()
    assert steps["decode"].steps == 2
    assert steps["decode"].attention_share == pytest.approx(0.006 / 0.030)
    assert steps["prefill"].attention_share == pytest.approx(0.2)
    assert aggs.outcomes == {"sampled": 2, "sampled_long": 1, "blind": 1}


def test_worker_samples_render_exactly_on_prometheus() -> None:
    aggs = WorkerAggregates()
    info = _info(3)
    aggs.add_layer(info)
    for _ in range(5):
        aggs.record_step(StepRecord("sampled", 0.01, [LayerCall(info, _shape(), 0.002)]))
    sampler = SimpleNamespace(unsampled=95, self_time_s=0.5, effective_rate=0.05)
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    sink.export(worker_samples("m", aggs, sampler, head_queries=7))
    sink.export(worker_samples("m", aggs, sampler, head_queries=7))  # idempotent re-export
    get = reg.get_sample_value
    lab = {"model": "m", "layer": "3", "backend": "FLASH_ATTN", "phase": "decode"}
    assert get("attnprof_attention_calls_total", lab) == 5
    assert get("attnprof_attention_time_seconds_total", lab) == pytest.approx(0.01)
    assert get("attnprof_attention_flops_total", {"model": "m", "layer": "3",
                                                  "phase": "decode"}) == 5 * 2 * 8 * 128 * 100
    assert get("attnprof_steps_total", {"model": "m", "outcome": "sampled"}) == 5
    assert get("attnprof_steps_total", {"model": "m", "outcome": "unsampled"}) == 95
    assert get("attnprof_head_stats_queries_total", {"model": "m"}) == 7
    assert get("attnprof_layer_info", {"model": "m", "layer": "3", "backend": "FLASH_ATTN",
                                       "impl": "FlashAttentionImpl", "fused": "true"}) == 1


def test_batch_shape_from_metadata() -> None:
    # Two decodes and one whole 5-token prompt in one step (chunked-prefill mixed batch).
    md = SimpleNamespace(num_actual_tokens=7, max_query_len=5, seq_lens=[9, 12, 5],
                         query_start_loc=[0, 1, 2, 7])
    s = batch_shape(md)
    assert (s.phase, s.num_tokens, s.num_reqs, s.max_seq_len) == ("mixed", 7, 3, 12)
    assert s.pairs == 9 + 12 + 25 and s.kv_tokens == 26
    assert s.whole_prompts == ((2, 5),)
    dec = batch_shape(SimpleNamespace(num_actual_tokens=2, max_query_len=1, seq_lens=[3, 4]))
    assert dec.phase == "decode" and dec.pairs == 7 and dec.whole_prompts == ()


# ----- the hooks over fake vLLM objects -----
class _Impl:
    calls = 0

    def forward(self, layer: Any, q: Any, k: Any, v: Any, kv_cache: Any, md: Any) -> str:
        type(self).calls += 1
        return "out"


class _Layer:
    num_heads, num_kv_heads, head_size, head_size_v = 8, 2, 64, 64
    sliding_window = None
    dtype = "float32"
    kv_cache_dtype = "auto"

    def __init__(self, i: int) -> None:
        self.layer_name = f"model.layers.{i}.self_attn.attn"
        self.impl = _Impl()


def _capture(rate: float, **kw: Any) -> Capture:
    # Budget 1.0: these tests count steps, not the adaptive rate (tested in test_sampling).
    state = State(config=Config(enabled=True, sample_rate=rate, seed=0, model_label="m",
                                long_prefill_rate=0.0, overhead_budget=1.0, **kw))
    hub = ExportHub(on_error=state.errors.record)
    hub.add_sink(PrometheusSink(registry=CollectorRegistry()))
    state.hub = hub
    return Capture(state)


def _wrapped_layers(cap: Capture, n: int) -> list[_Layer]:
    """``n`` fake attention layers (0 .. n-1), each wrapped by ``cap`` as install does."""
    layers = [_Layer(i) for i in range(n)]
    for lay in layers:
        cap.wrap_layer(lay)
    return layers


def _run_steps(cap: Capture, layers: list[_Layer], n: int) -> list[bool]:
    """n fake steps through the installed step hook; True where layer 0 ran our wrapper."""
    md = SimpleNamespace(num_actual_tokens=2, max_query_len=1, seq_lens=[5, 6])
    wrapped_seen: list[bool] = []

    def model_forward(runner: Any, input_ids: Any = None) -> None:
        wrapped_seen.append("forward" in vars(layers[0].impl))
        for lay in layers:
            lay.impl.forward(lay, 1, 2, 3, None, md)

    hook = step_hook(cap, model_forward)
    for _ in range(n):
        hook(SimpleNamespace(device=SimpleNamespace(type="cpu")), input_ids=[0, 0])
    return wrapped_seen


@pytest.mark.slow
def test_layers_do_no_attnprof_work_on_unsampled_steps() -> None:
    cap = _capture(0.0)
    layers = _wrapped_layers(cap, 3)
    seen = _run_steps(cap, layers, 20)
    assert not any(seen)  # vLLM's own forward every time
    assert all("forward" not in vars(lay.impl) for lay in layers)
    assert cap.seen == 20 and cap.aggs.outcomes["sampled"] == 0 and cap.aggs.agg == {}
    cap.state.hub.stop(final_flush=False)


def test_sampled_steps_time_every_layer_and_restore_vllms_forward() -> None:
    cap = _capture(1.0)
    layers = _wrapped_layers(cap, 3)
    seen = _run_steps(cap, layers, 4)
    assert all(seen)
    assert all("forward" not in vars(lay.impl) for lay in layers)  # removed after each step
    assert cap.aggs.outcomes["sampled"] == 4
    prof = cap.aggs.layer_profiles()
    assert [p.phases["decode"].calls for p in prof] == [4, 4, 4]
    assert worker_rpc.sampler_stats(cap).unsampled == 0
    cap.state.hub.stop(final_flush=False)


def test_fault_in_capture_is_counted_and_output_unchanged() -> None:
    from attnprof._safety import set_faults

    cap = _capture(1.0, fault_inject=("capture",))
    layers = _wrapped_layers(cap, 1)
    before = _Impl.calls
    set_faults(("capture",))
    try:
        _run_steps(cap, layers, 3)
    finally:
        set_faults(())
    assert _Impl.calls == before + 3  # the host's call ran every time
    assert cap.errors.by_place.get("capture") == 3
    assert cap.errors.dropped.get("capture_error") == 3
    cap.state.hub.stop(final_flush=False)


def test_malformed_liveness_notes_are_counted_not_fatal(tmp_path: Any) -> None:
    import json
    import os

    from attnprof.host.vllm import runtime

    (tmp_path / "worker-1.json").write_text(json.dumps(
        {"role": "worker", "pid": os.getpid(), "process": "w", "started_at": 1.0}))
    (tmp_path / "api_server-2.json").write_text("[1]")  # not an object
    (tmp_path / "worker-3.json").write_text('{"role": "work')  # still being written
    (tmp_path / "worker-4.json").write_text('{"role": "worker", "pid": "x"}')  # wrong type
    before = runtime.STATE.errors.by_place.get("snapshot_parse", 0)
    notes = runtime.processes_from_run_dir(Config(run_dir=tmp_path))
    assert [(n.role, n.pid, n.alive) for n in notes] == [("worker", os.getpid(), True)]
    assert runtime.STATE.errors.by_place.get("snapshot_parse", 0) - before == 2


class _FakeGpu:
    """CUDA events on a fake stream: work 'completes' when the test says so; a synchronize
    on any event is counted (it must never happen on the serving path)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.done_until = -1.0
        self.syncs = 0

    def event(self) -> Any:
        gpu = self

        class Event:
            def record(self) -> None:
                gpu.t += 0.001  # each recorded event is 1 ms of GPU work later
                self.at = gpu.t

            def query(self) -> bool:
                return self.at <= gpu.done_until

            def synchronize(self) -> None:
                gpu.syncs += 1

            def elapsed_time(self, end: Any) -> float:
                return (end.at - self.at) * 1e3  # ms, like torch

        return Event()


def gpu_rig(cap: Any) -> tuple[_FakeGpu, Any, Any]:
    """A capture on fake CUDA: two layers, the step hook, and a runner on a cuda device."""
    gpu = _FakeGpu()
    cap.event_factory = gpu.event
    cap.capturing_graph = lambda: False
    layers = _wrapped_layers(cap, 2)
    md = SimpleNamespace(num_actual_tokens=2, max_query_len=1, seq_lens=[5, 6])

    def model_forward(runner: Any, input_ids: Any = None) -> None:
        for lay in layers:
            lay.impl.forward(lay, 1, 2, 3, None, md)

    return gpu, step_hook(cap, model_forward), SimpleNamespace(
        device=SimpleNamespace(type="cuda"))


def test_gpu_steps_are_timed_by_events_read_late_with_no_sync() -> None:
    cap = _capture(1.0)
    gpu, hook, cuda = gpu_rig(cap)
    for _ in range(3):
        hook(cuda, input_ids=[0, 0])
    # The GPU has not finished anything: nothing is folded, nobody waited.
    assert cap.aggs.outcomes["sampled"] == 0 and len(cap.pending) == 3 and gpu.syncs == 0
    gpu.done_until = gpu.t  # all work done
    hook(cuda, input_ids=[0, 0])  # the next sampled step folds the finished ones
    assert cap.aggs.outcomes["sampled"] == 3 and len(cap.pending) == 1
    gpu.done_until = gpu.t
    snap = worker_rpc.snapshot(cap, include_head_stats=False)  # the snapshot folds the rest
    assert snap.sampler.sampled == 4 and not cap.pending and gpu.syncs == 0
    prof = cap.aggs.layer_profiles()
    # Events 1 ms apart: each layer call spans exactly one event interval.
    assert prof[0].phases["decode"].calls == 4
    assert abs(prof[0].phases["decode"].time_s - 4 * 0.001) < 1e-9
    cap.state.hub.stop(final_flush=False)


def test_sampling_switch_and_poll_deltas() -> None:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator

    cap = _capture(0.0)
    layers = _wrapped_layers(cap, 1)
    assert not any(_run_steps(cap, layers, 10))
    out = cap.set_sampling(rate=1.0, head_stats_rate=0.5)
    assert out["old"]["sample_rate"] == 0.0 and out["new"] == {"sample_rate": 1.0,
                                                                "head_stats_rate": 0.5}
    assert all(_run_steps(cap, layers, 5))
    with pytest.raises(ValueError):
        cap.set_sampling(head_stats_rate=2.0)
    # poll(): the worker snapshot without head statistics; the accumulator's halves swap and
    # the swapped-out one becomes a delta on the drain thread, collected by a later call.
    from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer

    cap.hs_buffer = HeadStatsDoubleBuffer(HeadStatsAccumulator(1, 2, 4))
    cap.hs_buffer.active.queries[0, 0] = 3.0
    got = worker_rpc.poll(cap)
    assert got["snapshot"]["head_stats"] is None and got["rank"]["tp_rank"] == 0
    assert got["head_stats"]["deltas"] == []  # nothing finished before this pull
    assert cap.hs_buffer.wait(60) and not cap.hs_buffer.active.queries.any()
    took = worker_rpc.head_stats_take(cap)["head_stats"]
    assert not took["pending"] and len(took["deltas"]) == 1
    assert HeadStatsAccumulator.from_bytes(took["deltas"][0]["data"]).queries[0, 0] == 3.0
    again = worker_rpc.poll(cap)["head_stats"]
    assert again == {"deltas": [], "pending": False}  # nothing new since
    cap.state.hub.stop(final_flush=False)


def test_tp_ranks_other_than_zero_leave_per_layer_series_to_rank_zero() -> None:
    names: dict[int, set[str]] = {}
    for rank in (0, 1):
        cap = _capture(1.0)
        cap.rank["tp_rank"] = rank
        layers = _wrapped_layers(cap, 1)
        _run_steps(cap, layers, 3)
        names[rank] = {smp.name for smp in worker_rpc.samples(cap)}
        cap.state.hub.stop(final_flush=False)
    per_layer = {"attnprof_attention_calls_total", "attnprof_attention_time_seconds_total",
                 "attnprof_step_time_seconds_total", "attnprof_steps_total",
                 "attnprof_layer_info"}
    assert per_layer <= names[0] and not per_layer & names[1]
    # What each process costs is its own: self time and the sample rate come from every rank.
    assert {"attnprof_self_time_seconds_total", "attnprof_sample_rate_ratio"} <= names[1]
    # Each rank holds its own share of the KV cache, so every rank reports it (livesum).
    from attnprof.exporters.catalog import spec

    assert spec("attnprof_kv_cache_bytes").multiprocess_mode == "livesum"
