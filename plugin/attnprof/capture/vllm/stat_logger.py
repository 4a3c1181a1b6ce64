"""vLLM stat-logger plugin (API server): request context lengths and KV-cache pressure.

Per finished request vLLM hands us prompt and generated token counts; they go into the
process's :class:`~attnprof.aggregate.requests.RequestAggregates` (histograms and quantile
estimators), which the export loop renders. Request ids and text are never read.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from attnprof._safety import fault_point
from attnprof.aggregate.histogram import pow2_buckets
from attnprof.aggregate.requests import RequestAggregates
from attnprof.capture.vllm import runtime, start
from attnprof.config import ConfigError
from attnprof.facts.label import model_label

__all__ = ["AttnProfStatLogger"]

logger = logging.getLogger("attnprof")


def request_samples() -> list[Any]:
    """The API server's sample source: request statistics and the latest window advice."""
    from attnprof.exporters.samples import advice_samples, request_samples

    st = runtime.STATE
    out = request_samples(st.model_label, st.requests) if st.requests is not None else []
    if st.advice is not None:
        out += advice_samples(st.model_label, st.advice)
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
            st.requests = RequestAggregates(max_len, buckets=buckets)
        self.requests: RequestAggregates = st.requests
        st.export_source("requests", request_samples)

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
            if scheduler_stats is not None:
                self.requests.set_kv_usage(float(scheduler_stats.kv_cache_usage))
            if iteration_stats is not None:
                for fr in iteration_stats.finished_requests:
                    self.requests.observe(int(fr.num_prompt_tokens),
                                          int(fr.num_generation_tokens))
        except Exception as exc:
            self.state.errors.record("stat_logger", exc)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass
