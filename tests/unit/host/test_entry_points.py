"""The distribution registers its vLLM plugins; loading them is inert unless enabled."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from tests.conftest import run_py


def _eps(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=group)
            if ep.value.startswith("attnprof.")}


def test_entry_points_registered() -> None:
    assert _eps("vllm.general_plugins") == {
        "attnprof": "attnprof.host.vllm:register"}
    assert _eps("vllm.stat_logger_plugins") == {
        "attnprof_stats": "attnprof.host.vllm.stat_logger:AttnProfStatLogger"}
    assert _eps("vllm.endpoint_plugins") == {
        "attnprof_http": "attnprof.host.vllm.endpoint:AttnProfEndpoint"}
    assert _eps("console_scripts") == {"attnprof": "attnprof.cli:main"}


@pytest.mark.vllm
def test_entry_points_load() -> None:
    for group in ("vllm.general_plugins", "vllm.stat_logger_plugins", "vllm.endpoint_plugins"):
        for ep in entry_points(group=group):
            if ep.value.startswith("attnprof."):
                assert callable(ep.load())


@pytest.mark.vllm
def test_stat_logger_is_a_vllm_stat_logger() -> None:
    from vllm.v1.metrics.loggers import StatLoggerBase

    from attnprof.host.vllm.stat_logger import AttnProfStatLogger

    assert issubclass(AttnProfStatLogger, StatLoggerBase)


_PROBE = """
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.plugins import load_general_plugins
init0, fwd0 = Attention.__init__, GPUModelRunner._model_forward
load_general_plugins()
from attnprof.host.vllm import register
register(); register()
from attnprof.host.vllm.runtime import STATE
print("patched" if Attention.__init__ is not init0 else "untouched",
      "patched" if GPUModelRunner._model_forward is not fwd0 else "untouched",
      getattr(Attention.__init__, "__wrapped__", None) is init0, sorted(STATE.roles))
"""


@pytest.mark.vllm
def test_disabled_plugin_changes_nothing() -> None:
    r = run_py(_PROBE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[:2] == ["untouched", "untouched"]


@pytest.mark.slow
@pytest.mark.vllm
def test_enabled_plugin_patches_once_even_if_loaded_twice() -> None:
    r = run_py(_PROBE, env={"ATTNPROF_ENABLED": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.split()
    # Patched, and the patch wraps vLLM's original directly: no double wrapping.
    assert out[:3] == ["patched", "patched", "True"], r.stdout


@pytest.mark.slow
def test_bad_setting_fails_startup_with_one_clear_line() -> None:
    r = run_py("from attnprof.host.vllm import register; register()",
               env={"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "abc"})
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines == ["attnprof: invalid configuration: ATTNPROF_SAMPLE_RATE='abc' is not a number"]


def test_bad_setting_fails_even_when_disabled_flag_is_bad() -> None:
    r = run_py("from attnprof.host.vllm import register; register()",
               env={"ATTNPROF_ENABLED": "perhaps"})
    assert r.returncode != 0 and "ATTNPROF_ENABLED" in r.stderr
    assert "Traceback" not in r.stderr


_BUCKETS = """
import os, sys
from types import SimpleNamespace
from attnprof.host.vllm import runtime
from attnprof.host.vllm.stat_logger import AttnProfStatLogger
cfg = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096, model="m"))
for endpoint in ("", sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:9/v1/metrics"):
    runtime.STATE = runtime.State()
    if endpoint:
        os.environ["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = endpoint
    logger = AttnProfStatLogger(cfg)
    print(bool(endpoint), [int(b) for b in logger.requests.buckets[:6]])
    runtime.STATE.hub.stop(final_flush=False)
"""


@pytest.mark.vllm
def test_exponential_otlp_histograms_change_the_bounds_only_when_otlp_is_on() -> None:
    r = run_py(_BUCKETS, env={"ATTNPROF_ENABLED": "1", "ATTNPROF_OTLP_HISTOGRAM": "exponential",
                              "OTEL_METRIC_EXPORT_TIMEOUT": "200"})
    assert r.returncode == 0, r.stderr[-2000:]
    off, on = r.stdout.strip().splitlines()[-2:]
    assert off == "False [1, 2, 5, 10, 20, 50]"  # /metrics keeps its 1-2-5 bounds
    assert on == "True [0, 1, 2, 4, 8, 16]"  # powers of two (and 0): OTLP converts exactly
