"""Per-layer attention capture inside a vLLM worker.

Hook points (see docs/vllm.md for why these and not module hooks):
- ``Attention.__init__`` is wrapped so each layer's ``impl.forward`` gets an instance-level
  wrapper. The custom op ``unified_attention_with_output`` calls ``impl.forward`` from
  Python on every step, eager or under torch.compile.
- ``GPUModelRunner._model_forward`` (``CPUModelRunner`` inherits it) marks step boundaries:
  it draws the sampling decision and times the whole model forward.
Unsampled steps cost one decrement and one branch in the runner and one attribute read
and branch per layer. Everything recorded is aggregated in dicts bounded by
layers x phases.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from attnprof.aggregate.sampler import StepSampler
from attnprof.analyze.memory import dtype_bytes
from attnprof.capture.vllm.runtime import State

__all__ = ["SNAPSHOT_VERSION", "Capture", "LayerInfo", "install"]

logger = logging.getLogger("attnprof")
SNAPSHOT_VERSION = 1
PHASES = ("prefill", "decode", "mixed")
FLUSH_INTERVAL_S = 1.0
HEAD_STATS_MAX_TOKENS = 32768
_LAYER_RE = re.compile(r"\.(\d+)\.")

# Fused = the backend runs attention as one kernel that never materializes the score
# matrix. Every paged vLLM backend is; the ones listed here are not.
_UNFUSED_BACKENDS = {"TORCH_SDPA_MATH", "NAIVE"}


@dataclass
class LayerInfo:
    name: str
    index: int
    backend: str
    impl: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    sliding_window: int | None
    dtype: str
    kv_cache_dtype: str
    fused: bool
    kv_cache_bytes: int = 0
    scale: float = 0.0
    kernel: str | None = None
    """Kernel variant actually used (CPU ISA, FlashAttention version), seen on first call."""


def layer_info(layer: Any, impl: Any) -> LayerInfo:
    name = str(getattr(layer, "layer_name", "") or "")
    m = _LAYER_RE.search(name + ".")
    index = int(m.group(1)) if m else -1
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
        name=name, index=index, backend=backend, impl=type(impl).__name__,
        num_heads=int(getattr(layer, "num_heads", 0) or 0),
        num_kv_heads=int(getattr(layer, "num_kv_heads", 0) or 0),
        head_size=int(getattr(layer, "head_size", 0) or 0),
        head_size_v=int(getattr(layer, "head_size_v", 0) or getattr(layer, "head_size", 0) or 0),
        sliding_window=sw,
        dtype=str(getattr(layer, "dtype", "")).removeprefix("torch."),
        kv_cache_dtype=str(getattr(layer, "kv_cache_dtype", "auto")),
        fused=backend not in _UNFUSED_BACKENDS,
        scale=float(getattr(impl, "scale", 0.0) or 0.0),
    )


@dataclass
class BatchShape:
    """What one attention-metadata object says about the batch (computed once per step)."""

    phase: str
    num_tokens: int
    pairs: int  # sum over requests of query_len * seq_len (dense, no causal discount)
    kv_tokens: int  # sum of seq_lens
    num_reqs: int
    max_seq_len: int
    whole_prompts: tuple[tuple[int, int], ...] = ()
    """(start, length) of requests whose entire context is computed in this step: their
    q and k are all in the step's tensors (no cached prefix, no earlier chunk)."""


def batch_shape(md: Any) -> BatchShape:
    num_tokens = int(md.num_actual_tokens)
    max_q = int(getattr(md, "max_query_len", 1))
    seq_lens = md.seq_lens
    seq = [int(x) for x in (seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens)]
    n = len(seq)
    whole: tuple[tuple[int, int], ...] = ()
    if max_q <= 1:
        qlens = [1] * n
    else:
        qsl = md.query_start_loc
        starts = [int(x) for x in (qsl.tolist() if hasattr(qsl, "tolist") else qsl)][: n + 1]
        qlens = [b - a for a, b in itertools.pairwise(starts)]
        whole = tuple((a, q) for a, q, s in zip(starts, qlens, seq, strict=False)
                      if q == s and q > 1)
    n_dec = sum(1 for q in qlens if q <= 1)
    phase = "decode" if n_dec == len(qlens) else ("prefill" if n_dec == 0 else "mixed")
    pairs = sum(q * s for q, s in zip(qlens, seq, strict=False))
    return BatchShape(phase, num_tokens, pairs, sum(seq), n, max(seq, default=0), whole)


class _Agg:
    __slots__ = ("bytes", "calls", "flops", "kv_tokens", "max_seq_len", "requests", "time_s",
                 "tokens")

    def __init__(self) -> None:
        self.calls = 0
        self.time_s = 0.0
        self.flops = 0
        self.bytes = 0
        self.tokens = 0
        self.kv_tokens = 0
        self.requests = 0
        self.max_seq_len = 0


class Capture:
    def __init__(self, state: State, clock: Any = time.perf_counter) -> None:
        cfg = state.config
        assert cfg is not None
        self.state = state
        self.errors = state.errors
        self.sampler = StepSampler(cfg.sample_rate, cfg.overhead_budget, cfg.long_prefill_tokens,
                                   cfg.long_prefill_rate, cfg.seed)
        self.clock = clock
        self.active = False
        self.layers: dict[str, LayerInfo] = {}
        self.agg: dict[tuple[int, str], _Agg] = {}
        self.steps: dict[str, list[float]] = {p: [0, 0.0, 0.0] for p in PHASES}
        self.outcomes = {"sampled": 0, "sampled_long": 0, "blind": 0}
        self.seen = 0
        self._pending: list[tuple[LayerInfo, Any, Any, Any]] = []
        self._cuda = False
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self.fault = cfg.fault_inject
        # Per-head statistics (sparsity advice) on a share of sampled steps.
        self.hs_rate = cfg.head_stats_rate
        self.hs_min_tokens = cfg.head_stats_min_tokens
        self.head_stats: Any = None
        self.hs = {"steps": 0, "requests": 0, "queries": 0, "time_s": 0.0,
                   "prefill_time_s": 0.0}
        self._hs_step = False
        self._hs_time = 0.0
        self._hs_seen: set[int] = set()
        self._shapes: dict[int, BatchShape] = {}
        self._reports: dict[tuple[Any, ...], dict[str, Any]] = {}

    # ----- layer registration (model build time) -----
    def wrap_layer(self, layer: Any) -> None:
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(impl, "_attnprof_wrapped", False):
            return
        info = layer_info(layer, impl)
        if not self.layers:
            self._learn_model_label()
        self.layers[info.name or str(len(self.layers))] = info
        orig = impl.forward
        cap = self

        @functools.wraps(orig)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not cap.active:
                return orig(*args, **kwargs)
            return cap._timed(info, orig, args, kwargs)

        impl.forward = forward
        impl._attnprof_wrapped = True
        self.state.add_role("worker")
        self._publish_layer(info)
        self.start_flusher()

    def _learn_model_label(self) -> None:
        """Workers never see the stat logger: read the served name from vLLM's config."""
        st = self.state
        if st.config is not None and st.config.model_label:
            return
        try:
            from vllm.config import get_current_vllm_config

            mc = get_current_vllm_config().model_config
            names = getattr(mc, "served_model_name", None) or mc.model
            st.model_label = str(names[0] if isinstance(names, (list, tuple)) else names)
        except Exception as exc:
            self.errors.record("model_label", exc)

    def _publish_layer(self, info: LayerInfo) -> None:
        try:
            self.state.get_sink().metric("attnprof_layer_info").labels(
                model=self.state.model_label, layer=str(info.index), backend=info.backend,
                impl=info.impl, fused=str(info.fused).lower()).set(1)
        except Exception as exc:
            self.errors.record("metrics", exc)

    # ----- per call (sampled steps only) -----
    def _timed(self, info: LayerInfo, orig: Any, args: Any, kwargs: Any) -> Any:
        # Our bookkeeping may fail (counted, dropped); the host's own call and its
        # exceptions pass through untouched.
        md = start = None
        try:
            md = args[5] if len(args) > 5 else kwargs.get("attn_metadata")
            if md is not None:  # None = profile/dummy run: not a real step
                start = self._timer_start()
        except Exception as exc:
            self.errors.record("capture", exc)
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
            import torch

            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            return e0
        return self.clock()

    def _timer_stop(self, info: LayerInfo, md: Any, start: Any, args: Any, kwargs: Any) -> None:
        if self.fault == "capture":
            raise RuntimeError("attnprof fault injection (ATTNPROF_FAULT_INJECT=capture)")
        if self._cuda:
            import torch

            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            self._pending.append((info, md, start, e1))
        else:
            self._pending.append((info, md, self.clock() - start, None))
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
        shape = self._shape(md)
        # Bounded: the statistics allocate O(prompt) scratch mid-forward, outside vLLM's
        # memory profile, so very long prompts are left out.
        todo = [(a, n) for a, n in shape.whole_prompts
                if self.hs_min_tokens <= n <= HEAD_STATS_MAX_TOKENS]
        if not todo or len(args) < 3:
            return
        t0 = self.clock()
        try:
            acc = self.head_stats
            if acc is None:
                from attnprof.aggregate.head_stats import HeadStatsAccumulator

                acc = self.head_stats = HeadStatsAccumulator(
                    num_layers=max(i.index for i in self.layers.values()) + 1,
                    num_kv_heads=info.num_kv_heads,
                    group_size=max(1, info.num_heads // max(1, info.num_kv_heads)),
                    seed=0)
            q, k = args[1], args[2]
            for a, n in todo:
                qs = q[a:a + n].view(n, info.num_heads, info.head_size)
                ks = k[a:a + n].view(n, info.num_kv_heads, info.head_size)
                got = acc.update(info.index, qs, ks, info.scale or info.head_size ** -0.5,
                                 q_start=0)
                self.hs["queries"] += got
                if id(md) not in self._hs_seen:
                    self._hs_seen.add(id(md))
                    self.hs["requests"] += len(todo)
        finally:
            self._hs_time += self.clock() - t0

    # ----- per step -----
    def model_forward(self, orig: Any, runner: Any, args: Any, kwargs: Any) -> Any:
        try:
            outcome = self._decide(args, kwargs)
        except Exception as exc:  # never let the decision itself reach vLLM
            self.errors.record("sampler", exc)
            outcome = None
        if outcome is None:
            return orig(runner, *args, **kwargs)
        return self._sampled_step(orig, runner, args, kwargs, outcome)

    def _decide(self, args: Any, kwargs: Any) -> str | None:
        """None (unsampled), "sampled" or "sampled_long"; one countdown branch when unsampled."""
        s = self.sampler
        self.seen += 1
        if not s.tick():
            if s.long_rate <= 0.0 or self.errors.disabled:
                return None
            n = _num_tokens(args, kwargs)  # scheduled tokens of the step
            if n < s.long_tokens or not s.long_prefill(n):
                return None
            return "sampled_long"
        return None if self.errors.disabled else "sampled"

    def _sampled_step(self, orig: Any, runner: Any, args: Any, kwargs: Any, outcome: str) -> Any:
        t_start = self.clock()
        try:
            self._pending.clear()
            self._shapes.clear()
            self._hs_seen.clear()
            self._hs_time = 0.0
            self._hs_step = self.hs_rate > 0 and self.sampler._rng.random() < self.hs_rate
            self._cuda = _on_cuda(runner)
            if self._cuda:
                import torch

                if torch.cuda.is_current_stream_capturing():
                    # vLLM is capturing a CUDA graph: timing events are illegal inside a
                    # capture and would break the host's graph. Not a real step; skip it.
                    self.seen -= 1
                    return orig(runner, *args, **kwargs)
                ev0 = torch.cuda.Event(enable_timing=True)
                ev0.record()
        except Exception as exc:
            self.errors.record("step_begin", exc)
            return orig(runner, *args, **kwargs)
        overhead = self.clock() - t_start
        self.active = True
        t0 = self.clock()
        try:
            out = orig(runner, *args, **kwargs)
        finally:
            self.active = False
        t1 = self.clock()
        sync_wait = 0.0
        try:
            model_time = t1 - t0 - self._hs_time  # head statistics are ours, not the model's
            if self._cuda:
                import torch

                ev1 = torch.cuda.Event(enable_timing=True)
                ev1.record()
                tw = self.clock()
                ev1.synchronize()
                # Waiting for the GPU to finish the forward is not attnprof's own time.
                sync_wait = self.clock() - tw
                model_time = ev0.elapsed_time(ev1) / 1e3
            self._finish_step(model_time, outcome)
        except Exception as exc:
            self.errors.record("step_end", exc)
        if self._hs_time:
            self.hs["steps"] += 1
            self.hs["time_s"] += self._hs_time
            # Attention-free estimate of the prefill's own cost: the step minus our stats.
            self.hs["prefill_time_s"] += max(0.0, t1 - t0 - self._hs_time)
        try:
            self.sampler.charge(overhead + self._hs_time + (self.clock() - t1) - sync_wait)
        except Exception as exc:
            self.errors.record("sampler", exc)
        return out

    def _finish_step(self, model_time: float, outcome: str) -> None:
        if self.fault == "step":
            self._pending.clear()
            raise RuntimeError("attnprof fault injection (ATTNPROF_FAULT_INJECT=step)")
        pending = self._pending
        if not pending:
            # No attention wrapper fired. With attention metadata set, the step replayed a
            # full CUDA graph (Python never ran inside): count it as blind, never pretend.
            # Without metadata it was a warm-up/dummy run: not a serving step at all.
            if _step_has_metadata():
                self.outcomes["blind"] += 1
            else:
                self.seen -= 1
            return
        self.outcomes[outcome] += 1
        attn_total = 0.0
        phase = "decode"
        for info, md, a, b in pending:
            shape = self._shape(md)
            dt = a.elapsed_time(b) / 1e3 if b is not None else float(a)
            attn_total += dt
            phase = shape.phase
            agg = self.agg.get((info.index, shape.phase))
            if agg is None:
                agg = self.agg[(info.index, shape.phase)] = _Agg()
            agg.calls += 1
            agg.time_s += dt
            agg.tokens += shape.num_tokens
            agg.kv_tokens += shape.kv_tokens
            agg.requests += shape.num_reqs
            agg.max_seq_len = max(agg.max_seq_len, shape.max_seq_len)
            # QK^T: 2*D and PV: 2*Dv FLOPs per (query, key) pair and query head.
            agg.flops += 2 * info.num_heads * (info.head_size + info.head_size_v) * shape.pairs
            # Q read + O written per query token; K and V read per key position.
            d_qk_v = info.head_size + info.head_size_v
            agg.bytes += (dtype_bytes(info.dtype, default=2) * shape.num_tokens * info.num_heads
                          * d_qk_v
                          + _kv_bytes_of(info) * shape.kv_tokens * info.num_kv_heads * d_qk_v)
        pending.clear()
        self._shapes.clear()
        st = self.steps[phase]
        st[0] += 1
        st[1] += model_time
        st[2] += attn_total

    # ----- export -----
    def start_flusher(self, interval: float = FLUSH_INTERVAL_S) -> None:
        """Push aggregates to Prometheus from a daemon thread, off the serving path.

        Flushing on sampled steps instead would leave the last second of a quiet server's
        activity unexported until the next sampled step.
        """
        if self._flusher is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval):
                self.flush_metrics()

        self._flusher = threading.Thread(target=loop, name="attnprof-flush", daemon=True)
        self._flusher.start()

    def flush_metrics(self) -> None:
        """Push counter deltas to Prometheus (called by the flusher thread and snapshots)."""
        with self._flush_lock:
            self._flush()

    def _flush(self) -> None:
        try:
            sink = self.state.get_sink()
            model = self.state.model_label
            by_index = {i.index: i for i in list(self.layers.values())}

            def inc(name: str, value: float, **labels: str) -> None:
                sink.inc_to(name, value, model=model, **labels)

            # Copy first: the serving thread may add a (layer, phase) key meanwhile.
            for (idx, phase), a in list(self.agg.items()):
                info = by_index.get(idx)
                backend = info.backend if info else "unknown"
                lay = str(idx)
                inc("attnprof_attention_calls_total", a.calls, layer=lay,
                    backend=backend, phase=phase)
                inc("attnprof_attention_time_seconds_total", a.time_s, layer=lay,
                    backend=backend, phase=phase)
                inc("attnprof_attention_flops_total", a.flops, layer=lay,
                    phase=phase)
                inc("attnprof_attention_bytes_total", a.bytes, layer=lay,
                    phase=phase)
                inc("attnprof_attention_tokens_total", a.tokens, layer=lay,
                    phase=phase)
            for phase, (_n, model_t, attn_t) in self.steps.items():
                inc("attnprof_step_time_seconds_total", model_t, phase=phase)
                inc("attnprof_step_attention_time_seconds_total", attn_t, phase=phase)
            for outcome, n in self.outcomes.items():
                inc("attnprof_steps_total", n, outcome=outcome)
            inc("attnprof_steps_total", self.seen - sum(self.outcomes.values()),
                outcome="unsampled")
            inc("attnprof_self_time_seconds_total", self.sampler.self_time)
            inc("attnprof_head_stats_queries_total", self.hs["queries"])
            self.state.export_errors()
            sink.metric("attnprof_sample_rate_ratio").labels(model=model).set(self.sampler.rate)
            for info in list(self.layers.values()):
                if info.kv_cache_bytes:
                    sink.metric("attnprof_kv_cache_bytes").labels(
                        model=model, layer=str(info.index)).set(info.kv_cache_bytes)
        except Exception as exc:
            self.errors.record("metrics", exc)

    def kernel_map(self) -> list[dict[str, Any]]:
        """Per group of identical layers: the backend that ran, the kernel variant, and why
        each other vLLM backend is not valid (vLLM's own ``validate_configuration`` where it
        imports, attnprof's rule data where not). Computed once per layer shape."""
        groups: dict[tuple[Any, ...], list[LayerInfo]] = {}
        for info in sorted(self.layers.values(), key=lambda i: i.index):
            key = (info.backend, info.kernel, info.num_heads, info.num_kv_heads, info.head_size,
                   info.dtype, info.kv_cache_dtype, info.sliding_window)
            groups.setdefault(key, []).append(info)
        out = []
        for key, infos in groups.items():
            rep = self._reports.get(key[2:])
            if rep is None:
                try:
                    from attnprof.analyze import vllm_backend_report

                    rep = vllm_backend_report(key[2], key[3], key[4], key[5], key[6], key[7],
                                              selected=key[0])
                except Exception as exc:
                    self.errors.record("kernel_map", exc)
                    rep = {"error": f"{type(exc).__name__}: {exc}"}
                self._reports[key[2:]] = rep
            first = infos[0]
            out.append({
                "layers": [i.index for i in infos], "backend": first.backend,
                "kernel": first.kernel, "fused": first.fused,
                "valid_backends": rep.get("valid"),
                "rejected": {name: b.get("reasons") for name, b in
                             (rep.get("backends") or {}).items() if not b.get("valid")},
                "source": rep.get("platform"),
            })
        return out

    def snapshot(self, include_head_stats: bool = True) -> dict[str, Any]:
        self.flush_metrics()
        layers = []
        for info in sorted(self.layers.values(), key=lambda i: i.index):
            d = asdict(info)
            d["phases"] = {}
            for phase in PHASES:
                a = self.agg.get((info.index, phase))
                if a is None:
                    continue
                d["phases"][phase] = {
                    "calls": a.calls, "time_s": a.time_s,
                    "mean_time_s": a.time_s / a.calls if a.calls else 0.0,
                    "tokens": a.tokens, "flops": a.flops, "bytes": a.bytes,
                    # Batch shape: requests per call and the context they attend over.
                    "mean_batch_requests": a.requests / a.calls if a.calls else 0.0,
                    "mean_seq_len": a.kv_tokens / a.requests if a.requests else 0.0,
                    "max_seq_len": a.max_seq_len,
                }
            layers.append(d)
        kernel_map = self.kernel_map()
        steps = {p: {"steps": int(v[0]), "model_time_s": v[1], "attention_time_s": v[2],
                     "attention_share": (v[2] / v[1]) if v[1] > 0 else None}
                 for p, v in self.steps.items() if v[0]}
        s = self.sampler
        return {
            "pid": os.getpid(),
            "process": multiprocessing.current_process().name,
            "layers": layers,
            "kernel_map": kernel_map,
            "steps": steps,
            "sampler": {
                "seen": self.seen, **self.outcomes,
                "unsampled": self.seen - sum(self.outcomes.values()),
                "base_rate": s.base_rate, "effective_rate": s.rate,
                "budget": s.budget, "self_time_s": s.self_time,
                "self_time_fraction": s.self_time_fraction(),
            },
            "errors": dict(self.errors.by_place),
            "dropped": dict(self.errors.dropped),
            "disabled": self.errors.disabled,
            "head_stats_cost": {
                **self.hs,
                "fraction_of_prefill": (self.hs["time_s"] / self.hs["prefill_time_s"]
                                        if self.hs["prefill_time_s"] > 0 else None),
            },
            "head_stats": (self.head_stats.to_dict() if self.head_stats is not None
                           and include_head_stats else None),
        }


def _kv_bytes_of(info: LayerInfo) -> int:
    """Bytes per KV-cache element: the cache dtype (e.g. fp8) when set, else the model's."""
    model = dtype_bytes(info.dtype, default=2)
    return model if info.kv_cache_dtype == "auto" else dtype_bytes(info.kv_cache_dtype, model)


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
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        return bool(is_forward_context_available() and get_forward_context().attn_metadata)
    except Exception:
        return False


def _on_cuda(runner: Any) -> bool:
    dev = getattr(runner, "device", None)
    return getattr(dev, "type", "cpu") == "cuda"


def install(state: State) -> None:
    """Patch vLLM classes in this process (called once, from the general plugin)."""
    cap = Capture(state)
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except Exception as exc:
        state.errors.record("install", exc)
        return

    orig_init = Attention.__init__
    if not getattr(orig_init, "_attnprof", False):
        @functools.wraps(orig_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(self, *args, **kwargs)
            try:
                cap.wrap_layer(self)
            except Exception as exc:
                state.errors.record("wrap_layer", exc)

        __init__._attnprof = True  # type: ignore[attr-defined]
        Attention.__init__ = __init__

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        orig_fwd = GPUModelRunner._model_forward
        if not getattr(orig_fwd, "_attnprof", False):
            @functools.wraps(orig_fwd)
            def _model_forward(runner: Any, *args: Any, **kwargs: Any) -> Any:
                return cap.model_forward(orig_fwd, runner, args, kwargs)

            _model_forward._attnprof = True  # type: ignore[attr-defined]
            GPUModelRunner._model_forward = _model_forward
    except Exception as exc:
        state.errors.record("install", exc)

    try:
        from vllm.v1.worker.worker_base import WorkerBase

        def attnprof_snapshot(self: Any, include_head_stats: bool = True) -> dict[str, Any]:
            try:
                return cap.snapshot(include_head_stats)
            except Exception as exc:  # runs in vLLM's worker loop: never raise there
                state.errors.record("snapshot", exc)
                return {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

        WorkerBase.attnprof_snapshot = attnprof_snapshot
    except Exception as exc:
        state.errors.record("install", exc)
