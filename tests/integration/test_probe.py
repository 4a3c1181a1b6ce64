"""The bandwidth probe and decode-attention bandwidth utilisation against independent
measurements (issue 13's goal: within 10%).

These are measurements on a shared CPU box whose bandwidth moves by 2x minute to minute, so
every comparison is *paired*: each round measures attnprof's side and the independent side
back to back, and the assertion is on the median of the rounds' ratios. Speed itself is not
asserted here (benchmarks/roofline.py records it)."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

torch = pytest.importorskip("torch")

GOAL = 0.10
ROUNDS = 21
"""Paired rounds per comparison. The CI box's bandwidth moves by 2x between back-to-back
runs (other tenants; the hypervisor's memory reclaim kept kswapd on a third of a core), so
single rounds range 0.5-1.7 and only the median of many is a measurement."""
REPEATS = 5
"""Runs per peak estimate on each side: a warm-up, then the best of REPEATS, the probe's own
default. Both sides are the same estimator; a single run against a single run was within
10% on an idle Xeon but 1.06-1.65 on a busier AMD EPYC, and best-of-3 medians still moved
0.98-1.09 from one test run to the next."""
STEPS = 4
"""Decode steps per round, each captured call paired with a plain one: a round's figure is
over all of them (the roofline sums bytes and time), so one call's scheduler hiccup moves
it a quarter as much."""


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _best_rate(nbytes: int, fn: Callable[[], Any]) -> float:
    """Bytes per second of ``fn`` over ``nbytes``, estimated as the probe estimates its own
    peaks: a warm-up run (page faults; torch's OpenMP threads still spinning from the other
    side's kernels), then the best of REPEATS."""
    fn()
    return max(nbytes / _timed(fn) for _ in range(REPEATS))


def _in_turn(i: int, first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Both results, ``first``'s and ``second``'s, run back to back in alternating order by
    round ``i``: neither side always runs in the other's wake (its cache state, its
    spinning threads)."""
    if i % 2:
        b = second()
        return first(), b
    a = first()
    return a, second()


def _numpy_read_bandwidth(nbytes: int, threads: int) -> Callable[[], float]:
    """A read of ``nbytes`` with numpy (the maximum of a float32 array and a bitwise or of
    the same bytes as uint64 words, the better of the two: numpy's own SIMD loops, which
    release the GIL), split over ``threads`` pinned threads: another mechanism than
    the probe's torch sum, measuring the same thing, how many bytes per second a read-only
    stream gets from DRAM. A read, not a copy: a copy's speed depends on how the library
    stores (glibc's memcpy matched the probe on the Xeon we first measured on; on the AMD
    EPYC CI later ran on it reached 29 GB/s where any read stream gets 35)."""
    import numpy as np

    n = nbytes // 4
    parts = np.array_split(np.arange(0, n, 2), threads)  # even bounds: uint64 words too
    bounds = [(int(p[0]), int(p[-1]) + 2) for p in parts if p.size]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    started = itertools.count()

    def pin() -> None:
        # One thread per CPU, as torch's OpenMP team runs (left to the scheduler, numpy's
        # max read 49 GB/s where torch's sum read 61 in one high-bandwidth run).
        if cpus:
            os.sched_setaffinity(0, {cpus[next(started) % len(cpus)]})

    pool = ThreadPoolExecutor(max_workers=threads, initializer=pin)

    def rate() -> float:
        # A fresh array each round, as the probe allocates its own each run. The best of two
        # numpy read loops (float max; bitwise or over the same bytes as uint64): a peak is
        # the best any read reaches, and the max loop alone, pinned, still ran 10% below
        # torch's sum for a whole benchmark run (0.98-1.04 with the best of the two).
        src: Any = np.ones(n, dtype=np.float32)
        words = src.view(np.uint64)
        loops = (lambda b: src[b[0]:b[1]].max(),
                 lambda b: np.bitwise_or.reduce(words[b[0] // 2:b[1] // 2]))
        return max(_best_rate(src.nbytes, lambda f=f: list(pool.map(f, bounds)))
                   for f in loops)

    return rate


def _kv_sized_peak(nbytes: int) -> Callable[[], float]:
    """The independent side's peak: plain torch reads of an array of exactly ``nbytes``
    (the KV's bytes), estimated as the probe estimates its own roof (its read loops): a
    warm-up, then the best of REPEATS. The same bytes at the same size: a KV small enough
    for a core's cache reads faster than DRAM, so the reference must not be the probe's
    larger arrays."""
    import numpy as np

    from attnprof.tools.probe import read_loops

    # numpy's allocator, not the probe's: it asks for huge pages on its own (as the probe
    # does, and as torch's allocator does not; 4 KiB pages read slower).
    def rate() -> float:  # a fresh array each round (see _numpy_read_bandwidth)
        b = torch.from_numpy(np.ones(max(1, nbytes // 4), dtype=np.float32))
        # The probe's read loops (the fastest of them): the same estimator at the KV's size.
        return max(_best_rate(b.nbytes, fn) for fn in read_loops(b))

    return rate


def probe_vs_numpy_rounds(rounds: int = ROUNDS) -> list[float]:
    """Paired rounds of the probe's bandwidth peak over an independent numpy read of arrays of
    the same size (the test's and benchmarks/roofline.py's one definition)."""
    from attnprof.tools.probe import default_array_bytes, probe

    size = default_array_bytes("cpu")
    numpy_bw = _numpy_read_bandwidth(size, torch.get_num_threads())
    ratios = []
    for i in range(rounds):
        p, theirs = _in_turn(i, lambda: probe(device="cpu", repeats=REPEATS, matmul_n=64),
                             numpy_bw)
        read = p.kernel("read")
        assert read is not None and read.size == size
        assert p.bandwidth_bytes_per_second == read.high
        ratios.append(p.bandwidth_bytes_per_second / theirs)
    return ratios


def test_probe_bandwidth_matches_an_independent_numpy_read() -> None:
    ratios = probe_vs_numpy_rounds()
    med = statistics.median(ratios)
    assert abs(med - 1) < GOAL, f"probe / numpy read = {med:.3f} (rounds {ratios})"


def test_probe_reports_matmul_and_spread() -> None:
    from attnprof.tools.probe import probe

    p = probe(device="cpu", repeats=3, array_bytes=64 << 20, matmul_n=256)
    names = [k.name for k in p.kernels]
    assert names == ["read", "copy", "triad", "matmul"]
    mm = p.kernels[3]
    assert mm.runs == 3 and mm.low <= mm.median <= mm.high
    assert p.matmul_flops_per_second == mm.high > 0  # the best run, as STREAM reports
    # The roof is the read stream's best run; copy and triad count their writes too.
    assert p.bandwidth_bytes_per_second == p.kernels[0].high
    assert p.kernel("copy") is p.kernels[1] and p.kernel("nope") is None
    assert p.threads == torch.get_num_threads() and p.spec is None
    with pytest.raises(ValueError):
        probe(device="tpu")
    # Any spelling of the dtype is recorded as torch names it (what layer facts carry and
    # what the GPU spec check tests for 16-bit).
    bf = probe(device="cpu", dtype="bf16", repeats=1, array_bytes=1 << 20, matmul_n=32)
    assert bf.kernels[3].dtype == "bfloat16"


KV_HEADS, HEAD_DIM = 3, 64
"""SmolLM2's KV shape, the decode model's (:func:`_decode_model`)."""
KV_BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 4
"""K and V in fp32."""


def _decode_model(kv_len: int) -> tuple[Any, Any, Callable[[], None]]:
    """One Llama layer with SmolLM2's attention shape (9 query / 3 KV heads x 64, fp32), a
    KV cache of ``kv_len`` tokens, and a decode step that leaves the cache as it found it.
    The cache grows by copying: each step writes the whole KV anew just before attention
    reads it (see :func:`decode_rounds` for the plain call's matching copy)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, intermediate_size=64, num_hidden_layers=1,
                      vocab_size=128,
                      max_position_embeddings=kv_len + 16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    cache = DynamicCache(config=cfg)
    cache.update(torch.randn(1, KV_HEADS, kv_len, HEAD_DIM),
                 torch.randn(1, KV_HEADS, kv_len, HEAD_DIM), 0)
    ids, pos = torch.tensor([[5]]), torch.tensor([[kv_len]])

    def step() -> None:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        cache.crop(-1)  # drop the token this step appended

    return model, cache, step


def decode_rounds(kv_len: int, rounds: int = ROUNDS) -> dict[str, Any]:
    """Paired rounds of decode-attention bandwidth utilisation at ``kv_len`` tokens of KV
    (the test's and benchmarks/roofline.py's one definition).

    attnprof's figure: the analytic KV bytes of the captured calls / the capture's time /
    the probe's peak (``roofline``'s own arithmetic). The independent one: the
    bytes of the K and V tensors the kernel actually got / a plain timing of the same
    attention function on those tensors (no attnprof) / a plain torch read of exactly those
    bytes, the roof estimated as the probe estimates its own (:func:`_kv_sized_peak`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnprof.analyze import roofline
    from attnprof.capture.transformers import instrument
    from attnprof.tools.probe import probe

    model, _cache, step = _decode_model(kv_len)
    events: deque[Any] = deque(maxlen=1)  # the last call (each holds its K and V tensors)
    prof = instrument(model, on_call=events.append, max_records=None)
    out: dict[str, Any] = {k: [] for k in ("ours", "theirs", "ratio", "captured_s",
                                           "plain_s")}
    try:
        step()
        step()
        ev = events[-1]
        kv = ev.key.nbytes + ev.value.nbytes
        kv_peak = _kv_sized_peak(kv)

        def plain() -> float:
            # The step's cache copies the whole KV right before attention reads it, leaving
            # the copy's tail in the LLC; the plain call gets the same fresh copy, untimed
            # (without it the captured call ran up to 10% faster at 192 MiB here).
            k, v = ev.key.clone(), ev.value.clone()
            return _timed(lambda: sdpa_attention_forward(ev.module, ev.query, k, v,
                                                         ev.attention_mask, **ev.kwargs))

        for r in range(rounds):
            # The two peaks back to back (the box's bandwidth moves between seconds); then
            # each captured call with a plain one (the second of two reads finds some of
            # the KV in cache: hence the alternating order).
            peak, ref_peak = _in_turn(
                r, lambda: probe(device="cpu", repeats=REPEATS, matmul_n=64), kv_peak)
            works, t_plain, captured = [], 0.0, 0.0
            for i in range(STEPS):
                n0 = len(prof.records)
                _, t = _in_turn(i, step, plain)
                t_plain += t
                (rec,) = prof.records[n0:]
                assert rec.phase == "decode" and rec.kv_len == kv_len + 1
                works.append(roofline.call_work(
                    rec.phase, rec.layer_idx, rec.batch, rec.q_len, rec.kv_len, rec.num_heads,
                    rec.num_kv_heads, rec.head_dim, rec.head_dim_v, rec.dtype, rec.elapsed_s))
                captured += rec.elapsed_s
            ours = roofline.roofline(works, peak).phases["decode"].bandwidth_utilization
            assert ours is not None
            theirs = STEPS * kv / t_plain / ref_peak
            out["ours"].append(ours)
            out["theirs"].append(theirs)
            out["ratio"].append(ours / theirs)
            out["captured_s"].append(captured / STEPS)
            out["plain_s"].append(t_plain / STEPS)
    finally:
        prof.uninstrument()
    out.update(kv_len=kv_len, kv_bytes=kv, analytic_kv_bytes=works[-1].kv_bytes)
    return out


def test_decode_bandwidth_utilisation_matches_an_independent_measurement() -> None:
    """attnprof's decode utilisation within 10% of the independent one (:func:`decode_rounds`),
    median of paired rounds, with a KV cache as large as the probe's own arrays (at least 128K
    tokens, 192 MiB): both roofs are then read at one size, past whatever cache the box has.
    A fixed 192 MiB was past the EPYC's 32 MiB L3 but not the Xeon's 480 MiB one CI moved to,
    where the ratio was 1.14 at 192 MiB (benchmarks/roofline.py records 96, 192, 384 and
    512 MiB: the ratio comes down to 1.0 from 384 MiB up)."""
    from attnprof.tools.probe import default_array_bytes

    res = decode_rounds(max(1 << 17, default_array_bytes("cpu") // KV_BYTES_PER_TOKEN))
    # the analytic count is the tensors' bytes exactly
    assert res["analytic_kv_bytes"] == res["kv_bytes"]
    med = statistics.median(res["ratio"])
    assert abs(med - 1) < GOAL, (f"attnprof / independent utilisation = {med:.3f}; "
                                 f"rounds {[round(r, 3) for r in res['ratio']]}, "
                                 f"utilisation {[round(u, 3) for u in res['ours']]}")


@pytest.mark.vllm
@pytest.mark.slow
def test_live_snapshot_and_metrics_carry_the_probe_and_roofline(
        tiny_model: Any, tmp_path_factory: pytest.TempPathFactory, tmp_path: Any) -> None:
    """ATTNPROF_PROBE=1 on a real multi-process vLLM server: the worker probes once after the
    model is built; the snapshot carries its probe and each phase on the roofline, /metrics
    the same numbers, and `attnprof snapshot --roofline` draws them."""
    from attnprof.cli import main
    from attnprof.contracts.snapshot import Snapshot
    from attnprof.tools.http import post_json
    from tests.conftest import get_snapshot, metric_value, poll_metrics, running_tiny_server

    env = {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_SEED": "0", "ATTNPROF_PROBE": "1",
           "ATTNPROF_OVERHEAD_BUDGET": "1.0", "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0",
           "ATTNPROF_ADVICE_INTERVAL_S": "0"}
    with running_tiny_server(tiny_model, tmp_path_factory, "probe-vllm.log", env,
                             max_model_len=512, kv_bytes=64 << 20) as srv:
        url = srv.base_url
        post_json(url + "/v1/completions", {
            "model": "tiny", "prompt": "hello " * 100, "max_tokens": 16, "min_tokens": 16,
            "ignore_eos": True, "temperature": 0.0}, timeout=120)
        deadline = time.monotonic() + 180
        while True:
            snap = Snapshot.from_json(get_snapshot(url, key=None))
            if snap.roofline is not None or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert snap.roofline is not None, "no worker probed within 180 s"
        probes = [w.probe for w in snap.workers if w.probe is not None]
        assert probes and probes[0].device == "cpu"
        assert [k.name for k in probes[0].kernels] == ["read", "copy", "triad", "matmul"]
        assert probes[0].kernels[3].dtype == snap.workers[0].layers[0].dtype
        rl = snap.roofline
        assert rl.peak_bandwidth_bytes_per_second == probes[0].bandwidth_bytes_per_second
        assert {"prefill", "decode"} <= set(rl.phases)
        dec = rl.phases["decode"]
        assert dec.bandwidth_utilization is not None and dec.bandwidth_utilization > 0
        text = poll_metrics(url, lambda t: "attnprof_decode_attention_bandwidth_utilization_ratio"
                            in t, timeout=10)
        peak = metric_value(text, "attnprof_memory_bandwidth_peak_bytes_per_second",
                            model="tiny")
        assert peak == pytest.approx(probes[0].bandwidth_bytes_per_second)
        util = metric_value(text, "attnprof_decode_attention_bandwidth_utilization_ratio",
                            model="tiny")
        # No traffic since the snapshot: the exported ratio is the snapshot's.
        assert util == pytest.approx(dec.bandwidth_utilization, rel=1e-6)
        inten = metric_value(text, "attnprof_arithmetic_intensity_flops_per_byte",
                             model="tiny", phase="prefill")
        assert inten == pytest.approx(rl.phases["prefill"].intensity_flops_per_byte, rel=1e-6)
        png = tmp_path / "roof.png"
        assert main(["snapshot", "--url", url, "--roofline", str(png)]) == 0
        assert png.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "roof.svg").exists()
