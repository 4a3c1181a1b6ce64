"""Cost of head statistics on a 4K prompt served in 512-token chunks (goal: <= 5% of the
sampled prefill), on the real vLLM-CPU engine.

SmolLM2 (float32, CPU_ATTN, eager, one process) serves one 4096-token prompt with
``max_num_batched_tokens=512``: eight chunked-prefill steps, every one sampled (sample rate 1,
head-statistics rate 1, no budget throttle). Each chunk's sampled queries (the whole prompt's
plan restricted to the chunk) are recomputed against all earlier keys, read back from the
paged KV cache. Two measures, on runs alternating statistics on and off:

* ``fraction_of_prefill``: the worker's own accounting (``head_stats_cost``): seconds spent in
  statistics over the sampled steps' model time without them, over the "on" runs;
* ``wall_ratio``: the prompt's wall time with statistics over without (medians), minus 1;
* ``cpu``: the same two in CPU time (the engine thread's ``thread_time`` inside the
  statistics; the process's ``process_time`` per prompt, statistics on and off). On a
  shared, oversubscribed machine wall time mostly measures the wait for a core; with
  ``OMP_NUM_THREADS=1`` (no OpenMP spin-waits) CPU time is the work done, and holds.

Writes benchmarks/results/head_stats_chunked.json. Run:
``.venv/bin/python benchmarks/head_stats_chunked.py [--tokens 4096] [--chunk 512]
[--repeats 3]`` (about 2-4 minutes on 2 cores; under ``flock /tmp/attnprof-vllm.lock`` on a
shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "head_stats_chunked.json"


_CPU = [0.0]  # engine-thread CPU seconds inside the head statistics


def _count_cpu() -> None:
    """Add each layer call's statistics CPU time to ``_CPU`` (class level, before the
    engine is built; nothing in attnprof changes)."""
    from attnprof.capture.vllm import hooks

    orig = hooks.Capture._head_stats

    def head_stats(self: Any, *a: Any) -> Any:
        t0 = time.thread_time()
        try:
            return orig(self, *a)
        finally:
            _CPU[0] += time.thread_time() - t0

    setattr(hooks.Capture, "_head_stats", head_stats)  # noqa: B010


def _cost(llm: Any) -> dict[str, float]:
    (ans,) = llm.collective_rpc("attnprof_poll", args=(False,))
    return dict(ans["snapshot"]["head_stats_cost"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    os.environ.update({"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "1.0",
                       "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                       "VLLM_NO_USAGE_STATS": "1"})
    _count_cpu()
    import torch
    from vllm import LLM, SamplingParams

    import attnprof
    from attnprof.tools import models
    from attnprof.tools.replay import default_prompts

    path = models.verified_model_dir()
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True,
              max_model_len=args.tokens + 64, max_num_batched_tokens=args.chunk,
              max_num_seqs=1, enable_prefix_caching=False, enable_chunked_prefill=True,
              kv_cache_memory_bytes=1 << 30, seed=0)
    tok = llm.get_tokenizer()
    ids = tok(default_prompts(tok, (args.tokens + 64,))[0])["input_ids"][:args.tokens]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    cpu: dict[str, list[float]] = {"on": [], "off": []}

    def serve(arm: str = "") -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        if arm:
            cpu[arm].append(time.process_time() - c0)
        return time.perf_counter() - t0

    serve()  # warm-up (allocator, oneDNN primitives, the first sampled prompt's set-up)
    load_before = os.getloadavg()
    on: list[float] = []
    off: list[float] = []
    spent = {"time_s": 0.0, "prefill_time_s": 0.0, "steps": 0.0, "queries": 0.0}
    for _ in range(args.repeats):
        llm.collective_rpc("attnprof_set_sampling", args=(None, 0.0))
        off.append(serve("off"))
        llm.collective_rpc("attnprof_set_sampling", args=(None, 1.0))
        before = _cost(llm)
        stats_cpu0 = _CPU[0]
        on.append(serve("on"))
        after = _cost(llm)
        cpu.setdefault("stats", []).append(_CPU[0] - stats_cpu0)
        for k in spent:
            spent[k] += float(after[k]) - float(before[k])
    results = {
        "model": "SmolLM2-135M-Instruct float32, vLLM-CPU (CPU_ATTN, eager, one process)",
        "prompt_tokens": len(ids), "chunk_tokens": args.chunk,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "repeats": args.repeats,
        # the statistics are many small torch ops: on a shared, oversubscribed machine each
        # waits on OpenMP threads descheduled elsewhere, so the load is part of the result
        "load_average_1m": {"before": round(load_before[0], 2),
                            "after": round(os.getloadavg()[0], 2),
                            "cpus": os.cpu_count()},
        "sampled_steps_per_prompt": spent["steps"] / args.repeats,
        "sampled_queries_per_prompt": spent["queries"] / args.repeats,
        "statistics_s_per_prompt": round(spent["time_s"] / args.repeats, 4),
        "prefill_model_s_per_prompt": round(spent["prefill_time_s"] / args.repeats, 4),
        "fraction_of_prefill": round(spent["time_s"] / max(spent["prefill_time_s"], 1e-9), 4),
        "wall_s": {"statistics_on": [round(x, 4) for x in on],
                   "statistics_off": [round(x, 4) for x in off]},
        "wall_ratio": round(statistics.median(on) / statistics.median(off) - 1.0, 4),
        "cpu": {
            "statistics_s": [round(x, 4) for x in cpu["stats"]],
            "prompt_s": {"statistics_on": [round(x, 4) for x in cpu["on"]],
                         "statistics_off": [round(x, 4) for x in cpu["off"]]},
            # the statistics' CPU time over the prompt's CPU time without them (medians)
            "fraction_of_prefill": round(statistics.median(cpu["stats"])
                                         / statistics.median(cpu["off"]), 4),
            "ratio": round(statistics.median(cpu["on"]) / statistics.median(cpu["off"]) - 1, 4),
        },
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "code": str(Path(attnprof.__file__).parent),
        "goal": "statistics <= 5% of the sampled prefill (4K prompt, 512-token chunks)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
