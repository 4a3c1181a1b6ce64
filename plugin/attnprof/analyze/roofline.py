"""Attention on the roofline: per phase (and per layer), the achieved bytes/s and FLOP/s
against the probed memory bandwidth and matmul peak, and the arithmetic intensity.

Pure: typed inputs (the snapshot's :class:`LayerProfile` s, or the profile's per-call shapes,
and a :class:`MemoryProbe`), a typed :class:`Roofline` out. FLOPs and bytes are attnprof's
analytic counts (:func:`attnprof.aggregate.layers.attention_flops` / ``attention_bytes``),
live and in ``attnprof profile`` alike: only the (query, key) pairs a layer's causal mask and
sliding window keep, and only the key positions its window needs (a windowed decode reads
min(seq, w) keys per request, not seq).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from attnprof.aggregate.layers import (
    BatchShape,
    LayerInfo,
    attention_bytes,
    attention_flops,
    kv_read_bytes,
    q_o_bytes,
)
from attnprof.contracts.roofline import MemoryProbe, Roofline, RooflinePoint
from attnprof.contracts.snapshot import LayerProfile, WorkerSnapshot

__all__ = ["OVER_ROOF", "PhaseWork", "call_work", "from_snapshot", "place", "place_point",
           "roofline", "work_from_layers"]


@dataclass
class PhaseWork:
    """Timed attention work of one phase (``layer`` None: summed over layers). ``site``: the
    attention site's label (:func:`attnprof.facts.shape.layer_label`: ``decoder.L0.cross``)
    when the layer index alone is ambiguous (encoder-decoder models); None: the layer."""

    phase: str
    calls: int
    time_s: float
    flops: float
    bytes: float
    kv_bytes: float
    layer: int | None = None
    site: str | None = None

    def add(self, other: PhaseWork) -> None:
        self.calls += other.calls
        self.time_s += other.time_s
        self.flops += other.flops
        self.bytes += other.bytes
        self.kv_bytes += other.kv_bytes


def work_from_layers(layers: Iterable[LayerProfile]) -> list[PhaseWork]:
    """Per (layer, phase) work from snapshot layers. The KV part of the bytes is what is left
    when Q and O (:func:`attnprof.aggregate.layers.q_o_bytes` of the query tokens) are taken
    out: the capture's counts already read only each layer's window."""
    out = []
    for lay in layers:
        for phase, st in lay.phases.items():
            if st.calls <= 0:
                continue
            kv = max(0, st.bytes - q_o_bytes(lay, st.tokens))
            out.append(PhaseWork(phase, st.calls, st.time_s, float(st.flops), float(st.bytes),
                                 float(kv), lay.index))
    return out


def call_work(phase: str, layer: int, batch: int, q_len: int, kv_len: int, num_heads: int,
              num_kv_heads: int, head_dim: int, head_dim_v: int, dtype: str, time_s: float,
              kv_cache_dtype: str = "auto", causal: bool = False,
              sliding_window: int | None = None, site: str | None = None) -> PhaseWork:
    """One attention call's work by the same analytic counts the live capture uses
    (``batch`` sequences of ``q_len`` queries over ``kv_len`` keys each). ``causal``: the
    queries are the last ``q_len`` positions under a causal mask (optionally a
    ``sliding_window``), and only the (query, key) pairs the mask keeps and the keys it needs
    are counted (the useful work; a kernel that skips masked blocks does about this).
    ``site``: the call's site label, which keeps encoder, decoder and cross-attention layers
    of one index apart."""
    info = LayerInfo(name="", index=layer, backend="", impl="", num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_dim, head_size_v=head_dim_v,
                     sliding_window=sliding_window, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     fused=True, attn_type="decoder" if causal else "encoder_only")
    shape = BatchShape.of((q_len,) * batch, (kv_len,) * batch, batch * q_len)
    return PhaseWork(phase, 1, time_s, float(attention_flops(info, shape)),
                     float(attention_bytes(info, shape)), float(kv_read_bytes(info, shape)),
                     layer, site)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def place_point(w: PhaseWork, peak_bw: float, peak_flops: float) -> RooflinePoint:
    """One piece of work against the roofs (rates None when it took no time)."""
    intensity = _ratio(w.flops, w.bytes)
    flops_s = _ratio(w.flops, w.time_s)
    kv_s = _ratio(w.kv_bytes, w.time_s)
    ridge = peak_flops / peak_bw if peak_bw > 0 else float("inf")
    return RooflinePoint(
        phase=w.phase, layer=w.layer, site=w.site, calls=w.calls, time_s=w.time_s, flops=w.flops,
        bytes=w.bytes, kv_bytes=w.kv_bytes, intensity_flops_per_byte=intensity,
        achieved_flops_per_second=flops_s, achieved_bytes_per_second=_ratio(w.bytes, w.time_s),
        kv_bytes_per_second=kv_s,
        bandwidth_utilization=None if kv_s is None else _ratio(kv_s, peak_bw),
        compute_utilization=None if flops_s is None else _ratio(flops_s, peak_flops),
        bound="memory" if intensity is not None and intensity < ridge else "compute")


def _site_rank(site: str) -> int:
    """Model order among the sites of one layer index: encoder, decoder self, cross."""
    return (0 if site.startswith("encoder.") else 2 if site.endswith(".cross") else 1)


OVER_ROOF = ("{} above the probed roof: the probe ran under other load (live on a CPU it "
             "shares the cores with serving) or the KV fits a cache")


def place(work: Iterable[PhaseWork], peak_bw: float, peak_flops: float,
          device: str = "cpu", note: str = "") -> Roofline:
    """Every (site, phase) piece and each phase's total (summed bytes over summed time:
    the time-weighted rate) against the roofs. A site is the layer index, and the site label
    where the work has one (an encoder-decoder's encoder.L0, decoder.L0 and decoder.L0.cross
    are three points)."""
    items = list(work)
    totals: dict[str, PhaseWork] = {}
    by_site: dict[tuple[int | None, str, str], PhaseWork] = {}
    for w in items:
        t = totals.setdefault(w.phase, PhaseWork(w.phase, 0, 0.0, 0.0, 0.0, 0.0))
        t.add(w)
        lw = by_site.setdefault((w.layer, w.site or "", w.phase),
                                PhaseWork(w.phase, 0, 0.0, 0.0, 0.0, 0.0, w.layer, w.site))
        lw.add(w)
    keyed = sorted(((p, lay, _site_rank(site), site), w)
                   for (lay, site, p), w in by_site.items() if lay is not None)
    layers = [place_point(w, peak_bw, peak_flops) for _k, w in keyed]
    phases = {p: place_point(w, peak_bw, peak_flops) for p, w in sorted(totals.items())}
    over = [p for p, pt in phases.items() if max(pt.bandwidth_utilization or 0.0,
                                                 pt.compute_utilization or 0.0) > 1.0]
    if over:  # say why a point can sit above a roof rather than let it pass as a fact
        note = "; ".join(x for x in (note, OVER_ROOF.format(", ".join(over))) if x)
    return Roofline(
        peak_bandwidth_bytes_per_second=peak_bw, peak_flops_per_second=peak_flops,
        ridge_flops_per_byte=peak_flops / peak_bw if peak_bw > 0 else 0.0,
        phases=phases, layers=layers, device=device, note=note)


def roofline(work: Iterable[PhaseWork], probe: MemoryProbe, note: str = "") -> Roofline:
    """:func:`place` against what ``probe`` measured."""
    return place(work, probe.bandwidth_bytes_per_second, probe.matmul_flops_per_second,
                 probe.device, note)


def from_snapshot(workers: Iterable[WorkerSnapshot]) -> Roofline | None:
    """The roofline of a live server: the first worker that has probed, its own layers
    (tensor-parallel ranks time the same layers, so one rank's are the model's); None when
    no worker has probed (``ATTNPROF_PROBE`` off, or the probe still to run)."""
    for w in workers:
        if w.probe is not None:
            return roofline(work_from_layers(w.layers), w.probe,
                            f"live: worker pid {w.pid}, sampled steps")
    return None
