"""Per-layer attention capture inside a vLLM worker: hooks only.

Hook points (docs/vllm.md says why these and not module hooks):
- ``GPUModelRunner._model_forward`` (``CPUModelRunner`` inherits it) marks step boundaries
  and decides sampling. An unsampled step costs one countdown decrement, one compare and
  (with the long-prefill stratum on) one read of the step's token count.
- Each layer's ``impl.forward`` gets an instance-level wrapper **only while a sampled step
  runs**: the custom op ``unified_attention_with_output`` looks ``impl.forward`` up on
  every call, so on unsampled steps layers run vLLM's own method and attnprof does no work
  at all per layer.
A sampled step becomes one typed :class:`StepRecord` handed to the aggregate room; reading
vLLM's argument positions happens here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import sys
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

from attnprof._safety import fault_point
from attnprof.aggregate.layers import (
    UNFUSED_BACKENDS,
    BatchShape,
    LayerCall,
    LayerInfo,
    StepRecord,
    WorkerAggregates,
    layer_index,
)
from attnprof.aggregate.sampler import STREAM_HEAD_STATS, StepSampler
from attnprof.aggregate.trace import MAX_RANGES, LayerRange, StepTrace, TraceBuffer
from attnprof.capture import head_rows
from attnprof.capture.vllm.runtime import State
from attnprof.contracts.snapshot import (
    HeadStatsCost,
    KernelGroup,
    PollCost,
    SamplerStats,
    WorkerSnapshot,
)

__all__ = ["Capture", "batch_shape", "install", "layer_info", "step_hook"]

logger = logging.getLogger("attnprof")
HEAD_STATS_MAX_TOKENS = 32768
PENDING_STEPS_MAX = 64
"""Sampled GPU steps whose timing events are not read yet; beyond this the oldest is dropped."""


# ----- the vLLM adapter: every read of vLLM objects and argument positions -----
def layer_info(layer: Any, impl: Any) -> LayerInfo:
    name = str(getattr(layer, "layer_name", "") or "")
    try:
        backend = str(layer.attn_backend.get_name())
    except Exception:
        backend = type(impl).__name__.removesuffix("Impl").upper()
    sw = getattr(layer, "sliding_window", None)
    if sw is None:
        sw = getattr(impl, "sliding_window", None)
    if isinstance(sw, tuple):  # some impls store (left, right) with -1 for "none"
        sw = sw[0] + 1 if sw[0] >= 0 else None
    if not isinstance(sw, int) or sw <= 0:
        sw = None
    return LayerInfo(
        name=name, index=layer_index(name), backend=backend, impl=type(impl).__name__,
        num_heads=int(getattr(layer, "num_heads", 0) or 0),
        num_kv_heads=int(getattr(layer, "num_kv_heads", 0) or 0),
        head_size=int(getattr(layer, "head_size", 0) or 0),
        head_size_v=int(getattr(layer, "head_size_v", 0) or getattr(layer, "head_size", 0) or 0),
        sliding_window=sw,
        dtype=str(getattr(layer, "dtype", "")).removeprefix("torch."),
        kv_cache_dtype=str(getattr(layer, "kv_cache_dtype", "auto")),
        fused=backend not in UNFUSED_BACKENDS,
        scale=float(getattr(impl, "scale", 0.0) or 0.0),
        has_sink=bool(getattr(layer, "has_sink", False)),
        attn_type=str(getattr(getattr(layer, "attn_type", None), "value", None)
                      or getattr(layer, "attn_type", None) or "decoder"),
    )


def _report_key(info: LayerInfo) -> tuple[Any, ...]:
    """What vLLM's backend verdicts depend on for a layer."""
    return (info.num_heads, info.num_kv_heads, info.head_size, info.dtype, info.kv_cache_dtype,
            info.sliding_window, info.has_sink, info.attn_type)


def _ints(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def batch_shape(md: Any) -> BatchShape:
    """Batch facts from vLLM attention metadata (``num_actual_tokens``, ``seq_lens``,
    ``query_start_loc``, ``max_query_len``)."""
    num_tokens = int(md.num_actual_tokens)
    max_q = int(getattr(md, "max_query_len", 1))
    seq = _ints(md.seq_lens)
    n = len(seq)
    whole: tuple[tuple[int, int], ...] = ()
    if max_q <= 1:
        qlens = [1] * n
    else:
        starts = _ints(md.query_start_loc)[: n + 1]
        qlens = [b - a for a, b in itertools.pairwise(starts)]
        whole = tuple((a, q) for a, q, s in zip(starts, qlens, seq, strict=False)
                      if q == s and q > 1)
    # Per-request lengths kept: each layer's FLOPs and KV reads follow its causal mask and
    # window (BatchShape.counts, once per distinct window per step).
    return BatchShape.of(tuple(qlens), tuple(seq), num_tokens, whole)


def _to_host(x: Any) -> Any:
    """A device tensor's copy on the host, queued behind the work that fills it (no sync);
    it is read only once the step's end event has completed. Host values pass through."""
    if getattr(x, "is_cuda", False):
        return x.to("cpu", non_blocking=True)
    return x


def shape_inputs(md: Any) -> Any:
    """What :func:`batch_shape` reads, captured now (metadata buffers are reused by later
    steps) without waiting for the GPU."""
    return SimpleNamespace(num_actual_tokens=int(md.num_actual_tokens),
                           max_query_len=int(getattr(md, "max_query_len", 1)),
                           seq_lens=_to_host(md.seq_lens),
                           query_start_loc=_to_host(getattr(md, "query_start_loc", None)))


def _num_tokens(args: Any, kwargs: Any) -> int:
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
        if x is None:
            x = args[0] if args else None
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape else 0


def _kernel_variant(info: LayerInfo, layer: Any) -> str:
    """The sub-variant the backend picked at runtime, where it exposes one."""
    isa = getattr(layer, "isa", None)  # CPU_ATTN: vec / vec16 / amx / neon, set per layer
    if isa is not None:
        return f"cpu_attention_with_kv_cache[{isa}]"
    impl = getattr(layer, "impl", None)
    fa = getattr(impl, "vllm_flash_attn_version", None)
    if fa is not None:
        return f"flash_attn_varlen_func[FA{fa}]"
    return info.impl


def _step_has_metadata() -> bool:
    # A vLLM worker has imported forward_context long before any step; elsewhere there is
    # no forward context to ask about (and importing vLLM here would cost seconds).
    fc = sys.modules.get("vllm.forward_context")
    if fc is None:
        return False
    try:
        return bool(fc.is_forward_context_available() and fc.get_forward_context().attn_metadata)
    except Exception:
        return False


def _on_cuda(runner: Any) -> bool:
    dev = getattr(runner, "device", None)
    return getattr(dev, "type", "cpu") == "cuda"


class _Wrapped:
    """One layer's impl, its original ``forward`` and the timing wrapper (installed on
    sampled steps only)."""

    __slots__ = ("impl", "instance_attr", "orig", "wrapper")

    def __init__(self, impl: Any, orig: Any, wrapper: Any, instance_attr: bool) -> None:
        self.impl = impl
        self.orig = orig
        self.wrapper = wrapper
        self.instance_attr = instance_attr


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _capturing_graph() -> bool:
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


class _PendingStep:
    """A sampled GPU step whose events are read later, once they have completed."""

    __slots__ = ("calls", "end", "hs_time", "outcome", "start", "wall_ns")

    def __init__(self, start: Any, end: Any, calls: list[tuple[LayerInfo, Any, Any, Any]],
                 outcome: str, hs_time: float, wall_ns: int = 0) -> None:
        self.start = start
        self.end = end
        self.calls = calls
        self.outcome = outcome
        self.hs_time = hs_time
        self.wall_ns = wall_ns  # host wall clock at the start event; 0: not traced


class Capture:
    def __init__(self, state: State, clock: Any = time.perf_counter) -> None:
        cfg = state.config
        assert cfg is not None
        self.state = state
        self.errors = state.errors
        self.sampler = StepSampler(cfg.sample_rate, cfg.overhead_budget, cfg.long_prefill_tokens,
                                   cfg.long_prefill_rate, cfg.seed)
        self.long_on = cfg.long_prefill_rate > 0.0
        self.clock = clock
        self.aggs = WorkerAggregates()
        self.seen = 0
        self.wrapped: list[_Wrapped] = []
        self._calls: list[tuple[LayerInfo, Any, Any, Any]] = []
        self._cuda = False
        # GPU timing: events recorded on sampled steps are read when complete (next sampled
        # step, snapshot), never by a synchronize() on the serving path.
        self.event_factory: Any = _cuda_event
        self.capturing_graph: Any = _capturing_graph
        self._pending: deque[_PendingStep] = deque()
        self._in_step = 0  # 1 while a sampled step runs (read by the export thread)
        self.seed_shared = cfg.seed is not None
        # Tensor/pipeline-parallel placement of this worker (read at model build).
        self.rank: dict[str, int] = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                                     "dp_rank": 0}
        self.total_kv_heads: int | None = None
        self.total_layers: int | None = None
        # Per-head statistics (sparsity advice) on a share of sampled steps.
        self.hs_rate = cfg.head_stats_rate
        self.hs_min_tokens = cfg.head_stats_min_tokens
        self.hs_buffer: Any = None  # HeadStatsDoubleBuffer, made at the first sampled prompt
        self.deltas: Any = None  # DeltaFiles: how deltas reach the API server
        self.hs = HeadStatsCost()
        self.poll_cost = PollCost()
        self._hs_step = False
        self._hs_time = 0.0
        self._hs_seen: set[int] = set()
        self._shapes: dict[int, BatchShape] = {}
        self._shape_inputs: dict[int, Any] = {}
        self._reports: dict[Any, dict[str, Any]] = {}
        # id(LayerInfo) -> key of its report (names can be empty; the infos live as long as we do)
        self._report_keys: dict[int, Any] = {}
        # vLLM's own selector inputs for the layer being built (see install()).
        self.selector_seen: Any = None
        # Step records for a live trace (armed by the API server) or OTLP spans; nothing is
        # built while neither wants them.
        self.trace = TraceBuffer(spans=bool(cfg.otlp_spans and state.otlp is not None))
        self._spans_started = False

    # ----- layer registration (model build time) -----
    def wrap_layer(self, layer: Any, selector: Any = None) -> None:
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(impl, "_attnprof_wrapped", False):
            return
        info = layer_info(layer, impl)
        if not self.aggs.layers:
            self._learn_model_label()
        self.aggs.add_layer(info)
        if selector is not None and (getattr(selector, "head_size", None) != info.head_size
                                     or bool(getattr(selector, "has_sink", False))
                                     != info.has_sink):
            selector = None  # not this layer's selection (a backend passed in explicitly)
        if "vllm" in sys.modules:
            # Ask vLLM about this layer now, inside vLLM's own config context (model build),
            # with the inputs its selector had a moment ago; the snapshot reads the answer.
            self._backend_report(info, selector, impl)
        instance_attr = "forward" in vars(impl)
        orig = impl.forward
        cap = self

        @functools.wraps(orig)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return cap._timed(info, orig, args, kwargs)

        self.wrapped.append(_Wrapped(impl, orig, forward, instance_attr))
        impl._attnprof_wrapped = True
        self.state.add_role("worker")
        self.state.export_source("worker", self.samples)
        if self.trace.spans and not self._spans_started:
            self._start_spans()

    def _start_spans(self) -> None:
        """Add the OTLP span sink to this worker's export loop (its thread builds the spans)."""
        self._spans_started = True
        try:
            from attnprof.exporters.otlp import OtlpSpanSink

            hub = self.state.get_hub()
            hub.add_sink(OtlpSpanSink(self.state.otlp, role="worker", take=self.trace.take_spans,
                                      model=lambda: self.state.model_label,
                                      on_error=self.errors.note))
            hub.start()
        except Exception as exc:
            self.errors.record("export", exc)
            self.trace.spans = False

    def _backend_report(self, info: LayerInfo, selector: Any = None,
                        impl: Any = None) -> dict[str, Any]:
        fa_ran = getattr(impl, "vllm_flash_attn_version", None)
        key = self._report_keys.get(id(info))
        if key is None:
            key = (_report_key(info), selector, info.backend, fa_ran)
            self._report_keys[id(info)] = key
        rep = self._reports.get(key)
        if rep is None:
            try:
                from attnprof.analyze import vllm_backend_report

                rep = vllm_backend_report(
                    info.num_heads, info.num_kv_heads, info.head_size, info.dtype,
                    info.kv_cache_dtype, info.sliding_window, has_sink=info.has_sink,
                    selected=info.backend, selector_config=selector,
                    flash_attn_version=fa_ran if isinstance(fa_ran, int) else None,
                    requires_alibi=getattr(impl, "alibi_slopes", None) is not None,
                    requires_softcap=bool(getattr(impl, "logits_soft_cap", None)))
            except Exception as exc:
                self.errors.record("kernel_map", exc)
                rep = {"error": f"{type(exc).__name__}: {exc}"}
            self._reports[key] = rep
        return rep

    def _learn_model_label(self) -> None:
        """Workers never see the stat logger: read the served name from vLLM's config, and
        this worker's parallel placement. Without ``ATTNPROF_SEED`` the sampler is seeded from
        the server's instance id, shared by all its ranks, so they sample the same steps."""
        st = self.state
        try:
            from vllm.config import get_current_vllm_config

            vc = get_current_vllm_config()
        except Exception:
            return  # no vLLM config in force (not a vLLM model build): nothing to learn
        try:
            if not (st.config is not None and st.config.model_label):
                from attnprof.facts.label import model_label

                st.model_label = model_label(vc.model_config)
            if not self.seed_shared and getattr(vc, "instance_id", None):
                import hashlib

                digest = hashlib.blake2b(str(vc.instance_id).encode(), digest_size=8).digest()
                self.sampler.reseed(int.from_bytes(digest, "little"))
                self.seed_shared = True
            pc = vc.parallel_config
            self.rank["tp_size"] = int(getattr(pc, "tensor_parallel_size", 1) or 1)
            self.rank["pp_size"] = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
            self.rank["dp_rank"] = int(getattr(pc, "data_parallel_rank", 0) or 0)
            mc = vc.model_config
            self.total_kv_heads = int(mc.get_total_num_kv_heads())
            self.total_layers = int(getattr(mc.hf_text_config, "num_hidden_layers", 0)) or None
        except Exception as exc:
            self.errors.record("model_label", exc)
        try:
            from vllm.distributed import parallel_state as ps

            self.rank["tp_rank"] = int(ps.get_tensor_model_parallel_rank())
            self.rank["pp_rank"] = int(ps.get_pp_group().rank_in_group)
        except Exception:
            pass  # no distributed state (unit tests, a single process): rank 0
        try:
            self._sync_ranks(getattr(vc, "instance_id", None))
        except Exception as exc:
            self.errors.record("install", exc)

    def _sync_ranks(self, instance: Any) -> None:
        """Tensor-parallel ranks agree on the budget's scale through the first rank's
        announcements (:mod:`attnprof.capture.vllm.rank_sync`); alone, a rank applies its own."""
        if self.rank["tp_size"] <= 1 or self.sampler.sync is not None:
            return
        from attnprof.capture.vllm.rank_sync import RateChannel, channel_path

        cfg = self.state.config
        # Without an instance id, the ranks' common parent (the engine) and shared seed.
        key = str(instance) if instance else f"{os.getppid()}:{self.sampler.seed}"
        leader = self.rank["tp_rank"] == 0
        self.sampler.sync = RateChannel(
            channel_path(key, self.rank["dp_rank"], self.rank["pp_rank"],
                         cfg.run_dir if cfg is not None else None),
            leader, self.sampler.epoch)
        self.sampler.sync_role = "leader" if leader else "follower"

    def _install_layers(self) -> None:
        for w in self.wrapped:
            w.impl.forward = w.wrapper

    def _remove_layers(self) -> None:
        for w in self.wrapped:
            if w.instance_attr:
                w.impl.forward = w.orig
            else:
                w.impl.__dict__.pop("forward", None)

    # ----- per call (sampled steps only) -----
    def _timed(self, info: LayerInfo, orig: Any, args: Any, kwargs: Any) -> Any:
        # Our bookkeeping may fail (counted, dropped); the host's own call and its
        # exceptions pass through untouched.
        md = start = None
        try:
            fault_point("capture")
            md = args[5] if len(args) > 5 else kwargs.get("attn_metadata")
            if md is not None:  # None = profile/dummy run: not a real step
                start = self._timer_start()
        except Exception as exc:
            self.errors.record("capture", exc)
            self.errors.drop("capture_error")
            md = None
        out = orig(*args, **kwargs)
        if md is not None:
            try:
                self._timer_stop(info, md, start, args, kwargs)
            except Exception as exc:
                self.errors.record("capture", exc)
                self.errors.drop("capture_error")
        return out

    def _timer_start(self) -> Any:
        if self._cuda:
            e0 = self.event_factory()
            e0.record()
            return e0
        return self.clock()

    def _timer_stop(self, info: LayerInfo, md: Any, start: Any, args: Any, kwargs: Any) -> None:
        fault_point("capture")
        if self._cuda:
            e1 = self.event_factory()
            e1.record()
            # The batch's shape is read once its copies have landed, not now (no sync).
            inputs = self._shape_inputs.get(id(md))
            if inputs is None:
                inputs = self._shape_inputs[id(md)] = shape_inputs(md)
            self._calls.append((info, inputs, start, e1))
        else:
            # Start and end clock readings: the duration, and the offset a trace places it at.
            self._calls.append((info, md, start, self.clock()))
        if info.kernel is None:
            info.kernel = _kernel_variant(info, args[0] if args else None)
        if not info.kv_cache_bytes:
            kv = args[4] if len(args) > 4 else kwargs.get("kv_cache")
            if kv is not None and hasattr(kv, "numel"):
                info.kv_cache_bytes = int(kv.numel() * kv.element_size())
        if self._hs_step:
            try:
                self._head_stats(info, md, args)
            except Exception as exc:
                # A shape the statistics cannot handle would fail on every step: switch head
                # statistics off here instead of spending the error budget of all capture.
                self.errors.record("head_stats", exc)
                self.hs_rate = 0.0
                self._hs_step = False

    def _shape(self, md: Any) -> BatchShape:
        shape = self._shapes.get(id(md))
        if shape is None:
            shape = self._shapes[id(md)] = batch_shape(md)
        return shape

    def _head_stats(self, info: LayerInfo, md: Any, args: Any) -> None:
        """Fold whole-prompt prefills of this layer into the head statistics.

        Runs after the layer's timer stopped; its time is charged to attnprof's budget.
        """
        t0 = self.clock()  # the shape read may wait for the device: ours too
        try:
            shape = self._shape(md)
            # Bounded: the statistics allocate O(prompt) scratch mid-forward, outside vLLM's
            # memory profile, so very long prompts are left out.
            todo = [(a, n) for a, n in shape.whole_prompts
                    if self.hs_min_tokens <= n <= HEAD_STATS_MAX_TOKENS]
            if not todo or len(args) < 3:
                return
            if self.hs_buffer is None:
                from attnprof.aggregate.head_stats import HeadStatsAccumulator
                from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
                from attnprof.capture.vllm.deltas import DeltaFiles

                # Both halves, the drain thread and the delta files' place now (charged to
                # this sampled step), so a pull only swaps.
                cfg = self.state.config
                self.deltas = DeltaFiles(cfg.run_dir if cfg is not None else None)
                self.hs_buffer = HeadStatsDoubleBuffer(HeadStatsAccumulator(
                    num_layers=max(i.index for i in self.aggs.layers.values()) + 1,
                    num_kv_heads=info.num_kv_heads,
                    group_size=max(1, info.num_heads // max(1, info.num_kv_heads)),
                    seed=0))
            acc = self.hs_buffer.active
            q, k = args[1], args[2]
            for a, n in todo:
                qs = q[a:a + n].view(n, info.num_heads, info.head_size)
                ks = k[a:a + n].view(n, info.num_kv_heads, info.head_size)
                got = head_rows.update(acc, info.index, qs, ks,
                                       info.scale or info.head_size ** -0.5, q_start=0)
                self.hs.queries += got
                if id(md) not in self._hs_seen:
                    self._hs_seen.add(id(md))
                    self.hs.requests += len(todo)
        finally:
            self._hs_time += self.clock() - t0

    # ----- per step -----
    def model_forward(self, orig: Any, runner: Any, args: Any, kwargs: Any) -> Any:
        """The step hook's slow path: the countdown reached zero, or the long-prefill
        stratum may apply. ``install`` inlines the unsampled fast path before this."""
        try:
            outcome = self._decide(args, kwargs)
        except Exception as exc:  # never let the decision itself reach vLLM
            self.errors.record("sampler", exc)
            outcome = None
        if outcome is None:
            return orig(runner, *args, **kwargs)
        return self._sampled_step(orig, runner, args, kwargs, outcome)

    def _decide(self, args: Any, kwargs: Any) -> str | None:
        """None (unsampled), "sampled" or "sampled_long"."""
        s = self.sampler
        if s.countdown <= 0 and s.fire():
            return None if self.errors.disabled else "sampled"
        if not self.long_on or self.errors.disabled:
            return None
        n = _num_tokens(args, kwargs)  # scheduled tokens of the step
        if n < s.long_tokens or not s.long_prefill(n):
            return None
        return "sampled_long"

    def _sampled_step(self, orig: Any, runner: Any, args: Any, kwargs: Any, outcome: str) -> Any:
        self._in_step = 1
        try:
            return self._run_sampled(orig, runner, args, kwargs, outcome)
        finally:
            self._in_step = 0

    def _run_sampled(self, orig: Any, runner: Any, args: Any, kwargs: Any, outcome: str) -> Any:
        t_start = self.clock()
        ev0 = None
        wall = 0
        try:
            if self.trace.wanted:
                wall = time.time_ns()
            self._calls = []  # a new list: a pending GPU step keeps the old one
            self._shapes.clear()
            self._shape_inputs.clear()
            self._hs_seen.clear()
            self._hs_time = 0.0
            # A coin of its own at this step index: every rank folds the same prompts.
            self._hs_step = (self.hs_rate > 0
                             and self.sampler.coin(STREAM_HEAD_STATS) < self.hs_rate)
            self._cuda = _on_cuda(runner)
            capturing = False
            if self._cuda:
                self._resolve_pending()
                # vLLM is capturing a CUDA graph: timing events are illegal inside a
                # capture and would break the host's graph. Not a real step; skip it.
                capturing = bool(self.capturing_graph())
                if not capturing:
                    ev0 = self.event_factory()
                    ev0.record()
            if not capturing:
                self._install_layers()
        except Exception as exc:
            self.errors.record("step_begin", exc)
            self._remove_layers()
            return orig(runner, *args, **kwargs)
        if capturing:  # outside the guard: the host's own exception passes through, once
            self.seen -= 1
            return orig(runner, *args, **kwargs)
        overhead = self.clock() - t_start
        t0 = self.clock()
        try:
            out = orig(runner, *args, **kwargs)
        finally:
            self._remove_layers()
        t1 = self.clock()
        try:
            # No wrapper fired but attention metadata is set: a full CUDA graph replayed
            # (Python never ran inside). Decided now: the forward context is this step's.
            blind = not self._calls and _step_has_metadata()
            if ev0 is not None:
                # GPU: record the end and read both events once they have completed (next
                # sampled step or snapshot). No synchronize(): the forward's CPU/GPU overlap
                # is the host's, and a wait here would be attnprof's cost, not the model's.
                ev1 = self.event_factory()
                ev1.record()
                if len(self._pending) >= PENDING_STEPS_MAX:
                    self._pending.popleft()
                    self.errors.drop("gpu_events_pending")
                self._pending.append(_PendingStep(ev0, ev1, self._calls,
                                                  "blind" if blind else outcome, self._hs_time,
                                                  wall))
            else:
                # head statistics are ours, not the model's
                self._finish_step(t1 - t0 - self._hs_time, outcome, self._calls, blind,
                                  (wall, t0, t1) if wall else None)
        except Exception as exc:
            self.errors.record("step_end", exc)
        if self._hs_time:
            self.hs.steps += 1
            self.hs.time_s += self._hs_time
            # Attention-free estimate of the prefill's own cost: the step minus our stats.
            self.hs.prefill_time_s += max(0.0, t1 - t0 - self._hs_time)
        try:
            self.sampler.charge(overhead + self._hs_time + (self.clock() - t1))
        except Exception as exc:
            self.errors.record("sampler", exc)
        return out

    def _resolve_pending(self) -> None:
        """Fold sampled GPU steps whose end event has completed (in order; never waits)."""
        while self._pending and self._pending[0].end.query():
            p = self._pending[0]
            try:
                # Head statistics ran inside the step's events: they are ours, not the model's.
                model_time = max(0.0, p.start.elapsed_time(p.end) / 1e3 - p.hs_time)
                self._finish_step(model_time, p.outcome, p.calls, p.outcome == "blind",
                                  (p.wall_ns, p.start, p.end) if p.wall_ns else None)
            except Exception as exc:
                self.errors.record("step_end", exc)
            finally:
                # Removed only once its outcome is recorded: an export in between must not
                # see the step as neither pending nor recorded (it would read "unsampled").
                self._pending.popleft()

    def _finish_step(self, model_time: float, outcome: str,
                     calls: list[tuple[LayerInfo, Any, Any, Any]], blind: bool,
                     trace: tuple[int, Any, Any] | None = None) -> None:
        """Fold one sampled step. ``trace``: (wall start ns, step start, step end) as clock
        readings (CPU) or events (GPU) when the step is to be recorded for a trace/spans."""
        fault_point("step")
        if not calls:
            # Blind: a replayed full CUDA graph, counted, never pretended. Otherwise a
            # warm-up/dummy run: not a serving step at all.
            if blind:
                self.aggs.record_step(StepRecord("blind", model_time))
            else:
                self.seen -= 1
            return
        rec = StepRecord("sampled_long" if outcome == "sampled_long" else "sampled", model_time)
        shapes: dict[int, BatchShape] = {}
        for info, md, a, b in calls:
            # GPU: the call's two events; CPU: its start and end clock readings.
            dt = a.elapsed_time(b) / 1e3 if hasattr(a, "elapsed_time") else b - a
            shape = shapes.get(id(md))
            if shape is None:
                shape = shapes[id(md)] = batch_shape(md)
            rec.calls.append(LayerCall(info, shape, dt))
        self.aggs.record_step(rec)
        if trace is not None:
            try:
                self.trace.add(self._step_trace(rec, calls, *trace))
            except Exception as exc:  # a trace is ours: the step's aggregates already count
                self.errors.record("trace", exc)

    def _step_trace(self, rec: StepRecord, calls: list[tuple[LayerInfo, Any, Any, Any]],
                    wall_ns: int, t0: Any, t1: Any) -> StepTrace:
        """The step's trace record: wall start, duration and each call's offset from the step
        start (CPU: clock readings; GPU: ``elapsed_time`` from the step's start event, read
        now that the end event has completed, so no wait)."""
        gpu = hasattr(t0, "elapsed_time")
        dur = t0.elapsed_time(t1) * 1e6 if gpu else (t1 - t0) * 1e9
        ranges = []
        for (info, _md, a, _b), call in zip(calls, rec.calls, strict=True):
            sh = call.shape
            off = t0.elapsed_time(a) * 1e6 if gpu else (a - t0) * 1e9
            ranges.append(LayerRange(
                info.index, info.backend, info.kernel or info.impl, int(off),
                int(call.time_s * 1e9), sh.phase, sh.num_tokens, sh.num_reqs, sh.max_seq_len,
                sh.kv_tokens / sh.num_reqs if sh.num_reqs else 0.0))
        first = rec.calls[0].shape
        return StepTrace(wall_ns, int(dur), first.phase, rec.outcome, self.sampler.rate,
                         first.num_tokens, first.num_reqs, first.max_seq_len,
                         first.kv_tokens / first.num_reqs if first.num_reqs else 0.0, ranges)

    def trace_arm(self, steps: int, timeout_s: float, trace_id: str = "",
                  max_ranges: int = MAX_RANGES) -> dict[str, Any]:
        """Record the next ``steps`` sampled steps for a live trace, at most ``max_ranges``
        layer ranges (RPC, between steps); returns this worker's identity. Recording stops
        by itself after ``timeout_s``."""
        self.trace.arm(steps, timeout_s, trace_id, max_ranges)
        return {"pid": os.getpid(), "process": multiprocessing.current_process().name,
                "rank": dict(self.rank), "armed": True}

    def trace_count(self, trace_id: str = "") -> dict[str, Any]:
        """Steps recorded so far for the armed trace (tiny: the API server polls it)."""
        self._resolve_pending()  # GPU steps whose events completed are recorded now
        return {"pid": os.getpid(), "steps": self.trace.count(trace_id),
                "recording": self.trace.recording}

    def trace_take(self, trace_id: str = "", page_ranges: int | None = None) -> dict[str, Any]:
        """One page of the recorded steps (compact JSON, at most ``page_ranges`` layer ranges)
        and this worker's identity; ``more``: pages are left. Recording stops."""
        self._resolve_pending()
        steps, truncated, more = self.trace.take(trace_id, page_ranges)
        return {"pid": os.getpid(), "process": multiprocessing.current_process().name,
                "rank": dict(self.rank), "truncated": truncated, "more": more,
                "steps": [s.to_json() for s in steps]}

    def set_sampling(self, rate: float | None = None,
                     head_stats_rate: float | None = None) -> dict[str, Any]:
        """Switch the step sample rate and/or the head-statistics rate at run time (A/B arms
        inside one server, an operator turning profiling down). Raises ``ValueError`` for a
        value outside [0, 1]; returns the old and new values."""
        old = {"sample_rate": self.sampler.base_rate, "head_stats_rate": self.hs_rate}
        if head_stats_rate is not None and not 0.0 <= float(head_stats_rate) <= 1.0:
            raise ValueError(f"head-statistics rate {head_stats_rate!r} is not in [0, 1]")
        if rate is not None:
            self.sampler.set_rate(float(rate))
        if head_stats_rate is not None:
            self.hs_rate = float(head_stats_rate)
        return {"old": old, "new": {"sample_rate": self.sampler.base_rate,
                                    "head_stats_rate": self.hs_rate}}

    # ----- reading (flusher thread, snapshot RPC) -----
    def sampler_stats(self) -> SamplerStats:
        s = self.sampler
        o = self.aggs.outcomes
        seen = self.seen
        return SamplerStats(
            seen=seen, sampled=o["sampled"], sampled_long=o["sampled_long"], blind=o["blind"],
            # A step in progress or a GPU step waiting for its events is not unsampled: counting
            # it so would overshoot, and an exported counter cannot come back down.
            unsampled=max(0, seen - sum(o.values()) - len(self._pending) - self._in_step),
            base_rate=s.base_rate,
            effective_rate=s.rate, budget=s.budget, self_time_s=s.self_time,
            self_time_fraction=s.self_time_fraction(), throttles=s.throttles,
            step_index=s.step + 1, sync=s.sync_role, late_changes=s.late_changes,
            unsynced=getattr(s.sync, "unread", 0), decisions_digest=s.decisions_digest,
            rate_changes=[[st, sc] for st, sc in s.rate_changes])

    def samples(self) -> list[Any]:
        from attnprof.exporters.samples import worker_samples

        # Under tensor parallelism every rank times the same layers: per-layer series come
        # from TP rank 0 only, or Prometheus' sum over processes would multiply them.
        first_tp = self.rank["tp_rank"] == 0
        return worker_samples(self.state.model_label, self.aggs, self.sampler_stats(),
                              self.hs.queries, per_layer=first_tp,
                              per_step=first_tp and self.rank["pp_rank"] == 0)

    def kernel_map(self) -> list[KernelGroup]:
        """Per group of identical layers: the backend that ran, the kernel variant, and why
        each other vLLM backend is not valid, asked of vLLM itself on this device (see
        :mod:`attnprof.analyze.vllm_backends`). Computed once per layer shape."""
        groups: dict[tuple[Any, ...], list[LayerInfo]] = {}
        for info in sorted(self.aggs.layers.values(), key=lambda i: i.index):
            self._backend_report(info)  # cached since model build (lazily without vLLM)
            groups.setdefault((info.backend, info.kernel, self._report_keys[id(info)]),
                              []).append(info)
        out = []
        for (_, _, key), infos in groups.items():
            rep = self._reports[key]
            first = infos[0]
            out.append(KernelGroup(
                layers=[i.index for i in infos], backend=first.backend, kernel=first.kernel,
                fused=first.fused, valid_backends=rep.get("valid"),
                rejected={name: b.get("reasons") for name, b in
                          (rep.get("backends") or {}).items() if not b.get("valid")},
                source=rep.get("source"), error=rep.get("error"),
                predicted=rep.get("predicted"),
                flash_attn_version=rep.get("flash_attn_version"), note=rep.get("note")))
        return out

    def snapshot(self, include_head_stats: bool = True, flush: bool = True) -> WorkerSnapshot:
        self._resolve_pending()
        if flush:
            self.state.flush()
        hs = HeadStatsCost(**{k: getattr(self.hs, k) for k in
                              ("steps", "requests", "queries", "time_s", "prefill_time_s")})
        hs.fraction_of_prefill = (hs.time_s / hs.prefill_time_s if hs.prefill_time_s > 0
                                  else None)
        return WorkerSnapshot(
            pid=os.getpid(), process=multiprocessing.current_process().name,
            layers=self.aggs.layer_profiles(), kernel_map=self.kernel_map(),
            steps=self.aggs.step_stats(), sampler=self.sampler_stats(),
            errors=dict(self.errors.by_place), dropped=dict(self.errors.dropped),
            disabled=self.errors.disabled, head_stats_cost=hs,
            poll_cost=dataclasses.replace(self.poll_cost),
            head_stats=(self.hs_buffer.active.to_dict() if self.hs_buffer is not None
                        and include_head_stats else None),
            probe=self.state.probe)

    def poll(self, with_head_stats: bool = True, api_host: str | None = None
             ) -> dict[str, Any]:
        """The API server's periodic pull (between model steps, so small and cheap): this
        worker's snapshot without head statistics, its parallel placement, and the head
        statistics: the deltas finished since the last pull, and a swap of the accumulator's
        halves whose delta a later :meth:`head_stats_take` collects (serialized off the
        engine's path). ``api_host``: the API server's :func:`host_id`; on this machine the
        deltas travel as files, not in the answer."""
        fault_point("capture")
        t0 = time.perf_counter()
        # No export flush here: the export thread flushes every second, and a flush (file
        # writes) would lengthen the pause the engine takes for this poll.
        snap = self.snapshot(include_head_stats=False, flush=False).to_json()
        t1 = time.perf_counter()
        out = self._placement()
        if with_head_stats:
            out["head_stats"] = self._take_deltas(api_host, swap=True)
        t2 = time.perf_counter()
        # This pull's own cost, all but the pickling vLLM does with the answer.
        pc = self.poll_cost
        pc.polls += 1
        pc.last_head_stats_s = t2 - t1
        pc.max_head_stats_s = max(pc.max_head_stats_s, pc.last_head_stats_s)
        pc.last_s = t2 - t0
        pc.max_s = max(pc.max_s, pc.last_s)
        if self.hs_buffer is not None:
            pc.drain_s, pc.delta_bytes = self.hs_buffer.drain_s, self.hs_buffer.delta_bytes
        snap["poll_cost"] = pc.to_json()
        out["snapshot"] = snap
        return out

    def head_stats_take(self, api_host: str | None = None) -> dict[str, Any]:
        """The deltas finished since the last pull, with this worker's placement (tiny: the
        API server asks until none is pending)."""
        fault_point("capture")
        out = self._placement()
        out["head_stats"] = self._take_deltas(api_host, swap=False)
        return out

    def _placement(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": dict(self.rank),
                "total_kv_heads": self.total_kv_heads, "total_layers": self.total_layers}

    def _take_deltas(self, api_host: str | None, swap: bool) -> dict[str, Any]:
        buf = self.hs_buffer
        if buf is None:
            return {"deltas": [], "pending": False}
        if self.deltas is None:  # a buffer set from outside (tests)
            from attnprof.capture.vllm.deltas import DeltaFiles

            self.deltas = DeltaFiles()
        if swap:
            self.deltas.forget_handed()  # a new pull: the last one's files were read
        ready = buf.take_ready()
        if swap:
            buf.swap(self.deltas.finish_for(api_host))
        self.deltas.hand(ready)
        for e in buf.errors:
            self.errors.record("head_stats", RuntimeError(e))
        buf.errors.clear()
        return {"deltas": ready, "pending": buf.draining}


def step_hook(cap: Capture, orig_fwd: Any) -> Any:
    """The replacement for ``GPUModelRunner._model_forward`` (``orig_fwd``)."""
    sampler = cap.sampler
    slow = cap.model_forward
    long_on, long_tokens = cap.long_on, sampler.long_tokens

    @functools.wraps(orig_fwd)
    def _model_forward(runner: Any, *args: Any, **kwargs: Any) -> Any:
        # The unsampled fast path, inlined: decrement, compare, count, and with the
        # long-prefill stratum on, one look at the step's token count. The draw, the
        # stratum's own coin and all timing are in ``slow``.
        # The step is counted once it is done, after its outcome is recorded, so an export
        # in between never reads it as unsampled (outcome counters cannot come back down).
        sampler.countdown -= 1
        if sampler.countdown > 0:
            if not long_on:
                out = orig_fwd(runner, *args, **kwargs)
                cap.seen += 1
                return out
            x = kwargs.get("input_ids")
            if x is not None and x.shape[0] < long_tokens:
                out = orig_fwd(runner, *args, **kwargs)
                cap.seen += 1
                return out
        out = slow(orig_fwd, runner, args, kwargs)
        cap.seen += 1
        return out

    return _model_forward


def _watch_selector(cap: Capture, state: State) -> None:
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
    sel._cached_get_attn_backend = _cached_get_attn_backend


def install(state: State) -> Capture | None:
    """Patch vLLM classes in this process (called once, from the general plugin)."""
    cap = Capture(state)
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except Exception as exc:
        state.errors.record("install", exc)
        return None

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
        Attention.__init__ = __init__

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        orig_fwd = GPUModelRunner._model_forward
        if not getattr(orig_fwd, "_attnprof", False):
            _model_forward = step_hook(cap, orig_fwd)
            _model_forward._attnprof = True  # type: ignore[attr-defined]
            GPUModelRunner._model_forward = _model_forward
    except Exception as exc:
        state.errors.record("install", exc)

    try:
        from vllm.v1.worker.worker_base import WorkerBase

        def attnprof_snapshot(self: Any, include_head_stats: bool = True) -> dict[str, Any]:
            try:
                return cap.snapshot(include_head_stats).to_json()
            except Exception as exc:  # runs in vLLM's worker loop: never raise there
                state.errors.record("snapshot", exc)
                return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

        def attnprof_poll(self: Any, with_head_stats: bool = True,
                          api_host: str | None = None) -> dict[str, Any]:
            try:
                return cap.poll(with_head_stats, api_host)
            except Exception as exc:
                state.errors.record("snapshot", exc)
                return {"snapshot": {"pid": os.getpid(),
                                     "error": f"{type(exc).__name__}: {exc}"}}

        def attnprof_head_stats(self: Any, api_host: str | None = None) -> dict[str, Any]:
            try:
                return cap.head_stats_take(api_host)
            except Exception as exc:
                state.errors.record("snapshot", exc)
                return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

        def attnprof_set_sampling(self: Any, rate: float | None = None,
                                  head_stats_rate: float | None = None) -> dict[str, Any]:
            try:
                return cap.set_sampling(rate, head_stats_rate)
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}

        def attnprof_trace(self: Any, op: str, trace_id: str = "", steps: int = 0,
                           timeout_s: float = 0.0, max_ranges: int = MAX_RANGES
                           ) -> dict[str, Any]:
            """One RPC for the live trace: ``arm`` (``max_ranges``: this worker's bound),
            ``count``, ``take`` (one page of at most ``max_ranges`` ranges) or ``drop``."""
            try:
                fault_point("capture")
                if op == "arm":
                    return cap.trace_arm(steps, timeout_s, trace_id, max_ranges)
                if op == "count":
                    return cap.trace_count(trace_id)
                if op == "take":
                    return cap.trace_take(trace_id, max_ranges)
                if op == "drop":
                    cap.trace.take(trace_id)
                    return {"pid": os.getpid(), "dropped": True}
                return {"pid": os.getpid(), "error": f"unknown trace op {op!r}"}
            except Exception as exc:
                state.errors.record("trace", exc)
                return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

        WorkerBase.attnprof_snapshot = attnprof_snapshot
        WorkerBase.attnprof_trace = attnprof_trace
        WorkerBase.attnprof_poll = attnprof_poll
        WorkerBase.attnprof_head_stats = attnprof_head_stats
        WorkerBase.attnprof_set_sampling = attnprof_set_sampling
        state.capture = cap
    except Exception as exc:
        state.errors.record("install", exc)
    return cap
