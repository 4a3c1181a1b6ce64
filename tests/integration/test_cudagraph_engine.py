"""Sampled steps leave full CUDA graphs inside a real vLLM-CPU engine: its model runner's own
``execute_model`` dispatches every step, with the runner's dispatcher keyed as on a GPU under
``FULL_AND_PIECEWISE`` (no graph runs on CPU: the mode each step was dispatched in is read from
vLLM's forward context). Every step attnprof samples ran outside a full graph, every step it
did not sample kept vLLM's FULL answer, and the sampled set is the one the sampler gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_py

pytestmark = pytest.mark.vllm

_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context


def rekey(worker):
    runner = worker.model_runner
    cc = runner.compilation_config
    # Decode batches of every size up to 8 replay a FULL graph on a GPU: no padding needed.
    cc.cudagraph_capture_sizes = list(range(1, 9))
    cc.max_cudagraph_capture_size = 8
    runner.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1)
    steps = []
    own = type(runner)._model_forward.__get__(runner)  # attnprof's step hook, bound

    def forward(*a, **k):
        from attnprof.host.vllm.runtime import STATE
        o = STATE.capture.aggs.outcomes
        before = o["sampled"] + o["sampled_long"]
        mode = get_forward_context().cudagraph_runtime_mode.name
        out = own(*a, **k)
        steps.append([mode, o["sampled"] + o["sampled_long"] - before,
                      int(STATE.capture.sampler.step)])
        return out

    runner._model_forward = forward
    worker._test_steps = steps
    return True


if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0, max_num_seqs=8)
    llm.collective_rpc(rekey)
    prompts = ["the model request server cache token layer"] * 4 + ["attention window"] * 3
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    (steps,) = llm.collective_rpc(lambda w: w._test_steps)
    from attnprof.host.vllm.runtime import STATE
    s = STATE.capture.sampler
    print("RESULT " + json.dumps({"steps": steps, "seed": s.seed, "rate": s.base_rate,
                                  "graphs": STATE.capture.graphs.modes,
                                  "blind": STATE.capture.aggs.outcomes["blind"]}))
"""


def test_sampled_steps_dispatched_off_full_graphs(tiny_model: Path) -> None:
    from attnprof.aggregate.sampler import STREAM_STEP, uniform

    r = run_py(_SCRIPT.replace("sys.argv[1]", repr(str(tiny_model))),
               env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ATTNPROF_ENABLED": "1",
                    "ATTNPROF_SAMPLE_RATE": "0.3", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
                    "ATTNPROF_SEED": "5", "ATTNPROF_LONG_PREFILL_RATE": "0",
                    "ATTNPROF_HEAD_STATS_RATE": "0"}, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    res: dict[str, Any] = json.loads(line[0].removeprefix("RESULT "))
    steps = res["steps"]
    decode = [(m, n, i) for m, n, i in steps if m != "NONE"]  # within the graphs' sizes
    sampled = [(m, i) for m, n, i in decode if n]
    kept = [(m, i) for m, n, i in decode if not n]
    assert len(decode) > 30 and len(sampled) > 5 and len(kept) > 5
    assert {m for m, _ in sampled} == {"PIECEWISE"}  # out of the full graph
    assert {m for m, _ in kept} == {"FULL"}  # vLLM's own answer
    # the steps sampled are the sampler's: coin of the step's index below the rate
    for _m, n, i in steps:
        assert bool(n) == (uniform(res["seed"], STREAM_STEP, i) < res["rate"])
    # every sampled step counted by the mode it ran in (a long prefill: NONE, as vLLM said)
    by_mode: dict[str, int] = {}
    for m, n, _i in steps:
        if n:
            by_mode[m] = by_mode.get(m, 0) + 1
    assert res["graphs"] == by_mode and by_mode["PIECEWISE"] == len(sampled)
    assert res["blind"] == 0
