"""vLLM stat-logger plugin (API server): request context lengths and KV-cache pressure.

Per finished request vLLM hands us prompt and generated token counts; we keep them in
log-spaced Prometheus histograms and bounded quantile sketches. Request ids and text are
never read.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from attnprof.aggregate.quantiles import QuantileSketch, log_buckets
from attnprof.capture.vllm import runtime
from attnprof.config import Config, ConfigError

__all__ = ["AttnProfStatLogger", "RequestStats"]

logger = logging.getLogger("attnprof")


class RequestStats:
    """Process-wide context-length summaries shared by every engine's logger."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.buckets = log_buckets(max_model_len)
        self.context = QuantileSketch()
        self.prompt = QuantileSketch()
        self.generation = QuantileSketch()
        self.kv_cache_usage: float | None = None
        self.requests = 0
        self.lock = threading.Lock()

    def observe(self, prompt: int, generated: int) -> None:
        with self.lock:
            self.requests += 1
            self.prompt.add(prompt)
            self.generation.add(generated)
            self.context.add(prompt + generated)

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "max_model_len": self.max_model_len,
                "context_tokens": {**self.context.summary(), "sketch": self.context.to_dict()},
                "prompt_tokens": self.prompt.summary(),
                "generation_tokens": self.generation.summary(),
                "kv_cache_usage": self.kv_cache_usage,
            }


class AttnProfStatLogger(StatLoggerBase):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        try:
            cfg = Config.from_env()
        except ConfigError as err:
            raise SystemExit(f"attnprof: invalid configuration: {err}") from None
        self.enabled = cfg.enabled
        self.fault = cfg.fault_inject == "stat_logger"
        if not self.enabled:
            return
        runtime.start(cfg)
        st = runtime.STATE
        self.state = st
        try:
            mc = vllm_config.model_config
            max_len = int(mc.max_model_len)
            st.model_path = str(mc.model)
            if not cfg.model_label:
                names = getattr(mc, "served_model_name", None) or mc.model
                st.model_label = names[0] if isinstance(names, (list, tuple)) else str(names)
        except Exception as exc:
            st.errors.record("stat_logger_init", exc)
            max_len = 8192
        if st.requests is None:
            st.requests = RequestStats(max_len)
        self.requests: RequestStats = st.requests
        sink = st.get_sink()
        for name in ("attnprof_request_context_tokens", "attnprof_request_prompt_tokens",
                     "attnprof_request_generation_tokens"):
            sink.buckets[name] = self.requests.buckets
        model = st.model_label
        self._ctx = sink.metric("attnprof_request_context_tokens").labels(model=model)
        self._prompt = sink.metric("attnprof_request_prompt_tokens").labels(model=model)
        self._gen = sink.metric("attnprof_request_generation_tokens").labels(model=model)
        self._kv = sink.metric("attnprof_kv_cache_usage_ratio").labels(model=model)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        # vLLM calls record() without a try/except: nothing may escape from here.
        if not self.enabled:
            return
        try:
            if self.fault:
                raise RuntimeError("attnprof fault injection (ATTNPROF_FAULT_INJECT=stat_logger)")
            if scheduler_stats is not None:
                usage = float(scheduler_stats.kv_cache_usage)
                self.requests.kv_cache_usage = usage
                self._kv.set(usage)
            if iteration_stats is not None:
                for fr in iteration_stats.finished_requests:
                    p = int(fr.num_prompt_tokens)
                    g = int(fr.num_generation_tokens)
                    self.requests.observe(p, g)
                    self._prompt.observe(p)
                    self._gen.observe(g)
                    self._ctx.observe(p + g)
        except Exception as exc:
            self.state.errors.record("stat_logger", exc)
            self.state.export_errors()

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass
