"""Tensor parallelism on vLLM-CPU (two ranks, one core each): both ranks sample the same
steps without ATTNPROF_SEED (a seed shared through vLLM's instance id), even while the
overhead budget throttles them (the first rank's scale, announced ahead and applied by both at
the same step); each answers with its own placement, and the API server's merge puts each
rank's heads at their global index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_py

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_PROLOGUE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=32 << 20, seed=0, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    prompts = ["the model request server " * 12,
               "cache token layer attention window head latency " * 8]
"""
"""Two tensor-parallel ranks on vLLM's real multiprocess executor, and two prompts."""

_SCRIPT = _PROLOGUE + r"""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    # The pull swaps each rank's head statistics; the deltas are serialized off the engine's
    # path and collected by a second, tiny RPC.
    polls = llm.collective_rpc("attnprof_poll")
    deltas = [[] for _ in polls]
    deadline = time.monotonic() + 120  # polled to a deadline, not a count of polls: load-proof
    while True:
        got = llm.collective_rpc("attnprof_head_stats")
        for i, g in enumerate(got):
            deltas[i] += [d["data"] for d in g["head_stats"]["deltas"]]
        if not any(g["head_stats"]["pending"] for g in got) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    from attnprof.aggregate.head_strata import HeadStatsStrata
    from attnprof.host.vllm.live_view import LiveView
    view = LiveView(None)
    parts, part_requests = [], []
    for p, ds in zip(polls, deltas):
        assert len(ds) == 1, len(ds)
        part = HeadStatsStrata.from_bytes(ds[0]).total()
        parts.append(part.queries.tolist())
        part_requests.append(part.requests.tolist())
        view._merge_delta(p, ds[0])
    acc = view.head_stats.total()
    # Then hundreds of steps under a budget nobody can meet: the first rank throttles, and
    # both ranks must still decide the same steps.
    long_sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for _ in range(8):
        llm.generate(prompts, long_sp, use_tqdm=False)
    final = llm.collective_rpc("attnprof_poll", args=(False,))
    print("RESULT " + json.dumps({
        "ranks": [p["rank"] for p in polls], "parts": parts, "part_requests": part_requests,
        "sampler": [p["snapshot"]["sampler"] for p in polls],
        "throttled": [p["snapshot"]["sampler"] for p in final],
        "merged": {"shape": [acc.num_layers, acc.num_kv_heads, acc.group_size],
                   "queries": acc.queries.tolist(), "requests": acc.requests.tolist()}}))
"""


def test_two_tp_ranks_sample_alike_and_merge_by_global_head(tiny_model: Path) -> None:
    r = run_py(_SCRIPT.replace("sys.argv[1]", repr(str(tiny_model))),
               env={"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "0.3",
                    "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_HEAD_STATS_MIN_TOKENS": "8",
                    # a budget no sampled step can meet: throttling forced
                    "ATTNPROF_OVERHEAD_BUDGET": "0.0001",
                    # every prefill (>= 20 tokens) sampled, so both ranks fold the prompts
                    "ATTNPROF_LONG_PREFILL_RATE": "1.0", "ATTNPROF_LONG_PREFILL_TOKENS": "20",
                    # two CPU workers on a one-NUMA-node machine: one core each
                    "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    res: dict[str, Any] = json.loads(line[0][len("RESULT "):])
    assert [(x["tp_rank"], x["tp_size"]) for x in res["ranks"]] == [(0, 2), (1, 2)]
    s0, s1 = res["sampler"]
    # No ATTNPROF_SEED, rate 0.3: the same steps sampled on both ranks, and not all of them.
    assert s0["seen"] == s1["seen"] and 0 < s0["sampled"] == s1["sampled"] < s0["seen"]
    assert s0["sampled_long"] == s1["sampled_long"]
    # The tiny Llama has 4 query / 2 KV heads: 2 / 1 per rank, placed at 0-1 and 2-3.
    assert res["merged"]["shape"] == [2, 2, 2]
    q = res["merged"]["queries"]
    p0, p1 = res["parts"]
    for layer in range(2):
        assert q[layer][:2] == p0[layer] and q[layer][2:] == p1[layer]
        assert min(q[layer]) > 0
    # Each prompt counted once, not once per rank.
    r0, r1 = res["part_requests"]
    assert r0 == r1 and min(r0) > 0 and res["merged"]["requests"] == r0
    # Throttled: the first rank's budget cut the rate (several times), announced ahead; the
    # second applied the same scales at the same steps, and both sampled the same steps.
    t0, t1 = res["throttled"]
    assert (t0["sync"], t1["sync"]) == ("leader", "follower")
    assert t0["throttles"] >= 1 and t0["rate_changes"], t0
    assert t0["rate_changes"] == t1["rate_changes"] and t0["throttles"] == t1["throttles"]
    assert t0["late_changes"] == t1["late_changes"] == 0
    assert t0["step_index"] == t1["step_index"] > 400
    assert t0["seen"] == t1["seen"] and t0["sampled"] == t1["sampled"] < t0["seen"]
    assert t0["sampled_long"] == t1["sampled_long"]
    assert t0["decisions_digest"] == t1["decisions_digest"] != ""  # the same set of steps
    assert t0["effective_rate"] == t1["effective_rate"] < 0.3


_RPC_SCRIPT = _PROLOGUE + r"""
    from attnprof.capture.vllm.rank_sync import carried_rates
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # What the API server's LiveView does: each poll carries the scales the last one
    # reported, and the executor delivers it to both ranks between the same two steps.
    known = {}
    for _ in range(14):
        llm.generate(prompts, sp, use_tqdm=False)
        answers = llm.collective_rpc("attnprof_poll", args=(False, None, dict(known) or None))
        carried_rates(answers, known)
    final = llm.collective_rpc("attnprof_poll", args=(False,))
    print("RESULT " + json.dumps({"sampler": [p["snapshot"]["sampler"] for p in final],
                                  "known": known}))
"""


def test_two_tp_ranks_without_the_file_sample_alike_through_the_poll(
        tiny_model: Path) -> None:
    """Issue 30, point 3: the file channel switched off (as for ranks on two nodes), the
    leader's scale rides the poll through vLLM's real executor and both ranks apply it at
    that RPC: identical sampled steps while the budget throttles."""
    r = run_py(_RPC_SCRIPT.replace("sys.argv[1]", repr(str(tiny_model))),
               env={"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "0.3",
                    "ATTNPROF_RANK_SYNC": "rpc", "ATTNPROF_OVERHEAD_BUDGET": "0.0001",
                    "ATTNPROF_HEAD_STATS_RATE": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
               timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    res: dict[str, Any] = json.loads(line[0][len("RESULT "):])
    t0, t1 = res["sampler"]
    assert (t0["sync"], t1["sync"]) == ("leader", "follower")
    assert list(res["known"]) == ["0:0"]  # the group's leader reported
    assert t0["throttles"] >= 1 and t0["rate_changes"], t0
    assert t0["rate_changes"] == t1["rate_changes"] and t0["throttles"] == t1["throttles"]
    assert t0["unsynced"] == t1["unsynced"] == 0
    assert t0["step_index"] == t1["step_index"] and t0["seen"] == t1["seen"]
    assert t0["sampled"] == t1["sampled"] < t0["seen"]
    assert t0["decisions_digest"] == t1["decisions_digest"] != ""
    assert t0["effective_rate"] == t1["effective_rate"] < 0.3


def test_two_tp_ranks_without_the_file_sample_alike_through_a_real_api_server(
        tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same, end to end: vLLM's real OpenAI server at TP=2 with the file channel off;
    the scales travel through attnprof's own LiveView (snapshot GETs and its rate-sync polls)
    and vLLM's AsyncLLM utility calls, not through a script's model of them."""
    from attnprof.tools.http import post_json
    from tests.conftest import TINY_API_KEY, get_snapshot, running_tiny_server

    env = {"ATTNPROF_SAMPLE_RATE": "0.3", "ATTNPROF_RANK_SYNC": "rpc",
           "ATTNPROF_OVERHEAD_BUDGET": "0.0001", "ATTNPROF_HEAD_STATS_RATE": "0",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1", "ATTNPROF_API_KEY": TINY_API_KEY,
           "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0"}
    with running_tiny_server(tiny_model, tmp_path_factory, "tp-rpc.log", env,
                             max_model_len=256, kv_bytes=32 << 20,
                             extra_args=("--tensor-parallel-size", "2")) as srv:
        for _ in range(12):
            post_json(srv.base_url + "/v1/completions",
                      {"model": "tiny", "prompt": "cache token layer attention " * 8,
                       "max_tokens": 32, "ignore_eos": True, "temperature": 0.0}, timeout=300)
            get_snapshot(srv.base_url, timeout=120)  # a poll: carries the leader's scale
        t0, t1 = (w["sampler"] for w in get_snapshot(srv.base_url, timeout=120)["workers"])
    assert {t0["sync"], t1["sync"]} == {"leader", "follower"}
    assert t0["throttles"] + t1["throttles"] >= 1 and t0["rate_changes"], (t0, t1)
    assert t0["rate_changes"] == t1["rate_changes"]
    assert t0["unsynced"] == t1["unsynced"] == 0
    assert t0["step_index"] == t1["step_index"] and t0["sampled"] == t1["sampled"]
    assert t0["decisions_digest"] == t1["decisions_digest"] != ""
