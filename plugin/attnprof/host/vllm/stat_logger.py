"""vLLM stat-logger plugin (API server): request context lengths and KV-cache pressure.

Per finished request vLLM hands us prompt and generated token counts; they go into the
process's :class:`~attnprof.aggregate.requests.RequestAggregates` (histograms and quantile
estimators), which the export loop renders. Per stats batch, KV usage, running and waiting
requests and preemptions go into its :class:`~attnprof.aggregate.kv.KvPressure`. Request
ids and text are never read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from attnprof._safety import fault_point
from attnprof.aggregate.histogram import pow2_buckets
from attnprof.aggregate.kv import FinishedRequest
from attnprof.aggregate.requests import RequestAggregates
from attnprof.config import ConfigError
from attnprof.facts.label import model_label
from attnprof.host.vllm import runtime, start

__all__ = ["AttnProfStatLogger"]

logger = logging.getLogger("attnprof")


def request_samples() -> list[Any]:
    """The API server's sample source: request statistics and the latest window advice."""
    from attnprof.analyze.kv_pressure import VERDICTS, assess, head_bytes
    from attnprof.exporters.samples import (
        advice_samples,
        context_bucket_samples,
        coverage_samples,
        kv_samples,
        request_samples,
    )

    st = runtime.STATE
    out = request_samples(st.model_label, st.requests) if st.requests is not None else []
    summ = st.requests.summary(with_state=False) if st.requests is not None else None
    a = assess(summ)
    if summ is not None and summ.kv_pressure is not None and a is not None:
        kv = summ.kv_pressure
        held = head_bytes(kv, kv.current, a.context_tokens.get("p50", 1.0))
        out += kv_samples(st.model_label, kv, a, held, VERDICTS)
    if st.advice is not None:
        out += advice_samples(st.model_label, st.advice)
    if summ is not None:
        out += context_bucket_samples(st.model_label, summ.context_buckets)
    out += coverage_samples(st.model_label, st.coverage, st.advice)
    return out


class AttnProfStatLogger(StatLoggerBase):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        try:
            cfg, otlp = runtime.config_from_env()
        except ConfigError as err:
            raise SystemExit(f"attnprof: invalid configuration: {err}") from None
        self.enabled = cfg.enabled
        if not self.enabled:
            return
        start(cfg, otlp)
        st = runtime.STATE
        self.state = st
        try:
            mc = vllm_config.model_config
            max_len = int(mc.max_model_len)
            st.model_path = str(mc.model)
            if not cfg.model_label:
                st.model_label = model_label(mc)
        except Exception as exc:
            st.errors.record("stat_logger_init", exc)
            max_len = 8192
        if st.requests is None:
            # OTLP exponential histograms convert exactly only from power-of-two edges (the
            # one set of bounds: /metrics shows them too). Without an endpoint, no change.
            buckets = (pow2_buckets(max_len) if st.otlp is not None
                       and cfg.otlp_histogram == "exponential" else None)
            st.requests = RequestAggregates(max_len, buckets=buckets,
                                            min_tokens=cfg.head_stats_min_tokens)
        self.requests: RequestAggregates = st.requests
        self.vllm_config = vllm_config
        try:
            self._configure_kv(vllm_config)
        except Exception as exc:
            st.errors.record("stat_logger_init", exc)
        st.export_source("requests", request_samples)

    def _configure_kv(self, vllm_config: Any) -> None:
        """Engine facts for KV pressure: batch limit, block size, KV dtype, bytes per token
        per layer (the cache's block count is known only once the engine has started)."""
        from attnprof.analyze.kv_pressure import kv_layers
        from attnprof.facts.kv import kv_cache_dtype
        from attnprof.facts.shape import AttentionShape

        mc, cc = vllm_config.model_config, vllm_config.cache_config
        sc = getattr(vllm_config, "scheduler_config", None)
        dt = kv_cache_dtype(getattr(cc, "cache_dtype", "auto"),
                            getattr(mc, "dtype", "bfloat16"))
        shape = AttentionShape.from_config(getattr(mc, "hf_text_config", None) or mc.hf_config)
        pc = getattr(vllm_config, "parallel_config", None)
        tp = max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1))
        if tp > 1 and shape.num_kv_heads >= tp:  # each rank holds its share of the heads
            import dataclasses

            shape = dataclasses.replace(shape, num_heads=shape.num_heads // tp,
                                        num_kv_heads=shape.num_kv_heads // tp)
        blocks = getattr(cc, "num_gpu_blocks", None)
        self.requests.kv.configure(
            max_num_seqs=int(sc.max_num_seqs) if sc is not None and sc.max_num_seqs else None,
            block_size=int(cc.block_size) if getattr(cc, "block_size", None) else None,
            num_blocks=int(blocks) if blocks else None, kv_dtype=dt,
            layers=kv_layers(shape, dt))

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        # vLLM calls record() without a try/except: nothing may escape from here.
        if not self.enabled:
            return
        try:
            if self.state.errors.is_off("stat_logger"):
                self.enabled = False  # its breaker tripped: vLLM's own loggers go on alone
                return
            fault_point("stat_logger")
            usage, running, waiting, preempted = 0.0, 0, 0, 0
            have_usage = scheduler_stats is not None
            if scheduler_stats is not None:
                usage = float(scheduler_stats.kv_cache_usage)
                self.requests.set_kv_usage(usage)
                running = int(scheduler_stats.num_running_reqs)
                # vLLM's "capacity" waiting reason; deferred requests wait for other things.
                waiting = int(scheduler_stats.num_waiting_reqs)
            finished: list[FinishedRequest] = []
            if iteration_stats is not None:
                preempted = int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
                for fr in iteration_stats.finished_requests:
                    done = FinishedRequest(
                        int(fr.num_prompt_tokens), int(fr.num_generation_tokens),
                        float(getattr(fr, "prefill_time", 0.0) or 0.0),
                        float(getattr(fr, "decode_time", 0.0) or 0.0))
                    self.requests.observe(done.prompt_tokens, done.generation_tokens,
                                          done.prefill_time_s, done.decode_time_s)
                    finished.append(done)
            if self.requests.kv.num_blocks is None:
                self.log_engine_initialized()
            # One KvPressure serves every engine's logger (vLLM makes one per engine_idx):
            # keyed by engine, an interval is never credited across engines.
            self.requests.kv.record(time.monotonic(), usage if have_usage else None, running,
                                    waiting, preempted, finished, engine=int(engine_idx))
        except Exception as exc:
            self.state.errors.record("stat_logger", exc)

    def log_engine_initialized(self) -> None:
        # The engine has sized its KV cache: num_gpu_blocks is set in this process's config.
        if not self.enabled:
            return
        try:
            blocks = self.vllm_config.cache_config.num_gpu_blocks
            if blocks:
                self.requests.kv.configure(num_blocks=int(blocks))
        except Exception as exc:
            self.state.errors.record("stat_logger", exc)

    def log(self) -> None:
        pass
