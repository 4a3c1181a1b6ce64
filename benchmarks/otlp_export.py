"""Cost of the OTLP sink: ``export()`` (the hub thread's call), a full flush (collect, encode,
send to a loopback receiver) per transport, memory over many flushes, and a failing flush.

Samples are a worker's realistic set (layers x phases x 5 attention counters, steps, self
metrics) plus the API server's 3 request histograms. Writes benchmarks/results/otlp_export.json.
Run: ``.venv/bin/python benchmarks/otlp_export.py``.
"""

from __future__ import annotations

import gc
import json
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.otlp_receiver import OtlpReceiver, free_port

from attnprof.aggregate.histogram import BucketHistogram, log_buckets
from attnprof.exporters import catalog as cat
from attnprof.exporters.otlp import OtlpConfig, OtlpSink
from attnprof.exporters.samples import HistogramSample, MetricSample, Sample

OUT = Path(__file__).parent / "results" / "otlp_export.json"


def make_samples(layers: int, step: int) -> list[MetricSample]:
    out: list[MetricSample] = []
    for layer in range(layers):
        for phase in ("prefill", "decode", "mixed"):
            base = (("model", "m"), ("layer", str(layer)))
            for m in (cat.ATTENTION_CALLS_TOTAL, cat.ATTENTION_TIME_SECONDS_TOTAL):
                out.append(Sample(m, (*base, ("backend", "FLASH_ATTN"), ("phase", phase)),
                                  float(step * (layer + 1))))
            for m in (cat.ATTENTION_FLOPS_TOTAL, cat.ATTENTION_BYTES_TOTAL,
                      cat.ATTENTION_TOKENS_TOTAL):
                out.append(Sample(m, (*base, ("phase", phase)), float(step * 1000 + layer)))
    for outcome in ("sampled", "sampled_long", "unsampled", "blind"):
        out.append(Sample(cat.STEPS_TOTAL, (("model", "m"), ("outcome", outcome)),
                          float(step)))
    out.append(Sample(cat.SAMPLE_RATE_RATIO, (("model", "m"),), 0.05))
    h = BucketHistogram(log_buckets(32768))
    for i in range(step % 50 + 1):
        h.observe(17 * i + 1)
    for m in (cat.REQUEST_CONTEXT_TOKENS, cat.REQUEST_PROMPT_TOKENS, cat.REQUEST_GENERATION_TOKENS):
        out.append(HistogramSample(m, (("model", "m"),), h.state()))
    return out


def rss_now_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def bench(protocol: str, layers: int, flushes: int = 100) -> dict[str, Any]:
    with OtlpReceiver(protocol) as r:
        sink = OtlpSink(OtlpConfig(r.endpoint, protocol, interval_s=3600, timeout_s=2),
                        role="worker")
        batches = [make_samples(layers, i) for i in range(flushes + 10)]
        n = len(batches[0])
        for b in batches[:10]:  # warm-up: provider, instruments, connection
            sink.export(b)
            sink.force_flush()
        exp, flush = [], []
        rss0 = rss_now_kib()
        for b in batches[10:]:
            t0 = time.perf_counter()
            sink.export(b)
            t1 = time.perf_counter()
            assert sink.force_flush()
            t2 = time.perf_counter()
            exp.append(t1 - t0)
            flush.append(t2 - t1)
            size = r.requests[-1].ByteSize()
            r.requests.clear()  # the receiver lives in this process: keep its memory flat
        rss1 = rss_now_kib()
        # Python-heap growth over another 50 flushes, traced separately (tracemalloc is slow).
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for b in batches[10:60]:
            sink.export(b)
            assert sink.force_flush()
            r.requests.clear()
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before,
                                                                               "filename"))
        tracemalloc.stop()
        sink.shutdown()
    return {"protocol": protocol, "samples": n, "flushes": flushes,
            "export_median_us": round(statistics.median(exp) * 1e6, 1),
            "export_p99_us": round(statistics.quantiles(exp, n=100, method="inclusive")[98] * 1e6,
                                   1),
            "flush_median_ms": round(statistics.median(flush) * 1e3, 2),
            "flush_max_ms": round(max(flush) * 1e3, 2),
            "request_bytes": size, "heap_growth_bytes_50_flushes": grown,
            "rss_growth_kib_100_flushes": rss1 - rss0}


def failing(protocol: str, flushes: int = 20) -> dict[str, Any]:
    port = free_port()
    ep = f"http://127.0.0.1:{port}" + ("" if protocol == "grpc" else "/v1/metrics")
    sink = OtlpSink(OtlpConfig(ep, protocol, interval_s=3600, timeout_s=1.0), role="worker")
    b = make_samples(32, 1)
    times = []
    for _ in range(flushes):
        sink.export(b)
        t = time.perf_counter()
        sink.force_flush()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    sink.shutdown()
    return {"protocol": protocol, "endpoint": "down", "failures": sink.failures,
            "failing_flush_median_ms": round(statistics.median(times) * 1e3, 2),
            "shutdown_ms": round((time.perf_counter() - t) * 1e3, 1)}


def main() -> None:
    results = {"python": sys.version.split()[0], "machine": platform.machine(), "runs": [],
               "failing": []}
    for protocol in ("http/protobuf", "grpc"):
        for layers in (32, 320):
            results["runs"].append(bench(protocol, layers))
        results["failing"].append(failing(protocol))
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
