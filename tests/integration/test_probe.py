"""The bandwidth probe and decode-attention bandwidth utilisation against independent
measurements (issue 13's goal: within 10%).

These are measurements on a shared CPU box whose bandwidth moves by 2x minute to minute, so
every comparison is *paired*: each round measures attnprof's side and the independent side
back to back, and the assertion is on the median of the rounds' ratios. Speed itself is not
asserted here (benchmarks/roofline.py records it)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

torch = pytest.importorskip("torch")

GOAL = 0.10
ROUNDS = 9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _numpy_copy_bandwidth(nbytes: int, threads: int) -> Callable[[], float]:
    """A copy of ``nbytes`` with numpy, split over ``threads`` threads (numpy's copy releases
    the GIL): glibc's memcpy, which above its non-temporal threshold (a fraction of the
    LLC; our 256 MiB pieces are above it) stores around the cache, so no write-allocate
    read: bytes moved = bytes read + bytes written. Another mechanism than the probe's torch
    kernels, measuring the same thing: how many bytes DRAM moves per second."""
    import numpy as np

    src: Any = np.ones(nbytes // 4, dtype=np.float32)
    dst: Any = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if p.size]
    pool = ThreadPoolExecutor(max_workers=threads)

    def one(b: tuple[int, int]) -> None:
        np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]])

    def run() -> float:
        return float(2 * src.nbytes) / _timed(lambda: list(pool.map(one, bounds)))

    run()  # first touch
    return run


def _kv_sized_peak(nbytes: int) -> Callable[[], float]:
    """The independent side's peak: plain torch calls on arrays of exactly ``nbytes`` (the
    KV's bytes), estimated as the probe estimates its own: the better of one copy and one
    triad per round, the bytes that move counted the same way (write-allocate on CPU). A
    single copy against the probe's best of two kernels is a biased pair (the maximum of
    two noisy samples sits above one sample), whatever the load."""
    from attnprof.tools.probe import write_allocates

    wa = 1 if write_allocates("cpu") else 0
    n = max(1, nbytes // 4)
    a, b, c = torch.empty(n), torch.ones(n), torch.full((n,), 2.0)
    kernels: tuple[tuple[int, Callable[[], Any]], ...] = (
        ((2 + wa) * 4 * n, lambda: a.copy_(b)),
        ((3 + wa) * 4 * n, lambda: torch.add(b, c, alpha=3.0, out=a)))
    for _moved, fn in kernels:
        fn()  # first touch

    def run() -> float:
        return max(moved / _timed(fn) for moved, fn in kernels)

    return run


def test_probe_copy_matches_an_independent_numpy_copy() -> None:
    from attnprof.tools.probe import default_array_bytes, probe

    size = default_array_bytes("cpu")
    numpy_bw = _numpy_copy_bandwidth(size, torch.get_num_threads())
    ratios = []
    for _ in range(ROUNDS):
        p = probe(device="cpu", repeats=1, matmul_n=64)
        assert p.kernels[0].name == "copy" and p.kernels[0].size == size
        ratios.append(p.bandwidth_bytes_per_second / numpy_bw())
    med = statistics.median(ratios)
    assert abs(med - 1) < GOAL, f"probe / numpy copy = {med:.3f} (rounds {ratios})"


def test_probe_reports_matmul_and_spread() -> None:
    from attnprof.tools.probe import probe

    p = probe(device="cpu", repeats=3, array_bytes=64 << 20, matmul_n=256)
    names = [k.name for k in p.kernels]
    assert names == ["copy", "triad", "matmul"]
    mm = p.kernels[2]
    assert mm.runs == 3 and mm.low <= mm.median <= mm.high
    assert p.matmul_flops_per_second == mm.high > 0  # the best run, as STREAM reports
    assert p.bandwidth_bytes_per_second == max(p.kernels[0].high, p.kernels[1].high)
    assert p.threads == torch.get_num_threads() and p.spec is None
    with pytest.raises(ValueError):
        probe(device="tpu")
    # Any spelling of the dtype is recorded as torch names it (what layer facts carry and
    # what the GPU spec check tests for 16-bit).
    bf = probe(device="cpu", dtype="bf16", repeats=1, array_bytes=1 << 20, matmul_n=32)
    assert bf.kernels[2].dtype == "bfloat16"


def _decode_model(kv_len: int) -> tuple[Any, Any, Callable[[], None]]:
    """One Llama layer with SmolLM2's attention shape (9 query / 3 KV heads x 64, fp32), a
    KV cache of ``kv_len`` tokens, and a decode step that leaves the cache as it found it."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=64, num_hidden_layers=1, vocab_size=128,
                      max_position_embeddings=kv_len + 16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    cache = DynamicCache(config=cfg)
    cache.update(torch.randn(1, 3, kv_len, 64), torch.randn(1, 3, kv_len, 64), 0)
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
    attention function on those tensors (no attnprof) / the peak of plain torch copy and
    triad on tensors of exactly those bytes, estimated as the probe estimates its own
    (:func:`_kv_sized_peak`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnprof.analyze import roofline
    from attnprof.capture.transformers import instrument
    from attnprof.tools.probe import probe

    model, _cache, step = _decode_model(kv_len)
    events: list[Any] = []
    prof = instrument(model, on_call=events.append, max_records=None)
    out: dict[str, Any] = {k: [] for k in ("ours", "theirs", "ratio", "captured_s",
                                           "plain_s")}
    try:
        step()
        step()
        ev = events[-1]
        kv = ev.key.nbytes + ev.value.nbytes
        kv_peak = _kv_sized_peak(kv)

        def plain() -> None:
            sdpa_attention_forward(ev.module, ev.query, ev.key, ev.value, ev.attention_mask,
                                   **ev.kwargs)

        for _ in range(rounds):
            peak = probe(device="cpu", repeats=1, matmul_n=64)
            n0 = len(prof.records)
            step()
            (rec,) = prof.records[n0:]
            assert rec.phase == "decode" and rec.kv_len == kv_len + 1
            w = roofline.call_work(rec.phase, rec.layer_idx, rec.batch, rec.q_len, rec.kv_len,
                                   rec.num_heads, rec.num_kv_heads, rec.head_dim,
                                   rec.head_dim_v, rec.dtype, rec.elapsed_s)
            ours = roofline.roofline([w], peak).phases["decode"].bandwidth_utilization
            assert ours is not None
            t_plain = _timed(plain)  # right after the captured call: the same context
            theirs = kv / t_plain / kv_peak()
            out["ours"].append(ours)
            out["theirs"].append(theirs)
            out["ratio"].append(ours / theirs)
            out["captured_s"].append(rec.elapsed_s)
            out["plain_s"].append(t_plain)
    finally:
        prof.uninstrument()
    out.update(kv_len=kv_len, kv_bytes=kv, analytic_kv_bytes=w.kv_bytes)
    return out


def test_decode_bandwidth_utilisation_matches_an_independent_measurement() -> None:
    """attnprof's decode utilisation within 10% of the independent one (:func:`decode_rounds`),
    median of paired rounds. 64K tokens = 96 MiB of KV: above the cache a core gets here, as
    a real KV cache is (benchmarks/roofline.py records 12 and 384 MiB too)."""
    res = decode_rounds(1 << 16)
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
    from attnprof.tools.server import http_post_json
    from tests.conftest import get_snapshot, metric_value, poll_metrics, running_tiny_server

    env = {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_SEED": "0", "ATTNPROF_PROBE": "1",
           "ATTNPROF_OVERHEAD_BUDGET": "1.0", "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0",
           "ATTNPROF_ADVICE_INTERVAL_S": "0"}
    with running_tiny_server(tiny_model, tmp_path_factory, "probe-vllm.log", env,
                             max_model_len=512, kv_bytes=64 << 20) as srv:
        url = srv.base_url
        http_post_json(url + "/v1/completions", {
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
        assert [k.name for k in probes[0].kernels] == ["copy", "triad", "matmul"]
        assert probes[0].kernels[2].dtype == snap.workers[0].layers[0].dtype
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
