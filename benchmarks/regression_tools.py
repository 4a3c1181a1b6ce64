"""Costs of the regression and trace tools (issue 9), so the docs quote measurements:

- ``armed``: a sampled step's extra cost while a live trace is armed (30 fake layers through
  the real step hook and layer wrappers), against the same steps unarmed; per step and per
  layer, median of paired repeats with a bootstrap 95% interval;
- ``offline``: ``attnprof diff`` of two 30-layer snapshots (2 phases, 64 calls each), the
  Chrome trace of 100 steps x 30 layers (bytes, ms), the live activation map of 30 layers x
  3 phases (PNG and SVG bytes, ms) and one TensorBoard poll of the same snapshot (scalars,
  bytes, ms);
- ``live`` (``--live``, ~1.5 min): ``GET /attnprof/trace?steps=8`` on a real vLLM server (the
  tiny test model, sample rate 1) under traffic: latency and body size over repeated requests.

Writes benchmarks/results/regression_tools.json and docs/regression-tools.md.
Run: ``.venv/bin/python benchmarks/regression_tools.py [--live]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.* fakes and the tiny model builder

OUT = ROOT / "benchmarks" / "results" / "regression_tools.json"
DOC = ROOT / "docs" / "regression-tools.md"
LAYERS = 30


def _ci(xs: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float, float]:
    """Median and a percentile-bootstrap 95% interval of the median."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _timed(fn: Any, repeats: int = 7) -> tuple[float, float, float]:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


# ----- armed vs unarmed sampled steps -----
def bench_armed(steps: int = 400, repeats: int = 15) -> dict[str, Any]:
    from tests.unit.aggregate.test_aggregate import _capture, _Layer, _run_steps

    from attnprof.host.vllm import worker_rpc

    cap = _capture(1.0)
    layers = [_Layer(i) for i in range(LAYERS)]
    for lay in layers:
        cap.wrap_layer(lay)
    _run_steps(cap, layers, 200)  # warm

    def run(armed: bool) -> float:
        if armed:
            worker_rpc.trace_arm(cap, steps + 10, 600.0, "bench")
        t0 = time.perf_counter()
        _run_steps(cap, layers, steps)
        dt = (time.perf_counter() - t0) / steps
        worker_rpc.trace_take(cap, "bench")
        return dt

    deltas, base = [], []
    for i in range(repeats):  # paired and alternated: drift hits both arms alike
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {a: run(a) for a in order}
        deltas.append(got[True] - got[False])
        base.append(got[False])
    cap.state.hub.stop(final_flush=False)
    med, lo, hi = _ci(deltas)
    return {"layers": LAYERS, "steps_per_arm": steps, "repeats": repeats,
            "sampled_step_us_unarmed": round(statistics.median(base) * 1e6, 1),
            "armed_extra_us_per_step": round(med * 1e6, 2),
            "armed_extra_us_per_step_ci95": [round(lo * 1e6, 2), round(hi * 1e6, 2)],
            "armed_extra_us_per_layer": round(med * 1e6 / LAYERS, 3)}


# ----- offline tools -----
def _snapshot(seed: int, slow: float = 1.0) -> Any:
    from attnprof.contracts.snapshot import (
        LayerProfile,
        PhaseStats,
        SamplerStats,
        Snapshot,
        StepPhaseStats,
        WorkerSnapshot,
    )

    rng = random.Random(seed)
    lays = []
    for i in range(LAYERS):
        phases = {}
        for ph, base in (("prefill", 4e-4), ("decode", 1e-4), ("mixed", 2e-4)):
            times = [slow * base * rng.uniform(0.9, 1.1) for _ in range(64)]
            phases[ph] = PhaseStats(calls=1000, time_s=sum(times) * 1000 / 64,
                                    mean_time_s=sum(times) / 64, recent_time_s=times)
        lays.append(LayerProfile(
            name=f"model.layers.{i}.self_attn.attn", index=i, backend="CPU_ATTN",
            impl="CPUAttentionBackendImpl", num_heads=9, num_kv_heads=3, head_size=64,
            head_size_v=64, sliding_window=None, dtype="bfloat16", kv_cache_dtype="auto",
            fused=True, kv_cache_bytes=1 << 22, kernel="cpu_attention_with_kv_cache[amx]",
            phases=phases))
    w = WorkerSnapshot(pid=1, process="VllmWorker-0", layers=lays,
                       steps={p: StepPhaseStats(steps=1000, model_time_s=20.0,
                                                attention_time_s=2.0, attention_share=0.1)
                              for p in ("prefill", "decode", "mixed")},
                       sampler=SamplerStats(seen=20000, sampled=1000, effective_rate=0.05))
    return Snapshot(time=1.0e9 + seed, model="smollm2", enabled=True, workers=[w])


def bench_offline() -> dict[str, Any]:
    from attnprof.aggregate.trace import LayerRange, StepTrace
    from attnprof.analyze.diff import compare
    from attnprof.exporters import activation_map as amap
    from attnprof.exporters import tensorboard as tb
    from attnprof.exporters.chrome_trace import TraceProcess, render_steps

    base, new = _snapshot(1), _snapshot(2, slow=1.3)
    t_diff = _timed(lambda: compare(base, new), repeats=5)

    steps = []
    t = 1_700_000_000_000_000_000
    for k in range(100):
        ranges = [LayerRange(i, "CPU_ATTN", "cpu_attention_with_kv_cache[amx]",
                             1000 + i * 20_000, 15_000, "decode", 8, 8, 512, 300.0)
                  for i in range(LAYERS)]
        steps.append(StepTrace(t + k * 1_000_000, 700_000, "decode", "sampled", 0.05, 8, 8,
                               512, 300.0, ranges))
    proc = [TraceProcess(pid=1, name="VllmWorker-0", steps=steps)]
    body = json.dumps(render_steps(proc)).encode()
    t_trace = _timed(lambda: json.dumps(render_steps(proc)))

    grid = amap.grid_from_snapshot(base)
    png, svg = amap.render(grid, "png"), amap.render(grid, "svg")
    t_png = _timed(lambda: amap.render(grid, "png"), repeats=5)
    t_svg = _timed(lambda: amap.render(grid, "svg"), repeats=5)

    scalars = tb.snapshot_scalars(base, 0)
    with tempfile.TemporaryDirectory() as d:
        w = tb.EventWriter(Path(d))
        w.add_scalars(scalars, 1.0)
        w.flush()
        size0 = sum(p.stat().st_size for p in Path(d).iterdir())
        t0 = time.perf_counter()
        polls = 20
        for k in range(1, polls + 1):
            w.add_scalars(tb.snapshot_scalars(base, k), 1.0 + k)
            w.flush()
        t_poll = (time.perf_counter() - t0) / polls
        per_poll = (sum(p.stat().st_size for p in Path(d).iterdir()) - size0) / polls
        w.close()

    def ms(x: tuple[float, float, float]) -> list[float]:
        return [round(v * 1e3, 2) for v in x]

    return {
        "diff_30_layers_3_phases_ms_median_min_max": ms(t_diff),
        "chrome_trace_100_steps_x_30_layers": {"bytes": len(body),
                                               "render_ms_median_min_max": ms(t_trace)},
        "activation_map_30x3": {"png_bytes": len(png), "svg_bytes": len(svg),
                                "png_ms_median_min_max": ms(t_png),
                                "svg_ms_median_min_max": ms(t_svg)},
        "tensorboard_poll_30_layers": {"scalars": len(scalars),
                                       "bytes_per_poll": round(per_poll),
                                       "ms_per_poll": round(t_poll * 1e3, 2),
                                       "mb_per_hour_at_10s": round(per_poll * 360 / 1e6, 2)},
    }


# ----- live trace route -----
def bench_live(requests: int = 15) -> dict[str, Any]:
    from tests.conftest import build_tiny_model, free_port

    from attnprof.tools.http import post_json
    from attnprof.tools.server import VllmServer

    key = "bench-key"
    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(Path(d) / "tiny")
        srv = VllmServer(model, port=free_port(), served_name="tiny", eager=True,
                         log=Path(d) / "vllm.log",
                         env={"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_API_KEY": key,
                              "ATTNPROF_OVERHEAD_BUDGET": "1.0"},
                         extra_args=["--max-model-len", "512", "--kv-cache-memory-bytes",
                                     str(64 << 20), "--no-enable-prefix-caching"])
        srv.start()
        stop = threading.Event()
        try:
            srv.wait_ready(timeout=300)

            def traffic() -> None:
                body = {"model": "tiny", "prompt": "attention window cache " * 4,
                        "max_tokens": 32, "ignore_eos": True, "temperature": 0.0}
                while not stop.is_set():
                    post_json(srv.base_url + "/v1/completions", body, timeout=120)

            movers = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
            for m in movers:
                m.start()
            time.sleep(2.0)
            lat, sizes = [], []
            for _ in range(requests):
                req = urllib.request.Request(srv.base_url + "/attnprof/trace?steps=8",
                                             headers={"Authorization": f"Bearer {key}"})
                t0 = time.perf_counter()
                with urllib.request.urlopen(req, timeout=60) as r:
                    body = r.read()
                lat.append(time.perf_counter() - t0)
                sizes.append(len(body))
        finally:
            stop.set()
            srv.stop()
    med, lo, hi = _ci(lat)
    return {"requests": requests, "steps": 8, "model": "tiny (2 layers), sample rate 1",
            "latency_ms_median": round(med * 1e3, 1),
            "latency_ms_median_ci95": [round(lo * 1e3, 1), round(hi * 1e3, 1)],
            "latency_ms_min_max": [round(min(lat) * 1e3, 1), round(max(lat) * 1e3, 1)],
            "bytes_median": int(statistics.median(sizes))}


def markdown(res: dict[str, Any]) -> str:
    a, o = res["armed"], res["offline"]
    lines = [
        "# Costs of the regression and trace tools",
        "",
        "Written by `benchmarks/regression_tools.py` (results in",
        f"`benchmarks/results/regression_tools.json`); {res['machine']}, 2 cores, "
        f"{res['date']}. `make bench` reruns it without the live part; "
        "`python benchmarks/regression_tools.py --live` includes it (~1.5 min).",
        "",
        "| what | measured |",
        "|---|---|",
        f"| a sampled step with a live trace armed, {a['layers']} layers | "
        f"+{a['armed_extra_us_per_step']} us per step (95% CI "
        f"{a['armed_extra_us_per_step_ci95'][0]} to {a['armed_extra_us_per_step_ci95'][1]}; "
        f"{a['armed_extra_us_per_layer']} us per layer) over "
        f"{a['sampled_step_us_unarmed']} us unarmed; unsampled steps never look |",
        f"| `attnprof diff` of two 30-layer snapshots (3 phases, 64 calls each) | "
        f"{o['diff_30_layers_3_phases_ms_median_min_max'][0]} ms (min-max "
        f"{o['diff_30_layers_3_phases_ms_median_min_max'][1]}-"
        f"{o['diff_30_layers_3_phases_ms_median_min_max'][2]}) |",
    ]
    c = o["chrome_trace_100_steps_x_30_layers"]
    lines.append(f"| Chrome trace of 100 steps x 30 layers | {c['bytes'] / 1e3:.0f} kB, "
                 f"{c['render_ms_median_min_max'][0]} ms to render and encode |")
    m = o["activation_map_30x3"]
    lines.append(f"| live activation map, 30 layers x 3 phases | PNG {m['png_bytes'] / 1e3:.0f}"
                 f" kB in {m['png_ms_median_min_max'][0]} ms; SVG {m['svg_bytes'] / 1e3:.0f} kB "
                 f"in {m['svg_ms_median_min_max'][0]} ms |")
    t = o["tensorboard_poll_30_layers"]
    lines.append(f"| one `attnprof tensorboard` poll, 30 layers x 3 phases | {t['scalars']} "
                 f"scalars, {t['bytes_per_poll'] / 1e3:.1f} kB, {t['ms_per_poll']} ms; "
                 f"{t['mb_per_hour_at_10s']} MB an hour at `--interval 10s` |")
    live = res.get("live")
    if live:
        lines.append(
            f"| `GET /attnprof/trace?steps=8`, {live['model']}, under traffic | "
            f"{live['latency_ms_median']} ms median (95% CI {live['latency_ms_median_ci95'][0]}"
            f"-{live['latency_ms_median_ci95'][1]}; min-max {live['latency_ms_min_max'][0]}-"
            f"{live['latency_ms_min_max'][1]}) over {live['requests']} requests, "
            f"{live['bytes_median'] / 1e3:.1f} kB |")
    lines += ["", "Noise: 2 shared CPU cores; the armed cost is the median of paired, "
              "alternating repeats (the interval is over repeats), the other times the "
              "median and range of 5-7 runs.", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--live", action="store_true", help="also time the live trace route")
    args = p.parse_args()
    from attnprof.tools.provenance import hardware

    res: dict[str, Any] = {"machine": f"{platform.machine()}, {hardware().cpu}",
                           "python": platform.python_version(),
                           "date": time.strftime("%Y-%m-%d")}
    res["armed"] = bench_armed()
    res["offline"] = bench_offline()
    if args.live:
        res["live"] = bench_live()
    elif OUT.exists():  # keep the last live measurement
        res["live"] = json.loads(OUT.read_text()).get("live")
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    DOC.write_text(markdown(res))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
