"""The roofline's pure parts: the GPU spec table and probe/spec ratio, placing phases against
the roofs, the KV bytes read out of snapshot layers, the exported samples and pictures."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from attnprof.aggregate.layers import BatchShape, LayerCall, LayerInfo, StepRecord, WorkerAggregates
from attnprof.analyze import roofline
from attnprof.contracts.roofline import MemoryProbe, ProbeKernel, Roofline
from attnprof.facts import gpu_specs


@pytest.mark.parametrize(("nvml", "part", "bw_tb"), [
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1.555),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 1.555),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 2.039),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 1.935),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35),
    ("NVIDIA H100 PCIe", "H100 PCIe", 2.0),
    ("NVIDIA H200", "H200", 4.8),
    ("NVIDIA L4", "L4", 0.3),
    ("NVIDIA L40S", "L40S", 0.864),
    ("NVIDIA A10G", "A10G", 0.6),
])
def test_gpu_spec_lookup_by_nvml_name(nvml: str, part: str, bw_tb: float) -> None:
    spec = gpu_specs.lookup(nvml)
    assert spec is not None and spec.name == part
    assert spec.bandwidth_bytes_per_second == pytest.approx(bw_tb * 1e12)
    assert spec.bf16_flops_per_second > 1e14 and spec.source


@pytest.mark.parametrize("nvml", [None, "", "NVIDIA L40", "NVIDIA H100 NVL", "NVIDIA H200 NVL",
                                  "NVIDIA A100", "Tesla T4", "NVIDIA GeForce RTX 4090"])
def test_unknown_or_ambiguous_parts_get_no_spec(nvml: str | None) -> None:
    assert gpu_specs.lookup(nvml) is None


def test_spec_ratio_and_check() -> None:
    from attnprof.tools.probe import spec_check

    assert gpu_specs.spec_ratio(4.0e12, 4.8e12) == pytest.approx(0.8333, rel=1e-3)
    assert gpu_specs.spec_ratio(None, 4.8e12) is None
    assert gpu_specs.spec_ratio(1.0, 0.0) is None
    chk = spec_check("NVIDIA H200", 4.2e12, 700e12, "bfloat16")
    assert chk is not None and chk.part == "H200"
    assert chk.bandwidth_ratio == pytest.approx(4.2 / 4.8)
    assert chk.flops_ratio == pytest.approx(700 / 989.5)
    # The table holds the 16-bit tensor peak: an fp32 GEMM is not compared with it.
    fp32 = spec_check("NVIDIA H200", 4.2e12, 50e12, "float32")
    assert fp32 is not None and fp32.flops_ratio is None
    assert spec_check("NVIDIA GeForce RTX 4090", 1e12, 1e14, "bfloat16") is None


def test_place_puts_each_phase_on_its_side_of_the_ridge() -> None:
    # Ridge = 100 FLOP/B. Decode: 1 FLOP/B, reads 1 GB of KV in 0.5 s at 10 GB/s peak ->
    # 20% of bandwidth; prefill: 500 FLOP/B, 1 TFLOP in 2 s at 1 TFLOP/s peak -> 50%.
    work = [roofline.PhaseWork("decode", 4, 0.25, 0.6e9, 0.6e9, 0.5e9, layer=0),
            roofline.PhaseWork("decode", 4, 0.25, 0.4e9, 0.4e9, 0.5e9, layer=1),
            roofline.PhaseWork("prefill", 1, 2.0, 1e12, 2e9, 1e9, layer=0)]
    rl = roofline.place(work, peak_bw=10e9, peak_flops=1e12)
    assert rl.ridge_flops_per_byte == pytest.approx(100.0)
    d, p = rl.phases["decode"], rl.phases["prefill"]
    assert d.calls == 8 and d.time_s == pytest.approx(0.5)
    assert d.kv_bytes_per_second == pytest.approx(2e9)
    assert d.bandwidth_utilization == pytest.approx(0.2)
    assert d.intensity_flops_per_byte == pytest.approx(1.0) and d.bound == "memory"
    assert p.compute_utilization == pytest.approx(0.5)
    assert p.intensity_flops_per_byte == pytest.approx(500.0) and p.bound == "compute"
    assert [(x.phase, x.layer) for x in rl.layers] == [("decode", 0), ("decode", 1),
                                                       ("prefill", 0)]
    assert rl.layers[0].bandwidth_utilization == pytest.approx(0.2)
    # No time: no rates, never a division by zero.
    z = roofline.place_point(roofline.PhaseWork("decode", 0, 0.0, 0, 0, 0), 1e9, 1e12)
    assert z.bandwidth_utilization is None and z.intensity_flops_per_byte is None


def _info(index: int, kv_dtype: str = "auto") -> LayerInfo:
    return LayerInfo(name=f"model.layers.{index}.attn", index=index, backend="CPU_ATTN",
                     impl="CPUAttentionBackendImpl", num_heads=9, num_kv_heads=3, head_size=64,
                     head_size_v=64, sliding_window=None, dtype="bfloat16",
                     kv_cache_dtype=kv_dtype, fused=True)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_kv_bytes_from_snapshot_layers_are_the_analytic_kv_reads(kv_dtype: str) -> None:
    """A decode step of 3 requests over 100, 200, 700 keys: the KV part of the snapshot's
    bytes is exactly K + V over 1000 keys x 3 KV heads x 64 x the KV element size."""
    aggs = WorkerAggregates()
    info = _info(0, kv_dtype)
    aggs.add_layer(info)
    shape = BatchShape(phase="decode", num_tokens=3, pairs=1000, kv_tokens=1000, num_reqs=3,
                       max_seq_len=700)
    for _ in range(5):
        aggs.record_step(StepRecord("sampled", 0.01, [LayerCall(info, shape, 0.002)]))
    (work,) = roofline.work_from_layers(aggs.layer_profiles())
    elem = 2 if kv_dtype == "auto" else 1
    assert work.kv_bytes == 5 * 1000 * 3 * 128 * elem
    assert work.calls == 5 and work.time_s == pytest.approx(0.01)
    same = roofline.call_work("decode", 0, 1, 1, 1000, 9, 3, 64, 64, "bfloat16", 0.002,
                              kv_cache_dtype=kv_dtype)
    assert same.kv_bytes == 1000 * 3 * 128 * elem
    assert same.flops == 2 * 9 * 128 * 1000


def _probe() -> MemoryProbe:
    k = [ProbeKernel("copy", 10e9, 9e9, 11e9, 5, 1 << 28),
         ProbeKernel("triad", 11e9, 10e9, 12e9, 5, 1 << 28),
         ProbeKernel("matmul", 1e12, 0.9e12, 1.1e12, 5, 1024)]
    return MemoryProbe(device="cpu", bandwidth_bytes_per_second=11e9,
                       matmul_flops_per_second=1e12, kernels=k, threads=2)


def test_contracts_round_trip() -> None:
    p = _probe()
    assert MemoryProbe.from_json(p.to_json()) == p
    assert p.to_json()["schema_version"] == "attnprof.probe/1.0"
    assert p.kernels[0].spread == pytest.approx(0.2)
    rl = roofline.roofline([roofline.PhaseWork("decode", 1, 1.0, 1e9, 1e9, 1e9, 0)], p)
    assert Roofline.from_json(rl.to_json()) == rl


def test_roofline_samples_use_catalog_labels() -> None:
    from attnprof.exporters.samples import Sample, roofline_samples

    p = _probe()
    rl = roofline.roofline([roofline.PhaseWork("decode", 1, 1.0, 2e9, 1e9, 5.5e9, 0),
                            roofline.PhaseWork("prefill", 1, 1.0, 4e11, 1e9, 1e8, 0)], p)
    got = {(x.name, x.labels): x.value for x in roofline_samples("m", p, rl)
           if isinstance(x, Sample)}
    assert got[("attnprof_decode_attention_bandwidth_utilization_ratio",
                (("model", "m"),))] == pytest.approx(0.5)
    assert got[("attnprof_prefill_attention_compute_utilization_ratio",
                (("model", "m"),))] == pytest.approx(0.4)
    assert got[("attnprof_arithmetic_intensity_flops_per_byte",
                (("model", "m"), ("phase", "decode")))] == pytest.approx(2.0)
    assert got[("attnprof_memory_bandwidth_peak_bytes_per_second",
                (("model", "m"),))] == 11e9
    assert roofline_samples("m", None, None) == []


@pytest.mark.slow
def test_render_png_and_svg() -> None:
    pytest.importorskip("matplotlib")
    from attnprof.exporters.roofline_plot import render, summary_lines

    rl = roofline.roofline([roofline.PhaseWork("decode", 1, 1.0, 2e9, 1e9, 0.9e9, 0),
                            roofline.PhaseWork("prefill", 1, 1.0, 4e11, 1e9, 1e8, 0)], _probe())
    png, svg = render(rl, "png"), render(rl, "svg")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and b"<svg" in svg
    assert b"decode (all layers)" in svg and render(rl, "svg") == svg  # deterministic
    lines = summary_lines(rl)
    assert lines[0].startswith("decode: 2 FLOP/B (memory-bound side")
    assert "8% of peak bandwidth" in lines[0]
    assert "40% of matmul peak" in lines[1]


def test_start_background_never_raises_and_skips_without_a_model() -> None:
    from attnprof.tools.probe import start_background

    got: list[object] = []
    errs: list[Exception] = []
    t = start_background(got.append, errs.append, dtype=lambda: None, delay_s=0, wait_s=0)
    t.join(5)
    assert not got and not errs  # no model dtype: no probe at all
    t = start_background(got.append, errs.append, dtype=lambda: "not-a-dtype", delay_s=0)
    t.join(120)  # imports torch first
    assert not got and len(errs) == 1 and isinstance(errs[0], ValueError)
    assert threading.current_thread().is_alive()


def test_probe_switch_is_read_from_the_environment() -> None:
    from attnprof.config import Config

    assert Config.from_env({}).probe is False
    assert Config.from_env({"ATTNPROF_PROBE": "1"}).probe is True


def test_causal_prefill_counts_only_the_pairs_the_mask_keeps() -> None:
    dense = roofline.call_work("prefill", 0, 2, 4, 4, 9, 3, 64, 64, "float32", 1.0)
    causal = roofline.call_work("prefill", 0, 2, 4, 4, 9, 3, 64, 64, "float32", 1.0,
                                causal=True)
    per_pair = 2 * 9 * 128
    assert dense.flops == 2 * 16 * per_pair
    assert causal.flops == 2 * (4 + 3 + 2 + 1) * per_pair  # query i sees keys 0..i
    # A chunk of 2 queries after 6 cached keys: 7 + 8 pairs.
    chunk = roofline.call_work("prefill", 0, 1, 2, 8, 9, 3, 64, 64, "float32", 1.0, causal=True)
    assert chunk.flops == 15 * per_pair
    assert causal.bytes == dense.bytes  # the mask changes the work, not the bytes read


@pytest.mark.parametrize(("argv", "msg"), [
    (["probe", "--dtype", "int8"], "--dtype"),
    (["probe", "--repeats", "0"], "--repeats"),
    (["probe", "--array-mib", "0"], "--array-mib"),
    (["snapshot", "--url", "http://127.0.0.1:9", "--roofline", "/etc/hostname/r.png"],
     "--roofline"),
])
def test_cli_inputs_fail_in_one_line(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    from attnprof.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnprof: error:") and msg in err and err.count("\n") == 1


def test_snapshot_without_a_probe_says_how_to_get_one(tmp_path: Path) -> None:
    from attnprof.cli import CliError
    from attnprof.cli.snapshot import _write_roofline
    from attnprof.contracts.snapshot import Snapshot

    snap = Snapshot(time=0.0, model="m", enabled=True).to_json()
    with pytest.raises(CliError, match="ATTNPROF_PROBE=1"):
        _write_roofline(snap, tmp_path / "r.png", "http://x")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_a_point_above_a_roof_says_why() -> None:
    from attnprof.exporters.roofline_plot import summary_lines

    rl = roofline.place([roofline.PhaseWork("prefill", 1, 1.0, 2e12, 1e9, 1e8, 0),
                         roofline.PhaseWork("decode", 1, 1.0, 1e9, 1e9, 5e8, 0)],
                        peak_bw=10e9, peak_flops=1e12, note="live")
    assert rl.phases["prefill"].compute_utilization == pytest.approx(2.0)
    assert rl.note == "live; " + roofline.OVER_ROOF.format("prefill")
    lines = summary_lines(rl)
    assert lines[1].endswith("(above the roof: see note)") and lines[-1].startswith("note: ")
    assert not lines[0].endswith("see note)")  # decode at 5%: no caveat
    ok = roofline.place([roofline.PhaseWork("decode", 1, 1.0, 1e9, 1e9, 5e8, 0)], 10e9, 1e12)
    assert ok.note == "" and len(summary_lines(ok)) == 1


def _md(q_lens: list[int], seq_lens: list[int]) -> object:
    """vLLM attention metadata as batch_shape reads it."""
    from types import SimpleNamespace

    import torch

    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return SimpleNamespace(num_actual_tokens=starts[-1], max_query_len=max(q_lens),
                           seq_lens=torch.tensor(seq_lens),
                           query_start_loc=torch.tensor(starts))


def _live_work(info: LayerInfo, md: object) -> roofline.PhaseWork:
    """One sampled step of ``info`` over ``md`` through the live capture's own path."""
    from attnprof.capture.vllm.args import batch_shape

    aggs = WorkerAggregates()
    aggs.add_layer(info)
    aggs.record_step(StepRecord("sampled", 0.01, [LayerCall(info, batch_shape(md), 0.002)]))
    (work,) = roofline.work_from_layers(aggs.layer_profiles())
    return work


def _windowed(index: int, window: int | None) -> LayerInfo:
    info = _info(index)
    info.sliding_window = window
    return info


def test_windowed_decode_reads_only_its_window() -> None:
    """Mistral/Gemma-2 style: a decode over 100, 30 and 700 keys on a layer with a 64-token
    window reads 64 + 30 + 64 keys (the full layer 830), and computes as many pairs; so
    its bandwidth utilisation is not inflated by 830/158."""
    md = _md([1, 1, 1], [100, 30, 700])
    per_key = 3 * 128 * 2  # KV heads x (D + Dv) x bf16
    per_pair = 2 * 9 * 128
    full = _live_work(_windowed(0, None), md)
    win = _live_work(_windowed(1, 64), md)
    assert full.kv_bytes == 830 * per_key and full.flops == 830 * per_pair
    assert win.kv_bytes == 158 * per_key and win.flops == 158 * per_pair
    same = roofline.call_work("decode", 1, 1, 1, 700, 9, 3, 64, 64, "bfloat16", 0.002,
                              causal=True, sliding_window=64)
    assert same.kv_bytes == 64 * per_key and same.flops == 64 * per_pair


def test_live_prefill_counts_causal_and_windowed_pairs() -> None:
    """A chunk of 2 new queries at context 8 (positions 6, 7: 7 + 8 pairs, not 2 x 8) and a
    whole 5-token prompt (1+..+5 = 15, not 25), live as in attnprof profile; with a 4-token
    window the chunk's queries see 4 keys each and need keys 3..7 (5), the prompt 1+2+3+4+4."""
    md = _md([2, 5], [8, 5])
    per_pair, per_key = 2 * 9 * 128, 3 * 128 * 2
    full = _live_work(_windowed(0, None), md)
    assert full.flops == (15 + 15) * per_pair and full.kv_bytes == 13 * per_key
    win = _live_work(_windowed(0, 4), md)
    assert win.flops == (8 + 14) * per_pair and win.kv_bytes == (5 + 5) * per_key
    chunk = roofline.call_work("prefill", 0, 1, 2, 8, 9, 3, 64, 64, "bfloat16", 1.0,
                               causal=True, sliding_window=4)
    assert chunk.flops == 8 * per_pair and chunk.kv_bytes == 5 * per_key


def test_causal_window_counts_match_the_mask() -> None:
    """The closed forms against counting the causal sliding-window mask itself."""
    import numpy as np

    from attnprof.aggregate.layers import causal_pairs, keys_read

    rng = np.random.default_rng(0)
    for _ in range(200):
        s = int(rng.integers(1, 60))
        q = int(rng.integers(1, s + 1))
        w = None if rng.random() < 0.2 else int(rng.integers(1, 70))
        pos = np.arange(s)
        keep = pos[None, :] <= pos[:, None]
        if w is not None:
            keep &= pos[None, :] > pos[:, None] - w
        rows = keep[s - q:]
        assert causal_pairs(q, s, w) == int(rows.sum())
        assert keys_read(q, s, w) == int(rows.any(axis=0).sum())


@pytest.mark.slow
def test_profile_roofline_counts_each_layers_own_mask() -> None:
    """attnprof profile's roofline: a decoder layer's sliding window and causal mask limit its
    pairs, while encoder self-attention and cross-attention are dense (brute-force counts)."""
    from attnprof.capture.transformers_records import CallRecord
    from attnprof.tools.profile_run import _roofline

    def rec(layer: int, q: int, kv: int, window: int | None, stack: str | None,
            kind: str = "self") -> CallRecord:
        return CallRecord(layer_idx=layer, impl="sdpa", phase="prefill", mask="none", batch=1,
                          q_len=q, kv_len=kv, num_heads=4, num_kv_heads=2, head_dim=16,
                          head_dim_v=16, dtype="float32", sliding_window=window, dropout=0.0,
                          elapsed_s=1e-3, kernel="k", fused=True, tags={"run": "time@64"},
                          stack=stack, kind=kind)

    L, w = 64, 16
    records = [rec(0, L, L, None, "encoder"), rec(1, L, L, w, "decoder"),
               rec(2, L, L, None, "decoder"), rec(3, 8, L, None, "decoder", "cross")]
    rl, _, err = _roofline(records, "float32", causal=True)
    assert not err and rl is not None
    flops = {p.layer: p.flops for p in rl.layers if p.phase == "prefill"}
    windowed = sum(min(i + 1, w) for i in range(L))
    causal_pairs = sum(i + 1 for i in range(L))
    assert flops[1] / flops[0] == pytest.approx(windowed / L**2)
    assert flops[2] / flops[0] == pytest.approx(causal_pairs / L**2)
    assert flops[3] / flops[0] == pytest.approx(8 * L / L**2)


@pytest.mark.slow
def test_probe_waits_for_an_idle_worker() -> None:
    """The live probe runs at the worker's first idle gap (a probe under load reads low), and
    says so in its note when the worker never idles."""
    from attnprof.tools.probe import wait_idle

    busy_until = [0]

    def steps_busy_then_idle() -> int:  # 5 more steps, then none
        busy_until[0] += 1
        return min(busy_until[0], 5)

    assert wait_idle(steps_busy_then_idle, idle_s=0.05, max_wait_s=5.0, poll_s=0.01)
    assert busy_until[0] > 5  # it kept watching while steps were still coming
    ticks = iter(range(10**9))
    assert not wait_idle(lambda: next(ticks), idle_s=0.05, max_wait_s=0.3, poll_s=0.01)


@pytest.mark.slow
def test_profile_roofline_keeps_encoder_decoder_and_cross_sites_apart() -> None:
    """An encoder-decoder numbers each stack from 0: encoder.L0, decoder.L0 and
    decoder.L0.cross are three roofline points with their own work, not one merged layer 0."""
    from attnprof.capture.transformers_records import CallRecord
    from attnprof.tools.profile_run import _roofline

    def rec(layer: int, q: int, kv: int, stack: str, kind: str = "self",
            elapsed: float = 1e-3) -> CallRecord:
        return CallRecord(layer_idx=layer, impl="sdpa", phase="prefill", mask="none", batch=1,
                          q_len=q, kv_len=kv, num_heads=4, num_kv_heads=4, head_dim=16,
                          head_dim_v=16, dtype="float32", sliding_window=None, dropout=0.0,
                          elapsed_s=elapsed, kernel="k", fused=True, tags={"run": "time@32"},
                          stack=stack, kind=kind)

    records = [rec(0, 32, 32, "encoder"), rec(1, 32, 32, "encoder"),
               rec(0, 8, 8, "decoder", elapsed=2e-3), rec(0, 8, 32, "decoder", "cross",
                                                          elapsed=3e-3),
               rec(1, 8, 8, "decoder"), rec(1, 8, 32, "decoder", "cross")]
    rl, _, err = _roofline(records, "float32", causal=False)
    assert not err and rl is not None
    pts = [p for p in rl.layers if p.phase == "prefill"]
    assert [p.site for p in pts] == ["encoder.L0", "decoder.L0", "decoder.L0.cross",
                                     "encoder.L1", "decoder.L1", "decoder.L1.cross"]
    by = {p.site: p for p in pts}
    assert all(p.calls == 1 for p in pts)
    assert [by[s].time_s for s in ("encoder.L0", "decoder.L0", "decoder.L0.cross")] == \
        pytest.approx([1e-3, 2e-3, 3e-3])
    # Dense pairs each: 32x32 encoder, 8x8 decoder self, 8x32 cross.
    assert by["decoder.L0"].flops / by["encoder.L0"].flops == pytest.approx(64 / 1024)
    assert by["decoder.L0.cross"].flops / by["encoder.L0"].flops == pytest.approx(256 / 1024)
    assert by["encoder.L0"].layer == 0 and by["decoder.L0.cross"].layer == 0
    # The phase total still sums every site.
    assert rl.phases["prefill"].calls == 6


def test_live_roofline_stays_keyed_by_layer() -> None:
    """Live (vLLM) work has no site label: one point per (layer, phase), as before."""
    work = [roofline.PhaseWork("decode", 2, 0.5, 1e9, 1e9, 5e8, layer=1),
            roofline.PhaseWork("decode", 2, 0.5, 1e9, 1e9, 5e8, layer=1),
            roofline.PhaseWork("decode", 1, 0.5, 1e9, 1e9, 5e8, layer=0)]
    rl = roofline.place(work, 10e9, 1e12)
    assert [(p.layer, p.site, p.calls) for p in rl.layers] == [(0, None, 1), (1, None, 4)]


def _anon_huge_kib() -> int:
    import re

    text = Path("/proc/self/smaps_rollup").read_text()
    m = re.search(r"AnonHugePages:\s+(\d+)", text)
    assert m is not None
    return int(m.group(1))


def _thp_available() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return (Path("/proc/self/smaps_rollup").exists() and thp.exists()
            and "[never]" not in thp.read_text(errors="replace"))


@pytest.mark.slow
@pytest.mark.skipif(not _thp_available(), reason="needs Linux transparent huge pages")
def test_probe_arrays_live_in_huge_pages() -> None:
    """The probe's CPU arrays ask for 2 MiB pages (torch's own allocator does not, and on
    4 KiB pages a read stream was 12-23% slower: the peak would read low)."""
    import gc

    torch = pytest.importorskip("torch")
    from attnprof.tools.probe import HUGE_PAGE, cpu_array

    gc.collect()
    before = _anon_huge_kib()
    a = cpu_array(16 << 20, 1.5)  # 64 MiB
    got = _anon_huge_kib() - before
    assert a.dtype == torch.float32 and a.numel() == 16 << 20
    assert float(a[0]) == float(a[-1]) == 1.5 and a.data_ptr() % HUGE_PAGE == 0
    assert got >= 32 << 10, f"only {got} KiB of 64 MiB in huge pages"
    z = cpu_array(5, 0.0)
    assert z.tolist() == [0.0] * 5
    del a
    gc.collect()
    assert _anon_huge_kib() - before < 32 << 10  # the mapping goes with the tensor
