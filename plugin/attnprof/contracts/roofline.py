"""The machine's measured peaks (``attnprof probe``, the start-up probe) and each attention
phase placed against them (a roofline). Bytes/s and FLOP/s are per second of wall time;
bandwidths count the bytes that move (read: one array read; copy: read + write; triad: two
reads + a write; on CPU copy and triad also the write-allocate read of the destination).

``attnprof.probe/1.0`` is a document of its own (``attnprof probe --json``); the snapshot
(``WorkerSnapshot.probe``, ``Snapshot.roofline``) and profile.json (``roofline``) carry it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnprof.contracts.base import Document, Record

__all__ = ["MemoryProbe", "ProbeKernel", "Roofline", "RooflinePoint", "SpecCheck"]


@dataclass
class ProbeKernel(Record):
    """One timed kernel of the probe, over ``runs`` repetitions."""

    name: str
    """read, copy, triad (bytes/s) or matmul (FLOP/s)."""
    median: float
    """Bytes/s (read, copy, triad) or FLOP/s (matmul), the median run."""
    low: float
    """The slowest run's rate."""
    high: float
    """The fastest run's rate."""
    runs: int
    size: int
    """Bytes per array (read, copy, triad) or the square matrix's side (matmul)."""
    dtype: str = "float32"

    @property
    def spread(self) -> float:
        """(high - low) / median: how noisy the runs were."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0


@dataclass
class SpecCheck(Record):
    """The probe against the GPU's datasheet (:mod:`attnprof.facts.gpu_specs`)."""

    part: str
    bandwidth_bytes_per_second: float
    flops_per_second: float
    source: str
    bandwidth_ratio: float | None = None
    """Probed / datasheet bandwidth (a healthy HBM part reaches about 0.8-0.93)."""
    flops_ratio: float | None = None
    """Probed / datasheet matmul FLOP/s in the probe's dtype (16-bit only; else null)."""


@dataclass
class MemoryProbe(Document):
    """What the probe measured on one device: memory bandwidth and a matmul peak."""

    KIND = "attnprof.probe"
    VERSION = (1, 0)

    device: str
    """cpu or cuda."""
    bandwidth_bytes_per_second: float
    """Peak memory bandwidth: the best run of the read-only stream (STREAM's "best rate"), the
    roof for decode attention, which reads the KV and writes almost nothing. Copy and triad
    are in ``kernels`` beside it; their bytes moved include writes, which overlap reads, so
    on a CPU they can exceed what any read stream reaches."""
    matmul_flops_per_second: float
    """The best square-GEMM run in the matmul kernel's dtype."""
    kernels: list[ProbeKernel] = field(default_factory=list)
    device_name: str | None = None
    threads: int | None = None
    seconds: float = 0.0
    """Wall time the probe took."""
    time: float = 0.0
    spec: SpecCheck | None = None
    note: str | None = None

    def kernel(self, name: str) -> ProbeKernel | None:
        """The kernel called ``name`` (read, copy, triad, matmul), None when absent."""
        return next((k for k in self.kernels if k.name == name), None)


@dataclass
class RooflinePoint(Record):
    """One phase (or one layer in a phase) of attention against the machine's roofs."""

    phase: str
    calls: int
    time_s: float
    flops: float
    bytes: float
    """Analytic bytes moved (Q, K, V read, O written)."""
    kv_bytes: float
    """The K and V part of ``bytes`` (what decode attention streams from memory)."""
    intensity_flops_per_byte: float | None
    achieved_flops_per_second: float | None
    achieved_bytes_per_second: float | None
    kv_bytes_per_second: float | None
    bandwidth_utilization: float | None
    """kv_bytes/s over the probed peak bandwidth (decode's headline)."""
    compute_utilization: float | None
    """FLOP/s over the measured matmul peak (prefill's headline)."""
    bound: str
    """memory or compute: which side of the ridge the intensity falls on."""
    layer: int | None = None
    site: str | None = None
    """The attention site's label when the layer index alone is ambiguous: ``encoder.L0``,
    ``decoder.L0``, ``decoder.L0.cross`` in encoder-decoder models, ``L0`` otherwise in
    ``attnprof profile`` (null: live, where ``layer`` is the site)."""


@dataclass
class Roofline(Record):
    """Every phase placed on the roofline of the probed machine."""

    peak_bandwidth_bytes_per_second: float
    peak_flops_per_second: float
    ridge_flops_per_byte: float
    phases: dict[str, RooflinePoint] = field(default_factory=dict)
    layers: list[RooflinePoint] = field(default_factory=list)
    """Per layer and phase (decode attention per layer)."""
    device: str = "cpu"
    note: str = ""
