"""Per-layer attention capture inside a vLLM worker: decide, measure, hand off.

Hook points (docs/vllm.md says why these and not module hooks):
- ``GPUModelRunner._model_forward`` (``CPUModelRunner`` inherits it) marks step boundaries
  and decides sampling. An unsampled step costs one countdown decrement, one compare and
  (with the long-prefill stratum on) one read of the step's token count. Model Runner V2 has
  no ``_model_forward``: its ``execute_model`` is the step hook there (:mod:`.runner_v2`,
  which hands :meth:`Capture.model_forward` the step's tokens and its sampled-step context).
- Each layer's ``impl.forward`` gets an instance-level wrapper **only while a sampled step
  runs**: the custom op ``unified_attention_with_output`` looks ``impl.forward`` up on
  every call, so on unsampled steps layers run vLLM's own method and attnprof does no work
  at all per layer.
A sampled step becomes one typed :class:`StepRecord` handed to the aggregate room. vLLM's
arguments and objects are read by :mod:`.args` only; what the worker learns at model build
is in :mod:`.model_info`, its answers to the API server in the plugin host
(:mod:`attnprof.host.vllm.worker_rpc`), and the
patching of vLLM (and its undoing) in :mod:`.install`.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from collections import OrderedDict, deque
from typing import Any, NamedTuple

from attnprof._safety import fault_point
from attnprof.aggregate import worker_snapshot as ws
from attnprof.aggregate.background import LatestBuild
from attnprof.aggregate.layers import BatchShape, LayerCall, LayerInfo, StepRecord, WorkerAggregates
from attnprof.aggregate.sampler import STREAM_HEAD_STATS, StepSampler
from attnprof.aggregate.trace import TraceBuffer, step_trace
from attnprof.capture.vllm import args as vargs
from attnprof.capture.vllm import model_info
from attnprof.capture.vllm.cudagraph import GraphSteer
from attnprof.capture.vllm.host_state import HostState
from attnprof.contracts.snapshot import HeadStatsCost, PollCost

__all__ = ["Capture", "step_hook"]

HS_WORKER_NICE = 19
"""CPU priority of the head statistics' worker thread (Linux nice; 0: the engine's)."""
DECODE_SEQS_PER_STEP = 4
"""Decode sequences folded per sampled step at most (Horvitz-Thompson weighted)."""
DECODE_SEQS_SEEN = 4096
"""Decode sequences remembered (a hash of the request id and the context bucket) so each
counts once as a folded request of its decode stratum; the oldest is forgotten first."""
_ZERO = (0,)  # the one query of a decode fold, as an index into its queries


class _Fold(NamedTuple):
    """One request's share of a sampled step's head statistics (see ``Capture._hs_plan``)."""

    phase: str  # "prefill" or "decode"
    bucket: int  # context bucket's lower edge (head_strata.context_bucket)
    start: int  # first of its query rows in the step's packed q/k
    q_len: int
    q_pos: int  # position of its first query = keys computed before this step
    prompt_len: int  # prefill: the prompt's total length; decode: the context length
    row: int  # its row in the block table
    weight: float  # inverse inclusion probability of the step (decode: x running / folded)
    seq_share: float = 0.0  # decode: 1 on a sequence's first fold in this bucket
    detail: float = 0.0  # decode: the detail query's weight (0: no detail query)

    @property
    def whole(self) -> bool:
        """The request is seen whole here: a prompt on the piece holding its last position,
        a decode sequence on its first fold of the stratum."""
        if self.phase == "prefill":
            return self.q_pos + self.q_len >= self.prompt_len
        return self.seq_share >= 1.0


def _fold_bytes(f: _Fold, idx: Any, q: Any, hq: int, hkv: int, d: int) -> int:
    """Bytes :func:`attnprof.capture.head_rows.prepare` copies for one fold: the keys up to
    its last sampled query in fp32, and the sampled queries."""
    if len(idx) == 0:
        return 0
    return 4 * hkv * d * (f.q_pos + int(idx[-1]) + 1) + len(idx) * hq * d * int(q.element_size())


def _run_job(acc: Any, job: Any) -> None:
    """A prepared CPU fold, run on the statistics' worker."""
    from attnprof.capture import head_rows

    head_rows.run(acc, job).apply()


def _paged_keys(kv_cache: Any, layout: Any, row: Any, q_pos: int, own: Any, n: int) -> Any:
    """Keys of positions [0, n) of a request whose first ``q_pos`` keys are in the paged
    cache and the next ones are ``own`` (the call's), in fp32, copied once into the layout
    the statistics' product reads (:func:`~attnprof.capture.vllm.paged_kv.read_keys_t`)."""
    import torch

    from attnprof.capture.vllm.paged_kv import read_keys_t

    return read_keys_t(kv_cache, layout, row, n, own, q_pos, torch.float32)
PENDING_STEPS_MAX = 64
"""Sampled GPU steps whose timing events are not read yet; beyond this the oldest is dropped."""


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
    """The hooks' state in one vLLM worker: the sampler (decide), the timers (measure) and
    the aggregates, trace buffer and head-statistics accumulator it hands records to."""

    def __init__(self, state: HostState, clock: Any = time.perf_counter,
                 args: vargs.VllmArgs = vargs.VLLM_0_32) -> None:
        cfg = state.config
        assert cfg is not None
        self.state = state
        self.errors = state.errors
        self.sampler = StepSampler(cfg.sample_rate, cfg.overhead_budget, cfg.long_prefill_tokens,
                                   cfg.long_prefill_rate, cfg.seed)
        self.long_on = cfg.long_prefill_rate > 0.0
        # The next step's decision when it was taken at CUDA-graph dispatch (cudagraph.py):
        # (outcome, the sampler's countdown after that step); the step hook takes it.
        self.predecided: tuple[str | None, int] | None = None
        self.graphs = GraphSteer()  # sampled steps by the CUDA graph mode they ran in
        # Set on a sampled Model Runner V2 step whose graph answer was FULL: V2 replays it
        # outside any forward context, so the step hook cannot tell it from a dummy run.
        self.full_replay = False
        self.v2_batch: Any = None  # a sampled V2 step's InputBatch (prompt lengths)
        self.runner: Any = None  # RunnerReport: the worker's model runner, once built
        self.clock = clock
        self.args = args  # where this vLLM version keeps the hooked methods' arguments
        self.aggs = WorkerAggregates()
        self.seen = 0
        self.wrapped: list[_Wrapped] = []
        self._calls: list[tuple[LayerInfo, Any, Any, Any]] = []
        self._cuda = False
        # GPU timing: events recorded on sampled steps are read when complete (next sampled
        # step, snapshot), never by a synchronize() on the serving path.
        self.event_factory: Any = _cuda_event
        self.capturing_graph: Any = _capturing_graph
        self.pending: deque[_PendingStep] = deque()
        self.in_step = 0  # 1 while a sampled step runs (read by the export thread)
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
        self.hs_worker: Any = None  # HeadStatsWorker: folds off the engine's thread (same time)
        # True: fold on the engine's thread (ATTNPROF_HEAD_STATS_INLINE: offline runs and the
        # demo, where every sampled step's statistics matter more than the step's latency)
        self.hs_inline = cfg.head_stats_inline
        self.deltas: Any = None  # DeltaFiles: how deltas reach the API server
        self.hs = HeadStatsCost()
        self.poll_cost = PollCost()
        # The snapshot's layers, built off the engine's thread (started by the first pull:
        # after model build, whose layers it reads, and never for a server nobody polls).
        self.snapshots = _snapshot_builder(self)
        self._hs_step = False
        self._hs_time = 0.0
        self._hs_seen: set[int] = set()
        self._hs_admitted = False  # the step's copies were sized against the worker's bound
        self._hs_plans: dict[int, list[_Fold]] = {}
        # each plan's sampled positions and weights (the same for every layer of the step)
        self._hs_folds: dict[int, tuple[list[_Fold], list[tuple[Any, ...]]]] = {}
        self._hs_weight = 1.0  # the sampled step's inverse inclusion probability (relative)
        self._step_tokens: int | None = None  # the step's scheduled tokens where known
        self._decode_seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._decode_step: dict[tuple[int, int], float] = {}  # this step's first folds
        self._runner: Any = None  # the sampled step's model runner (prompt lengths)
        self._shapes: dict[int, BatchShape] = {}
        self._shape_inputs: dict[int, Any] = {}
        self.reports = model_info.BackendReports(state.errors, state.backend_fallback)
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
        info = vargs.layer_info(layer, impl)
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
            self.reports.report(info, selector, impl)
        instance_attr = "forward" in vars(impl)
        orig = impl.forward
        cap = self

        @functools.wraps(orig)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return cap._timed(info, orig, args, kwargs)

        self.wrapped.append(_Wrapped(impl, orig, forward, instance_attr))
        impl._attnprof_wrapped = True
        spans = self.trace.spans and not self._spans_started
        self._spans_started = self._spans_started or spans
        self.state.worker_live(self, spans)  # the host exports this worker's samples

    def _learn_model_label(self) -> None:
        model_info.learn_model(self)

    def install_layers(self) -> None:
        """Put every layer's timing wrapper in place (a sampled step begins)."""
        for w in self.wrapped:
            w.impl.forward = w.wrapper

    def remove_layers(self) -> None:
        """vLLM's own ``impl.forward`` on every layer again (the step ended, or undo)."""
        for w in self.wrapped:
            if w.instance_attr:
                w.impl.forward = w.orig
            else:
                w.impl.__dict__.pop("forward", None)

    # ----- per call (sampled steps only) -----
    def _timed(self, info: LayerInfo, orig: Any, args: Any, kwargs: Any) -> Any:
        # Our bookkeeping may fail (counted, dropped); the host's own call and its
        # exceptions pass through untouched.
        call = md = start = None
        try:
            fault_point("capture")
            call = self.args.impl_call(args, kwargs)
            md = call.attn_metadata
            if md is not None:  # None = profile/dummy run: not a real step
                start = self._timer_start()
        except Exception as exc:
            self.errors.record("capture", exc)
            self.errors.drop("capture_error")
            md = None
        out = orig(*args, **kwargs)
        if md is not None and call is not None:
            try:
                self._timer_stop(info, call, start)
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

    def _timer_stop(self, info: LayerInfo, call: vargs.ImplCall, start: Any) -> None:
        fault_point("capture")
        md = call.attn_metadata
        if self._cuda:
            e1 = self.event_factory()
            e1.record()
            # The batch's shape is read once its copies have landed, not now (no sync).
            inputs = self._shape_inputs.get(id(md))
            if inputs is None:
                inputs = self._shape_inputs[id(md)] = vargs.shape_inputs(md, self._step())
            self._calls.append((info, inputs, start, e1))
        else:
            # Start and end clock readings: the duration, and the offset a trace places it at.
            self._calls.append((info, md, start, self.clock()))
        if info.kernel is None:
            info.kernel = vargs.kernel_variant(info, call.layer)
        if not info.kv_cache_bytes:
            info.kv_cache_bytes = vargs.kv_cache_bytes(call.kv_cache)
        if self._hs_step:
            try:
                self._head_stats(info, call)
            except Exception as exc:
                # A shape the statistics cannot handle would fail on every step: switch head
                # statistics off here instead of spending the error budget of all capture.
                self.errors.record("head_stats", exc)
                self.hs_rate = 0.0
                self._hs_step = False

    def _step(self) -> tuple[Any, Any]:
        """The sampled step's runner and V2 batch: where FlashInfer metadata's lengths are
        read when its own parts keep none (:func:`~.args.step_lens`)."""
        return (self._runner, self.v2_batch)

    def _shape(self, md: Any) -> BatchShape:
        shape = self._shapes.get(id(md))
        if shape is None:
            shape = self._shapes[id(md)] = vargs.batch_shape(md, self._step())
        return shape

    def _head_stats(self, info: LayerInfo, call: vargs.ImplCall) -> None:
        """Fold this layer's share of the step's statistics plan (:meth:`_hs_plan`): prompt
        pieces (whole, chunked, the uncached tail of a prefix-cache hit) and sampled decode
        queries, each against all its earlier keys (the paged cache's, then the call's own).

        Runs after the layer's timer stopped; its time is charged to attnprof's budget.
        """
        t0 = self.clock()  # the shape read may wait for the device: ours too
        md = call.attn_metadata
        try:
            plan = self._hs_plan(md)
            if not plan or call.query is None or call.key is None:
                return
            if self.hs_buffer is None:
                self._hs_start(info)
            from attnprof.capture import head_rows  # numpy and torch: only once sampled

            strata = self.hs_buffer.active
            # CPU: the statistics' worker computes (the engine's thread copies the queries
            # and keys it reads); a device: enqueued here, folded there once copied back
            device = call.query.device.type != "cpu"
            q, k = call.query, call.key
            hq, hkv, d = info.num_heads, info.num_kv_heads, info.head_size
            scale = info.scale or d ** -0.5
            layout: Any = False  # read once per call, only when a fold needs the cache
            deferred = not device and not self.hs_inline and self.hs_worker is not None
            cached = self._hs_folds.get(id(md))
            if cached is None or cached[0] is not plan:  # once per step, not per layer
                cached = (plan, [(f, *self._fold_plan(head_rows, strata, f)) for f in plan])
                self._hs_folds[id(md)] = cached
            folds = cached[1]
            if deferred and not self._hs_admitted:
                # Sized before anything is copied: a step whose copies for every layer would
                # not fit the worker's free bound (long contexts) is left out whole, its keys
                # never read, rather than copied on the engine's thread and then dropped.
                need = len(self.aggs.layers) * sum(
                    _fold_bytes(f, idx, q, hq, hkv, d) for f, idx, *_ in folds)
                if not self.hs_worker.fits(need):
                    self._hs_step = False
                    self.errors.drop("head_stats_step_too_large")
                    return
                self._hs_admitted = True
            for f, idx, wts, det, share in folds:
                qs = q[f.start:f.start + f.q_len].view(f.q_len, hq, d)
                ks: Any = k[f.start:f.start + f.q_len].view(f.q_len, hkv, d)
                if f.q_pos > 0:  # earlier keys live only in the paged cache
                    if info.sliding_window and f.q_pos + f.q_len > info.sliding_window:
                        # vLLM frees a sliding layer's blocks behind its window (their table
                        # entries then name the null block): the cache no longer holds them
                        self.errors.drop("head_stats_sliding_window")
                        continue
                    if layout is False:
                        layout = vargs.cache_layout(info, call.layer)
                    table = vargs.block_table(md)
                    if layout is None or table is None or call.kv_cache is None:
                        self.errors.drop("head_stats_unreadable_cache")
                        continue
                    # read when the fold knows how many keys its sampled queries need (none
                    # when no sampled position falls in this piece)
                    ks = functools.partial(_paged_keys, call.kv_cache, layout, table[f.row],
                                           f.q_pos, ks)
                if deferred and not self.hs_worker.fits(_fold_bytes(f, idx, q, hq, hkv, d)):
                    self.errors.drop("head_stats_queue_full")  # before copying, not after
                    continue
                acc = strata.get(f.phase, f.bucket)
                job = head_rows.prepare(acc, info.index, qs, ks, scale, f.q_pos, idx, wts, det,
                                        request_share=share, copy=not device, whole=f.whole)
                if self._hs_submit(acc, job, device):
                    self.hs.queries += job.queries
            if id(md) not in self._hs_seen:
                self._hs_seen.add(id(md))
                self.hs.requests += sum(1 for f in plan if f.phase == "prefill" and f.whole)
        finally:
            self._hs_time += self.clock() - t0

    @staticmethod
    def _fold_plan(head_rows: Any, strata: Any, f: _Fold) -> tuple[Any, Any, Any, float]:
        """A fold's sampled query indices, weights, detail queries and request share. The
        plan needs only the sampling settings (the strata's template): a stratum is made
        only for a fold that is folded."""
        if f.phase == "prefill":
            out: tuple[Any, Any, Any, float] = head_rows.span_plan(
                strata.template, f.q_len, f.prompt_len, f.q_pos, f.weight)
            return out
        # one query, the sequence's last position, standing for w sequences
        return _ZERO, [f.weight], ({0: f.detail} if f.detail else {}), f.seq_share

    def _hs_submit(self, acc: Any, job: Any, device: bool) -> bool:
        """Hand one prepared fold to the statistics' worker; dropped (counted, False) when
        its queue is full. ``hs_inline``: run here instead (tests, the benchmark's
        baseline)."""
        from attnprof.capture import head_rows

        if self.hs_inline:
            head_rows.run(acc, job).apply()
            return True
        if device:  # the device work is enqueued now; the worker folds its numbers back
            folds = head_rows.run(acc, job)
            ok = self.hs_worker.submit(folds.apply, 0)
        else:
            ok = self.hs_worker.submit(functools.partial(_run_job, acc, job), job.nbytes)
        if not ok:
            self.errors.drop("head_stats_queue_full")
        return bool(ok)

    def _hs_error(self, exc: BaseException) -> None:
        """A fold failed on the worker: counted, and statistics switched off as inline."""
        self.errors.record("head_stats", exc)
        self.hs_rate = 0.0

    def settle_head_stats(self, timeout: float = 10.0) -> bool:
        """Until every fold handed to the worker so far is in the accumulator (tests, the
        offline snapshot); False on timeout."""
        return self.hs_buffer is None or self.hs_buffer.settle(timeout)

    def _hs_start(self, info: LayerInfo) -> None:
        """Both halves, the drain thread and the delta files' place now (charged to this
        sampled step), so a pull only swaps."""
        from attnprof.aggregate.head_stats import HeadStatsAccumulator
        from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
        from attnprof.aggregate.head_strata import HeadStatsStrata
        from attnprof.capture.vllm.deltas import DeltaFiles

        cfg = self.state.config
        self.deltas = DeltaFiles(cfg.run_dir if cfg is not None else None)
        from attnprof.capture.head_worker import MAX_BYTES, HeadStatsWorker, quiet_thread

        ref = weakref.WeakMethod(self._hs_error)  # the thread must not keep the capture alive

        def on_error(exc: BaseException) -> None:
            m = ref()
            if m is not None:
                m(exc)

        self.hs_worker = HeadStatsWorker(
            on_error,
            max_bytes=cfg.head_stats_queue_mb << 20 if cfg is not None else MAX_BYTES,
            setup=functools.partial(quiet_thread, HS_WORKER_NICE),
            on_setup_error=functools.partial(self.errors.record, "head_stats"))
        self.hs_buffer = HeadStatsDoubleBuffer(HeadStatsStrata(HeadStatsAccumulator(
            num_layers=max(i.index for i in self.aggs.layers.values()) + 1,
            num_kv_heads=info.num_kv_heads,
            group_size=max(1, info.num_heads // max(1, info.num_kv_heads)),
            seed=0)))
        # a swap's drain (and a settle) waits for the folds handed over before it
        self.hs_buffer.folds = self.hs_worker

    def _hs_plan(self, md: Any) -> list[_Fold]:
        """What the step's statistics fold, decided once per metadata object (so every layer
        of a step folds the same requests and positions):

        * prompt queries (a request whose context ends within its prompt): the piece this step
          computes, sampled by the whole prompt's plan (``update_span``), in the stratum of the
          prompt's total length; prompts longer than ``HEAD_STATS_MAX_TOKENS`` are left out;
        * decode queries (one per running sequence past its prompt): at most
          ``DECODE_SEQS_PER_STEP`` sequences, drawn by a generator seeded by the step index
          (the same on every layer, KV-cache group and rank), each weighted running / drawn;
          a sequence counts as a request of its decode stratum on its first fold there.

        Every fold also carries the step's inverse inclusion probability
        (:meth:`_step_weight`), so steps the long-prefill stratum or a throttled rate chose
        weigh what they stand for.

        Without the prompts' lengths (runner unreadable) only prompts computed from position 0
        in this step fold, as whole prompts (a first chunk would then pass for one)."""
        plan = self._hs_plans.get(id(md))
        if plan is not None:
            return plan
        if self._cuda:  # the runner's host copies: the metadata's lengths are on the device
            lens = vargs.host_lens(md, self._step())
            if lens is None:  # left out, counted: never a wait for the device
                self.errors.drop("head_stats_lengths_unread")
                self._hs_plans[id(md)] = []
                return []
            shape = vargs.batch_shape(lens)
        else:
            shape = self._shape(md)
        q_lens, seq_lens = shape.q_lens, shape.seq_lens
        lens = (vargs.prompt_lens(self._runner, len(seq_lens), self.v2_batch)
                if self._runner is not None else None)
        from attnprof.aggregate.head_strata import (
            HEAD_STATS_MAX_TOKENS,
            context_bucket,
            context_bucket_edges,
        )

        edges = context_bucket_edges(self.hs_min_tokens, HEAD_STATS_MAX_TOKENS)
        plan, decodes, start = [], [], 0
        for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=False)):
            done = sl - ql  # positions computed by earlier steps (or the prefix cache)
            p = lens[i] if lens is not None else (sl if done == 0 else None)
            if p is not None and sl <= p:
                if p <= HEAD_STATS_MAX_TOKENS and ql > 0:
                    plan.append(_Fold("prefill", context_bucket(p, edges), start, ql, done, p,
                                      i, self._hs_weight))
            elif p is not None and ql == 1 and sl <= HEAD_STATS_MAX_TOKENS:
                decodes.append((start, sl, i))
            start += ql
        if decodes:
            import numpy as np

            n = min(len(decodes), DECODE_SEQS_PER_STEP)
            rng = np.random.default_rng([self.seen, len(decodes)])
            w = len(decodes) / n * self._hs_weight
            keys = (vargs.req_keys(self._runner, len(seq_lens), self.v2_batch)
                    if self._runner is not None else None)
            # one of the n folded sequences gets the detail query (entropy, top-k, pairwise
            # distances: the costly part), weighted n x theirs (unbiased)
            chosen = sorted(rng.choice(len(decodes), n, replace=False).tolist())
            dj = int(rng.integers(n))
            for jj, j in enumerate(chosen):
                a, sl, i = decodes[j]
                b = context_bucket(sl, edges)
                plan.append(_Fold("decode", b, a, 1, sl - 1, sl, i, w,
                                  0.0 if keys is None else self._first_decode_fold(keys[i], b),
                                  w * n if jj == dj else 0.0))
        self._hs_plans[id(md)] = plan
        return plan

    def _first_decode_fold(self, key: int, bucket: int) -> float:
        """1.0 when this step is the first to fold the sequence ``key`` in decode stratum
        ``bucket`` (every KV-cache group's plan of the step gets the same answer), else 0."""
        k = (key, bucket)
        got = self._decode_step.get(k)
        if got is None:
            got = self._decode_step[k] = 0.0 if k in self._decode_seen else 1.0
            self._decode_seen[k] = None
            self._decode_seen.move_to_end(k)
            if len(self._decode_seen) > DECODE_SEQS_SEEN:
                self._decode_seen.popitem(last=False)
        return got

    def _step_weight(self, args: Any, kwargs: Any) -> float:
        """The sampled step's inverse inclusion probability, relative to an ordinary step at
        the configured rate (so weights stay query counts where nothing else varies): the
        base coin passes with p = rate x scale; a step of at least ``long_tokens`` tokens
        with the long-prefill stratum on also has the long coin, p = 1 - (1 - p)(1 - long
        rate x scale). The head-statistics coin is the same for every step and cancels."""
        s = self.sampler
        p, ref = s.rate, s.base_rate
        if self.long_on:
            n = (self.args.step_tokens(args, kwargs) if self._step_tokens is None
                 else self._step_tokens)
            if n >= s.long_tokens:
                p = 1.0 - (1.0 - p) * (1.0 - min(1.0, s.long_rate * s.scale))
            if ref <= 0.0:
                ref = s.long_rate
        return ref / p if p > 0.0 and ref > 0.0 else 1.0

    # ----- per step -----
    def model_forward(self, orig: Any, runner: Any, args: Any, kwargs: Any,
                      tokens: int | None = None, around: Any = None) -> Any:
        """The step hook's slow path: the countdown reached zero, or the long-prefill
        stratum may apply. ``install`` inlines the unsampled fast path before this.
        ``tokens``: the step's scheduled tokens where the hook knows them (V2); ``around``:
        a context manager factory ``around(runner)`` a sampled step runs inside (V2: its
        CUDA-graph steering and batch capture; it must not raise its own errors)."""
        try:
            outcome = self._decide(args, kwargs, tokens)
            self._step_tokens = tokens
        except Exception as exc:  # never let the decision itself reach vLLM
            self.errors.record("sampler", exc)
            outcome = None
        if outcome is None:
            return orig(runner, *args, **kwargs)
        if around is None:
            return self._sampled_step(orig, runner, args, kwargs, outcome)
        with around(runner):
            return self._sampled_step(orig, runner, args, kwargs, outcome)

    def _decide(self, args: Any, kwargs: Any, tokens: int | None = None) -> str | None:
        """None (unsampled), "sampled" or "sampled_long"."""
        s = self.sampler
        pre = self.predecided
        if pre is not None:  # decided when vLLM chose the step's CUDA graph
            self.predecided = None
            s.countdown = pre[1]
            return pre[0]
        if s.countdown <= 0 and s.fire():
            return None if self.errors.disabled else "sampled"
        if not self.long_on or self.errors.disabled:
            return None
        n = self.args.step_tokens(args, kwargs) if tokens is None else tokens
        if n < s.long_tokens or not s.long_prefill(n):
            return None
        return "sampled_long"

    def _sampled_step(self, orig: Any, runner: Any, args: Any, kwargs: Any, outcome: str) -> Any:
        self.in_step = 1
        try:
            return self._run_sampled(orig, runner, args, kwargs, outcome)
        finally:
            self.in_step = 0

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
            self._hs_admitted = False
            self._hs_plans.clear()
            self._hs_folds.clear()
            self._runner = runner
            self._hs_time = 0.0
            # A coin of its own at this step index: every rank folds the same prompts.
            self._hs_step = (self.hs_rate > 0
                             and self.sampler.coin(STREAM_HEAD_STATS) < self.hs_rate)
            if self._hs_step and self.hs_worker is not None and self.hs_worker.lagging:
                # the worker is behind (head_worker.LAG_JOBS): this step's statistics are
                # left out whole (every layer alike, counted), not cut off after some layers
                self._hs_step = False
                self.errors.drop("head_stats_worker_busy")
            self._decode_step.clear()
            self._hs_weight = self._step_weight(args, kwargs) if self._hs_step else 1.0
            self._cuda = vargs.on_cuda(runner)
            capturing = False
            if self._cuda:
                self.resolve_pending()
                # vLLM is capturing a CUDA graph: timing events are illegal inside a
                # capture and would break the host's graph. Not a real step; skip it.
                capturing = bool(self.capturing_graph())
                if not capturing:
                    ev0 = self.event_factory()
                    ev0.record()
            if not capturing:
                self.install_layers()
        except Exception as exc:
            self.errors.record("step_begin", exc)
            self.remove_layers()
            return orig(runner, *args, **kwargs)
        if capturing:  # outside the guard: the host's own exception passes through, once
            self.seen -= 1
            return orig(runner, *args, **kwargs)
        overhead = self.clock() - t_start
        t0 = self.clock()
        try:
            out = orig(runner, *args, **kwargs)
        finally:
            self.remove_layers()
        t1 = self.clock()
        try:
            # No wrapper fired but attention metadata is set: a full CUDA graph replayed
            # (Python never ran inside). Decided now: the forward context is this step's.
            # V2 replays outside any forward context: its graph answer says (full_replay).
            blind = not self._calls and (self.full_replay or vargs.step_has_metadata())
            if ev0 is not None:
                # GPU: record the end and read both events once they have completed (next
                # sampled step or snapshot). No synchronize(): the forward's CPU/GPU overlap
                # is the host's, and a wait here would be attnprof's cost, not the model's.
                ev1 = self.event_factory()
                ev1.record()
                if len(self.pending) >= PENDING_STEPS_MAX:
                    self.pending.popleft()
                    self.errors.drop("gpu_events_pending")
                self.pending.append(_PendingStep(ev0, ev1, self._calls,
                                                 "blind" if blind else outcome, self._hs_time,
                                                 wall))
            else:
                # head statistics are ours, not the model's
                self._finish_step(t1 - t0 - self._hs_time, outcome, self._calls, blind,
                                  (wall, t0, t1) if wall else None)
        except Exception as exc:
            self.errors.record("step_end", exc)
        # the worker's folds since the last sampled step: attnprof's CPU time too
        bg = self.hs_worker.take_busy() if self.hs_worker is not None else 0.0
        self.hs.time_s += bg
        if self._hs_time:
            self.hs.steps += 1
            self.hs.time_s += self._hs_time
            # Attention-free estimate of the prefill's own cost: the step minus our stats.
            self.hs.prefill_time_s += max(0.0, t1 - t0 - self._hs_time)
        try:
            self.sampler.charge(overhead + self._hs_time + bg + (self.clock() - t1))
        except Exception as exc:
            self.errors.record("sampler", exc)
        return out

    def resolve_pending(self) -> None:
        """Fold sampled GPU steps whose end event has completed (in order; never waits)."""
        while self.pending and self.pending[0].end.query():
            p = self.pending[0]
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
                self.pending.popleft()

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
                # (GPU steps' md are host copies already, read when the step was)
                shape = shapes[id(md)] = vargs.batch_shape(md, self._step())
                if shape.num_reqs and not shape.seq_lens:
                    # native FlashInfer whose lengths the runner did not give: timed, no
                    # FLOPs or KV reads for this metadata (counted)
                    self.errors.drop(vargs.LENGTHS_UNREAD)
            rec.calls.append(LayerCall(info, shape, dt))
        self.aggs.record_step(rec)
        if trace is not None:
            try:
                self.trace.add(self._step_trace(rec, calls, *trace))
            except Exception as exc:  # a trace is ours: the step's aggregates already count
                self.errors.record("trace", exc)

    def _step_trace(self, rec: StepRecord, calls: list[tuple[LayerInfo, Any, Any, Any]],
                    wall_ns: int, t0: Any, t1: Any) -> Any:
        """The step's trace record (CPU: clock readings; GPU: ``elapsed_time`` from the step's
        start event, read now that the end event has completed, so no wait)."""
        if hasattr(t0, "elapsed_time"):
            dur = t0.elapsed_time(t1) * 1e6
            offsets = [t0.elapsed_time(a) * 1e6 for _i, _md, a, _b in calls]
        else:
            dur = (t1 - t0) * 1e9
            offsets = [(a - t0) * 1e9 for _i, _md, a, _b in calls]
        return step_trace(rec, offsets, wall_ns, dur, self.sampler.rate)

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


def _snapshot_builder(cap: Capture) -> LatestBuild:
    """The worker snapshot's slow parts, rebuilt on a thread of their own. The thread holds
    the capture weakly: a capture nobody uses any more (tests, undo) ends it."""
    ref = weakref.ref(cap)

    def build() -> Any:
        c = ref()
        if c is None:
            return None
        from attnprof.aggregate.background import yield_gil  # looked up per build (tests)

        return ws.slow_parts(c.aggs, c.reports.kernel_map, c.state.probe, yield_gil)

    def version() -> Any:
        c = ref()
        return LatestBuild.GONE if c is None else ws.slow_version(c.aggs, c.state.probe)

    def on_error(exc: BaseException) -> None:
        c = ref()
        if c is not None:
            c.errors.record("snapshot", exc)

    return LatestBuild(build, version, on_error=on_error)


def step_hook(cap: Capture, orig_fwd: Any) -> Any:
    """The replacement for ``GPUModelRunner._model_forward`` (``orig_fwd``)."""
    sampler = cap.sampler
    slow = cap.model_forward
    long_on, long_tokens = cap.long_on, sampler.long_tokens
    ids_key = cap.args.step_ids_key  # the adapter names it; read inline per step

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
            x = kwargs.get(ids_key)
            if x is not None and x.shape[0] < long_tokens:
                out = orig_fwd(runner, *args, **kwargs)
                cap.seen += 1
                return out
        out = slow(orig_fwd, runner, args, kwargs)
        cap.seen += 1
        return out

    return _model_forward


